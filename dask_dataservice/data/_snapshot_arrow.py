"""Snapshot chunks in open formats: a list of elements <-> one Arrow table.

Theory of operation
-------------------
The elements of a chunk share one *structure* (tuples, namedtuples and dicts with ``str`` or
``int`` keys, as in :mod:`dask_dataservice.data.structure`); each leaf position is one column,
named by its path (``"x"``, ``"0"``, ``"features.image"``; ``"value"`` for an element that is a
single leaf), one row per element, in the order the writer produced them. A column's Arrow
type follows its leaves:

============================================  =================================================
leaves of the column                          Arrow type (``layout`` in the metadata)
============================================  =================================================
Python ``bool``/``int``/``float``/``str``/    ``bool`` / ``int64`` / ``double`` / ``string`` /
``bytes``; numpy scalars                      ``binary``; the numpy type (``scalar``)
arrays of one shape, 0-d                      the numpy type (``fixed``)
arrays of one shape ``(a, b, ...)``           nested ``fixed_size_list``: ``[[T; b]; a]``, the
                                              shape in the type (``fixed_list``)
1-d arrays whose length varies                ``list<T>`` (``list``)
n-d arrays whose shape varies                 ``struct<data: list<T>, shape:
                                              fixed_size_list<int64>[n]>``, data row-major
                                              (``shaped_list``)
============================================  =================================================

Nested fixed-size lists rather than pyarrow's ``arrow.fixed_shape_tensor`` extension type:
``dask.dataframe.read_parquet`` fails on that type (pyarrow cannot build its empty table) and
pandas flattens it to 1-d; nested lists keep the shape in the schema for every reader (polars
reads them as ``Array`` of that shape, pandas as nested arrays).

The schema's metadata key ``dask_dataservice`` holds a JSON document: the chunk format's name
and version, the number of elements and the structure, whose leaves give each column's numpy
dtype (byte order and string length included), shape (``null`` where it varies) and layout.
That is all a reader needs to rebuild the elements exactly (dtype, shape, Python vs numpy
scalars, namedtuples, key order), and all a reader without this package needs to understand the
columns. What does not fit (other leaf types such as lists, ``None`` or objects, complex or
object dtypes, other dict keys, elements of different structures or dtypes in one chunk) raises
:class:`Unrepresentable`, and the writer falls back to a pickled chunk or reports it.

An Arrow IPC chunk also carries the CRC-32 of its record batch messages (all its data) in the
schema metadata (``dask_dataservice.crc32``); a Parquet chunk has Parquet's own CRC-32 on every
page. pyarrow is imported only here, by the functions that need it.
"""

from __future__ import annotations

import collections
import json
import struct
import sys
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import SnapshotCorruptedError
from .formats import optional_import

__all__ = ["Unrepresentable", "encode_table", "decode_table", "write_arrow", "read_arrow",
           "write_parquet", "read_parquet", "num_elements", "element_spec_json", "META_KEY",
           "CHUNK_FORMAT"]

#: The schema metadata key holding the chunk's JSON description.
META_KEY = b"dask_dataservice"
#: Schema metadata key of an Arrow IPC chunk: CRC-32 (8 hex digits) of its record batch messages.
CRC_KEY = b"dask_dataservice.crc32"
CHUNK_FORMAT = "dask-dataservice-snapshot-chunk"
CHUNK_VERSION = 1
_PLACEHOLDER = b"\x01\x02crc32\x03"  # 8 bytes, patched with the CRC once it is known
_TIME_UNITS = ("s", "ms", "us", "ns")
_PY_KINDS = {bool: "bool", int: "int", float: "float", str: "str", bytes: "bytes"}


class Unrepresentable(TypeError):
    """The elements cannot be stored as an Arrow table (the message says which part)."""


def _pa() -> Any:
    return optional_import("pyarrow", "parquet", "a snapshot in Arrow or Parquet format")


# -- structure -------------------------------------------------------------------------------------


