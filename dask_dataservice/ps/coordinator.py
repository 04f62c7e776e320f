"""ClusterCoordinator: schedule functions on training workers, join, fetch.

Theory of operation
-------------------
One Dask task per step caps near 600 steps/s on this hardware, so scheduled functions do
not become tasks. Instead:

- ``schedule(fn)`` appends a closure (a function id, ``fn``, its arguments and a
  :class:`RemoteValue`) to a queue and returns at once.
- On the client's event loop, each training worker has ``batches-in-flight`` *feeders*. A
  feeder takes a batch of closures from the queue (about an even share of what is queued,
  at most ``closures-per-batch``), pickles it once (a function used by many closures is
  pickled once), and sends it to the worker's ``ps_run_closures`` handler.
- The worker (:class:`TrainingWorkerPlugin`) runs the batch in its runner thread, one
  closure after the other, and answers all results in one reply. Inside a closure,
  variable handles talk to the parameter servers directly from that thread, over one
  ordered connection per PS: updates go out without waiting for their replies, reads wait
  for theirs (see :mod:`._transport`). Before it answers, the runner waits for every update
  of the batch to be acknowledged and fails any closure whose update failed.
- A feeder whose request fails with a connection error lost its worker: the closures of
  the batch go back to the front of the queue and run on another worker (at-least-once, as
  TensorFlow). Updates carry the closure's id and a per-run sequence number, and a PS
  applies each at most once, so a re-run does not repeat an update that already landed.
- A closure that raises stops the rest of its batch, cancels everything still queued, and
  its error is raised by the next ``join()``, ``done()`` or ``schedule()`` (then cleared),
  as in TensorFlow.
- A membership loop polls the scheduler for training workers that joined or left.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import secrets
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import cloudpickle
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.utils import run_in_executor_with_context, sync

from .. import config
from .._rpc import error_message
from . import _transport
from ._exceptions import ParameterServerError, ParameterServerUnavailableError
from .strategy import ParameterServerStrategy, _roles
from .variables import ShardedVariable, Variable

logger = logging.getLogger(__name__)

__all__ = ["ClusterCoordinator", "RemoteValue", "PerWorkerDataset", "PerWorkerIterator",
           "TrainingWorkerPlugin", "ClosureCancelledError"]

RUNNER_NAME = "dataservice-ps-runner"


class ClosureCancelledError(ParameterServerError):
    """A scheduled function was cancelled because an earlier one failed."""


# ---------------------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------------------


class TrainingWorkerPlugin(WorkerPlugin):
    """Runs batches of scheduled functions on a training worker (``ps_run_closures``).

    Closures run one at a time in the plugin's own thread (never on the event loop, never
    in the worker's task executor). The plugin also holds this worker's per-worker dataset
    iterators, created on first use.
    """

    name = RUNNER_NAME
    idempotent = True

    async def setup(self, worker) -> None:
        self.worker = worker
        self._runner = ThreadPoolExecutor(1, thread_name_prefix="dds-ps-runner")
        #: ``{iterator uid: iterator}`` and ``{dataset uid: newest iterator uid}``.
        self._iterators: dict[str, Any] = {}
        self._newest: dict[str, str] = {}
        #: ``{coordinator uid: error generation}`` of coordinators whose batch failed here.
        self._poisoned: dict[int, int] = {}
        #: ``{PS address: Channel}``: ordered connections used by the runner thread.
        self._channels: dict[str, _transport.Channel] = {}
        self._pipeline = bool(config.get("ps.pipeline-updates"))
        self._max_bytes = config.get_bytes("ps.unacked-bytes")
        self._max_messages = int(config.get("ps.unacked-messages"))
        self.stats = {"closures": 0, "batches": 0}
        worker.handlers["ps_run_closures"] = self.run_closures
        worker.extensions[RUNNER_NAME] = self

    async def teardown(self, worker) -> None:
        worker.handlers.pop("ps_run_closures", None)
        worker.extensions.pop(RUNNER_NAME, None)
        self._runner.shutdown(wait=False, cancel_futures=True)
        for channel in self._channels.values():
            channel.close()
        self._iterators.clear()

    async def run_closures(self, payload: bytes, coordinator: int, generation: int) -> dict:
        try:
            results = await run_in_executor_with_context(
                self._runner, self._run_batch, payload, coordinator, generation)
            return {"status": "OK", "results": results}
        except Exception as e:  # noqa: BLE001 - e.g. a batch that does not unpickle here
            return error_message(e)

    def _run_batch(self, payload: bytes, coordinator: int, generation: int) -> list:
        from distributed.worker import _worker_cvar

        _worker_cvar.set(self.worker)
        _transport._thread.worker = self.worker
        closures = cloudpickle.loads(payload)
        results: list[tuple[bool, bytes]] = []
        self.stats["batches"] += 1
        pipeline = None
        if self._pipeline:
            pipeline = _transport.Pipeline(self._channels, self.worker, self._max_bytes,
                                           self._max_messages)
        _transport._thread.pipeline = pipeline
        try:
            for index, (fn_id, fn, args, kwargs) in enumerate(closures):
                if self._poisoned.get(coordinator, -1) >= generation:
                    break  # an earlier closure of this generation failed: cancel the rest
                _transport._thread.fn = _transport.FunctionContext(fn_id)
                if pipeline is not None:
                    pipeline.current = index
                try:
                    value = fn(*args, **kwargs)
                    ok = True
                except Exception as e:  # noqa: BLE001 - returned to the coordinator
                    value, ok = e, False
                    self._poisoned[coordinator] = generation
                finally:
                    _transport._thread.fn = None
                self.stats["closures"] += 1
                results.append((ok, _dumps_result(ok, value)))
            if pipeline is not None:
                # A function's result counts once its updates landed: wait for them all,
                # and charge a failed update to the function that sent it.
                pipeline.drain()
                for index, err in sorted(pipeline.errors.items()):
                    if index < len(results) and results[index][0]:
                        results[index] = (False, _dumps_result(False, err))
                        self._poisoned[coordinator] = generation
        finally:
            _transport._thread.pipeline = None
        return results

    def iterator(self, handle: PerWorkerIterator):
        it = self._iterators.get(handle.uid)
        if it is None:
            old = self._newest.get(handle.dataset_uid)
            if old is not None:
                self._iterators.pop(old, None)
            ds = handle.dataset_fn()
            it = self._iterators[handle.uid] = iter(ds)
            self._newest[handle.dataset_uid] = handle.uid
        return it


def _dumps_result(ok: bool, value: Any) -> bytes:
    try:
        return cloudpickle.dumps(value, protocol=5)
    except Exception as e:  # noqa: BLE001
        what = "result" if ok else "error"
        return cloudpickle.dumps(ParameterServerError(
            f"the scheduled function's {what} could not be pickled: {type(e).__name__}: {e}; "
            f"{what} was {value!r:.200}"))


# ---------------------------------------------------------------------------------------
# per-worker datasets
# ---------------------------------------------------------------------------------------


class PerWorkerDataset:
    """A dataset built lazily on each training worker (``create_per_worker_dataset``)."""

    def __init__(self, dataset_fn):
        self._dataset_fn = dataset_fn
        self._uid = secrets.token_hex(6)

    def __iter__(self) -> PerWorkerIterator:
        """A fresh per-worker iterator (each worker starts its dataset again)."""
        return PerWorkerIterator(self._uid, self._dataset_fn)

    def build(self) -> PerWorkerDataset:
        return self


class PerWorkerIterator:
    """Pass it to scheduled functions; ``next(it)`` there reads this worker's dataset."""

    def __init__(self, dataset_uid: str, dataset_fn):
        self.dataset_uid = dataset_uid
        self.dataset_fn = dataset_fn
        self.uid = secrets.token_hex(6)

    def __iter__(self):
        return self

    def __next__(self):
        worker = getattr(_transport._thread, "worker", None)
        plugin = worker.extensions.get(RUNNER_NAME) if worker is not None else None
        if plugin is None:
            raise RuntimeError("a per-worker iterator is read inside a function scheduled with "
                               "ClusterCoordinator.schedule, on a training worker")
        return next(plugin.iterator(self))

    get_next = __next__


