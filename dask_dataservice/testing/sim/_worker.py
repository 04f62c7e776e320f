"""The simulated data worker, built on the REAL worker core.

:class:`~dask_dataservice.service.worker.core.WorkerCore` decides every task start and drop,
the heartbeat message and what a heartbeat reply changes, when a finish report goes out (when
the task's input ended) and when end of sequence becomes visible (only once the finish was
answered), and each consumer's request order (``turn``: kept replies, replays, acks).
:class:`~dask_dataservice.service.worker.core.SplitFlow` decides which splits a DYNAMIC task
asks for and how many at once; :func:`unknown_task_reply` and :func:`empty_reply` shape the
replies. This actor does only what the plugin's I/O does: it delivers messages to the core,
carries out its effects, and produces elements deterministically:

- split ``s`` (DYNAMIC, static FILE) is the elements ``s * per_split .. s * per_split +
  per_split - 1``; static DATA is the elements ``e`` with ``e % num_workers == index``;
  under a dataset ``.repeat(k)`` (``Params.repeat``) an element of repetition ``r`` is
  ``(r, e)``, and the task's pipeline starts the next repetition (``SplitFlow.reset``, then
  ``ack_splits`` of the repetition it answers) when one ended;
- an OFF task's elements are ``(task_id, i)`` for ``i`` in ``range(num_elements)`` (an endless
  job: every ``i``), so each worker's copy is told apart.

Coordinated reads (a job with ``num_consumers``): ``get_rounds`` forms and hands out rounds
with the core's :class:`~dask_dataservice.service.worker.core.Rounds`, waiting as the
plugin's ``RoundBuffer`` does (for a round to form, for laggards, up to
``Params.round_timeout``). The cross-trainer cache: a task's buffer is a window of
``Params.window`` elements whose per-trainer cursors, eviction bookkeeping and production
demand are the core's :class:`~dask_dataservice.service.worker.core.TrainerCursors`, as in
the plugin's ``CrossTrainerWindow`` (its producer: DYNAMIC splits of the endless repeat, or
an OFF task's endless copy, a chunk at a time, at most a window per tick); each element there is ``(task_id, position, value)``
(``position``: its place in the task's stream) and each reply says the window's first
position (``base``), so the consumer checks what a trainer skipped was evicted.

Where it differs from the plugin: a dataset "loads" at once (``task_started`` on the start
effect); a request waiting for its turn (an earlier one of the same consumer never came)
gives up at once instead of after the long poll plus 10 s.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...service.protocol._sharding import ShardingPolicy
from ...service.worker.core import (
    CancelTask,
    Effect,
    Rounds,
    SendFinishTask,
    ShowEnd,
    SplitFlow,
    StartTask,
    TaskPhase,
    TrainerCursors,
    WorkerCore,
    empty_reply,
    unknown_task_reply,
)
from ._world import DISPATCHER, Host

if TYPE_CHECKING:
    from ._scenario import Run

__all__ = ["DataWorker"]

#: Elements the window's producer hands over at once (``CrossTrainerWindow.chunk_size``).
WINDOW_CHUNK = 8
#: Seconds ``get_rounds`` waits for a task that has not arrived (the plugin's ``_runner``).
ROUNDS_TASK_WAIT = 10.0


@dataclass
class _Runner:
    """What the plugin's TaskRunner holds: the task, its buffer, its split flow."""

    task: dict[str, Any]
    buffer: deque[Any] = field(default_factory=deque)
    flow: SplitFlow | None = None
    asking: bool = False
    attempts: int = 0
    waited: bool = False
    end_visible: bool = False
    off_next: int = 0
    static_done: bool = False
    #: Coordinated reads: the round logic (made by the first ``get_rounds``) and the round
    #: being formed.
    rounds: Rounds | None = None
    forming: list[Any] = field(default_factory=list)
    #: The cross-trainer cache: the trainers' cursors, the pipeline's elements not yet in
    #: the window, elements put in the window and evicted from it, and the harness's own
    #: lead (one past the furthest position any trainer took).
    cursors: TrainerCursors | None = None
    staged: deque[Any] = field(default_factory=deque)
    produced: int = 0
    evicted: int = 0
    lead: int = 0


