"""``dds.status(client)``, ``/dataservice/status.json`` and ``DistributedDataset.stats()``,
checked by value on real clusters: the counts must equal what the workers served."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import dask
import numpy as np
import pytest
from _helpers import PS, WK, in_thread, poll, train_counter, wait
from distributed import Client, LocalCluster

import dask_dataservice as dds
from dask_dataservice.dashboard import PLUGIN_NAME
from dask_dataservice.dashboard._worker import FIGURES_READY
from dask_dataservice.service.client import _install_async
from dask_dataservice.testing import gen_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

FAST = {"dataservice.dashboard.interval": "50ms"}
#: Holds a pipeline's elements until a test has looked at a running job (module level: the
#: in-process workers run the pickled-by-reference function in this process).
GATE = threading.Event()


def gated(x):
    if x >= 500:
        GATE.wait(60)
    return x


@pytest.fixture
def cluster():
    with dask.config.set(FAST), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                         dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        dds.install(client)
        yield cluster, client


def _json(cluster) -> dict:
    port = cluster.scheduler.http_server.port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/dataservice/status.json",
                                timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"] == "application/json"
        return json.loads(r.read())


def _served(cluster) -> dict[str, int]:
    return {a: w.plugins["dataservice-worker"].stats.get("elements_served", 0)
            for a, w in cluster.scheduler.workers.items()
            for w in [next(x for x in cluster.workers.values() if x.address == a)]}


def _polled_after(cluster, check) -> dict:
    """dds.status once the dashboard has polled the state ``check`` waits for."""
    plugin = cluster.scheduler.plugins[PLUGIN_NAME]
    # the dashboard polls a worker once a heartbeat said its figures handler is set up
    wait(lambda: all(ws.metrics.get(FIGURES_READY) for ws in cluster.scheduler.workers.values()),
         what="every worker's heartbeat saying its figures are ready")
    start = plugin.polls
    wait(lambda: plugin.polls >= start + 2, what="two dashboard polls")
    return check()


def test_status_and_stats_count_exactly_what_each_worker_served(cluster):
    cluster, client = cluster
    n = 5000
    ds = dds.Dataset.range(n).apply(dds.distribute("DYNAMIC", client))
    assert sorted(ds) == list(range(n))
    served = _served(cluster)
    assert sum(served.values()) == n
    stats = ds.stats()
    assert stats["elements"] == n and stats["passes"] == 1
    assert {a: w["elements"] for a, w in stats["workers"].items()} == \
        {a: v for a, v in served.items() if v}  # a worker that served nothing is not listed
    st = _polled_after(cluster, lambda: dds.status(client))
    assert {a: w["elements_served"] for a, w in st["workers"].items()} == served
    assert {a: w["bytes_served"] for a, w in st["workers"].items()} == \
        {a: 8 * v for a, v in served.items()}
    assert all(w["data_worker"] for w in st["workers"].values())
    assert st["service"]["installed"] and [d["num_splits"] for d in st["service"]["datasets"]]
    assert st["scheduler"] == cluster.scheduler.address
    # the JSON route has the same figures
    js = _json(cluster)
    assert {a: w["elements_served"] for a, w in js["workers"].items()} == served
    assert set(js) == set(st)
    assert len(js["timeline"]["time"]) == len(js["timeline"]["elements_per_second"]) > 1
    assert max(js["timeline"]["elements_per_second"]) >= 0


def test_running_job_progress_consumers_and_throughput(cluster):
    cluster, client = cluster
    GATE.clear()
    ds = dds.Dataset.range(1000).map(gated).apply(
        dds.distribute("DYNAMIC", client, job_name="shared", split_size=50))
    it = iter(ds)
    try:
        got = [next(it) for _ in range(10)]
        assert sorted(got) == sorted(set(got))

        def job_seen():
            st = dds.status(client)
            jobs = st["service"]["jobs"]
            return st if jobs and jobs[0]["elements_served"] >= 10 else None

        wait(lambda: job_seen() is not None, what="the job's figures")
        st = job_seen()
        [job] = st["service"]["jobs"]
        assert job["mode"] == "DYNAMIC" and job["consumers"] == 1
        assert "name" not in job and "dataset_id" not in job  # issue 22: no names, no ids
        assert "shared" not in repr(st)
        [iteration] = job["iterations"]
        assert iteration["splits_total"] == 20
        # elements >= 500 wait behind GATE: splits are handed out ahead (all 20 maybe), and
        # the ones a pipeline still holds are not done
        assert 1 <= iteration["splits_handed_out"] <= 20
        assert 0 <= iteration["splits_done"] < iteration["splits_handed_out"]
        assert not iteration["finished"]
        [consumer] = st["service"]["consumers"]
        assert consumer["job_id"] == job["job_id"]
        assert 0 <= consumer["seconds_since_heartbeat"] < 30
        assert st["service"]["journal"] is None  # not fault tolerant
    finally:
        GATE.set()
        rest = list(it)
    assert sorted(got + rest) == list(range(1000))


def test_off_mode_progress_counts_elements(cluster):
    cluster, client = cluster
    ds = dds.Dataset.range(300).apply(dds.distribute("OFF", client, job_name="off"))
    it = iter(ds)
    try:
        first = [next(it) for _ in range(10)]
        assert len(first) == 10

        def produced():
            jobs = dds.status(client)["service"]["jobs"]
            return jobs[0]["elements_produced"] if jobs else 0

        wait(lambda: produced() > 0, what="elements produced")
        [job] = dds.status(client)["service"]["jobs"]
        assert job["mode"] == "OFF" and "splits_done" not in job["iterations"][0]
        assert job["elements_produced"] <= 2 * 300  # two workers, each the whole dataset
    finally:
        it.close()


def test_stats_wait_versus_compute():
    """The consumer's own work shows as compute time, not as time waiting on the service."""
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        ds = dds.Dataset.range(40).apply(dds.distribute("DYNAMIC", client))
        work = 0.0
        out = []
        for x in ds:
            t = time.perf_counter()
            a = np.random.default_rng(int(x)).random((200, 200))
            for _ in range(5):
                a = a @ a / 200.0  # the consumer's "training step"
            work += time.perf_counter() - t
            out.append(int(x))
        assert sorted(out) == list(range(40))
        stats = ds.stats()
        assert stats["elements"] == 40
        assert stats["compute_seconds"] >= work  # at least the measured work
        assert stats["compute_seconds"] <= work + 1.0  # and little else (loop overhead)
        assert stats["wait_seconds"] > 0 and 0 < stats["wait_fraction"] < 1
        assert stats["elements_per_second"] > 0


