"""Items of docs/tf-compatibility.yaml that no other test checked: the strategy's
``run``, its number of replicas, and its refusal of a variable without a value."""

from __future__ import annotations

import pytest

import dask_dataservice as dds
from dask_dataservice.testing import gen_cluster
from dask_dataservice.testing._ps import warm_up_zarr

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]

warm_up_zarr()

from _helpers import PS, WK, in_thread  # noqa: E402


@gen_cluster(client=False, nthreads=[PS, WK])
async def test_strategy_run_in_a_scheduled_function(s, p0, w0):
    """Re-expresses cluster_coordinator_test.StrategyIntegrationTest.testStrategyRun: a
    scheduled ``worker_fn`` calls ``strategy.run(replica_fn, args=(input,))`` and its
    ``RemoteValue`` fetches ``input + v``; and the seed's custom loop, where ``worker_fn``
    runs ``strategy.run(replica_fn, args=(next(iterator),))``. One replica per worker
    (parameter_server_strategy_v2.py, ``_num_replicas_in_sync`` without GPUs), and a variable
    without ``initial_value`` is a ValueError (the seed's ``_create_variable`` refuses it
    under a partitioner; here with or without one)."""
    def body(c):
        strategy = dds.ParameterServerStrategy(c)
        coordinator = dds.ClusterCoordinator(strategy)
        assert strategy.num_replicas_in_sync == 1
        with strategy.scope():
            v = dds.Variable(initial_value=1)

        def worker_fn(input_tensor):
            def replica_fn(input_tensor):
                return input_tensor + v
            return strategy.run(replica_fn, args=(input_tensor,))

        result = coordinator.schedule(worker_fn, args=(3,))
        assert isinstance(result, dds.ps.coordinator.RemoteValue)
        assert result.fetch() == 4

        contexts = []

        def dataset_fn(input_context):
            contexts.append((input_context.num_input_pipelines, input_context.input_pipeline_id,
                             input_context.num_replicas_in_sync))
            return dds.Dataset.range(3)

        assert iter(dataset_fn(dds.ps.strategy.InputContext())) is not None
        assert contexts == [(1, 0, 1)]
        per_worker = coordinator.create_per_worker_dataset(
            strategy.distribute_datasets_from_function(dataset_fn))

        def train_fn(iterator):
            def replica_fn(inputs):
                return int(inputs) * 10
            return strategy.run(replica_fn, args=(next(iterator),))

        iterator = iter(per_worker)
        results = [coordinator.schedule(train_fn, args=(iterator,)) for _ in range(3)]
        coordinator.join()
        # each element once; functions start in no promised order, even on one worker
        # (docs/parameter-server.md; TensorFlow promises none either)
        assert sorted(r.fetch() for r in results) == [0, 10, 20]
        assert coordinator.schedule(lambda: strategy.num_replicas_in_sync).fetch() == 1

        with strategy.scope(), pytest.raises(ValueError, match="^initial_value must be given$"):
            dds.Variable(shape=(4, 2), dtype="float32")

    await in_thread(s, body)
