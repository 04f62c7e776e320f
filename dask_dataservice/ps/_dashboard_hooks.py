"""Hooks by which the parameter servers and the coordinator feed the dashboard (issue 14).

Kept inside ``ps`` (the package's layering lets ``ps`` import only ``config``, ``_rpc``,
``_async`` and ``errors`` from elsewhere): ``count_shard_op`` counts gathers and update
requests per shard on a parameter server (read by ``dashboard/_worker.py``), and
``report_coordinator`` sends a ``ClusterCoordinator``'s queue depth to the scheduler's
dashboard plugin (``dataservice_coordinator_report``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["count_shard_op", "report_coordinator"]


#: Shard methods a parameter server runs, and the counter each one adds to.
_SHARD_OPS = {"gather": "gathers", "gather_into": "gathers", "update": "updates",
              "scatter": "updates", "apply": "updates"}


def count_shard_op(server: Any, key: str, fn: Any) -> None:
    """A parameter server runs ``fn`` (a ``Shard`` method) on shard ``key``: count gathers and
    update requests per shard (``server.shard_ops``; deleted shards are dropped by readers)."""
    kind = _SHARD_OPS.get(getattr(fn, "__name__", ""))
    if kind is None:
        return
    by_shard: dict[str, dict[str, int]] | None = getattr(server, "shard_ops", None)
    if by_shard is None:
        by_shard = server.shard_ops = {}
    counts = by_shard.get(key)
    if counts is None:
        counts = by_shard[key] = {"gathers": 0, "updates": 0}
    counts[kind] += 1


async def report_coordinator(coordinator: Any) -> None:
    """Tell the scheduler's dashboard how a ``ClusterCoordinator`` is doing (its queue lives in
    the trainer's process). Called from the coordinator's membership loop; a scheduler without
    the dashboard answers nothing once, and the coordinator stops reporting."""
    if getattr(coordinator, "_dds_no_dashboard", False):
        return
    scheduler = coordinator._client.scheduler
    if scheduler is None:
        return
    stats = coordinator.stats
    reply = await scheduler.dataservice_coordinator_report(
        uid=int(coordinator._uid), queued=len(coordinator._queue),
        finished=int(stats.get("finished", 0)), requeued=int(stats.get("requeued", 0)),
        workers=len(coordinator._feeders))
    if reply is None:
        coordinator._dds_no_dashboard = True
