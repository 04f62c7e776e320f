"""File formats: CSV, JSON lines, TFRecord, Parquet and images, on any fsspec filesystem.

Each format is a reader (``reader(path) -> elements``, for :meth:`Dataset.from_files`) and a
``Dataset.from_*`` source built on it; every file (for Parquet, every row group) is one split,
so DYNAMIC and FILE sharding hand out files or row groups. Readers stream: a file is never
loaded whole (Parquet reads one row group, in record batches; CSV, JSON lines and TFRecord read
a record at a time).

Optional dependencies are imported only when a format needs them, with an error that names
the extra to install (:func:`dask_dataservice.errors.install_hint`): Parquet needs ``pyarrow``
(``pip install 'dask-dataservice[parquet]'``), images need ``Pillow``
(``pip install 'dask-dataservice[images]'``).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import install_hint
from ._fs import open_file
from .sources import Source
from .tfrecord import read_records

__all__ = ["RowGroupSplit", "FromParquet", "csv_rows", "json_lines", "image", "optional_import"]


def optional_import(module: str, extra: str, what: str) -> Any:
    """Import an optional dependency, or raise ImportError naming the extra to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(
            f"{what} needs the optional dependency {module.split('.')[0]!r}: "
            f"{install_hint(extra)}") from None


# -- CSV and JSON lines --------------------------------------------------------------------------


def _infer(value: str) -> np.dtype:
    for dtype, cast in ((np.int64, int), (np.float64, float)):
        try:
            cast(value)
            return np.dtype(dtype)
        except ValueError:
            pass
    return np.dtype(object)


def csv_rows(path: str, header: bool = True, field_delim: str = ",",
             column_names: Sequence[str] | None = None, select_columns: Sequence[str] | None = None,
             column_defaults: dict[str, Any] | None = None, encoding: str = "utf-8") -> Iterator[dict[str, Any]]:
    """Rows of a CSV file as dicts ``{column: numpy scalar}``.

    Column names come from the header line, or ``column_names``; the type of each column is
    read from its first value (int64, float64, else str) unless ``column_defaults`` gives a
    value whose type decides it (and fills empty fields, TF's ``record_defaults``). An empty
    field without a default is an error naming the file, line and column.
    """
    defaults = dict(column_defaults or {})
    with open_file(path, "rb") as raw, io.TextIOWrapper(raw, encoding=encoding, newline="") as f:
        reader = csv.reader(f, delimiter=field_delim)
        names = list(column_names) if column_names is not None else None
        if header:
            first = next(reader, None)
            if first is None:
                return
            names = names or first
        if names is None:
            raise ValueError(f"{path}: a CSV file without a header needs column_names")
        keep = list(select_columns) if select_columns is not None else names
        missing = [c for c in keep if c not in names]
        if missing:
            raise KeyError(f"{path}: no column(s) {missing} (columns: {names})")
        index = [names.index(c) for c in keep]
        dtypes: dict[str, np.dtype] = {c: np.asarray(v).dtype for c, v in defaults.items()}
        for line_no, row in enumerate(reader, start=2 if header else 1):
            if not row:
                continue
            if len(row) != len(names):
                raise ValueError(f"{path}:{line_no}: {len(row)} fields, expected {len(names)} ({names})")
            out: dict[str, Any] = {}
            for c, i in zip(keep, index, strict=True):
                text = row[i]
                if text == "":
                    if c not in defaults:
                        raise ValueError(f"{path}:{line_no}: column {c!r} is empty and has no default")
                    out[c] = np.asarray(defaults[c])[()]
                    continue
                dtype = dtypes.setdefault(c, _infer(text))
                out[c] = text if dtype.kind == "O" else dtype.type(text)
            yield out


def json_lines(path: str, encoding: str = "utf-8") -> Iterator[Any]:
    """One JSON value per line (blank lines skipped); lists become numpy arrays."""
    with open_file(path, "rb") as raw, io.TextIOWrapper(raw, encoding=encoding) as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not JSON: {e}") from None
            yield _arrays(value)


def _arrays(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _arrays(v) for k, v in value.items()}
    if isinstance(value, list):
        return np.asarray(value)
    return value


def tfrecords(path: str) -> Iterator[bytes]:
    """Records of a TFRecord file as bytes, CRCs checked (see :mod:`.tfrecord`)."""
    return read_records(path)


def image(path: str, mode: str | None = None) -> Iterator[np.ndarray]:
    """The image in a file as a uint8 array (H, W) or (H, W, C), decoded with Pillow.

    ``mode`` converts it first (``"RGB"``, ``"L"``, ...).
    """
    pil = optional_import("PIL.Image", "images", "reading images")
    with open_file(path, "rb") as f, pil.open(f) as img:
        if mode is not None:
            img = img.convert(mode)
        yield np.asarray(img, dtype=np.uint8)


# -- Parquet -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RowGroupSplit:
    """One row group of a Parquet file."""

    path: str
    row_group: int


class FromParquet(Source):
    """Rows (or record batches) of Parquet files; each row group is a split."""

    name = "from_parquet"
    split_type = RowGroupSplit
    file_based = True

    def __init__(self, paths: Sequence[str], columns: Sequence[str] | None = None, rows: bool = True,
                 batch_rows: int = 65_536) -> None:
        pq = optional_import("pyarrow.parquet", "parquet", "from_parquet()")
        if not paths:
            raise ValueError("from_parquet(): no files")
        self.paths = tuple(paths)
        self.columns = None if columns is None else tuple(columns)
        if not isinstance(rows, bool):
            raise TypeError(f"rows must be a bool, got {type(rows).__name__}")
        self.rows = rows
        self.batch_rows = int(batch_rows)
        groups: list[RowGroupSplit] = []
        total = 0
        for path in self.paths:  # metadata only, where the dataset is defined
            with open_file(path, "rb") as f:
                meta = pq.ParquetFile(f).metadata
                if self.columns is not None:
                    names = set(meta.schema.names)
                    missing = [c for c in self.columns if c not in names]
                    if missing:
                        raise KeyError(f"from_parquet(): {path} has no column(s) {missing} "
                                       f"(columns: {sorted(names)})")
                groups.extend(RowGroupSplit(path, i) for i in range(meta.num_row_groups))
                total += meta.num_rows
        self._splits = tuple(groups)
        self._num_rows = total

    def params(self) -> tuple[Any, ...]:
        return (self.paths, self.columns, self.rows, self.batch_rows)

    def cardinality(self) -> int:
        from ._base import UNKNOWN

        return self._num_rows if self.rows else UNKNOWN

    def splits(self, split_size: int | None = None) -> list[Any]:
        return list(self._splits)

    def read_split(self, split: RowGroupSplit) -> Iterator[Any]:
        pq = optional_import("pyarrow.parquet", "parquet", "from_parquet()")
        with open_file(split.path, "rb") as f:
            pf = pq.ParquetFile(f)
            for batch in pf.iter_batches(batch_size=self.batch_rows, row_groups=[split.row_group],
                                         columns=list(self.columns) if self.columns else None):
                cols = {name: _column(batch.column(i)) for i, name in enumerate(batch.schema.names)}
                if not self.rows:
                    yield cols
                    continue
                for i in range(batch.num_rows):
                    yield {name: col[i] for name, col in cols.items()}


def _column(array: Any) -> np.ndarray:
    try:
        return array.to_numpy(zero_copy_only=False)  # type: ignore[no-any-return]
    except Exception:  # noqa: BLE001 - nested types: fall back to Python objects
        return np.asarray(array.to_pylist(), dtype=object)
