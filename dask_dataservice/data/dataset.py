"""``Dataset``: an immutable, picklable description of an input pipeline.

>>> from dask_dataservice.data import Dataset
>>> list(Dataset.range(10).map(lambda x: x * 2).filter(lambda x: x % 3 == 0).batch(2))
[array([0, 6]), array([12, 18])]

Iterating a ``Dataset`` runs it in this process. The data service runs the same object on
Dask workers (see :func:`dask_dataservice.distribute`).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, cast

import numpy as np

from . import _file_shard, _stats, formats, ops, ops_more, sources
from ._adapters import adapter
from ._base import AUTOTUNE, INFINITE, REPR_ONLY, UNKNOWN, IterContext, Op, walk
from ._base import sources as _sources
from ._fingerprint import fingerprint as _fingerprint
from ._fs import expand as _expand_globs
from .spec import relax_leading_dim, spec_of
from .splits import (
    ComponentSplit,
    ListSplitProvider,
    NotSplittableError,
    SplitProvider,
    mixed_splits,
    shared_splits,
)
from .structure import map_structure

__all__ = ["Dataset", "AUTOTUNE", "INFINITE", "UNKNOWN"]


class _hybrid:
    """A method usable on the class (``Dataset.zip(a, b)``) and on an instance (``a.zip(b)``)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]  # copies __doc__...

    def __get__(self, obj: object, cls: type | None = None) -> Callable[..., Any]:
        if obj is None:
            return self.fn
        return functools.partial(self.fn, obj)