def _template(x: Any, path: tuple[str, ...], leaves: list[dict[str, Any]]) -> dict[str, Any]:
    t = type(x)
    if t is dict:
        items = []
        for k, v in x.items():
            if type(k) not in (str, int):
                raise Unrepresentable(f"a dict key {k!r:.40} of type {type(k).__name__} "
                                      "(keys must be str or int)")
            items.append(_template(v, (*path, str(k)), leaves))
        return {"type": "dict", "keys": list(x), "items": items}
    if t is tuple:
        return {"type": "tuple",
                "items": [_template(v, (*path, str(i)), leaves) for i, v in enumerate(x)]}
    if isinstance(x, tuple) and hasattr(t, "_fields"):
        return {"type": "namedtuple", "name": t.__qualname__, "module": t.__module__,
                "fields": list(t._fields),
                "items": [_template(v, (*path, f), leaves) for f, v in zip(t._fields, x, strict=True)]}
    if isinstance(x, (dict, tuple)):
        raise Unrepresentable(f"a {t.__name__} (a subclass of dict or tuple)")
    leaf: dict[str, Any] = {"type": "leaf", "column": ".".join(path) if path else "value"}
    leaves.append(leaf)
    return leaf


def _flattener(tpl: dict[str, Any], first: Any) -> Callable[[Any, list[list[Any]]], None]:
    """A function appending an element's leaves to the column lists (checks the structure)."""
    kind = tpl["type"]
    if kind == "leaf":
        i = tpl["index"]

        def leaf(x: Any, out: list[list[Any]]) -> None:
            out[i].append(x)
        return leaf
    if kind == "dict":
        keys = tpl["keys"]
        pairs = [(k, _flattener(s, first[k])) for k, s in zip(keys, tpl["items"], strict=True)]
        if all(s["type"] == "leaf" for s in tpl["items"]):  # the common case, without calls
            direct = [(k, s["index"]) for k, s in zip(keys, tpl["items"], strict=True)]

            def flat_dict(x: Any, out: list[list[Any]]) -> None:
                if type(x) is not dict or list(x) != keys:
                    raise Unrepresentable(f"elements of different structures in one chunk (keys "
                                          f"{keys!r:.60} and {type(x).__name__} {x!r:.60})")
                for k, i in direct:
                    out[i].append(x[k])
            return flat_dict

        def dict_(x: Any, out: list[list[Any]]) -> None:
            if type(x) is not dict or list(x) != keys:
                raise Unrepresentable(f"elements of different structures in one chunk (keys "
                                      f"{keys!r:.60} and {type(x).__name__} {x!r:.60})")
            for k, f in pairs:
                f(x[k], out)
        return dict_
    cls = type(first)
    subs = [_flattener(s, v) for s, v in zip(tpl["items"], first, strict=True)]
    n = len(subs)

    def tuple_(x: Any, out: list[list[Any]]) -> None:
        if type(x) is not cls or len(x) != n:
            raise Unrepresentable(f"elements of different structures in one chunk (a "
                                  f"{cls.__name__} of {n} and {type(x).__name__} {x!r:.60})")
        for f, v in zip(subs, x, strict=True):
            f(v, out)
    return tuple_


def _namedtuple_class(tpl: dict[str, Any]) -> Any:
    """The writer's namedtuple class if this process has imported it, else an equivalent one.

    Only modules already in ``sys.modules`` are looked at: loading a chunk imports nothing.
    """
    obj: Any = sys.modules.get(tpl["module"])
    for part in tpl["name"].split("."):
        obj = getattr(obj, part, None)
    fields = list(tpl["fields"])
    if isinstance(obj, type) and issubclass(obj, tuple) and list(getattr(obj, "_fields", ())) == fields:
        return obj
    name = tpl["name"].rsplit(".", 1)[-1]
    return collections.namedtuple(name if name.isidentifier() else "Element", fields)


def _builder(tpl: dict[str, Any]) -> Callable[[tuple[Any, ...]], Any]:
    kind = tpl["type"]
    if kind == "leaf":
        i = tpl["index"]
        return lambda row: row[i]
    subs = [_builder(s) for s in tpl["items"]]
    if kind == "dict":
        pairs = list(zip(tpl["keys"], subs, strict=True))
        return lambda row: {k: f(row) for k, f in pairs}
    if kind == "tuple":
        return lambda row: tuple(f(row) for f in subs)
    cls = _namedtuple_class(tpl)
    return lambda row: cls(*(f(row) for f in subs))


# -- columns ---------------------------------------------------------------------------------------


def _check_dtype(dtype: np.dtype) -> None:
    kind = dtype.kind
    ok = (kind in "biuUS" or (kind == "f" and dtype.itemsize in (2, 4, 8))
          or (kind in "Mm" and np.datetime_data(dtype)[0] in _TIME_UNITS
              and np.datetime_data(dtype)[1] == 1))
    if not ok:
        raise Unrepresentable(f"numpy dtype {dtype} (Arrow has no type for it)")


