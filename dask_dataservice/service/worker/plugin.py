"""DataWorkerPlugin: runs data-service tasks on a Dask worker.

Responsibilities
----------------
- Register with the dispatcher and reconcile tasks with it (``dataservice_worker_heartbeat``:
  "these are my tasks" → "start these, drop those"), and start tasks the dispatcher pushes
  (stream op ``dataservice-tasks``) at once.
- Run each task's pipeline in a thread of its own (never on the event loop, never in the
  worker's task executor) into a byte- and count-bounded buffer (:mod:`._buffers`).
- Serve ``dataservice_get_elements``: as many buffered elements as fit a count and byte
  budget in one reply, numpy buffers as zero-copy frames; hold the request open briefly
  when the buffer is empty (long poll).
- Under DYNAMIC sharding, feed the pipeline splits from the dispatcher through
  :class:`DispatcherSplitProvider`, which asks for the next split while the current one is
  read.

Ownership: every coroutine the plugin starts runs in its :class:`~dask_dataservice._async.TaskGroup`;
every task thread is tracked until it exited; dataset loading runs in an owned executor.
``teardown`` cancels the tasks, closes the buffers, and waits for the threads to end.

End of sequence is served only after the dispatcher has acknowledged the task as finished,
so a consumer that sees every task end can ask the dispatcher once and trust its answer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from distributed.comm.addressing import get_address_host
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol.serialize import to_serialize
from distributed.utils import offload, run_in_executor_with_context
from distributed.utils_comm import retry

from ... import config
from ..._async import TaskGroup, owned_executor, shutdown_executor
from ..._rpc import error_message, handler
from ...data._stats import PipelineStats
from ...data.splits import ListSplitProvider
from ...errors import DataServiceError
from ..protocol._frames import choose_codec
from ..protocol._job_checks import JobAccessDeniedError, check_job_token
from ..protocol._malloc import tune_malloc_from_config
from ..protocol._messages import ElementBatch, TaskDef, raise_for_status
from ..protocol._metrics import count_served
from ..protocol._positions import tracked_elements
from ..protocol._sharding import ShardingPolicy
from . import dask_source  # noqa: F401 - installs the cluster side of Dataset.from_dask
from ._autocache import SplitCache
from ._buffers import ElementBuffer, RoundBuffer, TaskCancelled, element_size, task_buffer
from ._element_port import ElementPort
from ._figures import WorkerFigures
from ._split_provider import DispatcherSplitProvider
from ._worker_key import WorkerKey
from ._worker_util import (
    TurnFutures,
    call_soon,
    copy_outcome,
    load_dataset,
    offload_bytes,
    serialized_batch,
)
from .core import (
    CancelTask,
    Effect,
    ForgetDatasets,
    Recent,
    SendFinishTask,
    ShowEnd,
    StartTask,
    WorkerCore,
    empty_reply,
    heartbeat_delay,
    may_linger,
    unknown_task_reply,
)

if TYPE_CHECKING:
    from distributed import Worker

    from ...data.dataset import Dataset

logger = logging.getLogger(__name__)

__all__ = ["PLUGIN_NAME", "DataWorkerPlugin", "TaskRunner", "current_task"]

PLUGIN_NAME = "dataservice-worker"

#: A producer hands its chunk over once it holds this many bytes.
_CHUNK_BYTES = 1 << 20
#: Unpickled pipelines kept after their last task left (a re-read skips the reload).
_UNUSED_DATASETS = 8
#: How long teardown waits for task threads stuck in user code.
_JOIN_TIMEOUT = 10.0

_local = threading.local()


def current_task() -> TaskDef | None:
    """The data-service task whose pipeline runs in this thread, or None.

    A dict with ``task_id``, ``iteration_id``, ``job_id``, ``dataset_id``,
    ``processing_mode`` and, under static sharding, ``worker_index`` / ``num_workers``.
    Pipeline functions may use it, e.g. to seed per-worker randomness.
    """
    return getattr(_local, "task", None)


class TaskRunner:
    """One task: a pipeline running in its own thread into an :class:`ElementBuffer`."""

    def __init__(self, plugin: DataWorkerPlugin, task: TaskDef, dataset: Dataset | None,
                 splits: list[Any] | None) -> None:
        self.plugin = plugin
        self.task = task
        self.task_id: int = task["task_id"]
        self.dataset_id: int = task["dataset_id"]
        self.loop = plugin.loop
        self.dataset = dataset
        self.splits = splits
        self.cancelled = False
        self.buffer: ElementBuffer = task_buffer(self.loop, task)
        self.pipeline_stats = PipelineStats()  #: per-op figures (the dashboard polls them)
        #: Set (on the loop) once the thread returned.
        self.exited = asyncio.Event()
        self._waiting_on: concurrent.futures.Future[Any] | None = None
        #: Elements made and not handed to the buffer yet, and their sizes (the task
        #: thread's own: :meth:`_run`, :meth:`wait`).
        self._chunk: list[Any] = []
        self._sizes: list[Any] = []
        self.thread = threading.Thread(
            target=self._run, name=f"dds-task-{self.task_id}", daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    def wait(self, fut: concurrent.futures.Future[Any]) -> Any:
        """The result of ``fut`` (task thread); TaskCancelled once the task is cancelled.

        On the task's thread, the elements it made but has not handed over yet go to the
        buffer first: a DYNAMIC source waiting for its next split held them back for a round
        trip (issue 25: the first element waited for the second split). Not on another
        thread (a ``prefetch`` runs the source in its own): the chunk is the task thread's,
        which may be adding to it at that moment."""
        if self._chunk and not fut.done() and threading.current_thread() is self.thread:
            self._flush()
        self._waiting_on = fut
        try:
            if self.cancelled:
                fut.cancel()
            return fut.result()
        except concurrent.futures.CancelledError:
            raise TaskCancelled from None
        finally:
            self._waiting_on = None

    def _iterator(self) -> Iterator[Any]:
        mode = ShardingPolicy(self.task["processing_mode"])
        ds = self.dataset
        assert ds is not None  # a runner without a dataset never starts its thread
        if self.task.get("position"):  # issue 13: a job tracking input positions
            it, self.buffer.ledger = tracked_elements(ds._op, mode, DispatcherSplitProvider(
                self, self.splits or []), self.task["position"], str(self.plugin.worker.name))
            return it
        kw: dict[str, Any] = {"stats": self.pipeline_stats, "autocache": self.plugin.autocache}
        if mode == ShardingPolicy.DYNAMIC:
            assert self.splits is not None  # DYNAMIC datasets have splits
            return ds.iterate(DispatcherSplitProvider(self, self.splits), **kw)
        index, n = self.task.get("worker_index"), self.task.get("num_workers")
        if mode == ShardingPolicy.FILE:
            # this worker's files: every n-th, from its index (each repetition again)
            assert self.splits is not None  # FILE datasets have splits
            return ds.iterate(ListSplitProvider(self.splits[index::n]), **kw)
        if mode == ShardingPolicy.DATA:
            return ds.shard(n, index).iterate(**kw)
        if mode == ShardingPolicy.HINT:
            assert n is not None and index is not None  # static modes have both
            return (ds.with_shard_hint(n, index) if ds.has_shard_hint else ds).iterate(**kw)
        return ds.iterate(**kw)

    def _flush(self) -> None:
        """Hand the elements made so far to the buffer (task thread)."""
        self.buffer.put_many(self._chunk, self._sizes)
        self._chunk.clear()  # put_many copied them
        self._sizes.clear()

    def _run(self) -> None:
        error = None
        it = None
        _local.task = dict(self.task)
        try:
            it = self._iterator()
            buf = self.buffer
            chunk, sizes = self._chunk, self._sizes
            # Hand elements over in chunks (one lock round per chunk), but at once when a
            # consumer is waiting, so a slow pipeline's first element is not held back, and
            # once a chunk holds ~1 MiB, so large elements stay within the buffer's bound
            # (and their memory is reused instead of faulted in afresh); and before the
            # thread waits on the loop (:meth:`wait`).
            chunk_size = buf.chunk_size
            chunk_bytes = 0  # since the last flush here (one in wait() only makes it early)
            for x in it:
                size = element_size(x)
                chunk.append(x)
                sizes.append(size)
                chunk_bytes += size
                if len(chunk) >= chunk_size or chunk_bytes >= _CHUNK_BYTES or buf._waiting:
                    self._flush()
                    chunk_bytes = 0
            if chunk:
                self._flush()
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
            _local.task = None
            self.pipeline_stats.end()
            self.buffer.finish(error)
            if not self.cancelled:
                self.plugin.submit(self.plugin._input_ended, self)
            call_soon(self.loop, self.exited.set)

    def cancel(self) -> None:
        self.cancelled = True
        fut = self._waiting_on
        if fut is not None:
            fut.cancel()
        self.buffer.close()


class DataWorkerPlugin(WorkerPlugin):
    """The data service's half on each Dask worker (see the module docstring)."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, heartbeat_interval: float | None = None) -> None:
        #: Seconds between reconciliations with the dispatcher (default: config
        #: ``dataservice.worker.heartbeat-interval``).
        self.heartbeat_interval = heartbeat_interval
        self.tasks: dict[int, TaskRunner | None] = {}
        #: Every task / turn / end-of-sequence decision (:mod:`.core`).
        self.core = WorkerCore()

    @property
    def finished_tasks(self) -> Recent:
        """Ids of the tasks that finished or were cancelled here (recent ones)."""
        return self.core.finished

    async def setup(self, worker: Worker) -> None:
        self.worker = worker
        self.loop = asyncio.get_running_loop()
        tune_malloc_from_config()  # issue 16: dataservice.malloc-tuning
        self.tasks = {}
        self.core = WorkerCore()
        #: ``{dataset_id: (dataset, splits)}``, most recently used last.
        self._datasets: OrderedDict[int, tuple[Any, list[Any] | None]] = OrderedDict()
        #: ``{dataset_id: its compression}`` ("AUTO", None or a codec; issue 16, see _frames).
        self._compression: dict[int, str | None] = {}
        #: Datasets being loaded: concurrent starts of one dataset share one load.
        self._loading: dict[int, asyncio.Future[Any]] = {}
        #: Runners whose thread has not exited yet (also cancelled ones).
        self._runners: set[TaskRunner] = set()
        self._executor = owned_executor("dds-worker-io", 1)
        self._group = TaskGroup("dataservice worker")
        self._closing = False
        self._wake_heartbeat = asyncio.Event()
        #: Counters for tests and dashboards: tasks finished, elements they produced.
        self.stats = {"tasks_finished": 0, "elements_produced": 0, "batches_served": 0,
                      "batches_compressed": 0, "requests_replayed": 0}
        self.figures = WorkerFigures()  # request latency, ended tasks' per-op figures
        self.autocache = SplitCache(worker.local_directory)  # issue 26: autocache() ops
        #: ``{task_id: [elements, bytes]}`` served per task (the dashboard's figures).
        self.served_by_task: dict[int, list[int]] = {}
        self._task_arrived = asyncio.Event()
        #: ``{task_id: RoundBuffer}`` of coordinated-read tasks.
        self._rounds: dict[int, RoundBuffer] = {}
        #: The asyncio half of the core's request order: kept replies, turn waiters.
        self._turns = TurnFutures(self.core)
        worker.handlers["dataservice_get_elements"] = self.get_elements
        worker.handlers["dataservice_get_rounds"] = self.get_rounds
        worker.handlers["dataservice_worker_state"] = self.worker_state
        worker.stream_handlers["dataservice-tasks"] = self.tasks_changed
        self._port = await ElementPort.open(worker)  # issue 25: elements on plain streams
        self._key = WorkerKey(worker)
        self._key.install()
        worker.extensions["dataservice"] = self
        self.is_data_worker = not any(
            worker.state.total_resources.get(r) for r in config.get("dispatcher.worker-resource-excluded") or ()
        )
        if self.is_data_worker:
            self._group.spawn(self._heartbeat_loop)

    async def teardown(self, worker: Worker) -> None:
        self._closing = True
        # Requests may still be in flight: answer them "closing" rather than "unknown op".
        worker.handlers["dataservice_get_elements"] = _closing_get_elements
        worker.handlers.pop("dataservice_worker_state", None)
        # Keep a no-op stream handler: an unknown stream op would break the scheduler stream.
        worker.stream_handlers["dataservice-tasks"] = _ignore
        self._key.uninstall()
        worker.extensions.pop("dataservice", None)
        for runner in list(self._runners):
            runner.cancel()
        self.tasks.clear()
        await self._group.stop()
        await self._join_threads()
        # the io executor runs one job at a time: once this ran, joining it cannot block
        await run_in_executor_with_context(self._executor, self.autocache.close)
        shutdown_executor(self._executor)
        self._datasets.clear()
        self._rounds.clear()
        self._turns.clear()
        await self._port.close()

    async def _join_threads(self) -> None:
        runners = list(self._runners)
        if not runners:
            return
        try:
            await asyncio.wait_for(
                asyncio.gather(*(r.exited.wait() for r in runners)), _JOIN_TIMEOUT)
        except TimeoutError:
            stuck = sorted(r.task_id for r in runners if not r.exited.is_set())
            logger.warning("dataservice: task threads %s did not stop within %gs (a pipeline "
                           "function blocks); leaving them", stuck, _JOIN_TIMEOUT)
            return
        for r in runners:
            r.thread.join()  # returned already: joins at once

    # Thread → loop
    ###############
    def submit(self, afunc: Callable[..., Coroutine[Any, Any, Any]],
               *args: Any) -> concurrent.futures.Future[Any]:
        """Run ``afunc(*args)`` in the plugin's task group, from any thread.

        Returns a concurrent future of its result; cancelling the future cancels the task.
        After teardown (or with the loop closed) the future is cancelled at once.
        """
        out: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def start() -> None:
            if out.cancelled():
                return
            try:
                task = self._group.spawn(afunc, *args)
            except Exception:  # noqa: BLE001 - the group is closed: we are shutting down
                out.cancel()
                return
            task._dds_awaited = True  # type: ignore[attr-defined]  # its outcome goes to `out`
            task.add_done_callback(lambda t: copy_outcome(t, out))
            out.add_done_callback(
                lambda f: f.cancelled() and call_soon(self.loop, task.cancel))  # type: ignore[func-returns-value]

        try:
            self.loop.call_soon_threadsafe(start)
        except RuntimeError:  # the loop is closed: nothing will run it
            out.cancel()
        return out

    def post(self, afunc: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        """Run ``afunc(*args)`` in the plugin's task group, from any thread, for its effect
        only (no future, no outcome to copy: a DYNAMIC task acknowledges each repetition
        so). Dropped after teardown; its errors are logged by the group."""
        def start() -> None:
            with contextlib.suppress(Exception):  # the group is closed: we are shutting down
                self._group.spawn(afunc, *args)

        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing will run it
            self.loop.call_soon_threadsafe(start)

    # Handlers
    ##########
    @handler
    async def get_elements(self, task_id: int, max_elements: int = 4096,
                           max_bytes: int = 32 << 20, wait: float = 1.0,
                           consumer: int | None = None, seq: int | None = None,
                           trainer_id: str | None = None, linger: float = 0.0,
                           job_token: str | None = None,
                           codecs: list[str] | None = None,
                           ack: int | None = None) -> dict[str, Any]:
        """Up to ``max_elements`` buffered elements of a task, or end of sequence.

        A consumer may keep several requests in flight; ``(consumer, seq)`` makes them take
        elements in the order it sent them, so a task's elements arrive in order. Only the
        job's consumers may read: ``job_token`` must be the job's token. ``codecs``: the
        compression codecs the consumer accepts, best first (none: send raw).

        ``ack``: the consumer received every reply up to that ``seq``. A consumer that sends
        acks gets its replies kept until acknowledged: a request sent again because its
        connection broke (the reply may have been lost on the way) is answered with the same
        elements instead of losing them, and says how many read the task (``consumers``)."""
        if seq is None:
            return await self.figures.timed(self._get_elements(  # the dashboard's latency
                task_id, max_elements, max_bytes, wait, trainer_id, linger, job_token, codecs))
        key = (task_id, consumer)
        turn = self.core.turn(key, seq, ack)
        turns = self._turns
        if turn.forget:
            turns.forget(key, turn.forget)
        if turn.replay:  # sent again: the first answer (or the one under way)
            self.stats["requests_replayed"] += 1
            return await asyncio.shield(turns.kept(key, seq))
        kept = turns.keep(key, seq) if turn.keep else None
        try:
            if turn.wait:
                await turns.wait_turn(key, seq, timeout=wait + 10)
        except asyncio.CancelledError:
            turns.drop(key, seq, kept)
            raise
        try:
            reply = await self.figures.timed(self._get_elements(
                task_id, max_elements, max_bytes, wait, trainer_id, linger, job_token, codecs))
        except asyncio.CancelledError:
            turns.drop(key, seq, kept)  # a request sent again computes its reply afresh
            raise
        except Exception as e:
            if kept is not None:
                kept.set_exception(e)
                kept.exception()  # retrieved: no "never retrieved" warning if not replayed
            raise
        finally:
            turns.done(key, seq)
        if reply.get("elements") is not None:  # a shared job's reader holds little when not alone
            reply["consumers"] = self.core.consumers(task_id)
        if kept is not None:
            kept.set_result(reply)  # a replay under way gets it; later ones only if kept
            if not self.core.keep_reply(key, seq, reply.get("elements") is not None):
                turns.forget(key, (seq,))
        return reply

    async def _runner(self, task_id: int, timeout: float) -> TaskRunner | None:
        """The task's runner; waits up to ``timeout`` for a task that has not arrived yet."""
        deadline = self.loop.time() + timeout
        while (runner := self.tasks.get(task_id)) is None:
            remaining = deadline - self.loop.time()
            if task_id in self.finished_tasks or remaining <= 0:
                return None
            try:
                await asyncio.wait_for(self._task_arrived.wait(), remaining)
            except TimeoutError:
                pass
        return runner

    async def _get_elements(self, task_id: int, max_elements: int, max_bytes: int, wait: float,
                            trainer_id: str | None = None, linger: float = 0.0,
                            job_token: str | None = None,
                            codecs: list[str] | None = None) -> dict[str, Any]:
        runner = self.tasks.get(task_id)
        if runner is None:
            # The consumer learnt of the task from the dispatcher before the task reached
            # this worker (or its dataset is still loading): wait for it a little.
            runner = await self._runner(task_id, min(wait, 0.5))
            if runner is None:
                return unknown_task_reply(task_id, task_id in self.core.finished,
                                          self.core.knows(task_id))
        _check_token(runner, job_token, "reading elements")
        buf = runner.buffer

        def take(n: int = max_elements) -> list[Any]:
            return buf.take(n, max_bytes, trainer_id)
        items = take()
        if not items and not buf.end_visible and not runner.cancelled:
            await buf.wait(wait)
            items = take()
        size = buf.taken_bytes  # issue 22: sized once, when produced (no pass per element)
        runs = [buf.taken_runs]  # issue 25: a tracking task's runs of the elements taken
        if may_linger(len(items), max_elements, linger, buf.lingers):
            # A request that is not at the head of its consumer's queue collects elements
            # of a slow pipeline for a moment, so that each costs less than a round trip.
            deadline = self.loop.time() + linger
            while len(items) < max_elements and size < max_bytes and not buf.end_visible \
                    and not runner.cancelled:
                more = take(max_elements - len(items))
                if more:
                    items.extend(more)
                    size += buf.taken_bytes
                    runs.append(buf.taken_runs)
                    continue
                remaining = deadline - self.loop.time()
                if remaining <= 0:
                    break
                await buf.wait(remaining)
        if items:
            self.stats["batches_served"] += 1
            count_served(self.stats, self.served_by_task, self.tasks, runner.task_id,
                         len(items), size)  # issue 14: dashboard (service/protocol/_metrics.py)
            # Serialized here (not by the comm) so that an element that cannot travel is a
            # clear error; a big batch off the loop, as the comm would (distributed.comm.offload).
            codec = choose_codec(self._compression.get(runner.dataset_id), codecs)  # issue 16
            if size > offload_bytes() or (codec is not None and size > 1 << 20):
                elements = await offload(serialized_batch, runner, items, codec, runs)
            else:
                elements = serialized_batch(runner, items, codec, runs)
            if elements.header.get("compression"):
                self.stats["batches_compressed"] += 1
            return {"status": "OK", "elements": elements, "end_of_sequence": False}
        reply = empty_reply(buf.end_visible, buf.error, runner.cancelled)
        if isinstance(reply, BaseException):
            return error_message(reply)  # type: ignore[return-value]  # distributed's TypedDict
        return reply

    @handler
    async def get_rounds(self, task_id: int, first_round: int, count: int,
                         consumer_index: int, num_consumers: int,
                         job_token: str | None = None) -> dict[str, Any]:
        """Coordinated reads: this consumer's elements of rounds ``first_round ..``."""
        runner = await self._runner(task_id, 10.0)
        if runner is None:
            raise DataServiceError(f"task {task_id} does not run on {self.worker.address}")
        _check_token(runner, job_token, "reading rounds")
        rounds = self._rounds.get(task_id)
        if rounds is None:
            rounds = self._rounds[task_id] = RoundBuffer(
                runner.buffer, num_consumers, config.get_seconds("worker.coordinated-read-timeout"))
        if not 0 <= consumer_index < rounds.n:
            raise ValueError(f"consumer_index must be in [0, {rounds.n}), got {consumer_index}")
        out = [await rounds.get(r, consumer_index) for r in range(first_round, first_round + count)]
        return {"status": "OK", "elements": to_serialize(ElementBatch(out))}

    def worker_state(self) -> dict[str, Any]:
        return {
            "status": "OK",
            "is_data_worker": self.is_data_worker,
            "tasks": {
                tid: {"produced": r.buffer.produced, "buffered": len(r.buffer),
                      "produced_all": r.buffer.produced_all, "end_visible": r.buffer.end_visible,
                      "unacknowledged": self.core.unacknowledged(tid)}
                for tid, r in self.tasks.items() if r is not None
            },
            "finished_tasks": sorted(self.finished_tasks),
            "datasets": sorted(self._datasets),
            "threads": len(self._runners),
        }

    def tasks_changed(self, new_tasks: Iterable[TaskDef] = (), cancelled: Iterable[int] = ()) -> None:
        """Stream handler: the dispatcher assigned or cancelled tasks. Never raises."""
        try:
            self._apply_tasks(new_tasks, cancelled)
        except Exception:  # noqa: BLE001 - a raising stream handler disconnects the worker
            logger.exception("dataservice: could not apply task changes")

    # Internals
    ###########
    def _apply_tasks(self, new_tasks: Iterable[TaskDef], cancelled: Iterable[int]) -> None:
        self._execute(self.core.tasks_changed(new_tasks, cancelled))

    def _execute(self, effects: list[Effect], runner: TaskRunner | None = None) -> None:
        """Carry out what the core decided (on the loop)."""
        cancelled = False
        for effect in effects:
            if isinstance(effect, StartTask):
                self.tasks[effect.task["task_id"]] = None  # reserved while its dataset loads
                self._group.spawn(self._start_task, effect.task)
            elif isinstance(effect, CancelTask):
                self._cancel(effect.task_id)
                cancelled = True
            elif isinstance(effect, SendFinishTask):
                assert runner is not None  # the core answers it to the runner's own stimulus
                self._group.spawn(self._send_finish, effect, runner)
            elif isinstance(effect, ShowEnd):
                if runner is not None:
                    runner.buffer.show_end()
            elif isinstance(effect, ForgetDatasets):
                self._datasets.clear()
        if cancelled:
            self._release_unused_datasets()

    def _cancel(self, task_id: int) -> None:
        runner = self.tasks.pop(task_id, None)
        if runner is not None:
            runner.cancel()
        self._rounds.pop(task_id, None)
        self._turns.drop_task(task_id)  # waiting requests go on (and get end of sequence)

    async def _start_task(self, task: TaskDef) -> None:
        tid = task["task_id"]
        try:
            dataset, splits = await self._get_dataset(task["dataset_id"])
            if self._closing or not self.core.knows(tid):
                return
            runner = TaskRunner(self, task, dataset, splits)
        except Exception as e:  # noqa: BLE001 - reported to consumers through the task
            if self._closing or not self.core.knows(tid):
                return
            logger.warning("dataservice: task %s could not start: %r", tid, e)
            runner = TaskRunner(self, task, None, None)
            runner.buffer.finish(e)
            runner.exited.set()
            self.tasks[tid] = runner
            self._signal_task_arrived()
            self._execute(self.core.task_failed_to_start(tid), runner)
            return
        self.core.task_started(tid)
        self.tasks[tid] = runner
        self._runners.add(runner)
        self._group.spawn(self._forget_when_exited, runner)
        runner.start()
        self._signal_task_arrived()

    async def _forget_when_exited(self, runner: TaskRunner) -> None:
        try:
            await runner.exited.wait()
        finally:
            self._runners.discard(runner)
            self._release_unused_datasets()

    def _release_unused_datasets(self) -> None:
        """Keep only pipelines a task still uses, plus the few most recently used."""
        used = {r.dataset_id for r in self._runners} | {
            r.dataset_id for r in self.tasks.values() if r is not None}
        unused = [d for d in self._datasets if d not in used]
        for dataset_id in unused[:max(0, len(unused) - _UNUSED_DATASETS)]:
            del self._datasets[dataset_id]
            self._compression.pop(dataset_id, None)

    def _signal_task_arrived(self) -> None:
        event, self._task_arrived = self._task_arrived, asyncio.Event()
        event.set()

    async def _get_dataset(self, dataset_id: int) -> tuple[Any, list[Any] | None]:
        cached = self._datasets.get(dataset_id)
        if cached is not None:
            self._datasets.move_to_end(dataset_id)
            return cached
        loading = self._loading.get(dataset_id)
        if loading is None:
            loading = self._loading[dataset_id] = self._group.spawn(self._load_dataset, dataset_id)
            loading._dds_awaited = True  # type: ignore[attr-defined]  # see TaskGroup
            loading.add_done_callback(lambda _: self._loading.pop(dataset_id, None))
        return await asyncio.shield(loading)

    async def _load_dataset(self, dataset_id: int) -> tuple[Any, list[Any] | None]:
        key = await self._key.get()
        try:
            resp = raise_for_status(await self.worker.scheduler.dataservice_get_dataset(
                dataset_id=dataset_id, address=self.worker.address, worker_key=key,
            ), "dataset lookup")
        except JobAccessDeniedError:
            self._key.forget()  # a new dispatcher: the next attempt asks for a new key
            raise
        # Unpickling runs user code (cloudpickled functions): keep it off the loop.
        loaded = await run_in_executor_with_context(
            self._executor, load_dataset, resp["pipeline"], resp["splits"]
        )
        self._datasets[dataset_id] = loaded
        self._compression[dataset_id] = resp.get("compression", "AUTO")
        self._release_unused_datasets()
        return loaded

    async def _get_splits(self, task: TaskDef, repetition: int, count: int,
                          received: int = 0, first: bool = False
                          ) -> tuple[list[int], bool, bool]:
        """Split indices from the dispatcher, whether the repetition ended, and whether the
        task is drained (its worker retires: no split comes any more, issue 26); rides out
        a dispatcher that is going away.

        A closing (or unreachable) scheduler is retried with backoff for about 30 s (with
        distributed's ``retry``); if this worker is closing meanwhile, its tasks are being
        cancelled, and failing the task instead would report a bogus error to consumers.
        A retry says how many splits of ``repetition`` the task ``received``: if the failed
        attempt's splits were handed out (a reply lost with the dispatcher that crashed
        after journaling it), the dispatcher hands out those again, not new ones. The task's
        ``first`` request says it too (its first split may have been lost with its push).
        """
        attempts = 0

        async def ask() -> dict[str, Any]:
            nonlocal attempts
            if self._closing:
                raise TaskCancelled
            attempts += 1
            return raise_for_status(await self.worker.scheduler.dataservice_get_split(
                iteration_id=task["iteration_id"], task_id=task["task_id"],
                repetition=repetition, count=count, job_token=task.get("job_token"),
                **({"received": received} if attempts > 1 or first else {}),
            ), "split request")

        try:
            resp = await retry(ask, count=_RETRIES, delay_min=0.05, delay_max=_RETRY_DELAY_MAX,
                               operation="dataservice split request")
        except OSError:
            if self._closing:
                raise TaskCancelled from None
            raise
        return resp["split_indices"], resp["end_of_splits"], bool(resp.get("drained"))

    async def _ack_splits(self, task: TaskDef, repetition: int) -> None:
        try:
            await self.worker.scheduler.dataservice_ack_splits(
                task_id=task["task_id"], repetition=repetition, job_token=task.get("job_token"))
        except Exception as e:  # noqa: BLE001 - only bookkeeping is lost
            logger.debug("dataservice: ack_splits failed: %r", e)

    async def _input_ended(self, runner: TaskRunner) -> None:
        """The task's pipeline ended (its thread returned, not cancelled)."""
        self.figures.task_ended(runner)
        self._execute(self.core.input_ended(runner.task_id, runner.buffer.error is not None),
                      runner)

    async def _send_finish(self, finish: SendFinishTask, runner: TaskRunner) -> None:
        """Tell the dispatcher the task finished, then let consumers see the end."""
        try:
            await self.worker.scheduler.dataservice_finish_task(
                task_id=finish.task_id, error=finish.error, job_token=finish.job_token)
        except Exception as e:  # noqa: BLE001 - the heartbeat reports it again
            logger.info("dataservice: finish_task(%s) failed: %r", runner.task_id, e)
        self._execute(self.core.finish_sent(finish.task_id), runner)
        self.stats["tasks_finished"] += 1
        self.stats["elements_produced"] += runner.buffer.produced

    async def _heartbeat_loop(self) -> None:
        interval = self.heartbeat_interval or config.get_seconds("worker.heartbeat-interval")
        delay = interval
        while not self._closing:
            try:
                answered = await self._heartbeat()
            except Exception as e:  # noqa: BLE001 - the dispatcher may be restarting
                logger.debug("dataservice heartbeat failed: %r", e)
                answered = True
            delay = heartbeat_delay(answered, delay, interval)
            try:
                await asyncio.wait_for(self._wake_heartbeat.wait(), delay)
            except TimeoutError:
                pass
            self._wake_heartbeat.clear()

    def reconnected(self) -> None:
        """The worker registered again with a restarted scheduler (:mod:`._reconnect`).

        Its tasks, buffers and split cursors are intact: ask the new dispatcher for a key and
        report them at once (the first heartbeat says ``resumed``, and the replayed
        dispatcher revives them instead of counting them lost).
        """
        self._key.forget()
        self._wake_heartbeat.set()

    async def _heartbeat(self) -> bool:
        w = self.worker
        message = self.core.heartbeat_message()
        key = await self._key.get()
        if key is None:  # the dispatcher is not installed (yet)
            return False
        resp = await w.scheduler.dataservice_worker_heartbeat(
            address=w.address, host=get_address_host(w.address),
            nthreads=w.state.nthreads, worker_key=key, **message,
        )
        if resp is None:  # the dispatcher is not installed (yet)
            return False
        try:
            raise_for_status(resp, "worker heartbeat")
        except JobAccessDeniedError:
            self._key.forget()  # a new dispatcher: ask for a new key next time
            raise
        lineage = resp.get("lineage")
        if lineage is not None and self.core.lineage not in (None, lineage):
            logger.warning("dataservice: the dispatcher does not know this worker's tasks %s "
                           "(restarted without its journal?): dropping them",
                           sorted(self.core.task_ids()))
        self._execute(self.core.heartbeat_reply(resp))
        return True


#: Retries of a split request (backoff 0.05 s doubling to 0.25 s: about 30 s in all; a
#: short cap, so that the split flow resumes soon after a restarted dispatcher is back).
_RETRIES = 120
_RETRY_DELAY_MAX = 0.25


def _closing_get_elements(**kwargs: Any) -> dict[str, Any]:
    return {"status": "OK", "elements": None, "end_of_sequence": False, "closing": True}


def _check_token(runner: TaskRunner, job_token: str | None, what: str) -> None:
    check_job_token(runner.task.get("job_token") or "", job_token, runner.task["job_id"], what)


def _ignore(**kwargs: Any) -> None:
    return None
