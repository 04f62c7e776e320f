"""Keras 3 models on parameter servers (dask_dataservice.keras, the JAX backend).

TensorFlow re-expressed: ``parameter_server_strategy_v2.py``'s ``Model.fit`` usage (a model
created in ``strategy.scope()``, ``compile``, ``fit(DatasetCreator, steps_per_epoch=...)``),
as tested by tensorflow/python/keras/distribute/parameter_server_training_test.py
(``testModelFit``, ``testModelFitWithStepsPerExecution``) and
dataset_creator_model_fit_test.py (``testModelFitCallbacks``, ``testModelFitWithNoStepsPerEpoch``).
"""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import PS, WK, in_thread, needs

import dask_dataservice as dds
from dask_dataservice.ps import _kernels
from dask_dataservice.ps import optimizers as ps_optimizers
from dask_dataservice.ps.callbacks import LambdaCallback
from dask_dataservice.testing import gen_cluster
from dask_dataservice.testing._ps import warm_up_zarr

dds_keras = needs("dask_dataservice.keras", "keras")  # sets KERAS_BACKEND=jax first
keras = needs("keras", "keras")

warm_up_zarr()

ROWS, DIM, IDS_PER_ROW, BATCH, STEPS = 40, 3, 4, 8, 6


def _data(seed=0, n=BATCH * STEPS):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, ROWS, (n, IDS_PER_ROW)).astype("int32")
    y = rng.standard_normal((n, 1)).astype("float32")
    return x, y


def _batches(x, y):
    return [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH)]


def _model():
    keras.utils.set_random_seed(7)
    return keras.Sequential([keras.Input((IDS_PER_ROW,), dtype="int32"),
                             keras.layers.Embedding(ROWS, DIM, name="emb"),
                             keras.layers.Flatten(),
                             keras.layers.Dense(4, activation="relu", name="hidden"),
                             keras.layers.Dense(1, name="out")])


def _local_fit(weights, optimizer, epochs, spe=1):
    """Keras' own single-process fit on the same batches, in the same order."""
    model = _model()
    model.set_weights(weights)
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"], steps_per_execution=spe)
    batches = _batches(*_data())

    def forever():
        while True:
            yield from batches

    history = model.fit(forever(), epochs=epochs, steps_per_epoch=STEPS, verbose=0)
    return model, history.history


def _dataset_fn(input_context):
    x, y = _data()
    return dds.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat()


