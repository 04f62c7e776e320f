"""StaticHashTable / DistributedTable: vectorised lookups, defaults, lazy replication."""

from __future__ import annotations

import asyncio
import os
import pickle
import tempfile

import numpy as np
import pytest
from distributed import Nanny

import dask_dataservice as dds
from dask_dataservice.ps import tables
from dask_dataservice.ps.tables import DistributedTable, StaticHashTable
from dask_dataservice.testing import gen_cluster
from dask_dataservice.testing._ps import warm_up_zarr

pytestmark = [pytest.mark.pure, pytest.mark.timeout(60)]

warm_up_zarr()

from _helpers import PS, WK, in_thread  # noqa: E402


def test_local_lookup_shapes_defaults_and_errors():
    t = StaticHashTable(np.array([30, 10, 20]), np.array([3.0, 1.0, 2.0]), default_value=-1.0)
    np.testing.assert_array_equal(t.lookup([10, 11, 30, 40, -5]), [1.0, -1.0, 3.0, -1.0, -1.0])
    np.testing.assert_array_equal(t.lookup(np.array([[20, 99], [10, 30]])),
                                  [[2.0, -1.0], [1.0, 3.0]])
    assert t.size() == 3 and t[np.int64(20)] == 2.0
    words = StaticHashTable(["b", "a", "c"], [[1, 1], [0, 0], [2, 2]], default_value=[-1, -1])
    np.testing.assert_array_equal(words.lookup(["a", "zz", "c"]), [[0, 0], [-1, -1], [2, 2]])
    empty = StaticHashTable(np.array([], "i8"), np.array([], "f4"), default_value=7)
    np.testing.assert_array_equal(empty.lookup([1, 2]), [7.0, 7.0])
    with pytest.raises(ValueError, match=r"duplicate keys in a table: \[1\]"):
        StaticHashTable([1, 2, 1], [0, 0, 0], default_value=0)
    with pytest.raises(ValueError, match="1-d keys and as many values"):
        StaticHashTable([1, 2], [0], default_value=0)
    with pytest.raises(TypeError, match="table keys are <U1, looked up with int64"):
        words.lookup(np.array([1, 2]))
    assert DistributedTable is StaticHashTable
    # a local table pickles whole
    assert pickle.loads(pickle.dumps(t)).lookup([30]).tolist() == [3.0]


def test_from_file_with_line_numbers():
    with tempfile.NamedTemporaryFile("w", suffix=".tsv", delete=False) as f:
        f.write("apple\t5\nbanana\t7\n\ncherry\t9\n")
    try:
        t = StaticHashTable.from_file(f.name, default_value=0)
        np.testing.assert_array_equal(t.lookup(["cherry", "apple", "kiwi"]), [9, 5, 0])
        by_line = StaticHashTable.from_file(f.name, value_column=-1, default_value=-1)
        np.testing.assert_array_equal(by_line.lookup(["apple", "banana", "cherry"]), [0, 1, 3])
        bad = StaticHashTable.from_file(f.name, value_column=4)
        with pytest.raises(ValueError, match=r":1: expected columns 0 and 4, got 2 fields"):
            bad.lookup(["apple"])
    finally:
        os.unlink(f.name)


@pytest.mark.cluster
@gen_cluster(client=False, nthreads=[PS, WK, WK])
async def test_distributed_table_fetched_once_per_worker(s, p0, w0, w1):
    def body(c):
        strategy = dds.ParameterServerStrategy(c)
        coordinator = dds.ClusterCoordinator(strategy)
        keys = np.arange(0, 200_000, 2)  # even numbers
        with strategy.scope():
            table = StaticHashTable(keys, keys * 10, default_value=-1)
        # small on the wire: the data stays on the PS
        assert len(pickle.dumps(table)) < 2000
        assert table._remote[0] == strategy.ps_addresses[0]

        def step(ids):
            from distributed import get_worker

            return get_worker().address, table.lookup(np.asarray(ids)).tolist()

        rvs = [coordinator.schedule(step, args=([i, i + 1, 10**9],)) for i in range(0, 40, 2)]
        coordinator.join()
        results = [rv.fetch() for rv in rvs]
        for i, (_, values) in zip(range(0, 40, 2), results, strict=True):
            assert values == [10 * i, -1, -1]
        # coordinator-side lookups are local
        assert table.lookup([4]).tolist() == [40]
        return {addr for addr, _ in results}

    used = await in_thread(s, body)
    # each worker that ran steps built the index once, from the PS
    for w in (w0, w1):
        cached = tables._INDEXES.get(w, {})
        assert len(cached) == (1 if w.address in used else 0)


@pytest.mark.cluster
@gen_cluster(client=False, nthreads=[PS, WK])
async def test_restarted_worker_builds_the_table_again(s, p0, w0):
    def body(c):
        strategy = dds.ParameterServerStrategy(c)
        coordinator = dds.ClusterCoordinator(strategy)
        with strategy.scope():
            table = StaticHashTable(["x", "y"], [1, 2], default_value=0)

        def step():
            return table.lookup(["y", "q"]).tolist()

        assert coordinator.schedule(step).fetch() == [2, 0]
        return table

    await in_thread(s, body)
    assert len(tables._INDEXES[w0]) == 1
    # a worker process that restarted starts without the index (a new Worker object):
    # simulate by dropping this worker's cache; the next lookup fetches from the PS again
    del tables._INDEXES[w0]

    def again(c):
        strategy = dds.ParameterServerStrategy(c)
        coordinator = dds.ClusterCoordinator(strategy)
        with strategy.scope():
            table = StaticHashTable(["x", "y"], [1, 2], default_value=0)
        assert coordinator.schedule(lambda: table.lookup(["x"]).tolist()).fetch() == [1]

    await in_thread(s, again)
    assert len(tables._INDEXES[w0]) == 1


@pytest.mark.process
@pytest.mark.slow
@gen_cluster(client=False, Worker=Nanny, nthreads=[PS, WK], timeout=80)
async def test_a_restarted_worker_process_recreates_the_table(s, n_ps, n_wk):
    from distributed import Client

    c = await asyncio.to_thread(Client, s.address, set_as_default=False)
    try:
        def create(c):
            strategy = dds.ParameterServerStrategy(c)
            coordinator = dds.ClusterCoordinator(strategy)
            with strategy.scope():
                table = StaticHashTable(np.array(["x", "y"]), np.array([1, 2]), default_value=0)

            def step():
                import os

                return os.getpid(), table.lookup(["y", "q"]).tolist()

            return coordinator, step

        coordinator, step = await asyncio.to_thread(create, c)
        pid, values = await asyncio.to_thread(lambda: coordinator.schedule(step).fetch())
        assert values == [2, 0]
        await n_wk.kill()  # the worker process dies; the nanny starts a new one
        await n_wk.instantiate()
        # a new process, without the index: the next lookup builds it from the PS again
        new_pid, values = await asyncio.to_thread(lambda: coordinator.schedule(step).fetch())
        assert new_pid != pid and values == [2, 0]
        await asyncio.to_thread(coordinator.shutdown)
    finally:
        await asyncio.to_thread(c.close)
