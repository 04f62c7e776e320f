"""A training worker killed in the middle of a Keras ``model.fit`` on parameter servers."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest
from _helpers import needs
from distributed import Client, Nanny, get_worker

import dask_dataservice as dds
from dask_dataservice.ps import _routing
from dask_dataservice.testing import gen_cluster

dds_keras = needs("dask_dataservice.keras", "keras")  # sets KERAS_BACKEND=jax (inherited)
keras = needs("keras", "keras")

pytestmark = [pytest.mark.process, pytest.mark.slow, pytest.mark.timeout(90)]

PS = ("127.0.0.1", 1, {"resources": {"ps": 1}})
WK = ("127.0.0.1", 1)
ROWS, BATCH, EPOCHS, STEPS = 8, 8, 2, 40


def _model():
    """Linear in its weights under a linear loss: every batch moves each row by the same
    amount, so the final values count the batches applied."""
    return keras.Sequential([
        keras.Input((1,), dtype="int32"),
        keras.layers.Embedding(ROWS, 1, embeddings_initializer="zeros", name="emb"),
        keras.layers.Flatten()])


def _mean_prediction(y_true, y_pred):
    return keras.ops.mean(y_pred)


class _Gated:
    """The batches of one worker. The first worker to reach the 6th function of a scheduled
    batch of functions writes its port to ``gate.waiting`` and waits for the ``gate`` file,
    after the updates of the 5 before it landed: the test kills it at a known point,
    mid-batch, 5 functions applied."""

    def __init__(self, gate):
        self.gate = gate
        self.x = np.arange(BATCH, dtype="int32").reshape(BATCH, 1) % ROWS
        self.y = np.zeros((BATCH, 1), "float32")

    def __iter__(self):
        return self

    def __next__(self):
        pipeline = _routing._thread.pipeline
        if pipeline is not None and pipeline.current == 5 and self._first():
            pipeline.drain()
            deadline = time.monotonic() + 30
            while not os.path.exists(self.gate) and time.monotonic() < deadline:
                time.sleep(0.005)
        return self.x, self.y

    def _first(self):
        try:
            fd = os.open(f"{self.gate}.tmp", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.write(fd, get_worker().address.encode())
        os.close(fd)
        os.rename(f"{self.gate}.tmp", f"{self.gate}.waiting")  # "I am waiting"
        return True


def test_killed_training_worker_keeps_keras_updates_exactly_once(tmp_path):
    """A training worker killed mid-epoch: ``model.fit`` completes, each batch's update is
    applied exactly once (the final weights and ``optimizer.iterations`` count every batch
    once), though the victim's last functions ran again elsewhere. (TF:
    parameter_server_training_test.py / fault_tolerance_test.py, testWorkerPreemption...
    for Model.fit: closures of a lost worker are re-run.)"""
    gate = str(tmp_path / "gate")

    @gen_cluster(client=False, Worker=Nanny, nthreads=[PS, WK, WK], timeout=80,
                 config={"dataservice.ps.closures-per-batch": 20})
    async def run(s, n0, n1, n2):
        state = {}

        def train(c):
            strategy = dds.ParameterServerStrategy(c)
            with strategy.scope():
                model = _model()
            model.compile(optimizer=keras.optimizers.SGD(1.0), loss=_mean_prediction)
            state["model"] = model
            state["history"] = model.fit(
                dds.DatasetCreator(lambda ctx: _Gated(gate)), epochs=EPOCHS,
                steps_per_epoch=STEPS, verbose=0)
            state["skipped"] = sum(c.sync(c.rpc(a).ps_info)["stats"]["skipped"]
                                   for a in strategy.ps_addresses)
            state["coordinator"] = strategy._cluster_coordinator

        async with asyncio.timeout(75):
            c = await asyncio.to_thread(Client, s.address, set_as_default=False)
            try:
                fit = asyncio.create_task(asyncio.to_thread(train, c))
                marker = f"{gate}.waiting"
                while not os.path.exists(marker):  # a worker waits mid-batch
                    assert not fit.done(), fit.result()
                    await asyncio.sleep(0.01)
                with open(marker) as f:
                    address = f.read()
                victim = n1 if n1.worker_address == address else n2
                assert victim.worker_address == address
                await victim.process.process.kill()
                open(gate, "w").close()  # the other worker goes on
                await fit
            finally:
                await asyncio.to_thread(c.close)
        model = state["model"]
        n = EPOCHS * STEPS
        assert int(model.optimizer.iterations.numpy()) == n
        # loss = mean(prediction): each batch subtracts lr * (1/BATCH per id occurrence)
        # from each embedding row (every id once per batch)
        (emb,) = model.get_weights()
        np.testing.assert_array_equal(emb, np.full((ROWS, 1), -n / BATCH, "f4"))
        assert model.history.history["loss"][-1] < 0
        # the victim's applied functions ran again on the other worker, and the PS dropped
        # their repeated updates
        assert state["skipped"] >= 5

    run()
