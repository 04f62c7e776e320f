"""dask_dataservice: tf.data service and parameter-server training on Dask.

The pipeline library (:mod:`dask_dataservice.data`) is imported eagerly and needs no Dask;
the service and parameter-server names are imported on first use, so ``import
dask_dataservice`` stays light.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from .data import (
    AUTOTUNE,
    INFINITE,
    SHARD_HINT,
    UNKNOWN,
    Dataset,
    FileSplit,
    IndexRange,
)
from .errors import *  # noqa: F403 - every public error type (listed in __all__ below)
from .errors import __all__ as _ERRORS

try:
    __version__ = version("dask-dataservice")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"

#: Public names that live in modules importing Dask, loaded lazily: name -> module.
_LAZY: dict[str, str] = {
    # data service
    "ShardingPolicy": "dask_dataservice.service.client",
    "CrossTrainerCache": "dask_dataservice.service.client",
    "register_dataset": "dask_dataservice.service.client",
    "from_dataset_id": "dask_dataservice.service.client",
    "distribute": "dask_dataservice.service.client",
    "install": "dask_dataservice.service.client",
    "DistributedDataset": "dask_dataservice.service.client",
    "distributed_save": "dask_dataservice.data.snapshot",
    "DispatcherConfig": "dask_dataservice.service.servers",
    "DispatchServer": "dask_dataservice.service.servers",
    "WorkerConfig": "dask_dataservice.service.servers",
    "WorkerServer": "dask_dataservice.service.servers",
    "status": "dask_dataservice.dashboard",
    # parameter-server training
    "ParameterServerStrategy": "dask_dataservice.ps.strategy",
    "ClusterCoordinator": "dask_dataservice.ps.coordinator",
    "Variable": "dask_dataservice.ps.variables",
    "ShardedVariable": "dask_dataservice.ps.variables",
    "Checkpoint": "dask_dataservice.ps.checkpoint",
    "partitioners": "dask_dataservice.ps.partitioners",
    "fit": "dask_dataservice.ps.fit",
    "DatasetCreator": "dask_dataservice.ps.fit",
    "SidecarEvaluator": "dask_dataservice.ps.evaluator",
    "StaticHashTable": "dask_dataservice.ps.tables",
    "DistributedTable": "dask_dataservice.ps.tables",
    # the PyTorch bridge (a module: dds.torch.IterableDataset); imports torch
    "torch": "dask_dataservice.torch",
}
#: Lazy names left out of the TYPE_CHECKING re-exports below: following them makes a type
#: checker analyse torch itself (minutes of mypy time for every user of the package). Typed
#: code imports ``dask_dataservice.torch`` explicitly.
_UNTYPED_LAZY = frozenset({"torch"})

if TYPE_CHECKING:  # type checkers see the lazy names' real types (keep in sync with _LAZY)
    from .dashboard import status as status
    from .data.snapshot import distributed_save as distributed_save
    from .ps import partitioners as partitioners
    from .ps.checkpoint import Checkpoint as Checkpoint
    from .ps.coordinator import ClusterCoordinator as ClusterCoordinator
    from .ps.evaluator import SidecarEvaluator as SidecarEvaluator
    from .ps.fit import DatasetCreator as DatasetCreator
    from .ps.fit import fit as fit
    from .ps.strategy import ParameterServerStrategy as ParameterServerStrategy
    from .ps.tables import DistributedTable as DistributedTable
    from .ps.tables import StaticHashTable as StaticHashTable
    from .ps.variables import ShardedVariable as ShardedVariable
    from .ps.variables import Variable as Variable
    from .service.client import CrossTrainerCache as CrossTrainerCache
    from .service.client import DistributedDataset as DistributedDataset
    from .service.client import ShardingPolicy as ShardingPolicy
    from .service.client import distribute as distribute
    from .service.client import from_dataset_id as from_dataset_id
    from .service.client import install as install
    from .service.client import register_dataset as register_dataset
    from .service.servers import DispatcherConfig as DispatcherConfig
    from .service.servers import DispatchServer as DispatchServer
    from .service.servers import WorkerConfig as WorkerConfig
    from .service.servers import WorkerServer as WorkerServer


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dask_dataservice' has no attribute {name!r}")
    mod = importlib.import_module(module)
    value = mod if name in ("partitioners", "torch") else getattr(mod, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AUTOTUNE",
    "INFINITE",
    "UNKNOWN",
    "SHARD_HINT",
    "Dataset",
    "FileSplit",
    "IndexRange",
    "__version__",
    *_ERRORS,
    *sorted(_LAZY),
]


def dask_setup(server: object) -> object:
    """Dask preload entry point: ``--preload dask_dataservice`` installs the plugins."""
    from .service.preload import dask_setup as _setup

    return _setup(server)  # type: ignore[arg-type]  # a Scheduler or a Worker (dask's preload)
