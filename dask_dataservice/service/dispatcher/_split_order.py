"""Explicit split order of a DYNAMIC iteration (locality-aware hand-out), for the state.

A DYNAMIC iteration normally hands out its splits in index order: ``ProduceSplits(index,
count)`` gives splits ``index .. index + count - 1`` and the cursor counts how many were
handed out. When the dispatcher hands out splits in another order (the locality hint of a
persisted Dask collection: each worker first gets the splits already in its memory, see
:mod:`._locality`), the record also carries ``indices``: the split indices handed out at the
cursor's *positions* ``index .. index + count - 1``. Everything else is unchanged and counts
positions: the cursor, the splits in flight and the lost splits (so their accounting, the
acknowledgements and the end of a repetition work as before). This module keeps, per
iteration, the split indices handed out so far in the current repetition (an insertion-ordered
set: position ``p`` handed out split ``order[p]``), which the dispatcher consults to pick the
next splits and which maps a position back to its split. It also keeps the order of the
iteration's last *ended* repetition (``ended_split_at``): a worker whose ``get_split`` reply
ended a repetition and was lost asks again for that repetition, and its splits are found from
their positions (before, they were forgotten with the order and so lost on a live worker; found
by the simulator's locality workload).

Rules (the state's): pure functions over :class:`~.state.DispatcherState`'s
``_split_orders``; no I/O, no Dask. ``check`` raises :class:`IllegalUpdateError` and changes
nothing; ``record`` never raises on a checked update. A repetition is either ordered (every
record carries ``indices``) or not (none does): mixing them is illegal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...errors import IllegalUpdateError

if TYPE_CHECKING:
    from ._updates import ProduceSplits
    from .state import DispatcherState

__all__ = ["check", "decode", "decode_ended", "encode", "encode_ended", "ended_split_at",
           "record", "split_at", "taken", "validate"]


def check(state: DispatcherState, u: ProduceSplits) -> None:
    """Preconditions of ``u.indices`` (after the cursor checks passed)."""
    order = state._split_orders.get(u.iteration_id)
    if not u.indices:
        if order and u.count:
            raise IllegalUpdateError(
                f"ProduceSplits: iteration {u.iteration_id} hands out splits in an explicit order "
                "this repetition; a record without indices cannot follow")
        return
    cursor = state._split_cursors[u.iteration_id]
    if len(u.indices) != u.count:
        raise IllegalUpdateError(
            f"ProduceSplits: {len(u.indices)} indices for count {u.count}")
    if len(order or ()) != u.index:
        raise IllegalUpdateError(
            f"ProduceSplits: explicit indices at position {u.index} of iteration "
            f"{u.iteration_id}, whose earlier positions were handed out in index order")
    seen: set[int] = set()
    for i in u.indices:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < cursor.num_splits:
            raise IllegalUpdateError(
                f"ProduceSplits: split index {i!r} out of range ({cursor.num_splits} splits)")
        if i in seen or (order is not None and i in order):
            raise IllegalUpdateError(
                f"ProduceSplits: split {i} of iteration {u.iteration_id} was already handed "
                f"out in repetition {u.repetition}")
        seen.add(i)


def record(state: DispatcherState, u: ProduceSplits) -> None:
    """Remember the splits ``u`` handed out; forget them when the repetition ends."""
    if u.indices:
        order = state._split_orders.setdefault(u.iteration_id, {})
        for i in u.indices:
            order[int(i)] = None
    if u.end_of_splits:
        ended = state._split_orders.pop(u.iteration_id, None)
        if ended:
            state._ended_split_orders[u.iteration_id] = (u.repetition, list(ended))
        else:  # a repetition in index order: positions are splits
            state._ended_split_orders.pop(u.iteration_id, None)


def taken(state: DispatcherState, iteration_id: int) -> dict[int, None]:
    """The split indices handed out in the current repetition (read only; empty if none or
    in index order)."""
    return state._split_orders.get(iteration_id) or {}


def split_at(state: DispatcherState, iteration_id: int, position: int) -> int:
    """The split handed out at ``position`` of the current repetition."""
    order = state._split_orders.get(iteration_id)
    if not order:
        return position
    return list(order)[position]


def ended_split_at(state: DispatcherState, iteration_id: int, repetition: int,
                   positions: list[int]) -> list[int] | None:
    """The splits handed out at ``positions`` of ``repetition``, the iteration's last ended
    one, in an explicit order; None when that order is not kept (an older repetition)."""
    ended = state._ended_split_orders.get(iteration_id)
    if ended is None or ended[0] != repetition:
        return None
    order = ended[1]
    if any(p >= len(order) for p in positions):
        return None
    return [order[p] for p in positions]


def validate(state: DispatcherState) -> None:
    """Invariants: an order belongs to a DYNAMIC iteration, is as long as its cursor's
    position and holds distinct splits in range."""
    for iteration_id, order in state._split_orders.items():
        cursor = state._split_cursors.get(iteration_id)
        if cursor is None:
            raise AssertionError(f"split order of iteration {iteration_id}, which has no cursor")
        if len(order) != cursor.next_index or not order:
            raise AssertionError(
                f"split order of iteration {iteration_id} has {len(order)} splits, its cursor is "
                f"at {cursor.next_index}")
        if not all(0 <= i < cursor.num_splits for i in order):
            raise AssertionError(f"split order of iteration {iteration_id} out of range")
    for iteration_id, (repetition, ended) in state._ended_split_orders.items():
        cursor = state._split_cursors.get(iteration_id)
        if cursor is None:
            raise AssertionError(
                f"ended split order of iteration {iteration_id}, which has no cursor")
        if repetition >= cursor.repetition or not ended or len(set(ended)) != len(ended) \
                or not all(0 <= i < cursor.num_splits for i in ended):
            raise AssertionError(
                f"ended split order of iteration {iteration_id} (repetition {repetition}) is "
                f"not a past repetition's distinct splits in range")


def encode(state: DispatcherState) -> list[list[Any]]:
    """``[[iteration_id, [split, ...]], ...]`` for a snapshot."""
    return [[i, list(order)] for i, order in state._split_orders.items()]


def decode(state: DispatcherState, rows: list[list[Any]]) -> None:
    """Restore :func:`encode`'s rows (a snapshot without them has none)."""
    for iteration_id, order in rows:
        state._split_orders[iteration_id] = dict.fromkeys(order)


def encode_ended(state: DispatcherState) -> list[list[Any]]:
    """``[[iteration_id, repetition, [split, ...]], ...]`` for a snapshot."""
    return [[i, rep, list(order)] for i, (rep, order) in state._ended_split_orders.items()]


def decode_ended(state: DispatcherState, rows: list[list[Any]]) -> None:
    """Restore :func:`encode_ended`'s rows (a snapshot without them has none)."""
    for iteration_id, repetition, order in rows:
        state._ended_split_orders[iteration_id] = (int(repetition), [int(i) for i in order])
