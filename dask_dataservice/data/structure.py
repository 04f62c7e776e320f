"""Nested elements: tuples and dicts of numpy arrays and Python scalars.

An element is a *structure*: a tuple (or namedtuple) or dict whose leaves are numpy arrays,
numpy scalars or Python scalars (and strings/bytes). These helpers stack, pad, split and
describe such structures; ``batch``, ``padded_batch`` and ``unbatch`` are built on them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["map_structure", "flatten", "stack", "pad_stack", "unstack", "nbytes"]


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def map_structure(fn: Callable[..., Any], *structures: Any) -> Any:
    """Apply ``fn`` to the leaves of one or more structures of the same shape.

    Tuples (and namedtuples) and dicts are structure; everything else, lists included, is
    a leaf (as in tf.data, where a list is converted to one tensor).
    """
    first = structures[0]
    if isinstance(first, dict):
        return {k: map_structure(fn, *(s[k] for s in structures)) for k in first}
    if isinstance(first, tuple):
        items = [map_structure(fn, *parts) for parts in zip(*structures, strict=True)]
        return type(first)(*items) if _is_namedtuple(first) else tuple(items)
    return fn(*structures)


def flatten(x: Any) -> list[Any]:
    """The leaves of a structure, in a stable order (dict keys in insertion order)."""
    if isinstance(x, dict):
        return [leaf for v in x.values() for leaf in flatten(v)]
    if isinstance(x, tuple):
        return [leaf for v in x for leaf in flatten(v)]
    return [x]


def _transpose(elements: Sequence[Any]) -> Any:
    """Turn a list of structures into a structure of lists."""
    first = elements[0]
    if isinstance(first, dict):
        try:
            return {k: _transpose([e[k] for e in elements]) for k in first}
        except (KeyError, TypeError) as e:
            raise ValueError(
                f"cannot batch elements with different structures: {sorted(first)} vs another"
            ) from e
    if isinstance(first, tuple):
        n = len(first)
        for el in elements:
            if not isinstance(el, tuple) or len(el) != n:
                raise ValueError(
                    f"cannot batch elements with different structures: a tuple of {n} and "
                    f"{type(el).__name__} {el!r:.60}"
                )
        items = [_transpose([el[i] for el in elements]) for i in range(n)]
        return type(first)(*items) if _is_namedtuple(first) else tuple(items)
    return _Leaves(elements)


class _Leaves(list[Any]):
    """A list of leaves of one position of a structure (marker type for _transpose)."""


def _check_one_kind(leaves: list[Any], out: np.ndarray) -> None:
    """numpy turns ``[1, "a"]`` into strings; a batch mixing numbers and text is an error."""
    if out.dtype.kind not in "US":
        return
    kinds = {"text" if np.asarray(x).dtype.kind in "USO" else "number" for x in leaves}
    if len(kinds) > 1:
        examples = [repr(x)[:20] for x in leaves[:4]]
        raise ValueError(
            f"cannot batch numbers together with strings (elements such as {', '.join(examples)}); "
            "numpy would silently turn the numbers into strings")


def _stack_leaves(leaves: list[Any]) -> np.ndarray:
    first = leaves[0]
    if isinstance(first, np.ndarray):
        try:
            out = np.stack(leaves)
        except ValueError as e:
            shapes = sorted({tuple(np.shape(x)) for x in leaves})
            raise ValueError(
                f"cannot batch arrays of different shapes {shapes[:4]}; "
                "use padded_batch() or bucket_by_sequence_length()"
            ) from e
        _check_one_kind(leaves, out)
        return out
    out = np.asarray(leaves)
    _check_one_kind(leaves, out)
    if out.dtype == object:
        shapes = sorted({tuple(np.shape(x)) for x in leaves}, key=str)
        raise ValueError(
            f"cannot batch leaves of different shapes {shapes[:4]}; use padded_batch()"
        )
    return out


def stack(elements: Sequence[Any]) -> Any:
    """Stack a list of elements of the same structure into one batched element."""
    if not isinstance(elements[0], (tuple, dict)):
        return _stack_leaves(list(elements))
    return map_structure(_stack_leaves, _transpose(elements))


def _pad_leaves(leaves: list[Any], padded_shape: Any, padding_value: Any) -> np.ndarray:
    arrays = [np.asarray(x) for x in leaves]
    rank = arrays[0].ndim
    for a in arrays:
        if a.ndim != rank:
            raise ValueError(f"padded_batch needs leaves of one rank, got ranks {rank} and {a.ndim}")
    max_shape = [max(a.shape[d] for a in arrays) for d in range(rank)]
    if padded_shape is not None:
        padded_shape = list(padded_shape)
        if len(padded_shape) != rank:
            raise ValueError(f"padded_shapes {padded_shape} does not match rank {rank} of the elements")
        for d, want in enumerate(padded_shape):
            if want is None or want == -1:
                continue
            if want < max_shape[d]:
                raise ValueError(
                    f"an element has size {max_shape[d]} in dimension {d}, larger than the "
                    f"padded shape {want}"
                )
            max_shape[d] = want
    dtype = np.result_type(*arrays) if arrays[0].dtype.kind not in "US" else arrays[0].dtype
    if dtype.kind in "US":
        dtype = np.dtype(f"{dtype.kind}{max(a.dtype.itemsize // (4 if dtype.kind == 'U' else 1) for a in arrays)}")
    fill = padding_value if padding_value is not None else ("" if dtype.kind in "US" else 0)
    out = np.full([len(arrays), *max_shape], fill, dtype=dtype)
    for i, a in enumerate(arrays):
        where: tuple[int | slice, ...] = (i, *(slice(0, s) for s in a.shape))
        out[where] = a
    return out


def pad_stack(elements: Sequence[Any], padded_shapes: Any = None, padding_values: Any = None) -> Any:
    """Stack elements, padding every leaf to the largest shape in the batch.

    ``padded_shapes`` and ``padding_values`` mirror the element's structure (or are None);
    a ``None`` or ``-1`` dimension in a padded shape pads to the largest in the batch.
    """
    if not isinstance(elements[0], (tuple, dict)):
        return _pad_leaves(list(elements), padded_shapes, padding_values)
    leaves = _transpose(elements)
    shapes = padded_shapes if padded_shapes is not None else map_structure(lambda _: None, leaves)
    values = padding_values if padding_values is not None else map_structure(lambda _: None, leaves)
    if not isinstance(values, (tuple, dict)):  # one scalar padding value for every leaf
        values = map_structure(lambda _, v=values: v, leaves)
    return _map_pad(leaves, shapes, values)


def _map_pad(leaves: Any, shapes: Any, values: Any) -> Any:
    if isinstance(leaves, dict):
        return {k: _map_pad(leaves[k], shapes[k], values[k]) for k in leaves}
    if isinstance(leaves, tuple):
        items = [_map_pad(lv, sh, va) for lv, sh, va in zip(leaves, shapes, values, strict=True)]
        return type(leaves)(*items) if _is_namedtuple(leaves) else tuple(items)
    return _pad_leaves(leaves, shapes, values)


def batch_size_of(x: Any) -> int:
    """The size of axis 0 shared by every leaf of a batched element."""
    sizes: set[int | None] = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in flatten(x)}
    leading = {s for s in sizes if s is not None}
    if len(leading) != len(sizes):
        raise ValueError("unbatch() needs every leaf of an element to have a leading axis")
    if len(leading) != 1:
        raise ValueError(f"unbatch() needs leaves with one leading size, got {sorted(leading)}")
    return leading.pop()


def unstack(x: Any) -> list[Any]:
    """Split a batched element along axis 0 into a list of elements."""
    if not isinstance(x, (tuple, dict)):
        if np.ndim(x) == 0:
            raise ValueError(
                f"unbatch() needs elements with a leading axis, got {type(x).__name__} {x!r:.40}"
            )
        return list(x)
    n = batch_size_of(x)
    return [map_structure(lambda leaf, i=i: leaf[i], x) for i in range(n)]


def nbytes(x: Any) -> int:
    """Approximate memory of an element (array buffers; 8 bytes for a scalar)."""
    total = 0
    for leaf in flatten(x):
        n = getattr(leaf, "nbytes", None)
        if n is None:
            n = len(leaf) if isinstance(leaf, (bytes, str)) else 8
        total += int(n)
    return total
