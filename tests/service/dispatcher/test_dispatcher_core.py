"""The dispatcher's sans-I/O core, without a scheduler (service/dispatcher/core.py).

Every decision of the dispatcher is a method of DispatcherCore that takes ``now`` and returns
its reply, the records it applied and the pushes to send: these tests drive it directly, with
the cluster's facts in a plain dict.
"""

from __future__ import annotations

from typing import Any

import pytest

from dask_dataservice.data import INFINITE
from dask_dataservice.service.dispatcher._shares import fair_share
from dask_dataservice.service.dispatcher.core import (
    CoreConfig,
    DispatcherCore,
    WorkerInfo,
)
from dask_dataservice.service.dispatcher.state import (
    AcquireIterationClient,
    CreateIteration,
    CreateTask,
    FinishTask,
    GarbageCollectIteration,
    ProduceSplits,
    RegisterWorker,
    ReleaseIterationClient,
    RemoveWorker,
)

pytestmark = [pytest.mark.pure, pytest.mark.timeout(30)]


class Cluster:
    def __init__(self) -> None:
        self.workers: dict[str, WorkerInfo] = {}

    def add(self, address: str, **resources: float) -> WorkerInfo:
        info = WorkerInfo(address=address, host=address.split("//")[1].split(":")[0],
                          nthreads=1, resources=resources, name=address)
        self.workers[address] = info
        return info

    def worker(self, address: str) -> WorkerInfo | None:
        return self.workers.get(address)

    def holders(self, key: Any) -> list[str]:
        return []


def make(**config: Any) -> tuple[DispatcherCore, Cluster]:
    cluster = Cluster()
    tokens = iter(f"token-{i}" for i in range(1000))
    core = DispatcherCore(CoreConfig(**config), cluster, 100.0, lineage="L",
                          new_token=lambda: next(tokens), view_nonce="n")
    return core, cluster


def dataset(core: DispatcherCore, num_splits: int = 8, **metadata: Any) -> int:
    out = core.register_dataset("fp", b"p", b"s", num_splits,
                                metadata={"cardinality": num_splits, **metadata})
    return out.reply["dataset_id"]


def read(core: DispatcherCore, ds: int, mode: str, now: float = 100.0, **job: Any) -> dict:
    j = core.get_or_create_job(ds, mode, **job).reply
    return core.get_or_create_iteration(j["job_id"], now, job_token=j["job_token"]).reply


def join(core: DispatcherCore, cluster: Cluster, address: str, now: float = 100.0,
         **kw: Any) -> Any:
    return core.worker_heartbeat(cluster.add(address), now, **kw)


def test_fair_share():
    assert fair_share(256, 1) == 256
    assert fair_share(256, 2) == 64
    assert fair_share(192, 2) == 48
    assert fair_share(3, 2) == 1
    assert fair_share(0, 0) == 0
    # issue 22: past the first repetition at least REPEAT_SHARE_FLOOR (64) of what is left
    assert fair_share(10, 2, repetition=1) == 10  # range(10).repeat(): a round trip each
    assert fair_share(10, 2, repetition=0) == 2
    assert fair_share(100, 2, repetition=1) == 64 and fair_share(512, 2, repetition=3) == 128
    assert fair_share(10, 1, repetition=0) == 10