def _native(a: np.ndarray) -> np.ndarray:
    return a if a.dtype.isnative or a.dtype.itemsize == 1 else a.astype(a.dtype.newbyteorder("="))


def _prim(pa: Any, a: np.ndarray) -> Any:
    return pa.array(_native(np.ascontiguousarray(a)))


def _encode_column(pa: Any, leaf: dict[str, Any], values: list[Any]) -> Any:
    """The Arrow array of one leaf position; fills ``leaf`` with its dtype, shape and layout."""
    types = set(map(type, values))
    if len(types) != 1:
        raise Unrepresentable(f"column {leaf['column']!r}: leaves of different types "
                              f"{sorted(t.__name__ for t in types)}")
    (t,) = types
    if t in _PY_KINDS:
        kind = _PY_KINDS[t]
        leaf.update(kind=kind, shape=[], layout="scalar")
        arrow_type = {"bool": pa.bool_(), "int": pa.int64(), "float": pa.float64(),
                      "str": pa.string(), "bytes": pa.binary()}[kind]
        try:
            return pa.array(values, arrow_type)
        except (OverflowError, UnicodeError, pa.ArrowException) as e:
            raise Unrepresentable(f"column {leaf['column']!r}: {e}") from None
    if issubclass(t, np.generic):
        if t in (np.str_, np.bytes_):  # the dtype's length is the value's own
            leaf.update(kind="numpy_scalar", dtype=np.dtype(t).char, shape=[], layout="scalar")
            return pa.array(values, pa.string() if t is np.str_ else pa.binary())
        dtypes = {v.dtype for v in values}  # a datetime64's unit is in the value, not the type
        if len(dtypes) != 1:
            raise Unrepresentable(f"column {leaf['column']!r}: scalars of different dtypes "
                                  f"{sorted(map(str, dtypes))}")
        (dtype,) = dtypes
        _check_dtype(dtype)
        leaf.update(kind="numpy_scalar", dtype=dtype.str, shape=[], layout="scalar")
        return _prim(pa, np.array(values, dtype=dtype))
    if t is not np.ndarray:
        raise Unrepresentable(f"column {leaf['column']!r}: a leaf of type {t.__name__}")
    dtypes = {v.dtype for v in values}
    if len(dtypes) != 1:
        raise Unrepresentable(f"column {leaf['column']!r}: arrays of different dtypes "
                              f"{sorted(map(str, dtypes))}")
    (dtype,) = dtypes
    _check_dtype(dtype)
    shapes = {v.shape for v in values}
    ndim = {len(s) for s in shapes}
    if len(ndim) != 1:
        raise Unrepresentable(f"column {leaf['column']!r}: arrays of different ranks {sorted(ndim)}")
    (rank,) = ndim
    leaf.update(kind="array", dtype=dtype.str)
    if len(shapes) == 1:
        (shape,) = shapes
        size = int(np.prod(shape))
        if rank == 0 or size > 0:
            stacked = np.stack(values)
            leaf["shape"] = list(shape)
            if rank == 0:
                leaf["layout"] = "fixed"
                return _prim(pa, stacked)
            leaf["layout"] = "fixed_list"
            arr = _prim(pa, stacked.reshape(-1))
            for d in reversed(shape):  # the shape is in the type: (2, 3) is [[T; 3]; 2]
                arr = pa.FixedSizeListArray.from_arrays(arr, d)
            return arr
    dims = np.array([s for s in shapes])
    leaf["shape"] = [int(d[0]) if (d == d[0]).all() else None for d in dims.T]
    sizes = np.fromiter((v.size for v in values), np.int64, len(values))
    offsets = np.zeros(len(values) + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    flat = _prim(pa, np.concatenate([v.reshape(-1) for v in values]))
    big = offsets[-1] >= 2**31
    cls = pa.LargeListArray if big else pa.ListArray
    data = cls.from_arrays(pa.array(offsets if big else offsets.astype(np.int32)), flat)
    if rank == 1:
        leaf["layout"] = "list"
        return data
    leaf["layout"] = "shaped_list"
    shape_arr = pa.FixedSizeListArray.from_arrays(
        pa.array(np.array([v.shape for v in values], np.int64).reshape(-1)), rank)
    return pa.StructArray.from_arrays([data, shape_arr], names=["data", "shape"])


#: Elements at least this large (bytes, on average) are copied out of the chunk one by one:
#: allocations of their own size reuse the allocator's pages, where one copy of a 64 MiB
#: column takes fresh pages (a page fault every 4 KiB) each time.
_PER_ELEMENT_COPY = 1 << 16


def _to_numpy(a: Any, dtype: np.dtype) -> np.ndarray:
    """An Arrow array's values in exactly ``dtype``: a read-only view where Arrow allows it."""
    if dtype.kind in "US":
        return np.array(a.to_pylist(), dtype=dtype)
    values: np.ndarray = a.to_numpy(zero_copy_only=False)
    return values if values.dtype == dtype else values.astype(dtype)


def _owned(values: np.ndarray, pieces: Callable[[np.ndarray], list[np.ndarray]], n: int) -> list[np.ndarray]:
    """Writable elements (``pieces`` cuts them out of ``values``), copied once in all."""
    if values.flags.writeable:
        return pieces(values)
    if values.nbytes >= n * _PER_ELEMENT_COPY:
        return [np.array(x) for x in pieces(values)]
    return pieces(np.array(values))


def _decode_column(a: Any, leaf: dict[str, Any], n: int) -> list[Any]:
    kind, layout = leaf["kind"], leaf["layout"]
    if kind in _PY_KINDS.values():
        return a.to_pylist()  # type: ignore[no-any-return]
    if kind == "numpy_scalar":
        if leaf["dtype"] in ("U", "S"):
            cls = np.str_ if leaf["dtype"] == "U" else np.bytes_
            return [cls(v) for v in a.to_pylist()]
        return list(_to_numpy(a, np.dtype(leaf["dtype"])))
    dtype = np.dtype(leaf["dtype"])
    if layout == "fixed":
        return _owned(_to_numpy(a, dtype), lambda v: [v[i, ...] for i in range(n)], n)
    if layout == "fixed_list":
        shape = leaf["shape"]
        for _ in shape:
            a = a.flatten()
        return _owned(_to_numpy(a, dtype), lambda v: list(v.reshape(n, *shape)), n)
    if layout == "list":
        data, shapes = a, None
    else:
        data, shape_arr = a.flatten()
        shapes = shape_arr.flatten().to_numpy().reshape(n, -1).tolist()
    offsets = data.offsets.to_numpy()
    o = (offsets - offsets[0]).tolist()
    if shapes is None:
        return _owned(_to_numpy(data.flatten(), dtype),
                      lambda v: [v[o[i]:o[i + 1]] for i in range(n)], n)
    return _owned(_to_numpy(data.flatten(), dtype),
                  lambda v: [v[o[i]:o[i + 1]].reshape(shapes[i]) for i in range(n)], n)


# -- tables ----------------------------------------------------------------------------------------


def encode_table(elements: list[Any]) -> tuple[Any, dict[str, Any]]:
    """The Arrow table of ``elements`` and its metadata (raises :class:`Unrepresentable`)."""
    pa = _pa()
    if not elements:
        raise Unrepresentable("no elements")
    leaves: list[dict[str, Any]] = []
    structure = _template(elements[0], (), leaves)
    if not leaves:
        raise Unrepresentable("elements without leaves (an empty tuple or dict)")
    names: set[str] = set()
    for i, leaf in enumerate(leaves):
        leaf["index"] = i
        name = leaf["column"]
        while name in names:  # {"a.b": x, "a": {"b": y}}: keep every column
            name += "_"
        leaf["column"] = name
        names.add(name)
    columns: list[list[Any]] = [[] for _ in leaves]
    flatten = _flattener(structure, elements[0])
    for x in elements:
        flatten(x, columns)
    arrays = [_encode_column(pa, leaf, values) for leaf, values in zip(leaves, columns, strict=True)]
    meta = {"format": CHUNK_FORMAT, "version": CHUNK_VERSION, "num_elements": len(elements),
            "structure": structure}
    schema = pa.schema([pa.field(leaf["column"], arr.type) for leaf, arr in zip(leaves, arrays, strict=True)],
                       metadata={META_KEY: json.dumps(meta, separators=(",", ":"))})
    return pa.Table.from_arrays(arrays, schema=schema), meta


def _leaves(tpl: dict[str, Any]) -> list[dict[str, Any]]:
    if tpl["type"] == "leaf":
        return [tpl]
    return [leaf for s in tpl["items"] for leaf in _leaves(s)]


def chunk_meta(schema_metadata: dict[bytes, bytes] | None, where: str) -> dict[str, Any]:
    try:
        meta = json.loads((schema_metadata or {})[META_KEY])
    except (KeyError, ValueError):
        raise SnapshotCorruptedError(f"{where}: no dask_dataservice metadata in the schema "
                                     "(not a snapshot chunk)") from None
    if not isinstance(meta, dict) or meta.get("format") != CHUNK_FORMAT:
        raise SnapshotCorruptedError(f"{where}: not a dask-dataservice snapshot chunk")
    if meta.get("version") != CHUNK_VERSION:
        raise SnapshotCorruptedError(
            f"{where}: chunk format version {meta.get('version')!r}; this dask-dataservice reads "
            f"version {CHUNK_VERSION} (upgrade it to read this snapshot)")
    return meta


def _one_array(column: Any) -> Any:
    """A column as one array (combine_chunks copies even a single chunk)."""
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


def decode_table(table: Any, where: str) -> list[Any]:
    """The elements of a table written by :func:`encode_table`, exactly as they were."""
    meta = chunk_meta(table.schema.metadata, where)
    n = meta["num_elements"]
    if table.num_rows != n:
        raise SnapshotCorruptedError(f"{where}: holds {table.num_rows} elements, its metadata "
                                     f"says {n}")
    structure = meta["structure"]
    leaves = _leaves(structure)
    try:
        columns = [_decode_column(_one_array(table.column(leaf["column"])), leaf, n)
                   for leaf in leaves]
    except (KeyError, ValueError, TypeError, IndexError) as e:
        raise SnapshotCorruptedError(f"{where}: columns do not match the metadata ({e})") from None
    kind = structure["type"]
    if kind == "leaf":
        return columns[0]
    if kind == "dict" and all(s["type"] == "leaf" for s in structure["items"]):
        keys = structure["keys"]
        return [dict(zip(keys, row, strict=True)) for row in zip(*columns, strict=True)]
    if kind == "tuple" and all(s["type"] == "leaf" for s in structure["items"]):
        return list(zip(*columns, strict=True))
    build = _builder(structure)
    return [build(row) for row in zip(*columns, strict=True)]


def element_spec_json(meta: dict[str, Any]) -> dict[str, Any]:
    """The structure of a chunk's metadata without the column bookkeeping (for the manifest)."""
    def strip(tpl: dict[str, Any]) -> dict[str, Any]:
        if tpl["type"] == "leaf":
            return {k: tpl[k] for k in ("type", "column", "kind", "dtype", "shape", "layout") if k in tpl}
        return {**tpl, "items": [strip(s) for s in tpl["items"]]}
    return strip(meta["structure"])


# -- files -----------------------------------------------------------------------------------------

#: ``compression`` of distributed_save -> (Arrow IPC codec, Parquet codec)
CODECS: dict[str | None, tuple[str | None, str]] = {
    None: (None, "none"), "AUTO": (None, "none"), "LZ4": ("lz4", "lz4"),
    "ZSTD": ("zstd", "zstd"), "GZIP": ("zstd", "gzip"), "SNAPPY": ("lz4", "snappy"),
}


def write_arrow(table: Any, compression: str | None) -> list[Any]:
    """An Arrow IPC file (Feather v2) of ``table``, with the CRC-32 of its record batches.

    The CRC goes in the schema's metadata (key ``dask_dataservice.crc32``), which the file holds
    twice: in the schema message at its start and in its footer. Both are written with an
    8-byte placeholder and patched once the CRC of the bytes between them (every record batch
    message: all the data) is known; works with every pyarrow (no footer metadata needed).
    Returns the file as pieces to write in order (the data is not copied again).
    """
    pa = _pa()
    options = pa.ipc.IpcWriteOptions(compression=CODECS[compression][0])
    schema = table.schema.with_metadata({**(table.schema.metadata or {}), CRC_KEY: _PLACEHOLDER})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema, options=options) as writer:
        writer.write_table(table.replace_schema_metadata(schema.metadata))
    data = memoryview(sink.getvalue())
    begin, end = _data_region(data, "the chunk being written")
    crc = b"%08x" % zlib.crc32(data[begin:end])
    pieces: list[Any] = []
    for lo, hi in ((0, begin), (end, len(data))):
        part = bytearray(data[lo:hi])  # the schema message or the footer: small
        where = part.find(_PLACEHOLDER)
        if where < 0 or part.find(_PLACEHOLDER, where + 1) >= 0:
            raise RuntimeError("an Arrow schema does not hold the CRC placeholder exactly once")
        part[where:where + len(_PLACEHOLDER)] = crc
        pieces.append(part)
    return [pieces[0], data[begin:end], pieces[1]]