class Dataset:
    """An input pipeline: a source and a chain of transformations.

    A ``Dataset`` never changes: every transformation returns a new one. It can be iterated
    any number of times (each iteration runs the pipeline from the start), pickled with
    cloudpickle, and sent to the data service. Elements are numpy arrays, Python scalars,
    or tuples and dicts of them.
    """

    __slots__ = ("_op",)

    def __init__(self, op: Op) -> None:
        if not isinstance(op, Op):
            raise TypeError(
                "Dataset() is not built directly; start from a source such as "
                "Dataset.range() or Dataset.from_tensor_slices()"
            )
        self._op = op

    def __getstate__(self) -> dict[str, Any]:
        return {"_op": self._op}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._op = state["_op"]

    # ------------------------------------------------------------------------------------
    # sources
    # ------------------------------------------------------------------------------------
    @classmethod
    def range(cls, start: int, stop: int | None = None, step: int = 1) -> Dataset:
        """Integers like Python's ``range``: ``range(stop)`` or ``range(start, stop, step)``."""
        return cls(sources.RangeSource(start, stop, step))

    @classmethod
    def from_tensor_slices(cls, tensors: Any) -> Dataset:
        """Slices of arrays along axis 0.

        ``tensors`` is an array (or anything ``np.asarray`` accepts), or a tuple or dict of
        arrays with the same length, giving tuple or dict elements.
        """
        return cls(sources.TensorSlices(tensors))

    @classmethod
    def from_tensors(cls, tensors: Any) -> Dataset:
        """One element: ``tensors`` whole (TensorFlow's ``Dataset.from_tensors``).

        ``tensors`` is an array, a scalar, or a tuple or dict of them; the element has the
        same structure, with numpy arrays (and numpy scalars) as leaves. Typically followed
        by ``repeat()``.
        """
        return cls(sources.TensorSlices(map_structure(lambda t: np.asarray(t)[np.newaxis], tensors)))

    @classmethod
    def list_files(cls, file_pattern: str | list[str], shuffle: bool = False,
                   seed: int | None = None) -> Dataset:
        """Filenames matching a glob pattern (or list of patterns), sorted.

        The pattern is expanded when the dataset is defined, so every worker of the data
        service sees the same files. Each file is one split (FILE and DYNAMIC sharding).
        """
        return cls(sources.ListFiles(file_pattern, shuffle, seed))

    @classmethod
    def from_files(cls, paths: str | Iterable[str], reader: Callable[[str], Iterable[Any]]) -> Dataset:
        """Elements read from files by ``reader(path)``; each file is one split.

        ``paths`` are passed to ``reader`` as given, in their order (not globbed: a directory
        may be one "file" to its reader, as a zarr store is); the format readers
        (``from_csv``, ``from_parquet``...) take directories and globs.

        See :mod:`dask_dataservice.data.readers` for readers of ``.npy``, text and zarr.
        """
        return cls(sources.FromFiles(paths, reader))

    @classmethod
    def _file_list(cls, files: list[str], reader: Callable[[str], Iterable[Any]]) -> Dataset:
        return cls(sources.FromFiles(files, reader))

    @classmethod
    def from_text_lines(cls, file_pattern: str | list[str], encoding: str = "utf-8") -> Dataset:
        """One string per line of text files, without the line end (TF's ``TextLineDataset``);
        each file is a split. A directory stands for its ``.txt`` files."""
        from . import readers

        return cls._file_list(_expand("from_text_lines", file_pattern),
                              functools.partial(readers.text_lines, encoding=encoding))

    @classmethod
    def from_csv(cls, file_pattern: str | list[str], header: bool = True, field_delim: str = ",",
                 column_names: list[str] | None = None, select_columns: list[str] | None = None,
                 column_defaults: dict[str, Any] | None = None) -> Dataset:
        """Rows of CSV files as dicts of numpy scalars (TF's ``make_csv_dataset`` without
        batching); each file is a split. See :func:`~dask_dataservice.data.formats.csv_rows`."""
        return cls._file_list(_expand("from_csv", file_pattern), functools.partial(
            formats.csv_rows, header=header, field_delim=field_delim, column_names=column_names,
            select_columns=select_columns, column_defaults=column_defaults))

    @classmethod
    def from_json_lines(cls, file_pattern: str | list[str]) -> Dataset:
        """One element per line of JSON-lines files (lists become arrays); each file a split."""
        return cls._file_list(_expand("from_json_lines", file_pattern), formats.json_lines)

    @classmethod
    def from_tfrecord(cls, filenames: str | list[str]) -> Dataset:
        """Records of TFRecord files as bytes, CRCs checked (TF's ``TFRecordDataset``); decode
        ``tf.train.Example`` records with :func:`~dask_dataservice.data.tfrecord.parse_example`."""
        return cls._file_list(_expand("from_tfrecord", filenames), formats.tfrecords)

    @classmethod
    def from_parquet(cls, file_pattern: str | list[str], columns: list[str] | None = None,
                     rows: bool = True, batch_rows: int = 65_536) -> Dataset:
        """Rows of Parquet files as dicts of numpy scalars (or, with ``rows=False``, record
        batches as dicts of column arrays of up to ``batch_rows``); each row group is a split.
        Needs ``pyarrow`` (``pip install 'dask-dataservice[parquet]'``)."""
        return cls(formats.FromParquet(_expand("from_parquet", file_pattern), columns, rows, batch_rows))

    @classmethod
    def from_images(cls, file_pattern: str | list[str], mode: str | None = None) -> Dataset:
        """Images decoded with Pillow to uint8 arrays, one per file (``mode`` converts, e.g.
        ``"RGB"``). Needs ``Pillow`` (``pip install 'dask-dataservice[images]'``)."""
        formats.optional_import("PIL.Image", "images", "from_images()")
        return cls._file_list(_expand("from_images", file_pattern),
                              functools.partial(formats.image, mode=mode))

    @classmethod
    def from_zarr(cls, array_or_path: Any, rows_per_split: int | None = None,
                  path: str | None = None) -> Dataset:
        """Rows (axis 0) of a zarr array, or of the array stored at a path.

        ``rows_per_split`` (default: the array's chunk length on axis 0) sets the split size.
        Pass a path rather than an in-memory array when the pipeline runs on other machines.
        """
        return cls(sources.FromZarr(array_or_path, rows_per_split, path))

    @classmethod
    def from_dask(cls, collection: Any, rows: bool = True, locality: bool = True) -> Dataset:
        """The partitions of a Dask collection, computed on the cluster by the data workers.

        ``dask.array.Array``: chunks along axis 0 are the splits, elements are rows (or whole
        blocks with ``rows=False``). ``dask.dataframe.DataFrame``: partitions are the splits,
        elements are rows as dicts of numpy scalars (or a partition as a dict of column arrays
        with ``rows=False``). ``dask.bag.Bag``: partitions are the splits. The pipeline holds
        the graph (or, for a persisted collection, the keys of its partitions), never the
        data; see :mod:`dask_dataservice.data.dask_source`. With a persisted collection and
        ``locality=True``, DYNAMIC sharding hands each data worker the partitions in its
        memory first.
        """
        from .dask_source import FromDask

        return cls(FromDask(collection, rows, locality))

    @classmethod
    def load(cls, path: str, wait: bool = False, timeout: float | None = None, *,
             allow_pickle: bool = False) -> Dataset:
        """The elements of a snapshot written by :func:`dask_dataservice.distributed_save`.

        Each chunk is a split (DYNAMIC and FILE sharding hand out chunks). While the save
        still runs, the chunks committed so far are read; ``wait=True`` instead follows the
        save until it is done (not splittable then; ``timeout`` seconds without a new chunk
        raise TimeoutError). Arrow and Parquet chunks need pyarrow. Pickle chunks (snapshots
        written with ``format="pickle"``, elements Arrow cannot represent, or snapshots of
        older versions) are read only with ``allow_pickle=True``, as ``numpy.load``: loading a
        pickle can run arbitrary code, so allow it only for snapshots you trust. See
        :mod:`dask_dataservice.data.snapshot`.
        """
        from .snapshot import LoadSnapshot

        return cls(LoadSnapshot(path, wait, timeout, allow_pickle))

    @classmethod
    def from_generator(cls, generator: Callable[..., Iterable[Any]], args: tuple[Any, ...] = ()) -> Dataset:
        """Elements of ``generator(*args)``: any Python iterable.

        Arbitrary Python code is welcome here (the data service runs it on workers), but a
        generator has no splits, so it can only be read with OFF sharding.
        """
        return cls(sources.FromGenerator(generator, args))

    @_hybrid
    def zip(*datasets: Any) -> Dataset:
        """Combine datasets element-wise into tuples (or dicts, given a dict of datasets).

        ``Dataset.zip(a, b)``, ``Dataset.zip((a, b))``, ``Dataset.zip({"x": a, "y": b})`` and
        ``a.zip(b)`` all work. The result ends with the shortest input.
        """
        if len(datasets) == 1 and isinstance(datasets[0], (tuple, list, dict)):
            structure = datasets[0]
        else:
            structure = datasets
        values = structure.values() if isinstance(structure, dict) else structure
        for d in values:
            if not isinstance(d, Dataset):
                raise TypeError(f"zip() takes datasets, got {type(d).__name__}")
        return Dataset(ops_more.Zip(structure))

    # ------------------------------------------------------------------------------------
    # transformations
    # ------------------------------------------------------------------------------------
    def map(self, map_func: Callable[..., Any], num_parallel_calls: int | None = None,
            deterministic: bool | None = None) -> Dataset:
        """Apply ``map_func`` to every element (tuples are unpacked into arguments).

        With ``num_parallel_calls`` (an int or ``AUTOTUNE``) the function runs in that many
        threads; ``deterministic=False`` lets results come out in completion order.
        """
        return Dataset(ops.Map(self._op, map_func, num_parallel_calls, deterministic))

    def filter(self, predicate: Callable[..., Any]) -> Dataset:
        """Keep the elements for which ``predicate`` is true."""
        return Dataset(ops.Filter(self._op, predicate))

    def batch(self, batch_size: int, drop_remainder: bool = False) -> Dataset:
        """Stack consecutive elements into batches of ``batch_size`` (numpy arrays)."""
        return Dataset(ops.Batch(self._op, batch_size, drop_remainder))

    def padded_batch(self, batch_size: int, padded_shapes: Any = None, padding_values: Any = None,
                     drop_remainder: bool = False) -> Dataset:
        """Batch elements of different shapes, padding each to the largest in the batch.

        ``padded_shapes`` (mirroring the element structure; ``None`` dimensions pad to the
        batch maximum) and ``padding_values`` (default 0, or "" for strings) are optional.
        """
        return Dataset(ops.PaddedBatch(self._op, batch_size, padded_shapes, padding_values,
                                       drop_remainder))

    def unbatch(self) -> Dataset:
        """Split batched elements back into elements (the inverse of ``batch``)."""
        return Dataset(ops.Unbatch(self._op))

    def shuffle(self, buffer_size: int, seed: int | None = None,
                reshuffle_each_iteration: bool = True) -> Dataset:
        """Shuffle with a buffer of ``buffer_size`` elements.

        With a ``seed`` the order is reproducible; with ``reshuffle_each_iteration`` each
        repetition (under ``repeat``) gets a different order.
        """
        return Dataset(ops.Shuffle(self._op, buffer_size, seed, reshuffle_each_iteration))

    def repeat(self, count: int | None = None) -> Dataset:
        """Repeat the dataset ``count`` times (forever when ``count`` is None or -1)."""
        return Dataset(ops.Repeat(self._op, count))

    def take(self, count: int) -> Dataset:
        """The first ``count`` elements (all of them for -1)."""
        return Dataset(ops.Take(self._op, count))

    def skip(self, count: int) -> Dataset:
        """All but the first ``count`` elements (-1 skips everything)."""
        return Dataset(ops.Skip(self._op, count))

    def shard(self, num_shards: Any, index: Any) -> Dataset:
        """Every ``num_shards``-th element, starting at ``index``.

        ``shard(SHARD_HINT, SHARD_HINT)`` leaves the numbers to the data service's HINT
        sharding policy (see :meth:`with_shard_hint`).
        """
        return Dataset(ops.Shard(self._op, num_shards, index))

    def interleave(self, map_func: Callable[..., Any], cycle_length: int | None = None, block_length: int = 1,
                   num_parallel_calls: int | None = None, deterministic: bool | None = None) -> Dataset:
        """Map each element to a dataset and interleave them.

        ``cycle_length`` inner datasets are open at once; ``block_length`` elements are taken
        from each in turn. With ``num_parallel_calls`` each open dataset is read ahead in its
        own thread (the output order stays deterministic).
        """
        return Dataset(ops.Interleave(self._op, map_func, cycle_length, block_length,
                                      num_parallel_calls, deterministic))

    def flat_map(self, map_func: Callable[..., Any]) -> Dataset:
        """Map each element to a dataset and chain them in order."""
        return Dataset(ops.FlatMap(self._op, map_func))

    def prefetch(self, buffer_size: int) -> Dataset:
        """Run the pipeline so far in a background thread, ``buffer_size`` elements ahead.

        ``AUTOTUNE`` is 64 elements; 0 turns prefetching off. The thread and the consumer
        each hold at most ``buffer_size`` elements (they hand over a buffer at a time), and
        the thread stops as soon as the iterator is closed or dropped.
        """
        return Dataset(ops.Prefetch(self._op, buffer_size))

    def enumerate(self, start: int = 0) -> Dataset:
        """Pair each element with its index: ``(i, x)``."""
        return Dataset(ops.Enumerate(self._op, start))

    def concatenate(self, dataset: Dataset) -> Dataset:
        """This dataset's elements, then ``dataset``'s."""
        if not isinstance(dataset, Dataset):
            raise TypeError(f"concatenate() takes a Dataset, got {type(dataset).__name__}")
        return Dataset(ops_more.Concatenate(self._op, dataset._op))

    def bucket_by_sequence_length(self, element_length_func: Callable[..., Any], bucket_boundaries: list[int],
                                  bucket_batch_sizes: list[int], padded_shapes: Any = None,
                                  padding_values: Any = None, pad_to_bucket_boundary: bool = False,
                                  no_padding: bool = False, drop_remainder: bool = False) -> Dataset:
        """Batch elements of similar length together.

        ``element_length_func(x)`` gives a length; an element goes to bucket ``i`` when
        ``bucket_boundaries[i-1] <= length < bucket_boundaries[i]``; bucket ``i`` emits a padded
        batch when it holds ``bucket_batch_sizes[i]`` elements.
        """
        return Dataset(ops_more.BucketBySequenceLength(
            self._op, element_length_func, bucket_boundaries, bucket_batch_sizes, padded_shapes,
            padding_values, pad_to_bucket_boundary, no_padding, drop_remainder))

    # -- the tf.data transformations beyond the core set (data/ops_more.py) ----------------
    @staticmethod
    def sample_from_datasets(datasets: list[Dataset], weights: Any = None, seed: int | None = None,
                             stop_on_empty_dataset: bool = False,
                             rerandomize_each_iteration: bool | None = None) -> Dataset:
        """Interleave ``datasets`` at random, input ``i`` chosen with probability ``weights[i]``.

        When an input ends, ``stop_on_empty_dataset`` ends the result; otherwise the others
        go on (their weights renormalised). A ``seed`` makes the order reproducible
        (different per repetition unless ``rerandomize_each_iteration=False``).
        """
        return Dataset(ops_more.SampleFromDatasets(
            _ops_of("sample_from_datasets", datasets), weights, seed, stop_on_empty_dataset,
            rerandomize_each_iteration))

    @staticmethod
    def choose_from_datasets(datasets: list[Dataset], choice_dataset: Dataset,
                             stop_on_empty_dataset: bool = True) -> Dataset:
        """Element k comes from ``datasets[choice_dataset[k]]`` (integer scalars).

        With ``stop_on_empty_dataset`` (TF's default) the result ends when a chosen input is
        empty; otherwise choices of an ended input are skipped.
        """
        if not isinstance(choice_dataset, Dataset):
            raise TypeError(f"choice_dataset must be a Dataset, got {type(choice_dataset).__name__}")
        return Dataset(ops_more.ChooseFromDatasets(
            _ops_of("choose_from_datasets", datasets), choice_dataset._op, stop_on_empty_dataset))

    def scan(self, initial_state: Any, scan_func: Callable[..., Any]) -> Dataset:
        """``scan_func(state, element) -> (new_state, output)``: a running computation."""
        return Dataset(ops_more.Scan(self._op, initial_state, scan_func))

    def window(self, size: int, shift: int | None = None, stride: int = 1,
               drop_remainder: bool = False) -> Dataset:
        """Windows of ``size`` elements as datasets (a structure of datasets for tuple/dict
        elements, as TF), starting every ``shift`` elements, taking every ``stride``-th one.

        ``ds.window(4).flat_map(lambda w: w.batch(4))`` turns windows into arrays.
        """
        return Dataset(ops_more.Window(self._op, size, shift, stride, drop_remainder))

    def group_by_window(self, key_func: Callable[..., Any], reduce_func: Callable[..., Any], window_size: int | None = None,
                        window_size_func: Callable[..., Any] | None = None) -> Dataset:
        """Group elements by ``key_func(x)`` (an int); a window of ``window_size`` elements of
        one key becomes ``reduce_func(key, window_dataset)``'s elements. Partial windows are
        reduced at the end of the input."""
        return Dataset(ops_more.GroupByWindow(self._op, key_func, reduce_func, window_size,
                                              window_size_func))

    def rebatch(self, batch_size: int, drop_remainder: bool = False) -> Dataset:
        """Re-cut batched elements into batches of ``batch_size`` (rows carry over between
        input batches)."""
        return Dataset(ops_more.Rebatch(self._op, batch_size, drop_remainder))

    def unique(self) -> Dataset:
        """Each distinct element once (integer or string scalars, as TF)."""
        return Dataset(ops_more.Unique(self._op))

    def ignore_errors(self, log_warning: bool = False) -> Dataset:
        """Drop elements whose production raised (a failing ``map`` call, an unreadable file)
        instead of failing; ``log_warning`` logs each dropped error."""
        return Dataset(ops_more.IgnoreErrors(self._op, log_warning))

    def autocache(self, force: str | None = None) -> Dataset:
        """Let the data service cache what comes before here, and serve later reads (epochs,
        jobs, trainers) from the cache when that is measured faster (issue 26, after Cachew).

        ``force``: ``"always"`` or ``"never"`` overrides the measured decision; None takes
        ``dataservice.autocache.force`` (``"auto"``). Only a source and element-wise ops
        (map, filter, flat_map, interleave, prefetch, ignore_errors) may come before it, and
        they must be deterministic. Outside the service it passes elements on. See
        docs/elastic.md."""
        return Dataset(ops_more.AutoCache(self._op, force))

    def cache(self, filename: str = "") -> Dataset:
        """Keep the elements of the first complete iteration (in memory, or in ``filename``)
        and replay them on later iterations."""
        return Dataset(ops_more.Cache(self._op, filename))

    @property
    def element_spec(self) -> Any:
        """The structure of :class:`~dask_dataservice.data.TensorSpec` of the elements.

        Found by producing the first element (the pipeline runs arbitrary Python, so shapes are
        not known beforehand); a batch without ``drop_remainder`` gets an unknown (``None``)
        first dimension, as in TF. An empty dataset raises ValueError.
        """
        it = iter(self)
        try:
            first = next(it)
        except StopIteration:
            raise ValueError("element_spec: the dataset is empty, so its elements have no spec") from None
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()
        spec = spec_of(first)
        op = self._op
        while isinstance(op, _SHAPE_PRESERVING):
            op = op.input
        if isinstance(op, (ops.Batch, ops_more.Rebatch)) and not op.drop_remainder:
            spec = relax_leading_dim(spec)
        return spec

    def apply(self, transformation_func: Callable[[Dataset], Dataset]) -> Dataset:
        """Return ``transformation_func(self)`` (e.g. ``ds.apply(dds.distribute(...))``)."""
        out = transformation_func(self)
        if not isinstance(out, Dataset):
            raise TypeError(
                f"apply(): transformation_func must return a Dataset, got {type(out).__name__}"
            )
        return out

    # ------------------------------------------------------------------------------------
    # iteration
    # ------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        return self.iterate()

    def iterate(self, split_provider: SplitProvider | Iterable[Any] | None = None, *,
                stats: _stats.PipelineStats | bool = True, autocache: Any = None) -> Iterator[Any]:
        """Iterate, reading only the splits that ``split_provider`` serves (if given).

        ``split_provider`` is a :class:`~dask_dataservice.data.splits.SplitProvider` or a list
        of splits (served once per repetition). ``stats``: keep per-op figures for
        :meth:`stats` (the default), ``False`` not to, or a
        :class:`~dask_dataservice.data._stats.PipelineStats` to keep them in (whose
        ``end()`` the caller then calls when the iteration is over). ``autocache``: the data
        worker's split cache that ``autocache()`` ops use (internal).
        """
        if split_provider is not None:
            self.check_splittable()
            if not isinstance(split_provider, SplitProvider):
                split_provider = ListSplitProvider(split_provider)
        end = stats is True  # figures of our own: they end with the iterator
        figures: _stats.PipelineStats | None
        if stats is True:
            figures = _stats.PipelineStats(self._op)
        elif stats is False:
            figures = None
        elif isinstance(stats, _stats.PipelineStats):
            figures = stats
        else:
            raise TypeError(f"iterate(): stats must be a bool or a PipelineStats, got "
                            f"{type(stats).__name__}")
        if figures is not None:
            if figures.root is None:
                figures.root = self._op
            _stats.LATEST[self._op] = figures
        it = self._op.iterate(IterContext(split_provider=split_provider, stats=figures,
                                          autocache=autocache))
        return it if figures is None else _stats.ended_iterator(it, figures, end)

    def stats(self) -> _stats.DatasetStats:
        """Per-op figures of this dataset's latest (or ongoing) iteration in this process, as
        Ray's ``Dataset.stats()``: a dict (``ops``: one row per op, source first, with
        elements in and out, own time per element, share of the time, buffer fill;
        ``bottleneck``: the op with the largest own time; ``wall_seconds``) that prints as a
        table (``print(ds.stats())``). See docs/dashboard.md for how each figure is counted.
        """
        latest = _stats.LATEST.get(self._op)
        if latest is None:
            return _stats.DatasetStats.of([])
        return latest.snapshot()

    def as_numpy_iterator(self) -> Iterator[Any]:
        """Iterate with every leaf as a numpy value (Python scalars become numpy scalars)."""
        it = iter(self)
        try:
            for x in it:
                yield _to_numpy(x)
        finally:  # stop background threads at once when abandoned, like iter(self)
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def to_torch(self, pin_memory: bool = False) -> Any:
        """This dataset with ``torch.Tensor`` leaves (zero-copy from writable numpy arrays), as
        a ``torch.utils.data.IterableDataset`` for ``DataLoader`` or a plain ``for`` loop.
        Needs ``pip install 'dask-dataservice[torch]'``; see :mod:`dask_dataservice.torch`."""
        return adapter("torch")(self, pin_memory=pin_memory)  # torch.IterableDataset

    def to_jax(self, device: Any = None) -> Any:
        """An iterable of this dataset's elements with ``jax.Array`` leaves, put on ``device``
        (a device or sharding; default: JAX's default device) with ``jax.device_put``. Needs
        ``pip install 'dask-dataservice[jax]'``; see :mod:`dask_dataservice.jax`."""
        return adapter("jax")(self, device)  # jax.JaxIterable

    def cardinality(self) -> int:
        """The number of elements, or ``INFINITE`` / ``UNKNOWN``, without running anything."""
        return self._op.cardinality()

    def __len__(self) -> int:
        n = self.cardinality()
        if n == INFINITE:
            raise TypeError("the dataset is infinite")
        if n == UNKNOWN:
            why = next((note for op in walk(self._op) if (note := op.cardinality_note())), None)
            raise TypeError("the length of the dataset is unknown"
                            + (f": {why}" if why else "; see cardinality()"))
        return n

    def __bool__(self) -> bool:
        return True

    # ------------------------------------------------------------------------------------
    # splits and identity
    # ------------------------------------------------------------------------------------
    def why_not_splittable(self) -> str | None:
        """Why this pipeline cannot be cut into splits (DYNAMIC / FILE sharding), or None."""
        srcs = _sources(self._op)
        if _planned(self._op):  # zip / concatenate / mixes: the plan decides (it enumerates)
            plan = _split_plan(self._op, None)
            return plan if isinstance(plan, str) else None
        source = cast(sources.Source, srcs[0])
        if not source.splittable:
            return source.why_not()
        for node in walk(self._op):
            reason = node.split_blocker()
            if reason:
                return reason
        return None

    @property
    def splittable(self) -> bool:
        """Whether :meth:`splits` works (see :meth:`why_not_splittable`)."""
        return self.why_not_splittable() is None

    def check_splittable(self) -> None:
        """Raise :class:`NotSplittableError` with the reason if the pipeline has no splits."""
        reason = self.why_not_splittable()
        if reason:
            raise NotSplittableError(f"this dataset cannot be split: {reason}")

    def splits(self, split_size: int | None = None) -> Sequence[Any]:
        """The splits of the pipeline's source, in order (small picklable descriptors).

        ``split_size`` sets the elements per split of index-range sources (default: about
        256 splits, at most 65,536 elements each; ``from_zarr`` uses ``rows_per_split``).
        """
        if split_size is not None:
            split_size = ops.check_int("split_size", split_size, minimum=1)
        split_size = _file_shard.split_size(self._op, split_size)  # a file name per split
        if not _planned(self._op):
            self.check_splittable()
            return self.source.splits(split_size)
        plan = _split_plan(self._op, split_size)
        if isinstance(plan, str):
            raise NotSplittableError(f"this dataset cannot be split: {plan}")
        return plan

    @property
    def source(self) -> sources.Source:
        """The pipeline's source op (the first, when there are several)."""
        return cast(sources.Source, _sources(self._op)[0])

    @property
    def is_file_based(self) -> bool:
        """True when every source of the pipeline is a list of files (FILE sharding applies:
        see :meth:`why_not_file_shardable`)."""
        return _file_shard.why_not_file_shardable(self._op) is None

    def why_not_file_shardable(self) -> str | None:
        """Why FILE sharding cannot give each worker whole files of this pipeline, or None.

        As TensorFlow's auto-shard, it looks below ``interleave`` / ``flat_map`` / ``map``
        (the readers) for the file names: ``list_files``, ``from_files``, the format readers
        and ``from_tensor_slices(filenames)`` read by such an op (see
        :mod:`dask_dataservice.data._file_shard`); the pipeline must also be splittable.
        """
        return _file_shard.why_not_file_shardable(self._op) or self.why_not_splittable()

    @property
    def has_shard_hint(self) -> bool:
        """True when the pipeline contains ``shard(SHARD_HINT, SHARD_HINT)``."""
        return any(isinstance(n, ops.Shard) and n.is_hint for n in walk(self._op))

    def with_shard_hint(self, num_shards: int, index: int) -> Dataset:
        """A copy with every ``shard(SHARD_HINT, SHARD_HINT)`` made ``shard(num_shards, index)``."""
        num_shards = ops.check_int("num_shards", num_shards, minimum=1)
        index = ops.check_int("index", index, minimum=0)
        if index >= num_shards:
            raise ValueError(f"index must be < num_shards ({num_shards}), got {index}")

        def rewrite(op: Op) -> Op:
            new_inputs = tuple(rewrite(child) for child in op.inputs)
            if isinstance(op, ops.Shard) and op.is_hint:
                return ops.Shard(new_inputs[0], num_shards, index)
            if new_inputs == op.inputs:
                return op
            clone = copy.copy(op)
            clone.inputs = new_inputs
            if hasattr(clone, "input"):
                clone.input = new_inputs[0]
            return clone

        return Dataset(rewrite(self._op))

    def fingerprint(self) -> str:
        """A hex digest that is the same for the same pipeline definition in any process."""
        return _fingerprint(self._op)

    def __repr__(self) -> str:
        """The pipeline as the calls that build it, and its cardinality (nothing is run):
        ``<Dataset.range(1000).shuffle(1024).batch(32) cardinality=32>``."""
        from ._repr import cardinality_name, pipeline_repr

        token = REPR_ONLY.set(True)  # no RPC from a repr (a from_dataset_id source)
        try:
            text = pipeline_repr(self._op)
            card = cardinality_name(self.cardinality())
        except Exception as e:  # noqa: BLE001 - a repr must not raise
            return f"<{type(self).__name__} ({type(e).__name__} in repr)>"
        finally:
            REPR_ONLY.reset(token)
        if type(self) is not Dataset:  # a DistributedDataset
            text = f"{type(self).__name__} {text}"
        return f"<{text} cardinality={card}>"


