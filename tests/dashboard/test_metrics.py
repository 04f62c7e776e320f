"""Counters with time series (service/protocol/_metrics.py) and the dataservice_* Prometheus metrics,
read from the scheduler's and workers' real ``/metrics`` endpoints and checked by value."""

from __future__ import annotations

import asyncio
import re
import urllib.request

import dask
import numpy as np
import pytest
from _helpers import PS, WK, distribute, in_thread, poll, read, train_counter, wait

import dask_dataservice as dds
from dask_dataservice.dashboard import PLUGIN_NAME
from dask_dataservice.service.client import _install_async
from dask_dataservice.service.protocol import _metrics
from dask_dataservice.service.protocol._metrics import RateSeries, ReadStats
from dask_dataservice.testing import gen_cluster
from dask_dataservice.testing._ps import warm_up_zarr

pytestmark = [pytest.mark.pure, pytest.mark.timeout(90)]

# zarr runs its I/O on process-wide daemon threads; start them all before gen_cluster's
# thread-leak check takes its snapshot.
warm_up_zarr()

FAST = {"dataservice.dashboard.interval": "50ms"}


# RateSeries / ReadStats -------------------------------------------------------------------
def test_rate_series_rates_over_a_window():
    s = RateSeries(maxlen=10)
    assert s.rate() == 0.0 and s.rates() == [] and s.total == 0.0
    for t, v in [(0, 0), (1, 10), (2, 30), (3, 60), (4, 100)]:
        s.add(float(t), v)
    assert s.total == 100.0
    assert s.rates() == [(1.0, 10.0), (2.0, 20.0), (3.0, 30.0), (4.0, 40.0)]
    assert s.rate(window=1.0) == 40.0
    assert s.rate(window=2.0) == 35.0
    assert s.rate(window=100.0) == 25.0


def test_rate_series_restarted_counter_and_same_instant():
    s = RateSeries()
    s.add(0.0, 50)
    s.add(1.0, 70)
    s.add(2.0, 5)  # the counter restarted (a worker came back): no negative rate
    assert s.rates() == [] and s.rate() == 0.0
    s.add(3.0, 15)
    s.add(3.0, 25)  # the same instant again: the newest value wins
    assert s.rates() == [(3.0, 20.0)]


def test_rate_series_keeps_maxlen_samples_and_rejects_a_tiny_one():
    s = RateSeries(maxlen=3)
    for t in range(10):
        s.add(float(t), 2 * t)
    assert s.rates() == [(8.0, 2.0), (9.0, 2.0)]
    with pytest.raises(ValueError, match="maxlen must be at least 2, got 1"):
        RateSeries(maxlen=1)


