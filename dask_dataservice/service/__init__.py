"""The data service on Dask, in role packages; this package is their wiring.

- :mod:`.protocol`: what the roles share (wire messages, frames, sharding policies, op
  names, token checks, input positions, read counters, the hooks installed from above);
- :mod:`.dispatcher`: state, journal and the scheduler plugin;
- :mod:`.worker`: the data-worker plugin, its buffers, split provider, reconnecting worker;
- :mod:`.client`: ``register_dataset`` / ``distribute`` / ``from_dataset_id``, the readers.

The roles import :mod:`.protocol` and never one another; the wiring (this module,
:mod:`.servers`, :mod:`.preload`) puts them together. Importing this module installs the
dispatcher's start hook that gives every joining worker the data-worker plugin, and the
plugins ``dds.install`` installs (``tests/project/test_layering.py`` enforces the directions).
"""

from __future__ import annotations

from typing import Any

from .protocol import _hooks


async def _add_worker_plugin(scheduler: Any) -> None:
    """Every worker that joins gets the data-worker half (as P2P does for its plugin)."""
    from distributed.protocol.pickle import dumps

    from .worker import PLUGIN_NAME as WORKER_PLUGIN
    from .worker import DataWorkerPlugin

    if WORKER_PLUGIN not in scheduler.worker_plugins:
        await scheduler.register_worker_plugin(
            None, dumps(DataWorkerPlugin()), name=WORKER_PLUGIN, idempotent=True
        )


def _plugins() -> tuple[Any, ...]:
    from .dispatcher.plugin import DispatcherPlugin
    from .worker.plugin import DataWorkerPlugin

    return DispatcherPlugin(), DataWorkerPlugin()


_hooks.on_dispatcher_start("data-worker-plugin", _add_worker_plugin)
_hooks.set_plugins(_plugins)
