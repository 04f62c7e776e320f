"""Server-side optimizers: the parameter server applies the update, beside the shard.

A training step sends its gradients (dense, or :class:`IndexedSlices` for the rows an
embedding lookup touched) and the parameter server holding each shard applies the optimizer
to the shard in place. The optimizer's slot variables (momentum, accumulators, moments) live
beside the shard on the same PS, so a step moves the gradient once and never reads the
variable back, instead of the read-modify-write TensorFlow's workers do::

    with strategy.scope():
        emb = dds.Variable(np.zeros((1000, 16), "f4"), name="emb")
    opt = dds.ps.optimizers.Adagrad(learning_rate=0.1)

    def step(ids, grad_rows):           # runs on a training worker
        opt.apply_gradients([(IndexedSlices(grad_rows, ids), emb)])

The update rules are Keras': :class:`SGD` (optional momentum and Nesterov), :class:`Adagrad`,
:class:`Adam` and :class:`RMSprop`. Sparse gradients first sum the rows of duplicate ids, then update only
those rows (for Adam this is the "lazy" variant: moments of untouched rows do not decay).
Adam's step count is kept per shard.

The math is in :mod:`._kernels` (:func:`apply_dense` / :func:`apply_sparse`, pure numpy,
run by the PS); this module holds only the client-side objects.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ._kernels import (
    apply_dense,
    apply_sparse,
    check_hyperparameter,
    dedupe_rows,
    put_rows,
    take_rows,
)
from ._types import IndexedSlices
from .variables import Variable, apply_gradients

__all__ = ["Optimizer", "SGD", "Adagrad", "Adam", "RMSprop", "IndexedSlices", "get", "apply_dense",
           "apply_sparse", "dedupe_rows", "take_rows", "put_rows"]


class Optimizer:
    """Base class: hyperparameters on the coordinator, slots and updates on the PS.

    An optimizer object is small and picklable; use it inside scheduled functions. Its
    slots live beside each variable it updates, keyed by its ``name``: the class name by
    default (``"Adagrad"``, as Keras), never a counter, so a fresh process that creates its
    optimizers in another order finds the slots a checkpoint saved. Two optimizers *of the
    same kind updating the same variable* need explicit, distinct names.

    ``iterations`` counts the calls of :meth:`apply_gradients` (Keras' ``optimizer.iterations``,
    the training step): an int64 variable created with the optimizer, on a parameter server
    when the optimizer is created in ``strategy.scope()`` (so every training worker's steps
    count, and a :class:`~.checkpoint.Checkpoint` holding the optimizer saves and restores
    it), else local to the process that applies the gradients.
    """

    kind: str = ""
    slot_names: tuple[str, ...] = ()

    def __init__(self, learning_rate: float, name: str | None = None) -> None:
        self.learning_rate = check_hyperparameter("learning_rate", learning_rate)
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"an optimizer's name must be a non-empty str, got {name!r}")
        self.name = name if name is not None else type(self).__name__
        #: Steps applied (Keras' ``optimizer.iterations``; see the class docstring).
        self.iterations: Any = Variable(np.int64(0), trainable=False,
                                        name=f"{self.name}/iterations")

    def get_config(self) -> dict[str, Any]:
        """The hyperparameters, as sent to the parameter servers with each update."""
        return {"kind": self.kind, "name": self.name, "learning_rate": self.learning_rate}

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]]) -> None:
        """Send each gradient to the PS holding its variable; the PS applies the update.

        ``grads_and_vars`` is an iterable of ``(gradient, variable)``; a gradient is an array
        of the variable's shape or an :class:`IndexedSlices` of rows. Updates to different
        variables and shards travel in parallel.
        """
        apply_gradients(self.get_config(), list(grads_and_vars))
        self.iterations.assign_add(1, read_value=False)  # after the updates, in their lane

    def __repr__(self) -> str:
        cfg = {k: v for k, v in self.get_config().items() if k != "kind"}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in cfg.items())})"


class SGD(Optimizer):
    """Gradient descent, with optional (Nesterov) momentum, as ``keras.optimizers.SGD``."""

    kind = "sgd"

    def __init__(self, learning_rate: float = 0.01, momentum: float = 0.0, nesterov: bool = False,
                 name: str | None = None) -> None:
        super().__init__(learning_rate, name)
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"momentum must be in [0, 1], got {momentum!r}")
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)

    @property
    def slot_names(self) -> tuple[str, ...]:  # type: ignore[override]  # momentum 0: no slot
        return ("momentum",) if self.momentum else ()

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "momentum": self.momentum, "nesterov": self.nesterov}


class Adagrad(Optimizer):
    """Adagrad, as ``keras.optimizers.Adagrad``: per-element accumulated squared gradients."""

    kind = "adagrad"
    slot_names = ("accumulator",)

    def __init__(self, learning_rate: float = 0.001, initial_accumulator_value: float = 0.1,
                 epsilon: float = 1e-7, name: str | None = None) -> None:
        super().__init__(learning_rate, name)
        self.initial_accumulator_value = check_hyperparameter(
            "initial_accumulator_value", initial_accumulator_value)
        self.epsilon = check_hyperparameter("epsilon", epsilon)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "initial_accumulator_value": self.initial_accumulator_value,
                "epsilon": self.epsilon}


class Adam(Optimizer):
    """Adam, as ``keras.optimizers.Adam`` (bias-corrected step size, per-shard step count)."""

    kind = "adam"
    slot_names = ("m", "v", "iterations")

    def __init__(self, learning_rate: float = 0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, name: str | None = None) -> None:
        super().__init__(learning_rate, name)
        for label, b in (("beta_1", beta_1), ("beta_2", beta_2)):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"{label} must be in [0, 1), got {b!r}")
        self.beta_1, self.beta_2 = float(beta_1), float(beta_2)
        self.epsilon = check_hyperparameter("epsilon", epsilon)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "beta_1": self.beta_1, "beta_2": self.beta_2,
                "epsilon": self.epsilon}


class RMSprop(Optimizer):
    """RMSprop, as ``keras.optimizers.RMSprop`` (optional momentum, ``centered``)."""

    kind = "rmsprop"

    def __init__(self, learning_rate: float = 0.001, rho: float = 0.9, momentum: float = 0.0,
                 epsilon: float = 1e-7, centered: bool = False, name: str | None = None) -> None:
        super().__init__(learning_rate, name)
        for label, x in (("rho", rho), ("momentum", momentum)):
            if not 0.0 <= x <= 1.0:
                raise ValueError(f"{label} must be in [0, 1], got {x!r}")
        self.rho, self.momentum = float(rho), float(momentum)
        self.epsilon = check_hyperparameter("epsilon", epsilon)
        self.centered = bool(centered)

    @property
    def slot_names(self) -> tuple[str, ...]:  # type: ignore[override]  # depends on the config
        return ("velocity", *(("momentum",) if self.momentum else ()),
                *(("average_gradient",) if self.centered else ()))

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "rho": self.rho, "momentum": self.momentum,
                "epsilon": self.epsilon, "centered": self.centered}


_KINDS: dict[str, Callable[..., Optimizer]] = {"sgd": SGD, "adagrad": Adagrad, "adam": Adam,
                                               "rmsprop": RMSprop}


def get(identifier: Any) -> Optimizer:
    """An optimizer from an instance, a name (``"sgd"``, ``"adagrad"``, ``"adam"``,
    ``"rmsprop"``) or a config."""
    if isinstance(identifier, Optimizer):
        return identifier
    if isinstance(identifier, str) and identifier.lower() in _KINDS:
        return _KINDS[identifier.lower()]()
    if isinstance(identifier, dict) and identifier.get("kind") in _KINDS:
        cfg = dict(identifier)
        return _KINDS[cfg.pop("kind")](**cfg)
    raise ValueError(f"unknown optimizer {identifier!r}; use one of {sorted(_KINDS)}")
