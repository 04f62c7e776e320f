"""A :class:`~dask_dataservice.data.Dataset` as a ``torch.utils.data.IterableDataset``.

Leaves become ``torch.Tensor``: numpy arrays of a dtype torch has share their memory
(``torch.from_numpy``, no copy) when they are writable; read-only arrays (elements from the
data service are deserialized into read-only buffers) are copied, since torch tensors are
writable and must not write into memory that another object owns. Strings, bytes and object
arrays stay as they are (torch has no string tensors).

With ``torch.utils.data.DataLoader(..., num_workers=n)`` each loader process reads a share:
the splits ``i::n`` of a splittable pipeline (DYNAMIC-style, each split read once), else every
``n``-th element (``Dataset.shard``). A pipeline that reads from the data service is refused
there: the service already runs it in parallel on the data workers, and loader processes would
each need a Dask client of their own; read it with ``num_workers=0``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from .._bridge import convert_each
from ..data.formats import optional_import

torch: Any = optional_import("torch", "torch", "dask_dataservice.torch")

from ..data import Dataset  # noqa: E402 - after the optional import, which names the extra
from ..data._base import sources  # noqa: E402
from ..data.structure import map_structure  # noqa: E402

__all__ = ["IterableDataset", "ddp_split", "to_tensors"]


def ddp_split(remainder: str = "drop") -> dict[str, Any]:
    """This ``torch.distributed`` rank's equal split of a shared DYNAMIC job, as keyword
    arguments of ``dds.distribute`` / ``dds.from_dataset_id``: ``consumer_index`` (the rank),
    ``num_consumers`` (the world size) and ``equal`` (``"drop"`` or ``"pad"``), so every
    ``DistributedDataParallel`` rank takes the same number of steps per epoch::

        ds = dataset.apply(dds.distribute("distributed_epoch", client, job_name="train",
                                          **dds.torch.ddp_split()))

    Call it after ``torch.distributed.init_process_group``.
    """
    if remainder not in ("drop", "pad"):
        raise ValueError(f"remainder must be 'drop' or 'pad', got {remainder!r}")
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "dds.torch.ddp_split() reads the rank and world size of torch.distributed: call "
            "torch.distributed.init_process_group(...) first (or pass consumer_index, "
            "num_consumers and equal to dds.distribute yourself)")
    return {"consumer_index": int(dist.get_rank()), "num_consumers": int(dist.get_world_size()),
            "equal": remainder}


def _leaf(x: Any, pin: bool) -> Any:
    if isinstance(x, np.ndarray):
        if x.dtype.kind in "OUSV":  # strings, bytes, objects: no torch dtype
            return x
        if not x.flags.writeable or not x.flags.c_contiguous and not x.flags.f_contiguous:
            x = np.array(x)  # copy: writable (and contiguous) memory of our own
        if x.strides and min(x.strides) < 0:
            x = np.ascontiguousarray(x)
        t = torch.from_numpy(x)
    elif isinstance(x, (np.generic, bool, int, float, complex)):
        if isinstance(x, (np.str_, np.bytes_, np.object_)):
            return x
        t = torch.as_tensor(np.asarray(x))
    else:
        return x  # str, bytes, None, anything else: unchanged
    return t.pin_memory() if pin else t


def to_tensors(element: Any, pin_memory: bool = False) -> Any:
    """``element`` with its numeric leaves as ``torch.Tensor`` (same structure)."""
    return map_structure(lambda x: _leaf(x, pin_memory), element)


def _reads_service(dataset: Dataset) -> bool:
    return any(type(op).__name__ == "ServiceSource" for op in sources(dataset._op))


class IterableDataset(torch.utils.data.IterableDataset):  # type: ignore[misc]
    """``dataset`` for ``torch.utils.data.DataLoader``, with ``torch.Tensor`` leaves.

    Parameters
    ----------
    dataset
        Any :class:`~dask_dataservice.data.Dataset`, also one read from the data service.
    pin_memory
        Pin each tensor (page-locked memory, for fast copies to a GPU). Without an
        accelerator this warns once and does nothing, like ``DataLoader(pin_memory=True)``.

    Iterate it directly (``for batch in ds.to_torch()``) or hand it to a ``DataLoader``; use
    ``batch_size=None`` there when the pipeline batches already.
    """

    def __init__(self, dataset: Dataset, pin_memory: bool = False) -> None:
        if not isinstance(dataset, Dataset):
            raise TypeError(f"IterableDataset() takes a dask_dataservice Dataset, got "
                            f"{type(dataset).__name__}")
        if not isinstance(pin_memory, bool):
            raise TypeError(f"pin_memory must be a bool, got {type(pin_memory).__name__}")
        if pin_memory and not torch.cuda.is_available():
            warnings.warn("pin_memory=True but no accelerator is available: tensors are not "
                          "pinned", UserWarning, stacklevel=2)
            pin_memory = False
        self.dataset = dataset
        self.pin_memory = pin_memory

    def _share(self) -> Dataset | list[Any] | None:
        """This loader process's share, or None outside loader processes."""
        info = torch.utils.data.get_worker_info()
        if info is None or info.num_workers == 1:
            return None
        if _reads_service(self.dataset):
            raise RuntimeError(
                "dds.torch.IterableDataset: a dataset read from the data service cannot be "
                f"split between DataLoader worker processes (num_workers={info.num_workers}): "
                "the data service already runs the pipeline in parallel on the Dask workers; "
                "use DataLoader(..., num_workers=0)")
        if self.dataset.splittable:
            return list(self.dataset.splits()[info.id :: info.num_workers])
        return self.dataset.shard(info.num_workers, info.id)

    def __iter__(self) -> Iterator[Any]:
        share = self._share()
        if share is None:
            it: Any = self.dataset
        elif isinstance(share, Dataset):
            it = share
        else:
            it = self.dataset.iterate(share)
        return convert_each(it, lambda x: to_tensors(x, self.pin_memory))

    def __len__(self) -> int:
        return len(self.dataset)

    def __repr__(self) -> str:
        return f"dds.torch.IterableDataset({self.dataset!r}, pin_memory={self.pin_memory})"
