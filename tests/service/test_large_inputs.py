"""Large in-memory inputs reach the data workers through Dask, not in the pipeline's pickle.

``from_tensor_slices`` arrays above ``dataservice.client.scatter-threshold`` are scattered
to the workers in row chunks when the dataset is registered, and a ``from_dask`` collection
that is not persisted and whose graph is that big is persisted; the pipeline carries keys.
Real clusters throughout.
"""

from __future__ import annotations

import asyncio
import logging
import time

import cloudpickle
import dask
import dask.array as da
import numpy as np
import pytest
from _helpers import distribute, poll, read
from distributed.utils_test import gen_test

import dask_dataservice as dds
from dask_dataservice import Dataset
from dask_dataservice.data import DaskPartitionLostError
from dask_dataservice.data.dask_source import LOCALITY_KEY, ScatteredArray
from dask_dataservice.service.client._connection import _install_async
from dask_dataservice.service.dispatcher.plugin import PLUGIN_NAME, unpublish
from dask_dataservice.service.worker import current_task
from dask_dataservice.testing import gen_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(90)]

TWO = [("127.0.0.1", 1), ("127.0.0.1", 1)]

#: A small threshold and pipeline limit, so that a few MB exercise the same path as 100 MB.
SMALL = {"dataservice.client.scatter-threshold": "512 KiB",
         "dataservice.dispatcher.max-pipeline-bytes": "1 MiB"}


def indexed(rows: int, cols: int) -> np.ndarray:
    """``rows x cols`` float64 whose first column is the row's index."""
    x = np.ones((rows, cols))
    x[:, 0] = np.arange(rows)
    return x


def registered_bytes(s, dataset_id) -> int:
    ds = s.plugins[PLUGIN_NAME]._core.dataset(dataset_id)
    return len(ds.pipeline) + len(ds.splits)


def published(s) -> dict:
    return {k: v for k, v in s.extensions["publish"].datasets.items()
            if k.startswith("dask-dataservice-")}


@pytest.mark.slow
@gen_cluster(client=True, nthreads=TWO)
async def test_an_80_mb_array_is_read_through_distribute_exactly_once_per_element(c, s, a, b):
    """80 MB: above the dispatcher's 64 MiB pipeline limit, and light enough for 2 cores
    (the client, two in-process workers and the reader hold a copy each)."""
    x = indexed(10_000, 1000)
    assert x.nbytes == 80_000_000
    ds = Dataset.from_tensor_slices((x, np.arange(10_000, dtype=np.int32)))  # 40 kB: inline
    start = time.perf_counter()
    dataset_id = await asyncio.to_thread(dds.register_dataset, c, ds)
    registered = time.perf_counter() - start
    assert registered_bytes(s, dataset_id) < 200_000  # keys, not rows
    [pin] = published(s)
    keys = list(s.tasks)
    # chunks of whole 40-row splits, about 4 MiB each: 13 splits of 8 kB rows
    assert len([k for k in keys if str(k).startswith("dds-slices-")]) == 20
    assert sum(s.tasks[k].nbytes for k in keys) >= 80_000_000
    # both workers hold chunks: the array was spread, not put on one
    assert all(any(str(k).startswith("dds-slices-") for k in w.data) for w in (a, b))
    # the same array again: the same dataset, nothing scattered again
    assert await asyncio.to_thread(dds.register_dataset, c, ds) == dataset_id
    assert set(s.tasks) == set(keys)
    out = await read(dds.from_dataset_id("DYNAMIC", c, dataset_id).map(
        lambda row, i: (int(row[0]), int(i), float(row.sum()))))
    print(f"register {registered:.2f}s, read {time.perf_counter() - start - registered:.2f}s")
    assert sorted(out) == [(i, i, i + 999.0) for i in range(10_000)]  # each row exactly once
    assert pin in published(s)


@gen_cluster(client=True, nthreads=TWO,
             config={"dataservice.dispatcher.worker-addresses": ["0", "1"]})
async def test_scattered_rows_keep_the_local_order_and_shards(c, s, a, b):
    with dask.config.set(SMALL):
        await _install_async(c)
        x = indexed(2_000, 64)  # 1 MB: above the (test) threshold
        ds = Dataset.from_tensor_slices({"x": x, "small": np.arange(2_000)}).map(
            lambda e: (int(e["x"][0]), int(e["small"])))
        local = list(ds)
        # DYNAMIC hands out the same index-range splits: the elements of each split in order
        dynamic = await read(await distribute(ds, "DYNAMIC", c))
        assert sorted(dynamic) == local
        # OFF: each of the two workers reads the whole dataset in the local order
        tagged = await read(await distribute(
            ds.map(lambda *e: (current_task()["task_id"], e)), "OFF", c))
        tasks = sorted({t for t, _ in tagged})
        assert len(tasks) == 2
        for task in tasks:
            assert [e for t, e in tagged if t == task] == local
        # DATA: element i goes to worker i % 2, in order
        data = await read(await distribute(
            ds.map(lambda *e: (current_task()["worker_index"], e)), "DATA", c))
        for w in (0, 1):
            assert [e for i, e in data if i == w] == local[w::2]


