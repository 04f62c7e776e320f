"""One training step of a Keras model on a training worker (JAX backend).

Theory of operation
-------------------
- :class:`TrainStep` is what the coordinator schedules: it carries the model's
  *architecture and compile configuration* (Keras' own serialization, a few kB: no weights),
  the variable handles and the server-side optimizer. On a worker it is rebuilt once per
  process and kept (:func:`_trainer`, keyed by the step's id), with its jitted gradient
  function, so a scheduled batch costs a dictionary lookup, not a model build.
- Each batch: the weights are read from the parameter servers (every shard in parallel),
  ``jax.value_and_grad`` runs over the model's stateless forward and loss
  (``compute_loss_and_updates``, the function Keras' own JAX ``train_step`` differentiates)
  and the compiled metrics' update, all in one ``jax.jit``; then the gradients go to the
  servers' optimizer: the rows of an ``Embedding`` table that have a gradient as
  :class:`~dask_dataservice.ps.optimizers.IndexedSlices`, the other weights dense. Updated
  non-trainable weights (a ``BatchNormalization``'s moving statistics) are assigned; the
  batch count is incremented. Every update is tagged with the scheduled function's id, so
  a function that runs again after a worker loss changes nothing twice.
- ``steps_per_execution`` batches run in one scheduled function; it returns how the compiled
  metrics' state changed over them (Keras' metric variables are sums and counts: they merge
  by addition, see :class:`~.fit.KerasMetrics`).
- Random state (a ``Dropout``'s seed) stays on each worker; the forward pass reads the whole
  of every weight, tables included (the gradient of a table travels as rows, its value
  does not: see docs/keras.md).
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import warnings
from collections import OrderedDict
from typing import Any

import cloudpickle
import numpy as np

from ..ps import optimizers as ps_optimizers
from ..ps._types import IndexedSlices
from ..ps.variables import ShardedVariable, Variable, read_values
from ._backend import jax, keras

__all__ = ["TrainStep", "model_spec", "build_model"]

#: Trainers kept per worker process (the newest fits).
_MAX_TRAINERS = 4
_trainers: OrderedDict[str, _Trainer] = OrderedDict()
_trainers_lock = threading.Lock()


def model_spec(model: Any) -> tuple[str, Any, bytes]:
    """How to rebuild ``model`` on a worker: Keras' configuration of its architecture (or,
    for a model without one, the pickled model) and its ``compile`` arguments pickled as
    they were given (a loss or metric may be a plain function, which Keras' configuration
    cannot name)."""
    compile_args = dict(model._compile_config.config)
    # the worker's optimizer is not used to update (the servers apply the update)
    compile_args["optimizer"] = "sgd"
    compiled = cloudpickle.dumps(compile_args)
    try:
        config = keras.saving.serialize_keras_object(model)
    except (NotImplementedError, TypeError, ValueError):
        return "pickle", cloudpickle.dumps(model), compiled
    config.pop("compile_config", None)
    return "config", config, compiled


def build_model(spec: tuple[str, Any, bytes]) -> Any:
    kind, data, compiled = spec
    with warnings.catch_warnings():
        # Keras warns that the (unbuilt) optimizer's variables are not loaded: they are not
        # used here (the update is applied on the parameter servers)
        warnings.filterwarnings("ignore", message=".*[Ss]kipping variable loading.*")
        if kind == "config":
            model = keras.saving.deserialize_keras_object(data)
        else:
            model = cloudpickle.loads(data)
    model.compile(**cloudpickle.loads(compiled))
    return model


class TrainStep:
    """The scheduled function: ``steps_per_execution`` batches of ``iterator``."""

    def __init__(self, model: Any, trainable: list[Variable | ShardedVariable],
                 sparse: list[bool], non_trainable: list[Variable | ShardedVariable],
                 iterations: Variable, optimizer: ps_optimizers.Optimizer,
                 steps_per_execution: int, model_uid: str | None = None) -> None:
        self.spec = model_spec(model)
        #: The key of the worker's rebuilt model: the same model (``model_uid``) compiled the
        #: same way is rebuilt and jitted once per worker process, whatever the ``fit`` call.
        self.uid = (model_uid or secrets.token_hex(8)) + "/" + hashlib.sha1(
            cloudpickle.dumps(self.spec[1:])).hexdigest()[:16]
        #: The variables of ``model.trainable_weights`` and ``non_trainable_weights``, in
        #: order (a model rebuilt from the same configuration has them in the same order;
        #: its paths may differ: Keras makes layer names unique per process).
        self.trainable = trainable
        self.sparse = sparse
        self.non_trainable = non_trainable
        self.iterations = iterations
        self.optimizer = optimizer
        self.steps_per_execution = steps_per_execution

    def __call__(self, iterator: Any) -> dict[str, Any]:
        """``{"metrics": how the metric variables changed, "like": a one-row batch of
        zeros shaped as the input's (the coordinator builds its metrics from it)}``."""
        trainer = _trainer(self)
        data = None
        state: list[np.ndarray] = []
        for i in range(self.steps_per_execution):
            try:
                data = next(iterator)
            except StopIteration:
                if i == 0:
                    raise
                break  # Keras runs a shorter last execution too
            if i == 0:
                state = trainer.initial_metrics(data)
            state = trainer.batch(self, data, state)
        initial = trainer.initial_metrics(data)
        return {"metrics": [s - s0 for s, s0 in zip(state, initial, strict=True)],
                "like": keras.tree.map_structure(_zeros_like_row, data)}


def _positions(variables: list[Any], weights: list[Any]) -> list[int]:
    """The index in ``variables`` of each of ``weights`` (by identity)."""
    index = {id(v): i for i, v in enumerate(variables)}
    return [index[id(w)] for w in weights]


def _zeros_like_row(a: Any) -> Any:
    if a is None:
        return None
    a = np.asarray(a)
    return np.zeros((1, *a.shape[1:]), dtype=a.dtype)


def _trainer(step: TrainStep) -> _Trainer:
    with _trainers_lock:
        trainer = _trainers.get(step.uid)
        if trainer is not None:
            _trainers.move_to_end(step.uid)
            return trainer
    trainer = _Trainer(step)  # outside the lock: a build takes a while
    with _trainers_lock:
        trainer = _trainers.setdefault(step.uid, trainer)
        while len(_trainers) > _MAX_TRAINERS:
            _trainers.popitem(last=False)
    return trainer


class _Trainer:
    """The model rebuilt on this worker and its jitted step (see module doc)."""

    def __init__(self, step: TrainStep) -> None:
        model = build_model(step.spec)
        shapes = ([tuple(v.shape) for v in model.trainable_weights],
                  [tuple(v.shape) for v in model.non_trainable_weights])
        expected = ([tuple(v.shape) for v in step.trainable],
                    [tuple(v.shape) for v in step.non_trainable])
        if shapes != expected:
            raise RuntimeError(
                f"the model rebuilt on this worker has other weights than on the coordinator "
                f"(shapes {shapes} against {expected}): its configuration does not rebuild it")
        self.model = model
        #: Where each weight on the servers is in the stateless call's lists.
        self.trainable_at = _positions(model.trainable_variables, model.trainable_weights)
        self.nt_at = _positions(model.non_trainable_variables, model.non_trainable_weights)
        self._step = jax.jit(self._pure_step)
        self._lock = threading.Lock()
        self._initial: list[np.ndarray] | None = None

    def initial_metrics(self, data: Any) -> list[np.ndarray]:
        """The compiled metrics' variables at their start (built from ``data`` once)."""
        with self._lock:
            if self._initial is None:
                # builds the compiled loss and metrics (their variables) from a batch
                self.model._symbolic_build(data_batch=data)
                self.model.reset_metrics()
                self._initial = [np.asarray(v.value) for v in self.model.metrics_variables]
            return self._initial

    def _pure_step(self, trainable: list[Any], non_trainable: list[Any], metrics: list[Any],
                   optimizer_vars: list[Any], x: Any, y: Any, sample_weight: Any) -> Any:
        model = self.model
        grad_fn = jax.value_and_grad(model.compute_loss_and_updates, has_aux=True)
        (_, aux), grads = grad_fn(trainable, non_trainable, metrics, x, y, sample_weight,
                                  training=True, optimizer_variables=optimizer_vars)
        unscaled_loss, y_pred, non_trainable, metrics = aux
        _, metrics = model._update_metrics_variables(metrics, unscaled_loss, x, y, y_pred,
                                                     sample_weight)
        return grads, non_trainable, metrics

    def batch(self, step: TrainStep, data: Any, metrics: list[np.ndarray]) -> list[np.ndarray]:
        model = self.model
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with self._lock:  # one batch at a time per process (the runner has one thread)
            read = read_values(*step.trainable, *step.non_trainable)
            trainable = [v.value for v in model.trainable_variables]
            for i, value in zip(self.trainable_at, read, strict=False):
                trainable[i] = value
            non_trainable = [v.value for v in model.non_trainable_variables]
            for i, value in zip(self.nt_at, read[len(step.trainable):], strict=True):
                non_trainable[i] = value
            optimizer_vars = [v.value for v in model.optimizer.variables]
            grads, non_trainable, metrics_out = self._step(
                trainable, non_trainable, metrics, optimizer_vars, x, y, sample_weight)
            # random state (seed generators) stays on this worker
            on_ps = set(self.nt_at)
            for i, (v, value) in enumerate(zip(model.non_trainable_variables, non_trainable,
                                               strict=True)):
                if i not in on_ps:
                    v.assign(value)
        updates: list[tuple[Any, Any]] = []
        for i, var, sparse in zip(self.trainable_at, step.trainable, step.sparse, strict=True):
            g = np.asarray(grads[i])
            if sparse:
                rows = np.flatnonzero(np.any(g.reshape(g.shape[0], -1) != 0, axis=1))
                updates.append((IndexedSlices(g[rows], rows), var))
            else:
                updates.append((g, var))
        step.optimizer.apply_gradients(updates)
        for i, var in zip(self.nt_at, step.non_trainable, strict=True):
            var.assign(np.asarray(non_trainable[i]), read_value=False)
        step.iterations.assign_add(1, read_value=False)
        return [np.asarray(m) for m in metrics_out]