@pytest.mark.cluster
@gen_cluster(client=False, nthreads=[PS, PS, WK], timeout=60)
async def test_model_fit_on_ps_follows_keras_local_fit(s, p0, p1, w0):
    """The seed's ``Model.fit`` form: a Keras model with an Embedding and Dense layers
    created in ``strategy.scope()`` (the table partitioned into a ShardedVariable over both
    PSs), compiled outside it, fit on a DatasetCreator with ``steps_per_execution`` and
    callbacks. With one training worker the steps apply in order, so the loss curve and
    compiled metrics are Keras' local fit's (float32 rounding aside: rtol 1e-5), and so are
    the final weights and ``optimizer.iterations``. (TF: parameter_server_training_test.py
    testModelFit, testModelFitWithStepsPerExecution; dataset_creator_model_fit_test.py
    testModelFitCallbacks.)"""
    def body(c):
        strategy = dds.ParameterServerStrategy(
            c, variable_partitioner=dds.partitioners.MinSizePartitioner(
                min_shard_bytes=256, max_shards=2))
        with strategy.scope():
            model = _model()
        initial = model.get_weights()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"],
                      steps_per_execution=2)
        epochs_seen, steps_seen = [], []
        history = model.fit(
            dds.DatasetCreator(_dataset_fn), epochs=3, steps_per_epoch=STEPS, verbose=0,
            callbacks=[keras.callbacks.LambdaCallback(
                           on_epoch_end=lambda epoch, logs: epochs_seen.append(epoch)),
                       LambdaCallback(
                           on_train_batch_end=lambda batch, logs: steps_seen.append(batch))])
        local, local_history = _local_fit(initial, keras.optimizers.SGD(0.05), 3, spe=2)
        assert isinstance(history, keras.callbacks.History) and history is model.history
        assert history.epoch == [0, 1, 2] and epochs_seen == [0, 1, 2]
        assert steps_seen == [0, 1, 2] * 3  # scheduled functions: 2 batches each
        assert sorted(history.history) == ["loss", "mae"]
        for key in ("loss", "mae"):
            np.testing.assert_allclose(history.history[key], local_history[key], rtol=1e-5)
        assert history.history["loss"][2] < history.history["loss"][0]
        # the weights live on the PSs; the Keras model holds a copy pulled after fit
        placed = dds_keras.on_ps(model)
        table = placed.by_path["sequential/emb/embeddings"]
        assert isinstance(table, dds.ShardedVariable) and len(table.variables) == 2
        assert {v.ps_address for v in table.variables} == {p0.address, p1.address}
        assert not isinstance(placed.by_path["sequential/out/bias"], dds.ShardedVariable)
        for ps_value, mine, theirs in zip(placed.values(), model.get_weights(),
                                          local.get_weights(), strict=True):
            np.testing.assert_array_equal(ps_value, mine)
            np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)
        assert int(model.optimizer.iterations.numpy()) == 3 * STEPS
        assert int(placed.iterations.numpy()) == 3 * STEPS
        # the worker (in this process) read the table by rows: the batch's ids only
        import importlib

        trainers = importlib.import_module("dask_dataservice.keras.step")._trainers
        assert [t.by_rows for t in trainers.values()][-1] == {0: None}

        # a second fit goes on from there; RMSprop (the seed's compile default) on the PSs
        # is Keras' RMSprop for dense weights (here: every weight is trained densely)
        model.compile(optimizer="rmsprop", loss="mse", metrics=["mae"])
        with pytest.raises(ValueError, match="already on another strategy"):
            dds_keras.on_ps(model, strategy=object())
        before = model.get_weights()
        h2 = dds_keras.fit(model, dds.DatasetCreator(_dataset_fn), epochs=1,
                           steps_per_epoch=STEPS, verbose=0)
        assert len(h2.history["loss"]) == 1
        # the model was compiled again: the servers now apply RMSprop, counting from 0
        assert isinstance(placed.optimizer, ps_optimizers.RMSprop)
        assert int(placed.iterations.numpy()) == STEPS == int(model.optimizer.iterations.numpy())
        assert not all(np.array_equal(a, b)
                       for a, b in zip(before, model.get_weights(), strict=True))

        # errors: checked before anything runs
        with pytest.raises(ValueError, match="steps_per_epoch is required"):
            model.fit(dds.DatasetCreator(_dataset_fn), epochs=1)
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
        with pytest.raises(ValueError, match=r"steps_per_epoch must be a positive multiple "
                                             r"of steps_per_execution \(4\), got 6"):
            model.fit(dds.DatasetCreator(_dataset_fn), steps_per_epoch=6)
        with pytest.raises(ValueError, match=r"fit\(batch_size=\.\.\.\) is not supported"):
            model.fit(dds.DatasetCreator(_dataset_fn), steps_per_epoch=4, batch_size=8)

    await in_thread(s, body)


@pytest.mark.cluster
@gen_cluster(client=False, nthreads=[PS, WK], timeout=60)
async def test_checkpoint_restores_into_a_plain_keras_model_and_back(s, p0, w0):
    """A dds.Checkpoint of a model trained on the PSs restores into a plain Keras model
    (``load_checkpoint`` -> ``set_weights``), whose ``.weights.h5`` loads back into the
    model on the PSs (pushed at the next fit). (TF: parameter_server_training_test.py's
    checkpoint save/restore of a Model.fit model.)"""
    import tempfile

    def body(c):
        strategy = dds.ParameterServerStrategy(c)
        with strategy.scope():
            model = _model()
        model.compile(optimizer="adagrad", loss="mse")
        model.fit(dds.DatasetCreator(_dataset_fn), epochs=1, steps_per_epoch=2, verbose=0)
        placed = dds_keras.on_ps(model)
        trained = placed.values()
        with tempfile.TemporaryDirectory() as tmp:
            dds.Checkpoint(model=placed).save(f"{tmp}/ckpt")
            plain = _model()  # not on the PSs
            dds_keras.load_checkpoint(plain, f"{tmp}/ckpt")
            for a, b in zip(plain.get_weights(), trained, strict=True):
                np.testing.assert_array_equal(a, b)
            # and back: other weights from a .weights.h5 file go to the PSs at the next fit
            plain.set_weights([w * 0 + 0.5 for w in trained])
            plain.save_weights(f"{tmp}/plain.weights.h5")
            model.load_weights(f"{tmp}/plain.weights.h5")
            assert placed.sync() is True and placed.sync() is False
            for value in placed.values():
                np.testing.assert_array_equal(value, np.full_like(value, 0.5))
            # and the checkpoint restores onto the PSs again
            dds.Checkpoint(model=placed).restore(f"{tmp}/ckpt")
            placed.pull()
            for a, b in zip(model.get_weights(), trained, strict=True):
                np.testing.assert_array_equal(a, b)

    await in_thread(s, body)


