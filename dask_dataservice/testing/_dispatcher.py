"""Cleanup asserts for the dispatcher plugin (see :mod:`dask_dataservice.testing`)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from distributed.metrics import time

if TYPE_CHECKING:
    from distributed import Scheduler

__all__ = ["assert_dispatcher_cleanup", "dispatcher_leftovers"]


def dispatcher_leftovers(plugin: Any) -> list[str]:
    """What keeps the dispatcher ``plugin`` from being idle (empty when it is).

    Idle means: no live iteration client, every iteration of an anonymous job garbage
    collected (named jobs are kept for ``job-gc-timeout``, as in TensorFlow), the plugin's
    set of idle named iterations names only live iterations without clients, and no journal
    append still waiting to be made durable.
    """
    state = plugin.state
    problems = []
    clients = state.list_iteration_clients()
    if clients:
        problems.append(
            f"{len(clients)} iteration client(s) still acquired: "
            f"{[(c.iteration_client_id, c.iteration_id) for c in clients]}")
    for it in state.list_iterations():
        if it.garbage_collected:
            continue
        if state.job(it.job_id).job_name is None:
            problems.append(f"iteration {it.iteration_id} of an anonymous job is not collected "
                            f"({it.num_clients} client(s), {it.status})")
    for iteration_id in getattr(plugin, "_idle_iterations", ()):
        it = state.iteration(iteration_id)
        if not it.garbage_collected and it.num_clients:
            problems.append(f"idle set names iteration {iteration_id}, which has clients")
    seen = set(getattr(plugin, "_client_seen", ()))
    stale = seen - {c.iteration_client_id for c in clients}
    if stale:
        problems.append(f"liveness times kept for released clients {sorted(stale)}")
    tail = getattr(plugin, "_journal_tail", None)
    if tail is not None and not tail.done():
        problems.append("a journal append is still waiting to be written")
    return problems


async def assert_dispatcher_cleanup(scheduler: Scheduler, timeout: float = 10.0) -> None:
    """The dispatcher on ``scheduler`` (if any) becomes idle within ``timeout`` seconds.

    Polls :func:`dispatcher_leftovers` until it is empty (clients release their iterations
    asynchronously), then checks ``state.validate_state()`` and that the plugin runs no
    periodic callback other than its garbage collection.
    """
    from dask_dataservice.service.dispatcher.plugin import PLUGIN_NAME

    plugin: Any = scheduler.plugins.get(PLUGIN_NAME)
    if plugin is None or getattr(plugin, "state", None) is None:
        return
    deadline = time() + timeout
    while problems := dispatcher_leftovers(plugin):
        if time() > deadline:
            raise AssertionError("dispatcher not cleaned up: " + "; ".join(problems))
        await asyncio.sleep(0.01)
    plugin.state.validate_state()
    ours = [name for name in scheduler.periodic_callbacks if name.startswith("dataservice")]
    assert ours in ([], ["dataservice-gc"]), f"unexpected dispatcher callbacks: {ours}"
