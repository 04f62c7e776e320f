"""Cleanup asserts for the data-worker plugin (see :mod:`dask_dataservice.testing`)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distributed import Worker


def _leftovers(worker: Worker) -> list[str]:
    """What the data-worker plugin of ``worker`` still holds (empty: back to idle)."""
    ext = worker.extensions.get("dataservice")
    if ext is None:  # not installed, or torn down
        return []
    out = []
    live = {tid: r for tid, r in ext.tasks.items() if r is not None and not r.buffer.end_visible}
    if live:
        out.append(f"unfinished tasks {sorted(live)}")
    buffered = {tid: len(r.buffer) for tid, r in ext.tasks.items() if r is not None and len(r.buffer)}
    if buffered:
        out.append(f"buffered elements {buffered}")
    threads = sorted(r.task_id for r in ext._runners if r.thread.is_alive())
    if threads:
        out.append(f"task threads alive {threads}")
    background = [t for t in ext._group.tasks if t.get_coro().__name__ != "_heartbeat_loop"]
    if background:
        out.append(f"background tasks {[t.get_coro().__qualname__ for t in background]}")
    if ext._rounds:
        out.append(f"coordinated-read buffers {sorted(ext._rounds)}")
    return out


async def assert_data_worker_cleanup(*workers: Worker, timeout: float = 10.0) -> None:
    """Every data worker is back to idle within ``timeout`` seconds.

    Idle: no task still producing or holding buffered elements, no task thread alive, no
    background coroutine but the heartbeat, no coordinated-read buffer, and no thread named
    ``dds-task-*`` left in this process (workers of ``gen_cluster`` are in-process).
    """
    deadline = time.monotonic() + timeout
    while True:
        problems = {w.address: p for w in workers if (p := _leftovers(w))}
        stray = sorted(t.name for t in threading.enumerate() if t.name.startswith("dds-task-"))
        if workers and stray and not problems:
            problems["process"] = [f"task threads {stray}"]
        if not problems:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"data workers not cleaned up after {timeout:g}s: {problems}")
        await asyncio.sleep(0.02)
