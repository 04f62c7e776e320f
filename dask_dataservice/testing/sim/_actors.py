"""The simulated consumers (and the request/response helper the actors share).

:class:`Consumer` is built on the REAL reader core (:mod:`...service.client.reader_core`);
the data worker, built on the real worker core, is in :mod:`._worker`; the dispatcher they
drive is the real :class:`DispatcherCore` (:mod:`._world`).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...service.client.reader_core import ReaderCore, TaskRead, Tracker
from ._world import DISPATCHER, Host, Network, World

if TYPE_CHECKING:
    from ._scenario import Run

__all__ = ["Consumer"]

#: Seconds an actor waits for a reply before it asks again.
RPC_TIMEOUT = 0.5
#: A reader's ``client.dispatcher-timeout`` (virtual seconds of failed requests to one
#: worker before it gives the task up).
RETRY_TIMEOUT = 10.0
#: The readers' ``target_workers`` (the default).
TARGET_WORKERS = "AUTO"


class _Rpc:
    """Request/response over the simulated network, with a timeout and no retry of its own
    (the actor decides); only the reply to the latest request of a ``slot`` is taken."""

    def __init__(self, world: World, net: Network, host: Host) -> None:
        self._ids = itertools.count()
        self.world = world
        self.net = net
        self.host = host
        self._waiting: dict[int, tuple[str, Callable[[Any], None]]] = {}
        self._latest: dict[str, int] = {}

    def call(self, dst: str, name: str, kwargs: dict[str, Any], on_reply: Callable[[Any], None],
             on_timeout: Callable[[], None], slot: str,
             timeout: float | None = RPC_TIMEOUT) -> None:
        """Send a request; ``timeout=None``: wait for its reply for ever (a comm)."""
        rid = next(self._ids)
        self._waiting[rid] = (slot, on_reply)
        self._latest[slot] = rid
        self.net.send(self.host.name, dst, ("rpc", rid, name, kwargs))
        if timeout is None:
            return

        def expired() -> None:
            if self._waiting.pop(rid, None) is not None and self._latest.get(slot) == rid:
                on_timeout()

        self.world.on(self.host.name, timeout, expired)

    def reply(self, rid: int, value: Any) -> None:
        entry = self._waiting.pop(rid, None)
        if entry is None:
            return
        slot, fn = entry
        if self._latest.get(slot) == rid:
            fn(value)

    def reset(self) -> None:
        self._waiting.clear()
        self._latest.clear()


class Consumer:
    """A reader of one job, built on the REAL reader core: :class:`ReaderCore` decides which
    tasks to read, when a task's read is over and when the pass is over; one
    :class:`TaskRead` per task decides each request (``seq``, ``ack``), what a reply means
    (elements, end of sequence, a worker that will never know the task) and what a failed
    request does (back off and send again from its ``seq``, or give up). This actor only
    delivers views, replies, failures (an RPC timeout) and timer events, and collects the
    elements, as :mod:`dask_dataservice.service.client._reader` does with coroutines."""

    def __init__(self, run: Run, name: str, job: dict[str, Any]) -> None:
        self.run = run
        self.world = run.world
        self.name = name
        self.job = job
        self.host = self.world.hosts.setdefault(name, Host(name))
        self.host.deliver = self._deliver
        self.rpc = _Rpc(self.world, run.net, self.host)
        self.received: list[Any] = []
        self.client: dict[str, Any] | None = None
        self.view: dict[str, Any] | None = None
        self.core: ReaderCore | None = None
        #: ``{task_id: its request pipeline}`` of the tasks being read.
        self.reads: dict[int, TaskRead] = {}
        self.done_at: float | None = None
        self.released = False
        self.iteration_id: int | None = None
        self.final_state: Any = None
        #: Named jobs read several times (``Params.epochs``): the repetition of the job this
        #: pass reads, and each pass's iteration and ending.
        self.epoch = 0
        self.endings: list[tuple[int, Any]] = []
        self._pass = 0
        #: A trainer of a cross-trainer cache read with this (plain) reader: its id, the
        #: elements it reads of the endless job, its last position in each task's window
        #: and whether it ever skipped (``Run.took_window``).
        self.trainer_id: str | None = None
        self.target: int | None = None
        self.positions: dict[int, int] = {}
        self.skipped = False
        self.world.on(name, 0.0, self.start)

    def _deliver(self, src: str, msg: Any) -> None:
        if msg[0] == "reply":
            self.rpc.reply(msg[1], msg[2])

    def start(self) -> None:
        def reply(r: Any) -> None:
            if r.get("status") != "OK":
                self.run.fail(f"{self.name}: the read could not start: {r}")
                return
            self.token = r["job"]["job_token"]
            self.client = r["iteration"]
            self.iteration_id = r["iteration"]["iteration_id"]
            self.core = ReaderCore(self.iteration_id, TARGET_WORKERS, self.name,
                                   Tracker(None, None))
            self._view(r["iteration"])
            self.heartbeat()

        self.rpc.call(DISPATCHER, "start_read", {"job": self.job, "repetition": self.epoch},
                      reply, self.start, "start")

    def _view(self, view: dict[str, Any]) -> None:
        if self.done_at is not None:
            return
        if view.get("unchanged"):  # the view it has is current
            self._check_done()
            return
        if view.get("garbage_collected"):
            self.run.fail(f"{self.name}: its iteration was garbage collected mid-read")
            return
        assert self.core is not None
        self.view = view
        self.version = view.get("view_version")
        changes = self.core.on_view(view)
        for task_id in changes.cancel:  # its worker left: what it buffered is gone
            self.reads.pop(task_id, None)
            self.core.task_ended(task_id)
        for task_id, address in changes.start:
            read = TaskRead(task_id, address, 1, RETRY_TIMEOUT, Tracker(None, None),
                            self.world.now)
            self.reads[task_id] = read
            self._send(read)
        self._check_done()

    def heartbeat(self, periodic: bool = True, of_pass: int | None = None) -> None:
        """A client heartbeat (its reply is a view); ``periodic=False``: the extra one a
        reader sends when its last task ended (it decides on a fresh view, never on the one
        it had: the dispatcher may have added a task meanwhile, as for a restarted OFF
        worker)."""
        if self.done_at is not None or of_pass not in (None, self._pass):
            return  # ended: a reader stops its heartbeats (and releases its client)
        assert self.client is not None

        sent_in = self._pass

        def reply(r: Any) -> None:
            if self.done_at is not None or self._pass != sent_in:
                return  # sent before the read ended: the answer does not matter any more
            if r.get("status") != "OK":
                self.run.fail(f"{self.name}: client heartbeat refused: {r}")
                return
            self._view(r)

        self.rpc.call(DISPATCHER, "client_heartbeat",
                      {"iteration_client_id": self.client["iteration_client_id"],
                       "job_token": self.token, "view_version": getattr(self, "version", None)},
                      reply, lambda: None, "heartbeat" if periodic else "ask")
        if periodic:
            self.world.on(self.name, self.run.params.client_heartbeat,
                          functools.partial(self.heartbeat, True, self._pass))

    def _current(self, read: TaskRead) -> bool:
        return self.done_at is None and self.reads.get(read.task_id) is read

    def _send(self, read: TaskRead) -> None:
        if not self._current(read):
            return
        assert self.core is not None and self.client is not None
        for r in read.to_send(self.run.params.fetch, 0.0):
            self.rpc.call(read.address, "fetch",
                          {"task_id": read.task_id, "seq": r.seq, "ack": r.ack,
                           "max_elements": r.max_elements,
                           "consumer": self.client["iteration_client_id"],
                           "trainer_id": self.trainer_id},
                          functools.partial(self._reply, read, r.seq),
                          functools.partial(self._failed, read, r.seq),
                          f"fetch-{read.task_id}")

    def _reply(self, read: TaskRead, seq: int, reply: Any) -> None:
        if not self._current(read):
            return
        assert self.core is not None
        outcome = read.on_reply(seq, reply, self.world.now, self.core.is_gone(read.task_id))
        if outcome.kind == "elements":
            if self.trainer_id is not None and not self.run.took_window(
                    self, read.task_id, reply["elements"], reply["base"]):
                return
            for element in reply["elements"]:
                self.run.received(self, read.task_id, element)
            if self.target is not None and len(self.received) >= self.target:
                self._pass_over()  # an endless job: the consumer stops after its elements
                return
            self._send(read)
        elif outcome.kind == "done":
            self._ended(read)
        elif outcome.kind == "error":
            self.run.fail(f"{self.name}: fetch from {read.address}: {reply}")
        else:  # nothing yet: the next request after a moment (the long poll's wait)
            self.world.on(self.name, self.run.params.fetch_interval,
                          functools.partial(self._send, read))

    def _failed(self, read: TaskRead, seq: int) -> None:
        if not self._current(read):
            return
        assert self.core is not None
        decision = read.on_failure(self.world.now, self.core.is_lost(read.task_id))
        if decision.give_up:
            self.world.log(f"{self.name} gave up on task {read.task_id} ({decision.why})")
            self._ended(read)
            return

        def again() -> None:
            if self._current(read) and not self.core.is_lost(read.task_id):  # type: ignore
                read.resend(seq)
                self._send(read)

        self.world.on(self.name, decision.delay, again)

    def _ended(self, read: TaskRead) -> None:
        assert self.core is not None
        del self.reads[read.task_id]
        self.core.task_ended(read.task_id)
        if self.core.all_ended:  # ask now (the reader's loop: a fresh view decides)
            self.heartbeat(periodic=False)

    def _check_done(self) -> None:
        view = self.view
        if self.done_at is not None or view is None or self.core is None:
            return
        if not self.core.pass_over(view):
            return
        self._pass_over()

    def _pass_over(self) -> None:
        self.done_at = self.world.now
        assert self.iteration_id is not None
        self.final_state = self.run.seen_by(self.iteration_id)
        self.endings.append((self.iteration_id, self.final_state))
        self.run.consumer_done(self)
        self.release()

    def release(self) -> None:
        assert self.client is not None

        def reply(r: Any) -> None:
            # OK, or the client is already gone (a retried release whose reply was lost)
            if self.epoch + 1 < self.run.params.epochs:
                self._next_pass()
                return
            self.released = True

        self.rpc.call(DISPATCHER, "release_iteration_client",
                      {"iteration_client_id": self.client["iteration_client_id"],
                       "job_token": self.token}, reply, self.release, "release")

    def _next_pass(self) -> None:
        """The next ``iter()`` of a named job: its next repetition (a new iteration)."""
        self.epoch += 1
        self._pass += 1
        self.client = self.view = self.core = self.iteration_id = None
        self.reads = {}
        self.done_at = None
        self.start()
