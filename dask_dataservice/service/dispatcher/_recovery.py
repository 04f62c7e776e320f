"""A fault-tolerant dispatcher's start: replay the journal, then revive the workers that come
back with their tasks (issue 11 s1).

Replay (:func:`recover`) is the newest snapshot plus the records after it; a record that
decodes but is illegal for the state replayed so far is
:class:`~dask_dataservice.errors.JournalCorruptedError` naming its file and byte offset.

What the journal cannot know is whether the data workers of the previous run are still
there. Supervised data workers are (:mod:`._reconnect`): they keep their tasks, buffers and
split cursors while the scheduler is down, and register again once it is back. So the
replayed workers are not removed at once any more. Each one is *pending*:

- its first heartbeat says ``resumed`` (it kept its tasks): it is revived with them
  (:func:`revive`). Its tasks stay active, their splits in flight stay theirs, and readers go
  on reading them: nothing is lost and nothing is produced twice. A task the dispatcher
  assigned but the worker never received (the push was cut off by the crash) is sent to it
  as new, as on any heartbeat;
- its first heartbeat does not say ``resumed`` (a fresh process at the same address: what
  the old one held is gone): it is removed first (``RemoveWorker``: its tasks lost, the splits
  they held lost, never handed out again), then registers as a new worker;
- it never heartbeats: the liveness check drops it after ``dispatcher.worker-timeout``, with
  the same accounting (:mod:`._liveness`). That is the grace period of a worker that is
  still on its way back.

A DYNAMIC task's split request that was journaled, but whose reply the crash cut off, left
splits in flight for the task that its worker never got. The worker retries the request
saying how many splits of the repetition it received; :func:`undelivered` answers the
missing tail again (no new record: they are already the task's), so they are neither lost
nor handed to anyone else.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterable
from typing import Any

from ... import config
from ..._async import owned_executor, shutdown_executor
from . import _split_order
from .state import DispatcherState, RemoveWorker

logger = logging.getLogger("dask_dataservice.service.dispatcher.plugin")

__all__ = ["lineage", "recover", "revive", "undelivered"]


async def recover(plugin: Any) -> None:
    """Replay the journal of ``plugin`` (a DispatcherPlugin) before any handler is served,
    then open a new segment.

    The writer folds old segments into snapshots as it goes (``dispatcher.snapshot-records``
    / ``snapshot-bytes``); a long replayed tail is folded at once, in the background, so the
    next restart does not replay it again.
    """
    from ._state_codec import compact, restore
    from .journal import JournalWriter, load_journal

    work_dir = os.fspath(plugin.work_dir)
    snapshot_records = int(config.get("dispatcher.snapshot-records") or 0) or None
    snapshot_bytes = config.get_bytes("dispatcher.snapshot-bytes") or None

    def replay() -> tuple[DispatcherState, int, JournalWriter]:
        contents = load_journal(work_dir)
        state, n = restore(contents.snapshot, contents.records)
        writer = JournalWriter.open(work_dir, compact=compact,
                                    snapshot_records=snapshot_records,
                                    snapshot_bytes=snapshot_bytes)
        plugin.lineage = lineage(work_dir, plugin.lineage)
        return state, n, writer

    loop = asyncio.get_running_loop()
    # file I/O and the replay stay off the scheduler's loop, in a thread owned here
    executor = owned_executor("dds-dispatcher-recovery")
    started = time.perf_counter()
    try:
        plugin.state, plugin.recovered_updates, plugin._journal = await loop.run_in_executor(
            executor, replay)
    finally:
        shutdown_executor(executor)
    plugin.recovery_seconds = time.perf_counter() - started
    if snapshot_records and plugin.recovered_updates >= snapshot_records // 2:
        plugin._journal.request_snapshot()
    # Rebuild what is not journaled. The workers of the previous run are pending (module
    # docstring); clients restart their liveness timers (``_recovered_at``).
    plugin._recovered_workers = {w.address for w in plugin.state.list_workers()}
    plugin._idle_iterations = {
        it.iteration_id for it in plugin.state.list_live_iterations()
        if not it.num_clients
        and it.last_client_released_micros is not None
    }
    _warn_changed_worker_lists(plugin)
    if plugin._journal_tail is not None:
        await plugin._journal_tail
    logger.info(
        "dataservice dispatcher recovered %d journaled updates from %s in %.2fs "
        "(%d datasets, %d jobs, %d workers pending)",
        plugin.recovered_updates, work_dir, plugin.recovery_seconds,
        len(plugin.state.list_datasets()), len(plugin.state.list_jobs()),
        len(plugin._recovered_workers),
    )


def revive(plugin: Any, address: str, resumed: bool, active_tasks: Iterable[int]) -> None:
    """The first heartbeat of a worker the journal knew (module docstring)."""
    plugin._recovered_workers.discard(address)
    state = plugin.state
    if not state.worker(address).registered:
        return
    held = sorted(t.task_id for t in state.tasks_for_worker(address) if t.status == "active")
    if resumed:
        logger.info("dataservice: data worker %s is back with its tasks %s (reported %s): "
                    "revived", address, held, sorted(active_tasks))
        _tasks_of_iterations_created_meanwhile(plugin, address)
        return
    logger.warning(
        "dataservice: data worker %s came back without its tasks (a new process); its tasks "
        "%s are lost (the splits they held are not handed out again)", address, held)
    plugin._apply(RemoveWorker(address=address))


def _tasks_of_iterations_created_meanwhile(plugin: Any, address: str) -> None:
    """A revived worker gets a task of each live iteration created while it was away.

    Such an iteration got no task of it: at the time the worker was known to the journal
    but not to the new scheduler (a reader that started during the outage waited forever for
    a data worker, tests/service/test_invisible_restart.py). An iteration that already has a task of
    this worker, in any status, gets none: a finished OFF task must not run its repetition
    again. O(tasks of the live iterations), once per revived worker.
    """
    state = plugin.state
    for iteration in state.list_live_iterations():
        job = state.job(iteration.job_id)
        if job.num_consumers is not None or not plugin._serves(iteration, job):
            continue  # coordinated reads keep the task list they started with
        if any(t.worker_address == address
               for t in state.tasks_for_iteration(iteration.iteration_id)):
            continue
        plugin._create_task(iteration.iteration_id, address, job, push=False)


def _warn_changed_worker_lists(plugin: Any) -> None:
    """Say so when the config's worker list differs from what live static jobs journaled.

    Those jobs keep their own list (a shard is never reassigned by a config change); only new
    jobs use the new one.
    """
    config_list = tuple(plugin.worker_addresses or ())
    for job in plugin.state.list_jobs():
        if job.worker_addresses and not job.garbage_collected and \
                job.worker_addresses != config_list:
            gone = sorted(set(job.worker_addresses) - set(config_list))
            logger.warning(
                "dataservice: job %s keeps the worker list it was created with, %s; the "
                "dispatcher is now configured with %s (new jobs use it)%s",
                job.job_id, list(job.worker_addresses), list(config_list),
                f"; no longer configured: {gone}" if gone else "")


def undelivered(state: DispatcherState, iteration_id: int, task_id: int, repetition: int,
                received: int) -> tuple[list[int], bool] | None:
    """The splits of ``repetition`` handed to ``task_id`` beyond the ``received`` first ones
    (a reply that never arrived), with whether the repetition ended after them; ``None`` when
    there are none. O(runs the task holds): asked only by retried requests.
    """
    held = state._splits_in_flight.get(task_id)
    if not held:
        return None
    positions = [i for rep, start, stop in held if rep == repetition
                 for i in range(start, stop)]
    if len(positions) <= received:
        return None
    tail = positions[received:]
    current = state.split_position(iteration_id)[0]
    if current == repetition:
        order = list(_split_order.taken(state, iteration_id))
        indices = [order[p] for p in tail] if order else tail
    else:
        job = state.job(state.iteration(iteration_id).job_id)
        if state.dataset(job.dataset_id).metadata.get("dask_locality"):
            # the explicit order of an ended repetition is forgotten: positions cannot be
            # mapped back to splits (they stay in flight, as before)
            return None
        indices = tail
    logger.info("dataservice: task %s never got %d splits of repetition %d handed to it (a "
                "reply lost with the previous dispatcher): handing them out again",
                task_id, len(tail), repetition)
    return indices, current > repetition


#: The file of a work dir that names the lineage of its journal's ids.
LINEAGE_FILE = "lineage"


def lineage(work_dir: str, fresh: str) -> str:
    """The lineage of the journal in ``work_dir``: read from its file, or ``fresh`` written
    there (atomically: write, fsync, rename; mode 0600) on the first start. Blocking I/O."""
    path = os.path.join(work_dir, LINEAGE_FILE)
    try:
        with open(path) as f:
            found = f.read().strip()
        if found:
            return found
    except FileNotFoundError:
        pass
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, fresh.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return fresh