@dataclass
class _RoundsCall:
    """A ``get_rounds`` request under way (the plugin's handler awaiting its rounds)."""

    src: str
    rid: int
    kw: dict[str, Any]
    arrived: float
    next_round: int
    out: list[Any] = field(default_factory=list)
    #: When the current round's wait for laggards gives up.
    deadline: float | None = None
    #: The runner it started on (a cancelled task ends it with an error).
    runner: _Runner | None = None


class DataWorker:
    """A data worker process (see the module docstring)."""

    def __init__(self, run: Run, address: str) -> None:
        from ._actors import _Rpc

        self.run = run
        self.world = run.world
        self.address = address
        self.host = self.world.hosts.setdefault(address, Host(address))
        self.host.deliver = self._deliver
        self.rpc = _Rpc(self.world, run.net, self.host)
        self.left = False
        self.fresh()

    def fresh(self) -> None:
        """A new process: nothing kept."""
        self.core = WorkerCore()
        self.runners: dict[int, _Runner] = {}
        #: ``{(task_id, consumer, seq): reply}`` kept until acknowledged (``core.turn``).
        self.kept: dict[tuple[int, int, int], Any] = {}
        #: ``get_rounds`` requests waiting (for their task, a round, or laggards).
        self.round_calls: list[_RoundsCall] = []
        self.rpc.reset()
        self.world.on(self.address, self.world.rng.uniform(0, 0.05), self.heartbeat)
        self.world.on(self.address, 0.01, self.produce)

    @property
    def tasks(self) -> dict[int, _Runner]:
        return self.runners

    # The dispatcher side ------------------------------------------------------------------
    def heartbeat(self) -> None:
        def reply(r: Any) -> None:
            if r.get("status") != "OK":
                self.run.fail(f"{self.address}: worker heartbeat refused: {r}")
                return
            self._execute(self.core.heartbeat_reply(r))

        self.rpc.call(DISPATCHER, "worker_heartbeat", self.core.heartbeat_message(), reply,
                      lambda: None, "heartbeat")
        self.world.on(self.address, self.run.params.worker_heartbeat, self.heartbeat)

    def _execute(self, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, StartTask):
                task: dict[str, Any] = dict(effect.task)
                runner = _Runner(task)
                if ShardingPolicy(task["processing_mode"]) == ShardingPolicy.DYNAMIC:
                    runner.flow = SplitFlow(self.run.params.split_batch)
                    first = task.get("first_splits")
                    if first is not None:  # its first split came with it (issue 25)
                        self.run.handed(self.address, task["iteration_id"], task["task_id"],
                                        0, list(first[0]))
                if task.get("cross_trainer_cache"):
                    runner.cursors = TrainerCursors(self.run.params.lookahead)
                self.runners[task["task_id"]] = runner
                self.core.task_started(task["task_id"])  # its dataset "loads" at once
                if runner.flow is not None and runner.flow.start(task):
                    self._ask(task["task_id"], runner)  # ask ahead
            elif isinstance(effect, CancelTask):
                self.runners.pop(effect.task_id, None)
                for k in [k for k in self.kept if k[0] == effect.task_id]:
                    del self.kept[k]
            elif isinstance(effect, SendFinishTask):
                self._send_finish(effect)
            elif isinstance(effect, ShowEnd):
                r = self.runners.get(effect.task_id)
                if r is not None:
                    r.end_visible = True
            # ForgetDatasets: this actor keeps no datasets

    def _send_finish(self, finish: SendFinishTask) -> None:
        def done(_: Any = None) -> None:  # answered, or failed: the heartbeat reports it
            self._execute(self.core.finish_sent(finish.task_id))

        self.rpc.call(DISPATCHER, "finish_task",
                      {"task_id": finish.task_id, "error": finish.error,
                       "job_token": finish.job_token},
                      done, done, f"finish-{finish.task_id}")

    # Production (the task threads) ----------------------------------------------------------
    def produce(self) -> None:
        params = self.run.params
        for task_id, r in list(self.runners.items()):
            if self.core.phase(task_id) != TaskPhase.RUNNING:
                continue
            if r.cursors is not None:
                self._produce_window(task_id, r)
                continue
            if len(r.buffer) >= params.buffer:
                continue
            mode = ShardingPolicy(r.task["processing_mode"])
            if r.flow is not None:
                self._produce_dynamic(task_id, r, r.buffer, params.buffer)
            elif mode == ShardingPolicy.OFF:
                end = params.num_elements if params.repeat else None  # 0: endless
                stop = r.off_next + params.per_split
                stop = stop if end is None else min(stop, end)
                r.buffer.extend((task_id, i) for i in range(r.off_next, stop))
                r.off_next = stop
                if end is not None and stop >= end:
                    self._execute(self.core.input_ended(task_id, False))
            else:  # static sharding: this worker's shard
                index, shards = r.task["worker_index"], r.task["num_workers"]
                if mode == ShardingPolicy.DATA:
                    r.buffer.extend(e for e in range(params.num_elements) if e % shards == index)
                else:  # FILE: the splits (files) of this shard
                    for s in range(index, params.num_splits, shards):
                        r.buffer.extend(self.run.split_elements(s))
                self._execute(self.core.input_ended(task_id, False))
        if self.round_calls:
            self._serve_rounds()
        self.world.on(self.address, params.produce_interval, self.produce)

    def _produce_dynamic(self, task_id: int, r: _Runner, into: deque[Any], cap: int) -> None:
        flow = r.flow
        assert flow is not None
        repeat = self.run.params.repeat
        cached = []
        while flow.has_local() and len(into) < cap:
            index = flow.next_index()
            elements = self.run.split_elements(index)
            into.extend(elements if repeat == 1 else ((flow.repetition, e) for e in elements))
            if self.run.params.workload == "autocache" and self.world.rng.random() < 0.8:
                cached.append(index)  # kept by its autocache(): told to the dispatcher
        if cached:
            task = r.task
            self.rpc.call(DISPATCHER, "autocached",
                          {"task_id": task_id, "indices": cached, "job_token": task["job_token"]},
                          lambda _: None, lambda: None, f"autocached-{task_id}")
        if flow.has_local():
            return
        if flow.ended and (repeat == 0 or flow.repetition + 1 < repeat):
            # the dataset's repeat(): the next repetition asks the dispatcher afresh
            # (data/ops.py Repeat.iterate -> the split provider's reset)
            ack = flow.reset()
            if ack is not None:
                self._ack(r, ack)
            r.asking = False
            self._ask(task_id, r)
        elif flow.ended:
            self._execute(self.core.input_ended(task_id, False))
        elif not r.asking:
            self._ask(task_id, r)
        elif not r.waited:  # the source waits on the request in flight
            r.waited = True
            flow.waiting(False)

    def _ask(self, task_id: int, r: _Runner) -> None:
        flow = r.flow
        assert flow is not None
        req = flow.request()
        r.asking, r.waited = True, False
        r.attempts += 1
        task = r.task
        kwargs = {"iteration_id": task["iteration_id"], "task_id": task_id,
                  "repetition": req.repetition, "count": req.count,
                  "job_token": task["job_token"],
                  "received": req.received if r.attempts > 1 or req.first else None}

        def reply(resp: Any) -> None:
            if self.runners.get(task_id) is not r:
                return
            r.asking, r.attempts = False, 0
            if resp.get("status") != "OK":
                self.run.note(f"{self.address} get_split of task {task_id}: {resp}")
                return
            indices = list(resp["split_indices"])
            self.run.handed(self.address, task["iteration_id"], task_id, req.repetition, indices)
            if flow.on_reply(indices, bool(resp["end_of_splits"]), bool(resp.get("drained"))):
                self._ask(task_id, r)  # ask ahead

        def timeout() -> None:
            if self.runners.get(task_id) is r:
                r.asking = False  # asked again (with ``received``) by the next production

        self.rpc.call(DISPATCHER, "get_split", kwargs, reply, timeout, f"split-{task_id}")

    def _ack(self, r: _Runner, repetition: int) -> None:
        """``ack_splits`` (the plugin's ``_ack_splits``: one try, only bookkeeping is lost)."""
        task = r.task
        self.rpc.call(DISPATCHER, "ack_splits",
                      {"task_id": task["task_id"], "repetition": repetition,
                       "job_token": task["job_token"]},
                      lambda _: None, lambda: None, f"ack-{task['task_id']}-{repetition}")

    def _produce_window(self, task_id: int, r: _Runner) -> None:
        """The cross-trainer window's producer: chunks while the core says there is demand;
        a full window evicts its oldest elements (``CrossTrainerWindow.put_many``)."""
        cursors = r.cursors
        assert cursors is not None
        cap = self.run.params.window
        window = r.buffer
        chunks = cap // WINDOW_CHUNK + 1  # a thread's pace: at most a window per tick
        while chunks and cursors.has_demand(len(window), len(window), cap, WINDOW_CHUNK):
            chunks -= 1
            if len(r.staged) < WINDOW_CHUNK and r.flow is not None:  # the endless repeat
                self._produce_dynamic(task_id, r, r.staged, WINDOW_CHUNK)
            elif len(r.staged) < WINDOW_CHUNK:  # OFF: the endless copy
                r.staged.extend((task_id, i) for i in range(r.off_next, r.off_next + 8))
                r.off_next += 8
            if not r.staged:
                return  # the pipeline waits for splits
            for _ in range(min(WINDOW_CHUNK, len(r.staged))):
                window.append((task_id, r.produced, r.staged.popleft()))
                r.produced += 1
            evicted = 0
            evictable = cursors.evictable()  # what the fastest trainer read
            while len(window) > cap and evicted < evictable:
                _, position, _ = window.popleft()
                if position >= r.lead:
                    self.run.fail(f"{self.address}: the window of task {task_id} evicted "
                                  f"position {position}, which no trainer had read (the "
                                  f"furthest read is {r.lead - 1})")
                evicted += 1
            if evicted:
                cursors.evicted(evicted)
                r.evicted += evicted

    # The consumer side ------------------------------------------------------------------------
    def _deliver(self, src: str, msg: Any) -> None:
        kind = msg[0]
        if kind == "reply":
            self.rpc.reply(msg[1], msg[2])
        elif kind == "push":
            self._execute(self.core.tasks_changed(msg[1].get("new_tasks", ()),
                                                  msg[1].get("cancelled", ())))
        elif kind == "rpc":
            _, rid, name, kw = msg
            if name == "get_rounds":
                self.round_calls.append(_RoundsCall(src, rid, kw, self.world.now,
                                                    kw["first_round"]))
                self._serve_rounds()
                return
            assert name == "fetch"
            reply = self._get_elements(src, kw)
            if reply is not None:
                self.run.net.send(self.address, src, ("reply", rid, reply))

    def _get_elements(self, consumer: str, kw: dict[str, Any]) -> dict[str, Any] | None:
        """``get_elements`` with ``(consumer, seq, ack)``, as the plugin's handler."""
        if kw.get("seq") is None:  # the cross-trainer turn reader numbers no request
            return self._take(kw["task_id"], kw["max_elements"], kw.get("trainer_id"))
        task_id, seq, client = kw["task_id"], kw["seq"], kw["consumer"]
        key = (task_id, client)
        turn = self.core.turn(key, seq, kw["ack"])
        for s in turn.forget:
            self.kept.pop((task_id, client, s), None)
        if turn.replay:  # sent again: the first answer (None: still under way, never here)
            return self.kept.get((task_id, client, seq))
        if turn.wait:  # the earlier request never came: give up waiting for it at once
            self.core.turn_abandoned(key, seq, waiting=True)
        reply = self._take(task_id, kw["max_elements"], kw.get("trainer_id"))
        self.core.turn_done(key, seq)
        if turn.keep and self.core.keep_reply(key, seq, reply.get("elements") is not None):
            self.kept[(task_id, client, seq)] = reply
        return reply

    def _take(self, task_id: int, n: int, trainer_id: str | None = None) -> dict[str, Any]:
        r = self.runners.get(task_id)
        if r is None:
            return unknown_task_reply(task_id, task_id in self.core.finished,
                                      self.core.knows(task_id))
        if r.cursors is not None:  # CrossTrainerWindow.take
            start = r.cursors.start(trainer_id)
            items = list(itertools.islice(r.buffer, start, start + n))
            r.cursors.took(trainer_id, start, len(items))
            if items:
                r.lead = max(r.lead, items[-1][1] + 1)
                return {"status": "OK", "elements": items, "base": r.evicted}
            # no trainer waits for another, nor for nothing: one that read the whole window
            # always gets production (issue 22, item 4: a window of fewer than two chunks
            # never produced again once read, and every trainer waited for ever)
            window = r.buffer
            if not r.cursors.has_demand(len(window), len(window), self.run.params.window,
                                        WINDOW_CHUNK):
                self.run.fail(f"{self.address}: {trainer_id} read the whole window of task "
                              f"{task_id} ({len(window)} elements from position "
                              f"{r.cursors.base}) and waits, but the window asks the "
                              "pipeline for nothing")
        elif r.buffer:
            items = [r.buffer.popleft() for _ in range(min(n, len(r.buffer)))]
            return {"status": "OK", "elements": items}
        reply = empty_reply(r.end_visible, None, False)
        assert isinstance(reply, dict)
        return reply

    # Coordinated reads ------------------------------------------------------------------------
    def _serve_rounds(self) -> None:
        """Run the waiting ``get_rounds`` requests as far as they go (the handler's awaits:
        for its task, for a round to form, for laggards); answer those that are done."""
        progressed = True
        while progressed:
            progressed = False
            for call in list(self.round_calls):
                before = len(call.out)
                reply = self._rounds_step(call)
                if reply is not None:
                    self.round_calls.remove(call)
                    self.run.net.send(self.address, call.src, ("reply", call.rid, reply))
                if reply is not None or len(call.out) > before:
                    progressed = True  # a round moved on: the others may go on

    def _rounds_step(self, call: _RoundsCall) -> dict[str, Any] | None:
        """``get_rounds`` (the plugin's handler and ``RoundBuffer.get``) until it waits;
        its reply once done."""
        kw = call.kw
        task_id, consumer = kw["task_id"], kw["consumer_index"]
        r = self.runners.get(task_id)
        now = self.world.now
        if r is None or (call.runner is not None and r is not call.runner):
            if call.runner is not None:
                return _error("DataServiceError: coordinated read: the task was cancelled")
            if task_id in self.core.finished or now - call.arrived >= ROUNDS_TASK_WAIT:
                return _error(f"DataServiceError: task {task_id} does not run on "
                              f"{self.address}")
            return None
        call.runner = r
        if r.rounds is None:
            r.rounds = Rounds(kw["num_consumers"], self.run.params.max_ahead)
        rounds = r.rounds
        if not 0 <= consumer < rounds.n:
            return _error(f"ValueError: consumer_index must be in [0, {rounds.n}), got "
                          f"{consumer}")
        stop = kw["first_round"] + kw["count"]
        while call.next_round < stop:
            rnd = call.next_round
            why = rounds.out_of_step(rnd, consumer)
            if why is not None:
                return _error(f"DataServiceError: {why}")
            if rounds.too_far_ahead(rnd):
                if call.deadline is None:
                    call.deadline = now + self.run.params.round_timeout
                if now >= call.deadline:
                    return _error(
                        f"TimeoutError: coordinated read: consumers {rounds.laggards()} have "
                        f"not read round {rounds.oldest} (consumer {consumer} cannot go on)")
                return None
            call.deadline = None
            while rounds.must_form(rnd):  # RoundBuffer._form_next
                while r.buffer and len(r.forming) < rounds.n:
                    r.forming.append(r.buffer.popleft())
                if len(r.forming) < rounds.n:
                    if r.end_visible:
                        return _error("DataServiceError: coordinated reads need an infinite "
                                      "dataset, and this one ended")
                    return None
                rounds.formed(r.forming)
                r.forming = []
                if rounds.next_form - rounds.oldest > rounds.max_ahead:
                    self.run.fail(f"{self.address}: task {task_id} holds rounds "
                                  f"{rounds.oldest}..{rounds.next_form - 1}, more than "
                                  f"max_ahead={rounds.max_ahead} past the oldest unread")
            element, _ = rounds.take(rnd, consumer)
            call.out.append(element)
            call.next_round += 1
        return {"status": "OK", "elements": call.out}


def _error(text: str) -> dict[str, Any]:
    return {"status": "error", "error": text}
