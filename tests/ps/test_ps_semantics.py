"""ParameterServerStrategy semantics as TensorFlow users expect them (issue 9, section 3),
and the layering promises of issue 10 that only show on a cluster."""

from __future__ import annotations

import asyncio
import pickle
import threading
import time

import numpy as np
import pytest
from distributed import Client

import dask_dataservice as dds
from dask_dataservice.errors import ParameterServerError, ParameterServerUnavailableError
from dask_dataservice.ps import _routing, coordinator_context
from dask_dataservice.ps._runner_plugin import RUNNER_NAME
from dask_dataservice.ps.coordinator import ClosureCancelledError
from dask_dataservice.ps.server import PLUGIN_NAME, ParameterServerPlugin
from dask_dataservice.testing import gen_cluster
from dask_dataservice.testing._ps import warm_up_zarr

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]

warm_up_zarr()

from _helpers import PS, WK, in_thread  # noqa: E402

#: Shared by the in-process workers of one test (functions here pickle by reference).
STARTED = threading.Event()
RELEASE = threading.Event()


def _slow_step():
    STARTED.set()
    assert RELEASE.wait(30)
    return "finished late"


def _failing_step():
    raise ValueError("boom")


def _ok_step(i):
    return i


# -- 3.1 / 3.6: the tutorial's dataset pattern, error types ------------------------------------

@gen_cluster(client=False, nthreads=[PS, WK, WK])
async def test_tutorial_dataset_pattern_and_tf_error_types(s, p0, w0, w1):
    def body(c):
        strategy = dds.ParameterServerStrategy(c)
        coord = dds.ClusterCoordinator(strategy)

        def dataset_fn(ctx):
            assert ctx.num_input_pipelines == 1
            return dds.Dataset.range(5).map(lambda x: x * 10)

        # the strategy travels into the closure by reference (it holds a Client)
        per_worker = coord.create_per_worker_dataset(
            lambda: strategy.distribute_datasets_from_function(dataset_fn))
        it = iter(per_worker)
        assert coord.schedule(lambda i: next(i), args=(it,)).fetch() == 0
        assert pickle.loads(pickle.dumps(strategy)) is strategy  # the live one, here
        # iterating a distributed dataset on the coordinator is TF's ValueError
        with pytest.raises(ValueError, match="create_per_worker_dataset"):
            iter(strategy.experimental_distribute_dataset(dds.Dataset.range(3)))
        with pytest.raises(ValueError, match="create_per_worker_dataset"):
            iter(strategy.distribute_datasets_from_function(dataset_fn))
        with pytest.raises(TypeError):
            dds.ShardedVariable(None)
        # 3.2: a RemoteValue argument is refused at schedule time
        rv = coord.schedule(_ok_step, args=(1,))
        with pytest.raises(ValueError, match="RemoteValue"):
            coord.schedule(_ok_step, args=(rv,))
        with pytest.raises(ValueError, match="RemoteValue"):
            coord.schedule(_ok_step, kwargs={"i": {"nested": rv}})
        coord.join()

    await in_thread(s, body)


# -- 3.3: cancellation of functions that finish after a failure ---------------------------------

@gen_cluster(client=False, nthreads=[PS, WK, WK],
             config={"dataservice.ps.batches-in-flight": 1})
async def test_functions_finishing_after_a_failure_are_cancelled(s, p0, w0, w1):
    STARTED.clear()
    RELEASE.clear()

    def body(c):
        strategy = dds.ParameterServerStrategy(c)
        coord = dds.ClusterCoordinator(strategy)
        slow = coord.schedule(_slow_step)
        assert STARTED.wait(10)  # one worker is busy with it (one batch in flight)
        bad = coord.schedule(_failing_step)  # so this one runs on the other worker
        deadline = time.monotonic() + 10
        while not bad.done():
            assert time.monotonic() < deadline
            time.sleep(0.005)
        RELEASE.set()  # the slow one finishes successfully, after the failure
        with pytest.raises(ClosureCancelledError):
            slow.fetch()
        with pytest.raises(ValueError, match="boom"):
            bad.fetch()
        with pytest.raises(ValueError, match="boom"):
            coord.join()
        coord.join()  # cleared
        assert coord.schedule(_ok_step, args=(7,)).fetch() == 7

    await in_thread(s, body)
    # finding 8: the poisoned-generation record is gone once a newer generation ran there
    for w in (w0, w1):
        runner = w.extensions[RUNNER_NAME]
        assert len(runner.poisoned) <= 1
    ran_new = [w for w in (w0, w1) if w.extensions[RUNNER_NAME].stats["closures"] >= 1]
    assert ran_new


