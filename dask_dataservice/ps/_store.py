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
from zarr.storage import LocalStore, StoreLike

from ._shard import Lane, Shard

__all__ = ["create_backing", "read_checkpoint", "read_pieces", "reload", "write_checkpoint",
           "write_shard", "zarr_name"]


def zarr_name(key: str) -> str:
    return quote(key, safe="")


def create_backing(store: StoreLike, shard: Shard, chunk_bytes: int) -> None:
    value = shard.value
    rows = value.shape[0] if value.ndim else 1
    row_bytes = max(1, value[:1].nbytes if value.ndim else value.nbytes)
    chunk_rows = max(1, min(rows, chunk_bytes // row_bytes))
    chunks = (chunk_rows, *value.shape[1:]) if value.ndim else ()
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
    store = LocalStore(path)
    slot_names: dict[str, dict[str, list[str]]] = {}
    for group, value, slots in snaps:
        zarr.create_array(store, name=f"{group}/value", data=value, chunks=value.shape,
                          overwrite=True, compressors=None)
        slot_names[group] = {}
        for opt, d in slots.items():
            slot_names[group][opt] = sorted(d)
            for name, arr in d.items():
                zarr.create_array(store, name=f"{group}/slots/{zarr_name(opt)}/{name}",
                                  data=arr, chunks=arr.shape, overwrite=True, compressors=None)
    return slot_names


def read_pieces(store: StoreLike, pieces: list[Any], path: str, out: np.ndarray) -> bool:
    """Fill ``out`` from saved shards: ``pieces`` is ``[(group, start, stop, dst)]`` row ranges
    of the arrays ``<group>/<path>``. Rank-0 values (and per-shard scalars such as Adam's
    step count, whose shape has no rows) come from the first piece. False if none exists."""
    found = False
    for group, start, stop, dst in pieces:
        try:
            arr = zarr.open_array(store, path=f"{group}/{path}", mode="r")
        except (FileNotFoundError, zarr.errors.NodeNotFoundError):
            continue
        if out.ndim == 0 or arr.ndim == 0 or arr.shape[1:] != out.shape[1:]:
            if not found:
                out[...] = arr[...]
                found = True
            continue
        out[dst:dst + stop - start] = arr[start:stop]
        found = True
    return found


def _slot_shape(store: StoreLike, pieces: list[Any], path: str,
                shape: tuple[Any, ...]) -> tuple[tuple[int, ...], Any] | None:
    for group, *_ in pieces:
        try:
            arr = zarr.open_array(store, path=f"{group}/{path}", mode="r")
        except (FileNotFoundError, zarr.errors.NodeNotFoundError):
            continue
        if arr.ndim == 0 or not shape or arr.shape[1:] != shape[1:]:
            return arr.shape, arr.dtype
        return shape, arr.dtype
    return None


def read_checkpoint(path: str, pieces: list[Any], shape: tuple[Any, ...], dtype: Any,
                    slots: dict[str, Any]) -> tuple[np.ndarray, dict[str, dict[str, np.ndarray]]]:
    """The value (and the ``{optimizer: [slot names]}`` slots) of one shard from a checkpoint."""
    store = LocalStore(path, read_only=True)
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
