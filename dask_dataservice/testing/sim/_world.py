"""The simulated world: a virtual clock, a network, and the dispatcher host around the REAL
:class:`~dask_dataservice.service.dispatcher.core.DispatcherCore`.

Everything runs in one thread from one event queue ordered by (virtual time, sequence), and
every choice comes from one seeded :class:`random.Random`: a seed replays bit for bit.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import WorkerNotFoundError
from ...service.dispatcher import _split_order
from ...service.dispatcher._journal_format import JournalRecord, Snapshot
from ...service.dispatcher._shares import REPEAT_SHARE_FLOOR
from ...service.dispatcher._state_codec import encode_state, restore
from ...service.dispatcher._updates import ProduceSplits, RegisterWorker
from ...service.dispatcher.core import CoreConfig, DispatcherCore, Outcome, WorkerInfo
from ...service.dispatcher.state import DispatcherState, encode_update

__all__ = ["DISPATCHER", "Host", "Network", "SimDispatcher", "World"]

#: The dispatcher's host name.
DISPATCHER = "dispatcher"


class SimFailure(AssertionError):
    """An invariant broke (the message says which, at what virtual time)."""


@dataclass
class Host:
    """A process of the simulation: alive or dead, frozen or not, and its incarnation (a
    restart is a new process: messages to the old one are lost)."""

    name: str
    alive: bool = True
    frozen: bool = False
    incarnation: int = 0
    #: Messages that arrived while it was frozen (delivered at thaw, in order).
    inbox: list[tuple[str, Any]] = field(default_factory=list)
    #: Called with ``(source, message)`` for each delivered message.
    deliver: Callable[[str, Any], None] | None = None


class World:
    """The event queue, the clock, the random source and the hosts."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.hosts: dict[str, Host] = {}
        self.trace: list[str] = []
        self.steps = 0
        #: Log every request the dispatcher serves (``--seed`` replays do).
        self.verbose = False

    def at(self, when: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (max(when, self.now), next(self._seq), fn))

    def after(self, delay: float, fn: Callable[[], None]) -> None:
        self.at(self.now + delay, fn)

    def on(self, host: str, delay: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` on ``host`` after ``delay`` if that incarnation is still alive (a timer
        of a frozen host fires at thaw)."""
        h = self.hosts[host]
        inc = h.incarnation

        def run() -> None:
            if not h.alive or h.incarnation != inc:
                return
            if h.frozen:
                h.inbox.append(("", fn))
                return
            fn()

        self.after(delay, run)

    def log(self, text: str) -> None:
        self.trace.append(f"{self.now:9.3f} {text}")

    def step(self) -> bool:
        if not self._queue:
            return False
        when, _, fn = heapq.heappop(self._queue)
        self.now = when
        self.steps += 1
        fn()
        return True


class Network:
    """Messages between hosts: each one delayed at random (so messages reorder), dropped
    with probability ``drop``, duplicated with ``dup`` (pushes only: a request/response
    travels on one connection), never delivered across a partition or to a dead or
    restarted incarnation."""

    def __init__(self, world: World, *, delay: tuple[float, float] = (0.0005, 0.01),
                 drop: float = 0.0, dup: float = 0.0) -> None:
        self.world = world
        self.delay = delay
        self.drop = drop
        self.dup = dup
        #: Pairs of hosts that cannot reach each other now.
        self.partitions: set[frozenset[str]] = set()

    def send(self, src: str, dst: str, msg: Any, *, duplicable: bool = False) -> None:
        world = self.world
        target = world.hosts.get(dst)
        if target is None or frozenset((src, dst)) in self.partitions:
            return
        rng = world.rng
        if self.drop and rng.random() < self.drop:
            return
        copies = 2 if duplicable and self.dup and rng.random() < self.dup else 1
        inc = target.incarnation
        for _ in range(copies):
            def deliver() -> None:
                if not target.alive or target.incarnation != inc:
                    return
                if frozenset((src, dst)) in self.partitions:
                    return
                if target.frozen:
                    target.inbox.append((src, msg))
                    return
                assert target.deliver is not None
                target.deliver(src, msg)

            world.after(rng.uniform(*self.delay), deliver)


class SimDispatcher:
    """The dispatcher's host: the REAL core, a journal of encoded records (durable after a
    group commit; a kill -9 loses what was not), and the shell's rules: a reply and a push
    leave only once every record applied before them is durable.

    The journal keeps the bytes the real journal would hold (``encode_update``); a restart
    replays them through the real recovery code (``_state_codec.restore``, after a snapshot
    made with ``encode_state`` every ``snapshot_every`` records).
    """

    def __init__(self, world: World, net: Network, config: CoreConfig, *,
                 commit_delay: float = 0.002, snapshot_every: int = 0) -> None:
        self.world = world
        self.net = net
        self.config = config
        self.commit_delay = commit_delay
        self.snapshot_every = snapshot_every
        self.durable: list[bytes] = []
        self.pending: list[bytes] = []
        #: (snapshot payload, records it covers) or None.
        self.snapshot: tuple[bytes, int] | None = None
        self._held: list[Callable[[], None]] = []
        self._flush_scheduled = False
        #: Workers the current scheduler incarnation knows (they connected to it).
        self.connected: dict[str, WorkerInfo] = {}
        self.core: DispatcherCore | None = None
        #: ``{worker address: iterations}`` that were over when the worker (last)
        #: registered: every task finished and no consumer left (an OFF worker that joins
        #: then is owed no copy; TensorFlow's dispatcher gives a finished job no new task).
        self.joined_after: dict[str, set[int]] = {}
        self.host = world.hosts.setdefault(DISPATCHER, Host(DISPATCHER))
        self.host.deliver = self._deliver
        self.restarts = 0
        self._tokens = random.Random(world.rng.random())
        self.errors: list[str] = []
        self.check_every_step = True
        #: ``{Dask key: addresses holding it}`` (the scheduler's ``who_has``; set by the
        #: scenario of a dataset from a persisted collection).
        self.key_holders: dict[Any, set[str]] = {}
        #: The ``autocache`` workload: ``{address: splits it reported}`` since this start.
        self.autocache = False
        self.reported: dict[str, set[int]] = {}
        #: ``{(iteration_id, repetition, position): split}`` of an explicit split order.
        self.positions: dict[tuple[int, int, int], int] = {}
        self.start()

    # ClusterView
    def worker(self, address: str) -> WorkerInfo | None:
        return self.connected.get(address)

    def holders(self, key: Any) -> list[str]:
        """The workers holding Dask key ``key`` (the ``locality`` workload's partitions)."""
        return sorted(self.key_holders.get(key, ()))

    # Lifecycle
    def start(self) -> None:
        self.reported = {}  # the registry is volatile: a new core learns it again
        self.core = DispatcherCore(self.config, self, self.world.now, lineage="sim",
                                   new_token=lambda: f"t{self._tokens.getrandbits(32):08x}",
                                   view_nonce=f"v{self.restarts}")
        if self.durable or self.snapshot:
            self.core.restore(self.replayed(self.durable))

    def replayed(self, records: list[bytes]) -> DispatcherState:
        """The state the real recovery code rebuilds from ``records`` (after the snapshot)."""
        snap = None
        skip = 0
        if self.snapshot is not None:
            payload, skip = self.snapshot
            snap = Snapshot(Path("sim/snapshot"), 1, payload)
        rows = (JournalRecord(Path("sim/segment"), i, r)
                for i, r in enumerate(records[skip:]))
        state, _ = restore(snap, rows)
        return state

    def kill(self) -> None:
        """kill -9: volatile state, records not yet durable, held replies and pushes: gone."""
        assert self.core is not None
        self.check_replay(self.durable + self.pending, "before a kill")
        self.pending.clear()
        self._held.clear()
        self._flush_scheduled = False
        self.connected.clear()
        self.core = None
        self.host.alive = False
        self.host.incarnation += 1

    def restart(self) -> None:
        self.host.alive = True
        self.host.frozen = False
        self.host.inbox.clear()
        self.restarts += 1
        self.start()
        assert self.core is not None
        self.check_replay(self.durable, "after a restart")

    def check_replay(self, records: list[bytes], when: str) -> None:
        """Journal replay equals the live state (the journal holds every change)."""
        assert self.core is not None
        replayed = self.replayed(records)
        if replayed.snapshot() != self.core.state.snapshot():
            raise SimFailure(f"journal replay differs from the live state {when}")

    # Effects
    def _commit(self, out: Outcome[Any]) -> None:
        for update in out.updates:
            self.pending.append(encode_update(update))
            if isinstance(update, RegisterWorker):
                self._note_registration(update.address)
            elif isinstance(update, ProduceSplits) and update.indices:
                # the explicit order: which split each position handed out (lost splits are
                # positions, see service/dispatcher/_split_order.py), by get_split or with
                # a task's push (its first split)
                for k, split in enumerate(update.indices):
                    self.positions[(update.iteration_id, update.repetition,
                                    update.index + k)] = split
        if self.pending and not self._flush_scheduled:
            self._flush_scheduled = True
            inc = self.host.incarnation
            self.world.after(self.commit_delay, lambda: self._flush(inc))
        for address, message in out.messages:
            self._when_durable(functools.partial(self._push, address, message))

    def _flush(self, inc: int) -> None:
        if self.host.incarnation != inc or not self.host.alive:
            return
        if self.host.frozen:  # a frozen process writes nothing: try again later
            self.world.after(self.commit_delay, lambda: self._flush(inc))
            return
        self._flush_scheduled = False
        self.durable.extend(self.pending)
        self.pending.clear()
        if self.snapshot_every and len(self.durable) - (self.snapshot or (b"", 0))[1] \
                >= self.snapshot_every:
            self.snapshot = (encode_state(self.replayed(self.durable)), len(self.durable))
        held, self._held = self._held, []
        for fn in held:
            fn()

    def _note_registration(self, address: str) -> None:
        """Which iterations were over (facts of the state, not the core's rule) when
        ``address`` registered: all its tasks finished and no consumer registered."""
        assert self.core is not None
        state = self.core.state
        over = set()
        for it in state.list_iterations():
            tasks = state.tasks_for_iteration(it.iteration_id)
            if tasks and it.num_clients == 0 and all(t.status != "active" for t in tasks):
                over.add(it.iteration_id)
        self.joined_after[address] = over

    def _when_durable(self, fn: Callable[[], None]) -> None:
        if self.pending:
            self._held.append(fn)
        else:
            fn()

    def _push(self, address: str, message: Any) -> None:
        if address in self.connected:
            self.net.send(DISPATCHER, address, ("push", message), duplicable=True)

    # Requests
    def _deliver(self, src: str, msg: Any) -> None:
        kind, request_id, name, kwargs = msg
        assert kind == "rpc"
        core = self.core
        assert core is not None
        try:
            reply = self._handle(core, src, name, kwargs)
        except SimFailure:
            raise
        except Exception as e:  # noqa: BLE001 - errors travel as values, as in the shell
            self._commit(core.take_effects())
            reply = {"status": "error", "error": f"{type(e).__name__}: {e}"}
        if self.check_every_step:
            core.state.validate_state()
        if self.world.verbose:
            self.world.log(f"{src} -> {name}({kwargs}) = {reply}"[:400])
        self._when_durable(lambda: self.net.send(DISPATCHER, src, ("reply", request_id, reply)))

    def _run(self, stimulus: Callable[..., Outcome[Any]], *args: Any, **kwargs: Any) -> Any:
        out = stimulus(*args, **kwargs)
        self._commit(out)
        return out.reply

    def _handle(self, core: DispatcherCore, src: str, name: str, kw: dict[str, Any]) -> Any:
        now = self.world.now
        if name == "register_dataset":
            return self._run(core.register_dataset, **kw, now=now)
        if name == "start_read":
            job = self._run(core.get_or_create_job, **kw["job"], now=now)
            view = self._run(core.get_or_create_iteration, job["job_id"], now,
                             repetition=kw.get("repetition", 0), job_token=job["job_token"])
            return {"status": "OK", "job": job, "iteration": view}
        if name == "client_heartbeat":
            return self._run(core.client_heartbeat, kw["iteration_client_id"], now,
                             job_token=kw["job_token"], view_version=kw.get("view_version"))
        if name == "release_iteration_client":
            return self._run(core.release_iteration_client, kw["iteration_client_id"], now,
                             job_token=kw["job_token"])
        if name == "worker_heartbeat":
            info = self.world_workers[src]
            if src not in self.connected:  # the scheduler learns of it as it (re)connects
                self.connected[src] = info
            return self._run(core.worker_heartbeat, info, now,
                             active_tasks=kw["active_tasks"],
                             finished_tasks=kw["finished_tasks"], resumed=kw["resumed"])
        if name == "get_split":
            return self._get_split(core, src, kw)
        if name == "finish_task":
            return self._run(core.finish_task, **kw)
        if name == "ack_splits":
            return self._run(core.ack_splits, **kw)
        if name == "autocached":
            reply = self._run(core.autocached, **kw)
            self.reported.setdefault(src, set()).update(kw["indices"])
            return reply
        raise ValueError(f"unknown request {name!r}")

    def _get_split(self, core: DispatcherCore, src: str, kw: dict[str, Any]) -> Any:
        """``get_split``, checking that DYNAMIC spreads its splits: with other active tasks, no
        task takes more than half of what is left at once (533ed4f: one worker took nearly
        all 256 splits, so a worker killed then held none), past the first repetition more
        than that or ``REPEAT_SHARE_FLOOR`` (issue 22)."""
        state = core.state
        try:
            it = state.iteration(kw["iteration_id"])
            _, index, num_splits = state.split_position(kw["iteration_id"])
            active = it.num_tasks - it.num_finished_tasks - it.num_lost_tasks
        except Exception:  # noqa: BLE001 - the core answers the error
            active = 0
        hinted = bool(self.key_holders) or self.autocache
        local_left = self._local_left(src, kw) if hinted else set()
        reply = self._run(core.get_split, **kw)
        # the splits handed out now (a request saying what it ``received`` may be answered
        # what it never got instead: then the cursor does not move)
        new = self._handed_now(kw, index, reply)
        strays = sorted(set(new) - local_left) if local_left else []
        if strays:
            raise SimFailure(f"locality: task {kw['task_id']} of {src} got splits {strays}, "
                             f"which its worker does not hold, while it holds "
                             f"{sorted(local_left)} not handed out yet")
        left = num_splits - index if active else 0
        got = len(new)
        floor = REPEAT_SHARE_FLOOR if kw.get("repetition", 0) >= 1 else 1
        if active >= 2 and got > max(floor, left // 2) and not hinted:
            # (a locality hint hands a worker all its own splits, and the orphans it asks for;
            # past the first repetition a task may take a floor of them: core.fair_share)
            raise SimFailure(f"DYNAMIC: task {kw['task_id']} took {got} of the {left} splits "
                             f"left while {active} tasks were active")
        return reply

    def _handed_now(self, kw: dict[str, Any], index: int, reply: dict[str, Any]) -> list[int]:
        """The split indices ``reply`` handed out afresh: those past the cursor at ``index``
        (none when it answered splits handed out before, or another repetition's)."""
        assert self.core is not None
        try:
            rep, after, _ = self.core.state.split_position(kw["iteration_id"])
        except Exception:  # noqa: BLE001 - the core answered the error
            return []
        if rep != kw["repetition"] or after <= index:
            return []
        return list(reply.get("split_indices", ()))[:after - index]

    def _local_left(self, address: str, kw: dict[str, Any]) -> set[int]:
        """The splits of the current repetition not handed out yet whose partition
        ``address`` holds."""
        assert self.core is not None
        state = self.core.state
        try:
            rep, index, num_splits = state.split_position(kw["iteration_id"])
        except Exception:  # noqa: BLE001 - the core answers the error
            return set()
        if rep != kw["repetition"]:
            return set()
        order = _split_order.taken(state, kw["iteration_id"])
        taken = set(order) if order else set(range(index))
        if self.autocache:
            dataset = state.job(state.iteration(kw["iteration_id"]).job_id).dataset_id
            cached = self.core.hints.cached
            for who in cached.datasets:  # only what it was told since this start, and kept
                held = {i for i, ws in cached.splits.get(dataset, {}).items() if who in ws}
                if not held <= self.reported.get(who, set()):
                    raise SimFailure(f"autocache: the dispatcher says {who} caches splits "
                                     f"{sorted(held - self.reported.get(who, set()))} it "
                                     "never reported since this start")
                try:
                    registered = state.worker(who).registered
                except WorkerNotFoundError:
                    registered = False
                if not registered:
                    raise SimFailure(f"autocache: {who} left but its caches are kept")
            return {i for i in range(num_splits)
                    if i not in taken and address in cached.holders((dataset, i))}
        return {i for i in range(num_splits)
                if i not in taken and address in self.key_holders.get(("part", i), ())}

    #: ``{address: WorkerInfo}`` of every worker process of the world (set by the scenario).
    world_workers: dict[str, WorkerInfo] = {}

    # Stimuli that come from the cluster, not from a request
    def gc_tick(self) -> None:
        if self.core is None or not self.host.alive or self.host.frozen:
            return
        self._commit(self.core.gc_tick(self.world.now))
        if self.check_every_step:
            self.core.state.validate_state()

    def drain_worker(self, address: str, held: list[int]) -> list[int] | None:
        """``retire_workers`` began for ``address`` (the shell's :mod:`._retire`), which
        holds tasks ``held``: the tasks to wait for, or None when the dispatcher is down."""
        if self.core is None or not self.host.alive or self.host.frozen:
            return None
        return list(self._run(self.core.drain_worker, address, held))

    def worker_left(self, address: str) -> None:
        """The scheduler noticed ``address`` is gone (its comm closed)."""
        if self.core is None or not self.host.alive:
            return
        self.connected.pop(address, None)
        self._commit(self.core.worker_left(address))
