"""TrainingWorkerPlugin: runs batches of scheduled functions on a training worker.

Theory of operation
-------------------
- ``ps_run_closures`` receives a batch: ``[(closure id, fn, args, kwargs)]`` pickled as one
  payload (a function or handle used by many closures travels once). Nothing is unpickled
  on the event loop: the batch runs in the plugin's runner thread, one closure after the
  other (never in the worker's task executor).
- Inside a closure, variable handles reach the parameter servers from that thread over one
  ordered :class:`~._channel.Channel` per PS (updates not waited for, reads wait; see
  :mod:`._channel`). Before it answers, the runner waits for every update of the batch to be
  acknowledged and fails any closure whose update failed.
- A closure that raises poisons its coordinator's *generation*: later closures of that
  generation in this worker's batches are skipped (the coordinator cancels them). The
  record is dropped as soon as a batch of a newer generation arrives, and at most
  ``_MAX_POISONED`` coordinators are remembered.
- The coordinator may take back the later half of the functions of a batch that have not
  started (``ps_withdraw``, when another training worker is idle and nothing is queued), so a
  function never waits behind a long one while a worker is free (as in TensorFlow, where a
  worker takes a function only when it is free). The worker picks the batch with most
  functions waiting (the newest sent may have arrived first); the answer says which batch,
  and from which index on its functions are given back; the runner checks before each function, under the same lock,
  and stops there: each function runs here or is given back, never both.
- The plugin also holds this worker's per-worker dataset iterators, created on first use.
  ``ps_release_iterators`` closes those of a per-worker dataset (``fit`` at its end, the
  coordinator when the dataset is garbage-collected or it shuts down), in the runner thread,
  after the functions running: a data-service iterator's reader releases its iteration
  client on the dispatcher (TensorFlow frees per-worker resources with the iterator).

Everything the plugin starts is owned: the runner thread (an owned executor), the channels'
tasks (a :class:`~dask_dataservice._async.TaskGroup`); ``teardown`` stops and joins them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import cloudpickle
from distributed.comm.core import connect
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.utils import offload, run_in_executor_with_context

from .. import config
from .._async import TaskGroup, owned_executor, shutdown_executor
from .._rpc import handler
from ..errors import ParameterServerError
from . import _fastpath, _routing
from ._channel import Channel, Pipeline
from ._types import ClosuresReply, wire
from .input_position import CountingIterator

if TYPE_CHECKING:
    from distributed import Worker

__all__ = ["RUNNER_NAME", "PerWorkerDataset", "PerWorkerIterator", "TrainingWorkerPlugin"]

logger = logging.getLogger(__name__)

RUNNER_NAME = "dataservice-ps-runner"

#: Coordinators whose failed generation a worker remembers (oldest forgotten first).
_MAX_POISONED = 64

#: Batches a worker remembers having answered (a withdraw of one of them gets "none").
_MAX_ANSWERED = 1024


class TrainingWorkerPlugin(WorkerPlugin):
    """Runs batches of scheduled functions on a training worker (``ps_run_closures``)."""

    name = RUNNER_NAME
    idempotent = True

    async def setup(self, worker: Worker) -> None:
        self.worker = worker
        self._runner = owned_executor("dds-ps-runner", 1)
        self._group = TaskGroup("ps-channels")
        #: ``{iterator uid: iterator}`` and ``{dataset uid: newest iterator uid}``.
        self._iterators: dict[str, Any] = {}
        self._newest: dict[str, str] = {}
        #: ``{coordinator uid: failed generation}``, bounded (see the module doc).
        self.poisoned: OrderedDict[int, int] = OrderedDict()
        #: ``{PS address: Channel}``: ordered connections used by the runner thread.
        self.channels: dict[str, Channel | _fastpath.SocketChannel] = {}
        self._pipeline = bool(config.get("ps.pipeline-updates"))
        self._max_bytes = config.get_bytes("ps.unacked-bytes")
        self._max_messages = int(config.get("ps.unacked-messages"))
        self._connect_timeout = config.get_seconds("ps.connect-timeout")
        self.stats = {"closures": 0, "batches": 0, "withdrawn": 0}
        #: By ``(coordinator uid, batch id)``, for the batches received and not answered:
        #: their sizes, the index of the function running, and where a batch was cut
        #: (``ps_withdraw``); ``_batch_lock`` orders a function's start and a withdraw.
        self._sizes: dict[tuple[int, int], int] = {}
        self._running: dict[tuple[int, int], int] = {}
        self._cut: dict[tuple[int, int], int] = {}
        self._batch_lock = threading.Lock()
        #: Set (and replaced) when a batch arrives; the batches answered lately.
        self._arrived = asyncio.Event()
        self._answered: OrderedDict[tuple[int, int], None] = OrderedDict()
        #: ``{uid: Variable}``: this worker's copies of per-worker variables (ps/per_worker.py).
        self.per_worker_variables: dict[str, Any] = {}
        worker.handlers["ps_run_closures"] = self.run_closures
        worker.handlers["ps_withdraw"] = self.withdraw
        worker.handlers["ps_per_worker_read"] = self.per_worker_read
        worker.handlers["ps_release_iterators"] = self.release_iterators
        worker.extensions[RUNNER_NAME] = self

    async def teardown(self, worker: Worker) -> None:
        worker.handlers.pop("ps_run_closures", None)
        worker.handlers.pop("ps_withdraw", None)
        worker.handlers.pop("ps_per_worker_read", None)
        worker.handlers.pop("ps_release_iterators", None)
        worker.extensions.pop(RUNNER_NAME, None)
        self.per_worker_variables.clear()
        for channel in self.channels.values():
            channel.close()
        await self._group.stop()
        shutdown_executor(self._runner)
        self._iterators.clear()
        self._newest.clear()

    @property
    def idle(self) -> bool:
        """No channel has a request in flight (cleanup checks use it)."""
        return all(ch.idle for ch in self.channels.values())

    # -- handlers ----------------------------------------------------------------------------
    @handler
    async def run_closures(self, payload: bytes, coordinator: int, generation: int,
                           worker_index: int | None = None, batch: int | None = None,
                           size: int = 0) -> ClosuresReply:
        key = None if batch is None else (coordinator, batch)
        if key is not None:
            with self._batch_lock:
                self._sizes[key] = size
            self._arrived.set()  # withdraws that came first wait for their batch
            self._arrived = asyncio.Event()
        cut = None
        try:
            results = await run_in_executor_with_context(
                self._runner, self._run_batch, payload, coordinator, generation, worker_index,
                key)
        finally:
            if key is not None:
                with self._batch_lock:
                    self._sizes.pop(key, None)
                    self._running.pop(key, None)
                    cut = self._cut.pop(key, None)
                self._answered[key] = None
                while len(self._answered) > _MAX_ANSWERED:
                    self._answered.popitem(last=False)
        if cut is not None:  # the functions from there on were given back: none ran here
            return {"status": "OK", "results": results, "cut": cut}
        return {"status": "OK", "results": results}

    @handler
    async def withdraw(self, coordinator: int, batches: list[int]) -> dict[str, Any]:
        """Give back the later half of the functions not started of the batch, among
        ``batches`` (those the coordinator sent here and has no answer for), that has the
        most of them: ``{"batch": id, "from": index}`` (the runner stops there), or
        ``{"from": None}`` when none waits. Batches not arrived yet (each travels on its
        own connection, so the newest sent may arrive first) are waited for, up to the
        liveness timeout, unless this worker answered them already."""
        keys = [(coordinator, b) for b in batches]
        deadline = time.monotonic() + _routing.liveness()
        while True:
            arrived = self._arrived
            picked = self._pick(keys)
            missing = [k for k in keys if k not in self._sizes and k not in self._answered]
            if picked is not None or not missing or time.monotonic() >= deadline:
                break
            try:
                await asyncio.wait_for(arrived.wait(), deadline - time.monotonic())
            except TimeoutError:
                pass
        if picked is None:
            return {"status": "OK", "from": None}
        return {"status": "OK", "batch": picked[0][1], "from": picked[1]}

    @handler
    async def per_worker_read(self, key: str) -> dict[str, Any]:
        """This worker's copy of per-worker variable ``key`` (``None``: never used here)."""
        var = self.per_worker_variables.get(key)
        if var is None:
            return {"status": "OK", "value": None}
        if var.dtype.itemsize * math.prod(var.shape) > config.get_bytes("ps.offload-bytes"):
            value = await offload(var.read_value)  # a large copy: off the event loop
        else:
            value = var.read_value()
        return {"status": "OK", "value": wire(value)}

    @handler
    async def release_iterators(self, dataset_uid: str) -> dict[str, Any]:
        """Close this worker's iterator of per-worker dataset ``dataset_uid`` (if any), in
        the runner thread (after the batch running, if one is): ``{"released": n}``."""
        uid = self._newest.pop(dataset_uid, None)
        it = self._iterators.pop(uid, None) if uid is not None else None
        if it is None:
            return {"status": "OK", "released": 0}
        await run_in_executor_with_context(self._runner, _close, it)
        return {"status": "OK", "released": 1}

    def _pick(self, keys: list[tuple[int, int]]) -> tuple[tuple[int, int], int] | None:
        """Cut the batch of ``keys`` with the most functions not started (see withdraw)."""
        with self._batch_lock:
            best, most = None, 0
            for key in keys:
                size = self._sizes.get(key)
                if size is None or key in self._cut:
                    continue
                left = size - (self._running.get(key, -1) + 1)  # functions not started
                if left > most:
                    best, most = key, left
            if best is None:
                return None
            cut = self._sizes[best] - most + most // 2  # keep half of what waits
            self._cut[best] = cut
            self.stats["withdrawn"] += self._sizes[best] - cut
            return best, cut

    # -- methods for the runner thread -------------------------------------------------------
    async def _connect(self, address: str) -> Any:
        comm = await connect(address, timeout=self._connect_timeout, deserialize=True,
                             **self.worker.connection_args)
        comm.name = "dataservice-ps-channel"
        # Messages here are small dicts and to_serialize'd arrays, cheap to (de)serialise at
        # any size: skip the per-message sizeof() walk that decides whether to offload.
        comm.allow_offload = False
        return comm

    def _answers(self, address: str, limit: float) -> bool:
        """Whether the PS at ``address`` answers a probe (from the runner thread)."""
        return _routing.run_sync(self.worker.loop, _routing.answers, self.worker.rpc, address,
                                 limit)

    def _channel(self, address: str) -> Channel | _fastpath.SocketChannel:
        ch = self.channels.get(address)
        if ch is None:
            ch = self._socket_channel(address)
            if ch is None:  # distributed's comms, driven by the event loop
                loop = self.worker.loop.asyncio_loop  # type: ignore[attr-defined]  # tornado's AsyncIOLoop
                ch = Channel(loop, address, self._connect, self._group)
            self.channels[address] = ch
        return ch

    def _socket_channel(self, address: str) -> _fastpath.SocketChannel | None:
        """A channel on the PS's data path, on which the runner thread talks to the PS
        itself; None when there is none or it cannot be reached (only Dask's own ports may
        be open between the hosts: then distributed's comms carry the requests)."""
        if not (address.startswith("tcp://") and config.get("ps.fast-path")):
            return None
        where = self._where(address)
        if where is None:
            return None
        ch = _fastpath.SocketChannel(address, self._where, self._connect_timeout,
                                     _routing.timeout(), where, self._answers,
                                     _routing.liveness())
        try:
            ch.open()
        except OSError as e:
            logger.warning("the data path of parameter server %s at %s:%d is not reachable "
                           "(%s); using distributed's comms (dataservice.ps.fast-path)",
                           address, where[0], where[1], e)
            return None
        return ch

    def _where(self, address: str) -> tuple[str, int] | None:
        """``(host, port)`` of the PS's data path, or None (from the runner thread)."""
        async def ask() -> Any:
            return await asyncio.wait_for(self.worker.rpc(address).ps_fast_port(),
                                          self._connect_timeout)

        try:
            where = _routing.run_sync(self.worker.loop, ask)
        except (OSError, TimeoutError):
            return None  # unreachable: the channel's first request says so
        if isinstance(where, dict) and where.get("port"):
            return str(where["host"]), int(where["port"])
        return None

    def _poisoned(self, coordinator: int, generation: int) -> bool:
        failed = self.poisoned.get(coordinator)
        if failed is not None and failed < generation:
            del self.poisoned[coordinator]  # a newer generation: the failure was handled
            return False
        return failed is not None and failed >= generation

    def _poison(self, coordinator: int, generation: int) -> None:
        self.poisoned[coordinator] = generation
        self.poisoned.move_to_end(coordinator)
        while len(self.poisoned) > _MAX_POISONED:
            self.poisoned.popitem(last=False)

    def _run_batch(self, payload: bytes, coordinator: int, generation: int,
                   worker_index: int | None, key: tuple[int, int] | None) -> list[Any]:
        from distributed.worker import _worker_cvar

        _worker_cvar.set(self.worker)
        _routing._thread.worker = self.worker
        closures = cloudpickle.loads(payload)
        results: list[tuple[bool, bytes]] = []
        self.stats["batches"] += 1
        pipeline = None
        if self._pipeline:
            pipeline = Pipeline(self._channel, _routing.check, self._max_bytes,
                                self._max_messages, _routing.timeout(), self._answers,
                                _routing.liveness(), config.get_bytes("ps.coalesce-bytes"))
        _routing._thread.pipeline = pipeline
        try:
            for index, (fn_id, fn, args, kwargs) in enumerate(closures):
                if self._poisoned(coordinator, generation):
                    break  # an earlier closure of this generation failed: cancel the rest
                if key is not None and not self._may_start(key, index):
                    break  # given back (ps_withdraw): the coordinator runs the rest elsewhere
                _routing._thread.fn = _routing.FunctionContext(fn_id, worker_index)
                if pipeline is not None:
                    pipeline.current = index
                try:
                    value, ok = fn(*args, **kwargs), True
                except Exception as e:  # noqa: BLE001 - returned to the coordinator
                    value, ok = e, False
                    self._poison(coordinator, generation)
                finally:
                    _routing._thread.fn = None
                self.stats["closures"] += 1
                results.append((ok, _dumps_result(ok, value)))
            if pipeline is not None:
                # A function's result counts once its updates landed: wait for them all,
                # and charge a failed update to the function that sent it.
                pipeline.drain()
                for index, err in sorted(pipeline.errors.items()):
                    if index < len(results) and results[index][0]:
                        results[index] = (False, _dumps_result(False, err))
                        self._poison(coordinator, generation)
        finally:
            _routing._thread.pipeline = None
        return results

    def _may_start(self, key: tuple[int, int], index: int) -> bool:
        """Whether function ``index`` of batch ``key`` may run (it was not given back)."""
        with self._batch_lock:
            cut = self._cut.get(key)
            if cut is not None and index >= cut:
                return False
            self._running[key] = index
            return True

    def iterator(self, handle: PerWorkerIterator) -> CountingIterator:
        it = self._iterators.get(handle.uid)
        if it is None:
            old = self._newest.get(handle.dataset_uid)
            if old is not None:  # replaced (a restored input position): release the old one
                _close(self._iterators.pop(old, None))
            ds = handle.dataset_fn()
            # counted, from the handle's start position (see ps/input_position.py)
            start = getattr(handle, "start", {})
            it = self._iterators[handle.uid] = CountingIterator.at(ds, start, str(self.worker.name))
            self._newest[handle.dataset_uid] = handle.uid
        return it


