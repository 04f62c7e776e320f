"""The split API (splits, split providers, splittability, SHARD_HINT) and fingerprints."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import zarr
from _helpers import FAST, elements, py
from hypothesis import given
from hypothesis import strategies as st

from dask_dataservice.data import (
    SHARD_HINT,
    ComponentSplit,
    Dataset,
    FileSplit,
    IndexRange,
    ListSplitProvider,
    NotSplittableError,
    SplitProvider,
    readers,
)

pytestmark = pytest.mark.pure


class RecordingProvider(SplitProvider):
    """Serves ``per_repetition[r]`` in repetition ``r`` and records every call."""

    def __init__(self, per_repetition):
        self.per_repetition = [list(s) for s in per_repetition]
        self.repetition = 0
        self.pos = 0
        self.calls = []

    def get_next(self):
        self.calls.append("get")
        splits = self.per_repetition[self.repetition % len(self.per_repetition)]
        if self.pos >= len(splits):
            return None
        self.pos += 1
        return splits[self.pos - 1]

    def reset(self):
        self.calls.append("reset")
        self.repetition += 1
        self.pos = 0


# ------------------------------------------------------------------------------------------
# split descriptors and enumeration
# ------------------------------------------------------------------------------------------


def test_split_descriptors_are_small_and_picklable():
    for split in (IndexRange(10, 20), FileSplit("/data/part-0001.npy")):
        blob = pickle.dumps(split)
        assert len(blob) < 200
        assert pickle.loads(blob) == split
    assert len(IndexRange(3, 7)) == 4 and len(IndexRange(5, 5)) == 0


@pytest.mark.slow
def test_the_splits_of_a_million_files_pickle_as_their_paths():
    """Issue 22 s5: registering a million file splits took 15 s, most of it pickling a
    million ``FileSplit`` objects; they pickle as the tuple of paths now, and equal the
    list of ``FileSplit`` they stand for (a static shard's slice is a plain list)."""
    import cloudpickle

    from dask_dataservice.data.splits import FileSplits

    paths = [f"/data/part-{i:07d}" for i in range(1_000_000)]
    splits = Dataset.from_files(paths, readers.text_lines).splits()
    assert isinstance(splits, FileSplits) and len(splits) == 1_000_000
    blob = cloudpickle.dumps(splits)
    assert len(blob) < sum(map(len, paths)) + 4 * len(paths)  # paths and framing only
    back = cloudpickle.loads(blob)
    assert back == splits == [FileSplit(p) for p in paths]
    assert back[7] == FileSplit(paths[7]) and back[-1] == FileSplit(paths[-1])
    assert back[3::400_000] == [FileSplit(paths[i]) for i in (3, 400_003, 800_003)]
    assert list(Dataset.list_files([__file__]).splits()) == [FileSplit(__file__)]
    assert splits != [FileSplit("other")] and repr(splits) == "FileSplits(1000000 files)"


def test_a_fingerprint_of_many_paths_is_the_one_hashed_path_by_path():
    """The bulk hashing of a tuple of strings feeds the very bytes of the per-item one: a
    journaled fingerprint stays the same dataset after an upgrade."""
    import hashlib

    from dask_dataservice.data import _fingerprint

    paths = (f"/d/é-{i}" for i in range(1000))
    paths = tuple(paths)
    bulk = hashlib.blake2b()
    _fingerprint._feed(bulk, paths, set())
    by_item = hashlib.blake2b()
    by_item.update(b"tuple1000")
    for p in paths:
        by_item.update(b"str")
        by_item.update(repr(p).encode())
    assert bulk.digest() == by_item.digest()


def _check_cover(splits, n):
    assert all(isinstance(s, IndexRange) for s in splits)
    assert [i for s in splits for i in range(s.start, s.stop)] == list(range(n))
    assert all(len(s) > 0 for s in splits)


@FAST
@given(n=st.integers(0, 80), split_size=st.integers(1, 90))
def test_range_and_tensor_slices_splits_cover_once_in_order(n, split_size):
    for ds, want in (
        (Dataset.range(n), list(range(n))),
        (Dataset.range(5, 5 + 3 * n, 3), list(range(5, 5 + 3 * n, 3))),
        (Dataset.from_tensor_slices((np.arange(n), np.arange(n) * 2)),
         [(i, 2 * i) for i in range(n)]),
    ):
        splits = ds.splits(split_size)
        _check_cover(splits, n)
        assert all(len(s) == split_size for s in splits[:-1])
        assert [py(x) for x in ds.iterate(splits)] == want
        # one split at a time, in reverse: only that split, in the order served
        got = [py(x) for s in reversed(splits) for x in ds.iterate([s])]
        assert got == [x for s in reversed(splits) for x in want[s.start:s.stop]]


@pytest.fixture(scope="module")
def zarr_store(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("zarr") / "rows.zarr")
    z = zarr.create_array(store=path, shape=(37, 2), chunks=(5, 2), dtype="i4")
    z[:] = np.arange(74).reshape(37, 2)
    return path


@FAST
@given(split_size=st.integers(1, 40))
def test_from_zarr_splits_cover_once_in_order(zarr_store, split_size):
    rows = np.arange(74).reshape(37, 2).tolist()
    for ds in (Dataset.from_zarr(zarr_store, rows_per_split=split_size),
               Dataset.from_zarr(zarr_store).map(lambda r: r)):
        splits = ds.splits() if ds.source.rows_per_split == split_size else ds.splits(split_size)
        _check_cover(splits, 37)
        assert [py(x) for x in ds.iterate(splits)] == rows
        assert [py(x) for x in ds.iterate(splits[1::2])] == [
            r for s in splits[1::2] for r in rows[s.start:s.stop]
        ]


def test_default_splits():
    assert Dataset.from_zarr(zarr.create_array(store={}, shape=(10,), chunks=(3,), dtype="i1")
                             ).splits() == [IndexRange(0, 3), IndexRange(3, 6), IndexRange(6, 9),
                                            IndexRange(9, 10)]
    big = Dataset.range(10_000).splits()
    assert 200 <= len(big) <= 256
    _check_cover(big, 10_000)
    assert Dataset.range(3).splits() == [IndexRange(0, 1), IndexRange(1, 2), IndexRange(2, 3)]
    assert Dataset.range(0).splits() == []


def test_file_sources_have_one_file_split_per_file(tmp_path):
    paths = []
    for i in range(3):
        paths.append(str(tmp_path / f"{i}.txt"))
        (tmp_path / f"{i}.txt").write_text(f"a{i}\nb{i}\n")
    files = Dataset.list_files(str(tmp_path / "*.txt"))
    assert files.splits() == [FileSplit(p) for p in paths]
    assert files.is_file_based
    assert list(files.iterate([FileSplit(paths[2]), FileSplit(paths[0])])) == [paths[2], paths[0]]
    lines = Dataset.from_files(paths, readers.text_lines).map(str.upper)
    assert lines.splits() == [FileSplit(p) for p in paths]
    assert list(lines.iterate([FileSplit(paths[1])])) == ["A1", "B1"]
    # list_files -> interleave(from_files): the outer source is split, the inner read whole
    nested = files.interleave(lambda p: Dataset.from_files(p, readers.text_lines), cycle_length=2)
    assert nested.splittable
    assert list(nested.iterate([FileSplit(paths[1]), FileSplit(paths[2])])) == [
        "a1", "a2", "b1", "b2"
    ]


def test_provider_with_wrong_split_type_is_a_type_error(tmp_path):
    with pytest.raises(TypeError, match="IndexRange"):
        list(Dataset.range(4).iterate([FileSplit("x")]))
    (tmp_path / "f").write_text("")
    with pytest.raises(TypeError, match="FileSplit"):
        list(Dataset.list_files(str(tmp_path / "f")).iterate([IndexRange(0, 1)]))


# ------------------------------------------------------------------------------------------
# providers and repeat
# ------------------------------------------------------------------------------------------


@pytest.mark.component
def test_ops_above_the_source_run_unchanged_on_served_splits():
    ds = Dataset.range(20).map(lambda x: x * 2).filter(lambda x: x % 3 != 0).batch(2)
    splits = [IndexRange(10, 15), IndexRange(0, 4)]
    want = [x * 2 for x in [10, 11, 12, 13, 14, 0, 1, 2, 3] if (x * 2) % 3 != 0]
    got = [b.tolist() for b in ds.iterate(splits)]
    assert got == [want[i:i + 2] for i in range(0, len(want), 2)]
    # also through threads (prefetch and parallel map read the provider from another thread)
    threaded = Dataset.range(20).map(lambda x: x * 2, num_parallel_calls=2).prefetch(2)
    assert list(threaded.iterate(splits)) == [x * 2 for x in [10, 11, 12, 13, 14, 0, 1, 2, 3]]


def test_repeat_resets_the_provider_between_repetitions():
    provider = RecordingProvider([[IndexRange(0, 2)], [IndexRange(5, 7)], [IndexRange(8, 9)]])
    assert list(Dataset.range(10).repeat(3).iterate(provider)) == [0, 1, 5, 6, 8]
    assert provider.calls.count("reset") == 2  # between repetitions, not before or after
    assert provider.calls[0] == "get" and provider.calls[-1] == "get"
    lp = ListSplitProvider(Dataset.range(6).splits(4))
    assert list(Dataset.range(6).repeat(2).iterate(lp)) == [0, 1, 2, 3, 4, 5] * 2
    assert lp.repetition == 1
    # a list of splits is served again every repetition
    assert list(Dataset.range(6).repeat(2).iterate([IndexRange(4, 6)])) == [4, 5, 4, 5]


def test_infinite_repeat_over_a_provider_with_no_splits_ends():
    assert list(Dataset.range(6).repeat().iterate([])) == []


def test_shuffle_under_a_provider_permutes_the_served_elements():
    ds = Dataset.range(100).shuffle(10, seed=3)
    got = list(ds.iterate([IndexRange(50, 60), IndexRange(0, 5)]))
    assert sorted(got) == list(range(5)) + list(range(50, 60))


# ------------------------------------------------------------------------------------------
# splittability
# ------------------------------------------------------------------------------------------


def test_splittable_pipelines():
    for ds in (
        Dataset.range(10).map(str).batch(2).prefetch(1).repeat(2),
        Dataset.from_tensor_slices(np.arange(4)).shuffle(2).take(3).skip(1).enumerate(),
        Dataset.range(3).interleave(lambda x: Dataset.from_generator(lambda: iter([x]))),
    ):
        assert ds.splittable
        assert ds.why_not_splittable() is None
        ds.check_splittable()


def test_from_generator_is_not_splittable():
    ds = Dataset.from_generator(lambda: iter(range(3))).map(str)
    assert not ds.splittable
    reason = ds.why_not_splittable()
    assert "from_generator" in reason
    with pytest.raises(NotSplittableError, match="from_generator"):
        ds.check_splittable()
    with pytest.raises(NotSplittableError, match="from_generator"):
        ds.splits()
    with pytest.raises(NotSplittableError):
        ds.iterate([IndexRange(0, 1)])
    assert issubclass(NotSplittableError, ValueError)


def test_shard_after_the_source_is_not_splittable():
    for ds in (Dataset.range(10).shard(2, 0), Dataset.range(10).map(str).shard(3, 1).batch(2),
               Dataset.range(10).shard(SHARD_HINT, SHARD_HINT)):
        assert not ds.splittable
        assert "shard" in ds.why_not_splittable()
        with pytest.raises(NotSplittableError, match="shard"):
            ds.splits()


def _two_workers(ds, split_size=3):
    """Read ``ds`` as two DYNAMIC workers would: one gets the even splits, one the odd."""
    splits = ds.splits(split_size)
    return [py(x) for x in ds.iterate(splits[0::2])], [py(x) for x in ds.iterate(splits[1::2])]


def test_concatenate_splits_are_the_first_inputs_then_the_seconds():
    a, b = Dataset.range(10), Dataset.range(100, 105).map(lambda x: x * 2)
    ds = a.concatenate(b)
    assert ds.splittable and ds.why_not_splittable() is None
    splits = ds.splits(4)
    assert splits == [ComponentSplit(0, IndexRange(0, 4)), ComponentSplit(0, IndexRange(4, 8)),
                      ComponentSplit(0, IndexRange(8, 10)), ComponentSplit(1, IndexRange(0, 4)),
                      ComponentSplit(1, IndexRange(4, 5))]
    assert [py(x) for x in ds.iterate(splits)] == elements(ds)
    one, two = _two_workers(ds, 4)
    assert one == [0, 1, 2, 3, 8, 9, 208]  # splits 0, 2, 4
    assert two == [4, 5, 6, 7, 200, 202, 204, 206]  # splits 1, 3
    # a worker that gets only the second input's splits reads only those
    assert [py(x) for x in ds.iterate(splits[3:])] == [200, 202, 204, 206, 208]


def test_zip_components_share_each_split():
    a, b = Dataset.range(10), Dataset.range(100, 130)
    for ds in (Dataset.zip(a, b), Dataset.zip({"x": a, "y": b.map(lambda v: -v)})):
        assert ds.splittable
        splits = ds.splits(3)
        assert splits == [IndexRange(0, 3), IndexRange(3, 6), IndexRange(6, 9), IndexRange(9, 10)]
        one, two = _two_workers(ds)
        assert sorted(map(str, one + two)) == sorted(map(str, elements(ds)))
        assert len(one) + len(two) == 10
    one, two = _two_workers(Dataset.zip(a, b))
    assert one == [(0, 100), (1, 101), (2, 102), (6, 106), (7, 107), (8, 108)]  # pairs stay paired
    assert two == [(3, 103), (4, 104), (5, 105), (9, 109)]


def test_nested_zip_and_concatenate_with_repeat_after_them():
    a, b = Dataset.range(6), Dataset.range(10, 16)
    ds = Dataset.zip(a, b).concatenate(Dataset.zip(b, a)).repeat(2)
    one, two = _two_workers(ds, 2)
    assert sorted(one + two) == sorted(elements(ds))
    assert len(one + two) == 24
    # ListSplitProvider serves the same splits again on every repetition
    assert one[: len(one) // 2] == one[len(one) // 2:]


def test_unsplittable_zip_and_concatenate_say_why():
    a = Dataset.range(4)
    gen = Dataset.from_generator(lambda: iter(range(3)))
    cases = {
        "from_generator": [Dataset.zip(a, gen), a.concatenate(gen)],
        "repeat() inside an input of zip, concatenate": [a.repeat(2).concatenate(a),
                                                          Dataset.zip(a.repeat(), a)],
        "share their splits": [Dataset.zip(a, Dataset.list_files(__file__))],
        "shard": [a.shard(2, 0).concatenate(a)],
    }
    for needle, datasets in cases.items():
        for ds in datasets:
            assert not ds.splittable
            assert needle in ds.why_not_splittable()
            with pytest.raises(NotSplittableError, match=re.escape(needle)):
                ds.splits()
    assert list(a.concatenate(a)) == [0, 1, 2, 3] * 2  # still iterable locally


def test_splits_argument_checks():
    with pytest.raises(ValueError, match="split_size"):
        Dataset.range(4).splits(0)
    with pytest.raises(TypeError, match="split_size"):
        Dataset.range(4).splits(1.5)


# ------------------------------------------------------------------------------------------
# SHARD_HINT
# ------------------------------------------------------------------------------------------


@pytest.mark.component
def test_shard_hint_must_be_rewritten_before_local_iteration():
    ds = Dataset.range(10).shard(SHARD_HINT, SHARD_HINT).map(lambda x: x * 2).prefetch(2)
    assert ds.has_shard_hint
    with pytest.raises(ValueError, match=r"SHARD_HINT.*with_shard_hint"):
        list(ds)
    assert repr(SHARD_HINT) == "SHARD_HINT"
    assert pickle.loads(pickle.dumps(SHARD_HINT)) is SHARD_HINT
    with pytest.raises(ValueError, match="SHARD_HINT"):
        Dataset.range(4).shard(SHARD_HINT, 0)


@FAST
@given(n=st.integers(0, 40), num_shards=st.integers(1, 5))
def test_with_shard_hint_partitions(n, num_shards):
    ds = Dataset.range(n).map(lambda x: x + 1).shard(SHARD_HINT, SHARD_HINT).batch(2).unbatch()
    parts = []
    for i in range(num_shards):
        rewritten = ds.with_shard_hint(num_shards, i)
        assert not rewritten.has_shard_hint
        parts.append([int(x) for x in rewritten])
        assert parts[-1] == [x + 1 for x in range(n)][i::num_shards]
    assert sorted(x for p in parts for x in p) == [x + 1 for x in range(n)]
    assert ds.has_shard_hint  # the original is unchanged


def test_with_shard_hint_in_every_branch_and_arguments():
    a = Dataset.range(6).shard(SHARD_HINT, SHARD_HINT)
    b = Dataset.range(10, 16).shard(SHARD_HINT, SHARD_HINT)
    ds = Dataset.zip(a, b).concatenate(Dataset.zip(b, a))
    assert list(ds.with_shard_hint(3, 1)) == [(1, 11), (4, 14), (11, 1), (14, 4)]
    with pytest.raises(ValueError, match="index"):
        ds.with_shard_hint(2, 2)
    with pytest.raises(ValueError, match="num_shards"):
        ds.with_shard_hint(0, 0)
    plain = Dataset.range(3).map(str)
    assert list(plain.with_shard_hint(2, 1)) == ["0", "1", "2"]


# ------------------------------------------------------------------------------------------
# fingerprints
# ------------------------------------------------------------------------------------------

FINGERPRINT_SCRIPT = textwrap.dedent('''
    import json, sys, threading
    import numpy as np
    from dask_dataservice.data import Dataset, AUTOTUNE

    SCALE = int(sys.argv[1])  # a module global that one pipeline reads
    LOCK = threading.Lock()  # globals that cannot be hashed by value
    MIXED = {"lock": [threading.Lock()], "n": 3}

    def scaled(x):
        return x * SCALE

    def make_closure(offset, words):
        def keep(x):
            return str(x + offset) in words
        return keep

    def pipeline(offset=1, const=2, words=("1", "2", "3")):
        return (Dataset.range(100)
                .map(lambda x: x * const, num_parallel_calls=AUTOTUNE)
                .filter(make_closure(offset, set(words)))
                .filter(lambda x: x in {"alpha", "beta", "gamma", "delta", "epsilon"} or True)
                .interleave(lambda x: Dataset.from_tensor_slices(np.arange(3) + x))
                .shuffle(10, seed=4)
                .batch(8))

    fps = {
        "base": pipeline().fingerprint(),
        "offset": pipeline(offset=2).fingerprint(),
        "const": pipeline(const=3).fingerprint(),
        "words": pipeline(words=("1", "2", "4")).fingerprint(),
        "batch": pipeline().unbatch().batch(9).fingerprint(),
        "global": Dataset.range(5).map(scaled).fingerprint(),
        "process-specific globals": Dataset.range(5).map(lambda x: (x, LOCK, MIXED)).fingerprint(),
        "data": Dataset.from_tensor_slices(np.arange(5.0)).fingerprint(),
        "data2": Dataset.from_tensor_slices(np.arange(5.0) + 1).fingerprint(),
    }
    print(json.dumps(fps))
''')


def _fingerprints(tmp_path, scale, hashseed):
    script = tmp_path / "fp_script.py"
    script.write_text(FINGERPRINT_SCRIPT)
    env = {**os.environ, "PYTHONHASHSEED": str(hashseed)}
    out = subprocess.run([sys.executable, str(script), str(scale)], capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.process
def test_fingerprint_same_definition_same_fingerprint_across_processes(tmp_path):
    a = _fingerprints(tmp_path, scale=2, hashseed=1)
    b = _fingerprints(tmp_path, scale=2, hashseed=2)  # other process, other string hashing
    assert a == b
    assert len(set(a.values())) == len(a), "different definitions share a fingerprint"
    c = _fingerprints(tmp_path, scale=3, hashseed=1)
    assert c["global"] != a["global"]  # the function reads a global that changed
    assert {k: v for k, v in c.items() if k != "global"} == {
        k: v for k, v in a.items() if k != "global"
    }


def test_fingerprint_in_process():
    def build(k):
        return Dataset.range(10).map(lambda x: x + k).batch(2)

    assert build(1).fingerprint() == build(1).fingerprint()
    assert build(1).fingerprint() != build(2).fingerprint()
    variants = [
        Dataset.range(10),
        Dataset.range(11),
        Dataset.range(10).batch(2),
        Dataset.range(10).batch(2, drop_remainder=True),
        Dataset.range(10).shuffle(4, seed=1),
        Dataset.range(10).shuffle(4, seed=2),
        Dataset.range(10).map(lambda x: x + 1),
        Dataset.range(10).map(lambda x: x - 1),
        Dataset.range(10).map(lambda x: x, num_parallel_calls=2),
        Dataset.range(10).take(3),
        Dataset.range(10).skip(3),
        Dataset.range(10).shard(2, 0),
        Dataset.range(10).shard(2, 1),
        Dataset.range(10).repeat(2),
        Dataset.range(10).prefetch(2),
        Dataset.range(10).enumerate(),
        Dataset.zip(Dataset.range(10), Dataset.range(10)),
        Dataset.zip({"a": Dataset.range(10), "b": Dataset.range(10)}),
        Dataset.range(10).concatenate(Dataset.range(10)),
        Dataset.from_tensor_slices(np.arange(10)),
        Dataset.from_tensor_slices(np.arange(10, dtype=np.int32)),
    ]
    fps = [v.fingerprint() for v in variants]
    assert len(set(fps)) == len(fps)
    assert all(isinstance(f, str) and len(f) == 32 for f in fps)


@pytest.mark.component
def test_fingerprint_does_not_depend_on_the_cpu_count(monkeypatch):
    from dask_dataservice.data import AUTOTUNE, ops

    def build():
        return (Dataset.range(10).map(lambda x: x, num_parallel_calls=AUTOTUNE)
                .interleave(lambda x: Dataset.range(x), num_parallel_calls=AUTOTUNE)
                .interleave(lambda x: Dataset.range(x), cycle_length=AUTOTUNE))

    monkeypatch.setattr(ops, "autotune_threads", lambda: 2)
    two = build()
    monkeypatch.setattr(ops, "autotune_threads", lambda: 64)
    many = build()
    assert two._op.input.input.num_parallel_calls == 2  # the setting did apply
    assert many._op.input.input.num_parallel_calls == 64
    assert (two._op.cycle_length, many._op.cycle_length) == (2, 64)
    assert two.fingerprint() == many.fingerprint()
    assert sorted(two) == sorted(many)
