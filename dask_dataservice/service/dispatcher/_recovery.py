"""A fault-tolerant dispatcher's start: replay the journal, then revive the workers that come
back with their tasks (issue 11 s1).

Replay (:func:`recover`) is the newest snapshot plus the records after it; a record that
decodes but is illegal for the state replayed so far is
:class:`~._exceptions.JournalCorruptedError` naming its file and byte offset.

What the journal cannot know is whether the data workers of the previous run are still
there. Supervised data workers are (:mod:`._reconnect`): they keep their tasks, buffers and
split cursors while the scheduler is down, and register again once it is back. So the
replayed workers are not removed at once any more. Each one is *pending*:

- its first heartbeat says ``resumed`` (it kept its tasks): it is revived with them
  (``DispatcherCore._revive``). Its tasks stay active, their splits in flight stay theirs, and readers go
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

The decisions (which workers are pending, reviving one, the missing tail of a split request,
the joining worker's hand-out) are the core's (:mod:`.core`, ``restore``,
``_revive``, ``undelivered``); this module is the start's I/O: reading the journal (and its
manifest, which keeps the work_dir's lineage: :mod:`._journal_lineage`) off the scheduler's
loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING

from ... import config
from ..._async import owned_executor, shutdown_executor
from .state import DispatcherState

if TYPE_CHECKING:
    from .journal import JournalWriter
    from .plugin import DispatcherPlugin

logger = logging.getLogger("dask_dataservice.service.dispatcher.plugin")

__all__ = ["recover"]


async def recover(plugin: DispatcherPlugin) -> None:
    """Replay the journal of ``plugin`` before any handler is served, then open a new
    segment; the core takes the replayed state (:meth:`~.core.DispatcherCore.restore`).

    The writer folds old segments into snapshots as it goes (``dispatcher.snapshot-records``
    / ``snapshot-bytes``); a long replayed tail is folded at once, in the background, so the
    next restart does not replay it again.
    """
    from ._state_codec import compact, next_ids, restore
    from .journal import JournalWriter, load_journal

    assert plugin.work_dir is not None and plugin.core is not None
    core = plugin.core
    work_dir = os.fspath(plugin.work_dir)
    snapshot_records = int(config.get("dispatcher.snapshot-records") or 0) or None
    snapshot_bytes = config.get_bytes("dispatcher.snapshot-bytes") or None

    def replay() -> tuple[DispatcherState, int, JournalWriter, str]:
        contents = load_journal(work_dir)
        state, n = restore(*contents)
        # The manifest keeps the work_dir's lineage and the ids in use (``state`` is the
        # object the core goes on changing).
        writer = JournalWriter.open(work_dir, compact=compact,
                                    snapshot_records=snapshot_records,
                                    snapshot_bytes=snapshot_bytes, lineage=core.lineage,
                                    counters=lambda: next_ids(state))
        assert writer.lineage is not None
        return state, n, writer, writer.lineage

    loop = asyncio.get_running_loop()
    # file I/O and the replay stay off the scheduler's loop, in a thread owned here
    executor = owned_executor("dds-dispatcher-recovery")
    started = time.perf_counter()
    try:
        state, plugin.recovered_updates, journal, core.lineage = await loop.run_in_executor(
            executor, replay)
    finally:
        shutdown_executor(executor)
    plugin._journal = journal
    plugin.recovery_seconds = time.perf_counter() - started
    if snapshot_records and plugin.recovered_updates >= snapshot_records // 2:
        journal.request_snapshot()
    # Rebuild what is not journaled. The workers of the previous run are pending (module
    # docstring); clients restart their liveness timers (``recovered_at``).
    core.restore(state)
    logger.info(
        "dataservice dispatcher recovered %d journaled updates from %s in %.2fs "
        "(%d datasets, %d jobs, %d workers pending)",
        plugin.recovered_updates, work_dir, plugin.recovery_seconds,
        len(state.list_datasets()), len(state.list_jobs()),
        len(core.recovered_workers),
    )
