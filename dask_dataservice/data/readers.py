"""Readers for :meth:`Dataset.from_files`: each turns one file into elements.

A reader is any callable ``reader(path) -> iterable of elements``; these cover common
formats. Readers run where the pipeline runs (a data worker, under the data service). Paths
may be local or fsspec URLs (``memory://``, ``s3://``, ...). CSV, JSON lines, TFRecord and
images are defined in :mod:`dask_dataservice.data.formats`.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ._fs import is_url, open_file
from .formats import csv_rows, image, json_lines, tfrecords

__all__ = ["csv_rows", "image", "json_lines", "npy", "text_lines", "tfrecords", "zarr_rows"]


def npy(path: str) -> Iterator[np.ndarray]:
    """Rows (axis 0) of a ``.npy`` file, memory-mapped so only what is read is loaded.

    Each row is copied out of the mapping: elements are ordinary writable arrays that do not
    keep the file mapped.
    """
    if is_url(path):  # no memory map on an object store: the file is read whole
        with open_file(path, "rb") as f:
            arr = np.load(f, allow_pickle=False)
    else:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    if arr.ndim == 0:
        yield np.array(arr)
        return
    for i in range(arr.shape[0]):
        yield np.array(arr[i])


def text_lines(path: str, encoding: str = "utf-8") -> Iterator[str]:
    """Lines of a text file, without their line endings."""
    import io

    with open_file(path, "rb") as raw, io.TextIOWrapper(raw, encoding=encoding) as f:
        for line in f:
            yield line.rstrip("\r\n")


def zarr_rows(path: str, block_rows: int | None = None) -> Iterator[np.ndarray]:
    """Rows (axis 0) of a zarr array stored at ``path``, read a chunk at a time."""
    import zarr

    arr = zarr.open_array(path, mode="r")
    step = block_rows or arr.chunks[0]
    for start in range(0, arr.shape[0], step):
        yield from np.asarray(arr[start : start + step])
