"""Numpy kernels of parameter-server training, shared by servers and local variables.

Everything here is pure numpy on arrays the caller owns: no I/O, no asyncio, no locks. The
parameter server runs these on a shard's serial lane (see ``server.Shard``), local variables
(outside ``strategy.scope()``) run them in the caller's thread.

- :func:`update_dense`: ``assign`` / ``assign_add`` / ``assign_sub`` of a whole value, in
  place or into a fresh array (copy on write, in the same pass as the update).
- :func:`scatter_rows`: row updates (``add``, ``sub``, ``update``, ``mul``, ``div``, ``max``,
  ``min``), with a fast path for the sorted distinct ids clients send.
- :func:`new_slots`, :func:`apply_dense`, :func:`apply_sparse`: the server-side optimizers'
  update rules (Keras': SGD with momentum/Nesterov, Adagrad, Adam, RMSprop).
- :func:`take_rows` / :func:`put_rows` / :func:`dedupe_rows`: row movement.
- :func:`initial_value`: calls a user initializer for one partition, choosing the calling
  convention from its signature (never by catching the user's own ``TypeError``).

This module is a leaf of the package (it imports only numpy and ``_types``).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import ShapeMismatchError
from ._types import SCATTER_KINDS, UPDATE_KINDS, ShardInfo

__all__ = ["apply_dense", "apply_sparse", "cast_value", "check_hyperparameter", "check_optimizer",
           "dedupe_rows", "initial_value", "new_slots", "put_rows", "scatter_rows", "take_rows",
           "update_dense"]


def cast_value(value: Any, dtype: Any, what: str) -> np.ndarray:
    """``value`` as an array of ``dtype``, refusing casts that would change it silently.

    TensorFlow raises on a dtype mismatch; numpy casts ``0.7`` to int 0, ``1e30`` to the
    smallest int64 and ``1e39`` to a float32 ``inf``. Here a cast is done when it keeps the
    value: the same kind or a wider one (an int into a float, a float64 into a float32, as
    gradients are), floats that are whole numbers into ints, ints that fit into narrower
    ints. Anything else raises ``TypeError`` (a fraction, a complex into a real, a non-bool
    into a bool) or ``ValueError`` (out of range: for an int dtype, outside its range; for a
    float or complex dtype, a finite value that the cast makes ``inf``, as TensorFlow's
    conversion of a Python float refuses), naming ``what`` (e.g. ``"assign_add to variable
    'v'"``) and both dtypes. ``inf`` and ``nan`` stay what they are (TensorFlow keeps them
    too). Non-numeric dtypes (strings, objects) are left to numpy.
    """
    dtype = np.dtype(dtype) if dtype is not None else None
    arr = np.asarray(value)
    if dtype is None or arr.dtype == dtype:
        return arr
    src = arr.dtype
    if src.kind not in "biufc" or dtype.kind not in "biufc":
        return np.asarray(value, dtype=dtype)
    if np.can_cast(src, dtype, "same_kind") and not (src.kind in "iu" and dtype.kind in "iu"):
        # the same kind or a wider one (f8 -> f4, i8 -> f4, ...); a narrowing one may
        # overflow to inf, which the cast itself reports (no extra pass over the values)
        if dtype.kind in "iu" or np.can_cast(src, dtype, "safe"):
            return arr.astype(dtype)
        try:
            with np.errstate(over="raise"):
                return arr.astype(dtype)
        except FloatingPointError:
            return _overflowed(arr, dtype, what)
    prefix = f"{what}: a value of dtype {src} cannot become {dtype} without changing it"
    if dtype.kind == "b" or src.kind == "c":
        raise TypeError(f"{prefix} (TensorFlow refuses dtype mismatches too)")
    # into an int: whole numbers in range only
    if src.kind == "f" and arr.size:
        whole = np.isfinite(arr) & (arr == np.trunc(np.nan_to_num(arr)))
        if not bool(whole.all()):
            bad = arr[~whole].flat[0].item()
            raise TypeError(f"{prefix}: {bad!r} is not a whole number (TensorFlow refuses "
                            "dtype mismatches too); round or cast it first")
    if arr.size and not np.can_cast(src, dtype, "safe"):
        info = np.iinfo(dtype)
        lo, hi = arr.min(), arr.max()
        if src.kind == "f":  # float bounds are exact powers of two
            out_lo, out_hi = lo < float(info.min), hi >= float(info.max) + 1.0
        else:
            out_lo, out_hi = int(lo) < info.min, int(hi) > info.max
        if out_lo or out_hi:
            raise ValueError(f"{prefix}: {(lo if out_lo else hi).item()!r} is out of range "
                             f"[{info.min}, {info.max}]")
    return arr.astype(dtype)


def _overflowed(arr: np.ndarray, dtype: np.dtype[Any], what: str) -> np.ndarray:
    """``arr`` cast to ``dtype`` after the cast reported an overflow (only then are the
    values looked at): a ValueError if a finite value became ``inf``."""
    with np.errstate(over="ignore"):
        out = arr.astype(dtype)
    bad = ~np.isfinite(out) & np.isfinite(arr)
    if not bool(bad.any()):
        return out
    value = arr[bad].flat[0].item()
    fmax = float(np.finfo(dtype).max)
    raise ValueError(
        f"{what}: a value of dtype {arr.dtype} cannot become {dtype} without changing it: "
        f"{value!r} is out of its finite range [{-fmax!r}, {fmax!r}] (the cast would make it "
        "inf; TensorFlow refuses such a conversion too)")


def check_hyperparameter(name: str, value: Any) -> float:
    """``value`` as a float if it is a finite, non-negative number; else a ValueError (a
    ``nan`` or ``inf`` learning rate would turn every variable it updates into ``nan``)."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer) \
            or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite, non-negative number, got {value!r}")
    return float(value)


