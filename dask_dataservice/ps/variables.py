"""``Variable`` and ``ShardedVariable``: small picklable handles to values on parameter servers.

Created inside ``strategy.scope()``, a ``Variable`` lives on one parameter server (PS), and a
partitioned one is a :class:`ShardedVariable` whose shards are ``Variable`` s placed
round-robin over the PSs. Outside any scope a ``Variable`` holds its value right here, in
the process that made it (the coordinator), like a TensorFlow variable outside
``strategy.scope()``.

A handle carries only names, shape, dtype and PS addresses, so it pickles into scheduled
functions for free. Its methods talk to the PS directly (see :mod:`._routing`):

- ``read_value()`` / ``numpy()`` / ``np.asarray(v)``: the whole value;
- ``assign``, ``assign_add``, ``assign_sub``: whole-value updates (they return the handle);
- ``gather(ids)`` (alias ``sparse_read``): rows, e.g. an embedding lookup. A sharded
  variable sends one request per shard that holds any of the ids, all in parallel, asking
  each distinct row once, and reassembles the rows in the order of ``ids``;
- ``scatter_add``, ``scatter_sub``, ``scatter_update`` (``ids, updates`` or an
  :class:`~.optimizers.IndexedSlices`): row updates. Duplicate ids accumulate for add/sub;
  for update the last occurrence wins.

Updates made inside a scheduled function are tagged with the function's id and a sequence
number, so a PS applies each at most once even when the function is re-run.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Self

import numpy as np
from numpy.typing import ArrayLike

from ..errors import ShapeMismatchError
from . import _kernels, _routing
from ._types import Call, IndexedSlices, wire

if TYPE_CHECKING:
    from distributed import Client

__all__ = ["Variable", "ShardedVariable", "read_values", "apply_gradients"]

#: The strategy whose ``scope()`` is active in this context (set by ParameterServerStrategy).
current_strategy: contextvars.ContextVar[Any] = contextvars.ContextVar("dds_ps_strategy", default=None)


class _Handle:
    """What both handle classes share: metadata, arithmetic on the value, and the update API.

    Arithmetic reads the value first, as a TensorFlow variable converts to a tensor: ``v * 2``,
    ``x @ w``, ``-v``, ``v[3:5]`` each read the whole value from its PS (for an embedding
    lookup use :meth:`gather`, which moves only the rows asked for).

    Subclasses implement ``read_value()``, ``_update(kind, value)``, ``_parts()`` (the shard
    handles and their row offsets) and ``_client_uid()``.
    """

    # both handle classes store ``_name``, ``_shape`` and ``_dtype``
    _name: str
    _shape: tuple[int, ...]
    _dtype: np.dtype[Any]

    def read_value(self) -> np.ndarray:
        raise NotImplementedError

    def _update(self, kind: str, value: Any) -> None:
        raise NotImplementedError

    def _parts(self) -> tuple[list[Variable], list[int]]:
        raise NotImplementedError

    def _client_uid(self) -> tuple[Client | None, str | None]:
        raise NotImplementedError

    @property
    def name(self) -> str:
        return self._name

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> np.dtype[Any]:
        return self._dtype

    def value(self) -> np.ndarray:
        return self.read_value()

    read = numpy = value

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        v = self.read_value()
        return v if dtype is None else v.astype(dtype)

    # -- updates (TensorFlow's names; ``read_value=False`` returns None, as TF returns an op) --
    def assign(self, value: Any, read_value: bool = True) -> Self | None:
        """Set the value (broadcast to the variable's shape); returns the variable."""
        self._update("assign", value)
        return self if read_value else None

    def assign_add(self, delta: Any, read_value: bool = True) -> Self | None:
        """Add ``delta`` to the value on its PS; returns the variable."""
        self._update("assign_add", delta)
        return self if read_value else None

    def assign_sub(self, delta: Any, read_value: bool = True) -> Self | None:
        """Subtract ``delta`` from the value on its PS; returns the variable."""
        self._update("assign_sub", delta)
        return self if read_value else None

    def gather(self, ids: ArrayLike) -> np.ndarray:
        """Rows ``ids`` (any shape of ints): result shape ``ids.shape + shape[1:]``.

        A sharded variable sends one request per shard holding any id, all in parallel,
        asking each distinct row once, and reassembles the rows in the order of ``ids``."""
        shards, offsets = self._parts()
        client, uid = self._client_uid()
        return _gather(self._name, shards, offsets, self._shape, self._dtype, ids, client,
                       uid)

    sparse_read = gather

    def _scatter(self, kind: str, ids: Any, updates: Any) -> Self:
        shards, offsets = self._parts()
        client, uid = self._client_uid()
        _scatter(self._name, shards, offsets, self._shape, self._dtype, kind, ids, updates,
                 client, uid)
        return self

    def scatter_add(self, ids: Any, updates: Any = None) -> Self:
        """Add ``updates[i]`` to row ``ids[i]`` (duplicates accumulate); or one IndexedSlices."""
        return self._scatter("add", ids, updates)

    def scatter_sub(self, ids: Any, updates: Any = None) -> Self:
        """Subtract ``updates[i]`` from row ``ids[i]`` (duplicates accumulate)."""
        return self._scatter("sub", ids, updates)

    def scatter_update(self, ids: Any, updates: Any = None) -> Self:
        """Set row ``ids[i]`` to ``updates[i]`` (for a duplicate id the last one wins)."""
        return self._scatter("update", ids, updates)

    def scatter_mul(self, ids: Any, updates: Any = None) -> Self:
        """Multiply row ``ids[i]`` by ``updates[i]`` (duplicates multiply)."""
        return self._scatter("mul", ids, updates)

    def scatter_div(self, ids: Any, updates: Any = None) -> Self:
        """Divide row ``ids[i]`` by ``updates[i]`` (duplicates divide by their product;
        integer variables use floor division)."""
        return self._scatter("div", ids, updates)

    def scatter_max(self, ids: Any, updates: Any = None) -> Self:
        """Row ``ids[i]`` becomes the elementwise maximum of itself and ``updates[i]``."""
        return self._scatter("max", ids, updates)

    def scatter_min(self, ids: Any, updates: Any = None) -> Self:
        """Row ``ids[i]`` becomes the elementwise minimum of itself and ``updates[i]``."""
        return self._scatter("min", ids, updates)

    # -- arithmetic ----------------------------------------------------------------------------
    def _v(self) -> np.ndarray:
        return self.read_value()

    def __add__(self, o: Any) -> Any:
        return self._v() + o

    def __radd__(self, o: Any) -> Any:
        return o + self._v()

    def __sub__(self, o: Any) -> Any:
        return self._v() - o

    def __rsub__(self, o: Any) -> Any:
        return o - self._v()

    def __mul__(self, o: Any) -> Any:
        return self._v() * o

    def __rmul__(self, o: Any) -> Any:
        return o * self._v()

    def __truediv__(self, o: Any) -> Any:
        return self._v() / o

    def __rtruediv__(self, o: Any) -> Any:
        return o / self._v()

    def __matmul__(self, o: Any) -> Any:
        return self._v() @ o

    def __rmatmul__(self, o: Any) -> Any:
        return o @ self._v()

    def __neg__(self) -> Any:
        return -self._v()

    def __getitem__(self, index: Any) -> Any:
        return self._v()[index]

    def __float__(self) -> float:
        return float(self._v())

    def __int__(self) -> int:
        return int(self._v())


class Variable(_Handle):
    """A variable: on a parameter server when created in ``strategy.scope()``, else local.

    Parameters follow ``tf.Variable``: ``initial_value`` (an array, or a callable: see
    :func:`._kernels.initial_value` for the calling conventions, TensorFlow's ``shard_info``
    and Keras' ``partition_shape``/``partition_offset`` included), ``trainable``, ``name``,
    ``dtype``, ``shape``. ``per_worker_variable=True`` in a strategy's scope makes a
    :class:`~.per_worker.PerWorkerVariable` (one copy per training worker, TensorFlow 2.15).
    """

    #: The value of a local variable (None: it lives on a parameter server).
    _local: np.ndarray | None
    _lock: threading.Lock | None

    def __new__(cls, initial_value: Any = None, trainable: bool = True, name: str | None = None,
                dtype: Any = None, shape: Any = None, **kwargs: Any) -> Any:
        strategy = current_strategy.get()
        if kwargs.pop("per_worker_variable", False):
            if strategy is None:
                raise ValueError(
                    "per_worker_variable=True makes one copy of the variable per training "
                    "worker: create it inside strategy.scope() of a ParameterServerStrategy")
            return strategy._create_per_worker_variable(
                initial_value=initial_value, name=name, dtype=dtype, shape=shape)
        if cls is Variable and strategy is not None and initial_value is not None:
            return strategy._create_variable(initial_value=initial_value, trainable=trainable,
                                             name=name, dtype=dtype, shape=shape, **kwargs)
        return super().__new__(cls)

    def __init__(self, initial_value: Any = None, trainable: bool = True, name: str | None = None,
                 dtype: Any = None, shape: Any = None, **kwargs: Any) -> None:
        if getattr(self, "_ready", False):  # built by a strategy in __new__
            return
        if initial_value is None:
            raise ValueError("initial_value must be given")
        if callable(initial_value):
            if shape is None:
                initial_value = initial_value()
            else:
                initial_value, _ = _kernels.initial_value(initial_value, tuple(shape), dtype)
        value = np.array(_kernels.cast_value(initial_value, dtype, f"variable {name!r}"),
                         copy=True)
        if shape is not None and value.shape != tuple(shape):
            raise ValueError(f"initial_value has shape {value.shape}, expected {tuple(shape)}")
        self._init_handle(name or "Variable", value.shape, value.dtype, trainable,
                          address=None, key=None, ps_index=None)
        self._local = value
        self._lock = threading.Lock()

    # -- construction (strategy) -----------------------------------------------------------
    @classmethod
    def _remote(cls, name: str, shape: Sequence[int], dtype: Any, trainable: bool, address: str,
                key: str, ps_index: int, client: Client | None = None,
                owner: str | None = None) -> Variable:
        self = object.__new__(cls)
        self._init_handle(name, tuple(shape), np.dtype(dtype), trainable, address, key, ps_index)
        self._local = None
        self._lock = None
        self._client = client
        self._owner = owner
        return self

    def _init_handle(self, name: str, shape: Sequence[int], dtype: Any, trainable: bool,
                     address: str | None, key: str | None, ps_index: int | None) -> None:
        self._name = name
        self._shape = tuple(int(d) for d in shape)
        self._dtype = np.dtype(dtype)
        self._trainable = bool(trainable)
        self._address = address
        self._key = key
        self._ps_index = ps_index
        self._client: Client | None = None
        self._owner: str | None = None
        self._ready = True

    def __reduce_ex__(self, protocol: Any) -> Any:
        if self._local is not None:
            return object.__reduce_ex__(self, protocol)  # the value travels: __getstate__
        # A remote handle travels as plain strings and ints: pickling it (once per scheduled
        # function, in the user's thread) costs ~5 us instead of ~45 us for its __dict__.
        return (_remote_handle, (self._name, self._shape, self._dtype.str, self._trainable,
                                 self._address, self._key, self._ps_index, self._owner))

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_client", None)
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._client = None
        self._lock = threading.Lock() if self._local is not None else None

    def _parts(self) -> tuple[list[Variable], list[int]]:
        return [self], [0, self._shape[0] if self._shape else 0]

    def _client_uid(self) -> tuple[Client | None, str | None]:
        return self._client, self._owner

    # -- properties ------------------------------------------------------------------------
    @property
    def trainable(self) -> bool:
        return self._trainable

    @property
    def ps_address(self) -> str | None:
        """The Dask address of the parameter server holding this variable (None: local)."""
        return self._address

    @property
    def device(self) -> str:
        """TensorFlow-style placement: ``/job:ps/replica:0/task:<i>/device:CPU:0`` or ``""``."""
        if self._address is None:
            return ""
        return f"/job:ps/replica:0/task:{self._ps_index}/device:CPU:0"

    @property
    def key(self) -> str | None:
        """The shard key on the PS."""
        return self._key

    @property
    def variables(self) -> list[Variable]:
        return [self]

    def __repr__(self) -> str:
        where = f" on {self._address}" if self._address else ""
        return f"<dds.Variable {self._name!r} shape={self._shape} dtype={self._dtype}{where}>"

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a scalar variable")
        return self._shape[0]

    # -- reads and updates -------------------------------------------------------------------
    def read_value(self) -> np.ndarray:
        """The current value, as a new numpy array."""
        if self._local is not None:
            assert self._lock is not None  # local variables have one
            with self._lock:
                return self._local.copy()
        value: np.ndarray = _routing.call(_ps_address(self._address), "ps_read", self._client,
                                          {"key": self._key}, self._owner)["value"]
        return value

    def _update(self, kind: str, value: Any) -> None:
        arr = _kernels.cast_value(value, self._dtype, f"{kind} to variable {self._name!r}")
        if arr.shape != self._shape:
            try:
                fits = np.broadcast_shapes(arr.shape, self._shape) == self._shape
            except ValueError:
                fits = False
            if not fits:
                raise ShapeMismatchError(f"shape {arr.shape} does not fit variable "
                                         f"{self._name!r} of shape {self._shape}")
        if self._local is not None:
            assert self._lock is not None  # local variables have one
            with self._lock:
                _kernels.update_dense(self._local, kind, arr)
            return
        _routing.send_updates(
            [Call(_ps_address(self._address), "ps_update",
                  {"key": self._key, "kind": kind, "value": wire(arr), **_routing.tag()})],
            self._client, arr.nbytes, self._owner)


def _ps_address(address: str | None) -> str:
    """The PS address of a remote variable (set for every variable on a PS)."""
    assert address is not None, "a local variable has no parameter server"
    return address


def _remote_handle(name: str, shape: Sequence[int], dtype: Any, trainable: bool, address: str,
                   key: str, ps_index: int, owner: str | None) -> Variable:
    return Variable._remote(name, shape, dtype, trainable, address, key, ps_index, None, owner)


class ShardedVariable(_Handle):
    """A variable partitioned along axis 0 into ``variables`` (one per shard, in row order).

    It behaves as one variable of the full ``shape``: reads concatenate the shards, and
    ``gather`` / ``scatter_*`` route each id to the shard that holds its row.
    """

    def __init__(self, variables: list[Variable], name: str | None = None) -> None:
        if not isinstance(variables, list | tuple) or not variables or \
                not all(isinstance(v, Variable) for v in variables):
            # TensorFlow's type for all three: not a list, an empty one, a non-variable in it
            raise TypeError("ShardedVariable: `variables` should be a non-empty list of "
                            f"Variable objects, got {variables!r:.200}")
        first = variables[0]
        for v in variables:
            if v.dtype != first.dtype or v.shape[1:] != first.shape[1:] or not v.shape:
                raise ValueError("all shards must share dtype and the shape of axes 1..n, "
                                 f"got {[(v.shape, str(v.dtype)) for v in variables]}")
        self._variables = list(variables)
        self._offsets = [0]
        for v in variables:
            self._offsets.append(self._offsets[-1] + v.shape[0])
        self._name = name or first.name.rsplit("/part_", 1)[0]
        self._shape = (self._offsets[-1], *first.shape[1:])
        self._dtype = first.dtype

    @property
    def variables(self) -> list[Variable]:
        """The shards, in row order."""
        return list(self._variables)

    @property
    def trainable(self) -> bool:
        return self._variables[0].trainable

    @property
    def offsets(self) -> list[int]:
        """Row boundaries of the shards: ``len(variables) + 1`` ints from 0 to ``shape[0]``."""
        return list(self._offsets)

    def __len__(self) -> int:
        return self._shape[0]

    def __repr__(self) -> str:
        return (f"<dds.ShardedVariable {self._name!r} shape={self._shape} dtype={self._dtype} "
                f"shards={[v.shape[0] for v in self._variables]}>")

    def _parts(self) -> tuple[list[Variable], list[int]]:
        return self._variables, self._offsets

    def _client_uid(self) -> tuple[Client | None, str | None]:
        return self._variables[0]._client_uid()

    def read_value(self) -> np.ndarray:
        """The whole value: every shard read in parallel, concatenated."""
        return read_values(self)[0]

    def _update(self, kind: str, value: Any) -> None:
        arr = _kernels.cast_value(value, self._dtype, f"{kind} to variable {self._name!r}")
        try:
            full = np.broadcast_to(arr, self._shape)
        except ValueError:
            raise ValueError(f"cannot {kind} a value of shape {arr.shape} to variable "
                             f"{self._name!r} of shape {self._shape}") from None
        pieces = [full[a:b] for a, b in zip(self._offsets, self._offsets[1:], strict=False)]
        if self._variables[0]._local is not None:
            for v, piece in zip(self._variables, pieces, strict=True):
                v._update(kind, piece)
            return
        tag = _routing.tag()
        calls = [Call(_ps_address(v._address), "ps_update",
                      {"key": v._key, "kind": kind,
                       "value": wire(arr if arr.ndim == 0 else piece), **tag})
                 for v, piece in zip(self._variables, pieces, strict=True)]
        client, uid = self._client_uid()
        _routing.send_updates(calls, client, arr.nbytes, uid)


def read_values(*variables: Variable | ShardedVariable) -> list[np.ndarray]:
    """The values of several variables, read in parallel (one request per shard)."""
    calls: list[Call] = []
    local: dict[int, np.ndarray] = {}
    client = uid = None
    for i, var in enumerate(variables):
        for v in var.variables:
            if v._local is not None:
                local[i] = np.concatenate([s.read_value() for s in var.variables]) \
                    if isinstance(var, ShardedVariable) else var.read_value()
                break
            calls.append(Call(_ps_address(v._address), "ps_read", {"key": v._key}))
            client, uid = client or v._client, uid or v._owner
    replies = iter(_routing.call_many(calls, client, uid))
    out = []
    for i, var in enumerate(variables):
        if i in local:
            out.append(local[i])
            continue
        parts = [next(replies)["value"] for _ in var.variables]
        out.append(parts[0] if len(parts) == 1 and isinstance(var, Variable)
                   else np.concatenate(parts))
    return out


# ---------------------------------------------------------------------------------------
# row routing shared by Variable and ShardedVariable
# ---------------------------------------------------------------------------------------


def _flat_ids(ids: Any, rows: int, name: str) -> tuple[np.ndarray, tuple[Any, ...]]:
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
        if ids.size == 0:
            ids = ids.astype(np.int64)
        elif ids.dtype == object and all(isinstance(i, int | np.integer) for i in ids.flat):
            # Python ints, some beyond 64 bits: out of range (a row index is below 2**63)
            bad = next((int(i) for i in ids.flat if not 0 <= int(i) < rows), None)
            if bad is not None:
                raise IndexError(f"id {bad} is out of range [0, {rows}) for variable {name!r}")
            ids = ids.astype(np.int64)
        else:
            raise TypeError(f"ids must be integers, got dtype {ids.dtype}")
    if ids.dtype.kind == "u" and ids.size and int(ids.max()) >= rows:
        # before the cast to int64 below, which would wrap ids >= 2**63 to negative ones
        bad = ids[ids >= rows].flat[0]
        raise IndexError(f"id {int(bad)} is out of range [0, {rows}) for variable {name!r}")
    flat = ids.reshape(-1).astype(np.int64, copy=False)
    if flat.size and (flat.min() < 0 or flat.max() >= rows):
        bad = flat[(flat < 0) | (flat >= rows)][0]
        raise IndexError(f"id {int(bad)} is out of range [0, {rows}) for variable {name!r}")
    return flat, ids.shape


def _stable_sort(flat: np.ndarray, bound: int) -> tuple[np.ndarray, np.ndarray]:
    """``(order, flat[order])`` with ``order`` a stable argsort of ``flat`` (ids in
    ``[0, bound)``).

    The ids and their positions are packed into one int64 key (``id << bits | position``)
    and sorted: the keys are distinct, so any sort is stable, and numpy's default sort of
    int64 is ~6x as fast as a stable argsort (4,096 ids: 55 us instead of 330 us). Ids too
    large to pack take the stable argsort.
    """
    n = flat.size
    bits = max(1, (n - 1).bit_length())
    if bound > 0 and (bound - 1).bit_length() + bits <= 62:
        key = flat.astype(np.int64, copy=True)
        key <<= bits
        key |= np.arange(n, dtype=np.int64)
        key.sort()
        order = (key & ((1 << bits) - 1)).astype(np.intp, copy=False)
        key >>= bits
        return order, key
    order = np.argsort(flat, kind="stable")
    return order, flat[order]


class _Plan:
    """Where the rows of ``flat`` ids live: each distinct id once, grouped by shard.

    ``uniq`` is the sorted distinct ids and :attr:`inverse` maps each id to its position in
    ``uniq``; since ``uniq`` is sorted, each shard owns one contiguous range of it. One
    stable argsort of the ids serves everything: the distinct ids, the inverse, and the
    duplicate sums of :meth:`combine` (``np.unique(return_inverse=True)`` costs 4x as much,
    and a second argsort for the sums as much again).
    """

    __slots__ = ("uniq", "parts", "_order", "_first", "_group", "_inverse")

    def __init__(self, flat: np.ndarray, offsets: list[int]) -> None:
        #: ``order``: a stable argsort of ``flat`` (None: already sorted and distinct);
        #: ``first``: which sorted positions start a run of equal ids (None: all do);
        #: ``group``: the position in ``uniq`` of each sorted position (None: identity).
        self._order: np.ndarray | None = None
        self._first: np.ndarray | None = None
        self._group: np.ndarray | None = None
        self._inverse: np.ndarray | None = None
        n = flat.size
        if n < 2 or bool(np.all(flat[1:] > flat[:-1])):
            self.uniq = flat
        else:
            order, srt = _stable_sort(flat, offsets[-1])
            first = np.empty(n, dtype=bool)
            first[0] = True
            np.not_equal(srt[1:], srt[:-1], out=first[1:])
            self._order = order
            if first.all():
                self.uniq = srt
            else:
                self.uniq = srt[first]
                self._first = first
                group = np.cumsum(first, dtype=np.intp)
                group -= 1
                self._group = group
        bounds = np.searchsorted(self.uniq, offsets)
        #: ``[(shard, start, stop, shard-local ids)]`` for shards holding any id.
        self.parts = [(i, int(a), int(b), self.uniq[a:b] - offsets[i])
                      for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)) if b > a]

    @property
    def inverse(self) -> np.ndarray | None:
        """Each id's position in ``uniq`` (None when the ids were sorted and distinct)."""
        if self._inverse is None and self._order is not None:
            inv = np.empty(self._order.size, dtype=np.intp)
            inv[self._order] = np.arange(self._order.size) if self._group is None \
                else self._group
            self._inverse = inv
        return self._inverse

    def expand(self, rows: np.ndarray) -> np.ndarray:
        """Rows per distinct id → rows per requested id (a new array unless in order)."""
        inv = self.inverse
        return rows if inv is None else np.take(rows, inv, axis=0)

    def combine(self, rows: np.ndarray, ufunc: np.ufunc | None) -> np.ndarray:
        """Rows per requested id → rows per distinct id: repeats merged with ``ufunc``
        (``np.add``, ``np.multiply``, ...), or the last one kept when ``ufunc`` is None."""
        order = self._order
        if order is None:
            return rows
        first = self._first
        if first is None:  # distinct: only the order changes
            return np.take(rows, order, axis=0)
        if ufunc is None:  # the last of each run of equal ids (the sort is stable)
            last = np.empty_like(first)
            last[-1] = True
            last[:-1] = first[1:]
            return np.take(rows, order[last], axis=0)  # type: ignore[no-any-return]
        # first rows copied, the few repeats merged in (much faster than np.add.at or
        # np.add.reduceat over all rows when repeats are rare)
        out = np.take(rows, order[first], axis=0)
        repeat = ~first
        assert self._group is not None  # set with first
        ufunc.at(out, self._group[repeat], np.take(rows, order[repeat], axis=0))
        return out  # type: ignore[no-any-return]


