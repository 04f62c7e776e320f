"""The reader's sans-I/O core: which tasks to read, how many requests, retries, the end.

Pure decisions of one pass over a job (:mod:`._reader` does the I/O: coroutines on the
client's loop, the RPCs, the channel to the user's thread, sleeps). No Dask, no asyncio, no
threads in here; the time is passed in (``now``), so a simulator can drive M readers on a
virtual clock with the same code.

Stimuli and outcomes
--------------------
:class:`ReaderCore` (one iteration):

``on_view(view)``
    A view of the iteration from the dispatcher (the start reply or a heartbeat). Answers a
    :class:`ViewChanges`: the tasks to start reading (``start``: ``(task_id, address)``) and
    the fetches to stop (``cancel``: tasks now ``lost``, their worker left). Raises
    :class:`DataServiceError` for an iteration that was garbage collected, or for
    ``target_workers="LOCAL"`` with no task on this host.
``task_ended(task_id)``
    A task's fetch ended (end of sequence, its worker closing or lost, or an error).
``pass_over(view)``
    Whether the pass is over: every task read ended and the dispatcher says the iteration
    finished (a local reader: once every listed worker joined).
``ends_at_demand(view)``
    At the pass's end, whether it waits for the consumer's next call and asks the dispatcher
    once more (OFF: a worker that joined or restarted meanwhile serves its copy).
``ask_again_after(view, interval)`` (a function)
    Every task ended but the dispatcher has not recorded the iteration finished: seconds
    before the next heartbeat.
``no_workers(waited)``
    ``"warn"`` / ``"fail"`` / None after ``waited`` seconds without any task.

:class:`TaskRead` (one task's request pipeline; ``depth`` requests in flight, numbered):

``to_send(size, linger)``
    The requests to send now: :class:`Request` (``seq``, ``ack``, ``linger``: the head request
    answers at once, the ones queued behind it may linger).
``on_reply(seq, reply, now, gone)``
    The head request's reply. Answers a :class:`ReplyOutcome`: ``elements`` to hand over,
    ``done`` (end of sequence, worker closing, or unknown to the worker of a task that is
    lost or finished: ``gone``, see ``ReaderCore.is_gone``), ``error``
    (a reply that is not OK: the I/O raises it), or ``stall`` (``"warn"`` / ``"fail"``: a long
    poll brought nothing for that long).
``on_failure(now, lost)``
    The head request failed (a broken or refused connection). Answers a
    :class:`RetryDecision`: give up (the task is lost, or ``client.dispatcher-timeout`` of
    failures in a row), else wait ``delay`` (backoff 20 ms to 0.5 s) and send again from the
    head's ``seq`` (the worker answers a request it kept again); ``report``: ask the
    dispatcher to check the worker (once per run of failures).
``resend()``
    After the delay: forget the requests in flight (the I/O cancels them); the next
    ``to_send`` starts again at the failed request's ``seq``.

Readers over a fixed task list (coordinated reads, the cross-trainer cache under DYNAMIC):
:func:`fixed_tasks` (the active tasks when the read starts, by id), :func:`task_lost` (the
read then ends with an error: every round or turn needs every task), :func:`turn_reply`
(what a reply to a cross-trainer turn's request means), :func:`join_rounds` /
:func:`join_turns` (how the parts of one round or turn are put together).

:class:`RequestSize` (elements per request of a shared job): grows while the consumer keeps
up and reads alone, halves when it falls behind, stays at its smallest once another consumer
reads the iteration (:meth:`RequestSize.next`, :meth:`RequestSize.shared_with`).

Hot path: the core works per request (a reply is one call), never per element.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from typing import Any

from ...errors import DataServiceError

__all__ = [
    "ReaderCore",
    "ReplyOutcome",
    "Request",
    "RequestSize",
    "Retry",
    "RetryDecision",
    "TaskRead",
    "Tracker",
    "ViewChanges",
    "address_host",
    "ask_again_after",
    "fixed_tasks",
    "join_rounds",
    "join_turns",
    "select_tasks",
    "task_lost",
    "turn_reply",
]

_STATIC_NAMES = {"FILE", "DATA", "FILE_OR_DATA", "HINT"}


class Tracker:
    """Warn once after ``warning`` seconds (then every ``warning`` seconds), fail after
    ``timeout`` (None: never)."""

    def __init__(self, warning: float | None, timeout: float | None) -> None:
        self.warning = warning
        self.timeout = timeout
        self._next_warning = warning

    def copy(self) -> Tracker:
        return Tracker(self.warning, self.timeout)

    def reset(self) -> None:
        self._next_warning = self.warning

    def state(self, waited: float) -> str | None:
        """``"fail"``, ``"warn"`` or None after waiting ``waited`` seconds."""
        if self.timeout is not None and waited >= self.timeout:
            return "fail"
        if self._next_warning is not None and waited >= self._next_warning:
            self._next_warning = waited + (self.warning or waited)
            return "warn"
        return None


class Retry:
    """The retry state of one task's requests."""

    __slots__ = ("acked", "since", "timeout", "_delay")

    def __init__(self, timeout: float) -> None:
        #: The last request answered, in order (``-1``: none yet).
        self.acked = -1
        #: When the current run of failures began (None: the last request succeeded).
        self.since: float | None = None
        self.timeout = timeout
        self._delay = 0.02

    def answered(self, seq: int) -> None:
        self.acked = seq
        self.since = None
        self._delay = 0.02

    def next_delay(self) -> float:
        delay, self._delay = self._delay, min(2 * self._delay, 0.5)
        return delay


