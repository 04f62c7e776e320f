"""The simulated readers over a fixed task list: coordinated reads and the cross-trainer cache.

Built on the REAL reader-core functions that :mod:`...service.client._fixed_readers` uses:
:func:`~dask_dataservice.service.client.reader_core.fixed_tasks` (the active tasks when the
read starts, by id), :func:`~dask_dataservice.service.client.reader_core.task_lost` (a task
the read needs is gone: it ends with an error), :func:`join_rounds` / :func:`join_turns` (how
one turn's parts are put together). The actor does what ``_FixedTasksReader`` does with
coroutines: it asks every task for its part of turn ``u`` at once, asks for turn ``u + 1`` as
soon as turn ``u`` is complete, then hands turn ``u`` over; a request unanswered for
``REQUEST_TIMEOUT`` makes it ask the dispatcher whether the task was lost (``_answer``; the
probe of the worker is not simulated: a silent worker is dropped by the dispatcher's
worker timeout). Its requests have no timeout of their own (a comm waits for its reply), so
these workloads draw no message losses: a lost reply fails the real read, as a broken comm
does; a request to a worker process that died fails so too (found at that check).

- coordinated reads: ``get_rounds(first_round=u * k, count=k)`` to each task (``k``:
  ``Params.rounds_per_request``, ``client.rounds-per-request``);
- the cross-trainer cache: ``get_elements(max_elements=K - got, trainer_id=...)`` to each
  task until it gave ``K`` (``Params.turn_elements``,
  ``client.cross-trainer-turn-elements``); what a reply means is
  :func:`~dask_dataservice.service.client.reader_core.turn_reply`: "nothing yet" asks again
  after ``fetch_interval`` (the long poll), "unknown" asks the dispatcher first (the read
  fails if the task is lost), end of sequence ends the read with an error.

Each element is checked as it is handed over (:meth:`~._scenario.Run.received_fixed`).
"""

from __future__ import annotations

import functools
import itertools
from typing import TYPE_CHECKING, Any

from ...service.client import reader_core
from ...service.client.reader_core import fixed_tasks, join_rounds, join_turns, task_lost
from ._actors import _Rpc
from ._world import DISPATCHER, Host

if TYPE_CHECKING:
    from ._scenario import Run

__all__ = ["FixedReader"]

#: ``client.request-timeout`` (virtual seconds): then the reader asks whether the task is lost.
REQUEST_TIMEOUT = 1.0
#: ``client.dispatcher-timeout``: how long a read waits for a task before it fails.
NO_TASKS_TIMEOUT = 10.0


