"""Transformations against reference semantics in plain Python / numpy (tf.data's documented
behaviour where it is specific), cardinalities, and a cloudpickle round-trip of a pipeline
that uses every op."""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
from collections import Counter

import cloudpickle
import numpy as np
import pytest
import zarr
from _helpers import FAST, elements, py  # noqa: E402,F401
from hypothesis import given
from hypothesis import strategies as st

from dask_dataservice.data import AUTOTUNE, INFINITE, UNKNOWN, Dataset, readers

pytestmark = pytest.mark.pure


def check_cardinality(ds):
    """A known cardinality must equal the number of elements actually produced."""
    n = ds.cardinality()
    out = list(ds)
    if n >= 0:
        assert n == len(out), (n, len(out))
    return out


# ------------------------------------------------------------------------------------------
# map / filter
# ------------------------------------------------------------------------------------------


def test_map_unpacks_tuples_but_not_dicts():
    ds = Dataset.zip(Dataset.range(3), Dataset.range(10, 13)).map(lambda a, b: a + b)
    assert list(ds) == [10, 12, 14]
    d = Dataset.from_tensor_slices({"a": np.arange(3)}).map(lambda e: {"a2": e["a"] * 2})
    assert elements(d) == [{"a2": 0}, {"a2": 2}, {"a2": 4}]
    # a list returned by map_func is one leaf, not a structure to unpack later
    assert list(Dataset.range(2).map(lambda x: [x, x]).map(len)) == [2, 2]


@FAST
@given(xs=st.lists(st.integers(-50, 50), max_size=40), k=st.integers(1, 5))
def test_map_filter_reference(xs, k):
    ds = Dataset.from_tensor_slices(np.array(xs, dtype=np.int64).reshape(-1))
    got = check_cardinality(ds.map(lambda x: x * 3 + 1).filter(lambda x: x % k == 0))
    assert py(got) == [x * 3 + 1 for x in xs if (x * 3 + 1) % k == 0]


@pytest.mark.component
@FAST
@given(n=st.integers(0, 60), calls=st.sampled_from([1, 2, 3, 4, AUTOTUNE]))
def test_parallel_map_equals_sequential_map(n, calls):
    fn = lambda x: (x * x, str(x))  # noqa: E731
    seq = list(Dataset.range(n).map(fn))
    par = Dataset.range(n).map(fn, num_parallel_calls=calls)
    assert list(par) == seq
    assert par.cardinality() == n
    unordered = list(Dataset.range(n).map(fn, num_parallel_calls=calls, deterministic=False))
    assert Counter(unordered) == Counter(seq)


@pytest.mark.component
def test_parallel_map_nondeterministic_yields_in_completion_order():
    # element 0 is held until element 1 is out: only completion order can deliver that
    first_out = threading.Event()

    def fn(x):
        if x == 0:
            assert first_out.wait(10), "element 1 was never delivered before element 0"
        return x

    it = iter(Dataset.range(2).map(fn, num_parallel_calls=2, deterministic=False))
    assert next(it) == 1
    first_out.set()
    assert list(it) == [0]


# ------------------------------------------------------------------------------------------
# batch / unbatch / padded_batch
# ------------------------------------------------------------------------------------------


@FAST
@given(n=st.integers(0, 40), size=st.integers(1, 7), drop=st.booleans())
def test_batch_reference_and_cardinality(n, size, drop):
    ds = Dataset.range(n).batch(size, drop_remainder=drop)
    got = [b.tolist() for b in check_cardinality(ds)]
    want = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
    if drop:
        want = [b for b in want if len(b) == size]
    assert got == want


element_strategy = st.sampled_from(["scalar", "vector", "tuple", "dict"])