# -- 3.4: TensorFlow-style partition-aware initializers -----------------------------------------

@gen_cluster(client=False, nthreads=[PS, PS, WK])
async def test_tf_and_keras_initializers_build_each_partition_on_its_ps(s, p0, p1, w0):
    full = np.arange(40, dtype="f4").reshape(10, 4)

    def body(c):
        strategy = dds.ParameterServerStrategy(
            c, variable_partitioner=dds.partitioners.FixedShardsPartitioner(2))
        calls = []

        def tf_style(shard_info):
            calls.append(shard_info)
            a = shard_info.offset[0]
            return full[a:a + shard_info.shape[0]]

        def keras_style(shape, dtype=None, partition_shape=None, partition_offset=None):
            a = partition_offset[0]
            return full[a:a + partition_shape[0]].astype(dtype)

        def broken(shape, dtype, partition_offset):
            raise TypeError("a bug in my initializer")

        with strategy.scope():
            a = dds.Variable(tf_style, shape=(10, 4), dtype="f4", name="a")
            b = dds.Variable(keras_style, shape=(10, 4), dtype="f4", name="b")
            with pytest.raises(TypeError, match="a bug in my initializer"):
                dds.Variable(broken, shape=(10, 4), dtype="f4", name="c")
        assert isinstance(a, dds.ShardedVariable) and a.offsets == [0, 5, 10]
        np.testing.assert_array_equal(a.numpy(), full)
        np.testing.assert_array_equal(b.numpy(), full)
        assert calls == []  # called on the parameter servers, not here

    await in_thread(s, body)


# -- 3.5: the missing API -----------------------------------------------------------------------

def _worker_index_step():
    return coordinator_context.get_current_worker_index()


@gen_cluster(client=False, nthreads=[PS, PS, WK, WK])
async def test_scatter_ops_reduce_colocation_and_worker_index(s, p0, p1, w0, w1):
    def body(c):
        strategy = dds.ParameterServerStrategy(
            c, variable_partitioner=dds.partitioners.FixedShardsPartitioner(2))
        coord = dds.ClusterCoordinator(strategy)
        base = np.arange(1, 25, dtype="f8").reshape(8, 3)
        ids = np.array([6, 1, 6, 3])
        upd = np.linspace(1.5, 3.0, 12).reshape(4, 3)
        with strategy.scope():
            v = dds.Variable(base, name="v")
        local = dds.Variable(base)
        expected = base.copy()
        for op, ufunc in (("mul", np.multiply), ("div", np.divide), ("max", np.maximum),
                          ("min", np.minimum)):
            getattr(v, f"scatter_{op}")(ids, upd)
            getattr(local, f"scatter_{op}")(ids, upd)
            ufunc.at(expected, ids, upd)
            np.testing.assert_allclose(v.numpy(), expected, err_msg=op)
            np.testing.assert_allclose(local.numpy(), expected, err_msg=op)
        # strategy.reduce: one replica per worker
        assert strategy.reduce("SUM", np.array([1.0, 2.0]), axis=None).tolist() == [1.0, 2.0]
        assert float(strategy.reduce(dds.ps.strategy.ReduceOp.MEAN, np.array([1.0, 3.0]),
                                     axis=0)) == 2.0
        # colocate_vars_with: same PS, never partitioned
        with strategy.scope():
            w = dds.Variable(0.0, name="w")  # rank 0: never partitioned
            with strategy.extended.colocate_vars_with(w):
                big = dds.Variable(np.zeros((100, 2)), name="big")
        assert isinstance(big, dds.Variable) and big.ps_address == w.ps_address
        with pytest.raises(ValueError, match="per_worker_variable=True makes one copy"):
            dds.Variable(0.0, per_worker_variable=True)  # outside a strategy's scope
        # assign(read_value=False) returns None, as TF returns an op
        assert w.assign(1.0, read_value=False) is None
        assert w.assign_add(1.0) is w and float(w.numpy()) == 2.0
        # the worker index inside scheduled functions
        seen = {coord.schedule(_worker_index_step).fetch() for _ in range(40)}
        assert seen <= {0, 1} and seen
        with pytest.raises(RuntimeError, match="scheduled"):
            coordinator_context.get_current_worker_index()

    await in_thread(s, body)


# -- issue 10, finding 5: two strategies never cross; a hung PS times out -----------------------

