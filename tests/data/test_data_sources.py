"""Sources of the pipeline library: range, from_tensor_slices, list_files, from_files (and the
readers), from_zarr, from_generator; plus what every Dataset must be (immutable, re-iterable,
picklable, Dask-free)."""

from __future__ import annotations

import subprocess
import sys
from collections import namedtuple

import cloudpickle
import numpy as np
import pytest
import zarr
from _helpers import FAST, elements, py  # noqa: E402,F401
from hypothesis import given
from hypothesis import strategies as st

from dask_dataservice.data import UNKNOWN, Dataset, FileSplit, IndexRange, readers

pytestmark = pytest.mark.pure

# ------------------------------------------------------------------------------------------
# range
# ------------------------------------------------------------------------------------------


@FAST
@given(
    start=st.integers(-20, 20),
    stop=st.integers(-20, 20),
    step=st.integers(-5, 5).filter(lambda s: s != 0),
)
def test_range_matches_python_range(start, stop, step):
    ds = Dataset.range(start, stop, step)
    assert list(ds) == list(range(start, stop, step))
    assert ds.cardinality() == len(range(start, stop, step))


def test_range_one_argument_is_stop():
    assert list(Dataset.range(4)) == [0, 1, 2, 3]
    assert list(Dataset.range(0)) == []
    assert list(Dataset.range(-3)) == []
    assert list(Dataset.range(np.int64(3))) == [0, 1, 2]


# ------------------------------------------------------------------------------------------
# from_tensor_slices
# ------------------------------------------------------------------------------------------


def test_from_tensor_slices_array_slices_axis_0():
    a = np.arange(12).reshape(4, 3)
    out = list(Dataset.from_tensor_slices(a))
    assert len(out) == 4
    for row, want in zip(out, a, strict=True):
        assert isinstance(row, np.ndarray)
        np.testing.assert_array_equal(row, want)
    assert Dataset.from_tensor_slices(a).cardinality() == 4


def test_from_tensor_slices_list_tuple_and_dict():
    assert elements(Dataset.from_tensor_slices([1, 2, 3])) == [1, 2, 3]
    assert elements(Dataset.from_tensor_slices(["a", "bc"])) == ["a", "bc"]
    xs, ys = np.arange(3), np.arange(6).reshape(3, 2)
    assert elements(Dataset.from_tensor_slices((xs, ys))) == [
        (0, [0, 1]), (1, [2, 3]), (2, [4, 5])
    ]
    out = elements(Dataset.from_tensor_slices({"x": xs, "y": ys}))
    assert out == [{"x": 0, "y": [0, 1]}, {"x": 1, "y": [2, 3]}, {"x": 2, "y": [4, 5]}]


def test_from_tensor_slices_nested_and_namedtuple():
    Pair = namedtuple("Pair", "a b")
    out = list(Dataset.from_tensor_slices(Pair(np.arange(2), np.array([5.0, 6.0]))))
    assert [type(x) for x in out] == [Pair, Pair]
    assert [py(tuple(x)) for x in out] == [(0, 5.0), (1, 6.0)]
    nested = {"a": (np.arange(2), {"b": np.array([[1], [2]])})}
    assert elements(Dataset.from_tensor_slices(nested)) == [
        {"a": (0, {"b": [1]})}, {"a": (1, {"b": [2]})}
    ]


@FAST
@given(n=st.integers(0, 30), width=st.integers(1, 4))
def test_from_tensor_slices_matches_numpy_rows(n, width):
    a = np.arange(n * width, dtype=np.float32).reshape(n, width)
    b = np.arange(n)
    assert elements(Dataset.from_tensor_slices((a, b))) == [
        (a[i].tolist(), int(b[i])) for i in range(n)
    ]


def test_from_tensor_slices_does_not_alias_later_changes_of_a_list():
    data = [1, 2, 3]
    ds = Dataset.from_tensor_slices(data)
    data.append(4)
    assert elements(ds) == [1, 2, 3]


