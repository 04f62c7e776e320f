"""The server-side optimizer that applies a Keras optimizer's update on the parameter servers.

A Keras optimizer keeps its slots (momenta, accumulators) beside the model; here they live on
the parameter servers beside each shard, and the update rule is the project's numpy one
(:mod:`dask_dataservice.ps.optimizers`), which follows Keras' rules: ``SGD`` (momentum,
Nesterov), ``Adagrad``, ``Adam`` and ``RMSprop``. Options whose effect cannot be applied
shard by shard on a server without more state (weight decay, gradient clipping, EMA,
gradient accumulation, loss scaling, AMSGrad, a learning-rate schedule) are refused with an
error naming the option, never ignored.
"""

from __future__ import annotations

from typing import Any

from ..ps import optimizers as ps_optimizers
from ._backend import keras

__all__ = ["server_optimizer"]

#: Options of keras.optimizers.Optimizer that must keep their neutral value.
_NEUTRAL: dict[str, Any] = {"weight_decay": None, "clipnorm": None, "global_clipnorm": None,
                            "clipvalue": None, "use_ema": False, "loss_scale_factor": None,
                            "gradient_accumulation_steps": None}


def server_optimizer(optimizer: Any) -> ps_optimizers.Optimizer:
    """The server-side optimizer equal to the Keras ``optimizer`` (an instance or a name)."""
    if isinstance(optimizer, ps_optimizers.Optimizer):
        return optimizer
    optimizer = keras.optimizers.get(optimizer)
    kind = type(optimizer).__name__
    known = {"SGD": keras.optimizers.SGD, "Adagrad": keras.optimizers.Adagrad,
             "Adam": keras.optimizers.Adam, "RMSprop": keras.optimizers.RMSprop}
    if type(optimizer) is not known.get(kind):
        raise ValueError(
            f"the Keras optimizer {kind} has no server-side equivalent: use SGD, Adagrad, Adam "
            "or RMSprop (their updates are applied on the parameter servers)")
    cfg = optimizer.get_config()
    for option, neutral in _NEUTRAL.items():
        if cfg.get(option, neutral) not in (neutral, 0, 0.0):
            raise ValueError(
                f"{kind}({option}={cfg[option]!r}) cannot be applied on the parameter servers "
                f"(each server updates its shards alone); leave {option} unset")
    if isinstance(optimizer._learning_rate, keras.optimizers.schedules.LearningRateSchedule):
        raise ValueError(
            f"{kind} with a learning-rate schedule cannot be applied on the parameter servers "
            "(steps run asynchronously: no server knows the global step): give a number")
    lr = float(cfg["learning_rate"])
    if kind == "SGD":
        return ps_optimizers.SGD(lr, momentum=cfg["momentum"], nesterov=cfg["nesterov"])
    if kind == "Adagrad":
        return ps_optimizers.Adagrad(lr, initial_accumulator_value=cfg["initial_accumulator_value"],
                                     epsilon=cfg["epsilon"])
    if kind == "Adam":
        if cfg.get("amsgrad"):
            raise ValueError("Adam(amsgrad=True) cannot be applied on the parameter servers; "
                             "leave amsgrad unset")
        return ps_optimizers.Adam(lr, beta_1=cfg["beta_1"], beta_2=cfg["beta_2"],
                                  epsilon=cfg["epsilon"])
    return ps_optimizers.RMSprop(lr, rho=cfg["rho"], momentum=cfg["momentum"],
                                 epsilon=cfg["epsilon"], centered=cfg["centered"])