@gen_cluster(client=False, nthreads=[PS, WK])
async def test_two_strategies_in_one_process_do_not_cross(s, p0, w0):
    def body(c):
        with Client(s.address, set_as_default=False) as other:
            first = dds.ParameterServerStrategy(c)
            second = dds.ParameterServerStrategy(other)
            with first.scope():
                v = dds.Variable(np.ones(3), name="v")
            copy = pickle.loads(pickle.dumps(v))
            assert _routing.client_of(copy._owner) is c
            np.testing.assert_array_equal(copy.numpy(), np.ones(3))
            assert second.client is other
        with second.scope():
            pass
        # second's client is closed: its handles say so instead of using the first's client
        with first.scope():
            pass
        copy2 = pickle.loads(pickle.dumps(v))
        copy2._owner = second._uid
        with pytest.raises(ParameterServerError, match="client is open"):
            copy2.numpy()

    await in_thread(s, body)


class HangingReads(ParameterServerPlugin):
    """A parameter server whose reads never answer (until the test ends)."""

    async def setup(self, worker):
        await super().setup(worker)
        self.release = asyncio.Event()
        plain = self.read

        async def read(key):
            await self.release.wait()
            return await plain(key)

        worker.handlers["ps_read"] = read

    async def teardown(self, worker):
        self.release.set()
        await super().teardown(worker)


@gen_cluster(client=False, nthreads=[PS, WK], config={"dataservice.ps.request-timeout": "1s"})
async def test_a_hung_parameter_server_times_out_instead_of_hanging(s, p0, w0):
    def body(c):
        c.register_plugin(HangingReads(), name=PLUGIN_NAME)
        strategy = dds.ParameterServerStrategy(c)
        coord = dds.ClusterCoordinator(strategy)
        with strategy.scope():
            v = dds.Variable(np.zeros(2), name="v")
        started = time.monotonic()
        with pytest.raises(ParameterServerUnavailableError, match="did not answer"):
            v.numpy()
        rv = coord.schedule(lambda: v.numpy())  # inside a function: the pipeline's wait
        with pytest.raises(ParameterServerUnavailableError, match="did not answer"):
            rv.fetch()
        assert time.monotonic() - started < 10
        with pytest.raises(ParameterServerUnavailableError):
            coord.join()
        coord.shutdown()

    await in_thread(s, body)
    p0.extensions[PLUGIN_NAME].release.set()


# -- finding 8: the coordinator's dead-worker record is pruned ----------------------------------

@gen_cluster(client=False, nthreads=[PS, WK, WK],
             config={"dataservice.ps.membership-interval": "50ms"})
async def test_dead_workers_are_forgotten_once_the_scheduler_drops_them(s, p0, w0, w1):
    ready, gone, checked = threading.Event(), threading.Event(), threading.Event()
    box = {}

    def body(c):
        strategy = dds.ParameterServerStrategy(c)
        coord = box["coord"] = dds.ClusterCoordinator(strategy)
        assert coord.schedule(_ok_step, args=(1,)).fetch() == 1
        ready.set()
        assert gone.wait(20)
        deadline = time.monotonic() + 10
        while w1.address in coord._feeders or coord._dead:
            assert time.monotonic() < deadline, (coord._feeders, coord._dead)
            time.sleep(0.01)
        assert [coord.schedule(_ok_step, args=(i,)).fetch() for i in range(5)] == list(range(5))
        checked.set()

    task = asyncio.ensure_future(in_thread(s, body))
    await asyncio.to_thread(ready.wait, 20)
    await w1.close()
    gone.set()
    await task
    assert checked.is_set()


# -- issue 9, section 1: asynchronous clients and threads with a running loop -------------------

@gen_cluster(client=True, nthreads=[PS, WK])
async def test_an_asynchronous_client_is_refused_with_what_to_do(c, s, p0, w0):
    with pytest.raises(TypeError, match="asyncio.to_thread"):
        dds.ParameterServerStrategy(c)


@gen_cluster(client=False, nthreads=[PS, WK])
async def test_the_api_works_from_a_thread_running_its_own_event_loop(s, p0, w0):
    def body(c):
        async def cell():  # as a Jupyter cell runs: inside the kernel's (running) loop
            strategy = dds.ParameterServerStrategy(c)
            coord = dds.ClusterCoordinator(strategy)
            with strategy.scope():
                v = dds.Variable(np.zeros(2), name="v")
            v.assign_add(np.ones(2))
            assert coord.schedule(_ok_step, args=(3,)).fetch() == 3
            coord.join()
            coord.shutdown()
            return v.numpy()

        return asyncio.run(cell())

    np.testing.assert_array_equal(await in_thread(s, body), np.ones(2))
