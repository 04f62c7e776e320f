"""ParameterServerPlugin: variable shards on a Dask worker with the ``ps`` resource.

Theory of operation
-------------------
A parameter server (PS) is an ordinary Dask worker with this plugin. It holds *shards*
(:class:`~._shard.Shard`): one per variable, or one per partition of a partitioned variable,
each under a key the strategy chose (``"<strategy>/<n>/<name>"`` or ``".../<name>/part_<i>"``).

- **Live values are numpy.** Each shard's working copy is an ndarray, updated in place
  (zarr random-row gather and scatter are 13x and 190x slower than numpy).
- **Each shard has a serial lane** (:class:`~._shard.Lane`). Handlers validate a request on
  the event loop, then run the shard's work on its lane: inline when the work is small
  (under ``dataservice.ps.offload-bytes``) and the lane is idle, else on the plugin's compute
  threads. Work on one shard never interleaves; different shards run in parallel; the loop
  never runs numpy on a large array. Replies still follow requests in order on each comm
  (a Dask server answers one comm's messages one after the other), so a worker reads its own
  writes.
- **zarr is the backing store.** Every shard has a zarr array of the same shape in the
  plugin's store: a ``MemoryStore`` by default, a ``LocalStore`` under
  ``dataservice.ps.work-dir/<worker name>`` when configured. :meth:`flush` snapshots shards on
  their lanes and writes them on the one I/O thread; a PS that starts with a work_dir that
  holds shards reloads them. Unpickling and calling user initializers also run on the I/O
  thread.
- **Exactly-once updates.** An update sent from a scheduled function carries the function's
  id and a sequence number (1, 2, ... per function run). A shard remembers the highest
  sequence it applied per function and ignores anything at or below it, so a function
  re-run after its worker died does not apply the updates its first run already landed.
  The coordinator tells the PSs to forget finished functions (``ps_forget``): the PS keeps
  the bound, per coordinator, and drops any later update of a function below it (a worker
  that was frozen, declared lost, and woke up after its functions re-ran elsewhere).
- **Replies are dicts** (see :mod:`._types`); arrays travel as ``to_serialize`` frames;
  expected errors travel as ``error_message(e)`` values (:func:`dask_dataservice._rpc.handler`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import cloudpickle
import numpy as np
from distributed.comm.addressing import get_address_host, parse_address
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol.serialize import to_serialize
from distributed.utils import run_in_executor_with_context
from zarr.storage import LocalStore, MemoryStore

from .. import config
from .._async import owned_executor, shutdown_executor
from .._rpc import error_message, handler
from ..errors import ShapeMismatchError, VariableNotFoundError
from . import _kernels, _store
from ._channel import BATCH_OP
from ._dashboard_hooks import count_shard_op
from ._fastpath import FastServer
from ._shard import Lane, Shard
from ._types import SCATTER_KINDS, UPDATE_KINDS, CreateReply, UpdateReply, ValueReply, unwire

if TYPE_CHECKING:
    from distributed import Worker

logger = logging.getLogger(__name__)

PLUGIN_NAME = "dataservice-ps"

#: Every request handler this plugin installs: op name -> method name.
HANDLERS = {
    "ps_create": "create",
    "ps_delete": "delete",
    "ps_info": "info",
    "ps_read": "read",
    "ps_update": "update",
    "ps_gather": "gather",
    "ps_scatter": "scatter",
    "ps_apply": "apply",
    "ps_flush": "flush",
    "ps_forget": "forget",
    "ps_save": "save",
    "ps_restore": "restore",
    "ps_read_slots": "read_slots",
    "ps_batch": "batch",
    "ps_gather_parts": "gather_parts",
    "ps_apply_parts": "apply_parts",
    "ps_fast_port": "fast_port",
}

#: Requests a ``ps_batch`` message may carry: op name -> method name.
BATCHABLE = {op: HANDLERS[op] for op in ("ps_read", "ps_gather", "ps_update", "ps_scatter",
                                          "ps_apply", "ps_gather_parts", "ps_apply_parts")}


#: Arrays of the gradient's size an optimizer step reads and writes (value + slots).
_ARRAYS_TOUCHED = {"sgd": 2, "adagrad": 2, "adam": 3}


def _lane_of(shard: Shard) -> Lane:
    """The lane of a shard of this server (every shard it holds got one)."""
    assert shard.lane is not None, shard.key
    return shard.lane


def _check_ids(shard: Shard, ids: Any) -> np.ndarray:
    ids = np.asarray(unwire(ids))
    if ids.dtype.kind not in "iu":
        raise TypeError(f"ids must be integers, got dtype {ids.dtype} (variable {shard.key!r})")
    ids = ids.reshape(-1)
    rows = shard.rows
    if ids.size and (ids.min() < 0 or ids.max() >= rows):
        bad = ids[(ids < 0) | (ids >= rows)][0]
        raise IndexError(f"id {int(bad)} is out of range [0, {rows}) for shard {shard.key!r}")
    return ids  # type: ignore[no-any-return]


def _as_value(shard: Shard, value: Any, shape: tuple[Any, ...] | None = None) -> np.ndarray:
    arr = _kernels.cast_value(unwire(value), shard.value.dtype, f"variable {shard.key!r}")
    want = shard.value.shape if shape is None else shape
    if arr.shape != want:
        try:
            arr = np.broadcast_to(arr, want)
        except ValueError:
            raise ShapeMismatchError(
                f"shape {arr.shape} does not fit shard {shard.key!r} of shape {want}") from None
    return arr


def _check_kind(kind: str, kinds: tuple[Any, ...]) -> None:
    if kind not in kinds:
        raise ValueError(f"unknown update kind {kind!r}; expected one of {kinds}")


class ParameterServerPlugin(WorkerPlugin):
    """Holds variable shards on a parameter-server worker (see the module docstring).

    Installed on every worker by :class:`~dask_dataservice.ParameterServerStrategy`; it only
    serves on workers with the ``dataservice.ps.resource`` resource (others answer that they
    are not parameter servers).
    """

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, work_dir: str | None = None) -> None:
        #: Overrides ``dataservice.ps.work-dir`` when given.
        self.work_dir = work_dir
        self.store_path: str | None = None
        self._store: LocalStore | MemoryStore | None = None

    # -- lifecycle -----------------------------------------------------------------------
    async def setup(self, worker: Worker) -> None:
        self.worker = worker
        self.shards: dict[str, Shard] = {}
        resource = config.get("ps.resource")
        self.is_ps = bool(worker.state.total_resources.get(resource))
        self._io = owned_executor("dds-ps-io", 1)
        self._compute = owned_executor("dds-ps-compute", int(config.get("ps.compute-threads")))
        self._offload_bytes = config.get_bytes("ps.offload-bytes")
        self._chunk_bytes = config.get_bytes("ps.chunk-bytes")
        #: Counters for tests and dashboards (``offloaded``: lane jobs run on a thread;
        #: ``batches``: ``ps_batch`` messages, several requests each).
        self.stats = {"updates": 0, "skipped": 0, "gathers": 0, "flushes": 0, "offloaded": 0,
                      "batches": 0}
        #: ``{coordinator's id base: bound}``: every function id in ``[base, bound)`` finished.
        self.finished: dict[int, int] = {}
        work_dir = self.work_dir or config.get("ps.work-dir")
        if work_dir and self.is_ps:
            self.store_path = os.path.join(work_dir, _store.zarr_name(str(worker.name)))
            self._store = LocalStore(self.store_path)
        else:
            self.store_path = None
            self._store = MemoryStore()
        for op, method in HANDLERS.items():
            worker.handlers[op] = getattr(self, method)
        worker.extensions[PLUGIN_NAME] = self
        self._fast: FastServer | None = None
        if self.is_ps and config.get("ps.fast-path") \
                and parse_address(worker.address)[0] == "tcp":
            self._fast = FastServer(self._fast_handler)
            await self._fast.start(get_address_host(worker.address))
        if self.store_path is not None and os.path.isdir(self.store_path):
            shards = await run_in_executor_with_context(self._io, _store.reload, self._store,
                                                        self._lane)
            self.shards.update((s.key, s) for s in shards)
            logger.info("parameter server %s reloaded %d shards from %s", worker.address,
                        len(shards), self.store_path)

    async def teardown(self, worker: Worker) -> None:
        if self.store_path is not None and self.shards:
            try:
                await self._flush(list(self.shards))
            except Exception:  # noqa: BLE001 - best effort on the way down
                logger.exception("flushing parameter-server shards at teardown failed")
        for op in HANDLERS:
            worker.handlers.pop(op, None)
        worker.extensions.pop(PLUGIN_NAME, None)
        if self._fast is not None:
            await self._fast.stop()
        for shard in self.shards.values():
            _lane_of(shard).close()
        shutdown_executor(self._compute)
        shutdown_executor(self._io)

    def _lane(self) -> Lane:
        return Lane(self._compute)

    def _shard(self, key: str) -> Shard:
        try:
            return self.shards[key]
        except KeyError:
            if not self.is_ps:
                raise VariableNotFoundError(
                    f"worker {self.worker.address} is not a parameter server (it lacks the "
                    f"{config.get('ps.resource')!r} resource)") from None
            raise VariableNotFoundError(
                f"parameter server {self.worker.address} holds no shard {key!r}") from None

    async def _on_lane[T](self, shard: Shard, nbytes: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on ``shard``'s lane: inline if small and the lane is idle, else on a
        compute thread after the work queued before it."""
        lane = _lane_of(shard)
        count_shard_op(self, shard.key, fn)  # issue 14: per-shard rates on the dashboard
        if nbytes < self._offload_bytes and lane.idle:
            return fn(*args)
        self.stats["offloaded"] += 1
        return await asyncio.wrap_future(lane.submit(fn, *args))

    @property
    def busy(self) -> bool:
        """Any shard has work queued or running (cleanup checks use it)."""
        return any(_lane_of(s).pending for s in self.shards.values())

    # -- creation ------------------------------------------------------------------------
    @handler
    async def create(self, key: str, shape: Sequence[int] | None = None, dtype: Any = None,
                     value: Any = None, init: bytes | None = None, offset: int = 0,
                     full_shape: Sequence[int] | None = None,
                     exist_ok: bool = False) -> CreateReply:
        """Create shard ``key`` from ``value`` or by calling the pickled ``init`` here (on the
        I/O thread; see :func:`._kernels.initial_value` for the calling conventions)."""
        if not self.is_ps:
            self._shard(key)  # raises "not a parameter server"
        if key in self.shards:
            if exist_ok:
                return {"status": "OK", "sliced": False, "existed": True}
            raise ValueError(f"parameter server {self.worker.address} already holds {key!r}")
        sliced = False
        if init is not None:
            assert shape is not None  # an initializer comes with its shape
            value, sliced = await run_in_executor_with_context(
                self._io, _call_initializer, init, tuple(shape), dtype, int(offset),
                tuple(full_shape) if full_shape is not None else None)
        arr = np.array(_kernels.cast_value(unwire(value), dtype, f"variable {key!r}"),
                       copy=True, order="C")
        if shape is not None and arr.shape != tuple(shape):
            raise ShapeMismatchError(
                f"initial value of {key!r} has shape {arr.shape}, expected {tuple(shape)}")
        shard = Shard(key, arr, int(offset), self._lane())
        self.shards[key] = shard
        await run_in_executor_with_context(self._io, _store.create_backing, self._store, shard,
                                           self._chunk_bytes)
        return {"status": "OK", "sliced": sliced, "existed": False}

    def delete(self, key: str) -> dict[str, Any]:
        shard = self.shards.pop(key, None)
        if shard is not None:
            _lane_of(shard).close()
        return {"status": "OK", "deleted": shard is not None}

    def info(self) -> dict[str, Any]:
        """What this PS holds: ``{key: {"shape", "dtype", "offset", "slots"}}``."""
        return {"status": "OK", "is_ps": self.is_ps, "store": self.store_path,
                "stats": dict(self.stats),
                "shards": {k: {"shape": list(s.value.shape), "dtype": str(s.value.dtype),
                               "offset": s.offset,
                               "slots": {o: sorted(d) for o, d in s.slots.items()}}
                           for k, s in self.shards.items()}}

    # -- reads ---------------------------------------------------------------------------
    @handler
    async def read(self, key: str) -> ValueReply:
        shard = self._shard(key)
        # Zero-copy: the reply sends the live buffer and the next update copies first.
        return {"status": "OK", "value": to_serialize(await self._on_lane(shard, 0, shard.read))}

    @handler
    async def gather(self, key: str, ids: Any) -> ValueReply:
        """Rows ``ids`` (shard-local, any order, duplicates allowed) of shard ``key``."""
        shard = self._shard(key)
        ids = _check_ids(shard, ids)
        nbytes = ids.size * (shard.value[:1].nbytes if shard.value.ndim else 0)
        out = await self._on_lane(shard, nbytes, shard.gather, ids)
        self.stats["gathers"] += 1
        return {"status": "OK", "value": to_serialize(out)}

    def _parts(self, keys: Sequence[str], counts: Sequence[int], ids: Any) -> list[Any]:
        """``[(shard, start, stop, shard-local ids)]`` of a request on several shards of this
        server: ``ids`` holds ``counts[i]`` ids of ``keys[i]``, one shard after the other."""
        if len(keys) != len(counts):
            raise ValueError(f"{len(keys)} keys but {len(counts)} counts")
        ids = np.asarray(unwire(ids)).reshape(-1)
        if sum(int(c) for c in counts) != ids.size or any(int(c) < 0 for c in counts):
            raise ValueError(f"counts {list(counts)} do not add up to the {ids.size} ids")
        parts, start = [], 0
        for key, count in zip(keys, counts, strict=True):
            shard = self._shard(key)
            stop = start + int(count)
            parts.append((shard, start, stop, _check_ids(shard, ids[start:stop])))
            start = stop
        return parts

    @handler
    async def gather_parts(self, keys: Sequence[str], counts: Sequence[int], ids: Any) -> ValueReply:
        """Rows of several shards of this server in one reply: ``ids`` holds ``counts[i]``
        shard-local ids of shard ``keys[i]``; the rows come back in the same order."""
        parts = self._parts(keys, counts, ids)
        first = parts[0][0].value if parts else None
        if first is None or first.ndim == 0:
            raise ValueError("ps_gather_parts needs at least one shard with rows")
        out = np.empty((parts[-1][2], *first.shape[1:]), dtype=first.dtype)
        for shard, a, b, local in parts:
            if shard.value.shape[1:] != first.shape[1:] or shard.value.dtype != first.dtype:
                raise ShapeMismatchError(f"shards {parts[0][0].key!r} and {shard.key!r} differ "
                                         "in row shape or dtype")
            await self._on_lane(shard, out[a:b].nbytes, shard.gather_into, local, out[a:b])
            self.stats["gathers"] += 1
        return {"status": "OK", "value": to_serialize(out)}

    @handler
    async def read_slots(self, key: str, optimizer: str) -> dict[str, Any]:
        shard = self._shard(key)
        slots = await self._on_lane(shard, shard.value.nbytes, shard.read_slots, optimizer)
        return {"status": "OK", "slots": {k: to_serialize(v) for k, v in slots.items()}}

    # -- updates -------------------------------------------------------------------------
    def _late(self, fn_id: int | None) -> bool:
        """An update of a function its coordinator reported finished (a late repeat)."""
        return fn_id is not None and fn_id < self.finished.get(fn_id >> 32 << 32, 0)

    def _count(self, applied: bool) -> UpdateReply:
        self.stats["updates" if applied else "skipped"] += 1
        return {"status": "OK", "applied": applied}

    @handler
    async def update(self, key: str, kind: str, value: Any, fn_id: int | None = None,
                     seq: int | None = None) -> UpdateReply:
        """``assign`` / ``assign_add`` / ``assign_sub`` the whole shard."""
        shard = self._shard(key)
        _check_kind(kind, UPDATE_KINDS)
        val = _as_value(shard, value)
        if self._late(fn_id):
            return self._count(False)
        return self._count(await self._on_lane(shard, shard.value.nbytes, shard.update, kind,
                                               val, fn_id, seq))

    @handler
    async def scatter(self, key: str, kind: str, ids: Any, updates: Any, fn_id: int | None = None,
                      seq: int | None = None) -> UpdateReply:
        """Rows ``ids`` of shard ``key``: ``add``/``sub``/``mul``/``div``/``max``/``min``
        (duplicates accumulate), ``update`` (the last duplicate wins)."""
        shard = self._shard(key)
        _check_kind(kind, SCATTER_KINDS)
        ids = _check_ids(shard, ids)
        upd = _as_value(shard, updates, (ids.size, *shard.value.shape[1:]))
        if self._late(fn_id):
            return self._count(False)
        return self._count(await self._on_lane(shard, upd.nbytes, shard.scatter, kind, ids, upd,
                                               fn_id, seq))

    @handler
    async def apply(self, key: str, optimizer: dict[str, Any], grad: Any, ids: Any = None, fn_id: int | None = None,
                    seq: int | None = None) -> UpdateReply:
        """Apply one optimizer step to shard ``key``: dense ``grad``, or rows ``ids``."""
        shard = self._shard(key)
        _kernels.check_optimizer(optimizer)
        if ids is not None:
            ids = _check_ids(shard, ids)
            grad = _as_value(shard, grad, (ids.size, *shard.value.shape[1:]))
        else:
            grad = _as_value(shard, grad)
        if self._late(fn_id):
            return self._count(False)
        nbytes = grad.nbytes * _ARRAYS_TOUCHED.get(str(optimizer.get("kind")), 3)
        if optimizer.get("kind") == "sgd" and not optimizer.get("momentum"):
            nbytes = grad.nbytes
        return self._count(await self._on_lane(shard, nbytes, shard.apply, optimizer, grad, ids,
                                               fn_id, seq))

    @handler
    async def apply_parts(self, keys: Sequence[str], counts: Sequence[int], optimizer: dict[str, Any],
                          grad: Any, ids: Any, fn_id: int | None = None,
                          seq: int | None = None) -> dict[str, Any]:
        """One optimizer step on rows of several shards of this server: ``ids`` and
        ``grad`` hold ``counts[i]`` shard-local ids (and their gradient rows) of shard
        ``keys[i]``, one shard after the other. ``applied`` says, per shard, whether it was
        applied (False: a repeat of ``(fn_id, seq)`` on that shard)."""
        parts = self._parts(keys, counts, ids)
        _kernels.check_optimizer(optimizer)
        rows = np.asarray(unwire(grad))
        if not parts or rows.ndim == 0 or rows.shape[0] != parts[-1][2]:
            raise ShapeMismatchError(f"ps_apply_parts: a gradient of shape {rows.shape} for "
                                     f"{sum(int(c) for c in counts)} ids")
        grads = [_as_value(shard, rows[a:b], (b - a, *shard.value.shape[1:]))
                 for shard, a, b, _ in parts]
        if self._late(fn_id):
            return {"status": "OK", "applied": [self._count(False)["applied"] for _ in parts]}
        applied = []
        for (shard, _, _, local), g in zip(parts, grads, strict=True):
            nbytes = g.nbytes if optimizer.get("kind") == "sgd" and not optimizer.get("momentum") \
                else g.nbytes * _ARRAYS_TOUCHED.get(str(optimizer.get("kind")), 3)
            applied.append(self._count(await self._on_lane(
                shard, nbytes, shard.apply, optimizer, g, local, fn_id, seq))["applied"])
        return {"status": "OK", "applied": applied}

    @handler
    async def forget(self, below: int, above: int = 0) -> dict[str, Any]:
        """Drop exactly-once records of functions with ids in ``[above, below)`` (finished);
        later updates of those functions are dropped (see the module doc)."""
        if above and below >> 32 << 32 == above:
            self.finished[above] = max(self.finished.get(above, 0), below)
        n = 0
        for shard in list(self.shards.values()):
            n += await self._on_lane(shard, 0, shard.forget, below, above)
        return {"status": "OK", "forgotten": n}

    @handler
    async def batch(self, comm: Any, ops: Sequence[Any]) -> dict[str, Any]:
        """Several requests in one message (``[{"op": ..., **kwargs}]``, ops of
        :data:`BATCHABLE`), run in order: ``{"replies": [reply of each]}``. Each reply is
        what its request alone would have got, an error included; the others still run.

        Batches come on a training worker's channel (dicts and arrays, cheap to serialise
        at any size): the comm skips distributed's per-message ``sizeof()`` walk that
        decides whether to offload (de)serialisation, as the worker's end does."""
        if getattr(comm, "allow_offload", False):
            comm.allow_offload = False
        self.stats["batches"] += 1
        if not isinstance(ops, (list, tuple)):  # msgpack gives tuples
            raise TypeError(f"ps_batch takes a list of requests, got {type(ops).__name__}")
        replies = []
        for sub in ops:
            op = sub.get("op") if isinstance(sub, dict) else None
            method = self.worker.handlers.get(op) if isinstance(op, str) and op in BATCHABLE \
                else None
            if method is None:
                replies.append(error_message(ValueError(
                    f"ps_batch cannot carry {op!r}; expected one of {sorted(BATCHABLE)}")))
                continue
            # a handler answers error_message(e) for any error, wrong arguments included
            replies.append(await method(**{k: v for k, v in sub.items() if k != "op"}))
        return {"status": "OK", "replies": replies}

    def _fast_handler(self, op: str) -> Callable[..., Any] | None:
        """The handler of ``op`` on the data path: the worker's, as on Dask comms (a test or
        an extension may wrap it), for the ops a training worker's channel sends."""
        if op == BATCH_OP:
            return self._batch_on_fast_path
        return self.worker.handlers.get(op) if op in BATCHABLE else None

    async def _batch_on_fast_path(self, ops: Sequence[Any]) -> dict[str, Any]:
        return await self.batch(None, ops)

    def fast_port(self) -> dict[str, Any]:
        """Where this PS's data path listens (see :mod:`._fastpath`): ``port`` None if it
        has none (not a PS, ``dataservice.ps.fast-path`` off, or not ``tcp://``)."""
        port = None if self._fast is None else self._fast.port
        return {"status": "OK", "port": port,
                "host": get_address_host(self.worker.address) if port else None}

    # -- persistence ---------------------------------------------------------------------
    @handler
    async def flush(self, keys: Sequence[str] | None = None) -> dict[str, Any]:
        """Write the working copies (and slots) of ``keys`` (default: all dirty) to zarr."""
        written = await self._flush(keys)
        return {"status": "OK", "written": written, "store": self.store_path}

    async def _flush(self, keys: Sequence[str] | None) -> list[str]:
        keys = list(self.shards) if keys is None else list(keys)
        written = []
        for shard in [self._shard(k) for k in keys]:
            if not shard.dirty:
                continue
            value, slots = await self._on_lane(shard, shard.value.nbytes, shard.snapshot, True)
            await run_in_executor_with_context(self._io, _store.write_shard, self._store, shard,
                                               value, slots, self._chunk_bytes)
            written.append(shard.key)
        self.stats["flushes"] += 1
        return written

    # -- checkpoints ---------------------------------------------------------------------
    @handler
    async def save(self, path: str, items: list[Any]) -> dict[str, Any]:
        """Write shards into an existing checkpoint group at ``path``.

        ``items`` is ``[{"key": shard key, "group": group path}]``; each shard becomes
        ``<group>/value`` plus ``<group>/slots/<optimizer>/<slot>``. The coordinator created
        the groups; this PS is the only writer of the arrays below them.
        """
        snaps = []
        for item in items:
            shard = self._shard(item["key"])
            value, slots = await self._on_lane(shard, shard.value.nbytes, shard.snapshot)
            snaps.append((item["group"], value, slots))
        slots = await run_in_executor_with_context(self._io, _store.write_checkpoint, path,
                                                   snaps)
        return {"status": "OK", "slots": slots}

    @handler
    async def restore(self, path: str, key: str, pieces: list[Any], slots: dict[str, Any] | None = None) -> dict[str, Any]:
        """Fill shard ``key`` from saved shards: ``pieces`` is ``[(group, src_start,
        src_stop, dst_start)]`` row ranges; ``slots`` maps optimizer → slot names to load."""
        shard = self._shard(key)
        value, slot_values = await run_in_executor_with_context(
            self._io, _store.read_checkpoint, path, pieces, shard.value.shape,
            shard.value.dtype, slots or {})
        await self._on_lane(shard, shard.value.nbytes, shard.load, value, slot_values)
        return {"status": "OK"}


def _call_initializer(init: bytes, shape: tuple[int, ...], dtype: Any, offset: int,
                      full_shape: tuple[int, ...] | None) -> tuple[np.ndarray, bool]:
    """Unpickle and call a user initializer (on the I/O thread, never on the loop)."""
    return _kernels.initial_value(cloudpickle.loads(init), shape, dtype, offset, full_shape)
