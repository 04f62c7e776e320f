"""The reader: one pass over a job of the service, on the client's event loop.

Each iteration of a ``DistributedDataset`` acquires an iteration of its job at the
dispatcher, then one coroutine per task on the client's event loop pulls batches of elements
from the task's worker (a count- and byte-bounded batch per request, numpy buffers as
zero-copy frames) into a bounded :class:`Channel`. The user's thread only takes batches from
that channel, so a ``next()`` costs no round trip; ``async for`` takes them on the loop.

Every coroutine a reader starts runs in its own :class:`~dask_dataservice._async.TaskGroup`,
stopped when the reader ends or the consumer stops reading.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator
from types import ModuleType
from typing import Any

from distributed import Client
from distributed._async_taskgroup import AsyncTaskGroupClosedError
from distributed.comm.addressing import get_address_host

from ... import config
from ..._async import TaskGroup
from ...errors import DataServiceError
from ..protocol._frames import reader_codecs
from ..protocol._malloc import tune_malloc_from_config
from ..protocol._messages import raise_for_status
from ..protocol._metrics import ReadStats
from ..protocol._sharding import ShardingPolicy
from ..protocol._start_read import start_read
from . import _connection
from ._data_plane import open_stream, reopen
from ._locality import local_workers_mode, process_workers
from ._read_channel import END, Channel, Failure
from ._service_source import ReadSpec, ServiceSource
from .reader_core import ReaderCore, RequestSize, TaskRead, Tracker, ask_again_after

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------
# readers
# ---------------------------------------------------------------------------------------

#: Default of ``dataservice.client.shared-job-request-elements``: elements per request when
#: consumers share a named job (a consumer reading alone grows its requests from there). Once
#: another consumer reads the job, a consumer that pauses holds at most about
#: (1 in hand + channel batches + requests in flight) x this: 11 x 16 = 176 elements with the
#: defaults, so a job of a thousand elements still reaches a consumer that starts a moment
#: later (``data_service_ops_test.testSharedJobName``; at 256 the first consumer drained it).
SHARED_JOB_REQUEST_ELEMENTS = 16
#: Default of ``dataservice.client.cross-trainer-turn-elements``: under DYNAMIC, elements a
#: cross-trainer-cache consumer takes from each task per turn.
CROSS_TRAINER_TURN = 1024


def _local_host(scheduler_address: str) -> str:
    """This machine's address as seen on the route to the scheduler."""
    from distributed.utils import get_ip

    host = get_address_host(scheduler_address)
    try:
        return str(get_ip(host))
    except OSError:
        return host


