"""The data worker's sans-I/O core: every task / turn / end-of-sequence decision, no I/O.

:class:`WorkerCore` holds what a data worker knows about its tasks and its consumers' request
order, and turns each *stimulus* into state changes and *effects*. It imports no Dask, runs no
thread and awaits nothing; time, where a decision needs it, is passed in (``now``). The plugin
(:mod:`.plugin`) does the I/O: it receives messages, runs the pipelines in threads,
holds the buffers and the asyncio futures, and calls the core, then carries out the effects it
returns. A simulator drives the same class with plain messages and a virtual clock.

Stimuli (methods) and what they return
--------------------------------------
``tasks_changed(new_tasks, cancelled)``
    The dispatcher pushed task changes (stream op ``dataservice-tasks``). Returns effects:
    :class:`CancelTask` for each task cancelled (known here or not: it is remembered as
    finished, and its consumers' turns are dropped), :class:`StartTask` for each new task
    (neither known nor remembered as finished: a late or repeated push starts nothing).
``heartbeat_message()``
    The heartbeat to send: ``active_tasks`` / ``finished_tasks`` (a task is finished for the
    dispatcher once its end is visible) and ``resumed`` (a dispatcher answered before).
``heartbeat_reply(reply)``
    The dispatcher's answer (``dataservice_worker_heartbeat``). A reply naming another
    ``lineage`` than the tasks' (a dispatcher restarted without its journal) cancels every
    task and forgets finished ids and datasets (:class:`ForgetDatasets`); then its
    ``new_tasks`` / ``cancelled`` apply as a push.
``task_started(task_id)`` / ``task_failed_to_start(task_id, error)``
    The task's dataset loaded and its thread started, or loading failed. ``False`` /
    no effect when the task was cancelled meanwhile (the plugin then drops what it built);
    a failed start ends the task's input with the error (see ``input_ended``).
``input_ended(task_id, error)``
    The task's pipeline ended (``error``: it raised). Returns :class:`SendFinishTask`: the
    dispatcher must record the task finished *before* any consumer sees the end.
``finish_sent(task_id)``
    The finish report was answered (or failed: the heartbeat reports the task again). Returns
    :class:`ShowEnd`: consumers may now get end of sequence (or the error).
``turn(key, seq, ack)``
    A ``get_elements`` request ``seq`` of consumer ``key = (task_id, consumer)``, with the
    consumer's last acknowledged ``ack`` (None: a consumer that sends no acks). Returns a
    :class:`Turn`: the replies it acknowledged (to forget), whether a kept reply answers it
    (``replay``), whether to keep its reply until acknowledged, and whether it must wait for
    its turn (an earlier request of the same consumer has not run yet). ``consumers(task_id)``
    counts the consumers that sent such requests for the task (its replies say how many).
``keep_reply(key, seq, has_elements)``
    Request ``seq``'s reply is computed: whether to keep it (only a reply with elements; one
    without is computed afresh when the request is sent again).
``turn_done(key, seq)``
    Request ``seq`` ran (or failed, or was cancelled): the next one may run. Returns the
    ``seq`` to wake, or None.
``turn_abandoned(key, seq)``
    A request gave up waiting for its turn (the earlier one never came), or its kept reply
    is dropped (it was cancelled: a request sent again computes it afresh).

Reply shaping for one request (per request, never per element): :func:`may_linger`,
:func:`empty_reply`, :func:`unknown_task_reply`. Timer: :func:`heartbeat_delay` (the next
heartbeat, with a backoff while no dispatcher answers).

Invariants: a task is in at most one of ``tasks`` (known) and ``finished``; end of sequence
is visible only for a task whose finish report was answered; requests of one consumer run
in ``seq`` order (a missing one is skipped after the plugin's timeout, never waited for
forever).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from ..protocol._messages import TaskDef

__all__ = [
    "CancelTask",
    "ForgetDatasets",
    "Rounds",
    "SendFinishTask",
    "SplitFlow",
    "SplitRequest",
    "ShowEnd",
    "StartTask",
    "TaskPhase",
    "TrainerCursors",
    "Turn",
    "WorkerCore",
    "empty_reply",
    "heartbeat_delay",
    "may_linger",
]

#: Ids of finished/cancelled tasks remembered (late requests get end of sequence).
FINISHED_MEMORY = 4096


class Recent:
    """A set that remembers only its ``capacity`` most recent members."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[int, None] = OrderedDict()

    def add(self, item: int) -> None:
        self._items[item] = None
        self._items.move_to_end(item)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def discard(self, item: int) -> None:
        self._items.pop(item, None)

    def __contains__(self, item: object) -> bool:
        return item in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[int]:
        return iter(self._items)