@gen_cluster(client=True, nthreads=TWO)
async def test_an_unpersisted_collection_above_the_limit_is_persisted_at_registration(c, s, a, b):
    with dask.config.set(SMALL):
        await _install_async(c)
        data = indexed(4_000, 64)  # 2 MB embedded in the graph by from_array
        x = da.from_array(data, chunks=(500, 64))
        assert len(cloudpickle.dumps(x)) > 1 << 20
        ds = Dataset.from_dask(x).map(lambda row: int(row[0]))
        dataset_id = await asyncio.to_thread(dds.register_dataset, c, ds)
        assert registered_bytes(s, dataset_id) < 64_000
        # persisted at registration: the dispatcher knows where each partition is
        hint = s.plugins[PLUGIN_NAME]._core.dataset(dataset_id).metadata[LOCALITY_KEY]
        assert [tuple(keys[0]) for keys in hint] == [row[0] for row in x.__dask_keys__()]
        out = await read(dds.from_dataset_id("DYNAMIC", c, dataset_id))
        assert sorted(out) == list(range(4_000))
        assert len(published(s)) == 1


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_closure_capturing_a_large_array_is_refused_naming_the_ways_out(c, s, a):
    with dask.config.set(SMALL):
        await _install_async(c)
        big = np.ones(200_000)  # 1.6 MB, captured by the function, not a source
        ds = Dataset.range(3).map(lambda i: big[i])
        with pytest.raises(dds.ServiceLimitError) as info:
            await asyncio.to_thread(dds.register_dataset, c, ds)
    message = str(info.value)
    assert message.startswith("the dataset's pickled pipeline and splits take 1.5")
    for needed in ("dataservice.dispatcher.max-pipeline-bytes", "Dataset.from_tensor_slices",
                   "dataservice.client.scatter-threshold", "client.scatter()", "persist()",
                   "Dataset.from_dask()"):
        assert needed in message, needed


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_scattered_rows_that_are_gone_are_an_error_naming_them(c, s, a):
    with dask.config.set(SMALL):
        await _install_async(c)
        ds = Dataset.from_tensor_slices(indexed(2_000, 64) + 7)  # no other test's chunks
        dataset_id = await asyncio.to_thread(dds.register_dataset, c, ds)
        [pin] = published(s)
        await c.unpublish_dataset(pin)
        await poll(lambda: not any(str(k).startswith("dds-slices-") for k in s.tasks),
                   what="the scheduler to forget the chunks")
        with pytest.raises(DaskPartitionLostError,
                           match=r"from_tensor_slices\(\): the chunk 'dds-slices-[0-9a-f]+-0' "
                                 r"of an array of shape \(2000, 64\) that was scattered"
                                 r".*register the dataset again"):
            await read(dds.from_dataset_id("OFF", c, dataset_id))


@pytest.mark.pure
def test_small_arrays_and_no_threshold_stay_in_the_pipeline():
    from dask_dataservice.service.client._scatter import large_inputs

    big = Dataset.from_tensor_slices(np.zeros(17 << 20, np.uint8)).batch(4)
    assert [type(op).__name__ for op in large_inputs(big._op)] == ["TensorSlices"]
    assert large_inputs(Dataset.from_tensor_slices(np.zeros(1000))._op) == []
    with dask.config.set({"dataservice.client.scatter-threshold": None}):
        assert large_inputs(big._op) == []
    assert ScatteredArray(("k",), 4, (8, 2), "<f8", "s", "p").nbytes == 128


@pytest.mark.pure
def test_the_chunk_cache_keeps_the_chunks_read_last_within_its_bytes():
    from dask_dataservice.data.dask_source import _ChunkCache

    cache = _ChunkCache(max_bytes=3_000)
    one, two, three = (np.zeros(125) for _ in range(3))  # 1,000 bytes each
    cache.put(("a",), [one])
    cache.put(("b",), [two])
    assert cache.get(("a",))[0] is one  # a is now the most recent
    cache.put(("c",), [three, np.zeros(125)])  # 2,000 bytes: the oldest (b) goes
    assert cache.get(("b",)) is None
    assert cache.get(("a",))[0] is one and cache.get(("c",))[0] is three
    cache.put(("huge",), [np.zeros(1_000)])  # bigger than the cache: kept alone
    assert cache.get(("huge",)) is not None and cache.get(("a",)) is None