# ------------------------------------------------------------------------------------------
# list_files / from_files / readers
# ------------------------------------------------------------------------------------------


@pytest.fixture
def text_files(tmp_path):
    paths = []
    for i in (2, 0, 1):  # written out of order: list_files sorts
        p = tmp_path / f"part-{i}.txt"
        p.write_text("".join(f"f{i} line{j}\n" for j in range(i + 1)))
        paths.append(p)
    (tmp_path / "other.csv").write_text("x\n")
    return tmp_path


def test_list_files_sorted_and_matching_only(text_files):
    ds = Dataset.list_files(str(text_files / "part-*.txt"))
    want = [str(text_files / f"part-{i}.txt") for i in range(3)]
    assert list(ds) == want
    assert ds.cardinality() == 3
    both = Dataset.list_files([str(text_files / "*.csv"), str(text_files / "part-0.txt")])
    assert list(both) == sorted([str(text_files / "other.csv"), str(text_files / "part-0.txt")])


def test_list_files_shuffle_is_a_seeded_permutation(tmp_path):
    for i in range(12):
        (tmp_path / f"{i:02d}.bin").write_bytes(b"")
    pattern = str(tmp_path / "*.bin")
    ordered = list(Dataset.list_files(pattern))
    a = list(Dataset.list_files(pattern, shuffle=True, seed=7))
    b = list(Dataset.list_files(pattern, shuffle=True, seed=7))
    assert sorted(a) == ordered
    assert a == b  # same seed, same order
    assert a != ordered  # 1/12! chance of a false failure
    reps = list(Dataset.list_files(pattern, shuffle=True, seed=7).repeat(2))
    assert reps[:12] == a and sorted(reps[12:]) == ordered and reps[12:] != a


def test_list_files_no_match_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no files match"):
        Dataset.list_files(str(tmp_path / "*.nothing"))


def test_from_files_text_lines(text_files):
    files = Dataset.list_files(str(text_files / "part-*.txt"))
    ds = Dataset.from_files(list(files), readers.text_lines)
    assert list(ds) == ["f0 line0", "f1 line0", "f1 line1", "f2 line0", "f2 line1", "f2 line2"]
    assert ds.cardinality() == UNKNOWN
    assert ds.splits() == [FileSplit(p) for p in files]


def test_text_lines_keeps_empty_lines_and_strips_crlf(tmp_path):
    p = tmp_path / "t.txt"
    p.write_bytes(b"a\r\n\r\nb\nc")
    assert list(readers.text_lines(str(p))) == ["a", "", "b", "c"]
    assert list(Dataset.from_files(p, readers.text_lines)) == ["a", "", "b", "c"]


def test_from_files_npy_reader(tmp_path):
    arrays = [np.arange(6).reshape(3, 2), np.arange(6, 10).reshape(2, 2)]
    paths = []
    for i, a in enumerate(arrays):
        paths.append(tmp_path / f"{i}.npy")
        np.save(paths[-1], a)
    out = list(Dataset.from_files(paths, readers.npy))
    assert [x.tolist() for x in out] == np.concatenate(arrays).tolist()
    assert all(type(x) is np.ndarray and x.flags.writeable for x in out)
    np.save(tmp_path / "scalar.npy", np.array(7))
    assert [int(x) for x in Dataset.from_files(tmp_path / "scalar.npy", readers.npy)] == [7]


def test_from_files_zarr_reader(tmp_path):
    paths = []
    for i in range(2):
        path = str(tmp_path / f"{i}.zarr")
        z = zarr.create_array(store=path, shape=(5, 2), chunks=(2, 2), dtype="i4")
        z[:] = np.arange(10).reshape(5, 2) + 100 * i
        paths.append(path)
    out = elements(Dataset.from_files(paths, readers.zarr_rows))
    assert out == (np.arange(10).reshape(5, 2)).tolist() + (np.arange(10).reshape(5, 2) + 100).tolist()
    assert elements(readers.zarr_rows(paths[0], block_rows=3)) == np.arange(10).reshape(5, 2).tolist()


