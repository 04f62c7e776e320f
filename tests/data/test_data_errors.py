"""Errors that help: user exceptions keep their type and traceback and gain a note naming the
op (also across threads); bad arguments fail where the pipeline is defined, naming the
argument."""

from __future__ import annotations

import traceback

import numpy as np
import pytest
import zarr

from dask_dataservice.data import AUTOTUNE, SHARD_HINT, Dataset, readers

pytestmark = pytest.mark.pure


class UserError(Exception):
    """An exception type only user code raises."""


def user_frames(exc):
    return [f.name for f in traceback.extract_tb(exc.__traceback__)]


def library_notes(exc):
    return [n for n in getattr(exc, "__notes__", []) if n.startswith("dask_dataservice:")]


def bad_map(x):
    if x == 3:
        raise UserError(f"bad element {x}")
    return x


def bad_predicate(x):
    if x == 3:
        raise UserError("bad predicate")
    return True


def bad_interleave(x):
    if x == 3:
        raise UserError("bad interleave")
    return Dataset.range(2)


def bad_flat_map(x):
    if x == 3:
        raise UserError("bad flat_map")
    return Dataset.range(2)


def bad_generator():
    yield 1
    raise UserError("bad generator")


def bad_length(x):
    raise UserError("bad length")


def bad_reader(path):
    yield "first"
    raise UserError(f"cannot parse {path}")


def failing_reader_call(path):
    raise UserError("cannot open")


CASES = {
    "map": (lambda: Dataset.range(10).map(bad_map), "bad_map", "Dataset.map"),
    "map parallel": (lambda: Dataset.range(10).map(bad_map, num_parallel_calls=3), "bad_map",
                     "Dataset.map"),
    "map parallel unordered": (
        lambda: Dataset.range(10).map(bad_map, num_parallel_calls=AUTOTUNE, deterministic=False),
        "bad_map", "Dataset.map"),
    "map prefetch": (lambda: Dataset.range(10).map(bad_map).prefetch(2), "bad_map",
                     "Dataset.map"),
    "map parallel prefetch": (
        lambda: Dataset.range(10).prefetch(1).map(bad_map, num_parallel_calls=2).prefetch(3),
        "bad_map", "Dataset.map"),
    "filter": (lambda: Dataset.range(10).filter(bad_predicate), "bad_predicate",
               "Dataset.filter"),
    "filter prefetch": (lambda: Dataset.range(10).filter(bad_predicate).prefetch(1),
                        "bad_predicate", "Dataset.filter"),
    "interleave": (lambda: Dataset.range(10).interleave(bad_interleave, cycle_length=2),
                   "bad_interleave", "Dataset.interleave"),
    "interleave parallel": (
        lambda: Dataset.range(10).interleave(bad_interleave, cycle_length=2,
                                             num_parallel_calls=2), "bad_interleave",
        "Dataset.interleave"),
    "map inside parallel interleave": (
        lambda: Dataset.range(2).interleave(lambda x: Dataset.range(10).map(bad_map),
                                            cycle_length=2, num_parallel_calls=2),
        "bad_map", "Dataset.map"),
    "flat_map": (lambda: Dataset.range(10).flat_map(bad_flat_map), "bad_flat_map",
                 "Dataset.flat_map"),
    "from_generator": (lambda: Dataset.from_generator(bad_generator), "bad_generator",
                       "Dataset.from_generator"),
    "from_generator prefetch": (lambda: Dataset.from_generator(bad_generator).prefetch(4),
                                "bad_generator", "Dataset.from_generator"),
    "bucket length": (
        lambda: Dataset.range(3).map(np.ones).bucket_by_sequence_length(bad_length, [2], [1, 1]),
        "bad_length", "Dataset.bucket_by_sequence_length"),
}


@pytest.mark.component
@pytest.mark.parametrize("case", list(CASES))
def test_user_error_keeps_type_traceback_and_gets_a_note(case):
    make, fn_name, op = CASES[case]
    with pytest.raises(UserError) as info:
        list(make())
    exc = info.value
    assert type(exc) is UserError
    assert fn_name in user_frames(exc), f"the user's frame is missing: {user_frames(exc)}"
    notes = library_notes(exc)
    assert len(notes) == 1, notes  # only the innermost op annotates
    assert op + "(" in notes[0] and fn_name in notes[0]


def test_note_names_the_element():
    with pytest.raises(UserError) as info:
        list(Dataset.range(10).map(bad_map))
    assert "on element 3" in library_notes(info.value)[0]
    big = np.zeros((100, 100))
    with pytest.raises(UserError) as info:
        list(Dataset.from_tensor_slices(big[None]).map(lambda a: bad_map(3)))
    note = library_notes(info.value)[0]
    assert "shape=(100, 100)" in note and len(note) < 300  # summarised, not printed