#: A dataset nobody reads is collected within a few GC rounds.
FAST_GC = {"dataservice.dispatcher.dataset-gc-timeout": "200ms",
           "dataservice.dispatcher.gc-interval": "20ms"}


def chunk_keys(*servers) -> set:
    """The scattered chunks' keys the scheduler knows and the workers hold in memory."""
    return {k for server in servers for k in (server.tasks if hasattr(server, "tasks") and
                                              not hasattr(server, "data") else server.data)
            if str(k).startswith("dds-slices-")}


@gen_cluster(client=True, nthreads=TWO, config=FAST_GC)
async def test_a_collected_dataset_unpublishes_its_chunks_and_the_workers_release_them(c, s, a, b):
    with dask.config.set(SMALL):
        await _install_async(c)
        ds = Dataset.from_tensor_slices(indexed(2_000, 64) + 11)  # no other test's chunks
        dataset_id = await asyncio.to_thread(dds.register_dataset, c, ds)
    plugin = s.extensions["dataservice"]
    key = int(dataset_id.partition(":")[0])
    [pin] = published(s)
    assert plugin.core.dataset(dataset_id).metadata["published"] == [pin]
    assert chunk_keys(a, b)  # scattered to the workers' memory
    await poll(lambda: plugin.state.dataset_collected(key), timeout=20,
               what="the dataset collected")
    await poll(lambda: not published(s), what="the chunks unpublished")
    await poll(lambda: not chunk_keys(s) and not chunk_keys(a, b), timeout=20,
               what="the chunks released from the workers' memory")
    unpublish(s, [pin])  # a name already gone (a replay, or unpublished by hand): skipped
    assert not published(s)


@gen_cluster(client=True, nthreads=TWO,
             config={**FAST_GC, "dataservice.dispatcher.dataset-gc-timeout": "1s"})
async def test_a_collected_dataset_keeps_the_chunks_another_dataset_shares(c, s, a, b):
    x = indexed(2_000, 64) + 13  # the same array in two pipelines: one published name
    with dask.config.set(SMALL):
        await _install_async(c)
        unread = await asyncio.to_thread(
            dds.register_dataset, c, Dataset.from_tensor_slices(x).map(lambda e: int(e[0])))
        read_ = await asyncio.to_thread(
            dds.register_dataset, c, Dataset.from_tensor_slices(x).map(lambda e: -int(e[0])))
    assert unread != read_
    [pin] = published(s)
    out = await read(dds.from_dataset_id("DYNAMIC", c, read_))  # read: kept (as in TF)
    assert sorted(out) == sorted(-i - 13 for i in range(2_000))
    plugin = s.extensions["dataservice"]
    await poll(lambda: plugin.state.dataset_collected(int(unread.partition(":")[0])),
               timeout=20, what="the unread dataset collected")
    assert list(published(s)) == [pin]  # the other still uses it
    rounds = plugin.gc_rounds
    await poll(lambda: plugin.gc_rounds >= rounds + 3, what="three more GC rounds")
    assert list(published(s)) == [pin] and chunk_keys(a, b)
    out = await read(dds.from_dataset_id("DYNAMIC", c, read_))
    assert sorted(out) == sorted(-i - 13 for i in range(2_000))


@gen_test(timeout=60)
async def test_a_scheduler_shutting_down_releases_the_published_chunks_before_its_workers():
    """``client.shutdown()`` (the scheduler closes first): the published chunks are
    released before the workers go, so the scheduler does not log them as lost data."""
    from distributed import Client, Scheduler, Worker
    from distributed.utils_test import captured_logger

    async with Scheduler(dashboard_address=":0") as s, Worker(s.address, nthreads=1) as a:
        async with Client(s.address, asynchronous=True) as c:
            with dask.config.set(SMALL):
                await _install_async(c)
                await asyncio.to_thread(
                    dds.register_dataset, c, Dataset.from_tensor_slices(indexed(2_000, 64) + 17))
            assert published(s) and chunk_keys(a)
        with captured_logger("distributed.scheduler", level=logging.ERROR) as log:
            await s.close()
        assert "lose scattered data" not in log.getvalue()
        assert not s.extensions["publish"].datasets
