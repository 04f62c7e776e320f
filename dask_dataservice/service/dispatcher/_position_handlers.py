"""The dispatcher's handler for input positions (issue 13; the format and its checks are
:mod:`..protocol._positions`): a tracking reader's first call checks its start position
against the dataset."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...errors import InputPositionError
from ..protocol._positions import POLICIES, check_position
from ..protocol._sharding import ShardingPolicy

if TYPE_CHECKING:
    from ._entities import Dataset

__all__ = ["position_handlers"]


def position_handlers(dataset_of: Callable[[int | str], Dataset]) -> dict[str, Callable[..., Any]]:
    """The dispatcher's handlers for input positions (registered by the dispatcher plugin;
    ``dataset_of``: a dataset by its numeric id or the id its user chose)."""
    from ..._rpc import handler

    @handler
    def check(dataset_id: int | str, processing_mode: str,
              start: dict[str, Any] | None = None) -> dict[str, Any]:
        """A tracking reader's first call: the dataset's fingerprint, and ``start`` checked
        against it."""
        dataset = dataset_of(dataset_id)
        mode = ShardingPolicy[processing_mode].name
        if mode not in POLICIES:
            raise InputPositionError(
                f"input positions are tracked for DYNAMIC and OFF jobs, not {mode}")
        if start is not None:
            start = check_position(start, dataset.fingerprint, mode)
            if mode == "DYNAMIC":
                n = dataset.num_splits
                too_far = [k for k in start["partial"] if int(k) >= n]
                if (start["done"] and start["done"][-1][1] > n) or too_far:
                    raise InputPositionError(
                        f"the input position names split indices beyond the dataset's "
                        f"{n} splits")
        return {"status": "OK", "fingerprint": dataset.fingerprint, "start": start}

    return {"dataservice_check_position": check}