class FixedReader:
    """A consumer of a coordinated read (``consumer_index`` of ``num_consumers``) or a trainer
    of a cross-trainer cache (``trainer_id``); see the module docstring."""

    def __init__(self, run: Run, name: str, job: dict[str, Any], index: int) -> None:
        self.run = run
        self.world = run.world
        self.name = name
        self.job = job
        self.index = index
        self.coordinated = job.get("num_consumers") is not None
        self.trainer_id = None if self.coordinated else f"trainer{index}"
        self.host = self.world.hosts.setdefault(name, Host(name))
        self.host.deliver = self._deliver
        self.rpc = _Rpc(self.world, run.net, self.host)
        self.received: list[Any] = []
        #: The fixed task list, and how many elements this reader hands over in all.
        self.tasks: list[tuple[int, str]] = []
        self.target = 0
        self.turn = 0
        #: A turn is being handed over (the consumer has not taken it yet).
        self.busy = False
        #: ``{turn: [part of each task, None while under way]}``.
        self.parts: dict[int, list[list[Any] | None]] = {}
        self.done_at: float | None = None
        self.released = False
        self.error: str | None = None
        self.client: dict[str, Any] | None = None
        self.iteration_id: int | None = None
        self.final_state: Any = None
        #: Cross-trainer: ``{task_id: last position taken}``, and whether the trainer ever
        #: skipped (fell out of a window) or started past a window's first element.
        self.positions: dict[int, int] = {}
        self.skipped = False
        self._started_at = 0.0
        self._asks = itertools.count()
        self.world.on(name, run.params.start_delay, self.start)

    def _deliver(self, src: str, msg: Any) -> None:
        if msg[0] == "reply":
            self.rpc.reply(msg[1], msg[2])

    # The dispatcher side --------------------------------------------------------------------
    def start(self) -> None:
        def reply(r: Any) -> None:
            if r.get("status") != "OK":
                self.run.fail(f"{self.name}: the read could not start: {r}")
                return
            self.token = r["job"]["job_token"]
            self.client = r["iteration"]
            self.iteration_id = r["iteration"]["iteration_id"]
            self._started_at = self.world.now
            self._wait_for_tasks(r["iteration"])

        self.rpc.call(DISPATCHER, "start_read", {"job": self.job}, reply, self.start, "start")

    def _ask(self, then: Any) -> None:
        """A client heartbeat; ``then(view)`` with its view (asked again until answered)."""
        assert self.client is not None

        def reply(r: Any) -> None:
            if self.done_at is not None:
                return
            if r.get("status") != "OK":
                self.run.fail(f"{self.name}: client heartbeat refused: {r}")
                return
            then(r)

        self.rpc.call(DISPATCHER, "client_heartbeat",
                      {"iteration_client_id": self.client["iteration_client_id"],
                       "job_token": self.token}, reply, lambda: self._ask(then),
                      f"ask-{next(self._asks)}")

    def _wait_for_tasks(self, view: dict[str, Any]) -> None:
        if self.done_at is not None:
            return
        tasks = fixed_tasks(view)
        if not tasks:
            if self.world.now - self._started_at > NO_TASKS_TIMEOUT:
                self._end(f"{self._what}: the job has no data workers")
                return
            self.world.on(self.name, 0.05, lambda: self._ask(self._wait_for_tasks))
            return
        self.tasks = tasks
        p = self.run.params
        per_task = p.rounds_per_request if self.coordinated else p.turn_elements
        self.target = p.turns * per_task * len(tasks)
        self.run.started_fixed(self)
        self._heartbeats()
        self._request(0)

    def _heartbeats(self) -> None:
        if self.done_at is not None:
            return
        self._ask(lambda view: None)
        self.world.on(self.name, self.run.params.client_heartbeat, self._heartbeats)

    @property
    def _what(self) -> str:
        return "coordinated reads" if self.coordinated else "cross-trainer cache"

    # The turns --------------------------------------------------------------------------------
    def _request(self, turn: int) -> None:
        self.parts[turn] = [None] * len(self.tasks)
        for i, (task_id, address) in enumerate(self.tasks):
            if self.coordinated:
                self._rounds(turn, i, task_id, address)
            else:
                self._elements(turn, i, task_id, address, [])

    def _call(self, turn: int, address: str, task_id: int, name: str, kwargs: dict[str, Any],
              on_reply: Any) -> None:
        """One request (no timeout: a comm waits), and ``_answer``'s check: unanswered for
        ``REQUEST_TIMEOUT``, ask whether the task was lost (then the read fails)."""
        slot = f"{name}-{turn}-{task_id}"
        answered = [False]
        worker = self.world.hosts[address]
        incarnation = worker.incarnation if worker.alive else -1  # dead: connection refused

        def reply(r: Any) -> None:
            answered[0] = True
            if self.done_at is None:
                on_reply(r)

        def check() -> None:
            if answered[0] or self.done_at is not None:
                return
            if not worker.alive or worker.incarnation != incarnation:
                # the process died: its connections broke (the request raises at once)
                self._end(f"{self._what}: the connection to {address} (task {task_id}) "
                          "broke: the worker died")
                return

            def verdict(view: dict[str, Any]) -> None:
                if answered[0]:
                    return
                if task_lost(view, task_id):
                    self._end(f"{self._what}: the worker of task {task_id} ({address}) "
                              "stopped answering and the dispatcher dropped it")
                    return
                self.world.on(self.name, REQUEST_TIMEOUT, check)

            self._ask(verdict)

        self.rpc.call(address, name, kwargs, reply, lambda: None, slot, timeout=None)
        self.world.on(self.name, REQUEST_TIMEOUT if worker.alive else 0.001, check)

    def _rounds(self, turn: int, i: int, task_id: int, address: str) -> None:
        k = self.run.params.rounds_per_request

        def reply(r: Any) -> None:
            if r.get("status") != "OK":
                self._end(f"coordinated read: {r.get('error')}")
                return
            self._part(turn, i, list(r["elements"]))

        assert self.client is not None
        self._call(turn, address, task_id, "get_rounds",
                   {"task_id": task_id, "first_round": turn * k, "count": k,
                    "consumer_index": self.index, "num_consumers": self.job["num_consumers"],
                    "job_token": self.token}, reply)

    def _elements(self, turn: int, i: int, task_id: int, address: str, out: list[Any]) -> None:
        k = self.run.params.turn_elements

        def again() -> None:  # the long poll's wait, then again
            self.world.on(self.name, self.run.params.fetch_interval, functools.partial(
                self._elements, turn, i, task_id, address, out))

        def reply(r: Any) -> None:
            kind = reader_core.turn_reply(r)
            if kind == "closing":
                self._end(f"cross-trainer cache: the worker of task {task_id} ({address}) "
                          "is shutting down")
            elif kind == "error":
                self._end(f"element request: {r.get('error')}")
            elif kind == "elements":
                if not self.run.took_window(self, task_id, r["elements"], r["base"]):
                    return
                out.extend(r["elements"])
                if len(out) < k:
                    self._elements(turn, i, task_id, address, out)
                else:
                    self._part(turn, i, out)
            elif kind == "end":
                self._end(f"the cross-trainer cache needs an infinite dataset, and task "
                          f"{task_id} ended")
            elif kind == "unknown":  # lost? (the worker never got it, or restarted)
                def verdict(view: dict[str, Any]) -> None:
                    if reader_core.task_lost(view, task_id):
                        self._end(f"cross-trainer cache: the worker of task {task_id} "
                                  f"({address}) does not run it and the dispatcher lost it")
                    else:
                        again()

                self._ask(verdict)
            else:
                again()

        if self.done_at is not None:
            return
        self._call(turn, address, task_id, "fetch",
                   {"task_id": task_id, "max_elements": k - len(out),
                    "trainer_id": self.trainer_id, "job_token": self.token}, reply)

    def _part(self, turn: int, i: int, part: list[Any]) -> None:
        self.parts[turn][i] = part
        self._advance()

    def _advance(self) -> None:
        """Turn ``self.turn`` complete and the consumer took the one before (the channel's
        ``put`` returned): ask for the next turn, then hand this one over once the consumer
        is ready for it (``Params.think`` seconds per turn, times the consumer's index)."""
        parts = self.parts.get(self.turn)
        if self.done_at is not None or self.busy or parts is None or \
                any(p is None for p in parts):
            return
        done = [p for p in self.parts.pop(self.turn) if p is not None]
        self.turn += 1
        self._request(self.turn)  # the next turn is asked for while this one is handed
        self.busy = True
        self.world.on(self.name, self.run.params.think * self.index,
                      functools.partial(self._hand_over, done))

    def _hand_over(self, done: list[list[Any]]) -> None:
        self.busy = False
        for element in join_rounds(done) if self.coordinated else join_turns(done):
            if self.done_at is not None:
                return
            self.run.received_fixed(self, element)
            if len(self.received) >= self.target:
                self._end(None)
        self._advance()

    # The end ----------------------------------------------------------------------------------
    def _end(self, error: str | None) -> None:
        if self.done_at is not None:
            return
        self.error = error
        self.done_at = self.world.now
        assert self.iteration_id is not None
        self.final_state = self.run.seen_by(self.iteration_id)
        self.world.log(f"{self.name} ended with {len(self.received)} of {self.target}"
                       + (f": {error}" if error else ""))
        self.release()

    def release(self) -> None:
        assert self.client is not None

        def reply(r: Any) -> None:
            self.released = True

        self.rpc.call(DISPATCHER, "release_iteration_client",
                      {"iteration_client_id": self.client["iteration_client_id"],
                       "job_token": self.token}, reply, self.release, "release")
