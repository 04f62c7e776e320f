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
- an OFF task's elements are ``(task_id, i)`` for ``i`` in ``range(num_elements)``, so each
  worker's copy is told apart.

Where it differs from the plugin: a dataset "loads" at once (``task_started`` on the start
effect); a request waiting for its turn (an earlier one of the same consumer never came)
gives up at once instead of after the long poll plus 10 s.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...service.protocol._sharding import ShardingPolicy
from ...service.worker.core import (
    CancelTask,
    Effect,
    SendFinishTask,
    ShowEnd,
    SplitFlow,
    StartTask,
    TaskPhase,
    WorkerCore,
    empty_reply,
    unknown_task_reply,
)
from ._world import DISPATCHER, Host

if TYPE_CHECKING:
    from ._scenario import Run

__all__ = ["DataWorker"]


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
                self.runners[task["task_id"]] = runner
                self.core.task_started(task["task_id"])  # its dataset "loads" at once
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
            if len(r.buffer) >= params.buffer:
                continue
            mode = ShardingPolicy(r.task["processing_mode"])
            if r.flow is not None:
                self._produce_dynamic(task_id, r)
            elif mode == ShardingPolicy.OFF:
                stop = min(r.off_next + params.per_split, params.num_elements)
                r.buffer.extend((task_id, i) for i in range(r.off_next, stop))
                r.off_next = stop
                if stop >= params.num_elements:
                    self._execute(self.core.input_ended(task_id, False))
            else:  # static sharding: this worker's shard
                index, shards = r.task["worker_index"], r.task["num_workers"]
                if mode == ShardingPolicy.DATA:
                    r.buffer.extend(e for e in range(params.num_elements) if e % shards == index)
                else:  # FILE: the splits (files) of this shard
                    for s in range(index, params.num_splits, shards):
                        r.buffer.extend(self.run.split_elements(s))
                self._execute(self.core.input_ended(task_id, False))
        self.world.on(self.address, params.produce_interval, self.produce)

    def _produce_dynamic(self, task_id: int, r: _Runner) -> None:
        flow = r.flow
        assert flow is not None
        cap = self.run.params.buffer
        while flow.has_local() and len(r.buffer) < cap:
            r.buffer.extend(self.run.split_elements(flow.next_index()))
        if flow.has_local():
            return
        if flow.ended:
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
                  "received": req.received if r.attempts > 1 else None}

        def reply(resp: Any) -> None:
            if self.runners.get(task_id) is not r:
                return
            r.asking, r.attempts = False, 0
            if resp.get("status") != "OK":
                self.run.note(f"{self.address} get_split of task {task_id}: {resp}")
                return
            indices = list(resp["split_indices"])
            self.run.handed(self.address, indices)
            if flow.on_reply(indices, bool(resp["end_of_splits"])):
                self._ask(task_id, r)  # ask ahead

        def timeout() -> None:
            if self.runners.get(task_id) is r:
                r.asking = False  # asked again (with ``received``) by the next production

        self.rpc.call(DISPATCHER, "get_split", kwargs, reply, timeout, f"split-{task_id}")

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
            assert name == "fetch"
            reply = self._get_elements(src, kw)
            if reply is not None:
                self.run.net.send(self.address, src, ("reply", rid, reply))

    def _get_elements(self, consumer: str, kw: dict[str, Any]) -> dict[str, Any] | None:
        """``get_elements`` with ``(consumer, seq, ack)``, as the plugin's handler."""
        task_id, seq, client = kw["task_id"], kw["seq"], kw["consumer"]
        key = (task_id, client)
        turn = self.core.turn(key, seq, kw["ack"])
        for s in turn.forget:
            self.kept.pop((task_id, client, s), None)
        if turn.replay:  # sent again: the first answer (None: still under way, never here)
            return self.kept.get((task_id, client, seq))
        if turn.wait:  # the earlier request never came: give up waiting for it at once
            self.core.turn_abandoned(key, seq, waiting=True)
        reply = self._take(task_id, kw["max_elements"])
        self.core.turn_done(key, seq)
        if turn.keep and self.core.keep_reply(key, seq, reply.get("elements") is not None):
            self.kept[(task_id, client, seq)] = reply
        return reply

    def _take(self, task_id: int, n: int) -> dict[str, Any]:
        r = self.runners.get(task_id)
        if r is None:
            return unknown_task_reply(task_id, task_id in self.core.finished,
                                      self.core.knows(task_id))
        if r.buffer:
            items = [r.buffer.popleft() for _ in range(min(n, len(r.buffer)))]
            return {"status": "OK", "elements": items}
        reply = empty_reply(r.end_visible, None, False)
        assert isinstance(reply, dict)
        return reply