def test_get_split_past_the_first_repetition_hands_out_a_floor():
    """issue 22: ``range(10).repeat()`` under DYNAMIC with two workers took 8 round trips per
    repetition of 10 one-element splits (2, 2, 1, 1, ...; now 1 with each task, 2, 1, ...): from repetition 1 on a task takes
    up to 64 of what is left, the first repetition keeps half a fair share (each task's
    first split came with its push: 8 are left)."""
    core, cluster = make()
    ds = dataset(core, 10)
    join(core, cluster, "tcp://a:1")
    join(core, cluster, "tcp://b:1")
    view = read(core, ds, "DYNAMIC")
    task_a, task_b = (next(t["task_id"] for t in view["tasks"] if t["worker_address"] == a)
                      for a in ("tcp://a:1", "tcp://b:1"))
    token = core.state.job(core.state.iteration(view["iteration_id"]).job_id).token
    it = view["iteration_id"]
    sizes = []
    while True:
        reply = core.get_split(it, task_a, 0, count=1024, job_token=token).reply
        sizes.append(len(reply["split_indices"]))
        if reply["end_of_splits"]:
            break
    assert sizes == [2, 1, 1, 1, 1, 1, 1] and sum(sizes) == 8
    reply = core.get_split(it, task_a, 1, count=1024, job_token=token).reply
    assert reply["split_indices"] == list(range(10)) and reply["end_of_splits"]
    reply = core.get_split(it, task_b, 2, count=4, job_token=token).reply  # as asked
    assert reply["split_indices"] == [0, 1, 2, 3] and not reply["end_of_splits"]


def test_get_split_hands_a_greedy_task_half_a_fair_share():
    """533ed4f: with two active tasks a greedy task gets 63, 47, 36, ... of the 254 splits
    left once each task's first came with its push."""
    core, cluster = make()
    ds = dataset(core, 256)
    join(core, cluster, "tcp://a:1")
    join(core, cluster, "tcp://b:1")
    view = read(core, ds, "DYNAMIC")
    task_a = next(t["task_id"] for t in view["tasks"] if t["worker_address"] == "tcp://a:1")
    token = core.state.job(core.state.iteration(view["iteration_id"]).job_id).token
    sizes = []
    for _ in range(3):
        out = core.get_split(view["iteration_id"], task_a, 0, count=1024, job_token=token)
        sizes.append(len(out.reply["split_indices"]))
        assert [type(u) for u in out.updates] == [ProduceSplits]
    assert sizes == [63, 47, 36]


def test_split_batch_max_is_config():
    core, cluster = make(split_batch_max=3)
    ds = dataset(core, 100)
    join(core, cluster, "tcp://a:1")
    view = read(core, ds, "DYNAMIC")
    token = core.state.job(core.state.iteration(view["iteration_id"]).job_id).token
    out = core.get_split(view["iteration_id"], view["tasks"][0]["task_id"], 0, count=50,
                         job_token=token)
    assert out.reply["split_indices"] == [1, 2, 3]  # split 0 came with the task


def _pushed(outcome: Any) -> dict[str, list[dict]]:
    """``{address: task definitions}`` an outcome pushes to data workers."""
    out: dict[str, list[dict]] = {}
    for address, message in outcome.messages:
        out.setdefault(address, []).extend(message["new_tasks"])
    return out


def _dynamic_start(num_splits: int) -> tuple[DispatcherCore, Cluster, int, dict, Any]:
    """Two data workers, then a DYNAMIC read of ``num_splits`` splits: the core, the cluster,
    the dataset, the job's reply and the outcome that created the iteration."""
    core, cluster = make()
    ds = dataset(core, num_splits)
    join(core, cluster, "tcp://a:1")
    join(core, cluster, "tcp://b:1")
    j = core.get_or_create_job(ds, "DYNAMIC").reply
    return core, cluster, ds, j, core.get_or_create_iteration(j["job_id"], 100.0,
                                                               job_token=j["job_token"])