#: The last plan made in this thread, with a private copy of its ids: a training step
#: gathers rows and then sends gradients for the same ids, and the second routing is free.
_last_plan = threading.local()


def _plan(flat: np.ndarray, offsets: list[int]) -> _Plan:
    """``_Plan(flat, offsets)``, reused when this thread routed equal ids last time."""
    cached = getattr(_last_plan, "value", None)
    if cached is not None:
        ids, offs, plan = cached
        if offs == offsets and ids.shape == flat.shape and np.array_equal(ids, flat):
            return plan  # type: ignore[no-any-return]
    ids = flat.copy()  # the plan may keep views of it: never of the caller's array
    plan = _Plan(ids, offsets)
    _last_plan.value = (ids, list(offsets), plan)
    return plan


#: How :meth:`_Plan.combine` merges the rows of a repeated id, per scatter kind.
_COMBINE = {"add": np.add, "sub": np.add, "update": None, "mul": np.multiply,
            "div": np.multiply, "max": np.maximum, "min": np.minimum}


def _gather(name: str, variables: list[Variable], offsets: list[int], shape: tuple[int, ...],
            dtype: np.dtype[Any], ids: Any, client: Client | None, uid: str | None) -> np.ndarray:
    flat, ids_shape = _flat_ids(ids, offsets[-1] if shape else 0, name)
    row_shape = tuple(shape[1:])
    plan = _plan(flat, offsets)
    if variables[0]._local is not None:
        rows = np.empty((plan.uniq.size, *row_shape), dtype=dtype)
        for s, a, b, local in plan.parts:
            rows[a:b] = variables[s].read_value()[local]
    else:
        groups = _by_server(variables, plan.parts)
        calls = [_gather_call(variables, address, group) for address, group in groups]
        replies = _routing.call_many(calls, client, uid)
        want = (plan.uniq.size, *row_shape)
        if len(replies) == 1 and replies[0]["value"].shape == want \
                and replies[0]["value"].dtype == dtype:
            rows = replies[0]["value"]  # a fresh array, ours (no copy), in plan order
        else:
            rows = np.empty(want, dtype=dtype)
            for (_, group), reply in zip(groups, replies, strict=True):
                value, k = reply["value"], 0
                for _, a, b, _ in group:
                    rows[a:b] = value[k:k + b - a]
                    k += b - a
    return plan.expand(rows).reshape(ids_shape + row_shape)


