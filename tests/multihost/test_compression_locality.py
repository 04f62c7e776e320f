"""What one loopback cannot show about the data service: hosts with addresses of their own.

- ``compression="AUTO"`` (issue 16): a worker compresses the batches it sends a reader on
  another host (over a 1 Gbit/s ``tbf`` link) and not those for a reader on its own host;
  ``compression=None`` never. Read from the worker's own counters (``batches_served``,
  ``batches_compressed``) and the codecs each reader offers.
- ``target_workers`` by host (``data_service_ops_test.testTargetWorkers``-style, TF's
  ``LOCAL``/``AUTO``/``ANY``): a consumer in the namespace of one data worker reads ``LOCAL``
  from that worker only; two such consumers of one named DYNAMIC job see every element once
  between them, each from its own host; ``AUTO`` reads every worker under OFF, and only the
  local one under a static policy (DATA: each host's consumer gets its worker's shard); ``LOCAL`` on
  a host without a data worker is a clear error naming the hosts.
"""

from __future__ import annotations

import collections

import pytest
from _netns import poll

pytestmark = [pytest.mark.process, pytest.mark.multihost, pytest.mark.timeout(120)]

W1 = "w1"


def _cluster(net, workers=(W1,)):
    s = net.host("sched")
    address = net.scheduler(s)
    hosts = {}
    for name in workers:
        hosts[name] = net.host(name)
        net.worker(hosts[name], address, name, env={"DDS_HOST": name})
    return address, hosts


def _served(agent, worker):
    stats = agent.call("worker_stats", workers=[worker])["stats"][worker]
    return stats["batches_served"], stats["batches_compressed"]


@pytest.mark.slow
def test_auto_compression_across_hosts_not_on_the_same_host(net):
    address, hosts = _cluster(net)
    w1 = hosts[W1]
    net.rate(w1, "1gbit")
    worker = f"tcp://{w1.addr}:9000"
    remote = net.agent(net.host("c"), address, "remote consumer")
    remote.call("workers", n=1)
    local = net.agent(w1, address, "same-host consumer")

    offered = remote.call("codecs", workers=[worker])
    assert offered["local_host"] == net.hosts["c"].addr
    assert offered["codecs"][worker][0] == "lz4", offered  # AUTO's first choice, installed
    mine = local.call("codecs", workers=[worker])
    assert mine == {"local_host": w1.addr, "codecs": {worker: None}}

    n, size = 200, 16384  # 64 KiB of zeros each: compressible
    auto = remote.call("register", kind="arrays", n=n, size=size)["dataset_id"]
    raw = remote.call("register", kind="arrays", n=n, size=size,
                      compression=None)["dataset_id"]
    runs = {}
    for who, agent, dataset_id in (("remote AUTO", remote, auto), ("local AUTO", local, auto),
                                   ("remote None", remote, raw)):
        before = _served(remote, worker)
        agent.call("read", name=who, dataset_id=dataset_id)
        out = agent.call("result", name=who)
        assert out["read_error"] is None, out["read_error"]
        assert collections.Counter(out["elements"]) == collections.Counter(range(n)), who
        after = _served(remote, worker)
        runs[who] = (after[0] - before[0], after[1] - before[1])
    served, compressed = runs["remote AUTO"]
    assert served > 0 and compressed == served, runs  # every batch crossed hosts compressed
    served, compressed = runs["local AUTO"]
    assert served > 0 and compressed == 0, runs       # same host: raw frames
    served, compressed = runs["remote None"]
    assert served > 0 and compressed == 0, runs       # the dataset said never