def test_a_dynamic_task_pushed_as_its_iteration_starts_carries_its_first_split():
    """issue 25, target 2: the first split travels with the task, so the first element waits
    for no split request. Only DYNAMIC tasks pushed as their iteration starts: a worker that
    joins later gets its task in its heartbeat's reply and asks as before."""
    core, cluster, ds, j, out = _dynamic_start(3)
    pushed = _pushed(out)
    assert [t["first_splits"] for t in pushed["tcp://a:1"]] == [([0], False)]
    assert [t["first_splits"] for t in pushed["tcp://b:1"]] == [([1], False)]
    it = out.reply["iteration_id"]
    assert core.state.split_position(it) == (0, 2, 3)  # both journaled (ProduceSplits)
    assert sum(isinstance(u, ProduceSplits) for u in out.updates) == 2
    late = join(core, cluster, "tcp://c:1")
    assert [("first_splits" in t) for t in late.reply["new_tasks"]] == [False]
    task_c = late.reply["new_tasks"][0]["task_id"]
    reply = core.get_split(it, task_c, 0, job_token=j["job_token"], received=0).reply
    assert reply == {"status": "OK", "split_indices": [2], "end_of_splits": True}
    j = core.get_or_create_job(ds, "OFF").reply
    out = core.get_or_create_iteration(j["job_id"], 100.0, job_token=j["job_token"])
    assert not any("first_splits" in t for ts in _pushed(out).values() for t in ts)


def test_a_first_split_lost_with_its_push_is_handed_out_again():
    """The dispatcher journaled a task and its first split, then crashed before the push
    left: the revived task reaches its worker without the split. The task's first request
    says it received none (every first request says how many it received), and gets that
    split again instead of a new one; a task that got it says 1 and gets the next."""
    core, cluster, _, j, out = _dynamic_start(4)
    it = out.reply["iteration_id"]
    (task_a,), (task_b,) = (_pushed(out)[a] for a in ("tcp://a:1", "tcp://b:1"))
    lost = core.get_split(it, task_a["task_id"], 0, job_token=j["job_token"], received=0)
    assert lost.reply["split_indices"] == task_a["first_splits"][0] == [0]
    assert not lost.updates  # handed out once, answered twice
    got = core.get_split(it, task_b["task_id"], 0, job_token=j["job_token"], received=1)
    assert got.reply["split_indices"] == [2]


def test_creating_an_iteration_pushes_tasks_to_present_data_workers_only():
    core, cluster = make()
    ds = dataset(core)
    join(core, cluster, "tcp://a:1")
    core.worker_heartbeat(cluster.add("tcp://ps:1", ps=1), 100.0)  # excluded by its resource
    j = core.get_or_create_job(ds, "OFF").reply
    out = core.get_or_create_iteration(j["job_id"], 101.0, job_token=j["job_token"])
    assert [type(u) for u in out.updates] == [CreateIteration, CreateTask,
                                              AcquireIterationClient]
    assert [(a, m["op"], [t["task_id"] for t in m["new_tasks"]]) for a, m in out.messages] == \
        [("tcp://a:1", "dataservice-tasks", [4000])]
    assert out.updates[-1].time_micros == 101_000_000


def test_a_joining_worker_gets_a_task_of_each_live_iteration_it_serves():
    """The one hand-out of a joining worker: running iterations, and an OFF one whose tasks
    finished while consumers still read; not coordinated reads, not a finished DYNAMIC one."""
    core, cluster = make()
    ds = dataset(core)
    inf = core.register_dataset("fp2", b"p", b"s", 4, metadata={"cardinality": -1}).reply[
        "dataset_id"]
    join(core, cluster, "tcp://a:1")
    off = read(core, ds, "OFF")
    dyn = read(core, ds, "DYNAMIC")
    coord = read(core, inf, "OFF", job_name="c", num_consumers=2)
    for tid in (off["tasks"][0]["task_id"], dyn["tasks"][0]["task_id"]):
        core.apply(FinishTask(task_id=tid))
    out = join(core, cluster, "tcp://b:1", 102.0)
    created = [u for u in out.updates if isinstance(u, CreateTask)]
    assert [u.iteration_id for u in created] == [off["iteration_id"]]
    assert isinstance(out.updates[0], RegisterWorker)
    assert [t["iteration_id"] for t in out.reply["new_tasks"]] == [off["iteration_id"]]
    assert out.messages == []  # the heartbeat's reply carries them
    assert coord["iteration_id"] not in {u.iteration_id for u in created}


