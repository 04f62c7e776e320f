"""How many splits a DYNAMIC task may take at once (the dispatcher core's ``get_split``)."""

from __future__ import annotations

__all__ = ["REPEAT_SHARE_FLOOR", "fair_share"]

#: Past the first repetition a task may take this many of the splits left: see fair_share.
REPEAT_SHARE_FLOOR = 64


def fair_share(left: int, active: int, repetition: int = 0) -> int:
    """How many of the ``left`` splits a task may take at once: all of them if it is the only
    active task, else at most half of a fair share (``left / (2 x active)``, at least one):
    big batches for fine splits, and the last splits still spread over the workers. From
    ``repetition`` 1 on (the pipeline repeats its source) at least :data:`REPEAT_SHARE_FLOOR`
    (as in 13df877): the next repetition's splits follow, and ``range(10).repeat()`` cost a
    round trip per one-element split (issue 22)."""
    active = max(1, active)
    if active == 1:
        return left
    share = max(1, left // (2 * active))
    if repetition >= 1:
        share = max(share, min(left, REPEAT_SHARE_FLOOR))
    return share