# -- the iteration --------------------------------------------------------------------------
def address_host(address: str) -> str:
    """The host of a worker address (``tcp://10.0.0.1:8786`` -> ``10.0.0.1``; IPv6 in
    brackets; ``inproc://host/pid/n`` -> ``host``), as distributed's ``get_address_host``."""
    loc = address.split("://", 1)[-1]
    if loc.startswith("["):
        return loc[1:loc.index("]")]
    loc = loc.split("/", 1)[0]
    return loc.rsplit(":", 1)[0] if ":" in loc else loc


def select_tasks(view: dict[str, Any], target_workers: str, local_host: str,
                 in_process: frozenset[str] | None = None) -> tuple[list[dict[str, Any]], bool]:
    """The tasks a consumer reads by ``target_workers``, and whether it reads only the local
    ones (then it is done with its host's tasks; the others are other consumers' business).

    A task is local when its worker runs on ``local_host``, or, given ``in_process`` (the
    addresses of the workers in the consumer's process: ``dataservice.client.local-workers:
    process``, TensorFlow's meaning), when its worker is one of them (see ``_locality``).
    """
    get_address_host = address_host
    tasks: list[dict[str, Any]] = view["tasks"]
    if target_workers == "ANY" or not tasks:
        return tasks, False
    if in_process is None:
        local = [t for t in tasks if get_address_host(t["worker_address"]) == local_host]
    else:
        local = [t for t in tasks if t["worker_address"] in in_process]
    if target_workers == "LOCAL":
        if not local:
            if in_process is not None:
                raise DataServiceError(
                    "target_workers='LOCAL' with dataservice.client.local-workers='process', "
                    "but no data worker of this job runs in this process; its workers are "
                    f"{sorted(t['worker_address'] for t in tasks)}")
            hosts = sorted({get_address_host(t["worker_address"]) for t in tasks})
            raise DataServiceError(
                f"target_workers='LOCAL', but no data worker of this job runs on this "
                f"host ({local_host}); its workers are on {hosts}"
            )
        return local, True
    if view.get("processing_mode") in _STATIC_NAMES and local:  # AUTO
        return local, True
    return tasks, False