class IterationReader:
    """Reads one iteration: heartbeats with the dispatcher, one fetch loop per task."""

    #: The job's token (its capability, from the job creation reply): every element
    #: request shows it.
    job_token: str | None = None
    #: Counts elements per data worker (issue 14: ``DistributedDataset.stats()``).
    stats: ReadStats | None = None
    _reported = float("-inf")  # when the dashboard last got this consumer's figures

    def __init__(self, client: Client, spec: ReadSpec, iteration_id: int, client_id: int,
                 channel: Channel) -> None:
        self.client = client
        self.spec = spec
        self.iteration_id = iteration_id
        self.client_id = client_id
        self.channel = channel
        tune_malloc_from_config()  # issue 16: dataservice.malloc-tuning
        self.group = TaskGroup(f"dataservice reader {iteration_id}")
        self.fetchers: dict[int, asyncio.Task[Any]] = {}
        self.local_host = _local_host(spec.address)
        cache = spec.cross_trainer_cache
        self.trainer_id = cache.trainer_id if cache is not None else None
        self.task_done = asyncio.Event()
        self.stopped = False
        self._release: asyncio.Task[Any] | None = None
        #: Set once :meth:`run` returned (the channel holds its last item).
        self.done = threading.Event()
        self.max_elements = int(config.get("client.request-elements"))
        #: Elements per request: a shared job starts small and grows while the consumer
        #: keeps up (see :meth:`_request_size`).
        self.sizes = RequestSize(
            self.max_elements, spec.job_name is not None and self.trainer_id is None,
            int(config.get("client.shared-job-request-elements", SHARED_JOB_REQUEST_ELEMENTS)))
        self.max_bytes = config.get_bytes("client.request-bytes")
        self.long_poll = config.get_seconds("client.long-poll")
        self.depth = max(1, int(config.get("client.requests-per-task")))
        self.dispatcher_timeout = config.get_seconds("client.dispatcher-timeout")
        self.linger = config.get_seconds("client.linger")
        self.heartbeat_interval = config.get_seconds("client.heartbeat-interval")
        #: The last view the dispatcher sent and its version: a heartbeat sends the version
        #: and the dispatcher answers only "unchanged" while it is current.
        self._view: dict[str, Any] | None = None
        self._view_version: str | None = None
        #: Most consumers seen sharing this pass's iteration (heartbeats; issue 22: a reader
        #: of a named job is told when another consumer joins and takes a share).
        self.consumers_seen = 1
        self.request_timeout = _optional_seconds("client.request-timeout")
        self.connect_timeout = config.get_seconds("client.connect-timeout")
        self.stalls = _tracker("client.stall-warning", "client.stall-timeout")
        #: Which tasks this pass reads, and when it is over (:mod:`.reader_core`).
        self.core = ReaderCore(iteration_id, spec.target_workers, self.local_host,
                               _tracker("client.no-workers-warning", "client.no-workers-timeout"),
                               process_workers if local_workers_mode() == "process" else None)

    def start(self, view: dict[str, Any]) -> None:
        self.group.spawn(self.run, view)

    async def run(self, view: dict[str, Any]) -> None:
        """Read the iteration into the channel; end it with END, or the first error."""
        try:
            await self._read(view)
            if not self.stopped:
                # in flight while the consumer takes the end
                self._start_release(read_to_end=not self.core.local_only)
                self.channel.put_nowait(END)
        except asyncio.CancelledError:
            if not self.stopped:
                self.channel.put_nowait(Failure(DataServiceError(
                    f"lost contact with the data service at {self.spec.address}: the reader "
                    f"was cancelled (client status: {self.client.status})")))
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._fail(e)
        finally:
            self.stop()
            self.done.set()

    async def _read(self, view: dict[str, Any]) -> None:
        core = self.core
        self._update_tasks(view)
        loop = asyncio.get_running_loop()
        no_workers_since = loop.time()
        while not self.stopped:
            if core.has_tasks:
                no_workers_since = loop.time()
                core.workers_seen()
            else:
                await self._no_workers(loop.time() - no_workers_since)
            ended = core.all_ended
            if core.pass_over(view):
                if not core.ends_at_demand(view):
                    break
                more = await self._more_after_demand()
                if more is None:
                    break
                view = more
                continue
            self.task_done.clear()
            if not ended:  # when every known task ended, the dispatcher already knows: ask now
                try:
                    await asyncio.wait_for(self.task_done.wait(), self.heartbeat_interval)
                except TimeoutError:
                    pass
            view = await self._heartbeat()
            await self._report_reading()
            self._update_tasks(view)
            if ended and not view["finished"]:
                await asyncio.sleep(ask_again_after(view, self.heartbeat_interval))

    async def _more_after_demand(self) -> dict[str, Any] | None:
        """The end of an OFF pass (:meth:`.reader_core.ReaderCore.ends_at_demand`): keep the
        heartbeats (and so the iteration client) going until the consumer took every element
        and asks for the next, then one more heartbeat decides. Returns the new view if a task
        was added meanwhile (a worker joined or restarted: it serves its own copy), None at the
        consumer's end."""
        while not self.stopped:
            try:
                await asyncio.wait_for(self.channel.demanded(), self.heartbeat_interval)
                demanded = True
            except TimeoutError:
                demanded = False
            view = await self._heartbeat()
            self._update_tasks(view)
            if not self.core.all_ended:
                return view
            if demanded:
                return None
        return None

    async def _no_workers(self, waited: float) -> None:
        """The iteration has had no task for ``waited`` seconds: warn, then fail, saying why."""
        state = self.core.no_workers(waited)
        if state is None:
            return
        try:
            resp = await asyncio.wait_for(
                self.client.scheduler.dataservice_data_workers(),  # type: ignore[union-attr]
                self.heartbeat_interval + 5)
            why = raise_for_status(resp, "data worker query")["reason"]
        except Exception as e:  # noqa: BLE001 - the message says what it could
            why = f"the dispatcher could not say why ({e!r})"
        what = (f"iteration {self.iteration_id} of dataset {self.spec.dataset_label} has had no "
                f"data worker for {waited:.0f}s: {why}")
        if state == "fail":
            raise DataServiceError(
                f"{what} (gave up after dataservice.client.no-workers-timeout="
                f"{self.core.no_workers_tracker.timeout:g}s)")
        logger.warning("dataservice: %s; still waiting (up to dataservice.client."
                       "no-workers-timeout)", what)

    def _fail(self, e: BaseException) -> None:
        if not self.stopped:
            self.stopped = True
            self.channel.put_nowait(Failure(e))
        self.stop()

    async def _report_reading(self) -> None:
        """Tell the scheduler's dashboard how long this consumer waited on the service and
        how long it computed (once per ``dataservice.dashboard.interval`` at most, with a
        heartbeat: the dashboard's input-bound share)."""
        stats, scheduler = self.stats, self.client.scheduler
        now = time.monotonic()
        every = max(self.heartbeat_interval, config.get_seconds("dashboard.interval"))
        if stats is None or scheduler is None or now - self._reported < every:
            return
        self._reported = now
        try:
            await asyncio.wait_for(scheduler.dataservice_consumer_report(
                consumer=self.client_id, iteration_id=self.iteration_id,
                wait_seconds=stats.wait_seconds,
                compute_seconds=stats.compute_seconds, elements=stats.elements), 1.0)
        except Exception:  # noqa: BLE001 - no dashboard there, or it is slow: figures only
            pass

    async def _heartbeat(self) -> dict[str, Any]:
        """Ask the dispatcher for the iteration's tasks; ride out a dispatcher restart.

        A fault-tolerant dispatcher comes back with the same iteration (its journal holds
        it), so the consumer keeps asking, with a backoff (50 ms doubling to 250 ms), for up to
        ``client.dispatcher-timeout``. (distributed's ``retry`` counts attempts; this
        contract is a duration, hence the loop.)
        """
        loop = asyncio.get_running_loop()
        deadline = None
        delay = 0.05
        while True:
            scheduler = self.client.scheduler
            if scheduler is None or self.client.status in ("closed", "closing"):
                raise DataServiceError(
                    f"lost contact with the data service at {self.spec.address}: the client "
                    f"is {self.client.status} (it gave up reconnecting)"
                )
            try:
                resp = await scheduler.dataservice_client_heartbeat(
                    iteration_client_id=self.client_id, job_token=self.job_token,
                    view_version=self._view_version)
                if resp is not None:
                    view = raise_for_status(resp, "client heartbeat")
                    self._count_consumers(int(view.get("consumers") or 1))
                    if view.get("unchanged") and self._view is not None:
                        return self._view  # the dispatcher sent nothing new (service/dispatcher/_views.py)
                    self._view, self._view_version = view, view.get("view_version")
                    return view
                error: BaseException = RuntimeError("the dispatcher plugin is not installed")
            except (TimeoutError, OSError) as e:
                error = e
            if deadline is None:
                deadline = loop.time() + self.dispatcher_timeout
                logger.info("dataservice: dispatcher unreachable (%r); retrying", error)
            remaining = deadline - loop.time()
            if remaining <= 0 or self.stopped:
                raise DataServiceError(
                    f"lost contact with the data service at {self.spec.address}: {error!r}"
                ) from error
            await asyncio.sleep(min(delay, remaining))
            delay = min(2 * delay, 0.25)  # short: a restart is over in seconds

    def _count_consumers(self, consumers: int) -> None:
        """Say so when more consumers than seen so far share this pass (a named job)."""
        self.sizes.shared_with(consumers)
        if consumers > self.consumers_seen:
            logger.warning(
                "dataservice: %d consumers now read iteration %s of job %r (dataset %s): "
                "each gets a share of its elements", consumers, self.iteration_id,
                self.spec.job_name, self.spec.dataset_label)
            self.consumers_seen = consumers

    def _update_tasks(self, view: dict[str, Any]) -> None:
        """Start and stop fetches as the core decides from ``view``."""
        changes = self.core.on_view(view)
        for task_id in changes.cancel:  # its worker left: stop waiting on it
            fetcher = self.fetchers.get(task_id)
            if fetcher is not None and not fetcher.done():
                fetcher.cancel()
        for task_id, address in changes.start:
            fetcher = self.fetchers[task_id] = self.group.spawn(self._fetch, task_id, address)
            # a fetch cancelled before it ran never reaches its `finally`
            fetcher.add_done_callback(functools.partial(self._fetch_done, task_id))

    def _fetch_done(self, task_id: int, _: asyncio.Task[Any]) -> None:
        self.core.task_ended(task_id)

    async def _fetch(self, task_id: int, address: str) -> None:
        """Read one task: keep ``requests-per-task`` requests in flight, take them in order.

        Each request carries its number (``seq``) and the last one answered (``ack``); the
        worker keeps each reply until acknowledged. A request that fails (a broken or refused
        connection) is sent again with its number, so a reply lost on the way is answered
        again rather than its elements lost, until the dispatcher says the task is lost (its
        worker left: at-most-once), or for ``client.dispatcher-timeout``.
        """
        rpc = self.client.rpc(address)
        loop = asyncio.get_running_loop()
        core = self.core
        read = TaskRead(task_id, address, self.depth, self.dispatcher_timeout,
                        self.stalls.copy(), loop.time())
        #: ``{seq: request}`` in flight (their order: ``read.pending``).
        requests: dict[int, asyncio.Future[Any]] = {}
        codecs = reader_codecs(address, self.local_host)  # issue 16: compression where it pays
        #: issue 25: the worker's element port (None: distributed's comms)
        stream = None
        try:
            stream = await open_stream(rpc, address, self.connect_timeout)
            while not self.stopped:
                # the head request answers at once; the ones queued behind it may gather a
                # slow pipeline's elements for a moment
                for r in read.to_send(self._request_size(), self.linger):
                    kwargs = dict(
                        task_id=task_id, max_elements=r.max_elements, max_bytes=self.max_bytes,
                        wait=self.long_poll, consumer=self.client_id, seq=r.seq, ack=r.ack,
                        trainer_id=self.trainer_id, job_token=self.job_token,
                        **({"codecs": codecs} if codecs else {}),  # only when offered
                        linger=r.linger,
                    )
                    if stream is not None:
                        requests[r.seq] = stream.request(**kwargs)
                        continue
                    request = self.group.spawn(rpc.dataservice_get_elements, **kwargs)
                    request._dds_awaited = True  # type: ignore[attr-defined]  # see TaskGroup
                    requests[r.seq] = request
                head_seq = read.head
                head = requests[head_seq]
                done, _ = await asyncio.wait((head,), timeout=self.request_timeout)
                if not done:
                    await self._unresponsive(task_id, address)
                    continue  # the request stays in flight: the worker may still answer
                del requests[head_seq]
                try:
                    resp = head.result()
                except (TimeoutError, OSError) as e:
                    if not await self._may_retry(read, e):
                        return
                    for f in requests.values():  # the worker answers these again, in order
                        f.cancel()
                    requests.clear()
                    read.resend(head_seq)
                    if stream is not None and stream.broken:
                        stream = await reopen(rpc, stream, self.connect_timeout)
                    continue
                outcome = read.on_reply(head_seq, resp, loop.time(), core.is_gone(task_id))
                kind = outcome.kind
                if kind == "elements":
                    consumers = resp.get("consumers")
                    if consumers is not None:  # older workers do not say
                        self.sizes.shared_with(int(consumers))
                    items = resp["elements"].items
                    await self._put(items)
                    if self.stats is not None:  # issue 14
                        self.stats.received(address, len(items))
                elif kind == "done":
                    if outcome.why == "closing":
                        logger.info("dataservice: task %s on %s: worker closing", task_id,
                                    address)
                    return
                elif kind == "error":
                    raise_for_status(resp, "element request")
                elif outcome.stall is not None:  # a pipeline this slow is reported
                    self._stalled(outcome.stall, read.stalls, task_id, address, outcome.waited)
        except (asyncio.CancelledError, AsyncTaskGroupClosedError):
            raise
        except BaseException as e:  # noqa: BLE001 - the first error ends the iteration
            self._fail(e)
        finally:
            for f in requests.values():
                f.cancel()
            if stream is not None:
                stream.close()
            core.task_ended(task_id)
            self.task_done.set()

    async def _put(self, items: list[Any]) -> None:
        """Hand a batch received to the consumer (an equal split holds it back first)."""
        await self.channel.put(items)

    async def _may_retry(self, read: TaskRead, error: BaseException) -> bool:
        """The head request of ``read`` failed: wait as the core says and say whether to send
        it again (not once the task is lost, the read stopped, or ``client.dispatcher-timeout``
        passed since the first failure in a row)."""
        task_id, address = read.task_id, read.address
        if self.stopped:
            return False
        decision = read.on_failure(asyncio.get_running_loop().time(), self.core.is_lost(task_id))
        if decision.give_up:
            if decision.why == "timeout":
                logger.warning(
                    "dataservice: gave up on task %s on worker %s after %gs of failed requests "
                    "(dataservice.client.dispatcher-timeout): %r; what it had not delivered "
                    "is lost (at most once)", task_id, address, read.retry.timeout, error)
            return False
        if decision.report:
            logger.info("dataservice: a request for task %s to %s failed (%r); sending it "
                        "again", task_id, address, error)
            # a dead worker is dropped by the dispatcher (the next heartbeat says "lost")
            self.group.spawn(self._report_worker, address)
        await asyncio.sleep(decision.delay)
        return not (self.stopped or self.core.is_lost(task_id))

    async def _report_worker(self, address: str, timeout: float = 10.0) -> None:
        """Ask the dispatcher to check ``address`` (it drops a silent worker: the next
        heartbeat then says its tasks are lost)."""
        try:
            await asyncio.wait_for(
                self.client.scheduler.dataservice_suspect_worker(  # type: ignore[union-attr]
                    address=address), timeout)
        except Exception as e:  # noqa: BLE001 - the dispatcher's own deadline still applies
            logger.info("dataservice: could not report worker %s: %r", address, e)

    async def _unresponsive(self, task_id: int, address: str) -> None:
        """A request to ``address`` went unanswered for ``client.request-timeout``: say so and
        ask the dispatcher to check the worker (it drops a silent one, and this reader sees
        the task ``lost`` in its next heartbeat, which cancels this fetch)."""
        logger.warning(
            "dataservice: task %s on worker %s has not answered a request for %gs "
            "(dataservice.client.request-timeout); asking the dispatcher to check the worker",
            task_id, address, self.request_timeout)
        await self._report_worker(address, self.request_timeout or 10.0)

    def _stalled(self, state: str, stalls: Tracker, task_id: int, address: str,
                 waited: float) -> None:
        """Task ``task_id`` has given no element for ``waited`` seconds (a hung pipeline?)."""
        what = (f"task {task_id} of iteration {self.iteration_id} (dataset "
                f"{self.spec.dataset_label}) on worker {address} has produced no element for "
                f"{waited:.0f}s: its pipeline may be hung (e.g. a from_generator that never "
                "yields)")
        if state == "fail":
            raise DataServiceError(
                f"{what}; gave up after dataservice.client.stall-timeout={stalls.timeout:g}s")
        logger.warning("dataservice: %s", what)

    def _request_size(self) -> int:
        """Elements to ask for in the next request (:class:`.reader_core.RequestSize`:
        shared jobs adapt to how fast the consumer empties its channel)."""
        channel = self.channel
        return self.sizes.next(channel.queued, channel.taken, channel.capacity)

    def stop(self) -> None:
        """Stop reading (on the loop): cancel every fetch and request (not the release)."""
        self.stopped = True
        keep = {asyncio.current_task(), self._release}
        for task in self.group.tasks:
            if task not in keep and not task.done():
                task.cancel()

    def _start_release(self, read_to_end: bool = False) -> None:
        """Release the iteration client; ``read_to_end``: every task's end was read."""
        if self._release is None:
            self._release = self.group.spawn(self._release_client, read_to_end)

    async def _release_client(self, read_to_end: bool = False) -> None:
        extra = {"read_to_end": True} if read_to_end else {}  # older dispatchers: not sent
        try:
            await asyncio.wait_for(self.client.scheduler.dataservice_release_iteration_client(  # type: ignore[union-attr]
                iteration_client_id=self.client_id, job_token=self.job_token, **extra), 10)
        except Exception as e:  # noqa: BLE001 - the dispatcher releases silent clients itself
            logger.debug("dataservice: release failed: %r", e)

    async def close(self) -> None:
        """Stop, release the iteration client, and wait for every task of the reader."""
        self.stop()
        self._start_release()
        assert self._release is not None
        await asyncio.wait([self._release])
        await self.group.stop()


