"""Checkpoint: save and restore variables and optimizer slots as a zarr group.

Layout of a checkpoint directory (a zarr v3 group)::

    zarr.json                         attributes: format, save_counter, and per variable its
                                      shape, dtype, shard row offsets and slot names
    variables/<name>/shard_<i>/value  one array per saved shard (written by its PS)
    variables/<name>/shard_<i>/slots/<optimizer>/<slot>

Each parameter server writes the shards it holds, all PSs in parallel; the coordinator
creates the groups first and writes the attributes last, so a checkpoint whose attributes
are there is complete. One array per shard keeps one writer per chunk (div shards differ by
a row, so one logical array would make two PSs share chunks). Because the row offsets are
stored, any row range can be read back: :meth:`Checkpoint.restore` works onto a different
number of parameter servers and shards than at save time (each new shard reads the pieces
of the saved shards that overlap its rows). A checkpoint that does not fit (a variable
missing, another shape or dtype) raises :class:`CheckpointMismatchError` naming the variable
and both shapes, before anything is changed.

Optimizer slots are saved per variable under the optimizer's name (its class name unless
given: never a creation-order counter). When the Checkpoint holds optimizers, every saved
slot group of a restored variable must belong to one of them by name, with the slots that
optimizer keeps; otherwise the restore raises :class:`CheckpointMismatchError` naming the
variable and the unmatched slots, before anything is changed (never a partial restore).
Without optimizers in the Checkpoint, slots are restored under their saved names.

A per-worker iterator in the Checkpoint (``Checkpoint(model=..., input=iterator)``) has its
position (elements handed out per training worker name) saved in the same attribute write
that completes the checkpoint, so variables and input position are saved atomically;
restoring repositions the iterator (see :mod:`.input_position`).
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import quote

import numpy as np
import zarr

from ..errors import CheckpointMismatchError
from . import _routing, _store
from ._runner_plugin import PerWorkerIterator
from ._types import Call
from .input_position import InputPositionError, positions, reposition
from .optimizers import Optimizer
from .variables import ShardedVariable, Variable

__all__ = ["Checkpoint"]

FORMAT = "dask_dataservice.ps.checkpoint/1"


def _flatten(objects: dict[str, Any], optimizers: list[Any] | None = None,
             inputs: dict[str, PerWorkerIterator] | None = None,
             optional: set[str] | None = None) -> dict[str, Variable | ShardedVariable]:
    """``{path: variable}`` of ``objects``; their optimizers are appended to ``optimizers``,
    their per-worker iterators added to ``inputs``, the paths of their ``iterations``
    (``<path>/iterations``: not in checkpoints written before they were saved) to
    ``optional``."""
    out: dict[str, Variable | ShardedVariable] = {}

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, Variable | ShardedVariable):
            out[prefix] = obj
        elif isinstance(obj, PerWorkerIterator):
            if inputs is not None:
                inputs[prefix] = obj
        elif isinstance(obj, Optimizer) or obj is None:
            if obj is not None and optimizers is not None:
                optimizers.append(obj)
            if obj is not None and isinstance(obj.iterations, Variable):
                out[f"{prefix}/iterations"] = obj.iterations  # Keras' optimizer.iterations
                if optional is not None:
                    optional.add(f"{prefix}/iterations")
            return  # slots are saved beside their variables
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(obj, list | tuple):
            for i, v in enumerate(obj):
                walk(f"{prefix}/{i}", v)
        elif hasattr(obj, "variables"):
            walk(prefix, list(obj.variables))
        else:
            raise TypeError(f"Checkpoint cannot save {prefix!r} of type {type(obj).__name__}")

    for name, obj in objects.items():
        walk(name, obj)
    return out


def _layout(var: Variable | ShardedVariable) -> tuple[list[Variable], list[int] | None]:
    if isinstance(var, ShardedVariable):
        return var.variables, var.offsets
    return [var], ([0, var.shape[0]] if var.shape else None)


def _group(name: str, i: int) -> str:
    return f"variables/{quote(name, safe='')}/shard_{i}"


class Checkpoint:
    """Groups variables under names: ``Checkpoint(model=..., emb=table, step=step_var)``.

    Values may be variables, sharded variables, dicts/lists of them, objects with a
    ``variables`` attribute, or optimizers (their slots are saved with the variables).
    """

    def __init__(self, **objects: Any) -> None:
        self._objects = objects
        #: Number of times :meth:`save` ran (restored from the checkpoint).
        self.save_counter = 0

    def save(self, path: str | os.PathLike[str]) -> str:
        """Write a checkpoint to directory ``path`` (replaced if it exists); returns the path."""
        path = os.fspath(path)
        inputs: dict[str, PerWorkerIterator] = {}
        variables = _flatten(self._objects, inputs=inputs)
        client = _client_of(variables)
        if inputs and client[0] is None:
            raise InputPositionError("a Checkpoint saves an input position together with "
                                     "variables on parameter servers: add them")
        store = _store.checkpoint_store(path)
        root = zarr.open_group(store, mode="w")
        meta: dict[str, dict[str, Any]] = {}
        per_ps: dict[str, list[Any]] = {}
        local: list[tuple[str, Variable]] = []
        for name, var in variables.items():
            shards, offsets = _layout(var)
            meta[name] = {"shape": list(var.shape), "dtype": np.dtype(var.dtype).str,
                          "offsets": offsets, "slots": {}}
            for i, v in enumerate(shards):
                group = _group(name, i)
                root.require_group(group)
                if v.ps_address is None:
                    local.append((group, v))
                else:
                    per_ps.setdefault(v.ps_address, []).append({"key": v.key, "group": group})
        for group, v in local:
            zarr.create_array(store, name=f"{group}/value", data=v.read_value(),
                              chunks=_store.chunk_shape(v.shape), overwrite=True, compressors=None)
        replies = _routing.call_many(
            [Call(a, "ps_save", {"path": path, "items": items}) for a, items in per_ps.items()],
            *client)
        slot_names: dict[str, dict[str, Any]] = {}
        for reply in replies:
            slot_names.update(reply["slots"])
        for name, var in variables.items():
            shards, _ = _layout(var)
            merged: dict[str, set[Any]] = {}
            for i in range(len(shards)):
                for opt, names in slot_names.get(_group(name, i), {}).items():
                    merged.setdefault(opt, set()).update(names)
            meta[name]["slots"] = {o: sorted(n) for o, n in merged.items()}
        # read after every shard is written, saved in the same (last) write as the rest
        where = {name: positions(client[0], it) for name, it in inputs.items()}
        self.save_counter += 1
        # ONE write of zarr.json (zarr writes it atomically): attrs.update() would write it
        # once per key, and a reader could see "format" (complete) before "variables"
        root.attrs.put({"format": FORMAT, "save_counter": self.save_counter, "variables": meta,
                        "inputs": where})
        return path

    write = save

    def restore(self, path: str | os.PathLike[str]) -> Checkpoint:
        """Load every variable of this Checkpoint from ``path`` (any sharding at save time)."""
        path = os.fspath(path)
        try:
            root = zarr.open_group(_store.checkpoint_store(path, read_only=True), mode="r")
            attrs: dict[str, Any] = dict(root.attrs)
        except (FileNotFoundError, zarr.errors.NodeNotFoundError) as e:
            raise FileNotFoundError(f"no checkpoint at {path}") from e
        if attrs.get("format") != FORMAT:
            raise CheckpointMismatchError(
                f"{path} is not a complete dask_dataservice checkpoint (format "
                f"{attrs.get('format')!r}, expected {FORMAT!r})")
        saved = attrs["variables"]
        optimizers: list[Optimizer] = []
        inputs: dict[str, PerWorkerIterator] = {}
        optional: set[str] = set()
        variables = _flatten(self._objects, optimizers, inputs, optional)
        # an optimizer's step count is restored when the checkpoint has it (older ones do not)
        variables = {k: v for k, v in variables.items() if k in saved or k not in optional}
        saved_inputs = attrs.get("inputs") or {}
        for name in inputs:
            if name not in saved_inputs:
                raise CheckpointMismatchError(
                    f"input {name!r} has no saved position in checkpoint {path}; it holds "
                    f"positions of {sorted(saved_inputs)}")
        # Validate everything before changing anything.
        for name, var in variables.items():
            if name not in saved:
                raise CheckpointMismatchError(
                    f"variable {name!r} (shape {tuple(var.shape)}) is not in checkpoint {path}; "
                    f"it holds {sorted(saved)}")
            s = saved[name]
            if tuple(s["shape"]) != tuple(var.shape):
                raise CheckpointMismatchError(
                    f"variable {name!r} has shape {tuple(var.shape)} but checkpoint {path} "
                    f"saved it with shape {tuple(s['shape'])}")
            if np.dtype(s["dtype"]) != np.dtype(var.dtype):
                raise CheckpointMismatchError(
                    f"variable {name!r} has dtype {np.dtype(var.dtype)} but checkpoint {path} "
                    f"saved it with dtype {np.dtype(s['dtype'])}")
            if optimizers:
                _match_slots(name, s.get("slots") or {}, optimizers, path)
        client = _client_of(variables)
        calls = []
        for name, var in variables.items():
            s = saved[name]
            shards, offsets = _layout(var)
            old = s["offsets"]
            for i, v in enumerate(shards):
                if offsets is None or old is None:
                    pieces = [(_group(name, 0), 0, 0, 0)]
                else:
                    a, b = offsets[i], offsets[i + 1]
                    pieces = []
                    for j, (sa, sb) in enumerate(zip(old, old[1:], strict=False)):
                        lo, hi = max(a, sa), min(b, sb)
                        if lo < hi:
                            pieces.append((_group(name, j), lo - sa, hi - sa, lo - a))
                if v.ps_address is None:
                    _restore_local(path, v, pieces)
                else:
                    calls.append(Call(v.ps_address, "ps_restore",
                                      {"path": path, "key": v.key, "pieces": pieces,
                                       "slots": s.get("slots") or {}}))
        _routing.call_many(calls, *client)
        for name, it in inputs.items():
            reposition(it, {str(k): v if isinstance(v, dict) else int(v)  # dict: data service
                            for k, v in saved_inputs[name].items()})
        self.save_counter = int(attrs.get("save_counter", 0))
        return self

    read = restore

    def __repr__(self) -> str:
        return f"<dds.Checkpoint {sorted(self._objects)} save_counter={self.save_counter}>"


def _match_slots(name: str, saved: dict[str, Any], optimizers: list[Optimizer], path: str) -> None:
    """CheckpointMismatchError unless each saved slot group of variable ``name`` belongs to
    one of ``optimizers`` (by name) and holds the slots that optimizer keeps."""
    by_name = {o.name: o for o in optimizers}
    for key, slots in saved.items():
        opt = by_name.get(key)
        if opt is None:
            raise CheckpointMismatchError(
                f"checkpoint {path} holds slots {sorted(slots)} of optimizer {key!r} for "
                f"variable {name!r}, but this Checkpoint's optimizers are named "
                f"{sorted(by_name)}: give the optimizer the name it had when saved "
                f"(name={key!r}) so its slots are restored")
        if set(slots) != set(opt.slot_names):
            raise CheckpointMismatchError(
                f"checkpoint {path} holds slots {sorted(slots)} of optimizer {key!r} for "
                f"variable {name!r}, but {opt!r} keeps slots {sorted(opt.slot_names)}")


def _client_of(variables: dict[str, Any]) -> tuple[Any, ...]:
    """``(client, strategy id)`` of the first remote variable (``(None, None)``: all local)."""
    for var in variables.values():
        for v in var.variables:
            if v.ps_address is not None:
                return v._client_uid()  # type: ignore[no-any-return]
    return None, None


def _restore_local(path: str, v: Variable, pieces: list[Any]) -> None:
    value = np.empty(v.shape, dtype=v.dtype)
    _store.read_pieces(_store.checkpoint_store(path, read_only=True), pieces, "value", value)
    v.assign(value)