@dataclasses.dataclass(frozen=True)
class ViewChanges:
    #: ``(task_id, worker_address)`` of the tasks to start reading.
    start: tuple[tuple[int, str], ...] = ()
    #: Tasks whose fetch to stop: their worker left (what it had buffered is gone).
    cancel: tuple[int, ...] = ()


class ReaderCore:
    """One pass over a job: its tasks and when it is over (see the module docstring)."""

    def __init__(self, iteration_id: int, target_workers: str, local_host: str,
                 no_workers: Tracker,
                 in_process: Callable[[], frozenset[str]] | None = None) -> None:
        self.iteration_id = iteration_id
        self.target_workers = target_workers
        self.local_host = local_host
        #: The workers of the consumer's process now, when only those are local (None: the
        #: workers on ``local_host`` are).
        self.in_process = in_process
        #: Reading only the tasks on this host.
        self.local_only = False
        #: ``{task_id: ended}`` of the tasks this pass reads (or read).
        self.reading: dict[int, bool] = {}
        #: Tasks the dispatcher said are lost.
        self.lost: set[int] = set()
        #: Tasks the dispatcher said finished (their input ended; their worker may still
        #: hold elements of them).
        self.finished: set[int] = set()
        self.no_workers_tracker = no_workers

    def on_view(self, view: dict[str, Any]) -> ViewChanges:
        if view.get("garbage_collected"):
            raise DataServiceError(f"iteration {self.iteration_id} was garbage collected")
        tasks, local_only = select_tasks(view, self.target_workers, self.local_host,
                                         None if self.in_process is None else self.in_process())
        self.local_only = self.local_only or local_only
        start: list[tuple[int, str]] = []
        cancel: list[int] = []
        for task in tasks:
            task_id = task["task_id"]
            if task["status"] == "finished":
                self.finished.add(task_id)
            if task["status"] == "lost":
                if task_id in self.lost:
                    continue
                self.lost.add(task_id)
                ended = self.reading.get(task_id)
                if ended is False:
                    cancel.append(task_id)
                elif ended is None:
                    self.reading[task_id] = True  # nothing to read
            elif task_id not in self.reading:
                self.reading[task_id] = False
                start.append((task_id, task["worker_address"]))
        if not start and not cancel:
            return _NO_CHANGES
        return ViewChanges(tuple(start), tuple(cancel))

    def task_ended(self, task_id: int) -> None:
        if task_id in self.reading:
            self.reading[task_id] = True

    def is_lost(self, task_id: int) -> bool:
        return task_id in self.lost

    def is_gone(self, task_id: int) -> bool:
        """Whether a worker that says it does not know task ``task_id`` never will: the task
        is lost, or it finished (its worker left or restarted after its input ended, before
        this reader got its end of sequence: what it still held is gone, at most once)."""
        return task_id in self.lost or task_id in self.finished

    @property
    def has_tasks(self) -> bool:
        return bool(self.reading)

    @property
    def all_ended(self) -> bool:
        """Every task read ended (and there is one)."""
        return bool(self.reading) and all(self.reading.values())

    def pass_over(self, view: dict[str, Any]) -> bool:
        """Every task ended, and the dispatcher says the iteration finished (a local reader:
        once every listed worker has joined: one that joins later on this host is read too)."""
        return self.all_ended and bool(
            view["finished"] or (self.local_only and not view.get("pending_shards")))

    def ends_at_demand(self, view: dict[str, Any]) -> bool:
        """At the end of the pass (:meth:`pass_over`): whether it waits for the consumer's
        call after its last element, and asks the dispatcher once more then.

        Under OFF a worker that joins (or restarts) while the iteration is read serves its
        own full copy (the dispatcher gives it a task while the iteration has consumers), as
        in TensorFlow (``fault_tolerance_test.testAddWorkerMidJob``, ``testRestartWorker``),
        whose reader decides its end at the consumer's next call. A reader here is usually
        far ahead of its consumer (its tasks may have served everything before the consumer
        read half of it), so it decides at the same point. Other modes end at once: a new
        task of a finished DYNAMIC iteration has no split, a static job's tasks are fixed.
        """
        return view.get("processing_mode") == "OFF" and not self.local_only

    def no_workers(self, waited: float) -> str | None:
        return self.no_workers_tracker.state(waited)

    def workers_seen(self) -> None:
        self.no_workers_tracker.reset()