def _optional_seconds(key: str) -> float | None:
    """A duration key in seconds, or None when it is null (no limit)."""
    return None if config.get(key) is None else config.get_seconds(key)


def _tracker(warning_key: str, timeout_key: str) -> Tracker:
    return Tracker(_optional_seconds(warning_key), _optional_seconds(timeout_key))


#: The warn/fail tracker (it lives in the core; this name for older imports).
_Tracker = Tracker


# ---------------------------------------------------------------------------------------
# one pass
# ---------------------------------------------------------------------------------------


async def _start(client: Client, spec: ReadSpec, repetition: int,
                 stats: ReadStats | None = None) -> IterationReader:
    """Acquire an iteration of the job and start reading it (on the client's loop)."""
    capacity = spec.max_outstanding_requests or int(config.get("client.max-outstanding-batches"))
    scheduler: Any = client.scheduler  # a connected client's
    job_name, num_consumers = spec.job_request
    job, view = await start_read(scheduler, dict(  # issue 16: one round trip
        dataset_id=spec.dataset_id, processing_mode=spec.processing_mode,
        job_name=job_name, target_workers=spec.target_workers,
        num_consumers=num_consumers,
        cross_trainer_cache=spec.cross_trainer_cache is not None,
        **({"position": spec.position} if spec.position else {}),  # issue 13
    ), repetition)
    channel = Channel(asyncio.get_running_loop(), capacity)
    cls = reader_class(spec)
    reader = cls(client, spec, view["iteration_id"], view["iteration_client_id"], channel)
    reader.job_token = job.get("job_token")
    reader.stats = stats
    if stats is not None:
        stats.iteration_id = view["iteration_id"]
    reader.start(view)
    return reader


