"""Keras 3 models on parameter servers (the JAX backend).

::

    import keras
    import dask_dataservice as dds

    strategy = dds.ParameterServerStrategy(client, variable_partitioner=...)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,), dtype="int32"),
                                  keras.layers.Embedding(10_000, 16),
                                  keras.layers.Flatten(), keras.layers.Dense(1)])
    model.compile(optimizer="rmsprop", loss="mse", steps_per_execution=10)
    history = model.fit(dds.DatasetCreator(dataset_fn), epochs=3, steps_per_epoch=100)

Importing this package imports Keras and JAX (``pip install 'dask-dataservice[keras]'``;
``KERAS_BACKEND`` is set to ``jax`` if Keras is not imported yet); ``import
dask_dataservice`` does not. See docs/keras.md.
"""

from .fit import KerasMetrics, fit, install
from .model import ModelOnPS, bound_strategy, load_checkpoint, on_ps
from .optimizer import server_optimizer
from .step import TrainStep

install()

__all__ = ["fit", "install", "KerasMetrics", "ModelOnPS", "on_ps", "bound_strategy", "load_checkpoint",
           "server_optimizer", "TrainStep"]
