"""Keras ``model.fit`` on parameter servers with a data-service dataset as input.

TensorFlow re-expressed: the seed's ``Model.fit`` input forms ("Input: DatasetCreator ...
tf.data service": a ``dataset_fn`` whose dataset reads from the tf.data service, as
tensorflow/python/keras/distribute/parameter_server_training_test.py ``testModelFit`` fits a
model created in ``strategy.scope()``), with the reader released when ``fit`` ends
(data_service_ops_test.py ``testGcClient``).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from _helpers import PS, WK, in_thread, needs
from test_keras import BATCH, STEPS, _data, _local_fit, _model

import dask_dataservice as dds
from dask_dataservice.testing import gen_cluster
from dask_dataservice.testing._ps import warm_up_zarr

needs("dask_dataservice.keras", "keras")  # sets KERAS_BACKEND=jax first
keras = needs("keras", "keras")

warm_up_zarr()


def _acquired(dask_scheduler):
    from dask_dataservice.service.dispatcher.plugin import PLUGIN_NAME

    return len(dask_scheduler.plugins[PLUGIN_NAME].state.list_iteration_clients())


@pytest.mark.cluster
@gen_cluster(client=False, nthreads=[PS, WK], timeout=60)
async def test_model_fit_on_a_data_service_dataset(s, p0, w0):
    """``model.fit(dataset)`` where the dataset reads the data service (one data worker,
    ``parallel_epochs``: the batches in order) and ``DatasetCreator(dataset_fn)`` whose
    ``dataset_fn`` returns ``from_dataset_id(...)``: the steps read exactly the registered
    batches (the loss curve is Keras' local fit's on them), ``optimizer.iterations`` ==
    the steps run, and the readers are released when fit returns."""
    def body(c):
        strategy = dds.ParameterServerStrategy(c)
        with strategy.scope():
            model = _model()
        initial = model.get_weights()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
        x, y = _data()
        dataset_id = dds.register_dataset(
            c, dds.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat())
        address = c.scheduler.address
        service = dds.from_dataset_id("parallel_epochs", address, dataset_id)
        history = model.fit(service, epochs=1, steps_per_epoch=STEPS, verbose=0)
        _, local = _local_fit(initial, keras.optimizers.SGD(0.05), 1)
        for key in ("loss", "mae"):
            np.testing.assert_allclose(history.history[key], local[key], rtol=1e-5)
        assert int(model.optimizer.iterations.numpy()) == STEPS
        deadline = time.monotonic() + 10
        while c.run_on_scheduler(_acquired):
            assert time.monotonic() < deadline, "the fit's reader is still acquired"
            time.sleep(0.02)

        creator = dds.DatasetCreator(
            lambda ctx: dds.from_dataset_id("parallel_epochs", address, dataset_id))
        history = model.fit(creator, epochs=1, steps_per_epoch=STEPS, verbose=0)
        assert len(history.history["loss"]) == 1
        assert int(model.optimizer.iterations.numpy()) == 2 * STEPS

    await in_thread(s, body)
