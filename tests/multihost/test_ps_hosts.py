"""Parameter servers on hosts of their own (``dataservice.ps.fast-path``, docs/parameter-server.md
"The PS data path").

Two PSs and two training workers, each on its own host, the coordinator on a fifth. The data
path of the second PS is blocked (its TCP port drops every packet, as a firewall that lets
only Dask's ports through): the training workers reach the first PS over its data path
(``SocketChannel``) and the second over distributed's comms (``Channel``) after a warning, and
training is exact on both (``cluster_coordinator_test.testScheduleAndJoin``-style: every
scheduled step once, the values every step adds).
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.process, pytest.mark.multihost, pytest.mark.timeout(120)]

ROWS = 8
#: Training workers give up connecting to a blocked data path after this long.
WORKER_ENV = {"DASK_DATASERVICE__PS__CONNECT_TIMEOUT": "2s"}


def expected(steps: int) -> tuple[int, list[list[float]]]:
    """The counter and the table after steps ``0 .. steps - 1``, each exactly once."""
    table = [[0.0, 0.0] for _ in range(ROWS)]
    for i in range(steps):
        table[i % ROWS][0] += 1.0
        table[i % ROWS][1] += float(i)
    return steps, table


def ps_cluster(net, env=None, tls=None):
    """Scheduler, two PSs, two training workers, each a host; the coordinator's agent."""
    s = net.host("sched")
    address = net.scheduler(s, tls=tls)
    for name in ("ps1", "ps2"):
        net.worker(net.host(name), address, name, "--resources", "ps=1", tls=tls,
                   env={"DDS_HOST": name})
    for name in ("t1", "t2"):
        net.worker(net.host(name), address, name, tls=tls,
                   env={"DDS_HOST": name, **WORKER_ENV, **(env or {})})
    agent = net.agent(net.host("c"), address, "coordinator", tls=tls)
    agent.call("workers", n=4)
    return address, agent


@pytest.mark.slow
def test_ps_data_path_across_hosts_and_its_fallback_when_blocked(net):
    _, agent = ps_cluster(net)
    made = agent.call("strategy", rows=ROWS)
    ps1, ps2 = made["ps"]
    assert made["placement"] == {"counter": ps1, "table": ps2}
    port = made["ports"][ps2]
    assert port["host"] == net.hosts["ps2"].addr and port["port"]
    net.block(net.hosts["ps2"], port["port"])

    out = agent.call("train", steps=40, timeout=120)
    assert out["join_error"] is None
    assert out["results"] == list(range(40))
    values = agent.call("values")
    assert (values["counter"], values["table"]) == expected(40)

    channels = agent.call("channels")["channels"]
    used = {w: ch for w, ch in channels.items() if ch}
    assert used, channels
    for worker, ch in used.items():  # the data path to ps1, Dask's comms to the blocked ps2
        assert ch == {ps1: "SocketChannel", ps2: "Channel"}, (worker, ch)
    warned = [p for p in net.procs if p.name.startswith("t")
              and f"the data path of parameter server {ps2}" in p.stderr()]
    assert len(warned) == len(used), [p.name for p in warned]

    # unblocked, the channels stay as they are and training goes on, exact
    net.unblock(net.hosts["ps2"], port["port"])
    out = agent.call("train", steps=24, start=40, timeout=120)
    assert out["join_error"] is None and out["results"] == list(range(40, 64))
    values = agent.call("values")
    assert (values["counter"], values["table"]) == expected(64)
    agent.call("shutdown")