def _to_numpy(x: Any) -> Any:
    if isinstance(x, (np.ndarray, np.generic)):
        return x
    if isinstance(x, tuple):
        items = [_to_numpy(v) for v in x]
        return type(x)(*items) if hasattr(x, "_fields") else tuple(items)
    if isinstance(x, dict):
        return {k: _to_numpy(v) for k, v in x.items()}
    if isinstance(x, (bool, int, float, complex)):
        return np.asarray(x)[()]
    return x


def _planned(op: Op) -> bool:
    """Whether the pipeline's splits come from :func:`_split_plan` (several sources, or a
    sample/choose, whose inputs read tagged splits), not straight from its one source."""
    return len(_sources(op)) > 1 or any(
        isinstance(n, (ops_more.SampleFromDatasets, ops_more.ChooseFromDatasets))
        for n in walk(op))


def _split_plan(op: Op, split_size: int | None, in_component: bool = False,
                read: bool = False) -> Sequence[Any] | str:
    """The splits of the pipeline rooted at ``op``, or the reason it has none.

    One source: its splits. ``concatenate``: the inputs' splits one after the other, tagged
    with the input (:class:`~dask_dataservice.data.splits.ComponentSplit`). ``zip``: the splits
    every component shares (see :func:`~dask_dataservice.data.splits.shared_splits`).
    ``read``: a reader op (interleave, flat_map, map) is above ``op``, so a list of file names
    below it is cut one name per split (:mod:`._file_shard`).
    """
    if op.is_source:
        source = cast(sources.Source, op)
        if not source.splittable:
            return source.why_not()
        return source.splits(_file_shard.source_split_size(source, read, split_size))
    read = read or _file_shard.is_reader(op)
    reason = op.split_blocker()
    if reason:
        return reason
    if in_component and isinstance(op, ops.Repeat):
        return ("repeat() inside an input of zip, concatenate, sample_from_datasets or "
                "choose_from_datasets cannot be split (each repetition would need the input's "
                "splits again); apply repeat() after them")
    if isinstance(op, ops_more.Concatenate):
        plan: list[Any] = []
        for k, child in enumerate(op.inputs):
            part = _split_plan(child, split_size, True, read)
            if isinstance(part, str):
                return part
            plan.extend(ComponentSplit(k, s) for s in part)
        return plan
    if isinstance(op, (ops_more.SampleFromDatasets, ops_more.ChooseFromDatasets)):
        data = op.mixed_inputs()  # choose_from_datasets' choice input is not split
        parts = [_split_plan(child, split_size, True, read) for child in data]
        for part in parts:
            if isinstance(part, str):
                return part
        return mixed_splits(cast(list[Sequence[Any]], parts), op.rates(),
                            [child.cardinality() for child in data])
    if isinstance(op, ops_more.Zip):
        parts = [_split_plan(child, split_size, True, read) for child in op.inputs]
        for part in parts:
            if isinstance(part, str):
                return part
        return shared_splits(cast(list[Sequence[Any]], parts), op.cardinality(), split_size,
                             lambda size: [_split_plan(c, size, True, read) for c in op.inputs])
    if len(op.inputs) != 1:
        return f"{op.name}() reads {len(op.inputs)} inputs and cannot be split"
    return _split_plan(op.inputs[0], split_size, in_component, read)


