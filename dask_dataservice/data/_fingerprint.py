"""Stable fingerprints of pipelines: same definition, same fingerprint, in any process.

A fingerprint hashes the structure of the pipeline (op types and parameters) and, for user
functions, their code (bytecode, constants, names, defaults, closure values, and the values
of the module globals they use), not their identity, so a lambda defined the same way in
two processes fingerprints the same. Arrays hash their dtype, shape and bytes; sets hash
their elements in an order that does not depend on ``PYTHONHASHSEED``. Objects we cannot
take apart fall back to their cloudpickle bytes (stable for most plain objects).
"""

from __future__ import annotations

import hashlib
import types
from typing import Any

import numpy as np

from ._base import Op


def _feed(h: hashlib.blake2b, obj: Any, seen: set[int], depth: int = 0) -> None:
    if depth > 50:
        h.update(b"<deep>")
        return
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
        h.update(type(obj).__name__.encode())
        h.update(repr(obj).encode())
        return
    if isinstance(obj, Op):
        h.update(b"op:" + type(obj).__module__.encode() + type(obj).__qualname__.encode())
        for p in obj.params():
            _feed(h, p, seen, depth + 1)
        for child in obj.inputs:
            _feed(h, child, seen, depth + 1)
        return
    if isinstance(obj, np.ndarray):
        h.update(b"nd:" + str(obj.dtype).encode() + repr(obj.shape).encode())
        if obj.dtype == object:
            for x in obj.ravel():
                _feed(h, x, seen, depth + 1)
        else:
            h.update(np.ascontiguousarray(obj).view(np.uint8).data)
        return
    if isinstance(obj, np.generic):
        h.update(b"np:" + str(obj.dtype).encode() + obj.tobytes())
        return
    if isinstance(obj, (tuple, list)):
        h.update(f"{type(obj).__name__}{len(obj)}".encode())
        if obj and all(type(x) is str for x in obj):  # a million paths: the same bytes, at once
            h.update(("str" + "str".join(map(repr, obj))).encode())
            return
        for x in obj:
            _feed(h, x, seen, depth + 1)
        return
    if isinstance(obj, (set, frozenset)):
        # Iteration order of a set of strings changes with the hash seed of the process:
        # hash each element on its own and combine the digests in sorted order.
        digests = []
        for x in obj:
            sub = hashlib.blake2b(digest_size=16)
            _feed(sub, x, seen, depth + 1)
            digests.append(sub.digest())
        h.update(f"{type(obj).__name__}{len(obj)}".encode())
        for d in sorted(digests):
            h.update(d)
        return
    if isinstance(obj, dict):
        h.update(f"dict{len(obj)}".encode())
        for k, v in obj.items():
            _feed(h, k, seen, depth + 1)
            _feed(h, v, seen, depth + 1)
        return
    if isinstance(obj, (types.FunctionType, types.LambdaType)):
        if id(obj) in seen:  # recursion (through closures or globals)
            h.update(b"<rec>")
            return
        seen.add(id(obj))
        try:
            h.update(b"fn:" + (obj.__module__ or "").encode() + obj.__qualname__.encode())
            _feed_code(h, obj.__code__, seen, depth + 1)
            _feed(h, obj.__defaults__, seen, depth + 1)
            _feed(h, obj.__kwdefaults__, seen, depth + 1)
            for cell in obj.__closure__ or ():
                try:
                    _feed(h, cell.cell_contents, seen, depth + 1)
                except ValueError:  # empty cell
                    h.update(b"<empty>")
            _feed_globals(h, obj, seen, depth + 1)
        finally:
            seen.discard(id(obj))
        return
    if isinstance(obj, types.ModuleType):
        h.update(b"module:" + obj.__name__.encode())
        return
    if isinstance(obj, types.CodeType):
        _feed_code(h, obj, seen, depth + 1)
        return
    if isinstance(obj, (types.BuiltinFunctionType, type)):
        h.update(b"ref:" + f"{getattr(obj, '__module__', '')}.{obj.__qualname__}".encode())
        return
    if isinstance(obj, types.MethodType):
        _feed(h, obj.__func__, seen, depth + 1)
        _feed(h, obj.__self__, seen, depth + 1)
        return
    if hasattr(obj, "_op") and isinstance(obj._op, Op):  # a Dataset
        _feed(h, obj._op, seen, depth + 1)
        return
    import cloudpickle

    try:
        h.update(b"pkl:" + cloudpickle.dumps(obj))
    except Exception:  # noqa: BLE001 - unpicklable: identity is all we have
        h.update(b"id:" + type(obj).__qualname__.encode() + repr(id(obj)).encode())


def _global_names(code: types.CodeType) -> list[str]:
    names = list(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names.extend(_global_names(c))
    return names


_PLAIN = (type(None), bool, int, float, complex, str, bytes, np.generic)
_CONTAINERS = (tuple, list, dict, set, frozenset)
_CODE_LIKE = (types.FunctionType, types.ModuleType, types.BuiltinFunctionType, type, Op)


def _is_plain_data(x: Any, depth: int = 0) -> bool:
    """Scalars, strings, numeric arrays and containers of them (nothing process-specific)."""
    if depth > 20:
        return False
    if isinstance(x, _PLAIN):
        return True
    if isinstance(x, np.ndarray):
        return bool(x.dtype != object)
    if isinstance(x, dict):
        return all(_is_plain_data(k, depth + 1) and _is_plain_data(v, depth + 1)
                   for k, v in x.items())
    if isinstance(x, _CONTAINERS):
        return all(_is_plain_data(v, depth + 1) for v in x)
    return False


def _feed_globals(h: hashlib.blake2b, fn: types.FunctionType, seen: set[int], depth: int) -> None:
    """The module globals ``fn`` reads (a constant, a table, a helper function).

    Plain data, functions, modules, classes and datasets are hashed by value; any other
    global (a client, a lock, a cache of objects) by its type only, so that it cannot make the
    fingerprint depend on the process.
    """
    g = fn.__globals__
    for name in sorted(set(_global_names(fn.__code__))):
        if name not in g:
            continue  # an attribute name, a builtin, or not defined yet
        value = g[name]
        h.update(b"global:" + name.encode())
        if (isinstance(value, _CODE_LIKE) or _is_plain_data(value)
                or (hasattr(value, "_op") and isinstance(value._op, Op))):
            _feed(h, value, seen, depth + 1)
        else:
            h.update(b"type:" + type(value).__module__.encode() + type(value).__qualname__.encode())


def _feed_code(h: hashlib.blake2b, code: types.CodeType, seen: set[int], depth: int) -> None:
    h.update(b"code:" + code.co_code)
    h.update(repr((code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount,
                   code.co_flags)).encode())
    h.update(repr(code.co_names).encode() + repr(code.co_varnames).encode())
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _feed_code(h, c, seen, depth + 1)
        else:
            _feed(h, c, seen, depth + 1)


def fingerprint(op: Op) -> str:
    """A hex digest identifying the pipeline rooted at ``op``."""
    h = hashlib.blake2b(digest_size=16)
    _feed(h, op, set())
    return h.hexdigest()