@FAST
@given(n=st.integers(0, 25), size=st.integers(1, 6), kind=element_strategy)
def test_batch_then_unbatch_is_identity(n, size, kind):
    def make(i):
        if kind == "scalar":
            return i
        if kind == "vector":
            return np.arange(3) + i
        if kind == "tuple":
            return (i, np.full((2, 2), float(i)))
        return {"id": i, "x": np.arange(2) * i, "nested": (np.int8(i),)}

    xs = [make(i) for i in range(n)]
    ds = Dataset.from_generator(lambda: iter(xs))
    assert elements(ds.batch(size).unbatch()) == [py(x) for x in xs]
    assert elements(ds.batch(size).unbatch().batch(size)) == elements(ds.batch(size))


def test_batch_of_structures_stacks_each_leaf():
    ds = Dataset.from_tensor_slices({"a": np.arange(5), "b": (np.ones((5, 2)), np.arange(5) * 2.0)})
    first = next(iter(ds.batch(3)))
    assert first["a"].tolist() == [0, 1, 2]
    assert first["b"][0].shape == (3, 2)
    assert first["b"][1].dtype == np.float64


def test_padded_batch_pads_to_the_longest_in_each_batch():
    seqs = [[1], [2, 2], [3, 3, 3], [4], [5, 5]]
    ds = Dataset.from_generator(lambda: (np.array(s) for s in seqs))
    got = [b.tolist() for b in ds.padded_batch(2)]
    assert got == [[[1, 0], [2, 2]], [[3, 3, 3], [4, 0, 0]], [[5, 5]]]
    assert [b.tolist() for b in ds.padded_batch(2, padded_shapes=[4], padding_values=-1,
                                                drop_remainder=True)] == [
        [[1, -1, -1, -1], [2, 2, -1, -1]], [[3, 3, 3, -1], [4, -1, -1, -1]]
    ]
    with pytest.raises(ValueError, match="larger than the padded shape"):
        list(ds.padded_batch(5, padded_shapes=[2]))


def test_padded_batch_structures_and_strings():
    xs = [(np.arange(n), n, np.array(["a"] * n)) for n in (1, 3)]
    ds = Dataset.from_generator(lambda: iter(xs))
    seq, n, s = next(iter(ds.padded_batch(2, padding_values=(9, 0, "-"))))
    assert seq.tolist() == [[0, 9, 9], [0, 1, 2]]
    assert n.tolist() == [1, 3]
    assert s.tolist() == [["a", "-", "-"], ["a", "a", "a"]]
    d = Dataset.from_generator(lambda: iter([{"x": np.ones((1, 2))}, {"x": np.ones((2, 1))}]))
    assert next(iter(d.padded_batch(2)))["x"].tolist() == [[[1, 1], [0, 0]], [[1, 0], [1, 0]]]


def test_batch_of_ragged_elements_points_to_padded_batch():
    ds = Dataset.from_generator(lambda: iter([np.zeros(1), np.zeros(2)]))
    with pytest.raises(ValueError, match="padded_batch"):
        list(ds.batch(2))


# ------------------------------------------------------------------------------------------
# shuffle
# ------------------------------------------------------------------------------------------


@FAST
@given(n=st.integers(0, 60), buf=st.integers(1, 80), seed=st.integers(0, 2**31))
def test_shuffle_is_a_reproducible_permutation(n, buf, seed):
    ds = Dataset.range(n).shuffle(buf, seed=seed)
    a = check_cardinality(ds)
    assert sorted(a) == list(range(n))
    assert list(ds) == a


def test_shuffle_actually_shuffles_and_buffer_limits_displacement():
    a = list(Dataset.range(100).shuffle(100, seed=1))
    assert a != list(range(100))
    assert list(Dataset.range(100).shuffle(100, seed=2)) != a
    assert list(Dataset.range(50).shuffle(1, seed=3)) == list(range(50))  # a buffer of 1
    # an element can come out at most buffer_size - 1 positions early
    small = list(Dataset.range(200).shuffle(5, seed=4))
    assert all(pos >= x - 4 for pos, x in enumerate(small))
    assert sorted(small) == list(range(200))


