"""Saving a snapshot with the data service: :func:`distributed_save`.

The snapshot's format, its chunk writer and its reader are the pipeline library's
(:mod:`dask_dataservice.data.snapshot`, which imports no Dask); saving distributes the writer
over the data workers, so it lives with the other client calls.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ...data import Dataset
from ...data._base import INFINITE, UNKNOWN
from ...data.formats import optional_import
from ...data.snapshot import (
    CHUNKS,
    COMPRESSIONS,
    FORMAT,
    FORMATS,
    MANIFEST,
    VERSION,
    SnapshotSave,
    WriteChunks,
    _check_positive,
    _exists,
    _join,
    _makedirs,
    _write_manifest,
    chunk_num_elements,
    committed_chunks,
)
from . import distribute

__all__ = ["distributed_save"]


def distributed_save(dataset: Any, path: str, service: Any, wait: bool = False, *,
                     max_chunk_elements: int = 100_000, max_chunk_bytes: int = 64 << 20,
                     max_chunk_seconds: float = 10.0,
                     compression: str | None = "AUTO",
                     format: str = "AUTO") -> SnapshotSave | dict[str, Any]:
    """Write ``dataset``'s elements to ``path`` (a directory or fsspec URL), in parallel, on
    the data workers of ``service`` (TensorFlow's ``tf.data.experimental.distributed_save``).

    The dataset must be splittable (the data workers share its splits, DYNAMIC sharding) and
    finite. Read the snapshot back with ``Dataset.load(path)``, also while the save runs.

    Parameters
    ----------
    dataset
        The pipeline to save.
    path
        A directory that holds no snapshot yet (created if needed): a local path or a URL.
    service
        A ``distributed.Client`` or the scheduler's address (as ``distribute``).
    wait
        False (TensorFlow's default): return a :class:`SnapshotSave` at once; call its
        ``result()`` before exiting. True: return the final manifest when the save is done.
    max_chunk_elements, max_chunk_bytes, max_chunk_seconds
        A worker commits its chunk when it holds that many elements or bytes, or that many
        seconds after its first element. The bytes bound is also the memory each worker task
        uses for the save.
    compression
        The chunks' codec: ``"AUTO"`` (as TensorFlow's default) or None: not compressed (numeric
        data rarely shrinks enough to pay for the CPU); ``"LZ4"``, ``"ZSTD"``: Arrow's and
        Parquet's own codecs; ``"GZIP"`` (TensorFlow's name): gzip in Parquet, zstd in Arrow
        IPC (which has no gzip), zlib for pickle chunks; ``"SNAPPY"``: snappy in Parquet, lz4
        in Arrow IPC. Pickle chunks are zlib-compressed under any codec.
    format
        ``"AUTO"`` (the default): Arrow IPC files (Feather v2), and a pickle chunk for elements
        Arrow cannot represent (arbitrary Python objects); ``"arrow"``, ``"parquet"``: only that
        format (TypeError from the worker for elements it cannot represent); ``"pickle"``: every
        chunk a pickle (any element; ``Dataset.load`` then needs ``allow_pickle=True``). Arrow
        and Parquet need pyarrow on the client and the data workers
        (``pip install 'dask-dataservice[parquet]'``).

    Returns
    -------
    The final manifest (a dict: ``state``, ``chunks``, ``num_elements``, ...) with ``wait``,
    else a :class:`SnapshotSave`.
    """
    if not isinstance(dataset, Dataset):
        raise TypeError(f"distributed_save() takes a Dataset, got {type(dataset).__name__}")
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise TypeError(f"path must be a path or URL string, got {path!r:.60}")
    path = os.fspath(path)
    _check_positive("max_chunk_elements", max_chunk_elements)
    _check_positive("max_chunk_bytes", max_chunk_bytes)
    _check_positive("max_chunk_seconds", max_chunk_seconds, float)
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {', '.join(map(repr, COMPRESSIONS))}, "
                         f"got {compression!r:.40}")
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(map(repr, FORMATS))}, "
                         f"got {format!r:.40}")
    chunk_format = "arrow" if format == "AUTO" else format
    if chunk_format != "pickle":  # here, before any worker starts: say what to install
        optional_import("pyarrow", "parquet", f"distributed_save(format={format!r}) (or "
                        "format='pickle', which needs Dataset.load(allow_pickle=True))")
    dataset.check_splittable()
    cardinality = dataset.cardinality()
    if cardinality == INFINITE:
        raise ValueError("distributed_save(): the dataset is infinite (a repeat() without count?)")
    if _exists(_join(path, MANIFEST)):
        raise FileExistsError(f"distributed_save(): {path} already holds a snapshot; "
                              "choose another path or delete it")
    _makedirs(_join(path, CHUNKS))
    manifest: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "state": "running",
        "fingerprint": dataset.fingerprint(), "cardinality": cardinality, "started": time.time(),
        "chunk_format": chunk_format, "pickle_fallback": format == "AUTO",
        "compression": compression,
    }
    _write_manifest(path, manifest)
    writer = Dataset(WriteChunks(dataset._op, path, max_chunk_elements, max_chunk_bytes,
                                 float(max_chunk_seconds), chunk_format, compression,
                                 fallback=format == "AUTO"))
    try:
        job = writer.apply(distribute("distributed_epoch", service))
    except BaseException as e:
        _write_manifest(path, {**manifest, "state": "failed", "error": f"{type(e).__name__}: {e}"})
        raise
    if not isinstance(job, Dataset):  # an asynchronous client on its own loop
        job.close()
        raise RuntimeError("distributed_save() blocks while it registers the dataset: with an "
                           "asynchronous client call it from a thread (asyncio.to_thread)")

    def run() -> dict[str, Any]:
        received: list[dict[str, Any]] = []
        try:
            seen = set()
            for d in job:
                if d["chunk"] not in seen:  # a descriptor is never needed twice
                    seen.add(d["chunk"])
                    received.append(d)
        except BaseException as e:
            _write_manifest(path, {**manifest, "state": "failed",
                                   "error": f"{type(e).__name__}: {e}"})
            raise
        # rule 3: chunks committed by a worker whose descriptor was lost are kept too
        names = [d["chunk"] for d in received]
        names += sorted(set(committed_chunks(path)) - set(names))
        counts = {d["chunk"]: d["elements"] for d in received}
        counts = {n: counts[n] if n in counts else chunk_num_elements(_join(path, CHUNKS, n))
                  for n in names}
        total = sum(counts.values())
        structures = [d["structure"] for d in received if d.get("structure") is not None]
        final = {**manifest, "state": "done", "finished": time.time(), "chunks": names,
                 "chunk_elements": counts, "num_elements": total,
                 "pickle_chunks": sum(n.endswith(".chunk") for n in names),
                 "structure": structures[0] if structures else None,
                 "complete": None if cardinality == UNKNOWN else total == cardinality}
        _write_manifest(path, final)
        return final

    if wait:
        return run()
    return SnapshotSave(path, run)
