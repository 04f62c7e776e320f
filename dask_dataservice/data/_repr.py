"""``repr(dataset)``: the pipeline as the calls that build it, cheaply.

``repr(Dataset.range(1000).shuffle(1024).batch(32))`` is
``<Dataset.range(1000).shuffle(1024).batch(32) cardinality=32>``: the source and each op as
its method call, with the arguments given (each op's :meth:`~._base.Op.params`, named after
the op's constructor and without those equal to its defaults), arrays as their dtype and
shape, functions by name, long lists shortened; then the cardinality. Nothing is read, run or
asked of a service (an op may render its own arguments: :meth:`~._base.Op.repr_args`).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import numpy as np

from ._base import INFINITE, UNKNOWN, Op, callable_name

__all__ = ["pipeline_repr", "value_repr", "cardinality_name"]

_EMPTY = inspect.Parameter.empty
_MAX_ITEMS = 4
_MAX_TEXT = 60


def cardinality_name(n: int) -> str:
    return {INFINITE: "INFINITE", UNKNOWN: "UNKNOWN"}.get(n, str(n))


def value_repr(x: Any, depth: int = 0) -> str:
    """A short, one-line rendering of an op's argument."""
    if isinstance(x, np.ndarray):
        return f"<{x.dtype} {tuple(x.shape)}>"
    if isinstance(x, (str, bytes)):
        text = repr(x)  # a path's end says most: keep both ends
        half = _MAX_TEXT // 2
        return text if len(text) <= _MAX_TEXT else f"{text[:half - 2]}...{text[-half + 1:]}"
    if isinstance(x, functools.partial):
        return callable_name(x.func)
    if callable(x) and not isinstance(x, type):
        return callable_name(x)
    if depth > 2:
        return "..."
    if isinstance(x, dict):
        items = [f"{value_repr(k, depth + 1)}: {value_repr(v, depth + 1)}"
                 for k, v in list(x.items())[:_MAX_ITEMS]]
        more = f", ... {len(x)} items" if len(x) > _MAX_ITEMS else ""
        return "{" + ", ".join(items) + more + "}"
    if isinstance(x, (tuple, list)):
        items = [value_repr(v, depth + 1) for v in x[:_MAX_ITEMS]]
        more = f", ... {len(x)} items" if len(x) > _MAX_ITEMS else ""
        if isinstance(x, tuple) and len(x) == 1:
            more = ","
        open_, close = ("(", ")") if isinstance(x, tuple) else ("[", "]")
        return open_ + ", ".join(items) + more + close
    text = repr(x)
    return text if len(text) <= _MAX_TEXT else text[:_MAX_TEXT - 3] + "..."


def _is_default(value: Any, default: Any) -> bool:
    if default is _EMPTY:
        return False
    if value is default:
        return True
    if isinstance(value, (bool, int, float, str, type(None))) and type(value) is type(default):
        return bool(value == default)
    return False


def op_args(op: Op) -> str:
    """The arguments of ``op``'s call (see the module docstring)."""
    own = op.repr_args()
    if own is not None:
        return ", ".join(own)
    params = op.params()
    try:
        sig = [p for p in inspect.signature(type(op).__init__).parameters.values()][1:]
    except (TypeError, ValueError):  # pragma: no cover - a builtin __init__
        sig = []
    sig = [p for p in sig if p.name not in ("input", "inputs", "first", "second", "structure")]
    if len(sig) != len(params):  # params derived otherwise: show them as they are
        return ", ".join(value_repr(p) for p in params)
    out: list[str] = []
    keywords = False
    for p, value in zip(sig, params, strict=True):
        if _is_default(value, p.default):
            keywords = True  # later arguments need their names
            continue
        out.append(f"{p.name}={value_repr(value)}" if keywords else value_repr(value))
    return ", ".join(out)


def pipeline_repr(op: Op) -> str:
    """``Dataset.<source>(...).<op>(...)...`` for the pipeline rooted at ``op``."""
    chain: list[Op] = []
    node = op
    while len(node.inputs) == 1 and not node.is_source:
        chain.append(node)
        node = node.inputs[0]
    if node.is_source or not node.inputs:
        text = f"Dataset.{node.name}({op_args(node)})"
    elif node.name == "zip":
        keys = getattr(node, "keys", None)
        parts = [pipeline_repr(i) for i in node.inputs]
        if keys is not None:
            text = "Dataset.zip({" + ", ".join(
                f"{k!r}: {p}" for k, p in zip(keys, parts, strict=True)) + "})"
        else:
            text = "Dataset.zip((" + ", ".join(parts) + ("," if len(parts) == 1 else "") + "))"
    elif node.name == "concatenate":
        text = f"{pipeline_repr(node.inputs[0])}.concatenate({pipeline_repr(node.inputs[1])})"
    else:  # zip, sample_from_datasets, choose_from_datasets...
        inner = ", ".join(pipeline_repr(i) for i in node.inputs)
        extra = op_args(node)
        text = f"Dataset.{node.name}([{inner}]{', ' + extra if extra else ''})"
    for step in reversed(chain):
        text += f".{step.name}({op_args(step)})"
    return text
