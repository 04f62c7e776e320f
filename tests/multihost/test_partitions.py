"""Partitions: a host's link taken down and brought back (packets lost, no connection reset),
and a reader-worker connection that breaks, with the guarantees of a frozen (SIGSTOP)
process (tests/service/test_frozen_workers.py, tests/ps/test_ps_liveness.py).

- A data worker cut off mid-split (TF ``fault_tolerance_test``: a worker lost mid-job under
  DYNAMIC, at most once): the dispatcher drops it when its heartbeats stop, the read ends
  without it, no element twice, every missing one of a split it held; back, it heartbeats
  again, its old task is cancelled and serves nothing, and it serves the next read.
- The scheduler cut off for a while, within every timeout: the data workers go on serving
  what they hold, the read ends with every element exactly once, nobody is dropped.
- A parameter server cut off: ``join()`` raises ``ParameterServerUnavailableError`` after the
  liveness timeout, not Dask's worker-ttl; back, it is used again and updates are exact.
- A reader-worker connection broken while a reply was on its way (the worker's replies to
  the reader dropped until the reader's side gives the connection up): the reader sends the
  request again on a new connection and the worker answers it with the reply it kept, so
  nothing is lost or repeated.
"""

from __future__ import annotations

import collections
import time

import pytest
from _netns import poll

pytestmark = [pytest.mark.process, pytest.mark.multihost, pytest.mark.slow,
              pytest.mark.timeout(150)]


def _data_cluster(net, scheduler_env=None, worker_env=None):
    s = net.host("sched")
    address = net.scheduler(s, env=scheduler_env)
    for name in ("w1", "w2"):
        net.worker(net.host(name), address, name, env={"DDS_HOST": name, **(worker_env or {})})
    return address


def _both_registered(agent, net):
    want = sorted(f"tcp://{net.hosts[n].addr}:9000" for n in ("w1", "w2"))
    poll(lambda: agent.call("dispatcher")["workers"] == want, 30,
         "both data workers to register with the dispatcher")
    return want


def _off_read(agent, workers, n=2000):
    """A fresh OFF read: each worker its whole dataset (both serve)."""
    dataset_id = agent.call("register", kind="range", n=n)["dataset_id"]
    agent.call("read", name="after", dataset_id=dataset_id, mode="parallel_epochs")
    out = agent.call("result", name="after")
    assert out["read_error"] is None
    assert collections.Counter(out["elements"]) == {i: 2 for i in range(n)}
    assert out["workers"] == {w: n for w in workers}


