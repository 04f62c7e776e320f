"""``element_spec``: TensorFlow-style descriptions of a dataset's elements.

A :class:`TensorSpec` holds a leaf's ``shape`` (``None`` for a dimension that varies, such as
the batch dimension of ``batch(n)`` without ``drop_remainder``) and ``dtype``; an element spec
is the element's structure (tuples, dicts) with a ``TensorSpec`` per leaf.

Unlike TensorFlow, which knows shapes from its graph, a pipeline here runs arbitrary Python, so
``Dataset.element_spec`` is found by producing the first element (and cached on nothing: ask
once and keep it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .structure import map_structure

__all__ = ["TensorSpec", "spec_of", "relax_leading_dim", "check_element_spec"]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Shape and dtype of one leaf of an element (TensorFlow's ``tf.TensorSpec``)."""

    shape: tuple[int | None, ...]
    dtype: np.dtype
    name: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(None if d is None else int(d) for d in self.shape))
        object.__setattr__(self, "dtype", np.dtype(self.dtype))

    def is_compatible_with(self, value: Any) -> bool:
        """Whether ``value`` (an array or scalar) fits this spec."""
        arr = np.asarray(value)
        if arr.ndim != len(self.shape) or arr.dtype != self.dtype:
            return False
        return all(want is None or want == got for want, got in zip(self.shape, arr.shape, strict=True))


def spec_of(element: Any) -> Any:
    """The spec of one concrete element."""
    def leaf(x: Any) -> TensorSpec:
        arr = np.asarray(x)
        return TensorSpec(arr.shape, arr.dtype)
    return map_structure(leaf, element)


def relax_leading_dim(spec: Any) -> Any:
    """The same spec with an unknown first dimension (a batch that may be short)."""
    return map_structure(lambda s: TensorSpec((None, *s.shape[1:]), s.dtype, s.name) if s.shape else s,
                         spec)


def check_element_spec(spec: Any, what: str = "element_spec") -> Any:
    """``spec`` if it is a structure (tuples, dicts) of :class:`TensorSpec`, else TypeError."""
    from .structure import flatten

    bad = [leaf for leaf in flatten(spec) if not isinstance(leaf, TensorSpec)]
    if bad:
        raise TypeError(f"{what} must be a TensorSpec or a tuple/dict of them (as "
                        f"Dataset.element_spec returns), got a leaf {bad[0]!r:.60}")
    return spec