def test_shuffle_reshuffles_each_repetition():
    n = 30
    for seed in (None, 5):
        reps = list(Dataset.range(n).shuffle(n, seed=seed).repeat(3))
        epochs = [reps[i * n:(i + 1) * n] for i in range(3)]
        assert all(sorted(e) == list(range(n)) for e in epochs)
        assert len({tuple(e) for e in epochs}) == 3
        fixed = list(Dataset.range(n).shuffle(n, seed=seed, reshuffle_each_iteration=False).repeat(3))
        assert fixed[:n] == fixed[n:2 * n] == fixed[2 * n:]
    seeded = Dataset.range(n).shuffle(n, seed=9).repeat(3)
    assert list(seeded) == list(seeded)  # the sequence of epochs is reproducible too


def test_unseeded_shuffle_without_reshuffle_keeps_its_order_after_pickling():
    ds = Dataset.range(40).shuffle(40, reshuffle_each_iteration=False)
    once = list(ds)
    assert list(ds) == once
    assert list(cloudpickle.loads(cloudpickle.dumps(ds))) == once


# ------------------------------------------------------------------------------------------
# repeat / take / skip / shard
# ------------------------------------------------------------------------------------------


@FAST
@given(n=st.integers(0, 12), count=st.integers(0, 4), take=st.integers(-1, 30),
       skip=st.integers(-1, 30))
def test_repeat_take_skip_reference_and_cardinality(n, count, take, skip):
    base = list(range(n))
    rep = Dataset.range(n).repeat(count)
    assert check_cardinality(rep) == base * count
    taken = rep.take(take)
    want_taken = (base * count) if take == -1 else (base * count)[:take]
    assert check_cardinality(taken) == want_taken
    skipped = taken.skip(skip)
    want_skipped = [] if skip == -1 else want_taken[skip:]
    assert check_cardinality(skipped) == want_skipped


def test_cardinality_infinite_and_unknown():
    inf = Dataset.range(3).repeat()
    assert inf.cardinality() == INFINITE
    assert Dataset.range(3).repeat(-1).cardinality() == INFINITE
    assert list(inf.take(7)) == [0, 1, 2, 0, 1, 2, 0]
    assert inf.take(7).cardinality() == 7
    assert inf.skip(7).cardinality() == INFINITE
    assert inf.map(str).batch(2).cardinality() == INFINITE
    assert Dataset.range(0).repeat().cardinality() == 0
    assert list(Dataset.range(0).repeat()) == []  # and it does not spin forever
    unknown = Dataset.range(5).filter(lambda x: x > 2)
    assert unknown.cardinality() == UNKNOWN
    assert unknown.take(1).cardinality() == UNKNOWN
    assert unknown.repeat(0).cardinality() == 0
    assert list(unknown.repeat(0)) == []
    assert Dataset.range(4).batch(2).unbatch().cardinality() == UNKNOWN
    assert Dataset.range(4).flat_map(lambda x: Dataset.range(3)).cardinality() == UNKNOWN
    assert Dataset.range(4).interleave(lambda x: Dataset.range(3)).cardinality() == UNKNOWN
    assert Dataset.from_generator(lambda: iter([1])).cardinality() == UNKNOWN
    # zip with an input of unknown length: unknown (it may be the shortest)
    assert Dataset.zip(Dataset.range(10), unknown).cardinality() == UNKNOWN
    assert check_cardinality(Dataset.zip(Dataset.range(10), unknown)) == [(0, 3), (1, 4)]
    assert Dataset.zip(Dataset.range(10), inf).cardinality() == 10
    assert Dataset.zip(inf, inf).cardinality() == INFINITE
    assert Dataset.range(2).concatenate(inf).cardinality() == INFINITE
    assert Dataset.range(2).concatenate(unknown).cardinality() == UNKNOWN


