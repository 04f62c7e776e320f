"""The simulated data workers and consumers.

STAND-INS: these are small actors that follow the wire protocol of the data workers and the
readers (the same requests and pushes the dispatcher plugin receives), written for the
simulation. They are to be replaced by the real sans-I/O cores of the data worker (task /
turn / ack logic) and of the reader (request / retry / end-of-sequence) once those exist;
the dispatcher they drive is already the real :class:`DispatcherCore`.

Elements: split ``s`` of a DYNAMIC or static dataset is the elements
``s * per_split .. s * per_split + per_split - 1``; an OFF task's elements are
``(task_id, i)`` for ``i`` in ``range(num_elements)``, so each worker's copy is told apart.
"""

from __future__ import annotations

import functools
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...service.client.reader_core import ReaderCore, TaskRead, Tracker
from ...service.protocol._sharding import ShardingPolicy
from ._world import DISPATCHER, Host, Network, World

if TYPE_CHECKING:
    from ._scenario import Run

__all__ = ["Consumer", "DataWorker"]

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
             on_timeout: Callable[[], None], slot: str) -> None:
        rid = next(self._ids)
        self._waiting[rid] = (slot, on_reply)
        self._latest[slot] = rid
        self.net.send(self.host.name, dst, ("rpc", rid, name, kwargs))

        def timeout() -> None:
            if self._waiting.pop(rid, None) is not None and self._latest.get(slot) == rid:
                on_timeout()

        self.world.on(self.host.name, RPC_TIMEOUT, timeout)

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


@dataclass
class _Task:
    task: dict[str, Any]
    buffer: deque[Any] = field(default_factory=deque)
    produced: bool = False  # every element of its share is in the buffer (or delivered)
    received: int = 0  # DYNAMIC: splits received this repetition
    asking: bool = False
    retry: bool = False
    finished: bool = False  # the dispatcher was told (or is being told)
    told: bool = False
    #: ``{consumer: (seq, batch)}``: the last batch each consumer was sent (a retry of the
    #: same request gets it again).
    sent: dict[str, tuple[int, list[Any]]] = field(default_factory=dict)
    off_next: int = 0