#: ``(shard index, start, stop, shard-local ids)``: one shard's part of a plan.
_Part = tuple[int, int, int, np.ndarray]


def _by_server(variables: list[Variable], parts: list[_Part]) -> list[tuple[str, list[_Part]]]:
    """``parts`` grouped by parameter server (in order): one request per server, not per
    shard (unless the runner sends each shard's request alone: ``ps.coalesce-bytes: 0``)."""
    if not _routing.coalescing():
        return [(_ps_address(variables[p[0]]._address), [p]) for p in parts]
    groups: dict[str, list[_Part]] = {}
    for part in parts:
        groups.setdefault(_ps_address(variables[part[0]]._address), []).append(part)
    return list(groups.items())


def _gather_call(variables: list[Variable], address: str, group: list[_Part]) -> Call:
    if len(group) == 1:
        s, _, _, local = group[0]
        return Call(address, "ps_gather", {"key": variables[s]._key, "ids": wire(local)})
    return Call(address, "ps_gather_parts", {
        "keys": [variables[s]._key for s, _, _, _ in group],
        "counts": [b - a for _, a, b, _ in group],
        "ids": wire(np.concatenate([local for _, _, _, local in group]))})


def _scatter(name: str, variables: list[Variable], offsets: list[int], shape: tuple[int, ...],
             dtype: np.dtype[Any], kind: str, ids: Any, updates: Any, client: Client | None,
             uid: str | None) -> None:
    if updates is None:
        if not isinstance(ids, IndexedSlices):
            raise TypeError("scatter_* takes (ids, updates) or one IndexedSlices")
        ids, updates = ids.indices, ids.values
    flat, _ = _flat_ids(ids, offsets[-1] if shape else 0, name)
    row_shape = tuple(shape[1:])
    upd = _kernels.cast_value(updates, dtype, f"scatter_{kind} to variable {name!r}")
    try:
        upd = np.broadcast_to(upd, (flat.size, *row_shape))
    except ValueError:
        raise ValueError(f"updates of shape {np.shape(updates)} do not fit {flat.size} rows of "
                         f"variable {name!r} (row shape {row_shape})") from None
    plan = _plan(flat, offsets)
    rows = plan.combine(upd, _COMBINE[kind])  # each shard gets sorted distinct ids
    if variables[0]._local is not None:
        for s, a, b, local in plan.parts:
            v = variables[s]
            assert v._lock is not None and v._local is not None
            with v._lock:
                _kernels.scatter_rows(v._local, kind, local, rows[a:b])
        return
    tag = _routing.tag()
    calls = [Call(_ps_address(variables[s]._address), "ps_scatter",
                  {"key": variables[s]._key, "kind": kind, "ids": wire(local),
                   "updates": wire(rows[a:b]), **tag})
             for s, a, b, local in plan.parts]
    _routing.send_updates(calls, client, rows.nbytes, uid)