@FAST
@given(n=st.integers(0, 50), num_shards=st.integers(1, 7), data=st.data())
def test_shard_partitions_exactly(n, num_shards, data):
    shards = []
    for index in range(num_shards):
        ds = Dataset.range(n).shard(num_shards, index)
        got = check_cardinality(ds)
        assert got == list(range(n))[index::num_shards]
        shards.append(got)
    union = [x for s in shards for x in s]
    assert sorted(union) == list(range(n))  # covers the input, no element twice
    assert len(set(union)) == len(union)
    # shard after a shuffle with a fixed seed also partitions
    seed = data.draw(st.integers(0, 100))
    shuffled = [list(Dataset.range(n).shuffle(8, seed=seed).shard(num_shards, i))
                for i in range(num_shards)]
    assert sorted(itertools.chain(*shuffled)) == list(range(n))


# ------------------------------------------------------------------------------------------
# interleave / flat_map
# ------------------------------------------------------------------------------------------


def reference_interleave(inputs, cycle_length, block_length):
    """tf.data's interleave, as documented: a cycle of ``cycle_length`` open iterators;
    ``block_length`` elements from each in turn; an exhausted iterator's slot is refilled from
    the input the next time the cycle reaches it."""
    inputs = iter(inputs)
    slots = [None] * cycle_length
    exhausted_input = False
    out = []
    i = 0
    while True:
        if slots[i] is None and not exhausted_input:
            nxt = next(inputs, None)
            if nxt is None:
                exhausted_input = True
            else:
                slots[i] = iter(nxt)
        if exhausted_input and all(s is None for s in slots):
            return out
        if slots[i] is not None:
            for _ in range(block_length):
                y = next(slots[i], None)
                if y is None:
                    slots[i] = None
                    break
                out.append(y)
        i = (i + 1) % cycle_length


@pytest.mark.component
def test_interleave_tf_docs_examples():
    ds = Dataset.range(1, 6).interleave(lambda x: Dataset.from_tensor_slices([x] * 4),
                                        cycle_length=2, block_length=4)
    assert elements(ds) == [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5]
    # tf.data's API docs (from_tensors(x).repeat(6)): ended slots are refilled in place
    ds6 = Dataset.range(1, 6).interleave(lambda x: Dataset.from_tensor_slices([x]).repeat(6),
                                         cycle_length=2, block_length=4)
    assert elements(ds6) == [1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4,
                             3, 3, 4, 4, 5, 5, 5, 5, 5, 5]
    assert elements(Dataset.range(1, 6).interleave(
        lambda x: Dataset.from_tensor_slices([x]).repeat(6), cycle_length=2, block_length=4,
        num_parallel_calls=2)) == elements(ds6)


@pytest.mark.component
@FAST
@given(lengths=st.lists(st.integers(0, 6), max_size=8), cycle=st.integers(1, 4),
       block=st.integers(1, 4), parallel=st.sampled_from([None, 2, AUTOTUNE]))
def test_interleave_matches_reference(lengths, cycle, block, parallel):
    inputs = [[(i, j) for j in range(n)] for i, n in enumerate(lengths)]
    ds = Dataset.from_tensor_slices(np.array(lengths, dtype=np.int64).reshape(-1)).enumerate().interleave(
        lambda i, n: Dataset.range(n).map(lambda j: (i, j)),
        cycle_length=cycle, block_length=block, num_parallel_calls=parallel)
    assert elements(ds) == reference_interleave(inputs, cycle, block)


def test_flat_map_chains_in_order():
    ds = Dataset.range(4).flat_map(lambda x: Dataset.range(x))
    assert list(ds) == [0, 0, 1, 0, 1, 2]
    assert list(Dataset.range(3).flat_map(lambda x: Dataset.range(0))) == []


# ------------------------------------------------------------------------------------------
# prefetch / enumerate / zip / concatenate / apply
# ------------------------------------------------------------------------------------------