def test_heartbeat_reconciliation():
    core, cluster = make()
    ds = dataset(core)
    join(core, cluster, "tcp://a:1")
    view = read(core, ds, "OFF")
    tid = view["tasks"][0]["task_id"]
    # the push was lost: the heartbeat says the task again
    out = core.worker_heartbeat(cluster.workers["tcp://a:1"], 101.0, active_tasks=[])
    assert [t["task_id"] for t in out.reply["new_tasks"]] == [tid] and out.updates == []
    # reported finished: applied; an unknown task reported: cancelled
    out = core.worker_heartbeat(cluster.workers["tcp://a:1"], 102.0, finished_tasks=[tid],
                                active_tasks=[9999])
    assert out.updates == [FinishTask(task_id=tid)]
    assert out.reply == {"status": "OK", "new_tasks": [], "cancelled": [9999], "lineage": "L"}


def test_job_compatibility_errors():
    core, _ = make()
    ds = dataset(core)
    core.get_or_create_job(ds, "OFF", job_name="j")
    with pytest.raises(ValueError, match=r"^job 'j' of dataset 1000 already exists with "
                       r"processing mode OFF; it cannot be read in mode DYNAMIC$"):
        core.get_or_create_job(ds, "DYNAMIC", job_name="j")
    with pytest.raises(ValueError, match=r"^job 'j' is read with target_workers='AUTO'; all "
                       r"its consumers must use the same, not 'LOCAL'$"):
        core.get_or_create_job(ds, "OFF", job_name="j", target_workers="local")
    with pytest.raises(ValueError, match=r"^sharding policy DATA needs a fixed list of "
                       r"workers"):
        core.get_or_create_job(ds, "DATA")
    assert core.take_effects().updates == []


def test_liveness_deadline_and_stalled_dispatcher():
    core, cluster = make(worker_timeout=10.0, client_timeout=100.0)
    ds = dataset(core)
    join(core, cluster, "tcp://a:1", 100.0)
    read(core, ds, "OFF")
    assert core.gc_tick(105.0).updates == []
    # the dispatcher itself did not run for 20 s: the silence is its own, timers restart
    assert core.gc_tick(125.0).updates == []
    assert core.gc_tick(129.0).updates == []
    assert core.gc_tick(133.0).updates == []
    out = core.gc_tick(135.5)  # 10.5 s after the timers restarted
    assert out.updates[0] == RemoveWorker(address="tcp://a:1")
    assert core.deadlines.dropped == {"tcp://a:1": 135.5}