def _close(it: Any) -> None:
    """Close a per-worker iterator (its pipeline's threads, a data-service reader); from the
    runner thread (never an event loop: closing a reader waits for its release)."""
    close = getattr(it, "close", None)
    if close is None:
        return
    try:
        close()
    except Exception as e:  # noqa: BLE001 - the release is best effort (the dispatcher
        logger.debug("closing a per-worker iterator failed: %r", e)  # drops silent clients)


def _dumps_result(ok: bool, value: Any) -> bytes:
    try:
        data: bytes = cloudpickle.dumps(value, protocol=5)
        return data
    except Exception as e:  # noqa: BLE001
        what = "result" if ok else "error"
        return cloudpickle.dumps(ParameterServerError(  # type: ignore[no-any-return]
            f"the scheduled function's {what} could not be pickled: {type(e).__name__}: {e}; "
            f"{what} was {value!r:.200}"))


# ---------------------------------------------------------------------------------------
# per-worker datasets
# ---------------------------------------------------------------------------------------


class PerWorkerDataset:
    """A dataset built lazily on each training worker (``create_per_worker_dataset``)."""

    def __init__(self, dataset_fn: Callable[[], Any]) -> None:
        self._dataset_fn = dataset_fn
        self._uid = secrets.token_hex(6)

    def __iter__(self) -> PerWorkerIterator:
        """A fresh per-worker iterator (each worker starts its dataset again)."""
        it = PerWorkerIterator(self._uid, self._dataset_fn)
        it._owner = self  # the dataset lives as long as its iterators (see __getstate__)
        return it

    def build(self) -> PerWorkerDataset:
        return self


class PerWorkerIterator:
    """Pass it to scheduled functions; ``next(it)`` there reads this worker's dataset."""

    def __init__(self, dataset_uid: str, dataset_fn: Callable[[], Any]) -> None:
        self.dataset_uid = dataset_uid
        self.dataset_fn = dataset_fn
        self.uid = secrets.token_hex(6)
        #: ``{worker name: elements to skip}`` (a restored checkpoint's input position).
        self.start: dict[str, Any] = {}
        #: The PerWorkerDataset it came from, kept alive (on the coordinator only: when
        #: it and its iterators are garbage-collected, the workers release theirs).
        self._owner: PerWorkerDataset | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_owner"] = None  # the workers get the handle, not the dataset
        return state

    def __iter__(self) -> PerWorkerIterator:
        return self

    def __next__(self) -> Any:
        worker = getattr(_routing._thread, "worker", None)
        plugin = worker.extensions.get(RUNNER_NAME) if worker is not None else None
        if plugin is None:
            raise RuntimeError("a per-worker iterator is read inside a function scheduled with "
                               "ClusterCoordinator.schedule, on a training worker")
        return next(plugin.iterator(self))

    get_next = __next__
