"""Preload hooks: ``dask scheduler --preload dask_dataservice`` / ``dask worker --preload ...``.

On a scheduler this adds the dispatcher plugin (which also registers the data-worker plugin
with the scheduler, so every worker that joins gets it); on a worker it adds the data-worker
plugin directly, for workers that join a scheduler started without the preload.
"""

from __future__ import annotations

from distributed import Scheduler, Worker


def dask_setup(server: Scheduler | Worker) -> object:
    from .dispatcher.plugin import DispatcherPlugin
    from .worker import DataWorkerPlugin

    if isinstance(server, Scheduler):
        server.add_plugin(DispatcherPlugin())
        return None
    if isinstance(server, Worker):
        return server.plugin_add(DataWorkerPlugin(), name=DataWorkerPlugin.name)
    return None