class TaskPhase:
    """A task's phases on this worker (strings, for messages and logs)."""

    #: Reserved: its dataset definition loads.
    LOADING = "loading"
    #: Its pipeline runs.
    RUNNING = "running"
    #: Its input ended (or failed); the finish report to the dispatcher is in flight.
    ENDED = "ended"
    #: The dispatcher was told: consumers see the end.
    FINISHED = "finished"


# Effects ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StartTask:
    """Load the task's dataset and start its pipeline."""

    task: TaskDef


@dataclasses.dataclass(frozen=True)
class CancelTask:
    """Stop the task's pipeline (if it runs here) and drop its buffer, its rounds and its
    consumers' turns (kept replies, waiting requests)."""

    task_id: int


@dataclasses.dataclass(frozen=True)
class ForgetDatasets:
    """Dataset ids may be reused by this dispatcher: drop the loaded pipelines."""


@dataclasses.dataclass(frozen=True)
class SendFinishTask:
    """Tell the dispatcher (``dataservice_finish_task``) the task finished; then call
    :meth:`WorkerCore.finish_sent`."""

    task_id: int
    error: bool
    job_token: str | None


@dataclasses.dataclass(frozen=True)
class ShowEnd:
    """Consumers may now see the task's end of sequence (or its error)."""

    task_id: int


Effect = StartTask | CancelTask | ForgetDatasets | SendFinishTask | ShowEnd


@dataclasses.dataclass(frozen=True)
class Turn:
    """What to do with one ordered request (see :meth:`WorkerCore.turn`)."""

    #: Kept replies the consumer acknowledged: forget them.
    forget: tuple[int, ...] = ()
    #: A reply to this ``seq`` is kept (answered, or being answered): send it again.
    replay: bool = False
    #: Keep this request's reply until the consumer acknowledges it.
    keep: bool = False
    #: An earlier request of this consumer has not run yet: wait for the turn (bounded).
    wait: bool = False


_NO_TURN = Turn()


class _Turns:
    __slots__ = ("next", "kept", "waiting")

    def __init__(self) -> None:
        self.next = 0
        #: Requests whose replies are kept until acknowledged.
        self.kept: set[int] = set()
        #: Requests waiting for their turn.
        self.waiting: set[int] = set()


@dataclasses.dataclass
class _Task:
    task: TaskDef
    phase: str = TaskPhase.LOADING
    error: bool = False


