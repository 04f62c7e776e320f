"""dask_dataservice: tf.data service and parameter-server training on Dask.

The pipeline library (:mod:`dask_dataservice.data`) is imported eagerly and needs no Dask;
the service and parameter-server names are imported on first use, so ``import
dask_dataservice`` stays light.
"""

from __future__ import annotations

import importlib
from contextlib import AbstractContextManager as _AbstractContextManager
from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _version
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
from .data import _adapters as _data_adapters
from .data import dask_source as _dask_source
from .errors import (
    CheckpointCorruptedError,
    CheckpointMismatchError,
    ClosureCancelledError,
    DaskPartitionLostError,
    DataServiceError,
    DatasetNotFoundError,
    DemoError,
    DemoUsageError,
    DispatcherUnavailableError,
    IllegalUpdateError,
    InputExhaustedError,
    InputPositionError,
    IterationClientNotFoundError,
    IterationNotFoundError,
    JobAccessDeniedError,
    JobNameInUseError,
    JobNotFoundError,
    JournalClosedError,
    JournalCorruptedError,
    JournalError,
    NotSplittableError,
    ParameterServerError,
    ParameterServerUnavailableError,
    RemoteValueArgumentError,
    ServerClosingError,
    ServiceLimitError,
    ShapeMismatchError,
    SnapshotCorruptedError,
    StaleEpochError,
    TaskNotFoundError,
    TFRecordCorruptError,
    VariableNotFoundError,
    WorkerNotFoundError,
)
from .ps import _scope_hooks as _ps_scope_hooks
from .service.protocol import _hooks as _service_hooks

try:
    __version__ = _version("dask-dataservice")
except _PackageNotFoundError:  # pragma: no cover - running from a source tree
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
    "distributed_save": "dask_dataservice.service.client.snapshot",
    "DispatcherConfig": "dask_dataservice.service.servers",
    "DispatchServer": "dask_dataservice.service.servers",
    "WorkerConfig": "dask_dataservice.service.servers",
    "WorkerServer": "dask_dataservice.service.servers",
    "status": "dask_dataservice.dashboard",
    "DemandAdaptive": "dask_dataservice.service.adaptive",
    # parameter-server training
    "ParameterServerStrategy": "dask_dataservice.ps.strategy",
    "ClusterSpec": "dask_dataservice.ps.cluster_resolver",
    "SimpleClusterResolver": "dask_dataservice.ps.cluster_resolver",
    "TFConfigClusterResolver": "dask_dataservice.ps.cluster_resolver",
    "ClusterCoordinator": "dask_dataservice.ps.coordinator",
    "Variable": "dask_dataservice.ps.variables",
    "ShardedVariable": "dask_dataservice.ps.variables",
    "Checkpoint": "dask_dataservice.ps.checkpoint",
    "CheckpointManager": "dask_dataservice.ps.checkpoint_manager",
    "partitioners": "dask_dataservice.ps.partitioners",
    "fit": "dask_dataservice.ps.fit",
    "DatasetCreator": "dask_dataservice.ps.fit",
    "SidecarEvaluator": "dask_dataservice.ps.evaluator",
    "StaticHashTable": "dask_dataservice.ps.tables",
    "DistributedTable": "dask_dataservice.ps.tables",
    # the PyTorch bridge (a module: dds.torch.IterableDataset); imports torch
    "torch": "dask_dataservice.torch",
    # Keras 3 models on parameter servers (a module: dds.keras.fit); imports keras and jax
    "keras": "dask_dataservice.keras",
}
#: Lazy names left out of the TYPE_CHECKING re-exports below: following them makes a type
#: checker analyse torch itself (minutes of mypy time for every user of the package). Typed
#: code imports ``dask_dataservice.torch`` explicitly.
_UNTYPED_LAZY = frozenset({"torch", "keras"})

