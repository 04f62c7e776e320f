"""fit releases the per-worker iterators it built (a data-service dataset's readers) on every
training worker: at its normal end, after an error, after an early stop; a per-worker dataset
of ``create_per_worker_dataset`` is released when garbage-collected or at ``shutdown``.

TensorFlow frees a worker's per-worker resources with the distributed iterator
(tensorflow/python/distribute/coordinator/cluster_coordinator.py, ``PerWorkerDatasetFromDatasetFunction``
and its iterators' resource handles deleted with them); a tf.data service reader releases its
job client when its iterator is deleted
(tensorflow/python/data/experimental/kernel_tests/service/data_service_ops_test.py,
``testGcClient``: a deleted iterator's client is released by the dispatcher).
"""

from __future__ import annotations

import gc
import time

import pytest

import dask_dataservice as dds
from dask_dataservice.ps._runner_plugin import RUNNER_NAME
from dask_dataservice.ps.callbacks import LambdaCallback
from dask_dataservice.ps.fit import DatasetCreator, fit
from dask_dataservice.testing import gen_cluster
from dask_dataservice.testing._ps import warm_up_zarr

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]

warm_up_zarr()

from _helpers import PS, WK, in_thread  # noqa: E402


def _acquired(dask_scheduler):
    from dask_dataservice.service.dispatcher.plugin import PLUGIN_NAME

    return len(dask_scheduler.plugins[PLUGIN_NAME].state.list_iteration_clients())


def _held(dask_worker):
    return len(dask_worker.extensions[RUNNER_NAME]._iterators)


def wait_released(c, limit=10.0):
    """Wait (with a deadline) until the dispatcher has no iteration client acquired and no
    training worker holds a per-worker iterator."""
    deadline = time.monotonic() + limit
    while True:
        acquired = c.run_on_scheduler(_acquired)
        held = {k: v for k, v in c.run(_held).items() if v}
        if not acquired and not held:
            return
        assert time.monotonic() < deadline, (acquired, held)
        time.sleep(0.02)


def _service(c):
    dataset_id = dds.register_dataset(c, dds.Dataset.range(10).repeat())
    address = c.scheduler.address

    def dataset_fn(input_context):
        return dds.from_dataset_id("parallel_epochs", address, dataset_id)

    return dataset_fn


@gen_cluster(client=False, nthreads=[PS, WK, WK])
async def test_fit_releases_its_data_service_readers(s, p0, w0, w1):
    """dds.fit over a DatasetCreator reading the data service: when fit ends (normally,
    with a step's error, stopped by a callback), every training worker's reader is released
    on the dispatcher (before the fix, two iteration clients stayed acquired and the
    cleanup check failed)."""
    def body(c):
        strategy = dds.ParameterServerStrategy(c)
        creator = DatasetCreator(_service(c))
        # each training worker reads its own pass: 0, 1, 2, ... (6 steps between two)
        history = fit(strategy, lambda it: float(next(it)), creator, steps_per_epoch=6,
                      verbose=False)
        assert len(history.history["loss"]) == 1
        assert c.run_on_scheduler(_acquired) in (0, 1, 2)  # released, or being released
        wait_released(c)

        def failing(it):
            if next(it) == 1:
                raise KeyError("boom after a read")
            return 0.0

        with pytest.raises(KeyError, match="boom after a read"):
            fit(strategy, failing, creator, steps_per_epoch=6, verbose=False)
        wait_released(c)

        def stop(epoch, logs):
            stopper.run.stop_training = True

        stopper = LambdaCallback(on_epoch_end=stop)
        history = fit(strategy, lambda it: float(next(it)), creator, epochs=3,
                      steps_per_epoch=2, callbacks=[stopper], verbose=False)
        assert history.epoch == [0]
        wait_released(c)

    await in_thread(s, body)


@gen_cluster(client=False, nthreads=[PS, WK])
async def test_per_worker_dataset_released_when_collected_or_at_shutdown(s, p0, w0):
    """coordinator.create_per_worker_dataset over the data service: the workers' readers
    stay while the dataset or an iterator of it lives (fit does not close an input it was
    given), and are released once both are garbage-collected, or at shutdown."""
    def body(c):
        strategy = dds.ParameterServerStrategy(c)
        coordinator = dds.ClusterCoordinator(strategy)
        dataset_fn = _service(c)
        per_worker = coordinator.create_per_worker_dataset(dataset_fn)
        iterator = iter(per_worker)
        first = [coordinator.schedule(next, args=(iterator,)).fetch() for _ in range(3)]
        assert first == [0, 1, 2]
        fit(strategy, lambda it: float(next(it)), iterator, steps_per_epoch=2, verbose=False)
        assert coordinator.schedule(next, args=(iterator,)).fetch() == 5  # still open
        assert c.run_on_scheduler(_acquired) == 1
        del per_worker, iterator
        gc.collect()
        wait_released(c)

        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
        assert coordinator.schedule(next, args=(iterator,)).fetch() == 0
        assert c.run_on_scheduler(_acquired) == 1
        coordinator.shutdown()
        wait_released(c)

    await in_thread(s, body)