def test_data_worker_partitioned_mid_split_then_back(net):
    """``test_frozen_workers``' checks for a link down instead of SIGSTOP."""
    address = _data_cluster(net, scheduler_env={
        "DASK_DATASERVICE__DISPATCHER__WORKER_TIMEOUT": "3s",
        "DASK_DATASERVICE__DISPATCHER__WORKER_PROBE_TIMEOUT": "2s"})
    agent = net.agent(net.host("c"), address, "consumer",
                      env={"DASK_DATASERVICE__CLIENT__REQUEST_TIMEOUT": "2s"})
    workers = _both_registered(agent, net)
    victim_host = net.hosts["w1"]
    victim = f"tcp://{victim_host.addr}:9000"
    n = 20_000
    dataset_id = agent.call("register", kind="slow", n=n, slow_host="w1",
                            delay=0.005)["dataset_id"]
    splits = agent.call("splits", dataset_id=dataset_id)["splits"]
    agent.call("read", name="r", dataset_id=dataset_id)

    def victim_task():
        for it in agent.call("dispatcher")["iterations"]:
            for t in it["tasks"]:
                if t["worker"] == victim and t["splits"]:
                    return t
        return None

    old_task = poll(victim_task, 30, "the victim to hold a split")["task_id"]
    net.link(victim_host, up=False)
    try:
        poll(lambda: victim in agent.call("dispatcher")["dropped"], 30,
             "the dispatcher to drop the cut-off worker")
        out = agent.call("result", name="r", timeout=60)
        state = agent.call("dispatcher")
    finally:
        net.link(victim_host, up=True)
    assert out["read_error"] is None, out["read_error"]
    assert victim in state["dask_workers"], "Dask itself must not have noticed (worker-ttl)"
    counts = collections.Counter(out["elements"])
    assert max(counts.values()) == 1, "an element arrived twice"
    missing = set(range(n)) - set(counts)
    (it,) = state["iterations"]
    lost_elements = {i for _, index in it["lost"] for i in range(*splits[index])}
    assert it["lost"], "the victim held a split when it was cut off"
    assert missing <= lost_elements, "a missing element not of a split the victim held"

    # back: it heartbeats again, its old task is cancelled and serves nothing
    poll(lambda: victim not in agent.call("dispatcher")["dropped"], 30,
         "the victim to heartbeat again")
    poll(lambda: (lambda s: old_task not in s["tasks"] and old_task in s["finished"])(
        agent.call("worker_tasks", worker=victim)), 30, "the victim to cancel its old task")
    reply = agent.call("get_elements", worker=victim, task_id=old_task)
    assert reply["elements"] is None and reply["end_of_sequence"], reply
    # and, registered again (a job made before that would not know it), it serves the next read
    poll(lambda: (lambda s: s["workers"] == workers and s["dropped"] == [])(
        agent.call("dispatcher")), 30, "the victim to register again")
    _off_read(agent, workers)


def test_scheduler_partitioned_mid_read_then_back(net):
    address = _data_cluster(net, scheduler_env={
        "DASK_DATASERVICE__DISPATCHER__WORKER_TIMEOUT": "30s"})
    agent = net.agent(net.host("c"), address, "consumer")
    workers = _both_registered(agent, net)
    n = 20_000
    dataset_id = agent.call("register", kind="slow", n=n, slow_host="*",
                            delay=0.0002)["dataset_id"]
    agent.call("read", name="r", dataset_id=dataset_id)
    poll(lambda: agent.call("progress", name="r")["count"] > 0, 30, "the first elements")
    net.link(net.hosts["sched"], up=False)
    try:
        # the fault's length, well within the dispatcher's worker-timeout (30 s here), the
        # reader's dispatcher-timeout (30 s) and distributed's TCP timeout (30 s)
        time.sleep(3)
    finally:
        net.link(net.hosts["sched"], up=True)
    out = agent.call("result", name="r", timeout=90)
    assert out["read_error"] is None, out["read_error"]
    assert collections.Counter(out["elements"]) == collections.Counter(range(n))
    state = agent.call("dispatcher")
    assert state["workers"] == workers and state["dropped"] == []
    (it,) = state["iterations"]
    assert it["lost"] == []
    _off_read(agent, workers)


LIVENESS = 2.0
PS_ENV = {"DASK_DATASERVICE__PS__LIVENESS_TIMEOUT": f"{LIVENESS}s",
          "DASK_DATASERVICE__PS__MEMBERSHIP_INTERVAL": "200ms",
          "DASK_DATASERVICE__PS__CLOSURES_PER_BATCH": "20",
          "DASK_DATASERVICE__PS__REQUEST_TIMEOUT": "30s"}


