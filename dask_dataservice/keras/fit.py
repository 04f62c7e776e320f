"""``fit`` for a Keras model on parameter servers, and ``model.fit`` when the model is bound.

::

    with strategy.scope():                      # the model's weights go to the PSs
        model = keras.Sequential([keras.Input((3,), dtype="int32"),
                                  keras.layers.Embedding(1000, 8), ...])
    model.compile(optimizer="rmsprop", loss="mse", steps_per_execution=10)
    history = model.fit(dds.DatasetCreator(dataset_fn), epochs=5, steps_per_epoch=100)

Theory of operation
-------------------
- :func:`fit` is :func:`dask_dataservice.fit` (the project's epochs of scheduled functions:
  its fault handling, sync points, progress bar and callbacks) with a Keras step
  (:class:`~.step.TrainStep`) and an :class:`KerasMetrics` aggregate: each scheduled
  function returns how the compiled metrics' state changed; the coordinator adds the
  changes up and asks the model's own metrics for their result, so the logs (and
  ``History``) are Keras' own numbers (``loss`` and every compiled metric).
- Keras callbacks (``keras.callbacks.*``) run through one adapter that gives them the Keras
  model and its logs; at each epoch's end (a sync point) the Keras model first gets the
  servers' weights (:meth:`~.model.ModelOnPS.pull`), so ``ModelCheckpoint`` saves them.
  Weights a callback sets (``EarlyStopping(restore_best_weights=True)``) are pushed back.
  ``model.stop_training`` set by a callback ends training after the current epoch.
  Callbacks of :mod:`dask_dataservice.callbacks` are given to ``dds.fit`` as they are.
- ``model.fit`` of a model bound to a strategy (created in its scope, or placed with
  :func:`~.model.on_ps`) is this ``fit``: importing :mod:`dask_dataservice.keras` wraps
  ``keras.Model.fit`` once (:func:`install`); any other model runs Keras' own.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from ..ps import callbacks as ps_callbacks
from ..ps import fit as ps_fit
from ._backend import jax, keras
from .model import ModelOnPS, bound_strategy, on_ps
from .step import TrainStep

__all__ = ["fit", "KerasMetrics", "install"]


class KerasMetrics:
    """The compiled metrics of a Keras model, merged over the steps of an epoch.

    Each step returns how the model's ``metrics_variables`` changed over its batches; every
    built-in Keras metric keeps sums and counts, so the changes add up. ``logs()`` asks the
    model's metrics for their result on the sums (Keras' ``get_metrics_result``).
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.initial: list[np.ndarray] | None = None
        self.sums: list[np.ndarray] = []
        self.count = 0
        self._pending: dict[str, Any] | None = None
        self._result: Any = None

    def _build(self, like: Any) -> None:
        """Build the compiled loss and metrics here, from a batch shaped as the input's
        (Keras builds them from a batch; the batches are on the workers)."""
        self.model._symbolic_build(data_batch=like)  # builds only what is not built yet
        self.model.reset_metrics()
        self.initial = [np.asarray(v.value) for v in self.model.metrics_variables]
        self.sums = [np.array(v) for v in self.initial]
        if self._pending is not None:
            self.restore(self._pending)
            self._pending = None

    def reset(self) -> None:
        if self.initial is not None:
            self.sums = [np.array(v) for v in self.initial]
        self.count = 0

    def add(self, value: Any) -> None:
        if self.initial is None:
            self._build(value["like"])
        for total, delta in zip(self.sums, value["metrics"], strict=True):
            total += delta
        self.count += 1

    def logs(self) -> dict[str, float]:
        if not self.count:
            return {}
        if self._result is None:
            metrics_variables = self.model.metrics_variables

            def result(sums: list[Any]) -> Any:
                pairs = list(zip(metrics_variables, sums, strict=True))
                with keras.StatelessScope(state_mapping=pairs):
                    return self.model.get_metrics_result()

            # one call per step (the batch logs): jitted, it is one dispatch, not one per op
            self._result = jax.jit(result)
        values = jax.device_get(self._result(self.sums))
        return {k: float(v) for k, v in values.items()}

    def state(self) -> dict[str, Any]:
        return {"sums": [s.tolist() for s in self.sums], "count": self.count}

    def restore(self, state: Mapping[str, Any]) -> None:
        if not state.get("count"):  # saved before the epoch's first step: nothing to add
            return
        if self.initial is None:  # restored before the first step: kept until the build
            self._pending = dict(state)
            return
        self.sums = [np.asarray(s, dtype=v.dtype).reshape(v.shape)
                     for s, v in zip(state["sums"], self.initial, strict=True)]
        self.count = int(state["count"])


class _KerasCallbacks(ps_callbacks.Callback):
    """Keras callbacks (and Keras' History) driven by ``dds.fit``'s hooks."""

    def __init__(self, placed: ModelOnPS, callbacks: list[Any], epochs: int, steps: int,
                 steps_per_execution: int) -> None:
        super().__init__()
        self.placed = placed
        self.spe = steps_per_execution
        self.list = keras.callbacks.CallbackList(
            callbacks, add_history=True, add_progbar=False, model=placed.model,
            epochs=epochs, steps=steps * steps_per_execution, verbose=0)

    def on_train_begin(self, logs: Any = None) -> None:
        self.placed.model.stop_training = False
        self.list.on_train_begin(logs)

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.list.on_epoch_begin(epoch, logs)

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self.list.on_train_batch_begin(batch * self.spe, logs)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.list.on_train_batch_end((batch + 1) * self.spe - 1, logs)
        self._stop()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.placed.pull()  # a sync point: every update of the epoch landed
        self.list.on_epoch_end(epoch, logs)
        self.placed.sync()
        self._stop()

    def on_train_end(self, logs: Any = None) -> None:
        self.placed.pull()
        self.list.on_train_end(logs)
        self.placed.sync()

    def _stop(self) -> None:
        if self.placed.model.stop_training:
            self._run().stop_training = True


