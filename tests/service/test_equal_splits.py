"""Equal splits: N consumers of one DYNAMIC job deliver the same number of elements.

``from_dataset_id(..., consumer_index=i, num_consumers=N, equal=True | "drop" | "pad")``
on a real cluster: equal counts every pass, each element at most once (``drop``; ``pad``
repeats only its padding), the union is the whole dataset minus the documented drop, a
missing consumer fails the others naming it, a dispatcher restart is ridden out, and bad
combinations fail clearly.
"""

from __future__ import annotations

import asyncio
import time

import pytest

import dask_dataservice as dds
from dask_dataservice.service.client import _install_async
from dask_dataservice.testing import gen_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]

TWO = [("127.0.0.1", 1), ("127.0.0.1", 1)]
#: A job whose consumers failed is collected soon (gen_cluster's cleanup checks the workers).
GC = {"dataservice.dispatcher.job-gc-timeout": "200ms",
      "dataservice.dispatcher.gc-interval": "50ms",
      "dataservice.dispatcher.gc-dynamic-sharding-jobs": True}


def consume(c, dataset_id, index, n, equal, job="train", passes=1, delay=0.0, out=None):
    """Read ``passes`` passes as consumer ``index`` of ``n``; ``delay`` seconds per element."""
    ds = dds.from_dataset_id("distributed_epoch", c, dataset_id, job_name=job,
                             consumer_index=index, num_consumers=n, equal=equal)
    result = [] if out is None else out
    for _ in range(passes):
        got = []
        for x in ds:
            got.append(int(x))
            if delay:
                time.sleep(delay)
        result.append(got)
    return result


def check_pass(per_consumer, total, remainder):
    """Equal counts; no duplicates within the data (pad: only repeats of delivered ones)."""
    counts = [len(g) for g in per_consumer]
    assert len(set(counts)) == 1, counts
    if remainder == "drop":
        union = [x for g in per_consumer for x in g]
        assert len(union) == len(set(union)), "an element was delivered twice"
        assert set(union) <= set(range(total))
        return total - len(union)  # the drop
    distinct = [list(dict.fromkeys(g)) for g in per_consumer]
    firsts = [x for g in distinct for x in g]
    assert len(firsts) == len(set(firsts)), "two consumers delivered one element"
    assert sorted(firsts) == list(range(total)), "pad mode loses nothing"
    return sum(len(g) for g in per_consumer) - total  # the padding


@pytest.mark.parametrize("n, remainder", [(2, "drop"), (3, "drop"), (2, "pad"), (3, "pad")])
@gen_cluster(client=True, nthreads=TWO)
async def test_equal_counts_with_uneven_consumers(c, s, a, b, n, remainder):
    await _install_async(c)
    total = 2000 + n - 1  # not a multiple of n
    dataset_id = await asyncio.to_thread(dds.register_dataset, c, dds.Dataset.range(total),
                                         split_size=50)
    # consumer 0 is slow (half a millisecond per element), the others are not
    outs = await asyncio.gather(*(
        asyncio.to_thread(consume, c, dataset_id, i, n, remainder, passes=2,
                          delay=0.0005 if i == 0 else 0.0) for i in range(n)))
    for p in range(2):
        per_consumer = [out[p] for out in outs]
        extra = check_pass(per_consumer, total, remainder)
        # the documented bound: what n - 1 consumers hold beyond the count (2 held batches
        # and 2 requests in flight per task, of 8 elements each)
        assert 0 <= extra <= (n - 1) * (2 + 2 * 2) * 8, extra
        # which elements a consumer gets is decided as it reads, not a fixed shard
        assert any(set(g) != set(range(i, total, n)) for i, g in enumerate(per_consumer))


@gen_cluster(client=True, nthreads=TWO)
async def test_equal_split_errors_from_the_dispatcher(c, s, a, b):
    await _install_async(c)
    dataset_id = await asyncio.to_thread(dds.register_dataset, c, dds.Dataset.range(100))
    # consumer 0 of 2 waits for its peer; a peer that says 3 consumers is refused
    first = asyncio.ensure_future(asyncio.to_thread(consume, c, dataset_id, 0, 2, "drop", "mm"))
    await joined(s, 0)
    with pytest.raises(ValueError, match=r"consumer_index=1 reads job 'mm' .* with "
                       r"num_consumers=3, but its other consumers use num_consumers=2"):
        await asyncio.to_thread(consume, c, dataset_id, 1, 3, "drop", "mm")
    with pytest.raises(ValueError, match=r"consumer_index=1 reads job 'mm' .* with "
                       r"equal='pad', but its other consumers use equal='drop'"):
        await asyncio.to_thread(consume, c, dataset_id, 1, 2, "pad", "mm")
    with pytest.raises(ValueError, match=r"consumer_index=0 of job 'mm' .* is already read by "
                       "another consumer"):
        await asyncio.to_thread(consume, c, dataset_id, 0, 2, "drop", "mm")
    out = await asyncio.to_thread(consume, c, dataset_id, 1, 2, "drop", "mm")
    first_out = await first
    check_pass([first_out[0], out[0]], 100, "drop")