# ---------------------------------------------------------------------------------------
# coordinator side
# ---------------------------------------------------------------------------------------

_PENDING, _DONE, _FAILED, _CANCELLED = range(4)


class RemoteValue:
    """The future result of a scheduled function."""

    __slots__ = ("_coordinator", "_state", "_data", "_error", "_value", "_loaded")

    def __init__(self, coordinator: ClusterCoordinator):
        self._coordinator = coordinator
        self._state = _PENDING
        self._data: bytes | None = None
        self._error: BaseException | None = None
        self._value = None
        self._loaded = False

    def done(self) -> bool:
        return self._state != _PENDING

    def fetch(self) -> Any:
        """Wait for the function and return its result (or raise its error)."""
        coord = self._coordinator
        with coord._cond:
            while self._state == _PENDING:
                coord._cond.wait(0.5)
                coord._check_alive()
        if self._state == _DONE:
            if not self._loaded:
                self._value = cloudpickle.loads(self._data)
                self._data, self._loaded = None, True
            return self._value
        raise self._error

    get = fetch

    def __reduce__(self):
        if self._state == _DONE:
            return (_identity, (self.fetch(),))
        raise TypeError("only a finished RemoteValue can be passed to a scheduled function")

    def __repr__(self) -> str:
        state = ["pending", "done", "failed", "cancelled"][self._state]
        return f"<RemoteValue {state}>"


