"""The tf.data transformations beyond the core set: TF's documented examples, re-expressed."""

from __future__ import annotations

import collections
import pickle

import cloudpickle
import numpy as np
import pytest
from _helpers import elements, py

from dask_dataservice.data import Dataset, TensorSpec
from dask_dataservice.data.splits import ListSplitProvider

pytestmark = pytest.mark.pure

D = Dataset


def windows(ds):
    return [[py(x) for x in w] for w in ds]


# -- window -------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "want"), [
    ((3,), [[0, 1, 2], [3, 4, 5], [6]]),
    ((3, None, 1, True), [[0, 1, 2], [3, 4, 5]]),
    ((3, 1, 2, True), [[0, 2, 4], [1, 3, 5], [2, 4, 6]]),      # TF's docstring
    ((3, 2, 1, True), [[0, 1, 2], [2, 3, 4], [4, 5, 6]]),      # TF's docstring
    ((2, 3), [[0, 1], [3, 4], [6]]),
    ((3, 2, 2), [[0, 2, 4], [2, 4, 6], [4, 6], [6]]),
])
def test_window_as_tf(args, want):
    ds = D.range(7).window(*args)
    assert windows(ds) == want
    assert ds.cardinality() == len(want)


def test_window_of_tuples_is_a_tuple_of_datasets_and_flat_maps_into_batches():
    ds = D.zip(D.range(5), D.range(10, 15)).window(2)
    first = next(iter(ds))
    assert isinstance(first, tuple) and all(isinstance(w, Dataset) for w in first)
    batched = ds.flat_map(lambda a, b: D.zip(a.batch(2), b.batch(2)))
    assert elements(batched) == [([0, 1], [10, 11]), ([2, 3], [12, 13]), ([4], [14])]
    with pytest.raises(ValueError, match="size must be >= 1"):
        D.range(3).window(0)


# -- group_by_window, rebatch, scan, unique -------------------------------------------------


def test_group_by_window_as_tf():
    ds = D.range(10).group_by_window(key_func=lambda x: x % 2,
                                     reduce_func=lambda key, w: w.batch(5), window_size=5)
    assert elements(ds) == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]  # TF's docstring
    partial = D.range(10).group_by_window(lambda x: x % 3, lambda k, w: w.batch(10),
                                          window_size_func=lambda k: 2 + k)
    got = elements(partial)
    assert sorted(x for b in got for x in b) == list(range(10))
    assert [0, 3] in got and [1, 4, 7] in got
    with pytest.raises(ValueError, match="exactly one of window_size"):
        D.range(3).group_by_window(lambda x: 0, lambda k, w: w)
    with pytest.raises(TypeError, match="integer scalar"):
        list(D.range(3).group_by_window(lambda x: "a", lambda k, w: w, window_size=2))
    with pytest.raises(TypeError, match="must return a Dataset"):
        list(D.range(3).group_by_window(lambda x: 0, lambda k, w: 5, window_size=2))