@pytest.mark.pure
def test_status_rejects_a_bad_service():
    with pytest.raises(TypeError, match="service must be a distributed.Client or a scheduler"):
        dds.status(42)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], config=FAST)
async def test_status_with_an_asynchronous_client(c, s, a):
    st = await dds.status(c)  # installs the service on first use, as every entry point
    assert st["service"]["installed"] is True and st["scheduler"] == s.address
    assert st["service"]["jobs"] == [] and st["service"]["datasets"] == []
    await poll(lambda: a.address in s.plugins[PLUGIN_NAME].workers, what="a first poll")
    st = await dds.status(c)
    assert st["workers"][a.address]["elements_served"] == 0
    assert st["workers"][a.address]["data_worker"] is True


def test_a_bad_dashboard_interval_is_a_clear_error():
    with dask.config.set({"dataservice.dashboard.interval": "0s"}), \
            LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                         dashboard_address=None) as cluster, Client(cluster) as client:
        with pytest.raises(ValueError, match=r"dataservice.dashboard.interval must be > 0 and "
                                             r".history >= 2, got 0.0 and 600"):
            dds.install(client)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)], config=FAST)
async def test_stats_of_an_async_for_read(c, s, a, b):
    ds = await dds.distribute("DYNAMIC", c)(dds.Dataset.range(3000))
    got = [int(x) async for x in ds]
    assert sorted(got) == list(range(3000))
    stats = ds.stats()
    assert stats["elements"] == 3000 and stats["passes"] == 1
    served = {w.address: w.plugins["dataservice-worker"].stats.get("elements_served", 0)
              for w in (a, b)}
    assert {addr: w["elements"] for addr, w in stats["workers"].items()} == \
        {addr: n for addr, n in served.items() if n}


def _train_a_little(client) -> int:
    return int(train_counter(client, 30)[1].read_value())


@gen_cluster(client=True, nthreads=[PS, WK],
             config={"dataservice.dashboard.interval": "1 hour"})  # polls only when asked
async def test_training_between_two_polls_shows_in_status(c, s, ps, w):
    """Training that starts and ends between two polls of the dashboard (a short run, a fast
    machine) shows its steps/s in ``dds.status()``: the call takes a poll of its own, and the
    first poll that sees a training worker's runner counts it from zero at the poll before,
    when it had none (the notebook's plot of steps/s was sometimes empty)."""
    await _install_async(c)
    plugin = s.plugins[PLUGIN_NAME]
    await poll(lambda: w.address in s.workers and s.workers[w.address].metrics.get(FIGURES_READY),
               what="the worker's figures")
    await plugin.poll()
    assert w.address in plugin.workers and plugin.workers[w.address].get("runner") is None
    polls = plugin.polls
    assert await in_thread(s, _train_a_little) == 30
    status = await dds.status(c)
    assert status["polls"] == polls + 1  # the call's own poll, nothing periodic in between
    assert status["training_workers"][w.address]["stats"]["closures"] == 30
    assert status["training_workers"][w.address]["steps_per_second"] > 0
    assert status["totals"]["steps_per_second"] > 0