def _data_region(data: Any, where: str) -> tuple[int, int]:
    """Where an Arrow IPC file's record batches are: after the schema message, before the footer."""
    if len(data) < 26 or data[:6] != b"ARROW1" or data[-6:] != b"ARROW1":
        raise SnapshotCorruptedError(f"{where}: not an Arrow IPC file (bad magic; cut short?)")
    marker, schema_len = struct.unpack_from("<Ii", data, 8)  # continuation, then metadata size
    (footer,) = struct.unpack_from("<i", data, len(data) - 10)
    begin, end = 16 + schema_len, len(data) - 10 - footer
    if marker != 0xFFFFFFFF or schema_len <= 0 or footer <= 0 or not 16 < begin <= end:
        raise SnapshotCorruptedError(f"{where}: the Arrow schema ({schema_len} bytes) and footer "
                                     f"({footer} bytes) do not fit the file ({len(data)} bytes)")
    return begin, end


def read_arrow(data: bytes, where: str) -> Any:
    """The table of an Arrow IPC chunk, its CRC checked (SnapshotCorruptedError if damaged)."""
    pa = _pa()
    begin, end = _data_region(data, where)
    try:
        reader = pa.ipc.open_file(pa.py_buffer(data))
        crc = (reader.schema.metadata or {}).get(CRC_KEY)
    except (pa.ArrowException, OSError) as e:
        raise SnapshotCorruptedError(f"{where}: unreadable Arrow IPC file ({e})") from None
    if crc is None:
        raise SnapshotCorruptedError(f"{where}: no checksum in the Arrow schema (not a snapshot chunk)")
    if crc != b"%08x" % zlib.crc32(memoryview(data)[begin:end]):
        raise SnapshotCorruptedError(f"{where}: checksum mismatch (the chunk is damaged)")
    try:
        return reader.read_all()
    except (pa.ArrowException, OSError) as e:
        raise SnapshotCorruptedError(f"{where}: unreadable Arrow IPC file ({e})") from None