def test_rebatch_carries_rows_over():
    assert elements(D.range(10).batch(3).rebatch(4)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert elements(D.range(10).batch(3).rebatch(4, drop_remainder=True)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    ds = D.from_tensor_slices({"a": np.arange(6), "b": np.arange(6) * 2}).batch(4).rebatch(3)
    assert elements(ds) == [{"a": [0, 1, 2], "b": [0, 2, 4]}, {"a": [3, 4, 5], "b": [6, 8, 10]}]


def test_scan_running_sum_and_bad_return():
    assert elements(D.range(5).scan(0, lambda s, x: (s + x, s + x))) == [0, 1, 3, 6, 10]
    pairs = D.zip(D.range(3), D.range(3)).scan(10, lambda s, a, b: (s + 1, s + a + b))
    assert elements(pairs) == [10, 13, 16]
    with pytest.raises(TypeError, match=r"\(new_state, output\)"):
        list(D.range(2).scan(0, lambda s, x: s))


def test_unique_ints_and_strings_only():
    assert elements(D.from_tensor_slices(np.array([1, 2, 1, 3, 2])).unique()) == [1, 2, 3]
    assert elements(D.from_tensor_slices(np.array(["a", "b", "a"])).unique()) == ["a", "b"]
    with pytest.raises(TypeError, match="integer or string"):
        list(D.from_tensor_slices(np.array([1.5, 1.5])).unique())
    with pytest.raises(TypeError, match="scalar elements"):
        list(D.range(4).batch(2).unique())


# -- sample_from_datasets, choose_from_datasets -------------------------------------------


def test_sample_from_datasets_weights_and_exhaustion():
    a, b = D.range(1000).map(lambda x: 0), D.range(1000).map(lambda x: 1)
    got = elements(D.sample_from_datasets([a.repeat(), b.repeat()], weights=[0.8, 0.2], seed=3).take(5000))
    share = collections.Counter(got)[0] / len(got)
    assert 0.77 < share < 0.83
    # not stop_on_empty: everything of both inputs, exactly once
    both = elements(D.sample_from_datasets([D.range(5), D.range(100, 103)], seed=1))
    assert sorted(both) == [0, 1, 2, 3, 4, 100, 101, 102]
    assert [x for x in both if x < 100] == [0, 1, 2, 3, 4]  # each input keeps its order
    # stop_on_empty: ends when the first input is exhausted
    short = elements(D.sample_from_datasets([D.range(2), D.range(100, 200)], seed=1,
                                            stop_on_empty_dataset=True))
    assert len([x for x in short if x < 100]) == 2 and len(short) < 102
    # reproducible with a seed, per repetition different unless told otherwise
    ds = D.sample_from_datasets([D.range(50), D.range(100, 150)], seed=7)
    assert elements(ds) == elements(ds)
    with pytest.raises(ValueError, match="one entry per dataset"):
        D.sample_from_datasets([D.range(1), D.range(1)], weights=[1.0])
    with pytest.raises(ValueError, match="not all 0"):
        D.sample_from_datasets([D.range(1)], weights=[0.0])
    with pytest.raises(TypeError, match="non-empty list"):
        D.sample_from_datasets([])


def test_choose_from_datasets_as_tf():
    datasets = [D.from_tensor_slices(np.array(["foo"] * 3)), D.from_tensor_slices(np.array(["bar"] * 3)),
                D.from_tensor_slices(np.array(["baz"] * 3))]
    choice = D.range(3).repeat(3)
    assert elements(D.choose_from_datasets(datasets, choice)) == ["foo", "bar", "baz"] * 3  # TF's docstring
    # stop_on_empty_dataset (TF's default): ends at the first choice of an empty input
    assert elements(D.choose_from_datasets([D.range(1), D.range(10, 20)],
                                           D.from_tensor_slices(np.array([0, 1, 0, 1])))) == [0, 10]
    assert elements(D.choose_from_datasets([D.range(1), D.range(10, 20)],
                                           D.from_tensor_slices(np.array([0, 1, 0, 1])),
                                           stop_on_empty_dataset=False)) == [0, 10, 11]
    with pytest.raises(ValueError, match="out of range for 2 datasets"):
        list(D.choose_from_datasets([D.range(3), D.range(3)], D.from_tensor_slices(np.array([0, 2]))))
    with pytest.raises(TypeError, match="integer scalars"):
        list(D.choose_from_datasets([D.range(3)], D.from_tensor_slices(np.array([0.5]))))


# -- ignore_errors ---------------------------------------------------------------------------


@pytest.mark.component
def test_ignore_errors_drops_failing_elements_only_below_it(caplog):
    bad = D.range(6).map(lambda x: 1 // (x - 3))
    assert elements(bad.ignore_errors()) == [-1, -1, -1, 1, 0]
    assert elements(D.range(6).map(lambda x: 1 // (x - 3), num_parallel_calls=3).ignore_errors()) == [-1, -1, -1, 1, 0]
    assert elements(D.range(6).filter(lambda x: 1 // (x - 3) >= 0).ignore_errors()) == [4, 5]
    assert elements(D.range(4).flat_map(lambda x: D.range(1 // (x - 1))).ignore_errors()) == [0]
    with caplog.at_level("WARNING", logger="dask_dataservice.data"):
        list(bad.ignore_errors(log_warning=True))
    assert "ZeroDivisionError" in caplog.text
    # an op above ignore_errors still fails
    with pytest.raises(ZeroDivisionError):
        list(D.range(3).ignore_errors().map(lambda x: 1 // 0))


def test_ignore_errors_skips_an_unreadable_file(tmp_path):
    for i in range(3):
        (tmp_path / f"f{i}.txt").write_text("\n".join(f"{i}-{j}" for j in range(3)))
    (tmp_path / "f1.txt").write_bytes(b"\xff\xfe bad utf-8 \xff")
    ds = D.list_files(str(tmp_path / "*.txt")).interleave(
        lambda p: D.from_files(p, reader=lambda path: open(path, encoding="utf-8").read().split("\n")),
        cycle_length=1)
    with pytest.raises(UnicodeDecodeError):
        list(ds)
    assert elements(ds.ignore_errors()) == ["0-0", "0-1", "0-2", "2-0", "2-1", "2-2"]
    # under a split provider (how a DYNAMIC worker reads), a failing split is dropped
    direct = D.from_files([str(tmp_path / f"f{i}.txt") for i in range(3)],
                          reader=lambda path: open(path, encoding="utf-8").read().split("\n"))
    got = [py(x) for x in direct.ignore_errors().iterate(ListSplitProvider(direct.splits()))]
    assert got == ["0-0", "0-1", "0-2", "2-0", "2-1", "2-2"]


# -- cache -------------------------------------------------------------------------------------


def test_memory_cache_replays_the_first_complete_iteration():
    calls = []
    ds = D.range(5).map(lambda x: calls.append(x) or x * 2).cache()
    it = iter(ds)
    next(it)
    it.close()  # an incomplete iteration does not fill the cache
    assert elements(ds) == [0, 2, 4, 6, 8]
    n = len(calls)
    assert elements(ds) == [0, 2, 4, 6, 8]
    assert len(calls) == n  # served from the cache
    clone = cloudpickle.loads(cloudpickle.dumps(ds))
    assert clone._op._memory is None  # the cache does not travel with the pipeline
    assert elements(clone) == [0, 2, 4, 6, 8]
    assert not ds.splittable and "cache()" in ds.why_not_splittable()


def test_file_cache_survives_the_process_and_ignores_partial_writes(tmp_path):
    path = str(tmp_path / "c" / "cache")
    calls = []
    ds = D.range(4).map(lambda x: calls.append(x) or np.full(3, x)).cache(path)
    it = iter(ds)
    next(it)
    it.close()
    assert not (tmp_path / "c" / "cache.complete").exists()
    assert [p.name for p in (tmp_path / "c").iterdir()] == []  # the partial file is gone
    assert [py(x) for x in ds] == [[i] * 3 for i in range(4)]
    assert (tmp_path / "c" / "cache.complete").exists()
    calls.clear()
    again = pickle.loads(cloudpickle.dumps(ds))  # another process would see the same
    assert [py(x) for x in again] == [[i] * 3 for i in range(4)]
    assert calls == []


# -- element_spec --------------------------------------------------------------------------------


def test_element_spec():
    assert D.range(3).element_spec == TensorSpec((), np.int64)
    assert D.range(10).batch(4).element_spec == TensorSpec((None,), np.int64)
    assert D.range(10).batch(4, drop_remainder=True).element_spec == TensorSpec((4,), np.int64)
    spec = D.from_tensor_slices({"x": np.zeros((5, 2), np.float32), "y": np.arange(5)}).element_spec
    assert spec == {"x": TensorSpec((2,), np.float32), "y": TensorSpec((), np.int64)}
    assert spec["x"].is_compatible_with(np.ones(2, np.float32))
    assert not spec["x"].is_compatible_with(np.ones(3, np.float32))
    with pytest.raises(ValueError, match="empty"):
        _ = D.range(0).element_spec


def test_new_ops_pickle_and_fingerprint():
    pipelines = [
        D.range(10).window(3).flat_map(lambda w: w.batch(3)),
        D.range(10).group_by_window(lambda x: x % 2, lambda k, w: w.batch(2), window_size=2),
        D.range(10).batch(3).rebatch(2), D.range(10).scan(0, lambda s, x: (s + x, s)),
        D.range(10).unique(), D.range(10).ignore_errors(),
        D.sample_from_datasets([D.range(3), D.range(3)], seed=1),
        D.choose_from_datasets([D.range(3)], D.range(1)),
    ]
    fps = {p.fingerprint() for p in pipelines}
    assert len(fps) == len(pipelines)
    for p in pipelines:
        clone = cloudpickle.loads(cloudpickle.dumps(p))
        assert clone.fingerprint() == p.fingerprint()
        assert [str(x) for x in clone] == [str(x) for x in p]