class WorkerCore:
    """A data worker's tasks and request order (see the module docstring)."""

    def __init__(self, finished_memory: int = FINISHED_MEMORY) -> None:
        self._tasks: dict[int, _Task] = {}
        self.finished = Recent(finished_memory)
        #: Whether a dispatcher answered a heartbeat: the next heartbeat says ``resumed``.
        self.answered = False
        #: The lineage of the dispatcher whose tasks this worker holds.
        self.lineage: str | None = None
        self._turns: dict[tuple[int, int | None], _Turns] = {}
        #: ``{task_id: consumers}``: how many consumers sent ordered requests for the task.
        self._consumers: dict[int, int] = {}

    # -- queries ---------------------------------------------------------------------------
    def knows(self, task_id: int) -> bool:
        return task_id in self._tasks

    def phase(self, task_id: int) -> str | None:
        t = self._tasks.get(task_id)
        return None if t is None else t.phase

    def task_ids(self) -> list[int]:
        return list(self._tasks)

    def turn_keys(self) -> list[tuple[int, int | None]]:
        return list(self._turns)

    def consumers(self, task_id: int) -> int:
        """How many consumers sent ordered requests for task ``task_id`` (the consumers of a
        shared job read its tasks together: each reply says how many, so a reader holds
        little ahead once it is not alone; see ``reader_core.RequestSize``)."""
        return self._consumers.get(task_id, 0)

    # -- tasks -----------------------------------------------------------------------------
    def tasks_changed(self, new_tasks: Iterable[TaskDef] = (),
                      cancelled: Iterable[int] = ()) -> list[Effect]:
        out: list[Effect] = []
        for task_id in cancelled:
            self._tasks.pop(task_id, None)
            self.finished.add(task_id)
            self._drop_turns(task_id)
            out.append(CancelTask(task_id))
        for task in new_tasks:
            tid = task["task_id"]
            if tid in self._tasks or tid in self.finished:
                continue
            task = TaskDef(**task)  # a copy: the message is not ours
            self._tasks[tid] = _Task(task)
            out.append(StartTask(task))
        return out

    def task_started(self, task_id: int) -> bool:
        """The task's pipeline starts now; False if it was cancelled while it loaded."""
        t = self._tasks.get(task_id)
        if t is None:
            return False
        if t.phase == TaskPhase.LOADING:
            t.phase = TaskPhase.RUNNING
        return True

    def task_failed_to_start(self, task_id: int) -> list[Effect]:
        if task_id not in self._tasks:
            return []
        return self.input_ended(task_id, error=True)

    def input_ended(self, task_id: int, error: bool) -> list[Effect]:
        t = self._tasks.get(task_id)
        if t is None or t.phase in (TaskPhase.ENDED, TaskPhase.FINISHED):
            return []
        t.phase, t.error = TaskPhase.ENDED, error
        return [SendFinishTask(task_id, error, t.task.get("job_token"))]

    def finish_sent(self, task_id: int) -> list[Effect]:
        t = self._tasks.get(task_id)
        if t is None or t.phase != TaskPhase.ENDED:
            return []
        t.phase = TaskPhase.FINISHED
        return [ShowEnd(task_id)]

    # -- heartbeats --------------------------------------------------------------------------
    def heartbeat_message(self) -> dict[str, Any]:
        active = [tid for tid, t in self._tasks.items() if t.phase != TaskPhase.FINISHED]
        done = [tid for tid, t in self._tasks.items() if t.phase == TaskPhase.FINISHED]
        return {"active_tasks": active, "finished_tasks": done, "resumed": self.answered}

    def heartbeat_reply(self, reply: dict[str, Any]) -> list[Effect]:
        """An OK reply to a heartbeat (the plugin checked its status)."""
        self.answered = True
        out: list[Effect] = []
        lineage = reply.get("lineage")  # absent while the scheduler does not know us yet
        if lineage is not None and self.lineage is not None and lineage != self.lineage:
            # a dispatcher without the state these tasks belong to: their ids mean nothing
            # to it, and task and dataset ids may be reused by it
            out.extend(self.tasks_changed((), list(self._tasks)))
            self.finished = Recent(self.finished.capacity)
            out.append(ForgetDatasets())
        if lineage is not None:
            self.lineage = lineage
        out.extend(self.tasks_changed(reply.get("new_tasks", ()), reply.get("cancelled", ())))
        return out

    # -- request order ------------------------------------------------------------------------
    def turn(self, key: tuple[int, int | None], seq: int, ack: int | None) -> Turn:
        turns = self._turns.get(key)
        if turns is None:
            turns = self._turns[key] = _Turns()
            task_id = key[0]
            self._consumers[task_id] = self._consumers.get(task_id, 0) + 1
        forget: tuple[int, ...] = ()
        keep = False
        if ack is not None:
            kept = turns.kept
            if kept:
                gone = [s for s in kept if s <= ack]
                if gone:
                    kept.difference_update(gone)
                    forget = tuple(gone)
            if seq in kept:
                return Turn(forget, replay=True)
            kept.add(seq)
            keep = True
        wait = seq > turns.next
        if wait:
            turns.waiting.add(seq)
        if not (forget or keep or wait):
            return _NO_TURN
        return Turn(forget, keep=keep, wait=wait)

    def turn_done(self, key: tuple[int, int | None], seq: int) -> int | None:
        turns = self._turns.get(key)
        if turns is None:
            return None
        turns.next = max(turns.next, seq + 1)
        turns.waiting.discard(seq)
        nxt = turns.next
        if nxt in turns.waiting:
            turns.waiting.discard(nxt)
            return nxt
        return None

    def turn_abandoned(self, key: tuple[int, int | None], seq: int, *,
                       waiting: bool = False, kept: bool = False) -> None:
        turns = self._turns.get(key)
        if turns is None:
            return
        if waiting:
            turns.waiting.discard(seq)
        if kept:
            turns.kept.discard(seq)

    def keep_reply(self, key: tuple[int, int | None], seq: int, has_elements: bool) -> bool:
        """Request ``seq``'s reply is computed: whether to keep it until acknowledged. Only a
        reply with elements is kept (losing it loses them); one without ("unknown", "nothing
        yet", end of sequence) is computed afresh for a request sent again: kept, it would be
        stale (the task arrived or finished since, and a reader told "unknown" for a finished
        task ends its read: the task's elements would be lost)."""
        if has_elements:
            return True
        turns = self._turns.get(key)
        if turns is not None:
            turns.kept.discard(seq)
        return False

    def unacknowledged(self, task_id: int) -> int:
        """Replies with elements of ``task_id`` that their consumers have not acknowledged
        yet (on their way, or lost and to be replayed). A retiring worker waits for none
        (issue 26). O(the worker's consumer keys)."""
        return sum(len(t.kept) for k, t in self._turns.items() if k[0] == task_id)

    def replies_kept(self, key: tuple[int, int | None]) -> int:
        turns = self._turns.get(key)
        return 0 if turns is None else len(turns.kept)

    def _drop_turns(self, task_id: int) -> None:
        for key in [k for k in self._turns if k[0] == task_id]:
            del self._turns[key]
        self._consumers.pop(task_id, None)


