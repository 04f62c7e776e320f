"""zarr I/O of parameter servers and checkpoints (blocking: call from an I/O thread).

- A shard's backing array ``values/<key>`` and its slots ``slots/<key>/<optimizer>/<slot>``
  in a parameter server's store (:func:`create_backing`, :func:`write_shard`, :func:`reload`).
- Checkpoint groups ``<group>/value`` and ``<group>/slots/<optimizer>/<slot>``
  (:func:`write_checkpoint`), read back by row ranges (:func:`read_pieces`, used by the
  parameter server and by local variables alike).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast
from urllib.parse import quote, unquote

import numpy as np
import zarr
from zarr.storage import FsspecStore, LocalStore, StoreLike

from ..errors import CheckpointCorruptedError
from ._shard import Lane, Shard

__all__ = ["checkpoint_store", "chunk_shape", "create_backing", "read_checkpoint", "read_pieces", "reload",
           "write_checkpoint", "write_shard", "zarr_name"]


def checkpoint_store(path: str, read_only: bool = False) -> LocalStore | FsspecStore:
    """The zarr store of the checkpoint at ``path``: a local directory (a path, or a
    ``file://`` URL), else zarr's :class:`~zarr.storage.FsspecStore` of the URL
    (``s3://bucket/ckpt-3``, ``memory://...``: any fsspec filesystem).

    Raises
    ------
    ValueError
        If the URL's filesystem is unknown or its package is not installed.
    """
    if "://" not in path:
        return LocalStore(path, read_only=read_only)
    protocol, rest = path.split("://", 1)
    if protocol in ("file", "local"):
        return LocalStore(rest, read_only=read_only)
    try:
        return FsspecStore.from_url(path, read_only=read_only)
    except ImportError as e:
        raise ValueError(f"checkpoint {path}: the filesystem of {protocol}:// is not installed "
                         f"({e})") from e


def zarr_name(key: str) -> str:
    return quote(key, safe="")


def chunk_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A zarr chunk shape for arrays of ``shape``: zarr refuses a chunk length of 0, which a
    variable without rows (or of width 0) would otherwise ask for."""
    return tuple(max(1, int(d)) for d in shape)


def create_backing(store: StoreLike, shard: Shard, chunk_bytes: int) -> None:
    value = shard.value
    rows = value.shape[0] if value.ndim else 1
    row_bytes = max(1, value[:1].nbytes if value.ndim else value.nbytes)
    chunk_rows = max(1, min(rows, chunk_bytes // row_bytes))
    chunks = chunk_shape((chunk_rows, *value.shape[1:])) if value.ndim else ()
    shard.backing = zarr.create_array(
        store, name=f"values/{zarr_name(shard.key)}", shape=value.shape,
        chunks=chunks, dtype=value.dtype, fill_value=0, overwrite=True,
        attributes={"key": shard.key, "offset": shard.offset}, compressors=None)


def write_shard(store: StoreLike, shard: Shard, value: np.ndarray, slots: dict[str, Any], chunk_bytes: int) -> None:
    """Write a snapshot of ``shard`` (taken on its lane) to its backing array and slots."""
    if shard.backing is None:
        create_backing(store, shard, chunk_bytes)
    assert shard.backing is not None
    shard.backing[...] = value
    for opt, d in slots.items():
        for name, arr in d.items():
            zarr.create_array(store, name=f"slots/{zarr_name(shard.key)}/{zarr_name(opt)}/{name}",
                              data=arr, overwrite=True, compressors=None)


def reload(store: StoreLike, lane_for: Callable[[], Lane]) -> list[Shard]:
    """The shards a previous run of a parameter server flushed to ``store``."""
    try:
        root = zarr.open_group(store, mode="r")
    except (FileNotFoundError, zarr.errors.NodeNotFoundError):
        return []
    if "values" not in root:
        return []
    shards = []
    values = root["values"]
    assert isinstance(values, zarr.Group)
    for name, arr in values.arrays():
        shard = Shard(unquote(name), np.array(arr[...], order="C"),
                      int(cast(int, arr.attrs.get("offset", 0))), lane_for())
        shard.backing = zarr.open_array(store, path=f"values/{name}", mode="r+")
        shard.dirty = False
        slots_root = root["slots"] if "slots" in root else None
        if isinstance(slots_root, zarr.Group) and name in slots_root:
            shard_slots = slots_root[name]
            assert isinstance(shard_slots, zarr.Group)
            for oname, ogroup in shard_slots.groups():
                shard.slots[unquote(oname)] = {
                    sname: np.array(sarr[...]) for sname, sarr in ogroup.arrays()}
        shards.append(shard)
    return shards


def write_checkpoint(path: str, snaps: list[Any]) -> dict[str, Any]:
    """Write ``[(group, value, slots)]`` into the checkpoint at ``path``; the slot names."""
    store = checkpoint_store(path)
    slot_names: dict[str, dict[str, list[str]]] = {}
    for group, value, slots in snaps:
        zarr.create_array(store, name=f"{group}/value", data=value,
                          chunks=chunk_shape(value.shape), overwrite=True, compressors=None)
        slot_names[group] = {}
        for opt, d in slots.items():
            slot_names[group][opt] = sorted(d)
            for name, arr in d.items():
                zarr.create_array(store, name=f"{group}/slots/{zarr_name(opt)}/{name}",
                                  data=arr, chunks=chunk_shape(arr.shape), overwrite=True,
                                  compressors=None)
    return slot_names


def read_pieces(store: StoreLike, pieces: list[Any], path: str, out: np.ndarray) -> bool:
    """Fill ``out`` from saved shards: ``pieces`` is ``[(group, start, stop, dst)]`` row ranges
    of the arrays ``<group>/<path>``. Rank-0 values (and per-shard scalars such as Adam's
    step count, whose shape has no rows) come from the first piece. False if none exists.

    A saved array that cannot be read (a truncated chunk or metadata file), or whose shape
    does not fit ``out``, is a :class:`CheckpointCorruptedError` naming the file and the
    variable, never numpy's own error."""
    found = False
    for group, start, stop, dst in pieces:
        name = f"{group}/{path}"
        try:
            arr = _open(store, name)
        except (FileNotFoundError, zarr.errors.NodeNotFoundError):
            continue
        if out.ndim == 0 or arr.ndim == 0:
            if arr.shape != out.shape:
                raise _corrupted(store, name, f"it has shape {arr.shape}, expected {out.shape}")
            if not found:
                out[...] = _read(store, name, arr, ...)
                found = True
            continue
        if arr.shape[1:] != out.shape[1:] or arr.shape[0] < stop:
            raise _corrupted(store, name, f"it has shape {arr.shape}, expected rows of shape "
                             f"{out.shape[1:]} and at least {stop} of them")
        out[dst:dst + stop - start] = _read(store, name, arr, slice(start, stop))
        found = True
    return found


def _open(store: StoreLike, name: str) -> Any:
    try:
        return zarr.open_array(store, path=name, mode="r")
    except (FileNotFoundError, zarr.errors.NodeNotFoundError):
        raise
    except Exception as e:  # noqa: BLE001 - a damaged zarr.json fails in many ways
        raise _corrupted(store, f"{name}/zarr.json", f"{type(e).__name__}: {e}") from e


def _read(store: StoreLike, name: str, arr: Any, index: Any) -> np.ndarray:
    try:
        return np.asarray(arr[index])
    except Exception as e:  # noqa: BLE001 - a truncated chunk fails inside zarr or numpy
        # a checkpoint array is one chunk (its file: c/0/0 for rank 2)
        chunk = "/".join(["c", *["0"] * arr.ndim]) if arr.nchunks == 1 else "c/..."
        raise _corrupted(store, f"{name}/{chunk}", f"{type(e).__name__}: {e}") from e


def _corrupted(store: StoreLike, name: str, why: str) -> CheckpointCorruptedError:
    """The error for a damaged file ``name`` (``variables/<variable>/shard_<i>/...``)."""
    parts = name.split("/")
    variable = unquote(parts[1]) if len(parts) > 2 and parts[0] == "variables" else "?"
    root = getattr(store, "root", None)
    where = f"{root}/{name}" if root is not None else name
    return CheckpointCorruptedError(
        f"checkpoint file {where} (variable {variable!r}, {parts[2] if len(parts) > 2 else ''}) "
        f"is damaged and cannot be read: {why}")


def _slot_shape(store: StoreLike, pieces: list[Any], path: str,
                shape: tuple[Any, ...]) -> tuple[tuple[int, ...], Any] | None:
    """``(shape, dtype)`` of the slot ``path`` of a shard of ``shape``: the shard's shape, or
    rank 0 (Adam's step count); None if no saved shard has it."""
    for group, *_ in pieces:
        name = f"{group}/{path}"
        try:
            arr = _open(store, name)
        except (FileNotFoundError, zarr.errors.NodeNotFoundError):
            continue
        if arr.ndim == 0:
            return (), arr.dtype
        if not shape or arr.shape[1:] != shape[1:]:
            raise _corrupted(store, name, f"this slot has shape {arr.shape}, which does not "
                             f"fit the variable's shard of shape {shape}")
        return shape, arr.dtype
    return None


def read_checkpoint(path: str, pieces: list[Any], shape: tuple[Any, ...], dtype: Any,
                    slots: dict[str, Any]) -> tuple[np.ndarray, dict[str, dict[str, np.ndarray]]]:
    """The value (and the ``{optimizer: [slot names]}`` slots) of one shard from a checkpoint."""
    store = checkpoint_store(path, read_only=True)
    value = np.empty(shape, dtype=dtype)
    read_pieces(store, pieces, "value", value)
    slot_values: dict[str, dict[str, np.ndarray]] = {}
    for opt, names in slots.items():
        for name in names:
            spath = f"slots/{zarr_name(opt)}/{name}"
            found = _slot_shape(store, pieces, spath, tuple(shape))
            if found is None:
                continue
            out = np.zeros(*found)
            read_pieces(store, pieces, spath, out)
            slot_values.setdefault(opt, {})[name] = out
    return value, slot_values