if TYPE_CHECKING:  # type checkers see the lazy names' real types (keep in sync with _LAZY)
    from .dashboard import status as status
    from .ps import partitioners as partitioners
    from .ps.checkpoint import Checkpoint as Checkpoint
    from .ps.checkpoint_manager import CheckpointManager as CheckpointManager
    from .ps.cluster_resolver import ClusterSpec as ClusterSpec
    from .ps.cluster_resolver import SimpleClusterResolver as SimpleClusterResolver
    from .ps.cluster_resolver import TFConfigClusterResolver as TFConfigClusterResolver
    from .ps.coordinator import ClusterCoordinator as ClusterCoordinator
    from .ps.evaluator import SidecarEvaluator as SidecarEvaluator
    from .ps.fit import DatasetCreator as DatasetCreator
    from .ps.fit import fit as fit
    from .ps.strategy import ParameterServerStrategy as ParameterServerStrategy
    from .ps.tables import DistributedTable as DistributedTable
    from .ps.tables import StaticHashTable as StaticHashTable
    from .ps.variables import ShardedVariable as ShardedVariable
    from .ps.variables import Variable as Variable
    from .service.adaptive import DemandAdaptive as DemandAdaptive
    from .service.client import CrossTrainerCache as CrossTrainerCache
    from .service.client import DistributedDataset as DistributedDataset
    from .service.client import ShardingPolicy as ShardingPolicy
    from .service.client import distribute as distribute
    from .service.client import from_dataset_id as from_dataset_id
    from .service.client import install as install
    from .service.client import register_dataset as register_dataset
    from .service.client.snapshot import distributed_save as distributed_save
    from .service.servers import DispatcherConfig as DispatcherConfig
    from .service.servers import DispatchServer as DispatchServer
    from .service.servers import WorkerConfig as WorkerConfig
    from .service.servers import WorkerServer as WorkerServer


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dask_dataservice' has no attribute {name!r}")
    mod = importlib.import_module(module)
    value = mod if name in ("partitioners", "torch", "keras") else getattr(mod, name)
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
    "dask_setup",
    # every public error type (dask_dataservice.errors.__all__)
    "CheckpointCorruptedError",
    "CheckpointMismatchError",
    "ClosureCancelledError",
    "DaskPartitionLostError",
    "DataServiceError",
    "DatasetNotFoundError",
    "DemoError",
    "DemoUsageError",
    "DispatcherUnavailableError",
    "IllegalUpdateError",
    "InputExhaustedError",
    "InputPositionError",
    "IterationClientNotFoundError",
    "IterationNotFoundError",
    "JobAccessDeniedError",
    "JobNameInUseError",
    "JobNotFoundError",
    "JournalClosedError",
    "JournalCorruptedError",
    "JournalError",
    "NotSplittableError",
    "ParameterServerError",
    "ParameterServerUnavailableError",
    "RemoteValueArgumentError",
    "ServerClosingError",
    "ServiceLimitError",
    "ShapeMismatchError",
    "SnapshotCorruptedError",
    "StaleEpochError",
    "TFRecordCorruptError",
    "TaskNotFoundError",
    "VariableNotFoundError",
    "WorkerNotFoundError",
    # the lazy names, but the torch and keras bridges (modules whose import needs torch or keras: a star import
    # must work without it; dds.torch still loads it)
    *sorted(set(_LAZY) - {"torch", "keras"}),
]


# -- what the lower layers get from above (tests/project/test_layering.py: imports run downward) --


def _torch_adapter() -> type:
    from .torch import IterableDataset

    return IterableDataset


def _jax_adapter() -> type:
    from .jax import JaxIterable

    return JaxIterable


def _dask_cluster_side() -> object:
    from .service.worker import dask_source

    return dask_source


async def _attach_dashboard(scheduler: object) -> None:
    """issue 14: dashboard pages, /dataservice/status.json, /metrics on every scheduler a
    dispatcher starts on (``--preload``, ``DispatchServer``, ``dds.install``)."""
    from .dashboard import attach

    await attach(scheduler)


_data_adapters.register("torch", _torch_adapter)  # Dataset.to_torch()
_data_adapters.register("jax", _jax_adapter)  # Dataset.to_jax()
_dask_source.set_cluster_loader(_dask_cluster_side)  # Dataset.from_dask on a client
_service_hooks.on_dispatcher_start("dashboard", _attach_dashboard)


def _keras_scope(strategy: object) -> _AbstractContextManager[object] | None:
    """Keras variables created in a strategy's scope remember it (``model.fit`` then trains
    on its parameter servers); only once the user imported Keras (never imported here)."""
    import sys

    if "keras" not in sys.modules:
        return None
    try:
        from .keras._scope import recording
    except ImportError:  # Keras on another backend: importing dds.keras says why
        return None
    return recording(strategy)


_ps_scope_hooks.register("keras", _keras_scope)  # strategy.scope() with Keras models


def dask_setup(server: object) -> object:
    """Dask preload entry point: ``--preload dask_dataservice`` installs the plugins."""
    from .service.preload import dask_setup as _setup

    return _setup(server)  # type: ignore[arg-type]  # a Scheduler or a Worker (dask's preload)