_NO_CHANGES = ViewChanges()


def ask_again_after(view: dict[str, Any], interval: float) -> float:
    """Every task read ended, but the dispatcher has not seen all of them yet (lost workers,
    or new tasks being created): ask again soon; for listed workers still to join (static
    sharding), after a heartbeat interval."""
    return interval if view.get("pending_shards") else min(0.01, interval)


# -- one task ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Request:
    seq: int
    ack: int
    linger: float
    max_elements: int


@dataclasses.dataclass(frozen=True)
class ReplyOutcome:
    #: ``"elements"``, ``"done"``, ``"error"``, ``"nothing"``.
    kind: str
    #: For ``"done"``: why (``"end"``, ``"closing"``, ``"lost"``).
    why: str = ""
    #: For ``"nothing"``: a stalled pipeline's state (``"warn"`` / ``"fail"``), and for how
    #: long it gave nothing.
    stall: str | None = None
    waited: float = 0.0


_ELEMENTS = ReplyOutcome("elements")
_ERROR = ReplyOutcome("error")


@dataclasses.dataclass(frozen=True)
class RetryDecision:
    give_up: bool
    #: Seconds to wait before sending again.
    delay: float = 0.0
    #: Ask the dispatcher to check the worker (the first failure of a run).
    report: bool = False
    #: Why it gives up: ``"lost"`` or ``"timeout"``.
    why: str = ""


class TaskRead:
    """The request pipeline of one task (see the module docstring)."""

    def __init__(self, task_id: int, address: str, depth: int, retry_timeout: float,
                 stalls: Tracker, now: float) -> None:
        self.task_id = task_id
        self.address = address
        self.depth = depth
        self.seq = 0
        #: ``seq`` of the requests in flight, oldest (the head) first.
        self.pending: deque[int] = deque()
        self.retry = Retry(retry_timeout)
        self.stalls = stalls
        self.last_element = now

    def to_send(self, size: int, linger: float) -> list[Request]:
        out = []
        pending = self.pending
        while len(pending) < self.depth:
            seq = self.seq
            out.append(Request(seq, self.retry.acked, linger if pending else 0.0, size))
            pending.append(seq)
            self.seq = seq + 1
        return out

    @property
    def head(self) -> int:
        return self.pending[0]

    def on_reply(self, seq: int, reply: dict[str, Any] | None, now: float,
                 gone: bool) -> ReplyOutcome:
        """The head request's reply; ``gone``: :meth:`ReaderCore.is_gone` (a worker that does
        not know the task then never will)."""
        assert self.pending and self.pending[0] == seq, "replies are taken in order"
        self.pending.popleft()
        self.retry.answered(seq)
        if reply is None or reply.get("closing"):  # the worker is shutting down
            return ReplyOutcome("done", "closing")
        if reply.get("status") != "OK":
            return _ERROR
        if reply.get("elements") is not None:
            self.last_element = now
            self.stalls.reset()
            return _ELEMENTS
        if reply.get("end_of_sequence"):
            return ReplyOutcome("done", "end")
        if reply.get("unknown") and gone:
            # lost or finished, and its worker (restarted, or another at its address) does
            # not know it: it never will (polling on would never end)
            return ReplyOutcome("done", "lost")
        waited = now - self.last_element
        return ReplyOutcome("nothing", stall=self.stalls.state(waited), waited=waited)

    def on_failure(self, now: float, lost: bool) -> RetryDecision:
        """The head request failed (it leaves the pipeline)."""
        self.pending.popleft()
        if lost:
            return RetryDecision(True, why="lost")
        retry = self.retry
        report = False
        if retry.since is None:
            retry.since = now
            report = True
        elif now - retry.since > retry.timeout:
            return RetryDecision(True, why="timeout")
        return RetryDecision(False, retry.next_delay(), report)

    def resend(self, failed_seq: int) -> None:
        """Send again from ``failed_seq``: the requests in flight are dropped."""
        self.pending.clear()
        self.seq = failed_seq