def test_a_gc_tick_looks_only_at_the_silent(monkeypatch):
    """Workers and consumers are kept in the order they were last heard from: a GC tick walks
    from the oldest and stops at the first that is not silent (O(1 + silent), not a scan of
    every consumer every 500 ms); a worker registered without a heartbeat gets a timer at the
    next tick; a clock that stepped back finds a consumer silent late, never early."""
    core, cluster = make(worker_timeout=10.0, client_timeout=10.0)
    ds = dataset(core)
    for i, address in enumerate(("tcp://a:1", "tcp://b:1", "tcp://c:1")):
        join(core, cluster, address, 100.0 + i)
    core.apply(RegisterWorker(address="tcp://d:1", host="d", nthreads=1))  # no heartbeat
    views = [read(core, ds, "DYNAMIC", 100.0, job_name="shared") for _ in range(1_000)]
    token = core.state.job(core.state.iteration(views[0]["iteration_id"]).job_id).token
    for i, view in enumerate(views):
        when = 100.0 + i * 0.001 if i < 100 else 110.0
        core.client_heartbeat(view["iteration_client_id"], when, job_token=token)
    for address in ("tcp://b:1", "tcp://c:1"):
        core.worker_heartbeat(cluster.workers[address], 105.0)

    def scan(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a GC tick scanned every worker or consumer")

    monkeypatch.setattr(type(core.state), "list_iteration_clients", scan)
    monkeypatch.setattr(type(core.state), "list_workers", scan)
    # ticks closer than worker_timeout / 2 (a longer pause is the dispatcher's own stall)
    assert core.gc_tick(104.0).updates == []  # d's timer starts here
    assert core.gc_tick(108.0).updates == []
    out = core.gc_tick(111.0)  # silent: a (since 100) and the first 100 consumers
    released = [u.iteration_client_id for u in out.updates
                if isinstance(u, ReleaseIterationClient)]
    assert released == [v["iteration_client_id"] for v in views[:100]]
    assert [u.address for u in out.updates if isinstance(u, RemoveWorker)] == ["tcp://a:1"]
    for address in ("tcp://b:1", "tcp://c:1"):
        core.worker_heartbeat(cluster.workers[address], 114.5)
    out = core.gc_tick(114.5)  # d: 10.5 s after its first tick
    assert [u.address for u in out.updates if isinstance(u, RemoveWorker)] == ["tcp://d:1"]
    assert len(core.client_seen) == 900 and "tcp://a:1" not in core.deadlines.seen_at
    # the clock stepped back between two heartbeats: the later one looks older
    core.client_heartbeat(views[100]["iteration_client_id"], 118.0, job_token=token)
    core.client_heartbeat(views[101]["iteration_client_id"], 116.0, job_token=token)
    for view in views[102:]:
        core.client_heartbeat(view["iteration_client_id"], 118.0, job_token=token)
    assert core.gc_tick(118.5).updates == []
    assert core.gc_tick(122.5).updates == []
    for view in views[102:]:
        core.client_heartbeat(view["iteration_client_id"], 124.0, job_token=token)
    for address in ("tcp://b:1", "tcp://c:1"):
        core.worker_heartbeat(cluster.workers[address], 124.0)
    assert core.gc_tick(126.5).updates == []  # 101 is silent (10.5 s), found late
    out = core.gc_tick(128.5)
    assert [u.iteration_client_id for u in out.updates] == [
        views[100]["iteration_client_id"], views[101]["iteration_client_id"]]


def test_a_static_job_of_many_workers_per_host_gives_each_its_own_shard():
    """TensorFlow's ``"host:%port%"`` entries, 200 hosts of 10 workers: each worker takes a
    shard of its host not held by another live worker of the iteration, looked up per host
    (a worker that left frees its shard for the next of its host)."""
    entries = [f"10.0.{h // 250}.{h % 250}:%port%" for h in range(200) for _ in range(10)]
    core, cluster = make(worker_addresses=tuple(entries))
    ds = dataset(core)
    addresses = [f"tcp://10.0.{h // 250}.{h % 250}:{9000 + k}" for h in range(200)
                 for k in range(10)]
    for address in addresses:
        join(core, cluster, address)
    view = read(core, ds, "DATA")
    tasks = core.state.tasks_for_iteration(view["iteration_id"])
    assert sorted(t.shard_index for t in tasks) == list(range(2_000))
    assert all(entries[t.shard_index].split(":")[0] in t.worker_address for t in tasks)
    gone = next(t for t in tasks if t.worker_address == addresses[5])
    del cluster.workers[addresses[5]]
    core.worker_left(addresses[5])
    newcomer = "tcp://10.0.0.0:9999"
    out = join(core, cluster, newcomer)
    assert [t["worker_index"] for t in out.reply["new_tasks"]] == [gone.shard_index]


def test_gc_anonymous_at_release_named_after_timeout_dynamic_kept():
    core, cluster = make(job_gc_timeout=5.0)
    ds = dataset(core)
    join(core, cluster, "tcp://a:1")
    anon = read(core, ds, "OFF")
    token = core.state.job(core.state.iteration(anon["iteration_id"]).job_id).token
    out = core.release_iteration_client(anon["iteration_client_id"], 101.0, job_token=token)
    assert [type(u) for u in out.updates] == [ReleaseIterationClient, GarbageCollectIteration]
    assert out.messages == [("tcp://a:1", {"op": "dataservice-tasks", "new_tasks": [],
                                           "cancelled": [anon["tasks"][0]["task_id"]]})]
    named = {m: read(core, ds, m, job_name=f"n-{m}") for m in ("OFF", "DYNAMIC")}
    for view in named.values():
        token = core.state.job(core.state.iteration(view["iteration_id"]).job_id).token
        core.release_iteration_client(view["iteration_client_id"], 102.0, job_token=token)
    assert core.gc_tick(106.0).updates == []  # 4 s idle: kept
    out = core.gc_tick(107.0)
    assert [u.iteration_id for u in out.updates if isinstance(u, GarbageCollectIteration)] \
        == [named["OFF"]["iteration_id"]]  # the unfinished DYNAMIC one is kept (TF)


def test_a_stimulus_that_raises_leaves_its_effects():
    core, cluster = make()
    ds = dataset(core)
    join(core, cluster, "tcp://a:1")
    view = read(core, ds, "DYNAMIC")
    core.refusal = "journal failed"
    token = core.state.job(core.state.iteration(view["iteration_id"]).job_id).token
    with pytest.raises(Exception, match="journal failed"):
        core.get_split(view["iteration_id"], view["tasks"][0]["task_id"], 0, job_token=token)
    assert core.take_effects().updates == []


def test_restore_marks_workers_pending_and_revives_a_resumed_one():
    """A new start replays the journal (the records of every outcome); the journal's workers
    are pending until they heartbeat; one that kept its tasks is revived with them."""
    from dask_dataservice.service.dispatcher.state import replay

    core, cluster = make()
    records = []
    out = core.register_dataset("fp", b"p", b"s", 4, metadata={"cardinality": 4})
    records += out.updates
    records += join(core, cluster, "tcp://a:1").updates
    out = core.get_or_create_job(out.reply["dataset_id"], "OFF")
    records += out.updates
    job = out.reply
    records += core.get_or_create_iteration(job["job_id"], 100.0,
                                            job_token=job["job_token"]).updates
    assert [type(u) for u in records][-3:] == [CreateIteration, CreateTask,
                                               AcquireIterationClient]
    state = replay(records)
    assert state == core.state
    core2, cluster2 = make()
    core2.restore(state)
    assert core2.recovered_workers == {"tcp://a:1"}
    out = core2.worker_heartbeat(cluster2.add("tcp://a:1"), 200.0, active_tasks=[4000],
                                 resumed=True)
    assert out.updates == [] and out.reply["new_tasks"] == [] and not core2.recovered_workers
    # a fresh process at that address instead: its tasks are lost first
    core3, cluster3 = make()
    core3.restore(replay(records))
    out = core3.worker_heartbeat(cluster3.add("tcp://a:1"), 200.0)
    assert out.updates[0] == RemoveWorker(address="tcp://a:1")
    assert isinstance(out.updates[1], RegisterWorker)


def test_a_recovered_worker_removed_and_forgotten_registers_again():
    """Found by the simulator (dynamic seeds 6670, 6757): after a restart a journal's worker
    left (RemoveWorker) and, no task naming it any more, was forgotten; when it came back its
    revival raised WorkerNotFoundError, and so did every heartbeat of it from then on."""
    from dask_dataservice.service.dispatcher.state import replay

    core, cluster = make()
    records = list(join(core, cluster, "tcp://a:1").updates)
    core2, cluster2 = make()
    core2.restore(replay(records))
    assert core2.recovered_workers == {"tcp://a:1"}
    assert core2.worker_left("tcp://a:1").updates == [RemoveWorker(address="tcp://a:1")]
    assert core2.state.list_workers(include_departed=True) == []  # forgotten
    out = core2.worker_heartbeat(cluster2.add("tcp://a:1"), 200.0)
    assert [type(u) for u in out.updates] == [RegisterWorker]
    assert out.reply["status"] == "OK" and not core2.recovered_workers


def test_a_draining_worker_takes_no_split_and_no_task_and_its_splits_go_to_the_others():
    """issue 26: ``drain_worker`` answers the DYNAMIC tasks to wait for; their next split
    request answers ``drained`` (a retried one still gets what was handed out and never
    arrived), the other workers take every split left, and a live iteration gives the
    draining worker no new task. Every split is handed out exactly once."""
    core, cluster = make()
    ds = dataset(core, 40)
    join(core, cluster, "tcp://a:1")
    join(core, cluster, "tcp://b:1")
    view = read(core, ds, "DYNAMIC")
    it = view["iteration_id"]
    task = {t["worker_address"]: t["task_id"] for t in view["tasks"]}
    token = core.state.job(core.state.iteration(it).job_id).token
    handed = [0, 1]  # each task's first split came with its push
    got = core.get_split(it, task["tcp://a:1"], 0, count=3, job_token=token).reply
    handed += got["split_indices"]
    assert core.drain_worker("tcp://a:1").reply == [task["tcp://a:1"]]
    assert core.draining == {"tcp://a:1"}
    lost = core.get_split(it, task["tcp://a:1"], 0, count=4, job_token=token,
                          received=1).reply  # a retry: the 3 it never got, once more
    assert lost["split_indices"] == got["split_indices"] and "drained" not in lost
    again = core.get_split(it, task["tcp://a:1"], 0, count=4, job_token=token,
                           received=4).reply
    assert again == {"status": "OK", "split_indices": [], "end_of_splits": True,
                     "drained": True}
    # a later repetition too (an endless repeat() asks for it): drained, not an error
    assert core.get_split(it, task["tcp://a:1"], 1, job_token=token).reply["drained"]
    while True:
        reply = core.get_split(it, task["tcp://b:1"], 0, count=1024, job_token=token).reply
        handed += reply["split_indices"]
        if reply["end_of_splits"]:
            break
    assert sorted(handed) == list(range(40))
    assert core.drained([task["tcp://a:1"]]) == [task["tcp://a:1"]]  # still producing
    core.finish_task(task["tcp://a:1"], job_token=token)
    assert core.drained([task["tcp://a:1"]]) == []
    # a new read gives the draining worker no task; called off, it takes them again
    view2 = read(core, dataset(core, 8), "DYNAMIC")
    assert [t["worker_address"] for t in view2["tasks"]] == ["tcp://b:1"]
    core.undrain("tcp://a:1")
    assert core.is_data_worker("tcp://a:1")
    core.worker_left("tcp://b:1")
    assert core.draining == set()


def test_draining_waits_for_dynamic_tasks_only():
    """OFF and static tasks, and coordinated reads, are lost with their worker as in TF:
    ``drain_worker`` does not wait for them."""
    core, cluster = make()
    ds = dataset(core, 8)
    join(core, cluster, "tcp://a:1")
    read(core, ds, "OFF")
    endless = core.register_dataset("inf", b"p", b"s", 8,
                                    metadata={"cardinality": INFINITE}).reply["dataset_id"]
    read(core, endless, "DYNAMIC", job_name="coordinated", num_consumers=1)
    dyn = read(core, ds, "DYNAMIC", job_name="plain")
    assert core.drain_worker("tcp://a:1").reply == [dyn["tasks"][0]["task_id"]]
    assert core.drain_worker("tcp://nobody:1").reply == []


def test_a_finished_task_the_worker_still_holds_is_waited_for():
    """Found by the simulator's ``retire`` workload: a task that made all its splits leaves
    the dispatcher's index of its worker's tasks, yet its buffer may still hold elements;
    the drain took it for nothing to wait for, and they were lost with the worker."""
    core, cluster = make()
    ds = dataset(core, 4)
    join(core, cluster, "tcp://a:1")
    join(core, cluster, "tcp://b:1")
    view = read(core, ds, "DYNAMIC")
    task = {t["worker_address"]: t["task_id"] for t in view["tasks"]}
    token = core.state.job(core.state.iteration(view["iteration_id"]).job_id).token
    core.finish_task(task["tcp://a:1"], job_token=token)
    assert core.drain_worker("tcp://a:1").reply == []  # the index alone no longer has it
    assert core.drain_worker("tcp://a:1", [task["tcp://a:1"]]).reply == [task["tcp://a:1"]]
    # finished, with a consumer: the shell asks the worker whether its consumers took all
    assert core.drained([task["tcp://a:1"]], finished=True) == [task["tcp://a:1"]]
    # what the worker says it holds but is another worker's, or unknown, is not waited for
    assert core.drain_worker("tcp://a:1", [task["tcp://b:1"], 99_999]).reply == []


def _drain_splits(core: DispatcherCore, it: int, task_id: int, token: str) -> list[int]:
    got: list[int] = []
    while True:
        reply = core.get_split(it, task_id, 0, count=2, job_token=token).reply
        got += reply["split_indices"]
        if reply["end_of_splits"] or not reply["split_indices"]:
            return got


def test_an_autocached_dataset_hands_each_worker_the_splits_it_cached_first():
    """issue 26, part 3: the splits a data worker reported caching (``autocache()``) go to
    it first in later iterations, then the splits no worker caches, then (one per request)
    another worker's; a worker that left takes its caches along. Every split once."""
    core, cluster = make()
    ds = dataset(core, 12, autocache=True)
    join(core, cluster, "tcp://a:1")
    join(core, cluster, "tcp://b:1")
    j = core.get_or_create_job(ds, "DYNAMIC").reply
    out = core.get_or_create_iteration(j["job_id"], 100.0, job_token=j["job_token"])
    (a,), (b,) = (_pushed(out)[w] for w in ("tcp://a:1", "tcp://b:1"))
    assert (a["first_splits"], b["first_splits"]) == (([0], False), ([1], False))
    with pytest.raises(Exception, match="token"):
        core.autocached(a["task_id"], [0], job_token="forged")
    core.autocached(a["task_id"], [0, 2, 4, 6], job_token=j["job_token"])
    core.autocached(b["task_id"], [1, 3, 5], job_token=j["job_token"])
    # the next epoch: a new job of the same dataset
    j2 = core.get_or_create_job(ds, "DYNAMIC").reply
    out = core.get_or_create_iteration(j2["job_id"], 100.0, job_token=j2["job_token"])
    it = out.reply["iteration_id"]
    (a,), (b,) = (_pushed(out)[w] for w in ("tcp://a:1", "tcp://b:1"))
    assert (a["first_splits"], b["first_splits"]) == (([0], False), ([1], False))
    token = j2["job_token"]
    assert core.get_split(it, a["task_id"], 0, count=2, job_token=token).reply[
        "split_indices"] == [2, 4]
    assert core.get_split(it, a["task_id"], 0, count=2, job_token=token).reply[
        "split_indices"] == [6]  # the last of its own
    assert core.get_split(it, a["task_id"], 0, count=2, job_token=token).reply[
        "split_indices"] == [7, 8]  # nobody caches these
    rest_b = _drain_splits(core, it, b["task_id"], token)
    assert rest_b[:2] == [3, 5]
    assert sorted([0, 2, 4, 6, 7, 8, 1] + rest_b) == list(range(12))
    core.worker_left("tcp://a:1")
    internal = core.state.job(core.state.iteration(it).job_id).dataset_id
    assert core.hints.cached.holders((internal, 0)) == set()
    assert core.hints.cached.holders((internal, 1)) == {"tcp://b:1"}
