"""TensorFlow's tf.data service scenarios, re-expressed in this package's API on real clusters.

Each test names the TensorFlow test it re-expresses (``fault_tolerance_test.py`` and
``data_service_ops_test.py`` under ``tensorflow/python/data/experimental/kernel_tests/service``)
and asserts TensorFlow's semantics: which elements the reader sees, how many times, and what
the dispatcher keeps. Clusters are in-process (``gen_cluster``) unless a worker must really
restart (then Nanny processes). The blocking reader runs in a thread (``asyncio.to_thread``):
the test's event loop is the client's loop.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os

import pytest
from _helpers import distribute, free_port, poll
from distributed import Nanny, Worker

import dask_dataservice as dds
from dask_dataservice.service.dispatcher.plugin import PLUGIN_NAME
from dask_dataservice.testing import gen_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]

#: TensorFlow's size for the restart and add-worker scenarios: ``2 * cpu_count() + 100``
#: (more than a worker's prefetch, so the reader is mid-range when the cluster changes).
NUM_ELEMENTS = 2 * (os.cpu_count() or 1) + 100


async def take(it, n: int) -> list[int]:
    """``n`` calls of ``next(it)`` in a thread (the loop stays free); the reader must not end
    before."""
    def body() -> list[int]:
        out = []
        for _ in range(n):
            try:
                out.append(int(next(it)))
            except StopIteration:
                raise AssertionError(f"the reader ended after {len(out)} of {n} elements") from None
        return out

    return await asyncio.to_thread(body)


async def rest(it) -> list[int]:
    """Everything ``it`` still yields, in a thread."""
    return await asyncio.to_thread(lambda: [int(x) for x in it])


def registered_workers(s) -> int:
    return len(s.plugins[PLUGIN_NAME].state.list_workers())


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_add_worker_mid_job_OFF(c, s, a):
    """Re-expresses fault_tolerance_test.testAddWorkerMidJob: under OFF ("parallel_epochs")
    a worker added after half of ``range(n)`` was read produces its own full copy, so the
    reader gets every element twice overall."""
    n = NUM_ELEMENTS
    ds = await distribute(dds.Dataset.range(n), "parallel_epochs", c)
    it = await asyncio.to_thread(iter, ds)
    results = await take(it, n // 2)
    async with Worker(s.address, nthreads=1):
        await poll(lambda: registered_workers(s) == 2, what="the new worker to register")
        results += await rest(it)
    assert collections.Counter(results) == collections.Counter({i: 2 for i in range(n)})


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.parametrize("use_same_port", [True, False])
@pytest.mark.parametrize("fault_tolerant_mode", [False, True])
def test_restart_worker(tmp_path, fault_tolerant_mode, use_same_port):
    """Re-expresses fault_tolerance_test.testRestartWorker (both ``use_same_port`` and
    ``fault_tolerant_mode`` values): the only data worker's process restarts (a Nanny restart:
    a fresh process, with nothing of the old one's tasks) after half of ``range(n)`` was read.
    The reader may still get what it had prefetched from the old process, then it gets the
    restarted worker's own full copy, from 0."""
    port = free_port() if use_same_port else 0
    config = {"distributed.scheduler.allowed-failures": 10}
    if fault_tolerant_mode:
        config.update({"dataservice.dispatcher.fault-tolerant-mode": True,
                       "dataservice.dispatcher.work-dir": str(tmp_path)})

    @gen_cluster(client=True, Worker=Nanny, timeout=60, config=config,
                 nthreads=[("127.0.0.1", 1, {"worker_port": port} if port else {})])
    async def run(c, s, a):
        n = NUM_ELEMENTS
        ds = await distribute(dds.Dataset.range(n), "parallel_epochs", c)
        it = await asyncio.to_thread(iter, ds)
        midpoint = n // 2
        assert await take(it, midpoint) == list(range(midpoint))
        old = a.worker_address
        await a.restart()
        # the restarted worker registered with the dispatcher and has its task (TensorFlow's
        # restart returns once the new server registered)
        plugin = s.plugins[PLUGIN_NAME]
        (iteration,) = plugin.state.list_iterations()
        await poll(lambda: len(plugin.state.tasks_for_iteration(iteration.iteration_id)) == 2,
                   timeout=30, what="the restarted worker's task")
        assert (a.worker_address == old) is use_same_port
        # elements prefetched from the old process may come first
        prefetched = await asyncio.to_thread(
            lambda: list(itertools.takewhile(lambda v: v != 0, (int(x) for x in it))))
        assert prefetched == list(range(midpoint, midpoint + len(prefetched)))
        # the dataset starts over now that the reader reads from the restarted worker
        assert await take(it, n // 2 - 1) == list(range(1, n // 2))
        await asyncio.to_thread(it.close)

    run()


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_shared_job_name(c, s, a):
    """Re-expresses data_service_ops_test.testSharedJobName: two datasets built the same way,
    ``range(1000).shuffle(1000)``, read one named job; their consumers alternate ``next()``
    for 200 rounds each, then each reads to its end: together they see every element
    exactly once."""
    n = 1000

    def make_ds():
        return dds.Dataset.range(n).shuffle(n)

    ds1 = await distribute(make_ds(), "parallel_epochs", c, job_name="job_name")
    ds2 = await distribute(make_ds(), "parallel_epochs", c, job_name="job_name")

    def alternate():
        it1, it2 = iter(ds1), iter(ds2)
        results = []
        for i in range(n // 5):
            for name, it in (("first", it1), ("second", it2)):
                x = next(it, None)
                assert x is not None, f"the {name} consumer ended at its call {i + 1}"
                results.append(int(x))
        results += [int(x) for x in it1]
        results += [int(x) for x in it2]
        return results

    results = await asyncio.to_thread(alternate)
    assert sorted(results) == list(range(n))


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_shared_job_consumer_that_read_fast_holds_little_when_it_pauses(c, s, a):
    """What ``test_shared_job_name`` needs, made deterministic: a consumer of a shared job
    that read fast (its channel empty at every batch) and then pauses holds at most its batch
    in hand, its channel and its requests in flight at the smallest request size (11 x 16
    elements with the defaults), not about as many as it read: its requests used to double
    at every batch it took (16, 32, ... 1024 after 2,000 elements), so once the other
    consumer of a 1,000-element job waited on its own reader for a moment, the second held
    the rest of the job and the first ended at its 193rd call."""
    n, fast = 10_000, 2_000
    ds1 = await distribute(dds.Dataset.range(n), "parallel_epochs", c, job_name="job_name")
    ds2 = await distribute(dds.Dataset.range(n), "parallel_epochs", c, job_name="job_name")

    def body():
        it1, it2 = iter(ds1), iter(ds2)
        first = [int(next(it1))]  # the first consumer reads the job, then pauses
        second = [int(x) for x in itertools.islice(it2, fast)]  # the second reads fast
        rest1 = [int(x) for x in it1]  # the first reads on to the end
        return first, second, rest1, [int(x) for x in it2]  # what the second held

    first, second, rest1, held = await asyncio.to_thread(body)
    assert sorted(first + second + rest1 + held) == list(range(n))
    assert len(second) == fast
    assert len(held) <= (1 + 8 + 2) * 16, len(held)  # in hand, channel, requests in flight


@gen_cluster(client=True, nthreads=[("", 1)],
             config={"dataservice.dispatcher.job-gc-timeout": "20ms",
                     "dataservice.dispatcher.gc-interval": "50ms"})
async def test_dont_gc_jobs_with_visitation_guarantees(c, s, a):
    """Re-expresses data_service_ops_test.testDontGcJobsWithVisitationGuarantees: with job
    GC at 50 ms intervals and a 20 ms timeout, an OFF job's iteration with no client left is
    collected, and a DYNAMIC one's is kept (it promises each element once: a consumer coming
    back under its name goes on where it stopped). Each iterator takes one element (the
    reader acquires its iteration on the first ``next()``; TensorFlow's at ``iter()``)."""
    n = 1000
    dataset_id = await asyncio.to_thread(dds.register_dataset, c, dds.Dataset.range(n))
    ds1 = dds.from_dataset_id("parallel_epochs", c, dataset_id, job_name="test1")
    ds2 = dds.from_dataset_id("distributed_epoch", c, dataset_id, job_name="test2")
    it1, it2 = await asyncio.to_thread(iter, ds1), await asyncio.to_thread(iter, ds2)
    first = await take(it1, 1) + await take(it2, 1)
    worker = a.extensions["dataservice"]
    assert len(worker.tasks) == 2
    await asyncio.to_thread(it1.close)
    await asyncio.to_thread(it2.close)
    plugin = s.plugins[PLUGIN_NAME]
    off = plugin.state.job_by_name("test1")
    dyn = plugin.state.job_by_name("test2")
    # only the OFF job is collected
    await poll(lambda: plugin.state.job(off.job_id).status == "garbage_collected",
               what="the OFF job's GC")
    await poll(lambda: len(worker.tasks) == 1, what="the OFF job's task to be dropped")
    (dyn_iteration,) = [it for it in plugin.state.list_iterations() if it.job_id == dyn.job_id]
    assert set(worker.tasks) == {
        t.task_id for t in plugin.state.tasks_for_iteration(dyn_iteration.iteration_id)}
    # ... and the DYNAMIC one is still there after more GC rounds: a consumer under its name
    # goes on where the first one stopped (what that one took from the worker, its element
    # and its read-ahead, is not served again: at most once), not over from the start
    rounds = plugin.gc_rounds
    await poll(lambda: plugin.gc_rounds >= rounds + 3, what="three more GC rounds")
    assert plugin.state.job(dyn.job_id).status == "live"
    again = dds.from_dataset_id("distributed_epoch", c, dataset_id, job_name="test2")
    rest_ = [int(x) for x in await asyncio.to_thread(list, again)]
    assert len(rest_) == len(set(rest_)) and set(rest_) <= set(range(n))
    assert first[1] not in rest_
    assert len(rest_) >= n - 1 - 200  # the read-ahead of a shared job is small
    assert plugin.state.job_by_name("test2").job_id == dyn.job_id


GC_CONFIG = {"dataservice.dispatcher.job-gc-timeout": "20ms",
             "dataservice.dispatcher.gc-interval": "50ms"}


@pytest.mark.parametrize("job_name", [None, "test"])
def test_gc_unused_job(job_name):
    """Re-expresses data_service_ops_test.testGcUnusedJob (both ``job_name`` values): once
    its only iterator is gone, the job's task is dropped from the worker."""

    @gen_cluster(client=True, nthreads=[("", 1)], config=GC_CONFIG)
    async def run(c, s, a):
        ds = await distribute(dds.Dataset.range(100), "parallel_epochs", c, job_name=job_name)
        it = await asyncio.to_thread(iter, ds)
        assert await take(it, 1) == [0]
        worker = a.extensions["dataservice"]
        assert len(worker.tasks) == 1
        await asyncio.to_thread(it.close)
        await poll(lambda: not worker.tasks, what="the task to be dropped")

    run()


@gen_cluster(client=True, nthreads=[("", 1)], config=GC_CONFIG)
async def test_dont_gc_used_job(c, s, a):
    """Re-expresses data_service_ops_test.testDontGcUsedJob: of two named jobs whose first
    iterators are gone, only the one with no iterator left is collected (a second iterator of
    ``test2`` keeps its task)."""
    n = 1000
    dataset_id = await asyncio.to_thread(dds.register_dataset, c, dds.Dataset.range(n))

    def named(job_name):
        return dds.from_dataset_id("parallel_epochs", c, dataset_id, job_name=job_name)

    it1, it2, it3 = [await asyncio.to_thread(iter, named(j)) for j in ("test1", "test2", "test2")]
    for it in (it1, it2, it3):  # each acquires its iteration at its first element
        await take(it, 1)
    worker = a.extensions["dataservice"]
    assert len(worker.tasks) == 2
    await asyncio.to_thread(it1.close)
    await asyncio.to_thread(it2.close)
    plugin = s.plugins[PLUGIN_NAME]
    test1, test2 = plugin.state.job_by_name("test1"), plugin.state.job_by_name("test2")
    await poll(lambda: plugin.state.job(test1.job_id).status == "garbage_collected",
               what="job test1's GC")
    await poll(lambda: len(worker.tasks) == 1, what="job test1's task to be dropped")
    rounds = plugin.gc_rounds
    await poll(lambda: plugin.gc_rounds >= rounds + 3, what="three more GC rounds")
    assert len(worker.tasks) == 1
    assert plugin.state.job(test2.job_id).status == "live"
    await asyncio.to_thread(it3.close)


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_shared_job_name_multi_iteration(c, s, a):
    """Re-expresses data_service_ops_test.testSharedJobNameMultiIteration: two datasets on
    one named job; the second's first pass joins the iteration the first read whole (it gets
    nothing), its second pass reads the next iteration whole, and the first's second pass
    joins that one (nothing)."""
    n = 10
    ds1 = await distribute(dds.Dataset.range(n), "parallel_epochs", c, job_name="job_name")
    ds2 = await distribute(dds.Dataset.range(n), "parallel_epochs", c, job_name="job_name")
    assert await rest(ds1) == list(range(n))
    assert await rest(ds2) == []
    assert await rest(ds2) == list(range(n))
    assert await rest(ds1) == []


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_shared_job_name_repeat(c, s, a):
    """Re-expresses data_service_ops_test.testSharedJobNameRepeat: two datasets on one named
    job, each repeated 3 times; the first consumer takes 60 elements, then the second 60, then
    each reads to its end: together every element of the 3 repetitions, each once."""
    n, repetitions = 100, 3
    ds1 = await distribute(dds.Dataset.range(n), "parallel_epochs", c, job_name="job_name")
    ds2 = await distribute(dds.Dataset.range(n), "parallel_epochs", c, job_name="job_name")

    def body():
        it1, it2 = iter(ds1.repeat(repetitions)), iter(ds2.repeat(repetitions))
        results = [int(next(it1)) for _ in range(n * repetitions // 5)]
        results += [int(next(it2)) for _ in range(n * repetitions // 5)]
        return results + [int(x) for x in it1] + [int(x) for x in it2]

    results = await asyncio.to_thread(body)
    assert collections.Counter(results) == collections.Counter(
        {i: repetitions for i in range(n)})


@gen_cluster(client=True, nthreads=[("", 1)] * 5, timeout=60)
async def test_remove_more_workers_than_max_outstanding_requests(c, s, *workers):
    """Re-expresses fault_tolerance_test.testRemoveMoreWorkersThanMaxOutstandingRequests: an
    effectively infinite OFF read over 5 workers with ``max_outstanding_requests=1``; once
    every worker produced its 0, 4 of them stop, and the read goes on (1,000 more elements,
    no hang)."""
    ds = await distribute(dds.Dataset.range(2**55), "parallel_epochs", c,
                          max_outstanding_requests=1)
    it = await asyncio.to_thread(iter, ds)

    def zeros_from_every_worker():
        zeros = 0
        while zeros < len(workers):
            zeros += int(next(it)) == 0

    await asyncio.to_thread(zeros_from_every_worker)
    for w in workers[:-1]:
        await w.close()
    assert len(await take(it, 1000)) == 1000
    await asyncio.to_thread(it.close)


@gen_cluster(client=True, nthreads=[("", 1)] * 3, config=GC_CONFIG)
async def test_gc_and_recreate(c, s, *workers):
    """Re-expresses data_service_ops_test.testGcAndRecreate: three times, a named job is read
    for 50 elements and dropped; its tasks leave every worker before the name is used again."""
    job_ids = []
    for _ in range(3):
        ds = await distribute(dds.Dataset.range(1000), "parallel_epochs", c, job_name="test")
        it = await asyncio.to_thread(iter, ds)
        assert len(await take(it, 50)) == 50
        job_ids.append(s.plugins[PLUGIN_NAME].state.job_by_name("test").job_id)
        await asyncio.to_thread(it.close)
        await poll(lambda: not any(w.extensions["dataservice"].tasks for w in workers),
                   what="the tasks to leave every worker")
    assert len(set(job_ids)) == 3  # each time a new job under the name
