"""The dispatcher's periodic garbage collection (its ``dataservice-gc`` callback).

Releases clients that stopped sending heartbeats (``dispatcher.client-timeout``; timers start
again after a restart, heartbeats are not journaled), drops silent data workers
(:meth:`~._liveness.WorkerLiveness.check`), and collects idle named iterations after
``dispatcher.job-gc-timeout`` (:func:`collectable`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ._entities import Iteration

logger = logging.getLogger("dask_dataservice.service.dispatcher.plugin")

__all__ = ["collect", "collectable"]


def collect(plugin: Any) -> None:
    """One round of garbage collection of ``plugin`` (a DispatcherPlugin); never raises."""
    try:
        plugin._liveness.check()
        now = int(time.time() * 1_000_000)
        assert plugin.client_timeout is not None and plugin.job_gc_timeout is not None  # start()
        timeout = int(plugin.client_timeout * 1_000_000)
        for client in plugin.state.list_iteration_clients():
            # after a restart, every timer starts again (heartbeats are not journaled)
            seen = max(client.last_seen_micros, plugin._recovered_at,
                       plugin._client_seen.get(client.iteration_client_id, 0))
            if now - seen > timeout:
                logger.info("dataservice: releasing client %s (no heartbeat for %.1fs)",
                            client.iteration_client_id, (now - seen) / 1e6)
                plugin._release_client(client.iteration_client_id)
        gc_timeout = int(plugin.job_gc_timeout * 1_000_000)
        for iteration_id in list(plugin._idle_iterations):
            it = plugin.state.iteration(iteration_id)
            if it.garbage_collected or it.num_clients or it.last_client_released_micros is None:
                plugin._idle_iterations.discard(iteration_id)
                continue
            # after a restart, every timer starts again (nothing is collected early)
            released = max(it.last_client_released_micros, plugin._recovered_at)
            if now - released >= gc_timeout and collectable(plugin, it):
                plugin._garbage_collect(it.iteration_id)
    except Exception:  # noqa: BLE001 - a periodic callback must not die
        logger.exception("dataservice: garbage collection failed")


def collectable(plugin: Any, iteration: Iteration) -> bool:
    """Whether an idle named iteration may be collected once ``job-gc-timeout`` passed.

    A DYNAMIC job promises that every split is read once (TensorFlow's visitation
    guarantee): a consumer that comes back later under the job's name goes on where the job
    stopped. So, as in TensorFlow, an unfinished DYNAMIC iteration is kept while it can still
    be read, unless ``dataservice.dispatcher.gc-dynamic-sharding-jobs`` (TF's
    ``gc_dynamic_sharding_jobs``) says otherwise; it is collected once it finished (and
    stayed idle). Other modes are collected after the timeout as before; anonymous jobs
    never get here (they go as soon as their consumer leaves).
    """
    if iteration.finished or plugin._gc_dynamic_jobs:
        return True
    return bool(plugin.state.job(iteration.job_id).processing_mode != "DYNAMIC")
