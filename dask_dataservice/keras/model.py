"""A Keras model whose weights live on the parameter servers (:class:`ModelOnPS`).

Theory of operation
-------------------
- Each weight of the model (``model.weights``: trainable and not) becomes a variable on the
  parameter servers, created in the strategy's scope and named by the weight's Keras path
  (``"dense/kernel"``): the strategy's partitioner applies (an ``Embedding`` table becomes a
  :class:`~dask_dataservice.ShardedVariable` when it is large enough), unpartitioned
  variables go round robin over the servers. ``ps_model.variables`` lists them in the order
  of ``model.weights`` (that of ``get_weights``/``set_weights``).
- The Keras model on the coordinator keeps its own weights as a *copy*: :meth:`ModelOnPS.pull`
  reads the servers' values into it (``fit`` does after each epoch and at the end), and
  :meth:`ModelOnPS.push` sends its values to the servers. Weights set on the Keras model
  between two ``fit`` calls (``set_weights``, ``load_weights``) are pushed by the next
  ``fit`` (:meth:`ModelOnPS.sync`: it compares with the values of the last pull or push).
- ``iterations`` counts the batches applied: the server-side optimizer's ``iterations`` on a
  PS (each batch's ``apply_gradients`` adds one, exactly once even when its function runs
  again after a worker loss); it is copied into ``model.optimizer.iterations`` by :meth:`pull`.
- Which tables get sparse gradients: the ``embeddings`` weight of every ``Embedding`` layer.
"""

from __future__ import annotations

import secrets
import threading
from typing import Any

import numpy as np

from ..ps import optimizers as ps_optimizers
from ..ps.checkpoint import Checkpoint
from ..ps.variables import ShardedVariable, Variable, current_strategy, read_values
from ._backend import keras
from .optimizer import server_optimizer

__all__ = ["ModelOnPS", "on_ps", "bound_strategy", "load_checkpoint"]

#: The attribute of a Keras model that holds its ModelOnPS (set with object.__setattr__:
#: Keras' attribute tracking stays out of it).
_ATTR = "_dds_model_on_ps"
#: The attribute of a Keras variable created in a strategy's scope (see ._scope).
STRATEGY_ATTR = "_dds_strategy"

_lock = threading.Lock()


def bound_strategy(model: Any) -> Any:
    """The ParameterServerStrategy ``model`` belongs to, or None: the one it was placed on
    (:func:`on_ps`), or whose scope created any of its variables."""
    placed = model.__dict__.get(_ATTR)
    if placed is not None:
        return placed.strategy
    for v in model.variables:
        strategy = getattr(v, STRATEGY_ATTR, None)
        if strategy is not None:
            return strategy
    return None


class ModelOnPS:
    """A built Keras model's weights on ``strategy``'s parameter servers (see module doc).

    Use :func:`on_ps` (one per model and strategy); ``fit`` makes it on first use.
    """

    def __init__(self, model: Any, strategy: Any, optimizer: ps_optimizers.Optimizer,
                 keras_optimizer: Any = None) -> None:
        _check_placeable(model)
        paths = [w.path for w in model.weights]
        dupes = sorted({p for p in paths if paths.count(p) > 1})
        if dupes:
            raise ValueError(f"weights of model {model.name!r} share the paths {dupes}: give "
                             "its layers distinct names")
        self.model = model
        self.strategy = strategy
        self.optimizer = optimizer
        #: Names this model's rebuilt copy on the workers (kept across ``fit`` calls).
        self.uid = secrets.token_hex(8)
        #: Weight paths in ``model.weights`` order, and which of them train.
        self.paths = paths
        self.trainable_paths = [w.path for w in model.trainable_weights]
        self.non_trainable_paths = [w.path for w in model.non_trainable_weights]
        #: The tables whose gradients travel as rows (IndexedSlices).
        self.sparse_paths = frozenset(
            layer.embeddings.path for layer in model._flatten_layers()
            if isinstance(layer, keras.layers.Embedding) and layer.built)
        values = [np.asarray(w.value) for w in model.weights]
        with strategy.scope():
            self.by_path: dict[str, Variable | ShardedVariable] = {
                path: Variable(value, trainable=w.trainable, name=path)
                for path, w, value in zip(paths, model.weights, values, strict=True)}
        self._use_optimizer(optimizer, keras_optimizer)
        self._synced = values

    def _use_optimizer(self, optimizer: ps_optimizers.Optimizer, keras_optimizer: Any) -> None:
        """Apply ``optimizer`` from now on; its ``iterations`` (the batches applied, as
        Keras' ``optimizer.iterations``) start from the Keras optimizer's, on a PS."""
        done = int(np.asarray(keras_optimizer.iterations.value)) if keras_optimizer is not None \
            else int(np.asarray(optimizer.iterations.numpy()))
        with self.strategy.scope():
            if getattr(optimizer.iterations, "ps_address", None) is None:
                # counted by apply_gradients: on a PS, every training worker's batches count,
                # and a Checkpoint holding the optimizer saves them
                optimizer.iterations = Variable(np.int64(0), trainable=False,
                                                name=f"{optimizer.name}/iterations")
        optimizer.iterations.assign(np.int64(done), read_value=False)
        self.optimizer = optimizer
        #: The Keras optimizer the server-side one was made from (None: given as such).
        self.keras_optimizer = keras_optimizer
        #: The batches applied: the server-side optimizer's ``iterations``.
        self.iterations: Variable = optimizer.iterations

    def refresh_optimizer(self) -> None:
        """After ``model.compile`` with another optimizer: apply its server-side equivalent."""
        current = self.model.optimizer
        if self.keras_optimizer is not None and current is not self.keras_optimizer:
            with self.strategy.scope():
                optimizer = server_optimizer(current)
            self._use_optimizer(optimizer, current)

    @property
    def variables(self) -> list[Variable | ShardedVariable]:
        """The variables on the parameter servers, in ``model.weights`` order."""
        return [self.by_path[p] for p in self.paths]

    def values(self) -> list[np.ndarray]:
        """The servers' values, in ``model.weights`` order (as ``get_weights``)."""
        return read_values(*self.variables)

    def pull(self) -> None:
        """Copy the servers' values (and the batch count) into the Keras model."""
        *values, iterations = read_values(*self.variables, self.iterations)
        for w, value in zip(self.model.weights, values, strict=True):
            w.assign(value)
        if self.model.optimizer is not None:
            self.model.optimizer.iterations.assign(int(iterations))
        self._synced = values

    def push(self) -> None:
        """Send the Keras model's weights to the servers (``assign``)."""
        values = [np.asarray(w.value) for w in self.model.weights]
        for var, value in zip(self.variables, values, strict=True):
            var.assign(value, read_value=False)
        self._synced = values

    def sync(self) -> bool:
        """Push the Keras model's weights if they changed since the last pull or push
        (``set_weights``/``load_weights`` on the model); True if they did."""
        values = [np.asarray(w.value) for w in self.model.weights]
        if all(np.array_equal(a, b) for a, b in zip(values, self._synced, strict=True)):
            return False
        self.push()
        return True

    def __repr__(self) -> str:
        return (f"<dds.keras.ModelOnPS {self.model.name!r}: {len(self.paths)} weights on "
                f"{self.strategy.num_ps} parameter servers, {self.optimizer!r}>")