def apply_gradients(config: dict[str, Any], grads_and_vars: list[Any]) -> None:
    """Send optimizer updates for ``[(grad, variable)]`` (see Optimizer.apply_gradients)."""
    calls = []
    client = uid = None
    nbytes = 0
    for grad, var in grads_and_vars:
        if grad is None:
            continue
        shards, offsets = var._parts()
        if shards[0]._local is not None:
            raise ValueError(f"variable {var.name!r} is not on a parameter server (create it in "
                             "strategy.scope() to use a server-side optimizer)")
        client, uid = client or shards[0]._client, uid or shards[0]._owner
        tag = _routing.tag()
        if isinstance(grad, IndexedSlices):
            flat, _ = _flat_ids(grad.indices, offsets[-1], var.name)
            values = _kernels.cast_value(grad.values, var.dtype,
                                         f"the gradient of variable {var.name!r}")
            try:
                rows = np.broadcast_to(values, (flat.size, *var.shape[1:]))
            except ValueError:
                raise ShapeMismatchError(
                    f"an IndexedSlices gradient with values of shape {values.shape} does not "
                    f"fit {flat.size} rows of variable {var.name!r} of shape {var.shape} (its "
                    f"values need shape {(flat.size, *var.shape[1:])})") from None
            plan = _plan(flat, offsets)
            summed = plan.combine(rows, np.add)  # duplicate ids: gradients add up
            for address, group in _by_server(shards, plan.parts):
                if len(group) == 1:
                    s, a, b, local = group[0]
                    calls.append(Call(address, "ps_apply", {
                        "key": shards[s]._key, "optimizer": config,
                        "grad": wire(summed[a:b]), "ids": wire(local), **tag}))
                    continue
                calls.append(Call(address, "ps_apply_parts", {
                    "keys": [shards[s]._key for s, _, _, _ in group],
                    "counts": [b - a for _, a, b, _ in group], "optimizer": config,
                    "grad": wire(np.concatenate([summed[a:b] for _, a, b, _ in group])),
                    "ids": wire(np.concatenate([local for _, _, _, local in group])), **tag}))
            nbytes += summed.nbytes
        else:
            g = _kernels.cast_value(grad, var.dtype, f"the gradient of variable {var.name!r}")
            if g.shape != tuple(var.shape):
                raise ShapeMismatchError(f"gradient of shape {g.shape} does not fit variable "
                                         f"{var.name!r} of shape {var.shape}")
            for v, a, b in zip(shards, offsets, offsets[1:], strict=False):
                part = g if len(shards) == 1 else g[a:b]
                calls.append(Call(_ps_address(v._address), "ps_apply", {"key": v._key, "optimizer": config,
                                                           "grad": wire(part), **tag}))
            nbytes += g.nbytes
    _routing.send_updates(calls, client, nbytes, uid)