def check_optimizer(config: dict[str, Any]) -> None:
    """ValueError unless ``config`` (an optimizer's ``get_config()``, as a parameter server
    receives it from any client) has a known kind and hyperparameters in range."""
    kind = config.get("kind")
    if kind not in _OPTIMIZER_KINDS:
        raise ValueError(f"unknown optimizer kind {kind!r}; expected one of {_OPTIMIZER_KINDS}")
    who = f"optimizer {config.get('name', kind)!r}"
    check_hyperparameter(f"{who}: learning_rate", config.get("learning_rate"))
    for name in ("epsilon", "initial_accumulator_value"):
        if name in config:
            check_hyperparameter(f"{who}: {name}", config[name])
    for name, closed in (("momentum", True), ("beta_1", False), ("beta_2", False),
                         ("rho", True)):
        value = config.get(name)
        if value is None:
            continue
        if not isinstance(value, int | float) or not (
                0.0 <= value <= 1.0 if closed else 0.0 <= value < 1.0):
            raise ValueError(f"{who}: {name} must be in [0, 1{']' if closed else ')'}, "
                             f"got {value!r}")


#: The optimizer kinds :func:`new_slots` and :func:`apply_dense` know.
_OPTIMIZER_KINDS = ("sgd", "adagrad", "adam", "rmsprop")


def new_slots(config: dict[str, Any], value: np.ndarray) -> dict[str, np.ndarray]:
    """Fresh slot arrays for a shard ``value``."""
    kind = config["kind"]
    if kind == "sgd":
        return {"momentum": np.zeros_like(value)} if config.get("momentum") else {}
    if kind == "adagrad":
        return {"accumulator": np.full_like(value, config["initial_accumulator_value"])}
    if kind == "adam":
        return {"m": np.zeros_like(value), "v": np.zeros_like(value),
                "iterations": np.zeros((), dtype="int64")}
    if kind == "rmsprop":
        slots = {"velocity": np.zeros_like(value)}
        if config.get("momentum"):
            slots["momentum"] = np.zeros_like(value)
        if config.get("centered"):
            slots["average_gradient"] = np.zeros_like(value)
        return slots
    raise ValueError(f"unknown optimizer kind {kind!r}")


