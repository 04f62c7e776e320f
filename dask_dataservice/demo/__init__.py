"""The ``dask-dataservice demo``: a synthetic click-through pipeline on the data service, and
parameter-server training on it.

- :func:`make_click_dataset`: the input pipeline (generate → shuffle → batch → preprocess →
  prefetch), generated where it is read, splittable for DYNAMIC sharding;
- :func:`train_click_model`: an embedding + logistic model trained on that stream with
  ``ParameterServerStrategy`` and ``ClusterCoordinator``;
- :func:`run_demo` with :class:`DemoOptions`: the whole demo as the command line runs it
  (``dask_dataservice.cli`` only parses options into a :class:`DemoOptions`).

The demo is an application of the package's public API; nothing in the package imports it.
"""

from ._cluster import DemoError, DemoUsageError
from ._data import DENSE_FEATURES, SPARSE_FEATURES, VOCAB_SIZE, make_click_dataset
from ._run import DemoOptions, run_demo
from ._train import TrainResult, train_click_model

__all__ = [
    "DENSE_FEATURES",
    "SPARSE_FEATURES",
    "VOCAB_SIZE",
    "DemoError",
    "DemoOptions",
    "DemoUsageError",
    "TrainResult",
    "make_click_dataset",
    "run_demo",
    "train_click_model",
]
