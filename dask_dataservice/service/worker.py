"""DataWorkerPlugin: runs data-service tasks on a Dask worker.

Responsibilities
----------------
- Register with the dispatcher and reconcile tasks with it (``dataservice_worker_heartbeat``:
  "these are my tasks" → "start these, drop those"), and start tasks the dispatcher pushes
  (stream op ``dataservice-tasks``) at once.
- Run each task's pipeline in a thread of its own (never on the event loop, never in the
  worker's task executor) into a byte- and count-bounded :class:`ElementBuffer`.
- Serve ``dataservice_get_elements``: as many buffered elements as fit a count and byte
  budget in one reply, numpy buffers as zero-copy frames; hold the request open briefly
  when the buffer is empty (long poll).
- Under DYNAMIC sharding, feed the pipeline splits from the dispatcher through
  :class:`DispatcherSplitProvider`, which asks for the next split while the current one is
  read.

End of sequence is served only after the dispatcher has acknowledged the task as finished,
so a consumer that sees every task end can ask the dispatcher once and trust its answer.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import cloudpickle
import numpy as np
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol import to_serialize
from distributed.utils import run_in_executor_with_context

from .. import config
from ..data.splits import ListSplitProvider, SplitProvider
from ..data.structure import nbytes
from .._rpc import error_message
from ._messages import ElementBatch, raise_for_status
from ._sharding import ShardingPolicy
from ._exceptions import DataServiceError

logger = logging.getLogger(__name__)

PLUGIN_NAME = "dataservice-worker"

_local = threading.local()


def current_task() -> dict | None:
    """The data-service task whose pipeline runs in this thread, or None.

    A dict with ``task_id``, ``iteration_id``, ``job_id``, ``dataset_id``,
    ``processing_mode`` and, under static sharding, ``worker_index`` / ``num_workers``.
    Pipeline functions may use it, e.g. to seed per-worker randomness.
    """
    return getattr(_local, "task", None)


def worker_host(address: str) -> str:
    """The host part of a worker address (``tcp://10.0.0.5:1234`` → ``10.0.0.5``)."""
    hostport = address.split("://", 1)[-1]
    return hostport.rsplit(":", 1)[0].strip("[]") if ":" in hostport else hostport


class TaskCancelled(Exception):
    """Internal: the task was cancelled while its pipeline ran."""


class ElementBuffer:
    """Elements produced by a task's thread and served to consumers by the event loop.

    The producer blocks when the buffer holds ``max_bytes`` or ``max_elements``; consumers
    never block the loop: :meth:`get` waits on an asyncio event that the producer sets only
    when a consumer is waiting, so a busy stream costs no cross-thread wake-ups.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, max_bytes: int, max_elements: int):
        self._loop = loop
        self._items: deque = deque()
        self._sizes: deque = deque()
        self._bytes = 0
        self._max_bytes = max_bytes
        self._max_elements = max_elements
        self._cond = threading.Condition()
        self._event = asyncio.Event()
        self._waiting = False
        self._closed = False
        #: Set by the producer thread when the pipeline ended (or failed).
        self.produced_all = False
        #: Set on the loop once the dispatcher knows the task finished.
        self.end_visible = False
        self.error: BaseException | None = None
        self.produced = 0

    #: Elements the producer thread hands over at once (fewer when a consumer waits).
    chunk_size = 256
    #: Whether a request queued behind another may wait to gather more elements.
    lingers = True

    # -- producer thread ---------------------------------------------------------------
    def put_many(self, items: list, sizes: list | None = None) -> None:
        """Add elements (producer thread); blocks until :meth:`_room` says there is room."""
        if sizes is None:
            sizes = [_element_size(x) for x in items]
        with self._cond:
            while not self._room() and not self._closed:
                self._cond.wait(0.5)
            if self._closed:
                raise TaskCancelled
            self._items.extend(items)
            self._sizes.extend(sizes)
            self._bytes += sum(sizes)
            self.produced += len(items)
            self._added()
            if self._waiting:
                self._waiting = False
                self._loop.call_soon_threadsafe(self._event.set)

    def _room(self) -> bool:
        """Whether the producer may add elements now (called under the lock)."""
        return self._bytes < self._max_bytes and len(self._items) < self._max_elements

    def _added(self) -> None:
        """Hook run under the lock after elements were added."""

    @property
    def consumer_waiting(self) -> bool:
        """True while a request waits for elements (the producer should hand over at once)."""
        return self._waiting

    def finish(self, error: BaseException | None = None) -> None:
        with self._cond:
            self.error = error
            self.produced_all = True

    # -- event loop --------------------------------------------------------------------
    def wake(self) -> None:
        self._event.set()

    def take(self, max_elements: int, max_bytes: int) -> list:
        """Pop up to ``max_elements`` / about ``max_bytes`` of elements (never blocks)."""
        with self._cond:
            out = []
            taken = 0
            items, sizes = self._items, self._sizes
            while items and len(out) < max_elements and (taken < max_bytes or not out):
                size = sizes.popleft()
                out.append(items.popleft())
                taken += size
            if out:
                self._bytes -= taken
                self._cond.notify()
            elif not self.end_visible and not self._closed:
                self._waiting = True
                self._event.clear()
            return out

    async def wait(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._event.wait(), timeout)
        except TimeoutError:
            pass

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._items.clear()
            self._sizes.clear()
            self._bytes = 0
            self._cond.notify_all()
        self._event.set()

    @property
    def empty(self) -> bool:
        return not self._items


class SlidingWindowCache(ElementBuffer):
    """The cross-trainer cache of one task: a window of recent elements shared by trainers.

    Every trainer (a ``trainer_id``) has its own cursor into the task's element sequence, so
    trainers with different ids all see the same elements while the pipeline produces each
    element once. Consumers with the *same* id share one cursor (they split the elements).
    The window is bounded in bytes: the oldest elements are evicted when it is full, and a
    trainer whose cursor fell out of the window skips ahead to the oldest element still
    cached, so a slow trainer never holds back a fast one. Production is driven by demand:
    the pipeline runs ahead of the fastest trainer by at most ``lookahead`` elements.
    """

    #: Elements the producer hands over at once (small: production follows demand closely).
    chunk_size = 8
    #: No lingering: a trainer's request would follow production instead of falling behind.
    lingers = False

    def __init__(self, loop, max_bytes: int, lookahead: int = 256):
        super().__init__(loop, max_bytes=max_bytes, max_elements=2**62)
        self._base = 0  # sequence number of self._items[0]
        self._cursors: dict[str, int] = {}
        self._lookahead = lookahead
        #: Elements trainers skipped because they fell out of the window.
        self.skipped = 0

    def _head(self) -> int:
        return self._base + len(self._items)

    def _has_demand(self) -> bool:
        """Produce only for the fastest trainer, and never so far ahead of it that the
        window would evict elements it has not read yet."""
        lead = max(self._cursors.values(), default=self._base)
        ahead = self._head() - lead
        if ahead >= self._lookahead:
            return False
        if self._items:
            average = self._bytes / len(self._items)
            if (ahead + self.chunk_size) * average > self._max_bytes / 2:
                return False
        return True

    def _room(self) -> bool:
        return self._has_demand()

    def _added(self) -> None:
        # the window is full: evict the oldest elements (trainers behind them skip ahead)
        while self._bytes > self._max_bytes and len(self._items) > 1:
            self._bytes -= self._sizes.popleft()
            self._items.popleft()
            self._base += 1

    def take(self, max_elements: int, max_bytes: int, trainer_id: str | None = None) -> list:
        with self._cond:
            cursor = self._cursors.get(trainer_id, self._base)
            if cursor < self._base:
                self.skipped += self._base - cursor
                cursor = self._base
            start = cursor - self._base
            out = []
            taken = 0
            items, sizes = self._items, self._sizes
            i = start
            while i < len(items) and len(out) < max_elements and (taken < max_bytes or not out):
                out.append(items[i])
                taken += sizes[i]
                i += 1
            self._cursors[trainer_id] = cursor + len(out)
            if out:
                self._cond.notify()  # the lead may have moved: there may be demand now
            elif not self.end_visible and not self._closed:
                self._waiting = True
                self._event.clear()
                self._cond.notify()
            return out


class RoundBuffer:
    """Coordinated reads on one task: round ``k`` is the task's elements ``k*n .. k*n+n-1``.

    Consumer ``c`` of ``n`` gets element ``c`` of each round, so in every round all
    consumers read from the same worker, consecutive elements of its stream (a pipeline
    that emits rounds of ``n`` similar elements keeps the replicas of a synchronous step in
    step). Rounds are formed in order from the task's buffer and dropped once every consumer
    took its element. Consumers may run ahead of the slowest by ``max_ahead`` rounds; past
    that they wait, and after ``timeout`` seconds they get an error naming the laggards,
    rather than waiting forever for a consumer that stopped.
    """

    def __init__(self, runner: TaskRunner, num_consumers: int, timeout: float,
                 max_ahead: int = 64):
        self.runner = runner
        self.n = num_consumers
        self.timeout = timeout
        self.max_ahead = max_ahead
        self.rounds: dict[int, list] = {}
        self.taken: dict[int, set[int]] = {}
        self.next_form = 0
        self.oldest = 0
        self._lock = asyncio.Lock()
        self._progress = asyncio.Event()

    async def _form_next(self) -> None:
        buf = self.runner.buffer
        items: list = []
        while len(items) < self.n:
            got = buf.take(self.n - len(items), 2**62)
            items.extend(got)
            if len(items) < self.n:
                if buf.end_visible:
                    if buf.error is not None:
                        raise buf.error
                    raise DataServiceError(
                        "coordinated reads need an infinite dataset, and this one ended"
                    )
                await buf.wait(0.5)
        self.rounds[self.next_form] = items
        self.taken[self.next_form] = set()
        self.next_form += 1

    async def get(self, r: int, consumer: int):
        if r < self.oldest:
            raise DataServiceError(
                f"coordinated read: round {r} was already served to every consumer "
                f"(consumer {consumer} is out of step)"
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while r - self.oldest >= self.max_ahead:
            remaining = deadline - loop.time()
            if remaining <= 0:
                missing = sorted(set(range(self.n)) - self.taken.get(self.oldest, set()))
                raise TimeoutError(
                    f"coordinated read: consumers {missing} have not read round "
                    f"{self.oldest} for {self.timeout:g}s; they stopped or fell behind, so "
                    f"consumer {consumer} cannot go on (rounds must be read in step)"
                )
            self._progress.clear()
            try:
                await asyncio.wait_for(self._progress.wait(), remaining)
            except TimeoutError:
                pass
        async with self._lock:
            while r >= self.next_form:
                await self._form_next()
        element = self.rounds[r][consumer]
        taken = self.taken[r]
        taken.add(consumer)
        if len(taken) == self.n:
            del self.rounds[r], self.taken[r]
            while self.oldest < self.next_form and self.oldest not in self.rounds:
                self.oldest += 1
            self._progress.set()
        return element


class DispatcherSplitProvider(SplitProvider):
    """Serves a DYNAMIC task's source the splits the dispatcher hands out.

    Runs in the task's thread. It asks ahead: as soon as a batch of split indices arrives it
    requests the next batch, so the round trip hides behind reading. The batch size adapts:
    it doubles (up to ``MAX_BATCH``) whenever the source had to wait for a reply, so tiny
    splits cost few round trips, while slow pipelines keep asking for one split at a time.
    A split handed out but not yet finished counts as *in flight* at the dispatcher and is
    lost (never re-issued) if this worker dies: at-most-once visitation.
    """

    MAX_BATCH = 64

    def __init__(self, runner: TaskRunner, splits: list):
        self._runner = runner
        self._splits = splits
        self.repetition = 0
        self._pending = None
        self._local: deque = deque()
        self._ended = False
        self._batch = 1

    @property
    def num_splits(self) -> int:
        return len(self._splits)

    def _request(self):
        return asyncio.run_coroutine_threadsafe(
            self._runner.plugin._get_splits(self._runner.task, self.repetition, self._batch),
            self._runner.loop,
        )

    def _wait(self, fut):
        if not fut.done() and self._batch < self.MAX_BATCH:
            self._batch *= 2  # we are waiting on the dispatcher: ask for more at once
        while True:
            if self._runner.cancelled:
                fut.cancel()
                raise TaskCancelled
            try:
                return fut.result(timeout=0.5)
            except TimeoutError:
                continue

    def get_next(self):
        while not self._local:
            if self._ended:
                return None
            fut = self._pending if self._pending is not None else self._request()
            self._pending = None
            indices, ended = self._wait(fut)
            self._local.extend(indices)
            self._ended = ended
            if not ended:
                self._pending = self._request()
        return self._splits[self._local.popleft()]

    def reset(self) -> None:
        self.repetition += 1
        self._ended = False
        if self.repetition >= 2:
            # Splits two repetitions back have left the pipeline (short of a shuffle buffer
            # holding more than a whole repetition): stop counting them as in flight, so an
            # endless repeat() does not grow the dispatcher's in-flight set forever.
            asyncio.run_coroutine_threadsafe(
                self._runner.plugin._ack_splits(self._runner.task, self.repetition - 2),
                self._runner.loop,
            )


class TaskRunner:
    """One task: a pipeline running in its own thread into an :class:`ElementBuffer`."""

    def __init__(self, plugin: DataWorkerPlugin, task: dict, dataset, splits: list | None):
        self.plugin = plugin
        self.task = task
        self.task_id: int = task["task_id"]
        self.loop = plugin.loop
        self.dataset = dataset
        self.splits = splits
        self.cancelled = False
        if task.get("cross_trainer_cache"):
            self.buffer: ElementBuffer = SlidingWindowCache(
                self.loop, config.get_bytes("worker.cross-trainer-cache-bytes"))
        else:
            self.buffer = ElementBuffer(
                self.loop, config.get_bytes("worker.buffer-bytes"),
                int(config.get("worker.buffer-elements")),
            )
        self.thread = threading.Thread(
            target=self._run, name=f"dds-task-{self.task_id}", daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    def _iterator(self):
        mode = ShardingPolicy(self.task["processing_mode"])
        ds = self.dataset
        if mode == ShardingPolicy.DYNAMIC:
            return ds.iterate(DispatcherSplitProvider(self, self.splits))
        index, n = self.task.get("worker_index"), self.task.get("num_workers")
        if mode == ShardingPolicy.FILE:
            # this worker's files: every n-th, from its index (each repetition again)
            return ds.iterate(ListSplitProvider(self.splits[index::n]))
        if mode == ShardingPolicy.DATA:
            return iter(ds.shard(n, index))
        if mode == ShardingPolicy.HINT:
            return iter(ds.with_shard_hint(n, index) if ds.has_shard_hint else ds)
        return iter(ds)

    def _run(self) -> None:
        error = None
        it = None
        _local.task = dict(self.task)
        try:
            it = self._iterator()
            buf = self.buffer
            put_many = buf.put_many
            chunk: list = []
            sizes: list = []
            chunk_bytes = 0
            # Hand elements over in chunks (one lock round per chunk), but at once when a
            # consumer is waiting, so a slow pipeline's first element is not held back, and
            # once a chunk holds ~1 MiB, so large elements stay within the buffer's bound
            # (and their memory is reused instead of faulted in afresh).
            chunk_size = buf.chunk_size
            for x in it:
                size = _element_size(x)
                chunk.append(x)
                sizes.append(size)
                chunk_bytes += size
                if len(chunk) >= chunk_size or chunk_bytes >= _CHUNK_BYTES or buf._waiting:
                    put_many(chunk, sizes)
                    chunk, sizes, chunk_bytes = [], [], 0
            if chunk:
                put_many(chunk, sizes)
        except TaskCancelled:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the consumers
            error = e
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:  # noqa: BLE001
                    pass
            self.buffer.finish(error)
            if not self.cancelled:
                try:
                    self.loop.call_soon_threadsafe(self.plugin._task_produced_all, self)
                except RuntimeError:  # loop closed: the worker is shutting down
                    pass

    def cancel(self) -> None:
        self.cancelled = True
        self.buffer.close()


class _Turns:
    """Runs requests numbered 0, 1, 2, ... one after the other, in number order."""

    def __init__(self):
        self.next = 0
        self._waiters: dict[int, asyncio.Future] = {}

    async def wait_turn(self, seq: int, timeout: float) -> None:
        if seq <= self.next:
            return
        fut = self._waiters[seq] = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:  # an earlier request never came: go on rather than hang
            self._waiters.pop(seq, None)

    def done(self, seq: int) -> None:
        self.next = max(self.next, seq + 1)
        fut = self._waiters.pop(self.next, None)
        if fut is not None and not fut.done():
            fut.set_result(None)


class DataWorkerPlugin(WorkerPlugin):
    """The data service's half on each Dask worker (see the module docstring)."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, heartbeat_interval: float | None = None):
        #: Seconds between reconciliations with the dispatcher (default: config
        #: ``dataservice.worker.heartbeat-interval``).
        self.heartbeat_interval = heartbeat_interval
        self.tasks: dict[int, TaskRunner] = {}
        self.finished_tasks: set[int] = set()

    async def setup(self, worker) -> None:
        self.worker = worker
        self.loop = asyncio.get_running_loop()
        self.tasks = {}
        self.finished_tasks = set()
        self._datasets: dict[int, tuple[Any, list | None]] = {}
        self._dataset_locks: dict[int, asyncio.Lock] = {}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="dds-worker-io")
        self._closing = False
        #: Counters for tests and dashboards: tasks finished, elements they produced.
        self.stats = {"tasks_finished": 0, "elements_produced": 0, "batches_served": 0}
        self._task_arrived = asyncio.Event()
        #: ``{task_id: RoundBuffer}`` of coordinated-read tasks.
        self._rounds: dict[int, RoundBuffer] = {}
        #: ``{(task_id, consumer): _Turns}``: the order in which a consumer's requests run.
        self._order: dict[tuple[int, int | None], _Turns] = {}
        worker.handlers["dataservice_get_elements"] = self.get_elements
        worker.handlers["dataservice_get_rounds"] = self.get_rounds
        worker.handlers["dataservice_worker_state"] = self.worker_state
        worker.stream_handlers["dataservice-tasks"] = self.tasks_changed
        worker.extensions["dataservice"] = self
        self.is_data_worker = not any(
            worker.state.total_resources.get(r) for r in config.get("dispatcher.worker-resource-excluded") or ()
        )
        self._heartbeat_task = None
        if self.is_data_worker:
            self._heartbeat_task = asyncio.ensure_future(self._heartbeat_loop())

    async def teardown(self, worker) -> None:
        self._closing = True
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        for runner in list(self.tasks.values()):
            if runner is not None:
                runner.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)
        # Requests may still be in flight: answer them "closing" rather than "unknown op".
        worker.handlers["dataservice_get_elements"] = _closing_get_elements
        worker.handlers.pop("dataservice_worker_state", None)
        # Keep a no-op stream handler: an unknown stream op would break the scheduler stream.
        worker.stream_handlers["dataservice-tasks"] = _ignore
        worker.extensions.pop("dataservice", None)

    # Handlers
    ##########
    async def get_elements(self, task_id: int, max_elements: int = 4096,
                           max_bytes: int = 32 << 20, wait: float = 1.0,
                           consumer: int | None = None, seq: int | None = None,
                           trainer_id: str | None = None, linger: float = 0.0) -> dict:
        """Up to ``max_elements`` buffered elements of a task, or end of sequence.

        A consumer may keep several requests in flight; ``(consumer, seq)`` makes them take
        elements in the order it sent them, so a task's elements arrive in order.
        """
        if seq is None:
            return await self._get_elements(task_id, max_elements, max_bytes, wait, trainer_id,
                                            linger)
        key = (task_id, consumer)
        order = self._order.get(key)
        if order is None:
            order = self._order[key] = _Turns()
        await order.wait_turn(seq, timeout=wait + 10)
        try:
            return await self._get_elements(task_id, max_elements, max_bytes, wait, trainer_id,
                                            linger)
        finally:
            order.done(seq)

    async def _get_elements(self, task_id, max_elements, max_bytes, wait,
                            trainer_id=None, linger=0.0) -> dict:
        runner = self.tasks.get(task_id)
        if runner is None:
            if task_id in self.finished_tasks:
                return {"status": "OK", "elements": None, "end_of_sequence": True}
            # The consumer learnt of the task from the dispatcher before the task reached
            # this worker (or its dataset is still loading): wait for it a little.
            deadline = self.loop.time() + min(wait, 0.5)
            while self.tasks.get(task_id) is None and task_id not in self.finished_tasks:
                remaining = deadline - self.loop.time()
                if remaining <= 0:
                    return {"status": "OK", "elements": None, "end_of_sequence": False,
                            "unknown": task_id not in self.tasks}
                try:
                    await asyncio.wait_for(self._task_arrived.wait(), remaining)
                except TimeoutError:
                    pass
            runner = self.tasks.get(task_id)
            if runner is None:
                return {"status": "OK", "elements": None, "end_of_sequence": True}
        buf = runner.buffer
        if isinstance(buf, SlidingWindowCache):
            def take(n=max_elements):
                return buf.take(n, max_bytes, trainer_id)
        else:
            def take(n=max_elements):
                return buf.take(n, max_bytes)
        items = take()
        if not items and not buf.end_visible and not runner.cancelled:
            await buf.wait(wait)
            items = take()
        if items and linger > 0 and len(items) < max_elements and buf.lingers:
            # A request that is not at the head of its consumer's queue collects elements
            # of a slow pipeline for a moment, so that each costs less than a round trip.
            deadline = self.loop.time() + linger
            size = sum(map(_element_size, items))
            while len(items) < max_elements and size < max_bytes and not buf.end_visible \
                    and not runner.cancelled:
                more = take(max_elements - len(items))
                if more:
                    items.extend(more)
                    size += sum(map(_element_size, more))
                    continue
                remaining = deadline - self.loop.time()
                if remaining <= 0:
                    break
                await buf.wait(remaining)
        if items:
            self.stats["batches_served"] += 1
            return {"status": "OK", "elements": to_serialize(ElementBatch(items)), "end_of_sequence": False}
        if buf.end_visible:
            if buf.error is not None:
                return error_message(buf.error)
            return {"status": "OK", "elements": None, "end_of_sequence": True}
        return {"status": "OK", "elements": None, "end_of_sequence": runner.cancelled}

    async def get_rounds(self, task_id: int, first_round: int, count: int,
                         consumer_index: int, num_consumers: int) -> dict:
        """Coordinated reads: this consumer's elements of rounds ``first_round ..``."""
        try:
            runner = self.tasks.get(task_id)
            loop = self.loop
            deadline = loop.time() + 10
            while runner is None:  # the task has not reached this worker yet
                if task_id in self.finished_tasks or loop.time() > deadline:
                    raise DataServiceError(f"task {task_id} does not run on {self.worker.address}")
                await asyncio.sleep(0.005)
                runner = self.tasks.get(task_id)
            rounds = self._rounds.get(task_id)
            if rounds is None:
                rounds = self._rounds[task_id] = RoundBuffer(
                    runner, num_consumers, config.get_seconds("worker.coordinated-read-timeout"))
            if not 0 <= consumer_index < rounds.n:
                raise ValueError(f"consumer_index must be in [0, {rounds.n}), got {consumer_index}")
            out = [await rounds.get(r, consumer_index) for r in range(first_round, first_round + count)]
            return {"status": "OK", "elements": to_serialize(ElementBatch(out))}
        except Exception as e:  # noqa: BLE001 - errors travel as values
            return error_message(e)

    def worker_state(self) -> dict:
        return {
            "status": "OK",
            "is_data_worker": self.is_data_worker,
            "tasks": {
                tid: {"produced": r.buffer.produced, "buffered": len(r.buffer._items),
                      "produced_all": r.buffer.produced_all, "end_visible": r.buffer.end_visible}
                for tid, r in self.tasks.items() if r is not None
            },
            "finished_tasks": sorted(self.finished_tasks),
        }

    def tasks_changed(self, new_tasks=(), cancelled=()) -> None:
        """Stream handler: the dispatcher assigned or cancelled tasks. Never raises."""
        try:
            self._apply_tasks(new_tasks, cancelled)
        except Exception:  # noqa: BLE001 - a raising stream handler disconnects the worker
            logger.exception("dataservice: could not apply task changes")

    # Internals
    ###########
    def _apply_tasks(self, new_tasks, cancelled) -> None:
        for task_id in cancelled:
            runner = self.tasks.pop(task_id, None)
            if runner is not None:
                runner.cancel()
            self.finished_tasks.add(task_id)
            for key in [k for k in self._order if k[0] == task_id]:
                del self._order[key]
            self._rounds.pop(task_id, None)
        for task in new_tasks:
            tid = task["task_id"]
            if tid in self.tasks or tid in self.finished_tasks:
                continue
            self.tasks[tid] = None  # reserve while the dataset definition loads
            asyncio.ensure_future(self._start_task(dict(task)))

    async def _start_task(self, task: dict) -> None:
        tid = task["task_id"]
        try:
            dataset, splits = await self._get_dataset(task["dataset_id"])
            if self._closing or tid not in self.tasks:
                return
            runner = TaskRunner(self, task, dataset, splits)
            self.tasks[tid] = runner
            runner.start()
            self._signal_task_arrived()
        except Exception as e:  # noqa: BLE001 - reported to consumers through the task
            logger.warning("dataservice: task %s could not start: %r", tid, e)
            runner = TaskRunner(self, task, None, None)
            self.tasks[tid] = runner
            runner.buffer.finish(e)
            self._signal_task_arrived()
            self._task_produced_all(runner)

    def _signal_task_arrived(self) -> None:
        event, self._task_arrived = self._task_arrived, asyncio.Event()
        event.set()

    async def _get_dataset(self, dataset_id: int):
        cached = self._datasets.get(dataset_id)
        if cached is not None:
            return cached
        lock = self._dataset_locks.setdefault(dataset_id, asyncio.Lock())
        async with lock:
            if dataset_id in self._datasets:
                return self._datasets[dataset_id]
            resp = raise_for_status(
                await self.worker.scheduler.dataservice_get_dataset(dataset_id=dataset_id),
                "dataset lookup",
            )
            # Unpickling runs user code (cloudpickled functions): keep it off the loop.
            dataset, splits = await run_in_executor_with_context(
                self._executor, _load_dataset, resp["pipeline"], resp["splits"]
            )
            self._datasets[dataset_id] = (dataset, splits)
            return dataset, splits

    async def _get_splits(self, task: dict, repetition: int, count: int):
        """Split indices from the dispatcher; waits out a dispatcher that is going away.

        If the scheduler is closing (or unreachable), this worker is about to close too and
        its tasks will be cancelled; failing the task instead would report a bogus error
        to consumers.
        """
        while True:
            try:
                resp = await self.worker.scheduler.dataservice_get_split(
                    iteration_id=task["iteration_id"], task_id=task["task_id"],
                    repetition=repetition, count=count,
                )
            except OSError as e:
                logger.info("dataservice: split request failed (%r); retrying", e)
                resp = {"status": "closing"}
            if resp is None or resp.get("status") != "closing":
                break
            if self._closing:
                raise TaskCancelled
            await asyncio.sleep(0.1)
        resp = raise_for_status(resp, "split request")
        return resp["split_indices"], resp["end_of_splits"]

    async def _ack_splits(self, task: dict, repetition: int) -> None:
        try:
            await self.worker.scheduler.dataservice_ack_splits(
                task_id=task["task_id"], repetition=repetition)
        except Exception as e:  # noqa: BLE001 - only bookkeeping is lost
            logger.debug("dataservice: ack_splits failed: %r", e)

    def _task_produced_all(self, runner: TaskRunner) -> None:
        asyncio.ensure_future(self._finish_task(runner))

    async def _finish_task(self, runner: TaskRunner) -> None:
        """Tell the dispatcher the task finished, then let consumers see the end."""
        try:
            await self.worker.scheduler.dataservice_finish_task(
                task_id=runner.task_id, error=runner.buffer.error is not None
            )
        except Exception as e:  # noqa: BLE001 - the heartbeat reports it again
            logger.info("dataservice: finish_task(%s) failed: %r", runner.task_id, e)
        runner.buffer.end_visible = True
        runner.buffer.wake()
        self.stats["tasks_finished"] += 1
        self.stats["elements_produced"] += runner.buffer.produced

    async def _heartbeat_loop(self) -> None:
        interval = self.heartbeat_interval or config.get_seconds("worker.heartbeat-interval")
        delay = interval
        while not self._closing:
            try:
                answered = await self._heartbeat()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the dispatcher may be restarting
                logger.debug("dataservice heartbeat failed: %r", e)
                answered = True
            # No dispatcher on this scheduler (yet): back off, so that its log is not
            # flooded with "no handler" lines. Installing the dispatcher re-sends this plugin
            # to every worker, which restarts the heartbeat at once.
            delay = interval if answered else min(30.0, max(delay, interval) * 2)
            await asyncio.sleep(delay)

    async def _heartbeat(self) -> bool:
        w = self.worker
        active = [tid for tid, r in self.tasks.items() if r is None or not r.buffer.end_visible]
        done = [tid for tid, r in self.tasks.items() if r is not None and r.buffer.end_visible]
        resp = await w.scheduler.dataservice_worker_heartbeat(
            address=w.address, host=worker_host(w.address) if ":" in w.address else socket.gethostname(),
            nthreads=w.state.nthreads, active_tasks=active, finished_tasks=done,
        )
        if resp is None:  # the dispatcher is not installed (yet)
            return False
        raise_for_status(resp, "worker heartbeat")
        self._apply_tasks(resp.get("new_tasks", ()), resp.get("cancelled", ()))
        return True


_SCALARS = (int, float, bool, complex)
#: A producer hands its chunk over once it holds this many bytes.
_CHUNK_BYTES = 1 << 20


def _element_size(x: Any) -> int:
    t = type(x)
    if t is np.ndarray:
        return x.nbytes
    if t in _SCALARS or isinstance(x, np.generic):
        return 8
    return nbytes(x)


def _closing_get_elements(**kwargs) -> dict:
    return {"status": "OK", "elements": None, "end_of_sequence": False, "closing": True}


def _ignore(**kwargs) -> None:
    return None


def _load_dataset(pipeline: bytes, splits: bytes | None):
    dataset = cloudpickle.loads(pipeline)
    return dataset, (cloudpickle.loads(splits) if splits else None)