class DataWorker:
    """STAND-IN data worker (see the module docstring)."""

    def __init__(self, run: Run, address: str) -> None:
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
        self.tasks: dict[int, _Task] = {}
        self.answered = False
        self.rpc.reset()
        self.world.on(self.address, self.world.rng.uniform(0, 0.05), self.heartbeat)
        self.world.on(self.address, 0.01, self.produce)

    # Dispatcher side
    def heartbeat(self) -> None:
        active = sorted(t for t, r in self.tasks.items() if not r.told)
        done = sorted(t for t, r in self.tasks.items() if r.told)
        self.rpc.call(DISPATCHER, "worker_heartbeat",
                      {"active_tasks": active, "finished_tasks": done,
                       "resumed": self.answered},
                      self._heartbeat_reply, lambda: None, "heartbeat")
        self.world.on(self.address, self.run.params.worker_heartbeat, self.heartbeat)

    def _heartbeat_reply(self, reply: Any) -> None:
        if reply.get("status") != "OK":
            self.run.fail(f"{self.address}: worker heartbeat refused: {reply}")
            return
        self.answered = True
        self._changes(reply)

    def _changes(self, changes: dict[str, Any]) -> None:
        for task_id in changes.get("cancelled", ()):
            self.tasks.pop(task_id, None)
        for task in changes.get("new_tasks", ()):
            if task["task_id"] not in self.tasks:
                self.tasks[task["task_id"]] = _Task(task)

    def produce(self) -> None:
        """Fill each task's buffer a little (its pipeline running)."""
        params = self.run.params
        for task_id, t in list(self.tasks.items()):
            mode = ShardingPolicy(t.task["processing_mode"])
            if t.produced:
                self._maybe_finish(task_id, t)
                continue
            if len(t.buffer) >= params.buffer:
                continue
            if mode == ShardingPolicy.DYNAMIC:
                if not t.asking:
                    self._ask(task_id, t)
            elif mode == ShardingPolicy.OFF:
                stop = min(t.off_next + params.per_split, params.num_elements)
                t.buffer.extend((task_id, i) for i in range(t.off_next, stop))
                t.off_next = stop
                t.produced = stop >= params.num_elements
            else:  # static sharding: this worker's shard
                index, shards = t.task["worker_index"], t.task["num_workers"]
                if mode == ShardingPolicy.DATA:
                    t.buffer.extend(e for e in range(params.num_elements) if e % shards == index)
                else:  # FILE: the splits (files) of this shard
                    for s in range(index, params.num_splits, shards):
                        t.buffer.extend(self.run.split_elements(s))
                t.produced = True
        self.world.on(self.address, params.produce_interval, self.produce)

    def _ask(self, task_id: int, t: _Task) -> None:
        t.asking = True
        task = t.task
        kwargs = {"iteration_id": task["iteration_id"], "task_id": task_id, "repetition": 0,
                  "count": self.run.params.split_batch, "job_token": task["job_token"],
                  "received": t.received if t.retry else None}

        def reply(r: Any) -> None:
            t.asking = t.retry = False
            if r.get("status") != "OK":
                self.run.note(f"{self.address} get_split of task {task_id}: {r}")
                return
            for s in r["split_indices"]:
                t.buffer.extend(self.run.split_elements(s))
            t.received += len(r["split_indices"])
            t.produced = bool(r["end_of_splits"])

        def timeout() -> None:
            t.asking, t.retry = False, True

        self.rpc.call(DISPATCHER, "get_split", kwargs, reply, timeout, f"split-{task_id}")

    def _maybe_finish(self, task_id: int, t: _Task) -> None:
        if t.buffer or t.finished or any(b for _, b in t.sent.values()):
            return
        t.finished = True

        def reply(r: Any) -> None:
            t.told = True

        def timeout() -> None:
            t.finished = False  # ask again

        self.rpc.call(DISPATCHER, "finish_task",
                      {"task_id": task_id, "job_token": t.task["job_token"]},
                      reply, timeout, f"finish-{task_id}")

    # Consumer side
    def _deliver(self, src: str, msg: Any) -> None:
        kind = msg[0]
        if kind == "reply":
            self.rpc.reply(msg[1], msg[2])
        elif kind == "push":
            self._changes(msg[1])
        elif kind == "rpc":
            _, rid, name, kw = msg
            assert name == "fetch"
            self.run.net.send(self.address, src, ("reply", rid, self._fetch(src, kw)))

    def _fetch(self, consumer: str, kw: dict[str, Any]) -> dict[str, Any]:
        """A ``get_elements`` request, answered in the data worker's wire format."""
        t = self.tasks.get(kw["task_id"])
        if t is None:
            return {"status": "OK", "elements": None, "end_of_sequence": False,
                    "unknown": True}
        seq = kw["seq"]
        last = t.sent.get(consumer)
        if last is not None and last[0] == seq:
            batch = last[1]  # a retry: the same elements again (never new ones)
        elif last is not None and seq != last[0] + 1:
            return {"status": "error", "error": f"request {seq} after {last[0]}"}
        else:
            n = min(len(t.buffer), kw["max_elements"])
            batch = [t.buffer.popleft() for _ in range(n)]
            t.sent[consumer] = (seq, batch)
        end = not batch and t.produced and not t.buffer
        return {"status": "OK", "elements": batch or None, "end_of_sequence": end}


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

        self.rpc.call(DISPATCHER, "start_read", {"job": self.job}, reply, self.start, "start")

    def _view(self, view: dict[str, Any]) -> None:
        if view.get("unchanged") or self.done_at is not None:
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

    def heartbeat(self) -> None:
        if self.done_at is not None:
            return  # ended: a reader stops its heartbeats (and releases its client)
        assert self.client is not None

        def reply(r: Any) -> None:
            if self.done_at is not None:
                return  # sent before the read ended: the answer does not matter any more
            if r.get("status") != "OK":
                self.run.fail(f"{self.name}: client heartbeat refused: {r}")
                return
            self._view(r)

        self.rpc.call(DISPATCHER, "client_heartbeat",
                      {"iteration_client_id": self.client["iteration_client_id"],
                       "job_token": self.token, "view_version": getattr(self, "version", None)},
                      reply, lambda: None, "heartbeat")
        self.world.on(self.name, self.run.params.client_heartbeat, self.heartbeat)

    def _current(self, read: TaskRead) -> bool:
        return self.done_at is None and self.reads.get(read.task_id) is read

    def _send(self, read: TaskRead) -> None:
        if not self._current(read):
            return
        assert self.core is not None
        for r in read.to_send(self.run.params.fetch, 0.0):
            self.rpc.call(read.address, "fetch",
                          {"task_id": read.task_id, "seq": r.seq, "ack": r.ack,
                           "max_elements": r.max_elements},
                          functools.partial(self._reply, read, r.seq),
                          functools.partial(self._failed, read, r.seq),
                          f"fetch-{read.task_id}")

    def _reply(self, read: TaskRead, seq: int, reply: Any) -> None:
        if not self._current(read):
            return
        assert self.core is not None
        outcome = read.on_reply(seq, reply, self.world.now, self.core.is_gone(read.task_id))
        if outcome.kind == "elements":
            for element in reply["elements"]:
                self.run.received(self, read.task_id, element)
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
        self._check_done()

    def _check_done(self) -> None:
        view = self.view
        if self.done_at is not None or view is None or self.core is None:
            return
        if not self.core.pass_over(view):
            return
        self.done_at = self.world.now
        assert self.iteration_id is not None
        self.final_state = self.run.seen_by(self.iteration_id)
        self.run.consumer_done(self)
        self.release()

    def release(self) -> None:
        assert self.client is not None

        def reply(r: Any) -> None:
            # OK, or the client is already gone (a retried release whose reply was lost)
            self.released = True

        self.rpc.call(DISPATCHER, "release_iteration_client",
                      {"iteration_client_id": self.client["iteration_client_id"],
                       "job_token": self.token}, reply, self.release, "release")
