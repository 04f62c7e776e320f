"""The split provider of a DYNAMIC task: the splits the dispatcher hands out, asked ahead."""

from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING, Any

from ... import config
from ...data.splits import SplitProvider
from ._autocache import report
from .core import SplitFlow

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
        #: What to ask for and when (the worker core's split logic).
        self._flow = SplitFlow(config.get_int("worker.split-batch-max", minimum=1))
        self._pending: concurrent.futures.Future[Any] | None = None
        #: The task's first split came with it (issue 25): ask for the next ones once the
        #: source needs a second split, not before (the request's message would take the
        #: worker's loop, and the GIL, while this thread makes the first element).
        self._ask_later = self._flow.start(runner.task)
        self._cached: list[int] = []  # autocache: splits kept since the last report

    @property
    def repetition(self) -> int:
        return self._flow.repetition

    @property
    def num_splits(self) -> int:
        return len(self._splits)

    @property
    def drained(self) -> bool:
        """The dispatcher hands this task no split any more (its worker retires): every
        later repetition is empty, and an endless ``repeat()`` ends."""
        return self._flow.drained

    def cached(self, index: int) -> None:
        """The task's ``autocache()`` kept split ``index``: told to the dispatcher with the
        next request (or at the end), so later reads hand it to this worker first."""
        self._cached.append(index)

    def _report(self) -> None:
        if self._cached:
            runner = self._runner
            runner.plugin.post(report, runner.plugin, runner.task, self._cached)
            self._cached = []

    def _request(self) -> concurrent.futures.Future[Any]:
        runner = self._runner
        self._report()
        r = self._flow.request()
        return runner.plugin.submit(runner.plugin._get_splits, runner.task, r.repetition,
                                    r.count, r.received, r.first)

    def get_next(self) -> object | None:
        flow = self._flow
        if self._ask_later and not flow.has_local():  # the first split was taken
            self._ask_later = False
            self._pending = self._request()
        while not flow.has_local():
            if flow.ended:
                self._report()
                return None
            fut = self._pending if self._pending is not None else self._request()
            self._pending = None
            flow.waiting(fut.done())
            indices, ended, drained = self._runner.wait(fut)
            if flow.on_reply(indices, ended, drained):
                self._pending = self._request()
        self.last_index = index = flow.next_index()  # issue 13: input positions
        split: object = self._splits[index]
        return split

    def reset(self) -> None:
        ack = self._flow.reset()
        if ack is not None:
            runner = self._runner
            runner.plugin.post(runner.plugin._ack_splits, runner.task, ack)