def test_from_files_custom_reader_and_list_files_interleave(text_files):
    ds = Dataset.list_files(str(text_files / "part-*.txt")).interleave(
        lambda path: Dataset.from_files(path, readers.text_lines), cycle_length=3
    )
    assert list(ds) == ["f0 line0", "f1 line0", "f2 line0", "f1 line1", "f2 line1", "f2 line2"]


def test_from_files_closes_reader_when_abandoned(tmp_path):
    closed = []

    def reader(path):
        try:
            yield from range(100)
        finally:
            closed.append(path)

    (tmp_path / "a").write_text("")
    it = iter(Dataset.from_files(str(tmp_path / "a"), reader).take(2))
    assert list(it) == [0, 1]
    assert closed == [str(tmp_path / "a")]


# ------------------------------------------------------------------------------------------
# from_zarr
# ------------------------------------------------------------------------------------------


@pytest.fixture
def zarr_path(tmp_path):
    path = str(tmp_path / "data.zarr")
    z = zarr.create_array(store=path, shape=(11, 3), chunks=(4, 3), dtype="f8")
    z[:] = np.arange(33, dtype="f8").reshape(11, 3)
    return path


def test_from_zarr_path_reads_rows_and_splits_by_chunk(zarr_path):
    ds = Dataset.from_zarr(zarr_path)
    assert elements(ds) == np.arange(33.0).reshape(11, 3).tolist()
    assert ds.cardinality() == 11
    assert ds.splits() == [IndexRange(0, 4), IndexRange(4, 8), IndexRange(8, 11)]
    assert Dataset.from_zarr(zarr_path, rows_per_split=5).splits() == [
        IndexRange(0, 5), IndexRange(5, 10), IndexRange(10, 11)
    ]


def test_from_zarr_array_object_and_group_path(tmp_path):
    g = zarr.open_group(str(tmp_path / "g.zarr"), mode="w")
    x = g.create_array("x", shape=(4,), chunks=(3,), dtype="i8")
    y = g.create_array("y", shape=(4,), chunks=(3,), dtype="i8")
    x[:] = [1, 2, 3, 4]
    y[:] = [5, 6, 7, 8]
    assert elements(Dataset.from_zarr(x)) == [1, 2, 3, 4]
    assert elements(Dataset.from_zarr(str(tmp_path / "g.zarr"), path="y")) == [5, 6, 7, 8]
    # two arrays of one store, same shape and dtype: still two different datasets
    assert Dataset.from_zarr(x).fingerprint() != Dataset.from_zarr(y).fingerprint()
    assert (Dataset.from_zarr(str(tmp_path / "g.zarr"), path="x").fingerprint()
            != Dataset.from_zarr(str(tmp_path / "g.zarr"), path="y").fingerprint())


def test_from_zarr_in_memory_array_round_trips_through_cloudpickle():
    z = zarr.create_array(store={}, shape=(6, 2), chunks=(4, 2), dtype="i2")
    z[:] = np.arange(12).reshape(6, 2)
    ds = Dataset.from_zarr(z, rows_per_split=2).map(lambda r: r * 2)
    back = cloudpickle.loads(cloudpickle.dumps(ds))
    assert elements(back) == (np.arange(12).reshape(6, 2) * 2).tolist()
    assert len(back.splits()) == 3


def test_from_zarr_path_pickles_without_the_open_array(zarr_path):
    ds = Dataset.from_zarr(zarr_path)
    list(ds)  # opens (and caches) the array in this process
    blob = cloudpickle.dumps(ds)
    assert len(blob) < 2000  # a path and a few numbers, not an array handle
    assert elements(cloudpickle.loads(blob)) == np.arange(33.0).reshape(11, 3).tolist()