class RequestSize:
    """Elements per request. Consumers of a shared job take its elements first come, first
    served: what one holds ahead (requests in flight and its channel) is taken from the
    others. So requests start small, and double while the consumer keeps up and reads
    alone, halving back once the channel is half full. Once another consumer reads the
    same iteration (:meth:`shared_with`: a worker's reply or the dispatcher says so), every
    request asks for the smallest size: growing on every batch the consumer took made the
    size follow what it had read so far (16, 32, ... 1024 after 2,000 elements), so a
    consumer that paused held that much and another consumer of a 1,000-element job ended
    early. Private jobs always ask for the most."""

    def __init__(self, max_elements: int, shared: bool, shared_start: int) -> None:
        self.max_elements = max_elements
        self.shared = shared
        self.current = min(max_elements, shared_start) if shared else max_elements
        self.minimum = self.current
        #: Another consumer reads the same iteration.
        self.not_alone = False
        self._taken_seen = 0

    def shared_with(self, consumers: int) -> None:
        """``consumers`` read the iteration (or one of its tasks), this one included."""
        if consumers > 1 and self.shared:
            self.not_alone = True
            self.current = self.minimum

    def next(self, queued: int, taken: int, capacity: int) -> int:
        if self.shared and not self.not_alone:
            if queued <= 1 and taken > self._taken_seen:  # the consumer keeps up: grow
                self.current = min(self.max_elements, 2 * self.current)
            elif 2 * queued >= capacity:
                self.current = max(self.minimum, self.current // 2)
            self._taken_seen = taken
        return self.current


# -- readers over a fixed task list (coordinated reads, the cross-trainer cache) -------------
def fixed_tasks(view: dict[str, Any]) -> list[tuple[int, str]]:
    """The tasks a fixed-list reader walks: the active ones when it starts, by task id
    (workers that join later take no part). Empty: wait for a data worker."""
    return sorted((t["task_id"], t["worker_address"]) for t in view["tasks"]
                  if t["status"] == "active")


def task_lost(view: dict[str, Any], task_id: int) -> bool:
    """Whether ``view`` says task ``task_id`` is lost (a fixed-list read cannot go on)."""
    return any(t["task_id"] == task_id and t["status"] == "lost" for t in view["tasks"])


def turn_reply(reply: dict[str, Any] | None) -> str:
    """What one reply to a cross-trainer turn's request means (the turn reader asks a task
    until it gave its part): ``"closing"`` (the worker shuts down), ``"error"`` (not OK),
    ``"elements"``, ``"end"`` (end of sequence: the endless job ended, the read fails),
    ``"unknown"`` (the worker does not know the task: the reader asks the dispatcher and
    fails if the task is lost, since a worker that never got the task, or restarted without
    it, answers so for ever), else ``"nothing"`` (ask again)."""
    if reply is None or reply.get("closing"):
        return "closing"
    if reply.get("status") != "OK":
        return "error"
    if reply.get("elements") is not None:
        return "elements"
    if reply.get("end_of_sequence"):
        return "end"
    return "unknown" if reply.get("unknown") else "nothing"


def join_rounds(parts: list[list[Any]]) -> list[Any]:
    """Coordinated reads: the parts of one request to each task (rounds ``r .. r+k-1`` of
    task ``r mod T``...) interleaved round by round."""
    return [x for row in zip(*parts, strict=True) for x in row]


def join_turns(parts: list[list[Any]]) -> list[Any]:
    """The cross-trainer cache: each task's turn, in task order."""
    return [x for part in parts for x in part]