def heartbeat_delay(answered: bool, previous: float, interval: float) -> float:
    """Seconds until the next heartbeat: ``interval`` after an answer; with no dispatcher on
    the scheduler (yet), a backoff doubling to 30 s, so that its log is not flooded with "no
    handler" lines (installing the dispatcher re-sends the plugin, which restarts at once)."""
    return interval if answered else min(30.0, max(previous, interval) * 2)


# Reply shaping (per request) ----------------------------------------------------------------
def may_linger(taken: int, max_elements: int, linger: float, lingers: bool) -> bool:
    """Whether a request that took ``taken`` elements waits up to ``linger`` seconds for more:
    a request queued behind another (``linger > 0``) collects a slow pipeline's elements for
    a moment, so that each costs less than a round trip; never on an empty reply, a full one,
    or a buffer that does not linger (the cross-trainer window follows production)."""
    return taken > 0 and linger > 0 and taken < max_elements and lingers


def empty_reply(end_visible: bool, error: BaseException | None,
                cancelled: bool) -> dict[str, Any] | BaseException:
    """The reply to a request that got no element: end of sequence once the end is visible
    (the error instead if the pipeline raised), else "nothing yet" (end of sequence for a
    cancelled task, whose consumers stop reading it)."""
    if end_visible:
        if error is not None:
            return error
        return {"status": "OK", "elements": None, "end_of_sequence": True}
    return {"status": "OK", "elements": None, "end_of_sequence": cancelled}


def unknown_task_reply(task_id: int, finished: bool, known: bool) -> dict[str, Any]:
    """The reply for a task this worker does not run (yet): end of sequence if it finished
    here, else "unknown" unless it is reserved (its dataset loads)."""
    if finished:
        return {"status": "OK", "elements": None, "end_of_sequence": True}
    return {"status": "OK", "elements": None, "end_of_sequence": False, "unknown": not known}


