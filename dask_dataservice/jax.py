"""JAX bridge: ``Dataset.to_jax()`` yields elements with ``jax.Array`` leaves.

Each numeric leaf is put on a device with ``jax.device_put`` (the default device, or the
``device``/sharding given); strings and bytes stay as they are. Importing this module imports
jax (``pip install 'dask-dataservice[jax]'``); ``import dask_dataservice`` does not.

The same by hand, for a custom placement (for example a ``NamedSharding`` over a mesh)::

    for batch in dataset.as_numpy_iterator():
        batch = jax.device_put(batch, sharding)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ._bridge import convert_each
from .data.formats import optional_import

jax: Any = optional_import("jax", "jax", "Dataset.to_jax()")

from .data import Dataset  # noqa: E402 - after the optional import, which names the extra
from .data.structure import map_structure  # noqa: E402

__all__ = ["JaxIterable", "to_device"]


def to_device(element: Any, device: Any = None) -> Any:
    """``element`` with its numeric leaves put on ``device`` (a device or a sharding)."""
    def leaf(x: Any) -> Any:
        if isinstance(x, (np.ndarray, np.generic)) and x.dtype.kind not in "OUSV":
            return jax.device_put(x, device)
        if isinstance(x, (bool, int, float, complex)):
            return jax.device_put(np.asarray(x), device)
        return x
    return map_structure(leaf, element)


class JaxIterable:
    """Iterate ``dataset`` (any number of times) with leaves on a JAX device."""

    def __init__(self, dataset: Dataset, device: Any = None) -> None:
        if not isinstance(dataset, Dataset):
            raise TypeError(f"to_jax() takes a dask_dataservice Dataset, got {type(dataset).__name__}")
        self.dataset = dataset
        self.device = device

    def __iter__(self) -> Iterator[Any]:
        return convert_each(self.dataset, lambda x: to_device(x, self.device))

    def __repr__(self) -> str:
        return f"JaxIterable({self.dataset!r}, device={self.device!r})"
