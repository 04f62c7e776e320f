"""``Dataset.autocache()``: the data service caches a pipeline read again (issue 26, part 3).

Real in-process clusters (``gen_cluster``). tf.data service has no autocache: this follows
Cachew (USENIX ATC'22), whose autocache decides from measured figures whether to cache and
whether to serve from the cache. Each epoch here must still give every element exactly once
(TF's ``DynamicShardingTest.testBasic`` and ``DataServiceOpsTest.testDistributeBasic`` for
the OFF case, re-expressed with the cache in the pipeline).
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from _helpers import distribute, read

import dask_dataservice as dds
from dask_dataservice.testing import gen_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(90)]

N, SPLIT = 300, 15  # 20 splits


def slow(x):
    """An expensive map: 0.5 ms per element (what autocache is for)."""
    time.sleep(0.0005)
    return x * 2


def caches(c) -> dict:
    """Each worker's autocache status (dds.status()'s figures)."""
    return c.run(lambda dask_worker: dask_worker.extensions["dataservice"].autocache.status())


def totals(status: dict) -> dict:
    out = {"splits": 0, "hits": 0, "computed": 0, "memory_bytes": 0, "disk_bytes": 0}
    for worker in status.values():
        for ds in worker["datasets"].values():
            for k in out:
                out[k] += ds[k]
    return out


def pipeline(force=None):
    return dds.Dataset.range(N).map(slow).autocache(force)


async def epochs(c, ds, mode, n: int, **kw) -> list[dict]:
    """Read ``n`` epochs (a new job each, as a training loop does); the cache totals after
    each. Every epoch gives every element exactly once."""
    after = []
    for _ in range(n):
        dist = await distribute(ds, mode, c, split_size=SPLIT, **kw)
        got = await read(dist)
        assert sorted(got) == [2 * i for i in range(N)]
        after.append(totals(await c.run(lambda dask_worker: dask_worker.extensions[
            "dataservice"].autocache.status())))
    return after


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_second_and_third_epoch_are_served_from_the_cache(c, s, a):
    """One data worker: epoch 1 makes the 20 splits and keeps them in memory; epochs 2 and 3
    make none and serve all 20 from the cache."""
    first, second, third = await epochs(c, pipeline(), "distributed_epoch", 3)
    assert (first["splits"], first["computed"], first["hits"]) == (20, 20, 0)
    assert first["memory_bytes"] > 0 and first["disk_bytes"] == 0
    assert (second["computed"], second["hits"]) == (20, 20)
    assert (third["computed"], third["hits"]) == (20, 40)
    (status,) = (await c.run(lambda dask_worker: dask_worker.extensions[
        "dataservice"].autocache.status())).values()
    (ds,) = status["datasets"].values()
    assert ds["decision"] == "get" and "served from the memory cache" in ds["why"]
    assert ds["produce_us"] > 400  # the sleep is measured, not what comes after
    # dds.status() and the dashboard page show it
    deadline = time.monotonic() + 20  # the dashboard asks a worker once it says it is set up
    while not (st := await dds.status(c))["autocache"]:
        assert time.monotonic() < deadline, "the worker's figures never reached the dashboard"
        await asyncio.sleep(0.05)
    (row,) = st["autocache"].values()
    assert (row["splits"], row["hits"], row["computed"]) == (20, 40, 20)
    assert row["decisions"][a.address]["decision"] == "get"
    page = await c.run_on_scheduler(_autocache_table)
    assert page["splits"] == [20] and page["hits"] == [40]
    assert "served from the memory cache" in page["why"][0]


def _autocache_table(dask_scheduler):
    """The data-service page's autocache table, as the page builds it on the scheduler."""
    from dask_dataservice.dashboard._pages import DataServicePage

    page = DataServicePage(dask_scheduler)
    page.update()
    return dict(page.autocache.data)


def _registry(dask_scheduler):
    """``{split: [workers]}`` of the one cached dataset the dispatcher knows of."""
    cached = dask_scheduler.plugins["dataservice-dispatcher"]._core.hints.cached.splits
    return {i: sorted(w) for splits in cached.values() for i, w in splits.items() if w}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)])
async def test_each_worker_is_handed_the_splits_it_cached(c, s, a, b):
    """Two data workers: each reports what it cached (one-way messages: waited for), the
    dispatcher hands each its own splits first in the next epoch. Every element once per
    epoch. A worker that runs out of its own takes another's, one per request, and makes it
    (7.5 ms) while the other serves its own from memory: most of epoch 2 is served from the
    cache."""
    (first,) = await epochs(c, pipeline(), "distributed_epoch", 1)
    assert (first["computed"], first["splits"]) == (20, 20)
    deadline = time.monotonic() + 20
    while len(held := await c.run_on_scheduler(_registry)) < 20:
        assert time.monotonic() < deadline, f"reports never reached the dispatcher: {held}"
        await asyncio.sleep(0.05)
    assert sorted(held) == list(range(20)) and all(len(w) == 1 for w in held.values()), held
    (second,) = await epochs(c, pipeline(), "distributed_epoch", 1)
    epoch2 = {"hits": second["hits"], "made": second["computed"] - 20}
    assert epoch2["hits"] + epoch2["made"] == 20
    assert epoch2["hits"] >= 5, epoch2


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)],
             config={"dataservice.autocache.memory-limit": 0})
