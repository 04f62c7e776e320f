"""dds.fit: epochs of scheduled steps, metrics on the coordinator, sync points, errors."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import dask_dataservice as dds
from dask_dataservice.ps.callbacks import Callback, LambdaCallback
from dask_dataservice.ps.fit import DatasetCreator, InputExhaustedError, fit
from dask_dataservice.testing import gen_cluster
from dask_dataservice.testing._ps import warm_up_zarr

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]

warm_up_zarr()

from _helpers import PS, WK, in_thread  # noqa: E402
from test_callbacks import _strategy_and_counter  # noqa: E402


def _counting_step(counter):
    def step(iterator):
        x = next(iterator)
        counter.assign_add(1)
        return {"one": 1.0, "x": float(x), "n": np.int64(2)}

    return step


@gen_cluster(client=False, nthreads=[PS, WK, WK])
async def test_fit_epochs_metrics_and_history(s, p0, w0, w1):
    def body(c):
        strategy, counter = _strategy_and_counter(c)
        calls = []
        rec = LambdaCallback(
            on_train_begin=lambda logs: calls.append(("train_begin",)),
            on_epoch_begin=lambda e, logs: calls.append(("epoch_begin", e)),
            on_train_batch_begin=lambda b, logs: calls.append(("batch_begin", b)),
            on_train_batch_end=lambda b, logs: calls.append(("batch_end", b, logs["one"])),
            on_epoch_end=lambda e, logs: calls.append(("epoch_end", e, logs)),
            on_train_end=lambda logs: calls.append(("train_end",)))
        # every worker reads 7, 7, 7, ...: the mean of x is exactly 7
        history = fit(strategy, _counting_step(counter),
                      DatasetCreator(lambda ctx: dds.Dataset.range(7, 8).repeat()),
                      epochs=2, steps_per_epoch=3, callbacks=[rec], verbose=False)
        assert history.epoch == [0, 1]
        assert history.history == {"one": [1.0, 1.0], "x": [7.0, 7.0], "n": [2.0, 2.0]}
        assert int(counter.numpy()) == 6
        logs = {"one": 1.0, "x": 7.0, "n": 2.0}
        epoch = [("batch_begin", 0), ("batch_begin", 1), ("batch_begin", 2),
                 ("batch_end", 0, 1.0), ("batch_end", 1, 1.0), ("batch_end", 2, 1.0)]
        assert calls == [("train_begin",), ("epoch_begin", 0), *epoch, ("epoch_end", 0, logs),
                         ("epoch_begin", 1), *epoch, ("epoch_end", 1, logs), ("train_end",)]

    await in_thread(s, body)


class _CheckJoined(Callback):
    """At each sync step every earlier update is in the counter."""

    join_every = 4

    def __init__(self, counter):
        super().__init__()
        self.counter = counter
        self.seen: list[tuple[int, int]] = []

    def on_train_batch_end(self, batch, logs=None):
        run = self.run
        if run.global_step % self.join_every == 0:
            self.seen.append((run.global_step, int(self.counter.numpy())))


@gen_cluster(client=False, nthreads=[PS, WK, WK])
async def test_join_every_joins_before_the_sync_step(s, p0, w0, w1):
    def body(c):
        strategy = dds.ParameterServerStrategy(c)
        coordinator = dds.ClusterCoordinator(strategy)
        with strategy.scope():
            counter = dds.Variable(0, dtype="i8", name="counter")
        check = _CheckJoined(counter)
        fit(coordinator, _counting_step(counter), lambda: dds.Dataset.range(3).repeat(),
            epochs=3, steps_per_epoch=10, callbacks=[check], verbose=False)
        # global steps 4, 8, ..., 28 (across epoch boundaries); the counter is exact at each
        assert check.seen == [(g, g) for g in range(4, 31, 4)]

    await in_thread(s, body)


@gen_cluster(client=False, nthreads=[PS, WK])
async def test_fit_errors(s, p0, w0):
    def body(c):
        strategy, counter = _strategy_and_counter(c)
        data = DatasetCreator(lambda ctx: dds.Dataset.range(5))
        step = _counting_step(counter)
        with pytest.raises(ValueError, match="steps_per_epoch is required"):
            fit(strategy, step, data)
        with pytest.raises(ValueError, match="steps_per_epoch must be a positive integer"):
            fit(strategy, step, data, steps_per_epoch=0)
        with pytest.raises(ValueError, match="epochs must be a positive integer"):
            fit(strategy, step, data, steps_per_epoch=1, epochs=0)
        with pytest.raises(TypeError, match="LambdaCallback"):
            fit(strategy, step, data, steps_per_epoch=1, callbacks=[lambda: None])
        with pytest.raises(TypeError, match="ParameterServerStrategy or its ClusterCoordinator"):
            fit(c, step, data, steps_per_epoch=1)
        with pytest.raises(TypeError, match="unknown hooks"):
            LambdaCallback(on_epoch_ended=print)
        # 5 elements, 8 steps: the input runs out (steps run in any order on the worker)
        with pytest.raises(InputExhaustedError, match=r"ran out of data in epoch 0 \(\d of "
                           r"its 8 steps had finished\): make the dataset repeat"):
            fit(strategy, step, data, steps_per_epoch=8, verbose=False)

        def bad_metrics(iterator):
            return {"loss": "high"}

        with pytest.raises(TypeError, match="metric 'loss' must be a number"):
            fit(strategy, bad_metrics, data, steps_per_epoch=2, verbose=False)

        def failing(iterator):
            raise KeyError("boom in a step")

        with pytest.raises(KeyError, match="boom in a step"):
            fit(strategy, failing, data, steps_per_epoch=3, verbose=False)
        # the coordinator is usable afterwards: the error was cleared
        history = fit(strategy, lambda it: 0.5, data, steps_per_epoch=2, verbose=False)
        assert history.history == {"loss": [0.5]}

    await in_thread(s, body)


@gen_cluster(client=False, nthreads=[PS, WK])
async def test_fit_on_a_data_service_job(s, p0, w0):
    # the training worker also serves data (PS never run data tasks): a DYNAMIC job of
    # 10 batches, 10 steps: each example trained on exactly once
    def body(c):
        strategy = dds.ParameterServerStrategy(c)
        with strategy.scope():
            seen = dds.Variable(np.zeros(40, "i8"), name="seen")
        dataset_id = dds.register_dataset(c, dds.Dataset.range(40).batch(4))
        address = c.scheduler.address

        def dataset_fn(input_context):
            return dds.from_dataset_id("distributed_epoch", address, dataset_id,
                                       job_name="fit-job")

        def step(iterator):
            ids = np.asarray(next(iterator))
            seen.scatter_add(ids, np.ones(len(ids), "i8"))
            return {"examples": float(len(ids))}

        history = fit(strategy, step, DatasetCreator(dataset_fn), steps_per_epoch=10,
                      verbose=False)
        assert history.history == {"examples": [4.0]}
        np.testing.assert_array_equal(seen.numpy(), np.ones(40, "i8"))

    await in_thread(s, body)


#: Shared by the in-process workers of the next test (its step pickles by reference).
AT_BARRIER = threading.Barrier(2, timeout=20)
FIT_COORDINATOR: list = []


def _step_that_fails_after_an_earlier_one_started(iterator):
    """Two steps meet; the later-scheduled one fails at once, the earlier one returns only
    after the coordinator recorded that failure (so it is cancelled by it)."""
    from dask_dataservice.ps import _routing

    me = _routing._thread.fn.fn_id
    ids = FIT_IDS
    ids.append(me)
    AT_BARRIER.wait()  # both run now, on the two workers
    if me == max(ids):
        raise KeyError("boom in the later step")
    coord = FIT_COORDINATOR[0]
    deadline = time.monotonic() + 20
    while coord._generation == 0:  # the failure was recorded: this step is now cancelled
        assert time.monotonic() < deadline, "the failure never reached the coordinator"
        time.sleep(0.005)
    return 1.0


FIT_IDS: list = []


@gen_cluster(client=False, nthreads=[PS, WK, WK])
async def test_fit_raises_the_failed_steps_error_when_a_later_step_fails_first(s, p0, w0, w1):
    """Step 1 fails while step 0 still runs: fit fetches step 0 first, which is cancelled,
    and must raise step 1's error (the one join() holds), not ClosureCancelledError (a CI run
    saw it; before the fix this ordering raised ClosureCancelledError every time)."""
    AT_BARRIER.reset()
    FIT_IDS.clear()
    FIT_COORDINATOR.clear()

    def body(c):
        strategy, _ = _strategy_and_counter(c)
        FIT_COORDINATOR.append(dds.ClusterCoordinator(strategy))
        data = DatasetCreator(lambda ctx: dds.Dataset.range(5).repeat())
        with pytest.raises(KeyError, match="boom in the later step"):
            fit(strategy, _step_that_fails_after_an_earlier_one_started, data,
                steps_per_epoch=2, verbose=False)
        assert len(FIT_IDS) == 2
        # the coordinator is usable afterwards: the error was cleared
        history = fit(strategy, lambda it: 0.5, data, steps_per_epoch=2, verbose=False)
        assert history.history == {"loss": [0.5]}

    await in_thread(s, body)