@pytest.mark.component
@FAST
@given(n=st.integers(0, 200), buf=st.sampled_from([0, 1, 2, 7, AUTOTUNE]))
def test_prefetch_is_transparent(n, buf):
    ds = Dataset.range(n).map(lambda x: x * 2).prefetch(buf)
    assert check_cardinality(ds) == [x * 2 for x in range(n)]


def test_enumerate():
    assert list(Dataset.range(3).map(str).enumerate()) == [(0, "0"), (1, "1"), (2, "2")]
    assert list(Dataset.range(2).enumerate(start=5)) == [(5, 0), (6, 1)]
    assert Dataset.range(3).enumerate().cardinality() == 3


def test_zip_tuples_dicts_and_shortest():
    a, b = Dataset.range(3), Dataset.range(10, 15)
    want = [(0, 10), (1, 11), (2, 12)]
    assert list(Dataset.zip(a, b)) == want
    assert list(Dataset.zip((a, b))) == want
    assert list(Dataset.zip([a, b])) == want
    assert list(a.zip(b)) == want
    assert list(Dataset.zip({"x": a, "y": b})) == [{"x": x, "y": y} for x, y in want]
    assert Dataset.zip(a, b).cardinality() == 3
    assert list(Dataset.zip(a, b, a.map(str))) == [(0, 10, "0"), (1, 11, "1"), (2, 12, "2")]


def test_concatenate():
    ds = Dataset.range(3).concatenate(Dataset.range(10, 12))
    assert check_cardinality(ds) == [0, 1, 2, 10, 11]
    assert list(Dataset.range(0).concatenate(Dataset.range(1))) == [0]


def test_apply():
    def double_then_batch(d):
        return d.map(lambda x: x * 2).batch(2)

    assert elements(Dataset.range(4).apply(double_then_batch)) == [[0, 2], [4, 6]]


# ------------------------------------------------------------------------------------------
# bucket_by_sequence_length
# ------------------------------------------------------------------------------------------


def _bucket(length, bounds):
    return sum(length >= b for b in bounds)