@pytest.mark.slow
def test_local_target_workers_read_their_own_host(net):
    address, hosts = _cluster(net, (W1, "w2"))
    w1, w2 = hosts[W1], hosts["w2"]
    a1, a2 = f"tcp://{w1.addr}:9000", f"tcp://{w2.addr}:9000"
    c1 = net.agent(w1, address, "consumer on w1")
    c1.call("workers", n=2)
    poll(lambda: c1.call("dispatcher")["workers"] == sorted([a1, a2]), 30,
         "both data workers to register with the dispatcher")
    c2 = net.agent(w2, address, "consumer on w2")
    n = 4000
    dataset_id = c1.call("register", kind="range", n=n)["dataset_id"]

    # OFF: every worker produces the whole dataset; LOCAL reads only the one on this host
    c1.call("read", name="off", dataset_id=dataset_id, mode="parallel_epochs",
            target_workers="LOCAL")
    out = c1.call("result", name="off")
    assert out["read_error"] is None
    assert sorted(out["elements"]) == list(range(n))
    assert out["workers"] == {a1: n}

    # one named DYNAMIC job, a LOCAL consumer on each host: every element once between them,
    # each consumer's from the worker on its own host (which worker took how many splits is
    # the dispatcher's choice: not asserted)
    for c in (c1, c2):
        c.call("read", name="job", dataset_id=dataset_id, job_name="by-host",
               target_workers="LOCAL")
    o1, o2 = c1.call("result", name="job"), c2.call("result", name="job")
    assert o1["read_error"] is None and o2["read_error"] is None
    assert collections.Counter(o1["elements"] + o2["elements"]) == collections.Counter(range(n))
    assert set(o1["workers"]) <= {a1} and set(o2["workers"]) <= {a2}, (o1["workers"],
                                                                       o2["workers"])
    assert sum(o1["workers"].values()) == len(o1["elements"])
    assert sum(o2["workers"].values()) == len(o2["elements"])

    # AUTO reads every worker (TF: AUTO is LOCAL only under static sharding): OFF, each
    # worker's whole dataset
    c1.call("read", name="auto", dataset_id=dataset_id, mode="parallel_epochs",
            target_workers="AUTO")
    out = c1.call("result", name="auto")
    assert out["read_error"] is None
    assert collections.Counter(out["elements"]) == {i: 2 for i in range(n)}
    assert out["workers"] == {a1: n, a2: n}

    # LOCAL on a host without a data worker: the error names this host and theirs
    far = net.agent(net.host("c"), address, "consumer without a worker")
    far.call("read", name="none", dataset_id=dataset_id, mode="parallel_epochs",
             target_workers="LOCAL")
    out = far.call("result", name="none")
    c = net.hosts["c"].addr
    assert out["read_error"] == (
        f"DataServiceError: target_workers='LOCAL', but no data worker of this job runs on "
        f"this host ({c}); its workers are on {sorted([w1.addr, w2.addr])}"), out


def test_auto_target_workers_read_locally_under_static_sharding(net):
    """``target_workers="AUTO"`` under a static policy (DATA, over the fixed worker list
    ``w1,w2``) reads only the worker on the consumer's host: each host's consumer gets exactly
    its worker's shard (every 2nd element), from that worker (TF: AUTO is LOCAL for static
    sharding)."""
    s = net.host("sched")
    address = net.scheduler(s, "--worker-addresses", "w1,w2")
    hosts = {name: net.host(name) for name in ("w1", "w2")}
    for name, host in hosts.items():
        net.worker(host, address, name, env={"DDS_HOST": name})
    consumers = {name: net.agent(host, address, f"consumer on {name}")
                 for name, host in hosts.items()}
    c1 = consumers["w1"]
    c1.call("workers", n=2)
    want = sorted(f"tcp://{h.addr}:9000" for h in hosts.values())
    poll(lambda: c1.call("dispatcher")["workers"] == want, 30,
         "both data workers to register with the dispatcher")
    n = 3000
    dataset_id = c1.call("register", kind="range", n=n)["dataset_id"]
    for index, (name, agent) in enumerate(consumers.items()):
        agent.call("read", name="static", dataset_id=dataset_id, mode="DATA",
                   target_workers="AUTO")
        out = agent.call("result", name="static")
        assert out["read_error"] is None, out["read_error"]
        assert sorted(out["elements"]) == list(range(index, n, 2)), name
        assert out["workers"] == {f"tcp://{hosts[name].addr}:9000": len(range(index, n, 2))}