@pytest.mark.cluster
@gen_cluster(client=False, nthreads=[PS, WK], timeout=60)
async def test_keras_and_dds_callbacks_together(s, p0, w0):
    """Keras' EarlyStopping stops training at an epoch's end (``model.stop_training``), its
    ModelCheckpoint saves the weights of the parameter servers at each epoch's end (the
    Keras model is refreshed first), and dds' BackupAndRestore saves the run's position with
    the compiled metrics' merged state mid-epoch. (TF: dataset_creator_model_fit_test.py
    testModelFitCallbacks; keras callbacks_test.py EarlyStopping.)"""
    import json
    import tempfile

    from dask_dataservice.ps.callbacks import BackupAndRestore

    def body(c):
        strategy = dds.ParameterServerStrategy(c)
        with strategy.scope():
            model = _model()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
        placed = dds_keras.on_ps(model)
        with tempfile.TemporaryDirectory() as tmp:
            backup = BackupAndRestore(dds.Checkpoint(model=placed), f"{tmp}/backup",
                                      save_freq=4, delete_checkpoint=False)
            history = model.fit(
                dds.DatasetCreator(_dataset_fn), epochs=5, steps_per_epoch=STEPS, verbose=0,
                callbacks=[keras.callbacks.EarlyStopping(monitor="loss", min_delta=10,
                                                         patience=0),
                           keras.callbacks.ModelCheckpoint(f"{tmp}/m.weights.h5",
                                                           save_weights_only=True),
                           backup])
            assert history.epoch == [0, 1] and model.stop_training
            assert int(placed.iterations.numpy()) == 2 * STEPS
            saved = _model()
            saved.load_weights(f"{tmp}/m.weights.h5")
            for a, b in zip(saved.get_weights(), placed.values(), strict=True):
                np.testing.assert_array_equal(a, b)
            with open(f"{tmp}/backup/state.json") as f:
                state = json.load(f)
            # the last save (every 4 global steps): the 12th, epoch 1's 6th step, with the
            # metrics' merged state of epoch 1's 6 steps
            assert (state["epoch"], state["step"]) == (1, 6)
            assert state["aggregate"]["count"] == 6
            assert state["history"]["epoch"] == [0]

    await in_thread(s, body)


def _two_inputs():
    keras.utils.set_random_seed(3)
    ids = keras.Input((3,), dtype="int32", name="ids")
    feats = keras.Input((2,), name="feats")
    looked_up = keras.layers.Flatten()(keras.layers.Embedding(30, 2)(ids))
    out = keras.layers.Dense(1)(keras.layers.Concatenate()([looked_up, feats]))
    return keras.Model({"ids": ids, "feats": feats}, out)


