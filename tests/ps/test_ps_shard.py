"""Component tier: a PS shard and its serial lane, without a cluster."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from dask_dataservice.errors import ShapeMismatchError
from dask_dataservice.ps import _kernels
from dask_dataservice.ps._shard import Lane, Shard
from dask_dataservice.ps._types import ShardInfo

pytestmark = pytest.mark.pure


@pytest.fixture
def pool():
    with ThreadPoolExecutor(2, thread_name_prefix="test-lane") as ex:
        yield ex


@pytest.mark.component
def test_lane_runs_in_submission_order_one_at_a_time(pool):
    lane = Lane(pool)
    gate = threading.Event()
    order, running = [], []

    def job(i):
        running.append(i)
        assert len(running) == 1  # never two jobs of one lane at once
        if i == 0:
            assert gate.wait(5)
        order.append(i)
        running.remove(i)
        return i

    futs = [lane.submit(job, i) for i in range(20)]
    assert not lane.idle and lane.pending == 20  # 0 runs (gated), 19 queued
    gate.set()
    assert [f.result(5) for f in futs] == list(range(20))
    assert order == list(range(20))
    futs[-1].result()
    # idle once the drain loop saw the empty queue
    for _ in range(1000):
        if lane.idle:
            break
        threading.Event().wait(0.001)
    assert lane.idle and lane.pending == 0


@pytest.mark.component
def test_lane_close_fails_queued_work(pool):
    lane = Lane(pool)
    gate = threading.Event()
    first = lane.submit(gate.wait, 5)
    queued = lane.submit(lambda: "never")
    lane.close(RuntimeError("closing"))
    gate.set()
    assert first.result(5) is True
    with pytest.raises(RuntimeError, match="closing"):
        queued.result(5)


def test_lane_on_a_shut_down_executor_fails_instead_of_hanging():
    pool = ThreadPoolExecutor(1)
    pool.shutdown()
    fut = Lane(pool).submit(lambda: 1)
    with pytest.raises(RuntimeError):
        fut.result(1)


def test_shard_updates_exactly_once_and_copy_on_write():
    shard = Shard("k", np.zeros(4, "f4"))
    assert shard.update("assign_add", np.ones(4, "f4"), fn_id=7, seq=1)
    assert not shard.update("assign_add", np.ones(4, "f4"), fn_id=7, seq=1)  # a re-run
    exported = shard.read()
    assert shard.update("assign_sub", np.full(4, 0.5, "f4"), fn_id=7, seq=2)
    np.testing.assert_array_equal(exported, np.ones(4))  # the sent buffer is untouched
    np.testing.assert_array_equal(shard.value, np.full(4, 0.5))
    assert shard.forget(below=8, above=7) == 1 and shard.applied == {}
    # 0-d shards stay arrays through copy on write (a ufunc alone would return a scalar)
    scalar = Shard("s", np.array(1.0))
    scalar.read()
    scalar.update("assign_add", np.array(2.0))
    assert isinstance(scalar.value, np.ndarray) and scalar.value.shape == ()
    scalar.update("assign_add", np.array(2.0))
    assert float(scalar.value) == 5.0


@pytest.mark.parametrize("kind,ufunc", [("add", np.add), ("sub", np.subtract),
                                        ("mul", np.multiply), ("div", np.divide),
                                        ("max", np.maximum), ("min", np.minimum)])
def test_scatter_kinds_match_numpy_with_and_without_duplicates(kind, ufunc):
    rng = np.random.default_rng(0)
    base = rng.uniform(1, 2, (10, 3))
    for ids in (np.array([1, 4, 7]), np.array([7, 1, 7, 4, 1])):
        rows = rng.uniform(1, 2, (ids.size, 3))
        shard = Shard("k", base.copy())
        shard.scatter(kind, ids, rows)
        expected = base.copy()
        ufunc.at(expected, ids, rows)
        np.testing.assert_allclose(shard.value, expected)


def test_scatter_update_last_duplicate_wins_and_unknown_kinds_are_refused():
    shard = Shard("k", np.zeros((3, 2)))
    shard.scatter("update", np.array([2, 0, 2]), np.array([[1, 1], [2, 2], [3, 3]], "f8"))
    np.testing.assert_array_equal(shard.value, [[2, 2], [0, 0], [3, 3]])
    with pytest.raises(ValueError, match="unknown scatter kind"):
        _kernels.scatter_rows(shard.value, "pow", np.array([0]), np.ones((1, 2)))
    with pytest.raises(ValueError, match="unknown update kind"):
        _kernels.update_dense(shard.value, "assign_mul", 2.0)


def test_shard_optimizer_slots_snapshot_and_load():
    shard = Shard("k", np.ones((4, 2), "f4"))
    cfg = {"kind": "adagrad", "name": "ada", "learning_rate": 0.1,
           "initial_accumulator_value": 0.1, "epsilon": 1e-7}
    shard.apply(cfg, np.ones((2, 2), "f4"), np.array([0, 2]))
    value, slots = shard.snapshot(clean=True)
    assert not shard.dirty and set(slots["ada"]) == {"accumulator"}
    np.testing.assert_allclose(slots["ada"]["accumulator"][[0, 2]], 1.1, rtol=1e-6)
    np.testing.assert_array_equal(slots["ada"]["accumulator"][[1, 3]], np.float32(0.1))
    fresh = Shard("k", np.zeros((4, 2), "f4"))
    fresh.applied[3] = 1
    fresh.load(value, slots)
    np.testing.assert_array_equal(fresh.value, value)
    assert fresh.applied == {} and fresh.dirty


# -- initializers: conventions chosen by signature ----------------------------------------

def test_initializer_conventions():
    full, part, off = (10, 2), (4, 2), 6
    want = np.arange(20, dtype="f4").reshape(full)[6:10]

    def ours(shape, dtype, partition_offset):
        assert shape == part
        return np.arange(20, dtype=dtype).reshape(full)[partition_offset[0]:][:shape[0]]

    def tf_shard_info(shard_info):
        assert isinstance(shard_info, ShardInfo) and shard_info.offset == (6, 0)
        return np.arange(20, dtype="f4").reshape(full)[6:10]

    def keras(shape, dtype=None, **kwargs):
        assert shape == full and kwargs["partition_shape"] == part
        o = kwargs["partition_offset"][0]
        return np.arange(20, dtype=dtype).reshape(shape)[o:o + part[0]]

    def whole(shape, dtype):
        return np.arange(20, dtype=dtype).reshape(shape)

    for fn, sliced in ((ours, False), (tf_shard_info, False), (keras, False), (whole, True),
                       (lambda: np.arange(20, dtype="f4").reshape(full), True)):
        value, was_sliced = _kernels.initial_value(fn, part, "f4", off, full)
        np.testing.assert_array_equal(value, want)
        assert was_sliced is sliced, fn


def test_a_users_type_error_inside_an_initializer_surfaces_as_itself():
    def broken(shape, dtype, partition_offset):
        raise TypeError("my own bug")

    with pytest.raises(TypeError, match="my own bug"):
        _kernels.initial_value(broken, (2,), "f4", 0, (4,))
    with pytest.raises(ShapeMismatchError, match="initializer returned shape"):
        _kernels.initial_value(lambda: np.zeros(3), (2,), "f4", 0, (4,))
