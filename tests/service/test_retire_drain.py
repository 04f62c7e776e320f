"""Retiring data workers loses nothing (issue 26, part 2): real worker processes.

TensorFlow's ``dynamic_sharding_test.py`` (``DynamicShardingTest.testBasic``: a DYNAMIC
epoch visits every element exactly once) re-expressed with workers *leaving* mid-epoch. TF
has no drain: a worker that leaves loses the splits it holds (at-most-once). Here a worker
Dask retires (``client.retire_workers``, ``cluster.scale``, ``Adaptive``) is drained first, so
the epoch stays exactly-once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import dask
import pytest
from _helpers import wait
from distributed import Client, LocalCluster

import dask_dataservice as dds

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

N = 40_000
#: Small buffers (the workers' and the consumer's): an epoch moves only as fast as it is
#: read, so every worker still holds splits (and elements) when the retirement starts.
SMALL = {"dataservice.worker.buffer-elements": 256,
         "dataservice.worker.heartbeat-interval": "200ms",
         "dataservice.client.request-elements": 64,
         "dataservice.client.max-outstanding-batches": 2}


def _retirements(dask_scheduler):
    r = dask_scheduler.extensions["dataservice"].retirements
    return {"drained": dict(r.drained), "draining": sorted(
        dask_scheduler.extensions["dataservice"]._core.draining)}


def _began(client: Client, n: int) -> bool:
    """``n`` workers are draining or drained."""
    r = client.run_on_scheduler(_retirements)
    return len(set(r["draining"]) | set(r["drained"])) == n


def _produced(dask_worker):
    ext = dask_worker.extensions["dataservice"]
    return sum(r.buffer.produced for r in ext.tasks.values() if r is not None)


def _cluster(n: int) -> LocalCluster:
    return LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                        dashboard_address=None, host="127.0.0.1")


class Gate:
    """Consumers that stop after ``pause_at`` elements until released (no sleeps)."""

    def __init__(self, pause_at: int) -> None:
        self.pause_at = pause_at
        self.count = 0
        self.lock = threading.Lock()
        self.paused = threading.Event()
        self.go = threading.Event()

    def step(self) -> None:
        with self.lock:
            self.count += 1
            reached = self.count == self.pause_at
        if reached:
            self.paused.set()
        if self.count >= self.pause_at:
            self.go.wait(60)


def _when_paused(client: Client, gate: Gate, retire: Callable[[], None], n: int) -> None:
    """Once the consumers paused with every worker producing, ``retire()`` ``n`` workers
    (Dask's own call), and let the consumers go on once their drain began, or on any
    failure here (the consumers must not stay paused)."""
    try:
        wait(lambda: gate.paused.is_set(), 60, "the consumers to pause")
        wait(lambda: all(p > 0 for p in client.run(_produced).values()), 30,
             "every worker to produce")
        retire()
        wait(lambda: _began(client, n), 30, "the drain to begin")
    finally:
        gate.go.set()


def _retire_three_while_paused(client: Client, gate: Gate, keep: str) -> threading.Thread:
    """:func:`_when_paused` with ``client.retire_workers`` of all workers but ``keep``, in a
    thread (it returns once they are gone); answers that thread."""
    started: list[threading.Thread] = []

    def retire() -> None:
        others = [a for a in client.scheduler_info()["workers"] if a != keep]
        started.append(threading.Thread(target=client.retire_workers,
                                        kwargs={"workers": others}, name="test-retire",
                                        daemon=True))
        started[0].start()

    _when_paused(client, gate, retire, 3)
    return started[0]


def _read_while(ds, gate: Gate, helper: Callable[[], None]) -> list[int]:
    """Read ``ds`` to its end through ``gate`` while ``helper`` runs in a thread."""
    thread = threading.Thread(target=helper, name="test-helper", daemon=True)
    thread.start()
    seen = []
    for x in ds:
        seen.append(int(x))
        gate.step()
    thread.join(60)
    return seen


def test_retiring_three_of_four_workers_mid_dynamic_epoch_loses_nothing():
    with dask.config.set(SMALL), _cluster(4) as cluster, Client(cluster) as client:
        dds.install(client)
        client.wait_for_workers(4)
        keep = sorted(client.scheduler_info()["workers"])[0]
        ds = dds.Dataset.range(N).apply(dds.distribute("distributed_epoch", client))
        gate = Gate(5_000)
        retiring: list[threading.Thread] = []
        seen = _read_while(ds, gate, lambda: retiring.append(
            _retire_three_while_paused(client, gate, keep)))
        assert retiring, "the retirement did not start"
        retiring[0].join(60)
        assert not retiring[0].is_alive()
        assert len(seen) == N and sorted(seen) == list(range(N))  # 0 duplicates, 0 losses
        assert list(client.scheduler_info()["workers"]) == [keep]
        done = client.run_on_scheduler(_retirements)
        assert len(done["drained"]) == 3 and keep not in done["drained"]
        assert done["draining"] == []


def test_retiring_workers_under_a_named_job_with_two_consumers_loses_nothing():
    with dask.config.set(SMALL), _cluster(4) as cluster, Client(cluster) as client:
        dds.install(client)
        client.wait_for_workers(4)
        keep = sorted(client.scheduler_info()["workers"])[-1]
        gate = Gate(6_000)  # both consumers together
        seen: list[list[int]] = [[], []]
        errors: list[BaseException] = []

        def consume(k: int) -> None:
            try:
                ds = dds.Dataset.range(N).apply(dds.distribute(
                    "distributed_epoch", client, job_name="drain-shared"))
                for x in ds:
                    seen[k].append(int(x))
                    gate.step()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        readers = [threading.Thread(target=consume, args=(k,), daemon=True) for k in (0, 1)]
        for t in readers:
            t.start()
        retiring = _retire_three_while_paused(client, gate, keep)
        for t in readers:
            t.join(90)
        retiring.join(60)
        assert not errors, errors
        both = seen[0] + seen[1]
        assert len(both) == N and sorted(both) == list(range(N))  # shared: each once
        assert seen[0] and seen[1]
        assert list(client.scheduler_info()["workers"]) == [keep]
        assert len(client.run_on_scheduler(_retirements)["drained"]) == 3


def test_scaling_a_local_cluster_down_drains_its_data_workers():
    """``cluster.scale(1)`` (SpecCluster's path to ``retire_workers``) mid-epoch."""
    with dask.config.set(SMALL), _cluster(3) as cluster, Client(cluster) as client:
        dds.install(client)
        client.wait_for_workers(3)
        ds = dds.Dataset.range(N).apply(dds.distribute("distributed_epoch", client))
        gate = Gate(3_000)
        seen = _read_while(ds, gate, lambda: _when_paused(client, gate,
                                                          lambda: cluster.scale(1), 2))
        assert sorted(seen) == list(range(N))
        wait(lambda: len(client.scheduler_info()["workers"]) == 1, 60, "one worker left")
        assert len(client.run_on_scheduler(_retirements)["drained"]) == 2