# Splits of a DYNAMIC task ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SplitRequest:
    """Ask the dispatcher (``dataservice_get_split``) for ``count`` splits of ``repetition``;
    ``received``: how many of it the task got (a retry says it, see the plugin, and so does
    ``first``, the task's first request: splits handed to it that it never got come again)."""

    repetition: int
    count: int
    received: int
    first: bool = False


class SplitFlow:
    """Which splits a DYNAMIC task asks for, how many at once, and when it acknowledges a
    repetition (the task thread's :class:`._split_provider.DispatcherSplitProvider` does the
    asking and waiting).

    It asks ahead: once a batch of indices arrived, the next request goes out at once
    (:meth:`on_reply` says so). The batch doubles, up to ``max_batch``, whenever the source had
    to wait for a reply (:meth:`waiting`). :meth:`reset` (the next repetition) answers the
    repetition to acknowledge: two back, whose splits have left the pipeline.
    """

    def __init__(self, max_batch: int) -> None:
        self.repetition = 0
        #: Splits received of this repetition.
        self.received = 0
        self.ended = False
        #: The dispatcher drains this task's worker (issue 26): no split comes any more,
        #: in this repetition or a later one.
        self.drained = False
        self.batch = 1
        self.max_batch = max_batch
        self._local: deque[int] = deque()
        self._asked = False

    def start(self, task: Mapping[str, Any]) -> bool:
        """The task's first splits, if they came with it (issue 25); answers whether to ask
        for the next ones now (as :meth:`on_reply`)."""
        first = task.get("first_splits")
        if first is None:
            return False
        indices, end_of_splits = first
        return self.on_reply(list(indices), bool(end_of_splits))

    def request(self) -> SplitRequest:
        first, self._asked = not self._asked, True
        return SplitRequest(self.repetition, self.batch, self.received, first)

    def has_local(self) -> bool:
        return bool(self._local)

    def waiting(self, reply_ready: bool) -> None:
        """The source waits on a request (``reply_ready``: its reply is there already)."""
        if not reply_ready and self.batch < self.max_batch:
            self.batch *= 2  # we are waiting on the dispatcher: ask for more at once

    def on_reply(self, indices: list[int], end_of_splits: bool, drained: bool = False) -> bool:
        """A batch arrived; answers whether to ask for the next one now."""
        self._local.extend(indices)
        self.received += len(indices)
        self.ended = end_of_splits or drained
        self.drained = self.drained or drained
        return not self.ended

    def next_index(self) -> int:
        return self._local.popleft()

    def reset(self) -> int | None:
        """The next repetition starts; answers the repetition to acknowledge, if any."""
        self.repetition += 1
        self.received = 0
        self.ended = self.drained  # a drained task's later repetitions are empty
        # Splits two repetitions back have left the pipeline (short of a shuffle buffer
        # holding more than a whole repetition): stop counting them as in flight, so an
        # endless repeat() does not grow the dispatcher's in-flight set forever.
        return self.repetition - 2 if self.repetition >= 2 else None