async def test_past_the_memory_limit_splits_are_cached_on_the_workers_disk(c, s, a):
    """With no memory for it, the cache is files under the worker's local directory, read
    back in the next epoch, and removed when the worker closes."""
    first, second = await epochs(c, pipeline(), "distributed_epoch", 2)
    assert (first["splits"], first["memory_bytes"]) == (20, 0) and first["disk_bytes"] > 0
    assert (second["computed"], second["hits"]) == (20, 20)
    folder = os.path.join(a.local_directory, "dds-autocache")
    assert len([f for _, _, fs in os.walk(folder) for f in fs if f.endswith(".pkl")]) == 20
    await a.close()
    assert not os.path.exists(folder)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_off_sharding_caches_the_whole_pass(c, s, a):
    """OFF: the worker reads the whole dataset; the pass is one unit of the cache."""
    first, second = await epochs(c, pipeline(), "off", 2)
    assert (first["splits"], first["computed"]) == (1, 1)
    assert (second["computed"], second["hits"]) == (1, 1)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_autocache_forced_either_way(c, s, a):
    """``force="never"`` keeps nothing, whatever the pipeline costs; ``force="always"``
    caches a pipeline too cheap for the measured decision."""
    (never,) = await epochs(c, pipeline("never"), "distributed_epoch", 1)
    assert (never["splits"], never["computed"]) == (0, 20)
    cheap = dds.Dataset.range(N).map(lambda x: x * 2).autocache("always")
    _, second = await epochs(c, cheap, "distributed_epoch", 2)
    assert second["hits"] == 20


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)],
             config={"dataservice.autocache.force": "never"})
async def test_autocache_config_turns_it_off_and_an_op_overrides_it(c, s, a):
    (off,) = await epochs(c, pipeline(), "distributed_epoch", 1)
    assert off["splits"] == 0
    _, on = await epochs(c, pipeline("always"), "distributed_epoch", 2)
    assert on["hits"] == 20


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_what_comes_after_autocache_runs_every_epoch(c, s, a):
    """A random augmentation after the marker runs each epoch; what is cached is before it."""
    seen = []
    for _ in range(2):
        dist = await distribute(
            pipeline().map(lambda x: (x, os.urandom(4))), "distributed_epoch", c,
            split_size=SPLIT)
        seen.append(dict(await read(dist)))
    assert sorted(seen[0]) == sorted(seen[1]) == [2 * i for i in range(N)]
    assert seen[0] != seen[1]  # augmented anew: 300 draws of 4 random bytes
    assert totals(await caches(c))["hits"] == 20


def test_autocache_checks_what_comes_before_it_and_passes_through_locally():
    ds = dds.Dataset.range(10).map(lambda x: x + 1)
    assert list(ds.autocache()) == list(ds) == list(range(1, 11))
    with pytest.raises(ValueError, match=r"only a source and map, filter, flat_map, interleave, "
                                         r"prefetch, ignore_errors may come before it; found "
                                         r"batch\(\)"):
        ds.batch(2).autocache()
    with pytest.raises(ValueError, match=r"found shuffle\(\)"):
        ds.shuffle(4).map(str).autocache()
    with pytest.raises(ValueError, match="must be 'auto', 'always' or 'never'"):
        ds.autocache("sometimes")
    assert [list(b) for b in ds.autocache().batch(4)] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]


@pytest.mark.process
@pytest.mark.timeout(120)
def test_a_worker_killed_with_its_cache_costs_only_its_splits_made_again():
    """Worker processes: epoch 1 caches every split on the two workers; one worker process is
    killed (SIGKILL; its nanny starts another, with no cache) and the dispatcher forgets what
    it cached. Epoch 2 still gives every element exactly once: the survivor serves its splits
    from its cache, the killed worker's are made again (TF's fault_tolerance_test
    ``testRestartWorker`` under DYNAMIC, with the cache in the pipeline)."""
    import signal

    from _helpers import wait
    from distributed import Client, LocalCluster

    def costly(x):  # nested: sent by value to the worker processes
        time.sleep(0.0005)
        return x * 2

    def registry(dask_scheduler):
        core = dask_scheduler.plugins["dataservice-dispatcher"]._core
        return sorted(core.hints.cached.datasets)

    def status(dask_worker):
        return dask_worker.extensions["dataservice"].autocache.status()

    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        dds.install(client)
        ds = dds.Dataset.range(N).map(costly).autocache()

        def epoch():
            dist = ds.apply(dds.distribute("distributed_epoch", client, split_size=SPLIT))
            assert sorted(dist) == [2 * i for i in range(N)]

        epoch()
        first = client.run(status)
        assert sum(d["splits"] for w in first.values() for d in w["datasets"].values()) == 20
        victim, survivor = sorted(first)
        wait(lambda: registry_has(client, registry, {victim, survivor}), 20,
             "both workers' caches at the dispatcher")
        pid = client.run(os.getpid, workers=[victim])[victim]
        os.kill(pid, signal.SIGKILL)

        def replaced() -> bool:
            # One read of the workers. Two reads could straddle the victim's removal (two
            # workers, then the victim gone) before its replacement joined; epoch 2 then ran
            # on the survivor alone (ci115)
            workers = client.scheduler_info()["workers"]
            return len(workers) == 2 and victim not in workers \
                and victim not in client.run_on_scheduler(registry)

        wait(replaced, 60, "the killed worker replaced and forgotten")
        epoch()
        second = client.run(status)
        hits = {a: sum(d["hits"] for d in w["datasets"].values()) for a, w in second.items()}
        fresh = next(a for a in second if a != survivor)
        assert hits[fresh] == 0 and hits[survivor] >= 1, hits


def registry_has(client, registry, addresses) -> bool:
    return set(client.run_on_scheduler(registry)) >= addresses