def _identity(x):
    return x


class _Closure:
    __slots__ = ("fn_id", "fn", "args", "kwargs", "remote", "generation")

    def __init__(self, fn_id, fn, args, kwargs, remote, generation):
        self.fn_id, self.fn, self.args, self.kwargs = fn_id, fn, args, kwargs
        self.remote, self.generation = remote, generation


class ClusterCoordinator:
    """Schedules functions on training workers (``tf.distribute.experimental.coordinator``).

    ``schedule`` returns a :class:`RemoteValue` at once; ``join`` waits for every scheduled
    function and raises the first error; ``done`` says whether all have finished. One
    coordinator per strategy: a second ``ClusterCoordinator(strategy)`` returns the first.
    """

    def __new__(cls, strategy: ParameterServerStrategy):
        existing = getattr(strategy, "_cluster_coordinator", None)
        if existing is not None:
            return existing
        return super().__new__(cls)

    def __init__(self, strategy: ParameterServerStrategy):
        if getattr(self, "_started", False):
            return
        if not isinstance(strategy, ParameterServerStrategy):
            raise TypeError("ClusterCoordinator needs a ParameterServerStrategy")
        self.strategy = strategy
        self._client = strategy.client
        self._uid = secrets.randbits(30) + 1
        self._counter = itertools.count(1)
        self._cond = threading.Condition()
        self._queue: deque[_Closure] = deque()
        self._unfinished = 0
        self._error: BaseException | None = None
        self._generation = 0
        self._closing = False
        self._fatal: BaseException | None = None
        self._notify_pending = False
        self._feeders: dict[str, list] = {}
        self._dead: set[str] = set()
        self._max_batch = int(config.get("ps.closures-per-batch"))
        self._slots = int(config.get("ps.batches-in-flight"))
        self._interval = config.get_seconds("ps.membership-interval")
        #: Counters: closures finished, re-queued after a worker loss, batches sent.
        self.stats = {"finished": 0, "requeued": 0, "batches": 0, "workers_lost": 0}
        sync(self._client.loop, self._start)
        strategy._cluster_coordinator = self
        self._started = True

    @property
    def _fn_base(self) -> int:
        return self._uid << 32

    # -- the public API ------------------------------------------------------------------
    def schedule(self, fn, args=(), kwargs=None) -> RemoteValue:
        """Run ``fn(*args, **kwargs)`` on some training worker; returns a RemoteValue now.

        Raises the error of a previously failed function, if any (and clears it).
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        with self._cond:
            self._check_alive()
            self._raise_error_locked()
            remote = RemoteValue(self)
            self._queue.append(_Closure(self._fn_base + next(self._counter), fn, tuple(args),
                                        dict(kwargs or {}), remote, self._generation))
            self._unfinished += 1
            wake = not self._notify_pending
            self._notify_pending = True
        if wake:
            self._loop.call_soon_threadsafe(self._wake)
        return remote

    def join(self) -> None:
        """Wait until every scheduled function finished; raise the first error (then clear it)."""
        with self._cond:
            while self._unfinished and self._error is None:
                self._cond.wait(0.5)
                self._check_alive()
            self._raise_error_locked()
            below = next(self._counter)
        self._forget(below)

    def done(self) -> bool:
        """True when every scheduled function finished; raises the first error if any failed."""
        with self._cond:
            self._check_alive()
            self._raise_error_locked()
            return self._unfinished == 0

    def fetch(self, val):
        """Values of a structure of RemoteValues, variables and per-worker values."""
        if isinstance(val, RemoteValue):
            return val.fetch()
        if isinstance(val, Variable | ShardedVariable):
            return val.read_value()
        if isinstance(val, dict):
            return {k: self.fetch(v) for k, v in val.items()}
        if isinstance(val, list | tuple):
            out = [self.fetch(v) for v in val]
            if isinstance(val, tuple):
                return type(val)(*out) if hasattr(val, "_fields") else tuple(out)
            return out
        return val

    def create_per_worker_dataset(self, dataset_fn) -> PerWorkerDataset:
        """A dataset built on each training worker, lazily, from ``dataset_fn()``.

        ``dataset_fn`` takes no arguments and returns an iterable (a
        :class:`~dask_dataservice.Dataset`, a data-service dataset from
        ``from_dataset_id``, ...); a ``Dataset`` may be given directly.
        """
        if not callable(dataset_fn):
            ds = dataset_fn

            def dataset_fn():
                return ds

        return PerWorkerDataset(dataset_fn)

    def shutdown(self) -> None:
        """Stop the feeders (pending functions are cancelled)."""
        with self._cond:
            self._closing = True
            self._cancel_pending_locked(ClosureCancelledError("the coordinator was shut down"))
        try:
            sync(self._client.loop, self._stop)
        except Exception:  # noqa: BLE001 - the client may be gone already
            pass
        self.strategy._cluster_coordinator = None

    # -- helpers (user thread) -----------------------------------------------------------
    def _check_alive(self) -> None:
        if self._fatal is not None:
            raise self._fatal
        if self._client.status in ("closed", "closing"):
            raise ParameterServerError("the coordinator's client is closed")

    def _raise_error_locked(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _forget(self, below: int) -> None:
        """Tell the PSs to drop the exactly-once records of functions that finished."""
        calls = [(a, "ps_forget", {"below": below, "above": self._fn_base})
                 for a in self.strategy.ps_addresses]
        try:
            _transport.call_many(calls, self._client)
        except ParameterServerUnavailableError:
            raise
        except ParameterServerError as e:
            logger.warning("could not prune exactly-once records: %s", e)

    # -- event loop ----------------------------------------------------------------------
    async def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._have_work = asyncio.Event()
        await self._refresh_workers()
        self._membership = asyncio.ensure_future(self._membership_loop())

    async def _stop(self) -> None:
        self._membership.cancel()
        for tasks in self._feeders.values():
            for t in tasks:
                t.cancel()
        self._have_work.set()

    def _wake(self) -> None:
        with self._cond:
            self._notify_pending = False
        self._have_work.set()

    async def _membership_loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(self._interval)
            if self._client.status in ("closed", "closing"):
                self._fatal = ParameterServerError("the coordinator's client was closed")
                await self._stop()
                with self._cond:
                    self._closing = True
                    self._cancel_pending_locked(self._fatal)
                return
            try:
                await self._refresh_workers()
            except Exception as e:  # noqa: BLE001 - keep polling; the scheduler may be back
                logger.debug("membership poll failed: %s", e)

    async def _refresh_workers(self) -> None:
        info = await self._client.scheduler.identity()
        _, workers = _roles(info.get("workers", {}))
        for addr in workers:
            if addr not in self._feeders and addr not in self._dead:
                self._feeders[addr] = [asyncio.ensure_future(self._feed(addr))
                                       for _ in range(self._slots)]
        gone = set(self._feeders) - set(workers)
        for addr in gone:
            self._dead.add(addr)
            for t in self._feeders.pop(addr):
                t.cancel()

    def _take(self) -> list[_Closure]:
        with self._cond:
            if not self._queue:
                return []
            share = math.ceil(len(self._queue) / max(1, len(self._feeders) * self._slots))
            n = max(1, min(self._max_batch, share))
            return [self._queue.popleft() for _ in range(min(n, len(self._queue)))]

    async def _feed(self, addr: str) -> None:
        rpc = self._client.rpc(addr)
        while not self._closing:
            batch = self._take()
            if not batch:
                self._have_work.clear()
                batch = self._take()
                if not batch:
                    await self._have_work.wait()
                    continue
            generation = batch[0].generation
            try:
                payload = _pickle_batch(batch)
            except Exception as e:  # noqa: BLE001 - a closure that does not pickle fails alone
                self._fail_unpicklable(batch, e)
                continue
            self.stats["batches"] += 1
            try:
                reply = await rpc.ps_run_closures(payload=payload, coordinator=self._uid,
                                                  generation=generation)
            except asyncio.CancelledError:
                self._requeue(batch)
                raise
            except Exception as e:  # noqa: BLE001 - the worker is gone (or going)
                logger.info("training worker %s lost (%s: %s); re-queueing %d functions",
                            addr, type(e).__name__, e, len(batch))
                self.stats["workers_lost"] += 1
                self._requeue(batch)
                self._dead.add(addr)
                for t in self._feeders.pop(addr, []):
                    if t is not asyncio.current_task():
                        t.cancel()
                return
            if reply is None or reply.get("status") != "OK":
                if reply is None:
                    err = ParameterServerError(f"training worker {addr} has no runner plugin")
                else:
                    try:
                        _transport.check(reply, addr, "ps_run_closures")
                    except Exception as e:  # noqa: BLE001
                        err = e
                self._finish(batch, [(False, cloudpickle.dumps(err))])
                continue
            self._finish(batch, reply["results"])

    def _requeue(self, batch: list[_Closure]) -> None:
        with self._cond:
            live = [c for c in batch if c.generation == self._generation and not self._closing]
            for c in batch:
                if c not in live:
                    self._settle_locked(c, _CANCELLED, ClosureCancelledError(
                        "cancelled: an earlier scheduled function failed"))
            self._queue.extendleft(reversed(live))
            self.stats["requeued"] += len(live)
            self._cond.notify_all()
        self._have_work.set()

    def _finish(self, batch: list[_Closure], results: list) -> None:
        with self._cond:
            for i, closure in enumerate(batch):
                if i < len(results):
                    ok, data = results[i]
                    if ok:
                        closure.remote._data = data
                        self._settle_locked(closure, _DONE, None)
                        continue
                    try:
                        err = cloudpickle.loads(data)
                    except Exception as e:  # noqa: BLE001
                        err = ParameterServerError(f"a scheduled function failed: {e}")
                    if not isinstance(err, BaseException):
                        err = ParameterServerError(repr(err))
                    self._settle_locked(closure, _FAILED, err)
                    if closure.generation == self._generation:
                        self._record_error_locked(err)
                else:
                    self._settle_locked(closure, _CANCELLED, ClosureCancelledError(
                        "cancelled: an earlier scheduled function failed"))
            self.stats["finished"] += len(batch)
            self._cond.notify_all()

    def _fail_unpicklable(self, batch: list[_Closure], e: BaseException) -> None:
        results = []
        for c in batch:
            try:
                _pickle_batch([c])
                results.append(None)
            except Exception as err:  # noqa: BLE001
                results.append(err)
        with self._cond:
            good = [c for c, r in zip(batch, results, strict=True) if r is None]
            for c, r in zip(batch, results, strict=True):
                if r is not None:
                    err = TypeError(f"a scheduled function or its arguments do not pickle: {r}")
                    self._settle_locked(c, _FAILED, err)
                    self._record_error_locked(err)
            self._queue.extendleft(reversed(good))
            self._cond.notify_all()

    def _settle_locked(self, closure: _Closure, state: int, error) -> None:
        if closure.remote._state != _PENDING:
            return
        closure.remote._state = state
        closure.remote._error = error
        self._unfinished -= 1

    def _record_error_locked(self, err: BaseException) -> None:
        if self._error is None:
            self._error = err
        self._generation += 1
        self._cancel_pending_locked(ClosureCancelledError(
            f"cancelled because an earlier scheduled function failed: {err!r:.200}"))

    def _cancel_pending_locked(self, err: BaseException) -> None:
        while self._queue:
            self._settle_locked(self._queue.popleft(), _CANCELLED, err)
        self._cond.notify_all()

    def __repr__(self) -> str:
        return (f"<dds.ClusterCoordinator workers={sorted(self._feeders)} "
                f"unfinished={self._unfinished}>")


def _pickle_batch(batch: list[_Closure]) -> bytes:
    return cloudpickle.dumps([(c.fn_id, c.fn, c.args, c.kwargs) for c in batch], protocol=5)

