"""The node type every pipeline is built from, and the iteration context.

Rules
-----
1. An :class:`Op` is immutable after ``__init__``. A :class:`~dask_dataservice.data.Dataset`
   is a thin handle on one root ``Op``; transformations build new ops that point at their
   inputs, so a pipeline is a tree that can be pickled (cloudpickle) and shipped to a worker.
2. Nothing here knows about Dask. This package runs a pipeline in the current process.
3. Per-iteration state (shuffle epochs, the split provider, thread handles) lives in the
   :class:`IterContext` or in the generator an op returns, never on the op itself, so one
   pipeline can be iterated many times, concurrently, from several threads.

Theory of operation
-------------------
``Op.iterate(ctx)`` returns a fresh Python iterator. Most ops are generator functions over
their input's iterator. When a pipeline is iterated with a *split provider* (the data
service's DYNAMIC or FILE sharding), the single splittable source of the pipeline reads the
splits that the provider serves instead of its whole input; every op above it is unaware of
this, except :class:`~dask_dataservice.data.ops.Repeat`, which tells the provider that a new
repetition starts.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import reprlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

#: Cardinality of a dataset that never ends (``repeat()`` with no count).
INFINITE = -1
#: Cardinality that cannot be known without running the pipeline (``filter``, generators).
UNKNOWN = -2
#: True while ``Dataset.__repr__`` runs: an op answers ``cardinality()`` from what it knows,
#: without asking anything over the network (a source reading from the data service).
REPR_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "dask_dataservice_repr_only", default=False)
#: Let the library pick a degree of parallelism (the number of CPUs of this process).
AUTOTUNE = -1


def autotune_threads() -> int:
    """The number of threads AUTOTUNE stands for."""
    return max(2, os.cpu_count() or 2)


_short = reprlib.Repr()
_short.maxstring = 60
_short.maxother = 60
_short.maxlist = 6
_short.maxtuple = 6
_short.maxdict = 6


def short_repr(x: Any) -> str:
    """A bounded ``repr`` for error messages (large arrays are summarised)."""
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is not None and dtype is not None and getattr(x, "size", 0) > 8:
        return f"<array shape={tuple(shape)} dtype={dtype}>"
    return _short.repr(x)


def callable_name(fn: Callable[..., Any]) -> str:
    """A readable name for a user function (``module.qualname`` or its repr)."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if name is None:
        return short_repr(fn)
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module and module != "builtins" else name


_NOTE_MARK = "__dask_dataservice_annotated__"


def annotate_user_error(exc: BaseException, op: str, fn: Callable[..., Any] | None, element: Any) -> None:
    """Add a note saying which pipeline op and user function raised ``exc``.

    The exception keeps its type and traceback (the note is shown under it), so users can
    still ``except`` the error they raised. Only the innermost op annotates an exception.
    """
    if getattr(exc, _NOTE_MARK, False):
        return
    where = f"Dataset.{op}"
    if fn is not None:
        where += f"({callable_name(fn)})"
    note = f"dask_dataservice: raised in {where}"
    if element is not _NO_ELEMENT:
        note += f" on element {short_repr(element)}"
    try:
        exc.add_note(note)
        setattr(exc, _NOTE_MARK, True)
    except (AttributeError, TypeError):  # exotic exception types without __dict__/notes
        pass


_NO_ELEMENT = object()


@dataclass
class IterContext:
    """State of one iteration of a pipeline.

    Parameters
    ----------
    split_provider
        When set, the pipeline's splittable source reads only the splits it serves (see
        :mod:`dask_dataservice.data.splits`).
    """

    split_provider: Any = None
    #: Set by ``ignore_errors()`` for the ops below it: drop an element whose production raised.
    ignore_errors: bool = False
    #: With ``ignore_errors``: log each dropped element's error (``log_warning=True``).
    log_errors: bool = False
    #: Per-op counters of how often an op was (re)started in this iteration (shuffle epochs).
    epochs: dict[int, int] = field(default_factory=dict)
    #: Per-op figures of this iteration (a :class:`~._stats.PipelineStats`), or None.
    stats: Any = None
    #: The data worker's split cache (``autocache()``), or None (then it passes elements on).
    autocache: Any = None

    def next_epoch(self, op: Op) -> int:
        """Return how many times ``op`` was started before in this iteration, and count one."""
        n = self.epochs.get(id(op), 0)
        self.epochs[id(op)] = n + 1
        return n

    def nested(self) -> IterContext:
        """A context for a dataset built inside a user function (no split provider)."""
        return IterContext(ignore_errors=self.ignore_errors, log_errors=self.log_errors)

    def ignored(self, exc: BaseException) -> bool:
        """Whether ``ignore_errors()`` swallows ``exc`` here (it is logged when asked)."""
        if not self.ignore_errors or not isinstance(exc, Exception):
            return False
        if self.log_errors:
            logging.getLogger("dask_dataservice.data").warning(
                "ignore_errors: dropped an element: %s: %s", type(exc).__name__, exc)
        return True


class Op:
    """A node of a pipeline.

    Subclasses set ``name`` (the user-facing method name, used in errors), store their
    parameters in ``__init__`` and implement :meth:`iterate`, :meth:`cardinality` and
    :meth:`params`.
    """

    name: str = "op"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Every op's iterator is counted when the iteration keeps figures (``ctx.stats``,
        # see ._stats): one check per ``iterate`` call, none per element here.
        super().__init_subclass__(**kwargs)
        from ._stats import register_op_code

        register_op_code(cls)  # a sampled frame running one of its methods is this op's
        fn = cls.__dict__.get("iterate")
        if fn is None or getattr(fn, "_dds_counted", False):
            return

        @functools.wraps(fn)
        def iterate(self: Op, ctx: IterContext) -> Iterator[Any]:
            stats = ctx.stats
            if stats is None or type(self).iterate is not iterate:  # off, or super().iterate
                return fn(self, ctx)  # type: ignore[no-any-return]
            return stats.wrap(self, fn(self, ctx))  # type: ignore[no-any-return]

        iterate._dds_counted = True  # type: ignore[attr-defined]
        cls.iterate = iterate  # type: ignore[method-assign]

    #: Inputs that are part of the pipeline (not datasets built inside user functions).
    inputs: tuple[Op, ...] = ()
    #: True for ops that produce elements from outside the pipeline.
    is_source: bool = False

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        raise NotImplementedError

    def cardinality(self) -> int:
        return UNKNOWN

    def params(self) -> tuple[Any, ...]:
        """Parameters that define this op (for fingerprints and ``repr``)."""
        return ()

    def repr_args(self) -> list[str] | None:
        """The arguments ``repr(dataset)`` shows for this op, or None: its params, named after
        its constructor's (see ``data/_repr.py``)."""
        return None

    def cardinality_note(self) -> str | None:
        """Why this op's cardinality is UNKNOWN when it is and an op can say (``len()``)."""
        return None

    # -- splits ------------------------------------------------------------------------
    def split_blocker(self) -> str | None:
        """Why a pipeline with this op *above its source* cannot be split, or None."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(map(short_repr, self.params()))})"


def walk(op: Op) -> Iterator[Op]:
    """Every op of the pipeline rooted at ``op``, parents before children."""
    stack = [op]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(node.inputs))


def sources(op: Op) -> list[Op]:
    """The source ops of a pipeline, in order."""
    return [node for node in walk(op) if node.is_source]

