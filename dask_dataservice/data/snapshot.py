"""Snapshots: ``distributed_save`` writes a dataset to a directory, ``Dataset.load`` reads it.

Theory of operation
-------------------
``distributed_save(dataset, path, service)`` registers ``dataset`` with one stage added on
top, :class:`WriteChunks`, and reads that pipeline through the data service with DYNAMIC
sharding. Each data worker therefore runs the user's pipeline on the splits the dispatcher
hands it (every split once, all workers in parallel) and, in the same pipeline thread, cuts its
elements into *chunks* that it writes itself, straight to ``path`` (any fsspec URL). The
elements never travel to the client: what the job yields is one small descriptor per committed
chunk, and the client (the job's only consumer) only writes the manifest. This reuses the
service's split hand-out, worker liveness, job tokens and cleanup unchanged, instead of a
second task protocol beside it; the price is that a save is a job of the consumer that
started it (it stops when that process dies).

Layout of a snapshot directory::

    path/snapshot.json               the manifest (JSON: format, version, state running | done |
                                     failed; when done the chunks, their element counts and the
                                     element structure)
    path/chunks/<stream>-<n>.arrow   committed chunks (one stream per worker task): Arrow IPC
    path/chunks/<stream>-<n>.parquet files (Feather v2, the default) or Parquet files, one row
    path/chunks/<stream>-<n>.chunk   per element; or pickles (``format="pickle"``, the fallback)

Chunk formats
-------------
Arrow IPC and Parquet chunks hold one column per leaf of the elements' structure (see
:mod:`dask_dataservice.data._snapshot_arrow` for the types and the metadata) and are read by
pyarrow, pandas, polars, DuckDB and, for Parquet, ``dask.dataframe.read_parquet``. Elements
that Arrow cannot represent (arbitrary Python objects) are written as a pickle chunk when the
format is ``"AUTO"``. A pickle runs code when it is loaded, so :class:`LoadSnapshot` reads
pickle chunks only with ``allow_pickle=True`` (as ``numpy.load``): snapshots written before the
open formats (manifest version 1) hold only pickle chunks.

Rules
-----
1. A chunk is *committed* once it is visible under its final name, and it is then complete: a
   local file is written to a hidden temporary name, fsynced and renamed; on an object store
   the chunk is one put of the whole object. A writer killed at any moment leaves committed
   chunks intact and at most a temporary file, which readers ignore.
2. Every chunk is checksummed: a damaged chunk is a :class:`SnapshotCorruptedError` naming the
   file, never wrong elements (an Arrow chunk's schema metadata holds the CRC-32 of its record
   batches; Parquet has a CRC-32 per page; a pickle chunk's header holds its length and CRC-32).
3. Chunks never overlap: DYNAMIC sharding hands each split out once, so the committed chunks of
   a save (finished, failed or killed) hold distinct elements. The final manifest lists every
   committed chunk, also those whose descriptor never reached the client.
4. Element order is not kept across chunks (workers write in parallel, as TensorFlow's
   ``distributed_save``); within a chunk, elements are in the order the worker produced them.

Pickle chunk file: ``b"DDSCHNK1"`` (``b"DDSCHNKZ"`` when compressed), then little-endian ``u64``
payload length, ``u32`` CRC-32 of the payload as stored, ``u32`` number of elements, then the
payload (a pickle of the list of elements; zlib-compressed under the second magic).
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ..errors import SnapshotCorruptedError
from ._base import UNKNOWN, IterContext, Op
from ._fs import is_url, open_file
from .sources import Source
from .structure import nbytes

__all__ = [
    "ChunkSplit",
    "LoadSnapshot",
    "SnapshotCorruptedError",
    "SnapshotSave",
    "WriteChunks",
    "chunk_num_elements",
    "encode_chunk",
    "encode_elements",
    "read_chunk",
    "read_manifest",
]

MAGIC = b"DDSCHNK1"
#: A chunk whose payload is zlib-compressed (``compression="GZIP"``); same header otherwise.
MAGIC_ZLIB = b"DDSCHNKZ"
_HEADER = struct.Struct("<QII")
MANIFEST = "snapshot.json"
CHUNKS = "chunks"
FORMAT = "dask-dataservice-snapshot"
#: The manifest version this code writes (1: pickle chunks only, before the open formats).
VERSION = 2
#: Chunk format -> file name suffix.
SUFFIXES = {"arrow": ".arrow", "parquet": ".parquet", "pickle": ".chunk"}
#: ``format=`` values of distributed_save (``"AUTO"``: Arrow IPC, pickle where Arrow cannot).
FORMATS = ("AUTO", "arrow", "parquet", "pickle")
#: ``compression=`` values of distributed_save.
COMPRESSIONS = ("AUTO", None, "LZ4", "ZSTD", "GZIP", "SNAPPY")


# -- paths and atomic writes ---------------------------------------------------------------------


def _join(path: str, *parts: str) -> str:
    return "/".join([path.rstrip("/"), *parts]) if is_url(path) else os.path.join(path, *parts)


def _fs(path: str) -> Any:
    import fsspec

    return fsspec.get_fs_token_paths(path)[0]


def _write_atomic(path: str, data: bytes | list[Any]) -> None:
    """Make ``path`` hold ``data`` (bytes, or buffers to write in order), all or nothing (see
    rule 1)."""
    pieces = [data] if isinstance(data, bytes) else data
    if not is_url(path):
        head, tail = os.path.split(path)
        tmp = os.path.join(head, f".{tail}.{uuid.uuid4().hex[:8]}.tmp")
        with open(tmp, "wb") as f:
            for piece in pieces:
                f.write(piece)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return
    _fs(path).pipe_file(path, b"".join(pieces))  # one put: an object store shows the whole object or none


def _makedirs(path: str) -> None:
    if is_url(path):
        _fs(path).makedirs(path, exist_ok=True)
    else:
        os.makedirs(path, exist_ok=True)


def _exists(path: str) -> bool:
    return bool(_fs(path).exists(path)) if is_url(path) else os.path.exists(path)


def committed_chunks(path: str) -> list[str]:
    """The names of the committed chunks of the snapshot at ``path``, sorted."""
    where = _join(path, CHUNKS)
    if is_url(where):
        fs = _fs(where)
        names = [p.rsplit("/", 1)[-1] for p in fs.ls(where, detail=False)] if fs.exists(where) else []
    else:
        names = os.listdir(where) if os.path.isdir(where) else []
    return sorted(n for n in names if n.endswith(_SUFFIX_TUPLE) and not n.startswith("."))


_SUFFIX_TUPLE = tuple(SUFFIXES.values())


def chunk_format(name: str) -> str:
    """The format of the chunk file ``name`` ("arrow", "parquet" or "pickle"), by its suffix."""
    for fmt, suffix in SUFFIXES.items():
        if name.endswith(suffix):
            return fmt
    raise SnapshotCorruptedError(f"{name}: not a snapshot chunk name (suffix not one of "
                                 f"{sorted(SUFFIXES.values())})")


def pickle_refused(where: str, old: bool = False) -> ValueError:
    """The error for a pickle chunk met without ``allow_pickle=True``."""
    why = ("it was written by a version of dask-dataservice before the open formats, as pickles"
           if old else "it holds pickle chunks (format='pickle', or elements Arrow cannot "
           "represent)")
    return ValueError(
        f"{where}: {why}. Loading a pickle can run arbitrary code: pass allow_pickle=True to "
        "Dataset.load only for a snapshot you trust")


# -- chunks ---------------------------------------------------------------------------------------


def encode_chunk(elements: list[Any], compress: bool = False) -> bytes:
    payload = pickle.dumps(elements, protocol=5)
    magic = MAGIC
    if compress:
        payload, magic = zlib.compress(payload, 1), MAGIC_ZLIB
    return magic + _HEADER.pack(len(payload), zlib.crc32(payload), len(elements)) + payload


def _read_pickle_chunk(data: bytes, path: str) -> list[Any]:
    head = len(MAGIC) + _HEADER.size
    length, crc, count = _pickle_header(data, path)
    payload = memoryview(data)[head:]
    if len(payload) != length:
        raise SnapshotCorruptedError(f"{path}: payload is {len(payload)} bytes, header says {length}")
    if zlib.crc32(payload) != crc:
        raise SnapshotCorruptedError(f"{path}: checksum mismatch (the chunk is damaged)")
    elements = pickle.loads(zlib.decompress(payload) if data[: len(MAGIC)] == MAGIC_ZLIB
                            else payload)
    if not isinstance(elements, list) or len(elements) != count:
        raise SnapshotCorruptedError(f"{path}: holds {len(elements)} elements, header says {count}")
    return elements


def _pickle_header(data: bytes, path: str) -> tuple[int, int, int]:
    if len(data) < len(MAGIC) + _HEADER.size or data[: len(MAGIC)] not in (MAGIC, MAGIC_ZLIB):
        raise SnapshotCorruptedError(f"{path}: not a snapshot chunk (bad magic or short header)")
    length, crc, count = _HEADER.unpack_from(data, len(MAGIC))
    return int(length), int(crc), int(count)


def read_chunk(path: str, allow_pickle: bool = False) -> list[Any]:
    """The elements of the chunk file at ``path`` (checked, see rule 2).

    A pickle chunk is read only with ``allow_pickle=True`` (else ValueError): unpickling runs
    code chosen by whoever wrote the file.
    """
    fmt = chunk_format(path)
    if fmt == "pickle" and not allow_pickle:
        raise pickle_refused(path)
    with open_file(path, "rb") as f:
        data = f.read()
    if fmt == "pickle":
        return _read_pickle_chunk(data, path)
    from . import _snapshot_arrow as arrow

    table = arrow.read_arrow(data, path) if fmt == "arrow" else arrow.read_parquet(data, path)
    return arrow.decode_table(table, path)


def chunk_num_elements(path: str) -> int:
    """How many elements the chunk at ``path`` holds, from its header or schema (no unpickling)."""
    fmt = chunk_format(path)
    with open_file(path, "rb") as f:
        if fmt == "pickle":
            return _pickle_header(f.read(len(MAGIC) + _HEADER.size), path)[2]
        from . import _snapshot_arrow as arrow

        return arrow.num_elements(f, fmt, path)


def encode_elements(elements: list[Any], fmt: str, compression: str | None,
                    fallback: bool) -> tuple[list[Any], str, dict[str, Any] | None]:
    """A chunk of ``elements`` in ``fmt`` ("arrow", "parquet" or "pickle").

    Returns ``(data, format used, element structure or None)``, ``data`` a list of buffers
    whose concatenation is the file. Elements Arrow cannot represent
    are pickled when ``fallback`` is true, else raise TypeError naming what does not fit.
    """
    if fmt != "pickle":
        from . import _snapshot_arrow as arrow

        try:
            table, meta = arrow.encode_table(elements)
        except arrow.Unrepresentable as e:
            if not fallback:
                raise TypeError(
                    f"distributed_save(format={fmt!r}): the elements cannot be stored in "
                    f"{fmt} ({e}); use format='AUTO' (pickle for such chunks) or "
                    "format='pickle'") from None
        else:
            data = (arrow.write_arrow(table, compression) if fmt == "arrow"
                    else arrow.write_parquet(table, compression))
            return data, fmt, arrow.element_spec_json(meta)
    return [encode_chunk(elements, compression not in (None, "AUTO"))], "pickle", None


class WriteChunks(Op):
    """The stage ``distributed_save`` adds on the data workers: elements in, chunks out.

    Buffers the input's elements and commits a chunk when it holds ``max_elements`` elements
    or ``max_bytes`` bytes of arrays, or ``max_seconds`` after its first element (so that a
    slow pipeline still shows progress to a concurrent ``load``), and at the end of the input.
    Yields one descriptor per committed chunk: ``{"chunk": name, "elements": n, "bytes": b,
    "format": f, "structure": s}`` (``s``: the structure of an Arrow/Parquet chunk's elements, as
    in its metadata; None for pickle). ``format`` is "arrow", "parquet" or "pickle";
    ``fallback``: pickle the chunks Arrow cannot represent (else TypeError). A chunk still in the
    buffer when the iteration is closed early is not written.
    """

    name = "distributed_save"

    def __init__(self, input: Op, path: str, max_elements: int, max_bytes: int,
                 max_seconds: float, format: str = "arrow", compression: str | None = None,
                 fallback: bool = True) -> None:
        if format not in SUFFIXES:
            raise ValueError(f"format must be one of {sorted(SUFFIXES)}, got {format!r:.40}")
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r:.40}")
        self.input = input
        self.inputs = (input,)
        self.path = path
        self.max_elements = max_elements
        self.max_bytes = max_bytes
        self.max_seconds = max_seconds
        self.format = format
        self.compression = compression
        self.fallback = fallback

    def params(self) -> tuple[Any, ...]:
        return (self.path, self.max_elements, self.max_bytes, self.max_seconds, self.format,
                self.compression, self.fallback)

    def iterate(self, ctx: IterContext) -> Iterator[dict[str, Any]]:
        stream = uuid.uuid4().hex[:12]  # one writer: names never collide across workers
        where = _join(self.path, CHUNKS)
        buffer: list[Any] = []
        size = 0
        started = 0.0
        seq = 0

        def commit() -> dict[str, Any]:
            nonlocal buffer, size, seq
            data, fmt, structure = encode_elements(buffer, self.format, self.compression,
                                                   self.fallback)
            name = f"{stream}-{seq:06d}{SUFFIXES[fmt]}"
            if seq == 0:  # a worker on another machine may not have the directory yet
                _makedirs(where)
            _write_atomic(_join(where, name), data)
            out = {"chunk": name, "elements": len(buffer),
                   "bytes": sum(memoryview(piece).nbytes for piece in data), "format": fmt,
                   "structure": structure}
            buffer, size, seq = [], 0, seq + 1
            return out

        for x in self.input.iterate(ctx):
            if not buffer:
                started = time.monotonic()
            buffer.append(x)
            size += nbytes(x)
            if (len(buffer) >= self.max_elements or size >= self.max_bytes
                    or time.monotonic() - started >= self.max_seconds):
                yield commit()
        if buffer:
            yield commit()


# -- the manifest ---------------------------------------------------------------------------------


def read_manifest(path: str) -> dict[str, Any]:
    """The manifest of the snapshot at ``path`` (FileNotFoundError if there is none)."""
    where = _join(path, MANIFEST)
    try:
        with open_file(where, "rb") as f:
            manifest = json.loads(f.read())
    except FileNotFoundError:
        raise FileNotFoundError(f"no snapshot at {path} (no {MANIFEST}; see distributed_save)") from None
    except json.JSONDecodeError as e:
        raise SnapshotCorruptedError(f"{where}: not JSON: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SnapshotCorruptedError(f"{where}: not a dask-dataservice snapshot manifest")
    if not isinstance(manifest.get("version", 1), int) or manifest.get("version", 1) > VERSION:
        raise SnapshotCorruptedError(
            f"{where}: snapshot version {manifest.get('version')!r}; this dask-dataservice reads "
            f"versions 1 to {VERSION} (upgrade it to read this snapshot)")
    return manifest


def _write_manifest(path: str, manifest: dict[str, Any]) -> None:
    _write_atomic(_join(path, MANIFEST), json.dumps(manifest, indent=1).encode())


# -- saving ---------------------------------------------------------------------------------------


class SnapshotSave:
    """A save in progress (``distributed_save(..., wait=False)``).

    The job is read by a thread of this process: call :meth:`result` (or use the object as a
    context manager) before the process or its client goes away.
    """

    def __init__(self, path: str, run: Any) -> None:
        self.path = path
        self._future: Future[dict[str, Any]] = Future()

        def main() -> None:
            try:
                self._future.set_result(run())
            except BaseException as e:  # noqa: BLE001 - handed to result()
                self._future.set_exception(e)

        self._thread = threading.Thread(target=main, name="dds-snapshot-save", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        """Whether the save has ended (finished or failed)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait for the save to end and return its final manifest (or raise its error)."""
        out = self._future.result(timeout)
        self._thread.join()
        return out

    def __enter__(self) -> SnapshotSave:
        return self

    def __exit__(self, *exc: object) -> None:
        self.result()


def _check_positive(name: str, value: Any, kind: type = int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int) or value <= 0:
        raise ValueError(f"{name} must be a positive {kind.__name__}, got {value!r:.40}")


# -- loading --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChunkSplit:
    """One chunk of a snapshot."""

    path: str


class LoadSnapshot(Source):
    """The elements of a snapshot; each chunk is a split (see :meth:`Dataset.load`)."""

    name = "load"
    split_type = ChunkSplit
    file_based = True

    def __init__(self, path: str, wait: bool = False, timeout: float | None = None,
                 allow_pickle: bool = False) -> None:
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise TypeError(f"load() takes a path or URL string, got {path!r:.60}")
        if not isinstance(allow_pickle, bool):
            raise TypeError(f"allow_pickle must be a bool, got {allow_pickle!r:.40}")
        self.path = os.fspath(path)
        self.allow_pickle = allow_pickle
        if timeout is not None:
            _check_positive("timeout", timeout, float)
        self.timeout = timeout
        manifest = read_manifest(self.path)
        self.state = manifest["state"]
        if wait and self.state == "failed":  # it will never be done: say so, not part of it
            raise _failed(self.path, manifest)
        self.wait = bool(wait) and self.state == "running"
        names = manifest["chunks"] if self.state == "done" else committed_chunks(self.path)
        if not allow_pickle:  # say so now, not in the middle of a read on some worker
            if manifest.get("version", 1) < 2:
                raise pickle_refused(self.path, old=True)
            if any(n.endswith(SUFFIXES["pickle"]) for n in names):
                raise pickle_refused(self.path)
        self._splits = tuple(ChunkSplit(_join(self.path, CHUNKS, n)) for n in names)
        self.splittable = not self.wait
        self._cardinality = manifest["num_elements"] if self.state == "done" else UNKNOWN

    def params(self) -> tuple[Any, ...]:
        return (self.path, self.wait, self.allow_pickle, self._splits)

    def why_not(self) -> str:
        return (f"load({self.path!r}, wait=True) follows a save that is still running, so its "
                "chunks are not known yet; read it with OFF sharding, or load it with wait=False "
                "(the chunks committed so far, as splits)")

    def cardinality(self) -> int:
        return int(self._cardinality)

    def splits(self, split_size: int | None = None) -> list[ChunkSplit]:
        return list(self._splits)

    def read_split(self, split: ChunkSplit) -> Iterator[Any]:
        return iter(read_chunk(split.path, self.allow_pickle))

    def iterate_all(self, ctx: IterContext) -> Iterator[Any]:
        if not self.wait:
            for split in self._splits:
                yield from self.read_split(split)
            return
        yield from self._follow()

    def _follow(self) -> Iterator[Any]:
        """Chunks as they are committed, until the save is done (rule 3: listed in full)."""
        seen: set[str] = set()
        pause = 0.02
        last_new = time.monotonic()
        while True:
            manifest = read_manifest(self.path)
            final = manifest["state"] == "done"
            names = manifest["chunks"] if final else committed_chunks(self.path)
            new = [n for n in names if n not in seen]
            for name in new:
                seen.add(name)
                yield from read_chunk(_join(self.path, CHUNKS, name), self.allow_pickle)
            if final:
                return
            if manifest["state"] == "failed":
                raise _failed(self.path, manifest)
            now = time.monotonic()
            if new:
                last_new, pause = now, 0.02
            elif self.timeout is not None and now - last_new > self.timeout:
                raise TimeoutError(
                    f"load({self.path!r}, wait=True): no chunk committed for {self.timeout:g}s and "
                    "the save is not done (its process may have died; load(path) without wait "
                    "reads the chunks committed so far)")
            time.sleep(pause)  # a filesystem has no notification to wait on: poll, backing off
            pause = min(1.0, pause * 2)


def _failed(path: str, manifest: dict[str, Any]) -> RuntimeError:
    return RuntimeError(f"the save to {path} failed: {manifest.get('error')} "
                        "(load(path) without wait reads the chunks it committed)")
