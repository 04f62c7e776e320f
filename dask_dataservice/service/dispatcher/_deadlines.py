"""Heartbeat deadlines of the data workers and the consumers, on the dispatcher's side
(pure; the rules are in :mod:`._liveness`). Kept by :class:`~.core.DispatcherCore`; not
journaled.

A GC tick (every ``dispatcher.gc-interval``, 500 ms) costs O(1 + silent ones), not a scan of
every worker and consumer: :class:`LastSeen` keeps them in the order they were last seen, so
the tick walks from the oldest and stops at the first that is not silent (at 100,000
consumers the scan cost 30-60 ms of the scheduler's loop per tick, doing nothing).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TypeVar

logger = logging.getLogger("dask_dataservice.service.dispatcher.plugin")

__all__ = ["LastSeen", "WorkerDeadlines"]

K = TypeVar("K")


class LastSeen(OrderedDict[K, float]):
    """``{key: when it was last seen}``, oldest first.

    :meth:`seen` moves a key to the end (O(1)); :meth:`silent` walks from the oldest and
    stops at the first key seen within the timeout, so it costs O(1 + silent keys). (An
    ordered dict, not a dict with each key popped and inserted again: a dict's iteration
    skips the slots of the keys moved, and so slowed with the heartbeats since its last
    resize: 16 µs a tick at 100,000 consumers instead of 5.) Times come from the
    dispatcher's clock, which only moves forward in practice; if it stepped back, a key
    behind a younger one is found silent late, never early.
    """

    def seen(self, key: K, when: float) -> None:
        self[key] = when
        self.move_to_end(key)

    def silent(self, now: float, timeout: float) -> list[tuple[K, float]]:
        """``(key, last seen)`` of the keys silent for longer than ``timeout`` at ``now``,
        oldest first (they stay: the caller forgets what it acts on)."""
        out = []
        for key, when in self.items():
            if now - when <= timeout:
                break
            out.append((key, when))
        return out


class WorkerDeadlines:
    """Heartbeat deadlines of the data workers (not journaled: after a restart every timer
    starts again); see :mod:`._liveness` for the rules."""

    def __init__(self, timeout: float, now: float) -> None:
        self.timeout = float(timeout)
        #: ``{address: time of its last heartbeat}``, oldest first.
        self.seen_at: LastSeen[str] = LastSeen()
        #: Registered workers not heard from yet: their timer starts at the next check.
        self._unstamped: dict[str, None] = {}
        self.last_check = now
        #: Workers removed for silence (address → when), for the log when they come back.
        self.dropped: dict[str, float] = {}

    def watch(self, address: str) -> None:
        """A registered worker: its timer starts at the next check, unless it heartbeats."""
        if address not in self.seen_at:
            self._unstamped[address] = None

    def seen(self, address: str, now: float) -> None:
        self._unstamped.pop(address, None)
        self.seen_at.seen(address, now)
        since = self.dropped.pop(address, None)
        if since is not None:
            logger.warning(
                "dataservice: data worker %s answers again %.1fs after it was dropped for "
                "silence; the tasks of its previous life stay lost (it gets new ones)",
                address, now - since)

    def forget(self, address: str) -> None:
        self.seen_at.pop(address, None)
        self._unstamped.pop(address, None)
        self.dropped.pop(address, None)

    def silent(self, now: float) -> list[tuple[str, float]]:
        """The workers silent for longer than the timeout, with how long; they are
        forgotten here (the caller drops them). O(1 + silent workers)."""
        for address in self._unstamped:  # a timer starts at first sight
            self.seen_at[address] = now
        self._unstamped.clear()
        last_check, self.last_check = self.last_check, now
        if now - last_check > self.timeout / 2:
            # The dispatcher's own loop did not run for a while (blocked, or the process was
            # stopped): the silence is ours, not the workers'. Start every timer again.
            self.seen_at = LastSeen((address, now) for address in self.seen_at)
            return []
        out = [(address, now - last) for address, last in self.seen_at.silent(now, self.timeout)]
        for address, _ in out:
            del self.seen_at[address]
        return out