#: Ops that keep the shape of their input's elements (``element_spec`` looks through them).
_SHAPE_PRESERVING = (ops.Prefetch, ops.Take, ops.Skip, ops.Repeat, ops.Shuffle, ops.Filter,
                     ops.Shard, ops_more.Cache, ops_more.IgnoreErrors)


def _ops_of(what: str, datasets: Any) -> tuple[Op, ...]:
    if not isinstance(datasets, (list, tuple)) or not datasets:
        raise TypeError(f"{what}() takes a non-empty list of datasets, got {datasets!r:.60}")
    for d in datasets:
        if not isinstance(d, Dataset):
            raise TypeError(f"{what}() takes datasets, got {type(d).__name__}")
    return tuple(d._op for d in datasets)


def _expand(what: str, patterns: Any) -> list[str]:
    """The files that ``patterns`` (a path, directory, glob or URL, or a list of them) name,
    found where the dataset is defined (see :func:`~._fs.expand` for the rule)."""
    import os

    if isinstance(patterns, (str, os.PathLike)):
        patterns = [patterns]
    if not isinstance(patterns, (list, tuple)) or not patterns or not all(
            isinstance(p, (str, os.PathLike)) for p in patterns):
        raise TypeError(f"{what}() takes a path, directory, URL or glob, or a list of them; "
                        f"got {patterns!r:.60}")
    return _expand_globs([os.fspath(p) for p in patterns], what)


ops_more._DATASET[:] = [Dataset]  # window elements are datasets (see ops_more)