async def joined(s, index, timeout=10.0):
    """Wait until consumer ``index`` of the (one) equal split joined its group."""
    equal = s.extensions["dataservice"].core.equal
    deadline = time.monotonic() + timeout
    while not any(g.clients[index] is not None for g in equal.groups.values()):
        assert time.monotonic() < deadline, "the consumer never joined"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("kwargs, message", [
    (dict(processing_mode="parallel_epochs"), "need processing_mode='distributed_epoch'"),
    (dict(processing_mode="FILE"), "not FILE"),
    (dict(consumer_index=None, num_consumers=None), "needs consumer_index and num_consumers"),
    (dict(job_name=None), "needs a job_name"),
    (dict(equal="sometimes"), "equal must be False, True"),
    (dict(consumer_index=2), "need 0 <= consumer_index < num_consumers"),
    (dict(cross_trainer_cache=dds.CrossTrainerCache("t")), "do not combine"),
    (dict(track_position=True), "not tracked for equal splits"),
])
@pytest.mark.pure
def test_bad_combinations(kwargs, message):
    args = dict(processing_mode="distributed_epoch", service="tcp://127.0.0.1:1",
                dataset_id="1:x", job_name="j", consumer_index=0, num_consumers=2,
                equal=True) | kwargs
    with pytest.raises(ValueError, match=message):
        dds.from_dataset_id(**args)
    args.pop("dataset_id")
    with pytest.raises(ValueError, match=message):
        dds.distribute(**args)(dds.Dataset.range(4))


@gen_cluster(client=True, nthreads=TWO,
             config={**GC, "dataservice.dispatcher.client-timeout": "1s"})
async def test_a_consumer_that_never_joins_fails_the_others_naming_it(c, s, a, b):
    await _install_async(c)
    dataset_id = await asyncio.to_thread(dds.register_dataset, c, dds.Dataset.range(100))
    start = time.monotonic()
    with pytest.raises(dds.DataServiceError, match=r"the equal split failed: consumer_index 1, 2 "
                       r"of job 'lonely' .* \(num_consumers=3\) never joined within "
                       r"dataservice.dispatcher.client-timeout=1s"):
        await asyncio.to_thread(consume, c, dataset_id, 0, 3, "drop", "lonely")
    assert time.monotonic() - start < 10


@gen_cluster(client=True, nthreads=TWO, config=GC)
async def test_a_consumer_that_stops_early_fails_the_others_naming_it(c, s, a, b):
    await _install_async(c)
    dataset_id = await asyncio.to_thread(dds.register_dataset, c, dds.Dataset.range(5000),
                                         split_size=50)

    def stop_early():
        ds = dds.from_dataset_id("distributed_epoch", c, dataset_id, job_name="quit",
                                 consumer_index=1, num_consumers=2, equal=True)
        it = iter(ds)
        got = [next(it) for _ in range(5)]
        it.close()  # releases its iteration client: the others must not wait for it
        return got

    survivor = asyncio.ensure_future(
        asyncio.to_thread(consume, c, dataset_id, 0, 2, "drop", "quit", 1, 0.001))
    assert len(await asyncio.to_thread(stop_early)) == 5
    with pytest.raises(dds.DataServiceError, match=r"the equal split failed: consumer 1 of the 2 "
                       r"consumers of job 'quit' .* stopped reading before the equal count was "
                       "decided"):
        await survivor


def test_an_equal_split_rides_a_dispatcher_restart(tmp_path):
    """The counts are soft state: a fault-tolerant dispatcher restarted mid-pass rebuilds the
    split from the consumers' next reports; the pass ends with equal counts, at most once."""
    from concurrent.futures import ThreadPoolExecutor

    from _helpers import free_port, wait
    from distributed import Client

    cfg = dds.DispatcherConfig(port=free_port(), fault_tolerant_mode=True,
                               work_dir=str(tmp_path))
    dispatcher = dds.DispatchServer(cfg)
    workers = [dds.WorkerServer(dds.WorkerConfig(dispatcher._address)) for _ in range(2)]
    total = 4001
    try:
        with Client(dispatcher.target, timeout="20s") as c, ThreadPoolExecutor(2) as pool:
            c.wait_for_workers(2)
            dataset_id = dds.register_dataset(c, dds.Dataset.range(total), split_size=50)
            live = [[], []]

            def reader(i):
                ds = dds.from_dataset_id("distributed_epoch", c, dataset_id, job_name="ft-eq",
                                         consumer_index=i, num_consumers=2, equal=True,
                                         max_outstanding_requests=1)
                for x in ds:
                    live[i].append(int(x))
                    time.sleep(0.0005)
                return live[i]

            futures = [pool.submit(reader, i) for i in range(2)]
            wait(lambda: min(map(len, live)) >= 300, what="both consumers to read")
            dispatcher.stop()
            at_restart = max(map(len, live))
            dispatcher = dds.DispatchServer(cfg)
            per_consumer = [f.result(timeout=60) for f in futures]
            # the restart fell mid-pass: most of the pass was delivered after it
            assert at_restart + 1000 < len(per_consumer[0]), (at_restart, len(per_consumer[0]))
        extra = check_pass(per_consumer, total, "drop")
        assert 0 <= extra <= (2 + 2 * 2) * 8, extra
    finally:
        for w in workers:
            w.stop()
        dispatcher.stop()