def test_read_stats_times_waits_and_the_consumers_work(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(_metrics.time, "perf_counter", lambda: now[0])

    def produce():
        for x in range(3):
            now[0] += 2.0  # the service takes 2 s per element (a batch of one)
            yield [x]

    stats = ReadStats()
    for _ in stats.wrap(produce()):
        now[0] += 5.0  # the consumer works 5 s per element
    snap = stats.snapshot()
    assert snap["elements"] == 3 and snap["passes"] == 1
    assert snap["wait_seconds"] == 6.0
    assert snap["compute_seconds"] == 15.0  # three elements, each followed by 5 s of work
    assert snap["wait_fraction"] == pytest.approx(6 / 21)
    assert snap["elapsed_seconds"] == 21.0
    assert snap["elements_per_second"] == pytest.approx(3 / 21)


def test_read_stats_times_batches_and_counts_what_the_consumer_took(monkeypatch):
    """Timed per batch (issue 22: no clock per element): a batch's wait is the service's, the
    time until the next batch is asked for the consumer's; a consumer that stops inside a
    batch counts the elements it took, the one it holds included."""
    now = [0.0]
    monkeypatch.setattr(_metrics.time, "perf_counter", lambda: now[0])

    def produce():
        for b in range(3):
            now[0] += 3.0  # the service takes 3 s per batch of four
            yield list(range(4 * b, 4 * b + 4))

    stats = ReadStats()
    it = stats.wrap(produce())
    got = []
    for _ in range(6):
        got.append(next(it))
        now[0] += 1.0  # the consumer works 1 s per element
    assert got == [0, 1, 2, 3, 4, 5]
    assert stats.snapshot()["elements"] == 4  # the first batch; the second is being read
    it.close()  # in the second batch, holding its second element
    snap = stats.snapshot()
    assert snap["elements"] == 6 and snap["passes"] == 1
    assert snap["wait_seconds"] == 6.0 and snap["compute_seconds"] == 6.0
    assert snap["elapsed_seconds"] == 12.0 and snap["wait_fraction"] == 0.5
    # the whole pass, again: every element counted, the final wait too
    for _ in stats.wrap(produce()):
        now[0] += 1.0
    snap = stats.snapshot()
    assert snap["elements"] == 6 + 12 and snap["passes"] == 2
    assert snap["wait_seconds"] == 6.0 + 9.0 and snap["compute_seconds"] == 6.0 + 12.0


def test_read_stats_awrap_counts_what_the_consumer_took():
    async def produce():
        for b in range(3):
            yield list(range(4 * b, 4 * b + 4))

    async def main():
        stats = ReadStats()
        assert [x async for x in stats.awrap(produce())] == list(range(12))
        it = stats.awrap(produce())
        assert [await anext(it) for _ in range(5)] == [0, 1, 2, 3, 4]
        await it.aclose()
        return stats.snapshot()

    snap = asyncio.run(main())
    assert snap["elements"] == 12 + 5 and snap["passes"] == 2


def test_read_stats_closes_the_read_when_the_consumer_stops():
    closed = []

    def produce():
        try:
            for b in range(100):
                yield [2 * b, 2 * b + 1]
        finally:
            closed.append(True)

    stats = ReadStats()
    it = stats.wrap(produce())
    assert [next(it), next(it), next(it)] == [0, 1, 2]
    it.close()
    assert closed == [True]
    assert stats.snapshot()["elements"] == 3
    stats.received("tcp://a:1", 5, 40)
    stats.received("tcp://a:1", 2, 16)
    assert stats.snapshot()["workers"] == {"tcp://a:1": {"elements": 7, "bytes": 56,
                                                         "batches": 2}}


# /metrics by value ------------------------------------------------------------------------
def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        return r.read().decode()


def _value(text: str, name: str, **labels: str) -> float:
    """The one sample of ``name`` whose labels include ``labels``."""
    found = []
    for line in text.splitlines():
        m = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            found.append(float(m.group(2)))
    assert len(found) == 1, f"{name} {labels}: {found}"
    return found[0]


@pytest.mark.cluster
@gen_cluster(client=True, nthreads=[WK, WK], scheduler_kwargs={"dashboard_address": ":0"},
             worker_kwargs={"dashboard_address": ":0"}, config=FAST)
async def test_prometheus_scheduler_and_workers_by_value(c, s, a, b):
    n = 3000
    await _install_async(c)
    plugin = s.plugins[PLUGIN_NAME]
    ds = await distribute(dds.Dataset.range(n), "DYNAMIC", c)
    assert sorted(await read(ds)) == list(range(n))
    # a worker that served nothing (DYNAMIC: the other took every split) has no count yet
    served = {w.address: w.plugins["dataservice-worker"].stats.get("elements_served", 0)
              for w in (a, b)}
    assert sum(served.values()) == n
    await poll(lambda: sum(f["data"]["stats"].get("elements_served", 0)
                           for f in plugin.workers.values()) == n, what="a poll after the read")
    text = await asyncio.to_thread(_scrape, s.http_server.port)
    for w in (a, b):
        assert _value(text, "dataservice_elements_served_total", worker=w.address) == \
            served[w.address]
        assert _value(text, "dataservice_bytes_served_total", worker=w.address) == \
            8 * served[w.address]  # int64 scalars count 8 bytes each
    assert _value(text, "dataservice_datasets", scheduler=s.address) == 1
    for w in (a, b):
        wtext = await asyncio.to_thread(_scrape, w.http_server.port)
        assert _value(wtext, "dataservice_worker_elements_served_total", worker=w.address) == \
            served[w.address]
        assert _value(wtext, "dataservice_worker_bytes_served_total", worker=w.address) == \
            8 * served[w.address]
        assert _value(wtext, "dataservice_worker_plugin_cpu_seconds_total", worker=w.address) >= 0


@pytest.mark.cluster
@gen_cluster(client=True, nthreads=[PS, WK], scheduler_kwargs={"dashboard_address": ":0"},
             config=FAST)
async def test_prometheus_parameter_servers_and_training_steps(c, s, ps, wk):
    await _install_async(c)
    plugin = s.plugins[PLUGIN_NAME]

    def train(client):
        _, counter = train_counter(client, 7)
        # the coordinator reports its queue to the dashboard (every membership interval)
        wait(lambda: [(c["queued"], c["finished"]) for c in
                      dds.status(client)["coordinators"].values()] == [(0, 7)],
             what="the coordinator's report")
        return int(counter.numpy())

    assert await in_thread(s, train) == 7
    server = ps.plugins["dataservice-ps"]
    updates = server.stats["updates"]
    assert updates == 7
    await poll(lambda: (plugin.workers.get(ps.address, {}).get("ps") or {}).get(
        "stats", {}).get("updates") == updates, what="a poll after training")
    await poll(lambda: (plugin.workers.get(wk.address, {}).get("runner") or {}).get(
        "stats", {}).get("closures") == 7, what="the runner's steps")
    text = await asyncio.to_thread(_scrape, s.http_server.port)
    assert _value(text, "dataservice_ps_updates_total", worker=ps.address) == 7
    assert _value(text, "dataservice_ps_duplicates_dropped_total", worker=ps.address) == \
        server.stats["skipped"]
    assert _value(text, "dataservice_training_steps_total", worker=wk.address) == 7
    st = plugin.status()
    [shard] = st["parameter_servers"][ps.address]["shards"].items()
    assert shard[0].endswith("/counter") and shard[1]["bytes"] == 8 and shard[1]["rows"] == 1
    assert shard[1]["updates"] == 7 and shard[1]["gathers"] == 0  # per shard


@pytest.mark.cluster
def test_journal_metrics_by_value(tmp_path):
    """Fault-tolerant mode: journal records and fsyncs on /metrics equal the writer's counts."""
    from distributed import Client, LocalCluster

    with dask.config.set({**FAST, "dataservice.dispatcher.fault-tolerant-mode": True,
                          "dataservice.dispatcher.work-dir": str(tmp_path)}), \
            LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                         dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        dds.install(client)
        ds = dds.Dataset.range(100).apply(dds.distribute("DYNAMIC", client))
        assert sorted(ds) == list(range(100))
        s = cluster.scheduler
        writer = s.plugins["dataservice-dispatcher"]._journal
        plugin = s.plugins[PLUGIN_NAME]
        records = writer.metrics.records_written
        assert records > 0
        polls = plugin.polls
        deadline_polls = polls + 3

        def polled() -> bool:
            return plugin.polls >= deadline_polls

        import time

        end = time.monotonic() + 20
        while not polled():
            assert time.monotonic() < end, "no dashboard poll"
            time.sleep(0.02)
        before = (writer.metrics.records_written, writer.metrics.fsyncs)
        text = _scrape(s.http_server.port)
        after = (writer.metrics.records_written, writer.metrics.fsyncs)
        assert before[0] <= _value(text, "dataservice_journal_records_total") <= after[0]
        assert before[1] <= _value(text, "dataservice_journal_fsyncs_total") <= after[1]
        latency = _value(text, "dataservice_journal_last_fsync_seconds")
        assert 0 < latency < 10


@pytest.mark.cluster
@gen_cluster(client=True, nthreads=[WK], config=FAST)
async def test_plugin_thread_cpu_reaches_dasks_worker_metrics(c, s, a):
    """The service's thread CPU time goes to Dask's fine performance metrics (Linux)."""
    from dask_dataservice.dashboard._worker import DIGEST_KEY, FIGURES_READY, plugin_cpu_seconds

    if plugin_cpu_seconds() is None:
        pytest.skip("no /proc: thread CPU time is Linux only")
    await _install_async(c)
    # the dashboard polls the worker (and reads its threads' CPU) once a heartbeat said its
    # figures are ready; a thread's CPU is read while it lives, so the read starts after that
    await poll(lambda: s.workers[a.address].metrics.get(FIGURES_READY), timeout=30,
               what="the worker's figures ready")

    def burn(x):
        return float(np.linalg.norm(np.random.default_rng(x).random((120, 120)) @ np.eye(120)))

    ds = await distribute(dds.Dataset.range(400).map(burn), "DYNAMIC", c)
    assert len(await read(ds)) == 400
    await poll(lambda: s.cumulative_worker_metrics.get(DIGEST_KEY, 0) > 0, timeout=30,
               what="the digest in a worker heartbeat")
    plugin = s.plugins[PLUGIN_NAME]
    assert plugin.workers[a.address]["plugin_cpu_seconds"] > 0
