"""The multi-host tier's own checks: hosts that are namespaces, reached only by address."""

from __future__ import annotations

import collections
import subprocess

import pytest

pytestmark = [pytest.mark.process, pytest.mark.multihost, pytest.mark.timeout(120)]


def test_hosts_reach_each_other_and_leave_nothing_behind(net):
    """Three hosts on one bridge: a DYNAMIC read across them sees every element once; the
    namespaces exist during the test and are gone after ``close``."""
    s, w, c = net.host("sched"), net.host("w1"), net.host("c")
    address = net.scheduler(s)
    net.worker(w, address, "w1", env={"DDS_HOST": "w1"})
    agent = net.agent(c, address, "consumer")
    assert agent.call("workers", n=1)["workers"] == {f"tcp://{w.addr}:9000": "w1"}
    dataset_id = agent.call("register", kind="range", n=5000)["dataset_id"]
    agent.call("read", name="r", dataset_id=dataset_id)
    out = agent.call("result", name="r")
    assert out["read_error"] is None
    assert collections.Counter(out["elements"]) == collections.Counter(range(5000))
    assert out["workers"] == {f"tcp://{w.addr}:9000": 5000}
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert all(h.ns in listed for h in (s, w, c)) and net.bridge_ns in listed
    namespaces = [net.bridge_ns, s.ns, w.ns, c.ns]
    net.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [ns for ns in namespaces if ns in listed], listed
