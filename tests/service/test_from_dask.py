"""``Dataset.from_dask``: Dask collections as splittable sources with locality (issue 12 s1).

Real Dask clusters throughout: partitions are computed by the data workers, persisted
partitions are read where they are, and the dispatcher hands each worker its own first.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import shutil
import tempfile
import threading
import time

import cloudpickle
import dask
import dask.array as da
import dask.bag as db
import numpy as np
import pytest
from _helpers import distribute, needs, poll, read  # noqa: E402
from distributed import Client, LocalCluster, wait

import dask_dataservice as dds
from dask_dataservice import Dataset
from dask_dataservice.data import SHARD_HINT, DaskPartition, DaskPartitionLostError
from dask_dataservice.data.dask_source import LOCALITY_KEY, locality_metadata
from dask_dataservice.errors import IllegalUpdateError
from dask_dataservice.service.dispatcher._state_codec import decode_state, encode_state
from dask_dataservice.service.dispatcher.journal import read_journal
from dask_dataservice.service.dispatcher.plugin import PLUGIN_NAME, DispatcherPlugin
from dask_dataservice.service.dispatcher.state import (
    CreateIteration,
    CreateJob,
    CreateTask,
    DispatcherState,
    FinishTask,
    ProduceSplits,
    RegisterDataset,
    RegisterWorker,
    RemoveWorker,
    decode_update,
    encode_update,
    replay,
)
from dask_dataservice.service.worker import current_task
from dask_dataservice.testing import gen_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(90)]

TWO = [("127.0.0.1", 1), ("127.0.0.1", 1)]


def rows_of(out) -> list[tuple]:
    return sorted(tuple(np.asarray(r).tolist()) for r in out)


def matrix() -> da.Array:
    """40 x 6 floats in 4 row blocks and 2 column blocks (a row block spans two chunks)."""
    return da.arange(240, chunks=60).reshape(40, 6).rechunk((10, 3)).astype("f8")


# -- local iteration and pickling -------------------------------------------------------------


@pytest.mark.pure
def test_local_iteration_reads_every_row_and_block():
    x = matrix()
    expect = x.compute(scheduler="sync")
    with dask.config.set(scheduler="sync"):
        assert rows_of(Dataset.from_dask(x)) == rows_of(expect)
        blocks = list(Dataset.from_dask(x, rows=False))
    assert [b.shape for b in blocks] == [(10, 6)] * 4
    np.testing.assert_array_equal(np.concatenate(blocks), expect)
    ds = Dataset.from_dask(x)
    assert ds.splits() == [DaskPartition(i) for i in range(4)]
    assert ds.cardinality() == 40 and ds.is_file_based


@pytest.mark.pure
def test_unsupported_collections_are_refused_naming_the_supported_ones():
    for bad in (np.arange(3), dask.delayed(np.arange)(3), [1, 2], da.ones(3).to_delayed()[0]):
        with pytest.raises(TypeError, match=r"from_dask\(\) reads a dask\.array\.Array, a "
                                            r"dask\.dataframe\.DataFrame or a dask\.bag\.Bag"):
            Dataset.from_dask(bad)
    with pytest.raises(TypeError, match="rows must be a bool"):
        Dataset.from_dask(matrix(), rows=1)
    with pytest.raises(ValueError, match="at least one dimension"):
        Dataset.from_dask(da.ones(3).sum())
    with pytest.raises(ValueError, match="compute_chunk_sizes"):
        x = da.arange(10, chunks=5)
        Dataset.from_dask(x[x > 3])


@pytest.mark.pure
def test_from_tensor_slices_points_at_from_dask():
    with pytest.raises(TypeError, match=r"Dataset\.from_dask\(collection\)"):
        Dataset.from_tensor_slices(matrix())


# -- through the service: array, dataframe, bag; OFF, DYNAMIC, FILE ---------------------------


@gen_cluster(client=True, nthreads=TWO)
async def test_array_rows_and_blocks_under_dynamic_and_off(c, s, a, b):
    x = matrix()
    expect = x.compute(scheduler="sync")
    out = await read(await distribute(Dataset.from_dask(x), "DYNAMIC", c))
    assert rows_of(out) == rows_of(expect)  # every row exactly once
    out = await read(await distribute(Dataset.from_dask(x, rows=False), "OFF", c))
    assert len(out) == 8 and rows_of(np.concatenate(out)) == sorted(rows_of(expect) * 2)


@gen_cluster(client=True, nthreads=TWO)
async def test_partitions_are_computed_by_the_data_workers_not_the_client(c, s, a, b):
    def where(block):
        from distributed import get_worker

        return np.full((len(block), 1), int(get_worker().name))

    def reader(row):
        from dask_dataservice.service.worker.dask_source import current_worker as _current_worker

        return int(row[0]), int(_current_worker().name)

    x = da.zeros((40, 1), chunks=10).map_blocks(where, dtype=int)
    out = await read(await distribute(Dataset.from_dask(x).map(reader), "DYNAMIC", c))
    assert len(out) == 40
    # each partition was computed by the worker whose pipeline read it
    assert all(computed_on == read_by for computed_on, read_by in out), out


@gen_cluster(client=True, nthreads=TWO)
async def test_dataframe_rows_and_partitions(c, s, a, b):
    pd = needs("pandas", "test")
    dd = needs("dask.dataframe", "test")
    frame = pd.DataFrame({"a": np.arange(30), "b": np.arange(30) * 0.5})
    df = dd.from_pandas(frame, npartitions=3)
    out = await read(await distribute(Dataset.from_dask(df), "DYNAMIC", c))
    assert sorted((int(r["a"]), float(r["b"])) for r in out) == [(i, i * 0.5) for i in range(30)]
    assert all(isinstance(r["a"], np.int64) and isinstance(r["b"], np.float64) for r in out)
    persisted = c.persist(df)
    await wait(persisted)
    parts = await read(await distribute(Dataset.from_dask(persisted, rows=False), "DYNAMIC", c))
    assert sorted(len(p["a"]) for p in parts) == [10, 10, 10]
    assert sorted(np.concatenate([p["a"] for p in parts]).tolist()) == list(range(30))


@gen_cluster(client=True, nthreads=TWO)
async def test_bag_partitions_plain_and_persisted(c, s, a, b):
    bag = db.from_sequence(range(25), npartitions=5).map(lambda v: v * 3)
    out = await read(await distribute(Dataset.from_dask(bag), "DYNAMIC", c))
    assert sorted(out) == [v * 3 for v in range(25)]
    persisted = c.persist(db.from_sequence(range(25), npartitions=5).map(lambda v: v + 1))
    await wait(persisted)
    out = await read(await distribute(Dataset.from_dask(persisted), "DYNAMIC", c))
    assert sorted(out) == [v + 1 for v in range(25)]


@gen_cluster(client=True, nthreads=TWO)
async def test_collections_built_on_persisted_ones(c, s, a, b):
    pd = needs("pandas", "test")
    dd = needs("dask.dataframe", "test")
    x = c.persist(da.arange(60, chunks=10).reshape(20, 3).rechunk((5, 2)))
    frame = c.persist(dd.from_pandas(pd.DataFrame({"a": np.arange(20)}), npartitions=2))
    await wait([x, frame])
    on_top = x * 10 + 1  # a graph that holds Futures and tasks
    filtered = frame[frame.a > 3]
    ds = Dataset.from_dask(on_top)
    assert ds.source.partition_keys is None  # not a persisted collection itself
    out = await read(await distribute(ds, "DYNAMIC", c))
    assert rows_of(out) == rows_of(np.arange(60).reshape(20, 3) * 10 + 1)
    out = await read(await distribute(Dataset.from_dask(filtered), "DYNAMIC", c))
    assert sorted(int(r["a"]) for r in out) == list(range(4, 20))
    copy = cloudpickle.loads(cloudpickle.dumps(Dataset.from_dask(filtered)))
    assert sorted(int(r["a"]) for r in await asyncio.to_thread(list, copy)) == list(range(4, 20))


@gen_cluster(client=True, nthreads=TWO,
             config={"dataservice.dispatcher.worker-addresses": ["0", "1"]})
async def test_static_sharding_policies_split_the_partitions(c, s, a, b):
    x = da.arange(60, chunks=10)
    out = await read(await distribute(
        Dataset.from_dask(x).map(lambda v: (current_task()["worker_index"], int(v))), "FILE", c))
    groups = collections.defaultdict(list)
    for index, v in out:
        groups[index].append(v)
    assert {i: sorted(v) for i, v in groups.items()} == {
        i: sorted(v for p in range(i, 6, 2) for v in range(10 * p, 10 * p + 10)) for i in (0, 1)}
    # DATA: every worker reads every partition and keeps every other element
    out = await read(await distribute(
        Dataset.from_dask(x).map(lambda v: (current_task()["worker_index"], int(v))), "DATA", c))
    assert sorted(v for i, v in out if i == 1) == list(range(1, 60, 2))
    assert sorted(v for _, v in out) == list(range(60))
    # FILE_OR_DATA: a Dask collection's partitions are its files, so it shards as FILE does
    out = await read(await distribute(
        Dataset.from_dask(x).map(lambda v: (current_task()["worker_index"], int(v))),
        "FILE_OR_DATA", c))
    assert _by_worker(out) == {
        i: sorted(v for p in range(i, 6, 2) for v in range(10 * p, 10 * p + 10)) for i in (0, 1)}
    # HINT: shard(SHARD_HINT, SHARD_HINT) after the source becomes shard(2, worker index)
    out = await read(await distribute(
        Dataset.from_dask(x).shard(SHARD_HINT, SHARD_HINT)
        .map(lambda v: (current_task()["worker_index"], int(v))), "HINT", c))
    assert _by_worker(out) == {0: list(range(0, 60, 2)), 1: list(range(1, 60, 2))}


def _by_worker(out: list[tuple[int, int]]) -> dict[int, list[int]]:
    groups = collections.defaultdict(list)
    for index, v in out:
        groups[index].append(v)
    return {i: sorted(v) for i, v in groups.items()}


def _double_in_place(block):
    block *= 2
    return block


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_persisted_blocks_read_in_place_are_read_only(c, s, a):
    plain = da.arange(40, chunks=10)
    x = c.persist(plain)
    await wait(x)
    assert Dataset.from_dask(x).fingerprint() != Dataset.from_dask(plain).fingerprint()
    with pytest.raises(ValueError, match="read-only"):
        await read(await distribute(Dataset.from_dask(x, rows=False).map(_double_in_place),
                                    "DYNAMIC", c))
    assert (await c.compute(x.sum())) == sum(range(40))  # the persisted data is unchanged


def _sum_in_a_task(ds):
    return float(sum(float(v) for v in ds))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_dask_task_on_a_one_thread_worker_can_read_from_dask(c, s, a):
    # the task holds the worker's only thread: computing the partitions must not need it
    plain = da.arange(30, chunks=10) * 1.0
    x = c.persist(plain)
    await wait(x)
    for ds in (Dataset.from_dask(plain), Dataset.from_dask(x)):
        copy = cloudpickle.loads(cloudpickle.dumps(ds))  # as a task receives it
        assert await asyncio.wait_for(c.submit(_sum_in_a_task, copy, pure=False), 30) == 435.0


# -- registered size --------------------------------------------------------------------------


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_10_gb_collection_registers_in_kilobytes(c, s, a):
    big = da.ones((10_000_000, 128), chunks=(100_000, 128))  # 10.24 GB of float64
    assert big.nbytes > 10e9
    persisted = c.persist(da.arange(64_000, chunks=1000))  # 64 persisted partitions
    await wait(persisted)
    sizes = {}
    for name, ds in (("graph", Dataset.from_dask(big)), ("keys", Dataset.from_dask(persisted))):
        dataset_id = await asyncio.to_thread(dds.register_dataset, c, ds)
        registered = s.plugins[PLUGIN_NAME]._core.dataset(dataset_id)
        sizes[name] = len(registered.pipeline) + len(registered.splits)
    print("registered bytes:", sizes)
    assert sizes["graph"] < 64_000 and sizes["keys"] < 16_000
    hint = s.plugins[PLUGIN_NAME]._core.dataset(dataset_id).metadata[LOCALITY_KEY]
    assert len(hint) == 64 and tuple(hint[3][0]) == persisted.__dask_keys__()[3]


# -- locality: the dispatcher hands each worker its own partitions first --------------------


async def _dynamic_iteration(plugin, ds, workers):
    """A DYNAMIC iteration of ``ds`` with one task per worker address (no data-worker plugin:
    the test asks for splits itself)."""
    import cloudpickle as cp

    reply = await plugin.register_dataset(
        fingerprint=ds.fingerprint(), pipeline=cp.dumps(ds), splits=cp.dumps(ds.splits()),
        num_splits=len(ds.splits()), metadata=locality_metadata(ds._op))
    job = await plugin.get_or_create_job(dataset_id=reply["dataset_id"], processing_mode="DYNAMIC")
    token = job["job_token"]
    view = await plugin.get_or_create_iteration(job_id=job["job_id"], job_token=token)
    assert not plugin.state.tasks_for_iteration(view["iteration_id"])
    tasks = {}
    for address in workers:
        plugin._apply(RegisterWorker(address, "127.0.0.1", 1))
        task_id = plugin.state.next_task_id()
        plugin._apply(CreateTask(task_id, view["iteration_id"], address))
        tasks[address] = task_id
    return view["iteration_id"], tasks, token


#: Workers that run no data tasks (a "ps" resource): the test asks for splits in their name.
NOT_DATA_WORKERS = {"resources": {"ps": 1}}


@gen_cluster(client=True, nthreads=TWO, worker_kwargs=NOT_DATA_WORKERS)
async def test_dynamic_hands_each_worker_the_partitions_in_its_memory_first(c, s, a, b):
    x = c.persist(da.arange(160, chunks=10))
    await wait(x)
    keys = [k for k in x.__dask_keys__()]
    who = await c.scheduler.who_has(keys=keys)
    local = {w.address: [i for i, k in enumerate(keys) if w.address in who[k]] for w in (a, b)}
    assert local[a.address] and local[b.address], f"Dask put every chunk on one worker: {who}"
    work_dir = tempfile.mkdtemp(prefix="dds-locality-")
    plugin = DispatcherPlugin(fault_tolerant_mode=True, work_dir=work_dir)
    s.add_plugin(plugin)
    await plugin.start(s)
    try:
        iteration_id, tasks, token = await _dynamic_iteration(
            plugin, Dataset.from_dask(x), [a.address, b.address])

        async def get(address, count):
            reply = await plugin.get_split(iteration_id=iteration_id, task_id=tasks[address],
                                           repetition=0, count=count, job_token=token)
            assert reply["status"] == "OK", reply
            return reply["split_indices"], reply["end_of_splits"]

        first_a, _ = await get(a.address, 3)
        assert first_a == local[a.address][:3]
        rest_a, end = await get(a.address, 100)
        assert first_a + rest_a == local[a.address] and not end  # only its own splits
        # a has none of its own left: one of b's per request, b still gets the rest of its own
        stolen, _ = await get(a.address, 100)
        assert len(stolen) == 1 and stolen[0] in local[b.address]
        got_b, end = await get(b.address, 100)
        assert sorted(got_b + stolen) == local[b.address] and end
        assert plugin.state.split_position(iteration_id) == (1, 0, 16)
        plugin.state.validate_state()
        state = plugin.state
    finally:
        await plugin.close()
        s.plugins.pop(plugin.name, None)
    # the journal holds the explicit orders and replays to the same state
    records = [decode_update(r) for r in read_journal(work_dir)]
    handed = [list(r.indices) for r in records if isinstance(r, ProduceSplits)]
    assert handed == [first_a, rest_a, stolen, got_b]
    assert replay(records) == state
    shutil.rmtree(work_dir)


@gen_cluster(client=True, nthreads=TWO, worker_kwargs=NOT_DATA_WORKERS)
async def test_locality_blind_dataset_hands_out_splits_in_order(c, s, a, b):
    x = c.persist(da.arange(40, chunks=10))
    await wait(x)
    ds = Dataset.from_dask(x, locality=False)
    assert locality_metadata(ds._op) == {}
    assert ds.fingerprint() != Dataset.from_dask(x).fingerprint()
    plugin = DispatcherPlugin()
    s.add_plugin(plugin)
    await plugin.start(s)
    try:
        iteration_id, tasks, token = await _dynamic_iteration(plugin, ds, [b.address])
        reply = await plugin.get_split(iteration_id=iteration_id, task_id=tasks[b.address],
                                       repetition=0, count=8, job_token=token)
        assert reply["split_indices"] == [0, 1, 2, 3] and reply["end_of_splits"]
    finally:
        await plugin.close()
        s.plugins.pop(plugin.name, None)


def _reader_address(block):
    from dask_dataservice.service.worker.dask_source import current_worker as _current_worker

    return int(block[0]) // 10, _current_worker().address


@gen_cluster(client=True, nthreads=TWO, worker_kwargs=NOT_DATA_WORKERS)
async def test_partitions_no_worker_holds_go_out_in_batches(c, s, a, b):
    x = c.persist(da.arange(40, chunks=10))
    await wait(x)
    ds = Dataset.from_dask(x)
    plugin = DispatcherPlugin()
    s.add_plugin(plugin)
    await plugin.start(s)
    try:
        # release the keys (never published: registered at the dispatcher directly): the hint
        # points nowhere, as after a scheduler restart
        del x
        ds._op._collection = None
        await poll(lambda: not any(k in s.tasks for ks in ds.source.partition_keys for k in ks),
                   what="the scheduler to forget the partitions")
        iteration_id, tasks, token = await _dynamic_iteration(plugin, ds, [a.address])
        reply = await plugin.get_split(iteration_id=iteration_id, task_id=tasks[a.address],
                                       repetition=0, count=3, job_token=token)
        assert reply["split_indices"] == [0, 1, 2] and not reply["end_of_splits"]
    finally:
        await plugin.close()
        s.plugins.pop(plugin.name, None)


@gen_cluster(client=True, nthreads=TWO)
async def test_only_partitions_read_elsewhere_move_between_workers(c, s, a, b):
    x = c.persist(da.arange(400, chunks=10))  # 40 partitions
    await wait(x)
    keys = list(x.__dask_keys__())
    who = await c.scheduler.who_has(keys=keys)
    assert all(len(holders) == 1 for holders in who.values())
    elsewhere = {}
    for locality in (True, False):  # blind second: its fetches leave replicas behind
        # where each partition is now (the first pass's fetches left replicas behind too)
        who = await c.scheduler.who_has(keys=keys)
        before = {w.address: len(w.transfer_incoming_log) for w in (a, b)}
        ds = Dataset.from_dask(x, rows=False, locality=locality).map(_reader_address)
        out = await read(await distribute(ds, "DYNAMIC", c))
        assert sorted(p for p, _ in out) == list(range(40))  # each partition exactly once
        read_elsewhere = {keys[p] for p, address in out if address not in who[keys[p]]}
        moved = {key for w in (a, b) for e in list(w.transfer_incoming_log)[before[w.address]:]
                 for key in e["keys"]}
        # a partition in the reader's memory is read in place; only the others move, once each
        assert moved == read_elsewhere
        elsewhere[locality] = len(read_elsewhere)
    print("partitions read away from their worker (aware, blind):", elsewhere)
    assert elsewhere[False] > 0  # in index order, a worker reads partitions the other holds


# -- bad input: another cluster, lost partitions ------------------------------------------------


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_collection_persisted_on_another_cluster_is_a_clear_error(c, s, a):
    async with LocalCluster(n_workers=1, processes=False, asynchronous=True,
                            dashboard_address=":0") as other, \
            Client(other, asynchronous=True, set_as_default=False) as c2:
        x = c2.persist(da.arange(20, chunks=10))
        await wait(x)
        ds = Dataset.from_dask(x)
        with pytest.raises(ValueError, match=r"persisted on another Dask cluster \(scheduler "
                                             rf"{other.scheduler.id}\); the data service's "
                                             rf"scheduler is {s.id}"):
            await read(await distribute(ds, "DYNAMIC", c))
        # a pipeline registered some other way still meets the check on the data worker
        import dask_dataservice.service.client as service_client

        async def no_check(client, op):
            return None

        real, service_client.pin_persisted = service_client.pin_persisted, no_check
        try:
            with pytest.raises(ValueError, match=rf"{other.scheduler.id}\); this data worker's "
                                                 rf"scheduler is {s.id}"):
                await read(await distribute(ds, "DYNAMIC", c))
        finally:
            service_client.pin_persisted = real
        del ds, x


@gen_cluster(client=True, nthreads=TWO)
async def test_a_partition_lost_with_its_worker_is_recomputed_from_the_graph(c, s, a, b):
    x = c.persist(da.arange(100, chunks=10) * 2)
    await wait(x)
    who = await c.scheduler.who_has(keys=list(x.__dask_keys__()))
    on_b = [k for k, holders in who.items() if b.address in holders]
    assert on_b
    ds = Dataset.from_dask(x)
    await b.close()  # its partitions are lost; the scheduler recomputes them when asked
    out = await read(await distribute(ds, "DYNAMIC", c))
    assert sorted(int(v) for v in out) == [2 * i for i in range(100)]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_released_persisted_partition_is_an_error_naming_its_key(c, s, a):
    x = c.persist(da.arange(20, chunks=10) + 1)
    await wait(x)
    key = x.__dask_keys__()[0]
    ds = Dataset.from_dask(x)
    copy = cloudpickle.loads(cloudpickle.dumps(ds))  # the pipeline: keys only
    pin = ds.source.pin_name
    await asyncio.to_thread(dds.register_dataset, c, ds)  # publishes the partitions
    assert pin in s.extensions["publish"].datasets
    await c.unpublish_dataset(pin)
    del ds, x
    await poll(lambda: key not in s.tasks, what="the scheduler to forget the partition")
    with pytest.raises(DaskPartitionLostError, match=r"partition \('add-[0-9a-f]+', 0\) is no "
                                                     r"longer on the cluster"):
        await read(await distribute(copy, "DYNAMIC", c))


# -- the journaled explicit order: replay, snapshots, illegal records -----------------------


SETUP = (RegisterDataset(1000, "fp", b"p", b"s", 6), RegisterWorker("w1", "h", 1),
         RegisterWorker("w2", "h", 1), CreateJob(5000, None, 1000, "DYNAMIC", None, "AUTO", False),
         CreateIteration(2000, 5000, 0), CreateTask(4000, 2000, "w1"), CreateTask(4001, 2000, "w2"))


def _dynamic_state() -> DispatcherState:
    return replay(SETUP)


@pytest.mark.pure
def test_explicit_indices_replay_snapshot_and_accounting():
    state = _dynamic_state()
    updates = [ProduceSplits(2000, 0, 0, 2, 4000, indices=(4, 1)),
               ProduceSplits(2000, 0, 2, 1, 4001, indices=(0,))]
    for u in updates:
        assert decode_update(encode_update(u)) == u
        state.apply(u)
    state.validate_state()
    assert state.splits_in_flight(2000) == {(0, 0): 4000, (0, 1): 4000, (0, 2): 4001}  # positions
    assert decode_state(encode_state(state)) == state  # mid-repetition order survives snapshots
    state.apply(RemoveWorker("w2"))
    assert state.lost_splits(2000) == ((0, 2),)
    end = ProduceSplits(2000, 0, 3, 3, 4000, True, (5, 2, 3))
    state.apply(end)
    state.validate_state()
    assert state._split_orders == {} and state.split_position(2000) == (1, 0, 6)
    state.apply(FinishTask(4000))
    restored = replay([*SETUP, *updates, RemoveWorker("w2"), end, FinishTask(4000)])
    assert restored == state


@pytest.mark.pure
@pytest.mark.parametrize("bad, message", [
    (ProduceSplits(2000, 0, 1, 1, 4000, indices=(3,)), "whose earlier positions"),
    (ProduceSplits(2000, 0, 1, 2, 4000, indices=(3, 3)), "already handed out"),
    (ProduceSplits(2000, 0, 1, 1, 4000, indices=(4,)), "already handed out"),
    (ProduceSplits(2000, 0, 1, 1, 4000, indices=(6,)), "out of range"),
    (ProduceSplits(2000, 0, 1, 2, 4000, indices=(1,)), "1 indices for count 2"),
    (ProduceSplits(2000, 0, 1, 1, 4000), "without indices cannot follow"),
])
def test_illegal_explicit_orders_are_refused_and_change_nothing(bad, message):
    state = _dynamic_state()
    state.apply(ProduceSplits(2000, 0, 0, 1, 4000, indices=(4,)))
    if "earlier positions" in message:  # contiguous first, then explicit
        state = _dynamic_state()
        state.apply(ProduceSplits(2000, 0, 0, 1, 4000))
    before = state.snapshot()
    with pytest.raises(IllegalUpdateError, match=message):
        state.apply(bad)
    assert state.snapshot() == before


# -- a data worker waiting on a partition's computation stops with its task -----------------

GATE = threading.Event()
ENTERED = threading.Event()


def _gated(block):
    ENTERED.set()
    GATE.wait(60)  # released by the test once the data worker's thread has exited
    return block


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)], timeout=60,
             config={"dataservice.client.no-workers-timeout": "1s",
                     "dataservice.client.no-workers-warning": "100ms"})
async def test_closing_a_worker_stops_a_pipeline_waiting_on_a_partition(c, s, a, b):
    GATE.clear()
    ENTERED.clear()
    # one partition, computed (pinned) on the worker whose pipeline reads it: that worker's
    # only Dask thread runs the gated computation
    x = da.zeros(10, chunks=10).map_blocks(_gated, meta=np.array((), dtype=float))
    ds = await distribute(Dataset.from_dask(x), "DYNAMIC", c)
    consumer = asyncio.ensure_future(read(ds))
    try:
        await poll(lambda: ENTERED.is_set(), what="the partition computation to start")
        reading = next(w for w in (a, b) if w.state.executing_count)  # computes it
        plugin = reading.extensions["dataservice"]
        assert plugin._runners
        started = time.monotonic()
        await reading.close(executor_wait=False)  # the gated Dask task keeps its thread
        # the task thread left its wait for the partition; teardown did not wait for the
        # computation (which still waits on the gate): it took less than the 10 s join timeout
        assert not any(r.thread.is_alive() for r in plugin._runners)
        assert time.monotonic() - started < 8 and not GATE.is_set()
    finally:
        GATE.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(consumer, 20)


# -- real worker processes ----------------------------------------------------------------------


def _block_reader(block):
    from dask_dataservice.service.worker.dask_source import current_worker as _current_worker

    return int(block.flat[0]) // block.size, _current_worker().address


def _transferred_keys(dask_worker):
    return [key for e in dask_worker.transfer_incoming_log for key in e["keys"]]


@pytest.mark.process
@pytest.mark.slow
def test_worker_processes_read_a_persisted_array_where_it_lives():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                      memory_limit=0) as cluster, Client(cluster) as client:
        x = client.persist(da.arange(2000, chunks=100).reshape(200, 10).rechunk((10, 10)))
        wait(x)
        keys = [k for ks in x.__dask_keys__() for k in ks]
        who = client.sync(client.scheduler.who_has, keys=keys)
        before = {w: len(v) for w, v in client.run(_transferred_keys).items()}
        ds = Dataset.from_dask(x, rows=False).map(_block_reader)
        out = list(ds.apply(dds.distribute("DYNAMIC", client)))
        assert sorted(p for p, _ in out) == list(range(20))  # each partition exactly once
        moved = {tuple(k) if isinstance(k, list) else k
                 for w, v in client.run(_transferred_keys).items() for k in v[before[w]:]}
        elsewhere = {keys[p] for p, address in out if address not in who[keys[p]]}
        assert moved == elsewhere
        # only a worker done with its own partitions takes the other's: never more than one
        # worker holds (in index order both would read the other's)
        held = collections.Counter(holders[0] for holders in who.values())
        assert len(elsewhere) <= max(held.values()), (len(elsewhere), held)
        del x, ds
