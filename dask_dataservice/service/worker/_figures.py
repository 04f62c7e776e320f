"""What a data worker keeps for the dashboard beyond its counters: request latency, and the
per-op figures of the tasks that ended (the dashboard's next poll takes them)."""

from __future__ import annotations

import collections
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

__all__ = ["WorkerFigures"]

T = TypeVar("T")

#: Ended tasks whose per-op figures are kept.
FINISHED_TASKS = 64


class WorkerFigures:
    def __init__(self) -> None:
        #: Seconds each of the latest element requests took to answer (long polls included).
        self.request_seconds: collections.deque[float] = collections.deque(maxlen=1024)
        #: ``{task_id: (job_id, iteration_id, per-op rows)}`` of the latest tasks that ended.
        self.finished_ops: collections.OrderedDict[
            int, tuple[int, int, list[dict[str, Any]]]] = collections.OrderedDict()

    async def timed(self, request: Awaitable[T]) -> T:
        """``await request``, timed (per request, not per element)."""
        t0 = time.perf_counter()
        try:
            return await request
        finally:
            self.request_seconds.append(time.perf_counter() - t0)

    def task_ended(self, runner: Any) -> None:
        """Keep the final per-op figures of a task whose pipeline ended."""
        self.finished_ops[runner.task_id] = (runner.task["job_id"], runner.task["iteration_id"],
                                             runner.pipeline_stats.rows())
        while len(self.finished_ops) > FINISHED_TASKS:
            self.finished_ops.popitem(last=False)
