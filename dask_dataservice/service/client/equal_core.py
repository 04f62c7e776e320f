"""The consumer's half of an equal split, sans I/O (the dispatcher's half: ``_equal``).

``from_dataset_id(..., consumer_index=i, num_consumers=N, equal="drop" | "pad")``: the
reader counts what it received (:meth:`EqualGate.got`) and hands elements on to its
consumer only as far as the dispatcher allows (:meth:`EqualGate.may_move`), so each of the
``N`` consumers delivers the same number of elements in a pass. :class:`EqualGate` keeps
the counts and says what to send, when to wait and when the pass is over; the reader
(:mod:`._equal_reader`) keeps the coroutines and the RPCs. Work per batch, never per element.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["REPORT_INTERVAL", "EqualGate", "Report"]

#: Seconds a change of the counts that nobody waits for may wait before it is reported.
REPORT_INTERVAL = 0.01


@dataclass(frozen=True)
class Report:
    """What one ``dataservice_equal_sync`` request says: the consumer holds ``received``
    elements; ``ended``: its pass over the job is over; it needs ``need`` allowed."""

    received: int
    ended: bool
    need: int


class EqualGate:
    """One consumer's counts in an equal split.

    ``received`` counts what the consumer's reader received (held or handed on);
    ``moved`` what it handed on to the consumer. The dispatcher answers ``allowed`` (None:
    unbounded) and, once decided, ``final``: the pass delivers exactly ``final`` elements,
    dropping what is held beyond it (``drop``) or repeating delivered ones up to it (``pad``).
    """

    def __init__(self, remainder: str) -> None:
        self.remainder = remainder
        self.received = 0
        self.moved = 0
        self.allowed: int | None = 0
        self.final: int | None = None
        self.ended = False
        self._sent: tuple[int, bool] | None = None

    # Stimuli
    def got(self, n: int) -> None:
        """The reader received ``n`` more elements."""
        self.received += n

    def end(self) -> None:
        """The reader's pass over the job is over: ``received`` is final."""
        self.ended = True

    def on_reply(self, reply: dict[str, Any]) -> None:
        """An answer of the dispatcher (answers may arrive out of order: keep the most)."""
        allowed = reply.get("allowed")
        if allowed is None or self.allowed is None:
            self.allowed = None
        else:
            self.allowed = max(self.allowed, int(allowed))
        if reply.get("final") is not None and self.final is None:
            self.final = int(reply["final"])

    # Decisions
    def report(self) -> Report:
        """The counts to send now (and remember them as sent)."""
        self._sent = (self.received, self.ended)
        return Report(self.received, self.ended, self.moved + 1)

    @property
    def unreported(self) -> bool:
        """The counts changed since the last report (and the count is not decided yet)."""
        return self.final is None and self._sent != (self.received, self.ended)

    @property
    def urgent(self) -> bool:
        """The counts changed and the others may be waiting for them: this consumer may hold
        the least (what it last reported is not above what is allowed), or its pass ended.
        Other changes can wait a moment (``REPORT_INTERVAL``): fewer requests."""
        if not self.unreported:
            return False
        if self._sent is None or self.ended != self._sent[1]:
            return True
        return self.allowed is not None and self._sent[0] <= self.allowed

    def may_move(self) -> int | None:
        """How many more elements the consumer may be handed now (None: any number)."""
        limit = self.final if self.final is not None else self.allowed
        if limit is None:
            return None
        return max(0, limit - self.moved)

    def waiting(self, held: int) -> bool:
        """Whether the reader waits for the dispatcher's answer to go on: it holds ``held``
        elements it may not hand on yet, or its pass ended before the count was decided."""
        if self.final is not None:
            return False
        return (held > 0 and self.may_move() == 0) or self.ended

    def done(self, held: int) -> bool:
        """The pass delivered its count (``drop``: ``final`` handed on; ``pad``: every
        element received handed on, padding is :meth:`pad_count`)."""
        if self.final is None:
            return False
        if self.remainder == "drop":
            return self.moved >= self.final
        return held == 0 and self.ended

    def pad_count(self) -> int:
        """How many delivered elements to repeat at the end (``pad``)."""
        if self.final is None or self.remainder != "pad":
            return 0
        return max(0, self.final - self.moved)

    def moved_out(self, n: int) -> None:
        self.moved += n


def take(batch: list[Any], limit: int | None) -> tuple[list[Any], list[Any]]:
    """``batch`` cut at ``limit`` elements (None: whole): (handed on, kept)."""
    if limit is None or limit >= len(batch):
        return batch, []
    return batch[:limit], batch[limit:]
