"""Coordinated reads: in every round all consumers read from the same worker."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

import dask_dataservice as dds
from dask_dataservice.service.client import _install_async
from dask_dataservice.testing import gen_cluster

#: Named jobs of infinite datasets are collected soon after their consumers leave, so that
#: the workers are idle when gen_cluster's cleanup asserts run.
GC = {"dataservice.dispatcher.job-gc-timeout": "200ms", "dataservice.dispatcher.gc-interval": "50ms", "dataservice.dispatcher.gc-dynamic-sharding-jobs": True}

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]

N_CONSUMERS = 2


def bucketed(n_consumers=N_CONSUMERS):
    """Rounds of ``n_consumers`` consecutive batches of one bucket (the seed's recipe)."""
    ds = dds.Dataset.range(10**6).map(lambda i: np.ones((i * 7919) % 9 + 1, dtype="i4"))
    ds = ds.bucket_by_sequence_length(len, [4, 7], [4 * n_consumers] * 3)
    ds = ds.flat_map(lambda batch: dds.Dataset.from_tensor_slices(batch).batch(4))
    return ds.repeat()


def bucket_of(batch) -> int:
    width = batch.shape[1]
    return 0 if width < 4 else 1 if width < 7 else 2


def read_rounds(c, dataset_id, index, rounds, job="coordinated"):
    ds = dds.from_dataset_id("distributed_epoch", c, dataset_id, job_name=job,
                             consumer_index=index, num_consumers=N_CONSUMERS)
    it = iter(ds)
    try:
        return list(itertools.islice(it, rounds))
    finally:
        it.close()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)], config=GC)
async def test_every_round_reads_one_bucket(c, s, a, b):
    await _install_async(c)
    dataset_id = await asyncio.to_thread(dds.register_dataset, c, bucketed())
    rounds = 200
    out0, out1 = await asyncio.gather(
        asyncio.to_thread(read_rounds, c, dataset_id, 0, rounds),
        asyncio.to_thread(read_rounds, c, dataset_id, 1, rounds),
    )
    assert len(out0) == len(out1) == rounds
    for r, (x, y) in enumerate(zip(out0, out1, strict=True)):
        assert bucket_of(x) == bucket_of(y), f"round {r}: buckets differ"
        assert x.shape == y.shape, f"round {r}: {x.shape} vs {y.shape}"
    # the buckets do change between rounds (the test would be vacuous otherwise)
    assert len({bucket_of(x) for x in out0}) == 3


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], config=GC)
async def test_round_elements_are_consecutive_per_consumer(c, s, a):
    await _install_async(c)
    dataset_id = await asyncio.to_thread(dds.register_dataset, c, dds.Dataset.range(10**9).repeat())
    out0, out1 = await asyncio.gather(
        asyncio.to_thread(read_rounds, c, dataset_id, 0, 100),
        asyncio.to_thread(read_rounds, c, dataset_id, 1, 100),
    )
    # one worker: round r is its elements 2r (consumer 0) and 2r + 1 (consumer 1)
    assert out0 == list(range(0, 200, 2))
    assert out1 == list(range(1, 200, 2))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)],
             config={**GC, "dataservice.worker.coordinated-read-timeout": "1s"})
async def test_consumer_that_stops_gives_others_a_timeout_error(c, s, a):
    await _install_async(c)
    dataset_id = await asyncio.to_thread(dds.register_dataset, c, dds.Dataset.range(10**9).repeat())
    # consumer 1 reads 3 rounds and stops; consumer 0 would run ahead forever
    await asyncio.to_thread(read_rounds, c, dataset_id, 1, 3)
    with pytest.raises(TimeoutError, match=r"consumers \[1\] have not read round"):
        await asyncio.to_thread(read_rounds, c, dataset_id, 0, 10_000)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], config=GC)
async def test_coordinated_read_argument_errors(c, s, a):
    await _install_async(c)
    finite = await asyncio.to_thread(dds.register_dataset, c, dds.Dataset.range(10))
    with pytest.raises(ValueError, match="coordinated reads need an infinite dataset"):
        await asyncio.to_thread(read_rounds, c, finite, 0, 1)
    with pytest.raises(ValueError, match="consumer_index and num_consumers"):
        dds.from_dataset_id("distributed_epoch", c, finite, job_name="j", num_consumers=2)
    with pytest.raises(ValueError, match="need 0 <= consumer_index < num_consumers"):
        dds.from_dataset_id("distributed_epoch", c, finite, job_name="j", consumer_index=2,
                            num_consumers=2)
    with pytest.raises(ValueError, match="need a job_name"):
        dds.from_dataset_id("distributed_epoch", c, finite, consumer_index=0, num_consumers=2)


CONSUMER = """
import json, sys, itertools
from distributed import Client
import dask_dataservice as dds
address, dataset_id, index, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with Client(address) as c:
    ds = dds.from_dataset_id("distributed_epoch", c, dataset_id, job_name="procs",
                             consumer_index=index, num_consumers=2)
    it = iter(ds)
    out = [int(x.shape[1]) for x in itertools.islice(it, rounds)]
    it.close()
print(json.dumps(out))
"""


@pytest.mark.process
@pytest.mark.slow
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)], timeout=60, config=GC)
async def test_consumers_in_separate_processes_stay_in_step(c, s, a, b):
    import json
    import sys

    await _install_async(c)
    dataset_id = await asyncio.to_thread(dds.register_dataset, c, bucketed())
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-c", CONSUMER, s.address, str(dataset_id), str(i), "150",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        for i in range(2)
    ]
    outs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), 50)
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err.decode()[-2000:]
    widths = [json.loads(out.decode().strip().splitlines()[-1]) for out, _ in outs]
    assert len(widths[0]) == len(widths[1]) == 150
    assert widths[0] == widths[1], "every round, both processes got batches of one width"
