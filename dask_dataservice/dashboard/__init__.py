"""See the service working: pages on Dask's dashboard, a JSON route, Prometheus, ``status()``.

:func:`attach` runs on the scheduler (the dispatcher calls it when it starts, so it covers
``dask-dataservice scheduler``, ``--preload dask_dataservice`` and ``dds.install`` on a running
cluster alike). It adds

- the scheduler plugin that polls the workers' figures (:mod:`._collect`) and the worker plugin
  that answers them (:mod:`._worker`);
- ``/dataservice/status.json`` (the same figures as plain JSON);
- the bokeh pages ``/dataservice`` and ``/parameter-servers``, linked from the dashboard's
  navigation bar (:mod:`._pages`; bokeh is a dependency, as for Dask's own pages);
- ``dataservice_*`` collectors on ``/metrics`` (:mod:`._prometheus`).

:func:`status` returns the figures to a client as plain data.
"""

from __future__ import annotations

import logging
from typing import Any

from ._collect import PLUGIN_NAME, DashboardPlugin
from ._names import PAGES, STATUS_ROUTE

__all__ = ["attach", "status", "PAGES", "STATUS_ROUTE"]

logger = logging.getLogger(__name__)



async def attach(scheduler: Any) -> DashboardPlugin:
    """Add the dashboard's parts to ``scheduler`` (idempotent; on the scheduler's loop)."""
    plugin = scheduler.plugins.get(PLUGIN_NAME)
    if isinstance(plugin, DashboardPlugin):
        return plugin
    from distributed.protocol.pickle import dumps

    from ._http_tls import secure_http
    from ._prometheus import register_scheduler
    from ._worker import WORKER_PLUGIN_NAME, DashboardWorkerPlugin

    secure_http(scheduler, "scheduler")  # issue 22: a TLS cluster's HTTP is TLS too
    plugin = DashboardPlugin()
    await plugin.start(scheduler)
    # added, not registered: it is started already (the scheduler may be starting its plugins)
    scheduler.add_plugin(plugin, name=PLUGIN_NAME, idempotent=True)
    if WORKER_PLUGIN_NAME not in scheduler.worker_plugins:
        await scheduler.register_worker_plugin(
            None, dumps(DashboardWorkerPlugin()), name=WORKER_PLUGIN_NAME, idempotent=True)
    register_scheduler(plugin)
    if getattr(scheduler, "http_application", None) is not None:
        from ._routes import add_routes

        add_routes(scheduler)
        try:
            from ._pages import add_pages
        except ImportError as e:  # bokeh missing or too old: Dask has no dashboard either
            logger.info("dataservice: no dashboard pages (%s); %s still works", e, STATUS_ROUTE)
        else:
            add_pages(scheduler)
    return plugin


def status(client: Any) -> dict[str, Any]:
    """The service's figures as plain data (what the dashboard pages and the JSON route show).

    ``client`` is a ``distributed.Client`` (or the scheduler's address). Keys: ``service``
    (datasets, jobs with their progress and throughput, consumers, journal), ``workers``
    (per worker: elements and bytes served, rates, buffers, tasks, CPU of the service's
    threads), ``parameter_servers`` (with their shards), ``training_workers``,
    ``coordinators`` (each ClusterCoordinator's queue), ``totals`` and ``timeline``.
    Rates are over the last 2 s (at least two samples) of samples taken every
    ``dataservice.dashboard.interval``, and one taken for this call.
    With an asynchronous client, returns an awaitable.
    """
    from ..service.client import _connection

    c = _connection.client_for(client)

    async def go() -> dict[str, Any]:
        installing = _connection.ensure_installed(c)
        if installing is not None:
            await installing
        scheduler = c.scheduler
        if scheduler is None:
            raise RuntimeError("status(): the client is not connected to a scheduler")
        resp = await scheduler.dataservice_status(fresh=True)
        if resp is None:
            raise RuntimeError(
                f"the scheduler at {scheduler.address} has no dataservice dashboard: install "
                "dask_dataservice there (dds.install(client) or --preload dask_dataservice)")
        out: dict[str, Any] = _lists(dict(resp))
        return out

    if c.asynchronous and _connection.on_loop_thread(c):
        return go()  # type: ignore[return-value]
    _connection.check_can_block(c, "status()")
    result: dict[str, Any] = _connection.run_blocking(c, go)
    return result


def _lists(x: Any) -> Any:
    """The comm turns lists into tuples: give them back as the JSON route shows them."""
    if isinstance(x, dict):
        return {k: _lists(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_lists(v) for v in x]
    return x