# ------------------------------------------------------------------------------------------
# from_generator
# ------------------------------------------------------------------------------------------


def test_from_generator_with_args_and_reiteration():
    def gen(n, scale):
        for i in range(n):
            yield {"i": i, "v": np.full(2, i * scale)}

    ds = Dataset.from_generator(gen, args=(3, 10))
    want = [{"i": 0, "v": [0, 0]}, {"i": 1, "v": [10, 10]}, {"i": 2, "v": [20, 20]}]
    assert elements(ds) == want
    assert elements(ds) == want  # a fresh generator each time
    assert ds.cardinality() == UNKNOWN
    assert elements(Dataset.from_generator(lambda: iter([1, 2]))) == [1, 2]


def test_from_generator_cleanup_runs_when_abandoned():
    state = {"closed": 0}

    def gen():
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            state["closed"] += 1

    assert list(Dataset.from_generator(gen).take(3)) == [0, 1, 2]
    assert state["closed"] == 1


# ------------------------------------------------------------------------------------------
# every Dataset
# ------------------------------------------------------------------------------------------


def test_dataset_is_immutable_and_reiterable():
    base = Dataset.range(6)
    mapped = base.map(lambda x: x * 10)
    batched = mapped.batch(4)
    assert list(base) == list(range(6))  # untouched by the transformations built on it
    assert list(mapped) == [0, 10, 20, 30, 40, 50]
    assert elements(batched) == [[0, 10, 20, 30], [40, 50]]
    assert elements(batched) == [[0, 10, 20, 30], [40, 50]]
    # two iterators over one dataset are independent
    a, b = iter(mapped), iter(mapped)
    assert [next(a), next(a), next(b), next(a), next(b)] == [0, 10, 0, 20, 10]


def test_as_numpy_iterator_makes_numpy_leaves():
    ds = Dataset.from_generator(lambda: iter([(1, {"f": 2.5, "s": "x"}), (2, {"f": 3.5, "s": "y"})]))
    out = list(ds.as_numpy_iterator())
    i, d = out[0]
    assert isinstance(i, np.integer) and isinstance(d["f"], np.floating)
    assert d["s"] == "x"
    assert py(out) == [(1, {"f": 2.5, "s": "x"}), (2, {"f": 3.5, "s": "y"})]


def test_len_and_bool():
    assert len(Dataset.range(5).batch(2)) == 3
    with pytest.raises(TypeError, match="infinite"):
        len(Dataset.range(5).repeat())
    with pytest.raises(TypeError, match="unknown"):
        len(Dataset.range(5).filter(lambda x: True))
    assert bool(Dataset.range(0))


@pytest.mark.process
def test_no_dask_import():
    code = (
        "import sys\n"
        "import dask_dataservice.data as d\n"
        "import numpy as np\n"
        "ds = d.Dataset.range(8).map(lambda x: x + 1, num_parallel_calls=2).prefetch(2)\n"
        "assert sum(ds) == 36\n"
        "ds.fingerprint()\n"
        "assert 'distributed' not in sys.modules, 'distributed imported'\n"
        "assert 'dask' not in sys.modules, 'dask imported'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_from_tensors_is_one_element_of_the_whole_structure():
    """Re-expresses TensorFlow's from_tensors_test.py (testFromTensors,
    testFromTensorsDataset-style structures): one element, the whole input, any structure."""
    x = np.arange(6).reshape(2, 3)
    ds = Dataset.from_tensors({"x": x, "y": (7, "a")})
    (element,) = list(ds)
    assert element["x"].tolist() == x.tolist() and element["x"].shape == (2, 3)
    assert element["y"][0] == 7 and element["y"][1] == "a"
    assert ds.cardinality() == 1
    assert [int(e) for e in Dataset.from_tensors(5).repeat(3)] == [5, 5, 5]
    assert [e.tolist() for e in Dataset.from_tensors([1, 2]).batch(2)] == [[[1, 2]]]
