"""The dispatcher's handler for what a dataset's registration said of it: a reader that did
not register the dataset (``from_dataset_id``) asks it once, lazily, for ``cardinality()``.

O(1) (a dict lookup by credential). The dataset is found by its credential, the id
``register_dataset`` answered: only whoever holds the secret learns anything of it, and an
unknown or collected id is the same ``DatasetNotFoundError`` as for reading it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._entities import Dataset

__all__ = ["metadata_handlers"]

#: The registration metadata a reader is told (the rest is the dispatcher's own: locality
#: hints, published names).
READER_FIELDS = ("cardinality", "count_preserving")


def metadata_handlers(dataset_of: Callable[[int | str], Dataset]) -> dict[str, Callable[..., Any]]:
    """The dispatcher's handlers for dataset metadata (registered by the dispatcher plugin;
    ``dataset_of``: a dataset by its credential)."""
    from ..._rpc import handler

    @handler
    def dataset_metadata(dataset_id: int | str) -> dict[str, Any]:
        """``cardinality`` (the registered pipeline's own) and ``count_preserving`` (whether
        every op above its source keeps one element per element); None for a field the
        registration did not send (a dataset journaled by an older version)."""
        metadata = dataset_of(dataset_id).metadata or {}
        return {"status": "OK", **{name: metadata.get(name) for name in READER_FIELDS}}

    return {"dataservice_dataset_metadata": dataset_metadata}
