"""One training step of a Keras model on a training worker (JAX backend).

Theory of operation
-------------------
- :class:`TrainStep` is what the coordinator schedules: it carries the model's
  *architecture and compile configuration* (Keras' own serialization, a few kB: no weights),
  the variable handles and the server-side optimizer. On a worker it is rebuilt once per
  process and kept (:func:`_trainer`, keyed by the step's id), with its jitted gradient
  function, so a scheduled batch costs a dictionary lookup, not a model build.
- Each batch: the weights are read from the parameter servers (every shard in parallel;
  an ``Embedding`` table whose ids are a model input is read by rows, the batch's distinct
  ids padded to a size fixed by the batch's shape, and placed at their ids in a table of
  zeros inside the jitted step: its gradient is the rows' gradient),
  ``jax.value_and_grad`` runs over the model's stateless forward and loss
  (``compute_loss_and_updates``, the function Keras' own JAX ``train_step`` differentiates)
  and the compiled metrics' update, all in one ``jax.jit``; then the gradients go to the
  servers' optimizer: the rows of an ``Embedding`` table that have a gradient as
  :class:`~dask_dataservice.ps.optimizers.IndexedSlices`, the other weights dense. Updated
  non-trainable weights (a ``BatchNormalization``'s moving statistics) are assigned; the
  optimizer counts the batch (its ``iterations``, on a PS). Every update is tagged with the
  scheduled function's id, so a function that runs again after a worker loss changes nothing twice.
- ``steps_per_execution`` batches run in one scheduled function; it returns how the compiled
  metrics' state changed over them (Keras' metric variables are sums and counts: they merge
  by addition, see :class:`~.fit.KerasMetrics`).
- Random state (a ``Dropout``'s seed) stays on each worker. A table whose ids are computed
  inside the model is read whole (its gradient still travels as rows: see docs/keras.md).
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import warnings
from collections import OrderedDict
from collections.abc import Mapping
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


def _tables_read_by_rows(model: Any, sparse: list[bool]) -> dict[int, int | None]:
    """``{index in trainable_weights: where its ids are in the inputs}`` of the Embedding
    tables whose ids are a model input read by that layer only (None: the input is ``x``
    itself; an int: ``x[i]`` of a model with several inputs given as a list or tuple). Their
    rows are read by id; any other table is read whole (its ids are computed in the model).
    """
    inputs = list(getattr(model, "inputs", None) or [])
    layers = list(model._flatten_layers(include_self=False))
    out: dict[int, int | None] = {}
    for j, w in enumerate(model.trainable_weights):
        if not sparse[j]:
            continue
        layer = next((lay for lay in layers if isinstance(lay, keras.layers.Embedding)
                      and not getattr(lay, "lora_enabled", False)
                      and getattr(lay, "_embeddings", None) is w), None)
        if layer is None or layer.mask_zero or not layer._inbound_nodes:
            continue
        # every call of the layer (a rebuilt Sequential has several nodes) reads one model
        # input, the same one
        tensors = [list(node.input_tensors) for node in layer._inbound_nodes]
        where = {i for ts in tensors for t in ts for i, m in enumerate(inputs) if t is m}
        if any(len(ts) != 1 for ts in tensors) or len(where) != 1 \
                or any(not any(ts[0] is m for m in inputs) for ts in tensors):
            continue
        (i,) = where
        readers = {id(lay) for lay in layers for node in lay._inbound_nodes
                   if any(t is inputs[i] for t in node.input_tensors)}
        if readers != {id(layer)}:
            continue
        out[j] = None if len(inputs) == 1 else i
    return out


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
        #: ``{index in trainable_weights: index of its ids in the inputs}`` of the tables
        #: read by rows (see :func:`_tables_read_by_rows`)
        self.by_rows = _tables_read_by_rows(model, step.sparse)
        self.input_names = [t.name for t in (getattr(model, "inputs", None) or [])]
        #: where each of them goes in the stateless call, and its shape
        self.table_slots = tuple((self.trainable_at[j], tuple(model.trainable_weights[j].shape))
                                 for j in self.by_rows)
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

    def _pure_step(self, trainable: list[Any], rows: list[Any], idx: list[Any],
                   non_trainable: list[Any], metrics: list[Any], optimizer_vars: list[Any],
                   x: Any, y: Any, sample_weight: Any) -> Any:
        model = self.model

        def loss(trainable: list[Any], rows: list[Any]) -> Any:
            trainable = list(trainable)
            for (i, shape), r, ix in zip(self.table_slots, rows, idx, strict=True):
                # the table as the forward pass sees it: the batch's rows at their ids (the
                # other rows are not looked up); its gradient is the rows' gradient
                trainable[i] = jax.numpy.zeros(shape, r.dtype).at[ix].set(r)
            return model.compute_loss_and_updates(
                trainable, non_trainable, metrics, x, y, sample_weight, training=True,
                optimizer_variables=optimizer_vars)

        grad_fn = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
        (_, aux), (grads, row_grads) = grad_fn(trainable, rows)
        unscaled_loss, y_pred, new_non_trainable, new_metrics = aux
        _, new_metrics = model._update_metrics_variables(new_metrics, unscaled_loss, x, y,
                                                         y_pred, sample_weight)
        return grads, row_grads, new_non_trainable, new_metrics

    def _rows(self, step: TrainStep, x: Any) -> tuple[list[np.ndarray], list[np.ndarray],
                                                       list[np.ndarray]]:
        """For each table read by rows: its distinct ids in the batch, padded with unused
        ids to a size fixed by the batch's shape (one jit trace per batch shape), and those
        rows read from the servers (one request per shard holding any, in parallel)."""
        ids_out, idx_out, rows_out = [], [], []
        for j, where in self.by_rows.items():
            var = step.trainable[j]
            n_rows = int(var.shape[0])
            if where is None:
                source = x
            elif isinstance(x, Mapping):  # inputs by name
                source = x[self.input_names[where]]
            else:
                source = x[where]
            flat = np.asarray(source).reshape(-1)
            if flat.dtype.kind not in "iu":
                flat = flat.astype(np.int64)
            uniq = np.unique(flat)
            if uniq.size and (uniq[0] < 0 or uniq[-1] >= n_rows):
                raise IndexError(f"embedding ids of {var.name!r} must be in [0, {n_rows}), got "
                                 f"min {uniq[0]}, max {uniq[-1]}")
            size = min(flat.size, n_rows)
            pad = np.setdiff1d(np.arange(min(n_rows, size + uniq.size)), uniq,
                               assume_unique=True)[:size - uniq.size]
            idx = np.concatenate([uniq, pad]).astype(np.int32)
            ids_out.append(uniq)
            idx_out.append(idx)
            rows_out.append(var.gather(idx))
        return ids_out, idx_out, rows_out

    def batch(self, step: TrainStep, data: Any, metrics: list[np.ndarray]) -> list[np.ndarray]:
        model = self.model
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with self._lock:  # one batch at a time per process (the runner has one thread)
            ids, idx, rows = self._rows(step, x)
            whole = [j for j in range(len(step.trainable)) if j not in self.by_rows]
            read = read_values(*(step.trainable[j] for j in whole), *step.non_trainable)
            trainable: list[Any] = [v.value for v in model.trainable_variables]
            for j in self.by_rows:
                trainable[self.trainable_at[j]] = None  # built from its rows in the step
            for j, value in zip(whole, read, strict=False):
                trainable[self.trainable_at[j]] = value
            non_trainable = [v.value for v in model.non_trainable_variables]
            for i, value in zip(self.nt_at, read[len(whole):], strict=True):
                non_trainable[i] = value
            optimizer_vars = [v.value for v in model.optimizer.variables]
            grads, row_grads, non_trainable, metrics_out = self._step(
                trainable, rows, idx, non_trainable, metrics, optimizer_vars, x, y,
                sample_weight)
            # random state (seed generators) stays on this worker
            on_ps = set(self.nt_at)
            for i, (v, value) in enumerate(zip(model.non_trainable_variables, non_trainable,
                                               strict=True)):
                if i not in on_ps:
                    v.assign(value)
        updates: list[tuple[Any, Any]] = []
        by_rows = dict(zip(self.by_rows, zip(ids, row_grads, strict=True), strict=True))
        for j, (i, var, sparse) in enumerate(zip(self.trainable_at, step.trainable, step.sparse,
                                                 strict=True)):
            if j in by_rows:
                uniq, g_rows = by_rows[j]
                updates.append((IndexedSlices(np.asarray(g_rows)[:uniq.size], uniq), var))
                continue
            g = np.asarray(grads[i])
            if sparse:
                nonzero = np.flatnonzero(np.any(g.reshape(g.shape[0], -1) != 0, axis=1))
                updates.append((IndexedSlices(g[nonzero], nonzero), var))
            else:
                updates.append((g, var))
        step.optimizer.apply_gradients(updates)
        for i, var in zip(self.nt_at, step.non_trainable, strict=True):
            var.assign(np.asarray(non_trainable[i]), read_value=False)
        return [np.asarray(m) for m in metrics_out]