def dedupe_rows(ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sum the rows of duplicate ids: ``(sorted unique ids, summed rows)``.

    Ids that are already strictly increasing come back as they are (no copy).
    """
    ids = np.asarray(ids).reshape(-1)
    if ids.size < 2 or np.all(ids[1:] > ids[:-1]):
        return ids, rows
    order = np.argsort(ids, kind="stable")
    sids = ids[order]
    first = np.empty(sids.size, dtype=bool)
    first[0] = True
    np.not_equal(sids[1:], sids[:-1], out=first[1:])
    if first.all():
        return sids, np.take(rows, order, axis=0)
    out = np.take(rows, order[first], axis=0)
    repeat = ~first
    # the few repeated rows are added to their id's first row (np.add.at over all rows or
    # np.add.reduceat is much slower when repeats are rare)
    np.add.at(out, np.cumsum(first)[repeat] - 1, np.take(rows, order[repeat], axis=0))
    return sids[first], out


def _row_view(arr: np.ndarray) -> np.ndarray | None:
    """``arr`` (C-contiguous, 2+ dims) as a 1-D array of opaque rows, or None."""
    if arr.ndim < 2 or not arr.flags.c_contiguous or arr.size == 0:
        return None
    return arr.reshape(arr.shape[0], -1).view(
        np.dtype((np.void, arr.itemsize * (arr.size // arr.shape[0])))).reshape(-1)


def take_rows(value: np.ndarray, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``value[ids]`` (a new C-contiguous array, or written into ``out``), for valid ids.

    Rows move as opaque ``void`` items: for 256-byte rows that is ~1.7x as fast as fancy
    indexing (and ``np.take`` on the numeric array is in between).
    """
    rows = _row_view(value)
    items = None if out is None or rows is None else _row_view(out)
    if rows is None or (out is not None and items is None):
        return np.take(value, ids, axis=0, out=out)
    if items is not None:
        np.take(rows, ids, out=items)
        assert out is not None  # items is set only with out
        return out
    return np.take(rows, ids).view(value.dtype).reshape((ids.size, *value.shape[1:]))


def put_rows(value: np.ndarray, ids: np.ndarray, new: np.ndarray) -> None:
    """``value[ids] = new`` for valid ids (for a repeated id the last row wins)."""
    rows = _row_view(value)
    items: np.ndarray | None = None
    if rows is not None and new.dtype == value.dtype and new.shape == (ids.size, *value.shape[1:]):
        items = _row_view(np.ascontiguousarray(new))
    if items is None:
        value[ids] = new
    else:
        assert rows is not None  # items is set only with rows
        np.put(rows, ids, items)


def apply_dense(config: dict[str, Any], value: np.ndarray, slots: dict[str, Any], grad: np.ndarray) -> None:
    """Apply one dense update to ``value`` (all rows) in place."""
    _apply(config, value, slots, grad, None)


def apply_sparse(config: dict[str, Any], value: np.ndarray, slots: dict[str, Any], ids: np.ndarray,
                 grad_rows: np.ndarray) -> None:
    """Apply one sparse update to rows ``ids`` of ``value`` in place (duplicates summed)."""
    ids, grad_rows = dedupe_rows(ids, grad_rows)
    _apply(config, value, slots, grad_rows, ids)


def _apply(config: dict[str, Any], value: np.ndarray, slots: dict[str, Any], g: np.ndarray,
           ids: np.ndarray | None) -> None:
    """One update of ``value`` (rows ``ids``, distinct; or all rows when None) in place.

    Sparse updates read the rows they touch with :func:`take_rows`, compute on those
    copies in place, and write them back with :func:`put_rows`.
    """
    kind = config["kind"]
    dt = value.dtype
    g = np.asarray(g, dtype=dt)
    lr = dt.type(config["learning_rate"])

    def get(arr: np.ndarray) -> np.ndarray:
        return arr if ids is None else take_rows(arr, ids)

    def put(arr: np.ndarray, new: np.ndarray) -> None:
        if ids is None:
            if new is not arr:
                arr[...] = new
        else:
            put_rows(arr, ids, new)

    if kind == "sgd":
        mom = dt.type(config.get("momentum") or 0.0)
        if not mom:
            if ids is None:
                value -= lr * g
            else:
                rows = take_rows(value, ids)
                rows -= lr * g
                put_rows(value, ids, rows)
            return
        vel = get(slots["momentum"])
        vel *= mom  # in place: a copy when sparse, the slot itself when dense
        vel -= lr * g
        put(slots["momentum"], vel)
        step = mom * vel - lr * g if config.get("nesterov") else vel
        rows = get(value)
        rows += step
        put(value, rows)
    elif kind == "adagrad":
        acc = get(slots["accumulator"])
        acc += g * g
        put(slots["accumulator"], acc)
        upd = np.sqrt(acc, out=np.empty_like(acc))  # an array even when 0-d
        upd += dt.type(config["epsilon"])
        np.divide(lr * g, upd, out=upd)
        rows = get(value)
        rows -= upd
        put(value, rows)
    elif kind == "adam":
        it = slots["iterations"]
        it[...] = it + 1
        t = float(it)
        b1, b2 = config["beta_1"], config["beta_2"]
        alpha = dt.type(config["learning_rate"] * math.sqrt(1 - b2 ** t) / (1 - b1 ** t))
        m = get(slots["m"])
        m *= dt.type(b1)
        m += g * dt.type(1 - b1)
        v = get(slots["v"])
        v *= dt.type(b2)
        v += (g * g) * dt.type(1 - b2)
        put(slots["m"], m)
        put(slots["v"], v)
        upd = np.sqrt(v, out=np.empty_like(v))
        upd += dt.type(config["epsilon"])
        np.divide(alpha * m, upd, out=upd)
        rows = get(value)
        rows -= upd
        put(value, rows)
    elif kind == "rmsprop":
        _rmsprop(config, dt, g, lr, slots, get, put, value)
    else:
        raise ValueError(f"unknown optimizer kind {kind!r}")


def _rmsprop(config: dict[str, Any], dt: np.dtype[Any], g: np.ndarray, lr: Any,
             slots: dict[str, Any], get: Callable[[np.ndarray], np.ndarray],
             put: Callable[[np.ndarray, np.ndarray], None], value: np.ndarray) -> None:
    """Keras' RMSprop: ``epsilon`` is added under the square root (unlike Adagrad here)."""
    rho = dt.type(config["rho"])
    vel = get(slots["velocity"])
    vel *= rho
    vel += (g * g) * (dt.type(1) - rho)
    put(slots["velocity"], vel)
    denominator = vel.copy()
    if config.get("centered"):
        avg = get(slots["average_gradient"])
        avg *= rho
        avg += g * (dt.type(1) - rho)
        put(slots["average_gradient"], avg)
        denominator -= avg * avg
    denominator += dt.type(config["epsilon"])
    increment = np.sqrt(denominator, out=denominator)
    np.divide(lr * g, increment, out=increment)
    rows = get(value)
    if config.get("momentum"):
        mom = get(slots["momentum"])
        mom *= dt.type(config["momentum"])
        mom += increment
        put(slots["momentum"], mom)
        rows -= mom
    else:
        rows -= increment
    put(value, rows)


# ---------------------------------------------------------------------------------------
# whole-value and row updates
# ---------------------------------------------------------------------------------------

#: ``kind -> ufunc`` of the whole-value updates (``assign`` has none: it copies).
_DENSE_UFUNCS = {"assign": None, "assign_add": np.add, "assign_sub": np.subtract}
assert tuple(_DENSE_UFUNCS) == UPDATE_KINDS

#: ``kind -> ufunc`` of the row updates (``update`` has none: the last row wins).
_SCATTER_UFUNCS = {"add": np.add, "sub": np.subtract, "update": None, "mul": np.multiply,
                   "div": np.divide, "max": np.maximum, "min": np.minimum}
assert tuple(_SCATTER_UFUNCS) == SCATTER_KINDS


def update_dense(value: np.ndarray, kind: str, delta: Any, *, copy: bool = False) -> np.ndarray:
    """``assign`` / ``assign_add`` / ``assign_sub`` ``delta`` (broadcast) to ``value``.

    In place unless ``copy``: then ``value`` is left alone and a fresh C-contiguous array is
    returned (the copy costs no extra pass: it is the update's output). Returns the new value.
    """
    if kind not in _DENSE_UFUNCS:
        raise ValueError(f"unknown update kind {kind!r}; expected one of {UPDATE_KINDS}")
    ufunc = _DENSE_UFUNCS[kind]
    if copy:
        if ufunc is None:
            return np.array(np.broadcast_to(delta, value.shape), dtype=value.dtype, order="C")
        # out= keeps a 0-d result an array (a bare ufunc call would return a scalar)
        return ufunc(value, delta, out=np.empty_like(value, order="C"))  # type: ignore[no-any-return]
    if ufunc is None:
        value[...] = delta
    else:
        ufunc(value, delta, out=value)
    return value


def _divide(ufunc: np.ufunc, dtype: np.dtype[Any]) -> np.ufunc:
    return np.floor_divide if ufunc is np.divide and dtype.kind in "iu" else ufunc


def scatter_rows(value: np.ndarray, kind: str, ids: np.ndarray, rows: np.ndarray) -> None:
    """Row update ``kind`` of rows ``ids`` of ``value`` with ``rows``, in place.

    Duplicate ids accumulate (``add``/``sub``/``mul``/``div``/``max``/``min``); for ``update``
    the last one wins. Integer variables divide with floor division.
    """
    if kind not in _SCATTER_UFUNCS:
        raise ValueError(f"unknown scatter kind {kind!r}; expected one of {SCATTER_KINDS}")
    ufunc: np.ufunc | None = _SCATTER_UFUNCS[kind]
    if ufunc is None:
        put_rows(value, ids, rows)
        return
    ufunc = _divide(ufunc, value.dtype)
    if ids.size < 2 or bool(np.all(ids[1:] > ids[:-1])):  # clients send sorted distinct ids
        cur = take_rows(value, ids)
        ufunc(cur, rows, out=cur, casting="unsafe")
        put_rows(value, ids, cur)
    else:
        ufunc.at(value, ids, rows)


# ---------------------------------------------------------------------------------------
# initializers
# ---------------------------------------------------------------------------------------


def _accepts(fn: Callable[..., Any]) -> tuple[set[str], bool]:
    """``(keyword parameter names, takes **kwargs)`` of ``fn``; ``(set(), False)`` if unknown."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature
        return set(), False
    names = {p.name for p in params
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


def initial_value(fn: Callable[..., Any], shape: tuple[Any, ...], dtype: Any, offset: int = 0,
                  full_shape: tuple[Any, ...] | None = None) -> tuple[np.ndarray, bool]:
    """Call initializer ``fn`` for the partition ``shape`` at row ``offset``: ``(value, sliced)``.

    The convention is chosen from ``fn``'s signature, so a ``TypeError`` raised inside ``fn``
    reaches the caller as itself:

    - ``shard_info``: TensorFlow's ``fn(shard_info=ShardInfo(shape, offset))`` (plus
      ``shape=full_shape``/``dtype`` when it takes them);
    - ``partition_shape`` (or ``**kwargs``): Keras initializers,
      ``fn(shape=full_shape, dtype=, partition_shape=, partition_offset=)``;
    - ``partition_offset``: this package's ``fn(shape=partition shape, dtype=, partition_offset=)``;
    - ``shape``/``dtype``: ``fn(shape=full_shape, dtype=)``; nothing: ``fn()``.

    A value of the partition's shape is used as it is; a value of the full shape is sliced
    (``sliced=True``: the caller may warn that this is memory-inefficient).
    """
    shape = tuple(shape)
    full_shape = shape if full_shape is None else tuple(full_shape)
    dtype = np.dtype(dtype) if dtype is not None else None
    part_offset = (int(offset),) + (0,) * max(0, len(shape) - 1)
    names, var_kw = _accepts(fn)
    base = {k: v for k, v in (("shape", full_shape), ("dtype", dtype))
            if k in names or var_kw}
    if "shard_info" in names:
        value = fn(shard_info=ShardInfo(shape, part_offset), **base)
    elif "partition_shape" in names or (var_kw and "partition_offset" not in names):
        value = fn(**base, partition_shape=shape, partition_offset=part_offset)
    elif "partition_offset" in names:
        value = fn(**{**base, "shape": shape}, partition_offset=part_offset)
    else:
        value = fn(**base)
    value = cast_value(value, dtype, "the initializer's value")
    if value.shape == shape:
        return value, False
    if value.shape != full_shape or not shape:
        raise ShapeMismatchError(
            f"initializer returned shape {value.shape}; expected the partition {shape} at "
            f"row {offset} or the whole variable {full_shape}")
    return value[offset:offset + shape[0]], True
