"""Heartbeat deadlines of the data workers, on the dispatcher's side (pure; the rules are in
:mod:`._liveness`). Kept by :class:`~.core.DispatcherCore`; not journaled."""

from __future__ import annotations

import logging
from collections.abc import Iterable

logger = logging.getLogger("dask_dataservice.service.dispatcher.plugin")

__all__ = ["WorkerDeadlines"]


class WorkerDeadlines:
    """Heartbeat deadlines of the data workers (not journaled: after a restart every timer
    starts again); see :mod:`._liveness` for the rules."""

    def __init__(self, timeout: float, now: float) -> None:
        self.timeout = float(timeout)
        #: ``{address: time of its last heartbeat}``.
        self.seen_at: dict[str, float] = {}
        self.last_check = now
        #: Workers removed for silence (address → when), for the log when they come back.
        self.dropped: dict[str, float] = {}

    def seen(self, address: str, now: float) -> None:
        self.seen_at[address] = now
        since = self.dropped.pop(address, None)
        if since is not None:
            logger.warning(
                "dataservice: data worker %s answers again %.1fs after it was dropped for "
                "silence; the tasks of its previous life stay lost (it gets new ones)",
                address, now - since)

    def forget(self, address: str) -> None:
        self.seen_at.pop(address, None)
        self.dropped.pop(address, None)

    def silent(self, addresses: Iterable[str], now: float) -> list[tuple[str, float]]:
        """The workers of ``addresses`` silent for longer than the timeout, with how long."""
        last_check, self.last_check = self.last_check, now
        if now - last_check > self.timeout / 2:
            # The dispatcher's own loop did not run for a while (blocked, or the process was
            # stopped): the silence is ours, not the workers'. Start every timer again.
            self.seen_at = dict.fromkeys(self.seen_at, now)
            return []
        out = []
        for address in addresses:
            last = self.seen_at.setdefault(address, now)  # a timer starts at first sight
            if now - last > self.timeout:
                out.append((address, now - last))
        return out