def reader_class(spec: ReadSpec) -> type[IterationReader]:
    """The reader for ``spec``: coordinated reads, the cross-trainer cache under DYNAMIC
    (its tasks' windows hold different splits: every trainer reads them in turns), or the
    plain reader.

    It depends on what is read only, never on the tasks the job has when the read starts:
    choosing the plain reader for a cross-trainer read whose view listed one task (the second
    worker had not registered yet) made trainers of one job read differently, and such a
    read went on with the other worker when its own froze instead of failing as the turn
    reader does (``tests/service/test_frozen_fixed_readers.py``).
    """
    if spec.equal is not None:
        cls: type[IterationReader] = _EQUAL_READER[0]
    elif spec.num_consumers is not None:
        cls = _fixed_readers().CoordinatedReader
    elif (spec.cross_trainer_cache is not None
          and spec.processing_mode == int(ShardingPolicy.DYNAMIC)):
        cls = _fixed_readers().CrossTrainerReader
    else:
        cls = IterationReader
    return cls


def read(spec: ReadSpec, repetition: int, client: Client,
         stats: ReadStats | None = None) -> Iterator[list[Any]]:
    """Generator: one pass over a job of the service (blocking; any thread but the loop's),
    batch by batch, as the workers' replies brought them (:meth:`ReadStats.wrap` hands out
    the elements: the per-element path of a pass is that one ``yield from``)."""
    _connection.check_can_block(client, "iterating a distributed dataset")
    _connection.ensure_installed(client)
    reader = _connection.run_blocking(client, _start, client, spec, repetition, stats)
    try:
        channel = reader.channel
        while True:
            try:
                item = channel.get(timeout=1.0)
            except queue.Empty:
                if not reader.done.is_set():
                    continue
                try:  # the reader ended: whatever it put last (END wins) is there now
                    item = channel.get_nowait()
                except queue.Empty:
                    raise DataServiceError(
                        f"lost contact with the data service at {spec.address}: the reader "
                        f"stopped (client status: {client.status})"
                    ) from None
            if item is END:
                return
            yield _batch(item)
    finally:
        if reader.done.is_set():  # the end (or an error) came: the release is in flight
            _close_soon(client, reader)
        else:  # the consumer stopped early: release before it goes on (and may close its client)
            _close_now(client, reader)