# Coordinated reads ----------------------------------------------------------------------------
class Rounds:
    """The round logic of coordinated reads on one task (:class:`._buffers.RoundBuffer` waits
    and forms rounds from the task's buffer): round ``k`` holds the task's elements
    ``k*n .. k*n+n-1``, consumer ``c`` takes element ``c`` of each round, a round is dropped
    once every consumer took its element, and consumers may run ``max_ahead`` rounds ahead of
    the oldest round not fully read."""

    def __init__(self, num_consumers: int, max_ahead: int = 64) -> None:
        self.n = num_consumers
        self.max_ahead = max_ahead
        self.rounds: dict[int, list[Any]] = {}
        self.taken: dict[int, set[int]] = {}
        self.next_form = 0
        self.oldest = 0

    def out_of_step(self, r: int, consumer: int) -> str | None:
        """Why consumer ``consumer`` cannot read round ``r`` at all (it was dropped), or None."""
        if r < self.oldest:
            return (f"coordinated read: round {r} was already served to every consumer "
                    f"(consumer {consumer} is out of step)")
        return None

    def too_far_ahead(self, r: int) -> bool:
        """Round ``r`` must wait until the slowest consumers caught up."""
        return r - self.oldest >= self.max_ahead

    def laggards(self) -> list[int]:
        """The consumers that have not read the oldest round."""
        return sorted(set(range(self.n)) - self.taken.get(self.oldest, set()))

    def must_form(self, r: int) -> bool:
        return r >= self.next_form

    def formed(self, items: list[Any]) -> None:
        """The next round's ``n`` elements."""
        assert len(items) == self.n
        self.rounds[self.next_form] = items
        self.taken[self.next_form] = set()
        self.next_form += 1

    def take(self, r: int, consumer: int) -> tuple[Any, bool]:
        """Consumer ``consumer``'s element of (formed) round ``r``, and whether the oldest
        round moved on (waiting consumers may go on)."""
        element = self.rounds[r][consumer]
        taken = self.taken[r]
        taken.add(consumer)
        if len(taken) < self.n:
            return element, False
        del self.rounds[r], self.taken[r]
        while self.oldest < self.next_form and self.oldest not in self.rounds:
            self.oldest += 1
        return element, True


# The cross-trainer cache ------------------------------------------------------------------------
class TrainerCursors:
    """The consumer positions of a cross-trainer window (:class:`._buffers.CrossTrainerWindow`
    holds the elements and the lock): one cursor per trainer id into the task's element
    sequence; ``base`` is the sequence number of the oldest element still cached.

    A trainer whose cursor fell out of the window (evicted) skips ahead to ``base``; production
    follows the fastest trainer, at most ``lookahead`` elements (and half the window's bytes)
    ahead of it. The fastest trainer never waits for another, nor skips: once it has read
    every cached element there is always demand (:meth:`has_demand`), and the window evicts
    only elements it has read (:meth:`evictable`), so a window smaller than a producer's chunk
    runs over its bound by at most that chunk instead of starving it (issue 22, item 4).
    """

    def __init__(self, lookahead: int) -> None:
        self.base = 0
        self.lookahead = lookahead
        self.cursors: dict[str | None, int] = {}
        #: Elements trainers skipped because they fell out of the window.
        self.skipped = 0

    def lead(self) -> int:
        """The fastest trainer's position (``base`` before any trainer read)."""
        return max(self.cursors.values(), default=self.base)

    def has_demand(self, cached: int, cached_bytes: int, max_bytes: int, chunk: int) -> bool:
        """Whether to produce now, with ``cached`` elements (``cached_bytes``) in the window:
        only for the fastest trainer, and never so far ahead of it that the window would evict
        elements it has not read yet. A fastest trainer that read everything cached always
        has demand, whatever the elements' size: before, a window holding fewer than two
        chunks' bytes never produced again once it had been read, and its trainers waited
        for ever."""
        ahead = self.base + cached - self.lead()
        if ahead <= 0:
            return True
        if ahead >= self.lookahead:
            return False
        average = cached_bytes / cached
        return (ahead + chunk) * average <= max_bytes / 2

    def evictable(self) -> int:
        """How many of the oldest cached elements the window may evict: those the fastest
        trainer has read (slower trainers skip them)."""
        return max(0, self.lead() - self.base)

    def evicted(self, count: int) -> None:
        self.base += count

    def start(self, trainer_id: str | None) -> int:
        """Where ``trainer_id`` reads next, as an offset into the cached elements."""
        cursor = self.cursors.get(trainer_id, self.base)
        if cursor < self.base:
            self.skipped += self.base - cursor
            cursor = self.base
            self.cursors[trainer_id] = cursor
        return cursor - self.base

    def took(self, trainer_id: str | None, offset: int, count: int) -> None:
        """``trainer_id`` took ``count`` elements from ``offset`` (as :meth:`start` said)."""
        self.cursors[trainer_id] = self.base + offset + count