@pytest.mark.component
def test_reader_errors(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("x\n")
    with pytest.raises(UserError) as info:
        list(Dataset.from_files(str(path), bad_reader))
    assert "bad_reader" in user_frames(info.value)
    note = library_notes(info.value)[0]
    assert "Dataset.from_files(" in note and "bad_reader" in note and "data.txt" in note
    with pytest.raises(UserError) as info:
        list(Dataset.from_files(str(path), failing_reader_call).prefetch(2))
    assert "failing_reader_call" in user_frames(info.value)
    assert "Dataset.from_files(" in library_notes(info.value)[0]
    # the library's readers: a missing file is the OS error, naming the op and the path
    with pytest.raises(FileNotFoundError) as info:
        list(Dataset.from_files(str(tmp_path / "missing.npy"), readers.npy))
    assert "missing.npy" in library_notes(info.value)[0]


@pytest.mark.component
def test_elements_before_the_error_are_delivered():
    it = iter(Dataset.range(10).map(bad_map, num_parallel_calls=2).prefetch(2))
    assert [next(it), next(it), next(it)] == [0, 1, 2]
    with pytest.raises(UserError):
        next(it)
    with pytest.raises(StopIteration):  # an iterator that failed is finished
        next(it)


def test_errors_of_the_library_name_the_problem():
    ragged = Dataset.from_generator(lambda: iter([np.zeros(2), np.zeros(3)]))
    with pytest.raises(ValueError, match="padded_batch") as info:
        list(ragged.batch(2))
    assert "Dataset.batch" in library_notes(info.value)[0]
    with pytest.raises(TypeError, match="must return a Dataset"):
        list(Dataset.range(3).interleave(lambda x: [x]))
    with pytest.raises(ValueError, match="leading axis"):
        list(Dataset.range(3).unbatch())
    with pytest.raises(ValueError, match="leading axis"):
        list(Dataset.range(3).map(lambda x: (x, np.arange(2))).unbatch())


# ------------------------------------------------------------------------------------------
# definition-time argument checks
# ------------------------------------------------------------------------------------------

R = Dataset.range(10)


def _zarr_array():
    return zarr.create_array(store={}, shape=(4,), chunks=(2,), dtype="i1")


BAD_ARGUMENTS = [
    # (builds the pipeline, exception type, pattern the message must match)
    (lambda: R.batch(0), ValueError, r"batch_size.*>= 1"),
    (lambda: R.batch(2.0), TypeError, r"batch_size.*integer"),
    (lambda: R.batch("2"), TypeError, "batch_size"),
    (lambda: R.batch(True), TypeError, "batch_size"),
    (lambda: R.batch(2, drop_remainder="no"), TypeError, "drop_remainder"),
    (lambda: R.padded_batch(-1), ValueError, "batch_size"),
    (lambda: R.map(3), TypeError, r"map_func.*callable"),
    (lambda: R.map(str, num_parallel_calls=0), ValueError, "num_parallel_calls"),
    (lambda: R.map(str, num_parallel_calls=-5), ValueError, "num_parallel_calls"),
    (lambda: R.map(str, num_parallel_calls=2.5), TypeError, "num_parallel_calls"),
    (lambda: R.map(str, deterministic="yes"), TypeError, "deterministic"),
    (lambda: R.filter(None), TypeError, r"predicate.*callable"),
    (lambda: R.shuffle(0), ValueError, "buffer_size"),
    (lambda: R.shuffle(None), TypeError, "buffer_size"),
    (lambda: R.shuffle(10, seed="x"), TypeError, "seed"),
    (lambda: R.shuffle(10, reshuffle_each_iteration="False"), TypeError,
     "reshuffle_each_iteration"),
    (lambda: R.repeat(-2), ValueError, "count"),
    (lambda: R.repeat(1.5), TypeError, "count"),
    (lambda: R.take(-2), ValueError, "count"),
    (lambda: R.take("3"), TypeError, "count"),
    (lambda: R.skip(None), TypeError, "count"),
    (lambda: R.shard(0, 0), ValueError, "num_shards"),
    (lambda: R.shard(2, 2), ValueError, r"index.*num_shards"),
    (lambda: R.shard(2, -1), ValueError, "index"),
    (lambda: R.shard(SHARD_HINT, 1), ValueError, "SHARD_HINT"),
    (lambda: R.interleave(3), TypeError, "map_func"),
    (lambda: R.interleave(str, cycle_length=0), ValueError, "cycle_length"),
    (lambda: R.interleave(str, block_length=0), ValueError, "block_length"),
    (lambda: R.interleave(str, num_parallel_calls=0), ValueError, "num_parallel_calls"),
    (lambda: R.interleave(str, deterministic=1), TypeError, "deterministic"),
    (lambda: R.flat_map("f"), TypeError, "map_func"),
    (lambda: R.prefetch(-3), ValueError, "buffer_size"),
    (lambda: R.prefetch(None), TypeError, "buffer_size"),
    (lambda: R.enumerate(1.5), TypeError, "start"),
    (lambda: R.concatenate([1, 2]), TypeError, "concatenate"),
    (lambda: Dataset.zip(R, [1]), TypeError, "zip"),
    (lambda: Dataset.zip(), ValueError, "zip"),
    (lambda: R.apply(lambda d: 3), TypeError, "transformation_func"),
    (lambda: R.bucket_by_sequence_length(len, [3, 2], [1, 1, 1]), ValueError,
     "bucket_boundaries"),
    (lambda: R.bucket_by_sequence_length(len, [3], [1]), ValueError, "bucket_batch_sizes"),
    (lambda: R.bucket_by_sequence_length(len, 3, [1, 1]), TypeError, "bucket_boundaries"),
    (lambda: R.bucket_by_sequence_length(len, [3], [1, 0]), ValueError,
     r"bucket_batch_sizes\[1\]"),
    (lambda: R.bucket_by_sequence_length(None, [3], [1, 1]), TypeError, "element_length_func"),
    (lambda: Dataset.range(1.5, 3), TypeError, "start"),
    (lambda: Dataset.range(1.5), TypeError, "stop"),  # range(stop), as in Python
    (lambda: Dataset.range(0, "9"), TypeError, "stop"),
    (lambda: Dataset.range(0, 9, 0), ValueError, "step"),
    (lambda: Dataset.from_tensor_slices((np.arange(3), np.arange(4))), ValueError,
     r"same length.*\[3, 4\]"),
    (lambda: Dataset.from_tensor_slices(np.float64(3.0)), ValueError, "at least one dimension"),
    (lambda: Dataset.from_tensor_slices([[1, 2], [3]]), ValueError, "from_tensor_slices"),
    (lambda: Dataset.from_tensor_slices(None), TypeError, "from_tensor_slices"),
    (lambda: Dataset.list_files(3), TypeError, "file_pattern"),
    (lambda: Dataset.list_files([3]), TypeError, "file_pattern"),
    (lambda: Dataset.list_files([]), ValueError, "pattern"),
    (lambda: Dataset.from_files([], readers.npy), ValueError, "path"),
    (lambda: Dataset.from_files([1], readers.npy), TypeError, "paths"),
    (lambda: Dataset.from_files(5, readers.npy), TypeError, "paths"),
    (lambda: Dataset.from_files(["a"], "npy"), TypeError, "reader"),
    (lambda: Dataset.from_zarr(np.arange(3)), TypeError, "zarr"),
    (lambda: Dataset.from_zarr(_zarr_array(), rows_per_split=0), ValueError, "rows_per_split"),
    (lambda: Dataset.from_zarr(_zarr_array(), rows_per_split=1.0), TypeError, "rows_per_split"),
    (lambda: Dataset.from_generator(iter([1])), TypeError, "generator"),
    (lambda: Dataset.from_generator(lambda: iter([1]), args=5), TypeError, "args"),
]


@pytest.mark.parametrize("build,exc_type,pattern", BAD_ARGUMENTS,
                         ids=[f"{i}-{case[2]}" for i, case in enumerate(BAD_ARGUMENTS)])
def test_bad_arguments_fail_at_definition_time(build, exc_type, pattern):
    with pytest.raises(exc_type, match=pattern) as info:
        build()
    assert type(info.value) is exc_type


def test_list_files_bad_arguments(tmp_path):
    (tmp_path / "a").write_text("")
    with pytest.raises(TypeError, match="shuffle"):
        Dataset.list_files(str(tmp_path / "a"), shuffle="yes")
    with pytest.raises(TypeError, match="seed"):
        Dataset.list_files(str(tmp_path / "a"), shuffle=True, seed="s")


def test_dataset_is_not_built_directly():
    with pytest.raises(TypeError, match="Dataset.range"):
        Dataset(3)


def test_batch_of_numbers_and_strings_is_an_error_not_a_string_array():
    mixed = Dataset.from_generator(lambda: iter([1, "a", 2]))
    with pytest.raises(ValueError, match="cannot batch numbers together with strings") as info:
        list(mixed.batch(3))
    assert "Dataset.batch" in "".join(getattr(info.value, "__notes__", []))
    arrays = Dataset.from_generator(lambda: iter([np.array([1, 2]), np.array(["a", "b"])]))
    with pytest.raises(ValueError, match="numbers together with strings"):
        list(arrays.batch(2))
    # strings alone, and numbers alone, batch as before
    assert list(Dataset.from_generator(lambda: iter(["a", "bc"])).batch(2))[0].tolist() == ["a", "bc"]
    assert list(Dataset.from_generator(lambda: iter([1, 2.5])).batch(2))[0].tolist() == [1.0, 2.5]