def _check_placeable(model: Any) -> None:
    if not isinstance(model, keras.Model):
        raise TypeError(f"needs a keras.Model, got {type(model).__name__}")
    if not model.built:
        raise ValueError(
            f"the model {model.name!r} is not built: give its Input shape (keras.Input, or "
            "input_shape= on the first layer) or call model.build(shape) before putting "
            "it on the parameter servers")


def on_ps(model: Any, strategy: Any = None, optimizer: Any = None) -> ModelOnPS:
    """The model's :class:`ModelOnPS` on ``strategy`` (made on first call, then the same).

    ``strategy`` defaults to the one the model is bound to (created or compiled in its
    scope); ``optimizer`` to the server-side equivalent of ``model.optimizer``.
    """
    with _lock:
        placed: ModelOnPS | None = model.__dict__.get(_ATTR)
        if placed is not None:
            if strategy is not None and strategy is not placed.strategy:
                raise ValueError(f"the model {model.name!r} is already on another strategy's "
                                 "parameter servers")
            return placed
        strategy = strategy if strategy is not None else bound_strategy(model)
        if strategy is None:
            raise ValueError(
                f"the model {model.name!r} is not bound to a ParameterServerStrategy: create "
                "it inside `with strategy.scope():`, or pass strategy=")
        if optimizer is None:
            if getattr(model, "optimizer", None) is None:  # Keras 3 sets it in compile()
                raise ValueError(f"the model {model.name!r} is not compiled: call "
                                 "model.compile(optimizer=..., loss=...) first")
            optimizer = model.optimizer
        _check_placeable(model)
        keras_optimizer = optimizer if not isinstance(optimizer, ps_optimizers.Optimizer) else None
        with strategy.scope():  # its iterations on a PS
            server = server_optimizer(optimizer)
        placed = ModelOnPS(model, strategy, server, keras_optimizer)
        object.__setattr__(model, _ATTR, placed)
        return placed


def load_checkpoint(model: Any, path: str, name: str = "model") -> None:
    """Set the weights of any Keras ``model`` (on parameter servers or not) from a
    :class:`~dask_dataservice.Checkpoint` that saved a :class:`ModelOnPS` of the same
    architecture as ``Checkpoint(**{name: model_on_ps})``; a partitioned table is read
    back whole. The values are read into this process (no parameter server is involved)."""
    token = current_strategy.set(None)  # local variables, even inside a strategy's scope
    try:
        local = [Variable(np.zeros(tuple(w.shape), dtype=np.dtype(w.dtype)), name=w.path)
                 for w in model.weights]
    finally:
        current_strategy.reset(token)
    Checkpoint(**{name: local}).restore(path)
    model.set_weights([v.numpy() for v in local])