def write_parquet(table: Any, compression: str | None) -> list[Any]:
    """A Parquet file of ``table``: one row group, a CRC-32 on every page."""
    pa = _pa()
    pq = optional_import("pyarrow.parquet", "parquet", "a snapshot in Parquet format")
    text = [f.name for f in table.schema if pa.types.is_string(f.type) or pa.types.is_binary(f.type)]
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression=CODECS[compression][1], use_dictionary=text,
                   write_statistics=False, write_page_checksum=True,
                   row_group_size=max(1, table.num_rows))
    return [memoryview(sink.getvalue())]


def read_parquet(data: bytes, where: str) -> Any:
    """The table of a Parquet chunk, its page checksums checked."""
    pa = _pa()
    pq = optional_import("pyarrow.parquet", "parquet", "a snapshot in Parquet format")
    if len(data) < 12 or data[:4] != b"PAR1" or data[-4:] != b"PAR1":
        raise SnapshotCorruptedError(f"{where}: not a Parquet file (bad magic; cut short?)")
    try:
        return pq.read_table(pa.BufferReader(data), page_checksum_verification=True)
    except (pa.ArrowException, OSError) as e:
        raise SnapshotCorruptedError(f"{where}: unreadable Parquet file ({e})") from None


def num_elements(f: Any, fmt: str, where: str) -> int:
    """The number of elements of an Arrow or Parquet chunk, from its schema alone."""
    pa = _pa()
    try:
        if fmt == "parquet":
            pq = optional_import("pyarrow.parquet", "parquet", "a snapshot in Parquet format")
            schema = pq.ParquetFile(f).schema_arrow
        else:
            schema = pa.ipc.open_file(f).schema
    except (pa.ArrowException, OSError) as e:
        raise SnapshotCorruptedError(f"{where}: unreadable {fmt} file ({e})") from None
    return int(chunk_meta(schema.metadata, where)["num_elements"])
