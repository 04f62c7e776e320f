"""The cross-trainer cache: trainers with different ids share one production of elements."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter

import pytest
from _helpers import poll

import dask_dataservice as dds
from dask_dataservice.service.client import _install_async
from dask_dataservice.testing import gen_cluster

#: Named jobs of infinite datasets are collected soon after their consumers leave, so that
#: the workers are idle when gen_cluster's cleanup asserts run.
GC = {"dataservice.dispatcher.job-gc-timeout": "200ms", "dataservice.dispatcher.gc-interval": "50ms", "dataservice.dispatcher.gc-dynamic-sharding-jobs": True}

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]


def take(ds, n):
    it = iter(ds)
    try:
        return list(itertools.islice(it, n))
    finally:
        it.close()


def produced(*workers):
    total = 0
    for w in workers:
        ext = w.extensions["dataservice"]
        total += ext.stats["elements_produced"]
        total += sum(r.buffer.produced for r in ext.tasks.values() if r is not None)
    return total


async def register(c, ds):
    await _install_async(c)
    return await asyncio.to_thread(dds.register_dataset, c, ds)


def trainer(c, dataset_id, trainer_id, job="shared"):
    return dds.from_dataset_id("distributed_epoch", c, dataset_id, job_name=job,
                               cross_trainer_cache=dds.CrossTrainerCache(trainer_id))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)],
             config={**GC, "dataservice.client.request-elements": 512})
async def test_two_trainers_share_productions(c, s, a):
    dataset_id = await register(c, dds.Dataset.range(100_000).repeat())
    k = 20_000
    out1, out2 = await asyncio.gather(
        asyncio.to_thread(take, trainer(c, dataset_id, "t1"), k),
        asyncio.to_thread(take, trainer(c, dataset_id, "t2"), k),
    )
    assert len(out1) == len(out2) == k
    # one worker, both trainers from the start of the window: the very same elements
    assert out1 == out2 == list(range(k))
    # ... produced about once, not twice: K plus what the readers fetched ahead
    assert produced(a) < 1.2 * k, produced(a)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], config=GC)
async def test_same_trainer_id_splits_elements(c, s, a):
    dataset_id = await register(c, dds.Dataset.range(100_000).repeat())
    out1, out2 = await asyncio.gather(
        asyncio.to_thread(take, trainer(c, dataset_id, "same"), 1000),
        asyncio.to_thread(take, trainer(c, dataset_id, "same"), 1000),
    )
    assert len(out1) == len(out2) == 1000
    assert not set(out1) & set(out2), "a trainer id does not see an element twice"
    # each consumer got an increasing run of the one shared sequence
    assert out1 == sorted(out1) and out2 == sorted(out2)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)],
             config={**GC, "dataservice.worker.cross-trainer-cache-bytes": 800,  # ~100 elements
                     # a trainer reads ahead by whole turns (up to max-outstanding-batches + 2
                     # of them): small turns, so that the paused trainer has read little ahead
                     "dataservice.client.cross-trainer-turn-elements": 16})
async def test_slow_trainer_skips_ahead_and_never_blocks_the_fast_one(c, s, a):
    dataset_id = await register(c, dds.Dataset.range(10**9).repeat())
    slow_it = iter(trainer(c, dataset_id, "slow"))
    first = await asyncio.to_thread(lambda: [next(slow_it) for _ in range(10)])
    assert first == list(range(first[0], first[0] + 10))  # from the oldest cached element
    # the fast trainer reads far beyond the window while the slow one reads nothing
    fast = await asyncio.to_thread(take, trainer(c, dataset_id, "fast"), 5000)
    assert fast == sorted(fast) and len(set(fast)) == 5000  # in order, never waiting for "slow"
    # the slow trainer goes on: after what its reader had already fetched, it jumps to
    # what is still cached (it skipped the evicted elements)
    later = await asyncio.to_thread(lambda: [next(slow_it) for _ in range(2000)])
    assert later == sorted(later) and len(set(later)) == len(later)
    gaps = [b - a for a, b in itertools.pairwise([first[-1], *later])]
    assert max(gaps) > 1000, "the slow trainer skipped ahead"
    cache = next(r.buffer for r in a.extensions["dataservice"].tasks.values() if r is not None)
    assert cache.skipped > 0
    await asyncio.to_thread(slow_it.close)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_cache_needs_infinite_dataset_and_job_name(c, s, a):
    dataset_id = await register(c, dds.Dataset.range(10))
    with pytest.raises(ValueError, match="needs an infinite dataset"):
        await asyncio.to_thread(take, trainer(c, dataset_id, "t1"), 5)
    with pytest.raises(ValueError, match="needs a job_name"):
        dds.from_dataset_id("distributed_epoch", c, dataset_id,
                            cross_trainer_cache=dds.CrossTrainerCache("t1"))
    with pytest.raises(ValueError, match="trainer_id must be a non-empty string"):
        dds.CrossTrainerCache("")


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], config=GC)
async def test_iterating_one_cached_dataset_twice_is_an_error(c, s, a):
    """issue 9, 2.11: as TensorFlow, a second pass over the same distributed dataset would be
    a new repetition that reuses nothing from the cache: refused."""
    dataset_id = await register(c, dds.Dataset.range(10**9).repeat())
    ds = trainer(c, dataset_id, "t1")
    assert await asyncio.to_thread(take, ds, 10) == list(range(10))
    with pytest.raises(ValueError, match="disallows multiple repetitions"):
        await asyncio.to_thread(take, ds, 10)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)],
             config={**GC, "dataservice.client.cross-trainer-turn-elements": 64})
async def test_dynamic_trainers_see_the_same_elements(c, s, a, b):
    """issue 9, 2.11: under DYNAMIC the two tasks' windows hold different splits; every
    trainer takes a fixed number of elements from each task in task order, so trainers see
    the same elements (they used to take whichever task answered first: often disjoint)."""
    dataset_id = await register(c, dds.Dataset.range(10**9).repeat())
    # a trainer reads the tasks present when it starts: both workers registered by then
    dispatcher = s.plugins["dataservice-dispatcher"]
    await poll(lambda: len(dispatcher.state.list_workers()) == 2, what="both data workers")

    def dyn(trainer_id):
        return dds.from_dataset_id("distributed_epoch", c, dataset_id, job_name="dyn",
                                   cross_trainer_cache=dds.CrossTrainerCache(trainer_id))

    out1 = await asyncio.to_thread(take, dyn("t1"), 200)
    out2 = await asyncio.to_thread(take, dyn("t2"), 200)
    assert len(out1) == len(out2) == 200
    assert out1 == out2, "the second trainer reads what the first read, in the same order"
    assert len({x // 65536 for x in out1}) == 2, "both tasks' splits are in the sequence"


def _rows(x):
    import numpy as np

    return np.full(64, x, dtype=np.int64)  # 512 bytes: a window of 4 KiB holds 8 of them


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["distributed_epoch", "parallel_epochs"])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)], timeout=90,
             config={**GC, "dataservice.worker.cross-trainer-cache-bytes": 4096,
                     "dataservice.client.cross-trainer-turn-elements": 64})
async def test_fast_trainer_reads_on_while_a_slow_one_is_blocked(c, s, a, b, mode):
    """cross_trainer_cache_test.testSlowClientSkipsData / testConcurrentReaders (issue 22,
    item 4): a slow trainer never slows the others, under DYNAMIC and OFF. The slow trainer
    reads one element, then stops consuming without releasing its read; the fast one must
    read 3,000 elements (375 windows: the window holds 8) within a generous deadline, each
    once per copy, in its stream's order, skipping nothing once it leads. (The stall fixed
    here did not depend on the slow trainer: the fast one alone waited too.) Before, a trainer that had read the whole window got
    no more production whenever 8 elements (a producer's chunk) were more than half the
    window: the fast trainer stopped after its first 8 elements of each task, for ever."""
    dataset_id = await register(c, dds.Dataset.range(10**9).map(_rows).repeat())
    dispatcher = s.plugins["dataservice-dispatcher"]
    await poll(lambda: len(dispatcher.state.list_workers()) == 2, what="both data workers")

    def cached(trainer_id):
        return dds.from_dataset_id(mode, c, dataset_id, job_name="blocked-slow",
                                   cross_trainer_cache=dds.CrossTrainerCache(trainer_id))

    slow_it = aiter(cached("slow"))
    assert (await anext(slow_it)).shape == (64,)  # ... and then it reads no more
    n = 3000
    fast_it = aiter(cached("fast"))
    values: list[int] = []
    try:
        async with asyncio.timeout(30):
            while len(values) < n:
                values.append(int((await anext(fast_it))[0]))
    except TimeoutError:
        produced_ = [r.buffer.produced for w in (a, b)
                     for r in w.extensions["dataservice"].tasks.values() if r is not None]
        pytest.fail(f"the fast trainer read {len(values)} of {n} elements in 30 s while the "
                    f"slow one is blocked (the tasks produced {produced_})")
    finally:
        await fast_it.aclose()
    if mode == "distributed_epoch":
        # each element of the job once, each split's run in order; the fast trainer skips
        # only while it is behind what the slow trainer's reader fetched ahead (that reader
        # led the 8-element windows then), never once it leads
        assert len(set(values)) == n, "no element twice"
        slow_reach = max(r.buffer.positions.cursors["slow"] for w in (a, b)
                         for r in w.extensions["dataservice"].tasks.values() if r is not None)
        for split in {v // 65536 for v in values}:
            run = [v for v in values if v // 65536 == split]
            assert run == sorted(set(run)), "in order"
            led = [v for v in run if v % 65536 >= slow_reach]
            assert len(led) > 100 and led == list(range(led[0], led[0] + len(led))), \
                "the fast trainer skipped while it led"
    else:
        # a copy per worker: each value at most twice
        assert max(Counter(values).values()) <= 2
    await slow_it.aclose()