def _verbose(verbose: Any) -> bool | Literal["auto"]:
    if verbose == "auto":
        return "auto"
    return bool(verbose)


def fit(model: Any, x: Any = None, *, epochs: int = 1, steps_per_epoch: int | None = None,
        callbacks: Sequence[Any] | None = None, initial_epoch: int = 0,
        verbose: Any = "auto", strategy: Any = None, **unsupported: Any) -> Any:
    """Train a compiled Keras ``model`` on its strategy's parameter servers; returns Keras'
    ``History`` (``history.history["loss"]`` and every compiled metric, per epoch).

    Parameters
    ----------
    model : keras.Model
        Built and compiled (its optimizer is applied on the servers: SGD, Adagrad, Adam or
        RMSprop). ``steps_per_execution`` of ``compile`` is the number of batches each
        scheduled function runs.
    x : DatasetCreator, dataset, iterable of batches or callable
        What :func:`dask_dataservice.fit` takes; each element is a batch ``(x, y)`` or
        ``(x, y, sample_weight)`` (Keras' forms).
    steps_per_epoch : int
        Required (as with TensorFlow's parameter-server strategy): batches per epoch, a
        multiple of ``steps_per_execution``.
    callbacks : list
        Keras callbacks and/or :mod:`dask_dataservice.callbacks` ones.
    strategy : ParameterServerStrategy, optional
        Default: the one the model is bound to (created or compiled in its scope).
    """
    for name, value in unsupported.items():
        if value is not None and not (name in _NEUTRAL_FIT and _NEUTRAL_FIT[name] == value):
            raise ValueError(
                f"fit({name}=...) is not supported on parameter servers: give the input as "
                "a DatasetCreator, a dataset or an iterable of (x, y[, sample_weight]) batches")
    if not isinstance(model, keras.Model):
        raise TypeError(f"fit needs a keras.Model, got {type(model).__name__}")
    if not model.compiled:
        raise ValueError(f"the model {model.name!r} is not compiled: call model.compile(...) "
                         "first")
    if x is None:
        raise ValueError("fit needs an input: a DatasetCreator, a dataset or an iterable of "
                         "batches")
    if steps_per_epoch is None:
        raise ValueError("steps_per_epoch is required with parameter-server training (as in "
                         "TensorFlow): each worker reads its own input, so the end of the data "
                         "cannot mark the end of an epoch")
    spe = int(model.steps_per_execution or 1)
    if isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int) \
            or steps_per_epoch < 1 or steps_per_epoch % spe:
        raise ValueError(f"steps_per_epoch must be a positive multiple of steps_per_execution "
                         f"({spe}), got {steps_per_epoch!r}")
    placed = on_ps(model, strategy)
    placed.refresh_optimizer()  # compiled again with another optimizer since the last fit
    placed.sync()  # weights set on the Keras model since the last fit go to the servers
    metrics = KerasMetrics(model)
    step = TrainStep(model, [placed.by_path[p] for p in placed.trainable_paths],
                     [p in placed.sparse_paths for p in placed.trainable_paths],
                     [placed.by_path[p] for p in placed.non_trainable_paths],
                     placed.iterations, placed.optimizer, spe, placed.uid)
    dds_callbacks = [cb for cb in callbacks or () if isinstance(cb, ps_callbacks.Callback)]
    keras_callbacks = [cb for cb in callbacks or () if not isinstance(cb, ps_callbacks.Callback)]
    adapter = _KerasCallbacks(placed, keras_callbacks, epochs, steps_per_epoch // spe, spe)
    try:
        ps_fit.fit(placed.strategy, step, x, epochs=epochs, steps_per_epoch=steps_per_epoch // spe,
                   callbacks=[*dds_callbacks, adapter], initial_epoch=initial_epoch,
                   verbose=_verbose(verbose), aggregate=metrics)
    except BaseException:
        placed.pull()  # what was trained so far, as Keras' fit leaves the model
        raise
    return model.history


#: Keras fit arguments accepted at their default value only.
_NEUTRAL_FIT: dict[str, Any] = {"y": None, "batch_size": None, "validation_split": 0.0,
                                "validation_data": None, "shuffle": True, "class_weight": None,
                                "sample_weight": None, "validation_steps": None,
                                "validation_batch_size": None, "validation_freq": 1}


# ---------------------------------------------------------------------------------------
# model.fit of a bound model
# ---------------------------------------------------------------------------------------

_installed = False


def install() -> None:
    """Wrap ``keras.Model.fit`` (once; idempotent): ``fit`` of a model bound to a
    ParameterServerStrategy (see :func:`~.model.bound_strategy`) is :func:`fit`; every other
    model runs Keras' own ``fit`` unchanged. (``compile`` is left alone: Keras rebuilds a
    loaded model with it only when it is Keras' own.)"""
    global _installed
    if _installed:
        return
    keras_fit = keras.Model.fit

    @functools.wraps(keras_fit)
    def fit_(self: Any, *args: Any, **kwargs: Any) -> Any:
        strategy = bound_strategy(self)
        if strategy is None:
            return keras_fit(self, *args, **kwargs)
        return fit(self, *args, strategy=strategy, **kwargs)

    keras.Model.fit = fit_
    _installed = True