def test_parameter_server_partitioned_then_back(net):
    """``test_ps_liveness.test_frozen_parameter_server``'s checks for a link down."""
    s = net.host("sched")
    address = net.scheduler(s, env=PS_ENV)
    ps = net.host("ps1")
    net.worker(ps, address, "ps1", "--resources", "ps=1", env=PS_ENV)
    net.worker(net.host("t1"), address, "t1", env=PS_ENV)
    agent = net.agent(net.host("c"), address, "coordinator", env=PS_ENV)
    agent.call("workers", n=2)
    agent.call("strategy", rows=8)
    out = agent.call("train", steps=50)
    assert out["join_error"] is None and out["results"] == list(range(50))
    assert agent.call("values")["counter"] == 50

    net.link(ps, up=False)
    try:
        out = agent.call("train", steps=20, start=50, timeout=60)
        assert out["join_error"] is not None and out["join_error"].startswith(
            "ParameterServerUnavailableError: "), out["join_error"]
        assert f"did not answer within {LIVENESS:g} s" in out["join_error"], out["join_error"]
        poll(lambda: agent.call("all_done")["done"], 3 * LIVENESS + 10,
             "the runner to give up on the cut-off PS")
        poll(lambda: agent.call("coord_stats")["stats"]["ps_silent"] == 1, 10,
             "the PS to be marked silent")
        out = agent.call("train", steps=1, start=70, timeout=30)
        assert "did not answer within" in (out["join_error"] or ""), out
    finally:
        net.link(ps, up=True)
    poll(lambda: agent.call("coord_stats")["stats"]["ps_back"] == 1, 30,
         "the PS to answer again")
    out = agent.call("train", steps=10, start=100)
    assert out["join_error"] is None, out["join_error"]
    settled = agent.call("values")["counter"]
    assert 60 <= settled <= 81, settled  # as for SIGSTOP: some of the cut-off steps landed
    out = agent.call("train", steps=10, start=200)
    assert out["join_error"] is None and out["results"] == list(range(200, 210))
    assert agent.call("values")["counter"] == settled + 10
    agent.call("shutdown")


def test_broken_reader_worker_connection_loses_nothing(net):
    """The worker's replies to the reader are dropped while one is on its way, until the
    reader's TCP connection gives up (``distributed.comm.timeouts.tcp``, 11 s here: the
    least distributed accepts; the element port's connection gets the same kernel timeouts as
    a Dask comm); the reader sends the request again once the worker can be
    reached, and the worker answers with the reply it kept (``requests_replayed``)."""
    address = _data_cluster(net)
    c = net.host("c")
    agent = net.agent(c, address, "consumer",
                      env={"DASK_DISTRIBUTED__COMM__TIMEOUTS__TCP": "11s"})
    _both_registered(agent, net)
    w1 = net.hosts["w1"]
    a1 = f"tcp://{w1.addr}:9000"
    n = 30_000
    dataset_id = agent.call("register", kind="slow", n=n, slow_host="*",
                            delay=0.001)["dataset_id"]
    agent.call("read", name="r", dataset_id=dataset_id)
    poll(lambda: agent.call("progress", name="r")["count"] > 0, 30, "the first elements")
    element_port = agent.call("worker_stats", workers=[a1])["stats"][a1]["element_port"]
    assert element_port  # the reader's requests go there (issue 25)
    net.block_replies(c, w1, 9000)
    net.block_replies(c, w1, element_port)
    try:
        before = agent.call("worker_stats", workers=[a1])["stats"][a1]["batches_served"]
        # a reply served from now on is lost; so is one served just before the block that
        # was still on its way (it was counted in ``before``): then the reader waits for it
        # until it gives the connection up, and w1 serves nothing new meanwhile
        poll(lambda: agent.call("worker_stats", workers=[a1])["stats"][a1]["batches_served"]
             > before or agent.call("log", contains=f"to {a1} failed")["lines"], 30,
             "a reply of w1 to be lost on its way")
        poll(lambda: agent.call("log", contains=f"to {a1} failed")["lines"], 60,
             "the reader to give its connection to w1 up")
    finally:
        net.unblock(c, -9000)
        net.unblock(c, -element_port)
    out = agent.call("result", name="r", timeout=90)
    assert out["read_error"] is None, out["read_error"]
    assert collections.Counter(out["elements"]) == collections.Counter(range(n))
    stats = agent.call("worker_stats", workers=[a1])["stats"][a1]
    assert stats["requests_replayed"] >= 1, stats
    state = agent.call("dispatcher")
    assert state["dropped"] == [] and all(it["lost"] == [] for it in state["iterations"])