@pytest.mark.cluster
@gen_cluster(client=False, nthreads=[PS, WK], timeout=60)
async def test_functional_model_with_named_inputs_from_a_list_of_batches(s, p0, w0):
    """A functional model with two named inputs (the table's ids, read by rows, and dense
    features), trained from a plain list of batches: Keras' local fit's losses and weights.
    (TF: parameter_server_training_test.py testModelFit with a functional model.)"""
    import importlib

    def body(c):
        strategy = dds.ParameterServerStrategy(c)
        with strategy.scope():
            model = _two_inputs()
        local = _two_inputs()
        local.set_weights(model.get_weights())
        for m in (model, local):
            m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        rng = np.random.default_rng(0)
        x = {"ids": rng.integers(0, 30, (32, 3)).astype("int32"),
             "feats": rng.standard_normal((32, 2)).astype("float32")}
        y = rng.standard_normal((32, 1)).astype("float32")
        batches = [({k: v[i:i + 8] for k, v in x.items()}, y[i:i + 8]) for i in range(0, 32, 8)]

        def forever():
            while True:
                yield from batches

        history = model.fit(batches * 2, epochs=2, steps_per_epoch=4, verbose=0)
        expected = local.fit(forever(), epochs=2, steps_per_epoch=4, verbose=0)
        np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
        for a, b in zip(model.get_weights(), local.get_weights(), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        # the worker (in this process) read the table by rows, its ids found by name
        trainer = list(importlib.import_module("dask_dataservice.keras.step")
                       ._trainers.values())[-1]
        ((table, where),) = trainer.by_rows.items()
        assert table == 0 and trainer.input_names[where] == "ids"

    await in_thread(s, body)


# -- no cluster --------------------------------------------------------------------------


@pytest.mark.pure
@pytest.mark.parametrize("make", [
    lambda: keras.optimizers.SGD(0.1),
    lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    lambda: keras.optimizers.Adagrad(0.1),
    lambda: keras.optimizers.Adam(0.01),
    lambda: keras.optimizers.RMSprop(0.01),
    lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
], ids=["sgd", "momentum", "nesterov", "adagrad", "adam", "rmsprop", "rmsprop-centered"])
def test_server_side_optimizer_matches_keras(make):
    """Three dense updates of the server-side equivalent of a Keras optimizer give Keras'
    values (Adagrad adds epsilon outside the square root, Keras inside it: 1e-6 apart)."""
    rng = np.random.default_rng(1)
    value = rng.standard_normal((5, 3)).astype("f4")
    grads = [rng.standard_normal((5, 3)).astype("f4") for _ in range(3)]
    keras_opt = make()
    var = keras.Variable(value.copy())
    config = dds_keras.server_optimizer(keras_opt).get_config()
    mine, slots = value.copy(), _kernels.new_slots(config, value)
    for g in grads:
        keras_opt.apply_gradients([(g, var)])
        _kernels.apply_dense(config, mine, slots, g)
    np.testing.assert_allclose(mine, np.asarray(var.numpy()), rtol=2e-6, atol=2e-6)


@pytest.mark.pure
def test_unsupported_optimizers_and_options_are_refused():
    assert isinstance(dds_keras.server_optimizer("rmsprop"), ps_optimizers.RMSprop)
    with pytest.raises(ValueError, match="the Keras optimizer Nadam has no server-side "
                                         "equivalent: use SGD, Adagrad, Adam or RMSprop"):
        dds_keras.server_optimizer(keras.optimizers.Nadam())
    with pytest.raises(ValueError, match="AdamW has no server-side equivalent"):
        dds_keras.server_optimizer(keras.optimizers.AdamW())
    with pytest.raises(ValueError, match=r"SGD\(clipnorm=1\.0\) cannot be applied on the "
                                         r"parameter servers"):
        dds_keras.server_optimizer(keras.optimizers.SGD(clipnorm=1.0))
    with pytest.raises(ValueError, match="learning-rate schedule"):
        dds_keras.server_optimizer(keras.optimizers.SGD(
            keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)))
    with pytest.raises(ValueError, match=r"Adam\(amsgrad=True\)"):
        dds_keras.server_optimizer(keras.optimizers.Adam(amsgrad=True))


@pytest.mark.pure
def test_models_that_cannot_go_on_parameter_servers_are_refused():
    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    unbuilt.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="is not built: give its Input shape"):
        dds_keras.on_ps(unbuilt, strategy=object())
    model = _model()
    with pytest.raises(ValueError, match="is not compiled"):
        dds_keras.fit(model, [], steps_per_epoch=1)
    # a Keras 3 model has no `optimizer` attribute before compile(): the same error, not an
    # AttributeError, when it is placed explicitly
    with pytest.raises(ValueError, match=r"is not compiled: call model.compile\(optimizer="):
        dds_keras.on_ps(_model(), strategy=object())
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="is not bound to a ParameterServerStrategy: create "
                                         r"it inside `with strategy.scope\(\):`"):
        dds_keras.fit(model, [(np.zeros((1, 4), "i4"), np.zeros((1, 1), "f4"))],
                      steps_per_epoch=1)
    with pytest.raises(TypeError, match="fit needs a keras.Model, got list"):
        dds_keras.fit([], [], steps_per_epoch=1)
