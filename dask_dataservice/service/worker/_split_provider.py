"""The split provider of a DYNAMIC task: the splits the dispatcher hands out, asked ahead."""

from __future__ import annotations

import concurrent.futures
from collections import deque
from typing import TYPE_CHECKING, Any

from ... import config
from ...data.splits import SplitProvider

if TYPE_CHECKING:
    from .plugin import TaskRunner

__all__ = ["DispatcherSplitProvider"]


class DispatcherSplitProvider(SplitProvider):
    """Serves a DYNAMIC task's source the splits the dispatcher hands out.

    Runs in the task's thread. It asks ahead: as soon as a batch of split indices arrives it
    requests the next batch, so the round trip hides behind reading. The batch size adapts:
    it doubles (up to ``dataservice.worker.split-batch-max``) whenever the source had to wait
    for a reply, so tiny splits cost few round trips, while slow pipelines keep asking for one
    split at a time. A split handed out but not yet finished counts as *in flight* at the
    dispatcher and is lost (never re-issued) if this worker dies: at-most-once visitation. So
    a worker that dies loses at most about two batches of splits, and batches grow only for
    pipelines that read a split faster than a round trip to the dispatcher.

    A request costs a data worker about 0.8 ms of CPU (a distributed comm message each way):
    with 100,000 splits of 10 elements, batches of at most 64 spent 15 us per split, 1,024
    spend 3 us (issue 16: ``benchmarks/fine_splits.py``).
    """

    def __init__(self, runner: TaskRunner, splits: list[Any]) -> None:
        self._runner = runner
        self._splits = splits
        self.repetition = 0
        #: Splits received of this repetition (a retried request says it: see _get_splits).
        self._received = 0
        self._pending: concurrent.futures.Future[Any] | None = None
        self._local: deque[Any] = deque()
        self._ended = False
        self._batch = 1
        self._max_batch = config.get_int("worker.split-batch-max", minimum=1)

    @property
    def num_splits(self) -> int:
        return len(self._splits)

    def _request(self) -> concurrent.futures.Future[Any]:
        runner = self._runner
        return runner.plugin.submit(runner.plugin._get_splits, runner.task, self.repetition,
                                    self._batch, self._received)

    def _wait(self, fut: concurrent.futures.Future[Any]) -> Any:
        if not fut.done() and self._batch < self._max_batch:
            self._batch *= 2  # we are waiting on the dispatcher: ask for more at once
        return self._runner.wait(fut)

    def get_next(self) -> object | None:
        while not self._local:
            if self._ended:
                return None
            fut = self._pending if self._pending is not None else self._request()
            self._pending = None
            indices, ended = self._wait(fut)
            self._local.extend(indices)
            self._received += len(indices)
            self._ended = ended
            if not ended:
                self._pending = self._request()
        self.last_index = index = self._local.popleft()  # issue 13: input positions
        split: object = self._splits[index]
        return split

    def reset(self) -> None:
        self.repetition += 1
        self._received = 0
        self._ended = False
        if self.repetition >= 2:
            # Splits two repetitions back have left the pipeline (short of a shuffle buffer
            # holding more than a whole repetition): stop counting them as in flight, so an
            # endless repeat() does not grow the dispatcher's in-flight set forever.
            runner = self._runner
            runner.plugin.submit(runner.plugin._ack_splits, runner.task, self.repetition - 2)
