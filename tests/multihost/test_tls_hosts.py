"""TLS across hosts (issue 11 s6 on separate hosts; tests/service/test_tls.py on one loopback).

A certificate made in the test (``Security.temporary()``, written to files as a deployment
has them) for the scheduler, two PSs and two workers started with ``--tls-*`` options, each
on its own host, and for the coordinator's client on a sixth: a DYNAMIC read sees every
element once from both data workers, scheduled PS steps are exact, the training workers use
distributed's (TLS) comms, not the plain data path, and no process warns that it listens
without TLS (the same command lines without certificates do).
"""

from __future__ import annotations

import collections

import pytest
from _helpers import write_certs
from _netns import poll
from distributed.security import Security
from test_ps_hosts import expected, ps_cluster

pytestmark = [pytest.mark.process, pytest.mark.multihost, pytest.mark.timeout(120)]


def _certs(directory) -> dict[str, str]:
    return write_certs(directory, Security.temporary())


@pytest.mark.slow
def test_tls_data_service_and_ps_training_across_hosts(net):
    address, agent = ps_cluster(net, tls=_certs(net.tmp))
    assert address.startswith(f"tls://{net.hosts['sched'].addr}:")
    workers = agent.call("workers", n=4)["workers"]
    assert all(w.startswith("tls://") for w in workers), workers
    by_name = {name: a for a, name in workers.items()}

    data_workers = {by_name["t1"], by_name["t2"]}  # not the PSs
    poll(lambda: set(agent.call("dispatcher")["workers"]) == data_workers, 30,
         "both data workers to register with the dispatcher")
    n = 6000
    dataset_id = agent.call("register", kind="range", n=n)["dataset_id"]
    agent.call("read", name="off", dataset_id=dataset_id, mode="parallel_epochs")
    out = agent.call("result", name="off")
    assert out["read_error"] is None  # OFF: each worker the whole dataset, over TLS
    assert collections.Counter(out["elements"]) == {i: 2 for i in range(n)}
    assert out["workers"] == {w: n for w in data_workers}
    agent.call("read", name="dynamic", dataset_id=dataset_id)
    out = agent.call("result", name="dynamic")
    assert out["read_error"] is None  # DYNAMIC: every element once
    assert collections.Counter(out["elements"]) == collections.Counter(range(n))
    assert set(out["workers"]) <= data_workers

    made = agent.call("strategy", rows=8)
    assert [p["port"] for p in made["ports"].values()] == [None, None]  # no data path
    out = agent.call("train", steps=30, timeout=120)
    assert out["join_error"] is None and out["results"] == list(range(30))
    values = agent.call("values")
    assert (values["counter"], values["table"]) == expected(30)
    for worker, ch in agent.call("channels")["channels"].items():
        assert set(ch.values()) <= {"Channel"}, (worker, ch)
    agent.call("shutdown")
    for proc in net.procs:
        assert "without TLS" not in proc.stderr(), proc.name
