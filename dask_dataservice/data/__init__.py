"""The pipeline library: ``Dataset`` and its sources, transformations and splits.

Nothing in this package imports Dask: a pipeline is defined and iterated in plain Python,
and the data service (:mod:`dask_dataservice.service`) runs the same objects on workers.
"""

from . import readers
from ._base import AUTOTUNE, INFINITE, UNKNOWN
from .dask_source import DaskPartition, DaskPartitionLostError
from .dataset import Dataset
from .spec import TensorSpec
from .splits import (
    SHARD_HINT,
    ComponentSplit,
    FileSplit,
    IndexRange,
    ListSplitProvider,
    NotSplittableError,
    SplitProvider,
)

__all__ = [
    "AUTOTUNE",
    "INFINITE",
    "UNKNOWN",
    "SHARD_HINT",
    "ComponentSplit",
    "DaskPartition",
    "DaskPartitionLostError",
    "Dataset",
    "FileSplit",
    "IndexRange",
    "ListSplitProvider",
    "NotSplittableError",
    "SplitProvider",
    "TensorSpec",
    "readers",
]
