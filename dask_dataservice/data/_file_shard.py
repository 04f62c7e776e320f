"""Where FILE sharding cuts a pipeline: its file source, found as TensorFlow's auto-shard does.

TensorFlow's FILE policy walks down from the pipeline's output, through the ops that pass
elements on (map, batch, shuffle, prefetch, ...) and through the ops that read a dataset per
element (``interleave``, ``flat_map``: the readers), to the dataset of file names below them,
and gives each worker every n-th file. Here a pipeline is FILE-shardable when each of its
sources is a list of files:

- a source that reads files itself (``list_files``, ``from_files``, the format readers
  ``from_csv`` / ``from_tfrecord`` / ``from_parquet`` ..., ``Dataset.load``, ``from_dask``
  partitions): each file (row group, chunk, partition) is a split;
- ``from_tensor_slices(filenames)``, a 1-D array of strings, read by an ``interleave``,
  ``flat_map`` or ``map`` above it (TensorFlow's ``from_tensor_slices(filenames)
  .interleave(TFRecordDataset)``): each file name is a split, so each file is read whole by
  one worker (:func:`split_size`).

Nothing is opened or run to decide this (the readers' functions are not called): the
decision is made where the pipeline is registered, from the ops alone.
"""

from __future__ import annotations

from typing import cast

import numpy as np

from . import ops, sources
from ._base import Op

__all__ = ["filename_source", "is_reader", "source_split_size", "split_size",
           "why_not_file_shardable"]

#: Ops that turn an element (a file name) into the file's elements.
_READERS = (ops.Interleave, ops.Map)  # flat_map is an Interleave

_SOURCES_NOTE = ("FILE sharding reads list_files, from_files, a format reader (from_csv, "
                 "from_tfrecord, ...) or from_tensor_slices(filenames) read by interleave, "
                 "flat_map or map")


def _is_filename_array(source: Op) -> bool:
    if not isinstance(source, sources.TensorSlices):
        return False
    data = source.data
    return isinstance(data, np.ndarray) and data.ndim == 1 and data.dtype.kind in "US"


def _walk(op: Op, read_above: bool, out: list[tuple[Op, bool]]) -> None:
    """Collect ``(source, whether a reader op is above it)`` for every source."""
    if op.is_source:
        out.append((op, read_above))
        return
    read_above = read_above or is_reader(op)
    for child in op.inputs:
        _walk(child, read_above, out)


def why_not_file_shardable(op: Op) -> str | None:
    """Why FILE sharding does not apply to the pipeline rooted at ``op``, or None.

    The reason names the first source that is not a list of files, in TensorFlow's words
    ("found an unshardable source dataset").
    """
    found: list[tuple[Op, bool]] = []
    _walk(op, False, found)
    for source, read_above in found:
        if cast(sources.Source, source).file_based:
            continue
        if _is_filename_array(source):
            if read_above:
                continue
            return (f"found an unshardable source dataset: {source.name}() of strings that no "
                    "interleave, flat_map or map reads as file names; " + _SOURCES_NOTE)
        return (f"found an unshardable source dataset: {source.name}() is not a list of "
                f"files; {_SOURCES_NOTE}")
    return None


def filename_source(op: Op) -> sources.TensorSlices | None:
    """The pipeline's only source when it is ``from_tensor_slices(filenames)`` read by a
    reader op above it (see the module docstring), else None."""
    found: list[tuple[Op, bool]] = []
    _walk(op, False, found)
    if len(found) != 1:
        return None
    source, read_above = found[0]
    if read_above and _is_filename_array(source):
        return cast(sources.TensorSlices, source)
    return None


def is_reader(op: Op) -> bool:
    """Whether ``op`` reads its input's elements as file names (see the module docstring)."""
    return isinstance(op, _READERS)


def source_split_size(source: Op, read: bool, given: int | None) -> int | None:
    """The split size to cut ``source`` with (``read``: a reader op is above it): ``given`` if
    set; one file name per split for a list of file names (each file is read whole by one
    worker, under FILE and DYNAMIC sharding alike, as in TensorFlow); else None (the
    source's default)."""
    if given is None and read and _is_filename_array(source):
        return 1
    return given


def split_size(op: Op, given: int | None) -> int | None:
    """:func:`source_split_size` for a pipeline with one source."""
    if given is None and filename_source(op) is not None:
        return 1
    return given
