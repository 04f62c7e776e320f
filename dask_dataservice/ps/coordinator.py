"""ClusterCoordinator: schedule functions on training workers, join, fetch.

Theory of operation
-------------------
One Dask task per step caps near 600 steps/s on this hardware, so scheduled functions do
not become tasks. Instead:

- ``schedule(fn)`` appends a closure (a function id, ``fn``, its arguments and a
  :class:`RemoteValue`) to a queue and returns at once.
- On the client's event loop, each training worker has ``batches-in-flight`` *feeders*. A
  feeder takes a batch of closures from the queue (about an even share of what is queued,
  at most ``closures-per-batch``), has it pickled once on a thread of the client loop's
  executor (never on the loop itself; a function or handle used by many closures is pickled
  once: ~1.5 us a closure, where pickling each closure alone in ``schedule`` cost 10-45 us
  and slowed P1 down), and sends it to the worker's ``ps_run_closures`` handler.
- The worker (:class:`~._runner_plugin.TrainingWorkerPlugin`) runs the batch in its runner
  thread, one closure after the other, and answers all results in one reply (see
  :mod:`._runner_plugin` and :mod:`._channel`).
- A feeder whose request fails with a connection error lost its worker: the closures of
  the batch go back to the front of the queue and run on another worker (at-least-once, as
  TensorFlow). Updates carry the closure's id and a per-run sequence number, and a PS
  applies each at most once, so a re-run does not repeat an update that already landed.
- A feeder whose worker holds nothing and finds the queue empty takes over the later half
  of the functions not started of a batch (the one with most of them) of the worker with
  most functions sent (``ps_withdraw``,
  one request at a time) and sends them to its own worker, so a function never waits
  behind a long one while a worker is free (TensorFlow's workers take a function only when
  they are free; here up to ``batches-in-flight`` batches of several functions wait at a
  worker). The busy worker stops its batch there and answers for the functions before it.
- A closure that raises stops the rest of its batch, cancels everything still queued, and
  its error is raised by the next ``join()``, ``done()`` or ``schedule()`` (then cleared),
  as in TensorFlow. Closures of the failed generation that were running elsewhere and
  finish afterwards are cancelled too: their ``fetch()`` raises ClosureCancelledError.
- A membership loop polls the scheduler for training workers that joined or left; a worker
  whose request failed is remembered as dead only while the scheduler still lists it.
- A liveness loop probes every training worker and parameter server each
  ``membership-interval``, each probe bounded by ``dataservice.ps.liveness-timeout``
  (seconds; Dask's worker-ttl is minutes). A training worker that does not answer (frozen,
  hung) is treated like a dead one: its feeders are cancelled, its batch goes back to the
  queue and re-runs elsewhere (exactly-once updates keep the counters exact); it is used
  again once it answers. A parameter server that does not answer fails the scheduled
  functions in flight at once with ParameterServerUnavailableError (``join()`` raises it
  within seconds), and new ones while it stays silent; one that answers again is used
  again (the training workers' channels reconnect by themselves).
- Parameter servers fence late updates: after ``join()`` the coordinator tells them that
  every function below a bound finished (``ps_forget``), and an update of such a function
  that arrives later (from a worker that was frozen, then woke up) is dropped.
- Every task the coordinator starts belongs to its TaskGroup; ``shutdown`` stops them.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import logging
import math
import secrets
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, cast

import cloudpickle

from .. import config
from .._async import LoopWaker, TaskGroup
from ..errors import (
    ClosureCancelledError,
    ParameterServerError,
    ParameterServerUnavailableError,
    RemoteValueArgumentError,
)
from . import _routing
from ._dashboard_hooks import report_coordinator
from ._runner_plugin import PerWorkerDataset, PerWorkerIterator, TrainingWorkerPlugin
from ._types import Call
from .strategy import InputContext, ParameterServerStrategy, _roles
from .variables import ShardedVariable, Variable

logger = logging.getLogger(__name__)

__all__ = ["ClusterCoordinator", "RemoteValue", "PerWorkerDataset", "PerWorkerIterator",
           "TrainingWorkerPlugin", "ClosureCancelledError"]


# ---------------------------------------------------------------------------------------
# coordinator side
# ---------------------------------------------------------------------------------------

_PENDING, _DONE, _FAILED, _CANCELLED = range(4)


class RemoteValue[T]:
    """The future result of a scheduled function (``T``: what the function returns)."""

    __slots__ = ("_coordinator", "_state", "_data", "_error", "_value", "_loaded")

    def __init__(self, coordinator: ClusterCoordinator) -> None:
        self._coordinator = coordinator
        self._state = _PENDING
        self._data: bytes | None = None
        self._error: BaseException | None = None
        self._value: Any = None
        self._loaded = False

    def done(self) -> bool:
        return self._state != _PENDING

    def fetch(self) -> T:
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
            return cast(T, self._value)
        assert self._error is not None  # failed or cancelled
        raise self._error

    get = fetch

    def __reduce__(self) -> NoReturn:
        raise RemoteValueArgumentError(
            "a RemoteValue cannot be an argument of a scheduled function (TensorFlow refuses "
            "it too): pass rv.fetch() instead")

    def __repr__(self) -> str:
        state = ["pending", "done", "failed", "cancelled"][self._state]
        return f"<RemoteValue {state}>"


def _refuse_remote_values(x: Any, depth: int = 0) -> None:
    """ValueError if ``x`` is (or holds, in plain containers) a RemoteValue."""
    if isinstance(x, RemoteValue):
        x.__reduce__()  # raises RemoteValueArgumentError
    if depth < 4 and isinstance(x, list | tuple | set | frozenset):
        for item in x:
            _refuse_remote_values(item, depth + 1)
    elif depth < 4 and isinstance(x, dict):
        for item in x.values():
            _refuse_remote_values(item, depth + 1)


class _Closure:
    __slots__ = ("fn_id", "fn", "args", "kwargs", "remote", "generation")

    def __init__(self, fn_id: int, fn: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any], remote: RemoteValue[Any], generation: int) -> None:
        self.fn_id, self.fn, self.args, self.kwargs = fn_id, fn, args, kwargs
        self.remote, self.generation = remote, generation



def _without_arguments(dataset_fn: Callable[..., Any]) -> Callable[[], Any]:
    """``dataset_fn``, given an :class:`InputContext` first when it needs an argument.

    Each training worker runs one input pipeline with one replica, so every worker gets the
    same context, as ``strategy.distribute_datasets_from_function`` gives it.
    """
    try:
        params = inspect.signature(dataset_fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: call it as it is
        return dataset_fn
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind in positional and p.default is p.empty for p in params):
        return functools.partial(dataset_fn, InputContext())
    return dataset_fn

class ClusterCoordinator:
    """Schedules functions on training workers (``tf.distribute.experimental.coordinator``).

    ``schedule`` returns a :class:`RemoteValue` at once; ``join`` waits for every scheduled
    function and raises the first error; ``done`` says whether all have finished. One
    coordinator per strategy: a second ``ClusterCoordinator(strategy)`` returns the first.
    """

    def __new__(cls, strategy: ParameterServerStrategy) -> ClusterCoordinator:
        existing = getattr(strategy, "_cluster_coordinator", None)
        if existing is not None:
            return existing  # type: ignore[no-any-return]
        return super().__new__(cls)

    def __init__(self, strategy: ParameterServerStrategy) -> None:
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
        self._feeders: dict[str, list[asyncio.Task[Any]]] = {}
        #: ``{worker: batches its feeders hold}``; ``{worker: {batch id: batch}}`` of the
        #: batches sent and not answered (in sending order); ``{batch id: index}``: where
        #: another worker took a batch over (see ``_take_over``: of the worker's answer and
        #: the withdraw's answer, the one that arrives second leaves the rest to the first).
        self._held: dict[str, int] = {}
        self._sent: dict[str, dict[int, list[_Closure]]] = {}
        self._cut: dict[int, int] = {}
        self._batch_ids = itertools.count(1)
        self._stealing = False
        #: Workers whose request failed, while the scheduler still lists them.
        self._dead: set[str] = set()
        #: ``{worker name: index}``: TensorFlow's worker index (stable across restarts).
        self._worker_index: dict[str, int] = {}
        #: Names of parameter servers the scheduler does not list now.
        self._ps_down: set[str] = set()
        #: Names of listed parameter servers that did not answer the last liveness probe.
        self._ps_silent: set[str] = set()
        self._liveness = config.get_seconds("ps.liveness-timeout")
        self._max_batch = int(config.get("ps.closures-per-batch"))
        self._slots = int(config.get("ps.batches-in-flight"))
        self._interval = config.get_seconds("ps.membership-interval")
        #: Counters: closures finished, re-queued after a worker loss, batches sent.
        self.stats = {"finished": 0, "requeued": 0, "batches": 0, "workers_lost": 0,
                      "workers_silent": 0, "workers_back": 0, "reconnects": 0,
                      "ps_silent": 0, "ps_back": 0, "withdrawn": 0}
        #: The per-worker datasets created and alive (their workers' iterators are released
        #: when they are garbage-collected, or at shutdown).
        self._per_worker: weakref.WeakValueDictionary[str, PerWorkerDataset] = \
            weakref.WeakValueDictionary()
        _routing.run_sync(self._client.loop, self._start)
        strategy._cluster_coordinator = self
        self._started = True

    @property
    def _fn_base(self) -> int:
        return self._uid << 32

    # -- the public API ------------------------------------------------------------------
    def schedule[T](self, fn: Callable[..., T], args: Sequence[Any] = (),
                    kwargs: dict[str, Any] | None = None) -> RemoteValue[T]:
        """Run ``fn(*args, **kwargs)`` on some training worker; returns a RemoteValue now.

        Raises the error of a previously failed function, if any (and clears it), and
        ValueError when an argument is a RemoteValue (fetch it first).
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        args, kwargs = tuple(args), dict(kwargs or {})
        _refuse_remote_values((args, kwargs))
        with self._cond:
            self._check_alive()
            self._raise_error_locked()
            remote: RemoteValue[T] = RemoteValue(self)
            closure = _Closure(self._fn_base + next(self._counter), fn, args, kwargs, remote,
                               self._generation)
            self._unfinished += 1
            if self._ps_silent:  # fails at once: the feeders may be waiting on that PS
                err = self._silent_ps_error()
                self._settle_locked(closure, _FAILED, err)
                self._record_error_locked(err)
                return remote
            self._queue.append(closure)
        self._waker.wake()
        return remote

    def join(self) -> None:
        """Wait until every scheduled function finished; raise the first error (then clear it)."""
        with self._cond:
            while self._unfinished and self._error is None:
                self._cond.wait(0.5)
                self._check_alive()
            self._raise_error_locked()
            below = self._fn_base + next(self._counter)  # ids are base + counter
        self._forget(below)

    def done(self) -> bool:
        """True when every scheduled function finished; raises the first error if any failed."""
        with self._cond:
            self._check_alive()
            self._raise_error_locked()
            return self._unfinished == 0

    def fetch(self, val: Any) -> Any:
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

    def create_per_worker_dataset(self, dataset_fn: Callable[[], Any]) -> PerWorkerDataset:
        """A dataset built on each training worker, lazily, from ``dataset_fn()``.

        ``dataset_fn`` takes no arguments, or an ``InputContext`` as the functions of
        ``strategy.distribute_datasets_from_function`` do (TensorFlow's module documentation
        of the tf.data service passes such a function here), and returns an iterable (a
        :class:`~dask_dataservice.Dataset`, a data-service dataset from
        ``from_dataset_id``, the result of ``strategy.distribute_datasets_from_function``,
        ...); a ``Dataset`` may be given directly.
        """
        if not callable(dataset_fn):
            ds = dataset_fn

            def dataset_fn():
                return ds

        dataset = PerWorkerDataset(_without_arguments(dataset_fn))
        self._per_worker[dataset._uid] = dataset
        # garbage-collected (with its iterators): the workers release theirs, without waiting
        final = weakref.finalize(dataset, _release_later, weakref.ref(self), dataset._uid)
        final.atexit = False
        return dataset

    def release_per_worker_dataset(self, dataset: PerWorkerDataset | PerWorkerIterator) -> None:
        """Close every training worker's iterator of ``dataset`` now (a data-service
        dataset's reader releases its iteration client); waits for the workers' answers.

        ``fit`` calls it for the input it built; a garbage-collected per-worker dataset (with
        its iterators) and ``shutdown`` do it too. A later function reading the dataset
        builds it again on its worker.
        """
        uid = dataset.dataset_uid if isinstance(dataset, PerWorkerIterator) else dataset._uid
        if self._client.status in ("closed", "closing"):
            return
        try:
            _routing.run_sync(self._client.loop, self._release, uid)
        except Exception as e:  # noqa: BLE001 - best effort: a lost worker released its own
            logger.debug("releasing per-worker dataset %s failed: %r", uid, e)

    def shutdown(self) -> None:
        """Stop the feeders (pending functions are cancelled) and release the training
        workers' per-worker iterators."""
        with self._cond:
            self._closing = True
            self._cancel_pending_locked(ClosureCancelledError("the coordinator was shut down"))
        for dataset in list(self._per_worker.values()):
            self.release_per_worker_dataset(dataset)
        try:
            _routing.run_sync(self._client.loop, self._group.stop)
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
        calls = [Call(a, "ps_forget", {"below": below, "above": self._fn_base})
                 for a in self.strategy.ps_addresses]
        try:  # a small request: bounded by the liveness timeout, not the request timeout
            _routing.call_many(calls, self._client, limit=self._liveness)
        except ParameterServerUnavailableError:
            raise
        except ParameterServerError as e:
            logger.warning("could not prune exactly-once records: %s", e)

    # -- event loop ----------------------------------------------------------------------
    async def _start(self) -> None:
        self._group = TaskGroup("ps-coordinator")
        self._have_work = asyncio.Event()
        self._waker = LoopWaker(asyncio.get_running_loop(), self._have_work.set)
        await self._refresh_workers()
        self._group.spawn(self._membership_loop)
        self._group.spawn(self._liveness_loop)

    async def _release(self, dataset_uid: str) -> None:
        """Ask every live training worker to close its iterator of ``dataset_uid``."""
        async def one(addr: str) -> None:
            try:
                await asyncio.wait_for(self._client.rpc(addr).ps_release_iterators(
                    dataset_uid=dataset_uid), self._liveness)
            except Exception as e:  # noqa: BLE001 - a lost worker holds nothing any more
                logger.debug("training worker %s did not release %s: %r", addr, dataset_uid, e)

        await asyncio.gather(*(one(a) for a in list(self._feeders) if a not in self._dead))

    def _release_soon(self, dataset_uid: str) -> None:
        """``_release`` in the coordinator's task group (from any thread, without waiting)."""
        if self._closing:
            return

        def spawn() -> None:
            if not self._closing:
                self._group.spawn(self._release, dataset_uid)

        loop = self._client.loop
        if loop is None:  # the client was closed
            return
        try:
            loop.add_callback(spawn)
        except Exception:  # noqa: BLE001 - the client's loop is closed
            pass

    async def _membership_loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(self._interval)
            if self._client.status in ("closed", "closing"):
                self._fatal = ParameterServerError("the coordinator's client was closed")
                with self._cond:
                    self._closing = True
                    self._cancel_pending_locked(self._fatal)
                self._have_work.set()
                return
            try:
                await self._refresh_workers()
                await report_coordinator(self)  # issue 14: queue depth on the dashboard
            except Exception as e:  # noqa: BLE001 - keep polling; the scheduler may be back
                logger.debug("membership poll failed: %s", e)

    async def _refresh_workers(self) -> None:
        assert self._client.scheduler is not None  # a connected client
        info = await self._client.scheduler.identity()
        listed = info.get("workers", {})
        _, workers = _roles(listed)
        self._dead &= set(listed)  # the scheduler dropped them: nothing left to avoid
        for addr in workers:
            name = str(listed[addr].get("name", addr))
            if name not in self._worker_index:
                self._worker_index[name] = len(self._worker_index)
            if addr not in self._feeders and addr not in self._dead:
                index = self._worker_index[name]
                self._feeders[addr] = [self._group.spawn(self._feed, addr, index)
                                       for _ in range(self._slots)]
        for addr in set(self._feeders) - set(workers):
            self._dead.add(addr)
            for t in self._feeders.pop(addr):
                t.cancel()
        await self._watch_ps(listed)

    async def _watch_ps(self, listed: dict[str, Any]) -> None:
        """Note parameter servers that left; point variables at the ones that came back."""
        by_name = {str(w.get("name", "")): a for a, w in listed.items()}
        strategy = self.strategy
        down = {n for n in strategy._ps_names if n not in by_name}
        if down - self._ps_down:
            logger.warning("parameter servers %s left the cluster", sorted(down - self._ps_down))
        moved = {n: by_name[n] for n in strategy._ps_names
                 if n in by_name and by_name[n] not in strategy._ps}
        for name, addr in moved.items():
            if await strategy._answers_async(addr):
                strategy._repoint({name: addr})
                self._ps_silent.discard(name)  # it answered at its new address
                self.stats["reconnects"] += 1
                logger.info("parameter server %s is back at %s", name, addr)
            else:
                down.add(name)
        self._ps_down = down

    async def _answers(self, address: str) -> bool:
        """Whether ``address`` answers a probe within the liveness timeout."""
        return await _routing.answers(self._client.rpc, address, self._liveness)

    async def _liveness_loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(self._interval)
            workers = sorted(set(self._feeders) | self._dead)
            strategy = self.strategy
            ps = [(n, a) for n, a in zip(strategy._ps_names, strategy.ps_addresses, strict=True)
                  if n not in self._ps_down]
            answers = await asyncio.gather(*(self._answers(a) for a in workers),
                                           *(self._answers(a) for _, a in ps))
            if self._closing:
                return
            for addr, ok in zip(workers, answers, strict=False):
                if not ok and addr in self._feeders:
                    self._lose_silent_worker(addr)
                elif ok and addr in self._dead:
                    logger.info("training worker %s answers again: using it again", addr)
                    self._dead.discard(addr)
                    self.stats["workers_back"] += 1
            current = dict(zip(strategy._ps_names, strategy.ps_addresses, strict=True))
            for (name, addr), ok in zip(ps, answers[len(workers):], strict=True):
                if current.get(name) != addr or name in self._ps_down:
                    continue  # it moved (or left) while probed: the next round decides
                if not ok and name not in self._ps_silent:
                    self._ps_silent.add(name)
                    self.stats["ps_silent"] += 1
                    self._fail_in_flight(self._silent_ps_error())
                elif ok and name in self._ps_silent:
                    self._ps_silent.discard(name)
                    self.stats["ps_back"] += 1
                    logger.info("parameter server %s (%s) answers again", name, addr)

    def _lose_silent_worker(self, addr: str) -> None:
        """A training worker that did not answer its probe: handled like a dead one."""
        logger.warning("training worker %s did not answer within %g s "
                       "(dataservice.ps.liveness-timeout): its functions run elsewhere",
                       addr, self._liveness)
        self.stats["workers_lost"] += 1
        self.stats["workers_silent"] += 1
        self._dead.add(addr)
        for t in self._feeders.pop(addr, []):
            t.cancel()  # the feeder puts its batch back in the queue

    def _silent_ps_error(self) -> ParameterServerUnavailableError:
        by_name = dict(zip(self.strategy._ps_names, self.strategy.ps_addresses, strict=True))
        names = ", ".join(f"{n} ({by_name.get(n)})" for n in sorted(self._ps_silent))
        return ParameterServerUnavailableError(
            f"parameter servers {names} did not answer within {self._liveness:g} s "
            "(dataservice.ps.liveness-timeout): frozen, hung or unreachable")

    def _fail_in_flight(self, err: BaseException) -> None:
        """Fail the functions scheduled now (``join()`` raises ``err`` at once)."""
        logger.warning("%s", err)
        with self._cond:
            if self._unfinished:
                self._record_error_locked(err)
            self._cond.notify_all()

    def _take(self) -> list[_Closure]:
        with self._cond:
            if not self._queue:
                return []
            share = math.ceil(len(self._queue) / max(1, len(self._feeders) * self._slots))
            n = max(1, min(self._max_batch, share))
            return [self._queue.popleft() for _ in range(min(n, len(self._queue)))]

    async def _feed(self, addr: str, worker_index: int) -> None:
        rpc = self._client.rpc(addr)
        while not self._closing:
            batch = self._take()
            if not batch:
                self._have_work.clear()
                batch = self._take()
                if not batch and not self._held.get(addr):
                    batch = await self._take_over(addr)
                if not batch:
                    await self._have_work.wait()
                    continue
            self._held[addr] = self._held.get(addr, 0) + 1
            try:
                if not await self._send(addr, rpc, worker_index, batch):
                    return
            finally:
                self._held[addr] -= 1

    async def _take_over(self, addr: str) -> list[_Closure]:
        """Worker ``addr`` is idle and nothing is queued: functions not started of a batch of
        the worker with most functions sent, given back by that worker (``ps_withdraw``)."""
        victims = [(sum(map(len, sent.values())), other) for other, sent in self._sent.items()
                   if other != addr and other in self._feeders
                   and (len(sent) > 1 or sum(map(len, sent.values())) > 1)]
        if self._stealing or not victims:
            return []
        _, victim = max(victims)
        self._stealing = True
        try:
            reply = await asyncio.wait_for(self._client.rpc(victim).ps_withdraw(
                coordinator=self._uid, batches=list(self._sent[victim])), 2 * self._liveness)
            batch_id, cut = reply.get("batch"), reply.get("from")
        except Exception as e:  # noqa: BLE001 - the victim's own feeder sees it fail
            logger.debug("taking work over from %s failed: %s", victim, e)
            return []
        finally:
            self._stealing = False
        batch = self._sent.get(victim, {}).get(batch_id) if cut is not None else None
        if batch is None:
            return []  # nothing to give, or answered meanwhile (its reply re-queues the rest)
        self._cut[batch_id] = cut
        self.stats["withdrawn"] += len(batch) - cut
        with self._cond:  # a failure meanwhile cancels them, as if they were still queued
            live = [c for c in batch[cut:] if c.generation == self._generation]
            for c in batch[cut:]:
                if c not in live:
                    self._settle_locked(c, _CANCELLED, ClosureCancelledError(
                        "cancelled: an earlier scheduled function failed"))
            self._cond.notify_all()
        return live

    async def _send(self, addr: str, rpc: Any, worker_index: int,
                    batch: list[_Closure]) -> bool:
        """Run ``batch`` on worker ``addr``; settle, re-queue or cancel its closures.
        False when the worker is lost (its feeders stop)."""
        if self._ps_down or self._ps_silent:
            err = ParameterServerUnavailableError(
                f"parameter servers {sorted(self._ps_down)} left the cluster") \
                if self._ps_down else self._silent_ps_error()
            self._finish(batch, [(False, cloudpickle.dumps(err))])
            return True
        generation = batch[0].generation
        loop = asyncio.get_running_loop()
        try:
            payload = await loop.run_in_executor(None, _pickle_batch, batch)
        except asyncio.CancelledError:
            self._requeue(batch)
            raise
        except Exception:  # noqa: BLE001 - a closure that does not pickle fails alone
            try:
                await self._fail_unpicklable(batch)
            except asyncio.CancelledError:
                self._requeue(batch)
                raise
            return True
        self.stats["batches"] += 1
        batch_id = next(self._batch_ids)
        sent = self._sent.setdefault(addr, {})
        sent[batch_id] = batch
        if sum(map(len, sent.values())) > 1 and any(
                not self._held.get(a) for a in self._feeders if a != addr):
            self._have_work.set()  # an idle worker may take part of it over (_take_over)
        try:
            reply = await rpc.ps_run_closures(
                payload=payload, coordinator=self._uid, generation=generation,
                worker_index=worker_index, batch=batch_id, size=len(batch))
        except asyncio.CancelledError:
            self._requeue(batch[:self._cut.pop(batch_id, len(batch))])
            raise
        except Exception as e:  # noqa: BLE001 - the worker is gone (or going)
            batch = batch[:self._cut.pop(batch_id, len(batch))]  # the rest runs elsewhere
            logger.info("training worker %s lost (%s: %s); re-queueing %d functions",
                        addr, type(e).__name__, e, len(batch))
            self.stats["workers_lost"] += 1
            self._requeue(batch)
            self._dead.add(addr)
            for t in self._feeders.pop(addr, []):
                if t is not asyncio.current_task():
                    t.cancel()
            return False
        finally:
            sent.pop(batch_id, None)
        try:
            checked = _routing.check(reply, Call(addr, "ps_run_closures", {}))
            results = checked["results"]
        except Exception as err:  # noqa: BLE001 - e.g. no runner plugin there
            checked, results = {}, [(False, cloudpickle.dumps(err))]
        taken = self._cut.pop(batch_id, None)
        cut = checked.get("cut")
        if taken is not None:
            batch = batch[:taken]  # another worker runs the rest
        elif cut is not None:  # given back, but the taker did not get the answer: re-queue
            self._requeue(batch[cut:])
            batch = batch[:cut]
        self._finish(batch, results)
        return True

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

    def _finish(self, batch: list[_Closure], results: list[Any]) -> None:
        with self._cond:
            for i, closure in enumerate(batch):
                if i >= len(results):
                    self._settle_locked(closure, _CANCELLED, ClosureCancelledError(
                        "cancelled: an earlier scheduled function failed"))
                    continue
                ok, data = results[i]
                if ok and closure.generation == self._generation:
                    closure.remote._data = data
                    self._settle_locked(closure, _DONE, None)
                elif ok:  # finished after a function of its generation failed (TF cancels)
                    self._settle_locked(closure, _CANCELLED, ClosureCancelledError(
                        "cancelled: a scheduled function failed while this one ran"))
                else:
                    try:
                        err = cloudpickle.loads(data)
                    except Exception as e:  # noqa: BLE001
                        err = ParameterServerError(f"a scheduled function failed: {e}")
                    if not isinstance(err, BaseException):
                        err = ParameterServerError(repr(err))
                    self._settle_locked(closure, _FAILED, err)
                    if closure.generation == self._generation:
                        self._record_error_locked(err)
            self.stats["finished"] += len(batch)
            self._cond.notify_all()

    async def _fail_unpicklable(self, batch: list[_Closure]) -> None:
        errors = await asyncio.get_running_loop().run_in_executor(None, _pickle_each, batch)
        with self._cond:
            good = [c for c, err in zip(batch, errors, strict=True) if err is None]
            for c, err in zip(batch, errors, strict=True):
                if err is not None:
                    if not isinstance(err, ValueError):  # a RemoteValue deep inside: as is
                        err = TypeError("a scheduled function or its arguments do not pickle: "
                                        f"{type(err).__name__}: {err}")
                    self._settle_locked(c, _FAILED, err)
                    self._record_error_locked(err)
            self._cond.notify_all()
        self._requeue(good)  # cancelled instead if one of them failed their generation
        self._have_work.set()

    def _settle_locked(self, closure: _Closure, state: int, error: BaseException | None) -> None:
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


def _release_later(ref: weakref.ref[ClusterCoordinator], dataset_uid: str) -> None:
    """A per-worker dataset was garbage-collected: release its workers' iterators."""
    coordinator = ref()
    if coordinator is not None:
        coordinator._release_soon(dataset_uid)


def _pickle_batch(batch: list[_Closure]) -> bytes:
    data: bytes = cloudpickle.dumps([(c.fn_id, c.fn, c.args, c.kwargs) for c in batch],
                                    protocol=5)
    return data


def _pickle_each(batch: list[_Closure]) -> list[BaseException | None]:
    """Which closures of ``batch`` do not pickle (their error) and which do (None)."""
    errors: list[BaseException | None] = []
    for c in batch:
        try:
            _pickle_batch([c])
            errors.append(None)
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    return errors