@FAST
@given(lengths=st.lists(st.integers(1, 12), max_size=40), drop=st.booleans())
def test_bucket_by_sequence_length_groups_by_bucket(lengths, drop):
    bounds, sizes = [3, 6, 9], [2, 3, 2, 4]
    seqs = [np.full(n, i + 1) for i, n in enumerate(lengths)]
    ds = Dataset.from_generator(lambda: iter(seqs)).bucket_by_sequence_length(
        len, bounds, sizes, drop_remainder=drop)
    seen = []
    for batch in ds:
        rows = [row[row != 0] for row in batch]  # unpad (ids are >= 1, padding is 0)
        buckets = {_bucket(len(r), bounds) for r in rows}
        assert len(buckets) == 1, "a batch mixes buckets"
        b = buckets.pop()
        assert len(rows) == sizes[b] or not drop
        assert len(rows) <= sizes[b]
        assert batch.shape[1] == max(len(r) for r in rows)  # padded to the longest
        seen.extend(int(r[0]) - 1 for r in rows)
    if not drop:
        assert sorted(seen) == list(range(len(lengths)))
    else:  # only whole batches: per bucket, count // size * size elements
        per = Counter(_bucket(n, bounds) for n in lengths)
        assert len(seen) == sum(c // sizes[b] * sizes[b] for b, c in per.items())


def test_bucket_by_sequence_length_pad_to_boundary_and_no_padding():
    seqs = [np.ones(n) for n in (1, 2, 4, 5, 4)]
    ds = Dataset.from_generator(lambda: iter(seqs))
    out = list(ds.bucket_by_sequence_length(len, [3, 7], [2, 2, 2], pad_to_bucket_boundary=True))
    assert [b.shape for b in out] == [(2, 2), (2, 6), (1, 6)]
    same = Dataset.from_generator(lambda: iter([np.ones(2), np.ones(2), np.ones(5)]))
    out = list(same.bucket_by_sequence_length(len, [3], [2, 2], no_padding=True))
    assert [b.shape for b in out] == [(2, 2), (1, 5)]
    with pytest.raises(ValueError, match="last boundary"):
        list(Dataset.from_generator(lambda: iter([np.ones(9)])).bucket_by_sequence_length(
            len, [3], [1, 1], pad_to_bucket_boundary=True))


# ------------------------------------------------------------------------------------------
# pickling: every op
# ------------------------------------------------------------------------------------------


def _every_op_pipeline(tmp_path):
    text = tmp_path / "lines.txt"
    text.write_text("alpha\nbeta\ngamma\n")
    for i in range(2):
        np.save(tmp_path / f"{i}.npy", np.arange(4).reshape(2, 2) + 10 * i)
    zpath = str(tmp_path / "z.zarr")
    z = zarr.create_array(store=zpath, shape=(6,), chunks=(4,), dtype="i8")
    z[:] = np.arange(6) * 7
    offset = 100  # closed over

    def gen(n):
        yield from range(n)

    ints = (
        Dataset.range(40)
        .map(lambda x: x + offset, num_parallel_calls=2)
        .filter(lambda x: x % 3 != 0)
        .shuffle(8, seed=1)
        .batch(3)
        .unbatch()
        .enumerate()
        .map(lambda i, x: x - offset, num_parallel_calls=AUTOTUNE, deterministic=True)
        .take(24)
        .skip(2)
        .shard(2, 1)
        .interleave(lambda x: Dataset.from_tensor_slices(np.array([x, -x])), cycle_length=2,
                    block_length=2, num_parallel_calls=2)
        .flat_map(lambda x: Dataset.range(2).map(lambda y: x * 10 + y))
        .prefetch(3)
        .repeat(2)
        .concatenate(Dataset.from_generator(gen, args=(3,)))
        .concatenate(Dataset.from_zarr(zpath, rows_per_split=2).map(int))
        .concatenate(Dataset.from_files(sorted(tmp_path.glob("*.npy")), readers.npy).map(
            lambda r: int(r.sum())))
    )
    words = (Dataset.list_files(str(text)).interleave(
        lambda p: Dataset.from_files(p, readers.text_lines)).repeat())
    return (
        Dataset.zip({"n": ints, "w": words, "t": Dataset.from_tensor_slices((np.arange(200),))})
        .map(lambda d: (np.arange(abs(int(d["n"])) % 5), d["w"]))
        .padded_batch(2, padding_values=(-1, ""))
        .unbatch()
        .bucket_by_sequence_length(lambda seq, w: len(seq) + 1, [3], [2, 3])
        .apply(lambda d: d.prefetch(2))
    )


@pytest.mark.component
def test_cloudpickle_round_trip_of_every_op(tmp_path):
    ds = _every_op_pipeline(tmp_path)
    want = elements(ds)
    assert len(want) > 10
    back = cloudpickle.loads(cloudpickle.dumps(ds))
    assert elements(back) == want
    assert back.fingerprint() == ds.fingerprint()
    # pickled again while an iterator is running (no per-iteration state on the pipeline)
    it = iter(ds)
    next(it)
    assert elements(cloudpickle.loads(cloudpickle.dumps(ds))) == want
    del it


@pytest.mark.process
def test_pickled_pipeline_runs_in_another_process(tmp_path):
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        ds = _every_op_pipeline(tmp_path)
        blob = tmp_path / "ds.pkl"
        blob.write_bytes(cloudpickle.dumps(ds))
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    code = (
        "import pickle, sys\n"
        "ds = pickle.load(open(sys.argv[1], 'rb'))\n"
        "print(repr([tuple(b.tolist() for b in x) for x in ds]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(blob)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == repr([tuple(b.tolist() for b in x) for x in ds])