async def aread(spec: ReadSpec, repetition: int, client: Client,
                stats: ReadStats | None = None) -> AsyncIterator[list[Any]]:
    """Async generator: one pass, on an asynchronous client's loop (``async for``), batch
    by batch (:meth:`ReadStats.awrap` hands out the elements)."""
    if not (client.asynchronous and _connection.on_loop_thread(client)):
        raise RuntimeError(
            "`async for` reads with an asynchronous distributed.Client on the running event "
            "loop: pass Client(asynchronous=True) as the service of from_dataset_id/distribute "
            "(or iterate with a plain `for` in a thread)")
    installing = _connection.ensure_installed(client)
    if installing is not None:
        await installing
    reader = await _start(client, spec, repetition, stats)
    try:
        while True:
            item = await reader.channel.aget()
            if item is END:
                return
            yield _batch(item)
    finally:
        await reader.close()


def _batch(item: list[Any] | Failure) -> list[Any]:
    """A batch taken from the channel, or the error that ended the read, raised."""
    if isinstance(item, Failure):
        exc = item.exc
        item.exc = None  # type: ignore[assignment]  # no reference cycle through the traceback
        raise exc
    return item


def _close_now(client: Client, reader: IterationReader) -> None:
    """Close the reader and wait (a consumer that stops early), except on an event loop.

    A reader dropped on any running event loop is closed without waiting: on its client's
    own loop waiting would deadlock, and on another loop it would block that loop, which
    may be the one the release needs (a training worker's plugin teardown drops its
    per-worker iterators on the worker's loop; in an in-process cluster that loop also runs
    the scheduler: the wait ran into a 20 s timeout with every server of the process frozen).
    """
    if client.status in ("closed", "closing") or _connection.on_a_loop():
        _close_soon(client, reader)
        return
    try:
        _connection.run_blocking(client, reader.close)
    except Exception as e:  # noqa: BLE001 - the dispatcher releases silent clients itself
        logger.debug("dataservice: closing a reader failed: %r", e)


def _close_soon(client: Client, reader: IterationReader) -> None:
    """Close the reader on the client's loop without waiting (the consumer goes on at once:
    StopIteration costs no round trip). The reader's own tasks are owned by its group,
    which ``close`` stops."""
    try:
        client.loop.add_callback(reader.close)  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - the client's loop is closed
        pass


#: The readers over a fixed task list (:mod:`._fixed_readers`): they build on IterationReader,
#: so they install themselves here when imported (the client package imports them).
_FIXED_READERS: list[ModuleType] = []


#: The reader of an equal split (:mod:`._equal_reader`, which installs itself here).
_EQUAL_READER: list[type[IterationReader]] = []


def _fixed_readers() -> ModuleType:
    """The readers over a fixed task list."""
    return _FIXED_READERS[0]


ServiceSource.read_pass = staticmethod(read)
