"""Values are never silently wrong (issue 11 s4): unsafe casts and nonsense partitioner
arguments are clear errors, on local variables, on parameter servers, and at the server.
Issue 22 s5: casts that overflow a float dtype, non-finite hyperparameters, ids beyond int64,
gradients of the wrong width and damaged checkpoint files are refused with errors naming the
variable (and the file); a variable without rows works end to end."""

from __future__ import annotations

import math
import os
import re

import numpy as np
import pytest
import zarr

import dask_dataservice as dds
from dask_dataservice.errors import CheckpointCorruptedError, ShapeMismatchError
from dask_dataservice.ps import _routing
from dask_dataservice.ps import optimizers as opt
from dask_dataservice.ps._kernels import cast_value
from dask_dataservice.ps._types import Call
from dask_dataservice.ps._types import wire as _wire
from dask_dataservice.testing import gen_cluster
from dask_dataservice.testing._ps import warm_up_zarr

pytestmark = [pytest.mark.pure, pytest.mark.timeout(60)]

warm_up_zarr()

from _helpers import PS, WK, in_thread  # noqa: E402


@pytest.mark.parametrize(("value", "dtype", "error", "match"), [
    (0.7, "i8", TypeError, r"float64 cannot become int64.*0\.7 is not a whole number"),
    (1e30, "i8", ValueError, r"1e\+30 is out of range \[-9223372036854775808"),
    (2.0 ** 63, "i8", ValueError, "out of range"),
    (np.nan, "i4", TypeError, "nan is not a whole number"),
    (2 ** 40, "i4", ValueError, "1099511627776 is out of range"),
    (-1, "u8", ValueError, "-1 is out of range"),
    (np.uint64(2 ** 63), "i8", ValueError, "out of range"),
    (1j, "f8", TypeError, "complex128 cannot become float64"),
    (2, "?", TypeError, "int64 cannot become bool"),
    (np.float32(3e9), "i4", ValueError, "out of range"),
    # a finite value that the cast makes inf (issue 22 s5; TensorFlow's conversion refuses too)
    (1e39, "f4", ValueError, r"float64 cannot become float32 without changing it: 1e\+39 is out "
     r"of its finite range \[-3\.4028234663852886e\+38, 3\.4028234663852886e\+38\]"),
    (-1e39, "f4", ValueError, r"-1e\+39 is out of its finite range"),
    (1e6, "f2", ValueError, r"float64 cannot become float16 .*1000000\.0 is out of its finite "
     r"range \[-65504\.0, 65504\.0\]"),
    (70000, "f2", ValueError, r"int64 cannot become float16 .*70000 is out of its finite range"),
    (np.float32(7e4), "f2", ValueError, r"float32 cannot become float16 .*70000\.0 is out"),
    ([1.0, np.inf, 1e39], "f4", ValueError, r"1e\+39 is out of its finite range"),
    (1e39 + 1j, "c8", ValueError, r"complex128 cannot become complex64 .*\(1e\+39\+1j\)"),
])
def test_unsafe_casts_are_refused(value, dtype, error, match):
    with pytest.raises(error, match=match):
        cast_value(value, dtype, "assign_add to variable 'v'")


@pytest.mark.parametrize(("value", "dtype", "expected"), [
    (2.0, "i8", 2), (-2.0 ** 63, "i8", -2 ** 63), (1, "i4", 1), (True, "i8", 1),
    (0.1, "f4", np.float32(0.1)), (3, "f4", 3.0), (2 ** 62, "f8", float(2 ** 62)),
    (1.5, "c8", 1.5), ([1, 2], "u1", [1, 2]),
    # inf and nan stay what they are, as TensorFlow keeps them; the largest finite values fit
    (np.inf, "f4", np.inf), (-np.inf, "f2", -np.inf), (np.nan, "f2", np.nan),
    ([np.nan, np.inf, 1.0], "f4", [np.nan, np.inf, 1.0]),
    (3.4028235e38, "f4", np.float32(3.4028235e38)),
    (65504.0, "f2", 65504.0), (2 ** 62, "f4", np.float32(2 ** 62)),
])
def test_value_preserving_casts_are_done(value, dtype, expected):
    out = cast_value(value, dtype, "x")
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out, expected)


def test_local_variable_refuses_unsafe_updates():
    v = dds.Variable(5, dtype="i8", name="counter")
    with pytest.raises(TypeError, match="assign_add to variable 'counter'.*0.7"):
        v.assign_add(0.7)
    with pytest.raises(ValueError, match="assign_add to variable 'counter'.*out of range"):
        v.assign_add(1e30)
    v.assign_add(2.0)
    assert int(v.numpy()) == 7
    with pytest.raises(TypeError, match="variable 'w'.*0.5 is not a whole number"):
        dds.Variable(0.5, dtype="i4", name="w")


@pytest.mark.cluster
@gen_cluster(client=False, nthreads=[PS, PS, WK])
async def test_remote_variables_refuse_unsafe_updates(s, p0, p1, w0):
    def body(c):
        strategy = dds.ParameterServerStrategy(
            c, variable_partitioner=dds.partitioners.FixedShardsPartitioner(2))
        with strategy.scope():
            counter = dds.Variable(0, dtype="i8", name="counter")
            table = dds.Variable(np.zeros((4, 2), "i4"), name="table")  # two shards
            with pytest.raises(TypeError, match="variable 'bad'.*0.5"):
                dds.Variable([0.5, 1.0], dtype="i8", name="bad")
        with pytest.raises(TypeError, match="assign_add to variable 'counter'.*0.7"):
            counter.assign_add(0.7)
        with pytest.raises(ValueError, match="out of range"):
            counter.assign_add(1e30)
        with pytest.raises(ValueError, match="assign to variable 'table'.*out of range"):
            table.assign(np.full((4, 2), 2 ** 40))
        with pytest.raises(TypeError, match="scatter_add to variable .*0.25"):
            table.scatter_add([1], [[0.25, 0.0]])

        def step():
            counter.assign_add(0.7)

        coord = dds.ClusterCoordinator(strategy)
        coord.schedule(step)
        with pytest.raises(TypeError, match="0.7 is not a whole number"):
            coord.join()
        counter.assign_add(3.0)
        assert int(counter.numpy()) == 3
        np.testing.assert_array_equal(table.numpy(), np.zeros((4, 2)))
        # the server checks too (any client may send it a raw update)
        reply = c.sync(c.rpc(counter.ps_address).ps_update, key=counter.key,
                       kind="assign_add", value=_wire(np.array(1e30)))
        with pytest.raises(ValueError, match=f"variable {counter.key!r}.*out of range"):
            _routing.check(reply, Call(counter.ps_address, "ps_update", {}))
        assert int(counter.numpy()) == 3
        coord.shutdown()

    await in_thread(s, body)


@pytest.mark.parametrize(("make", "error", "match"), [
    (lambda: dds.partitioners.FixedShardsPartitioner(0), ValueError, "`num_shards` must be positive"),
    (lambda: dds.partitioners.FixedShardsPartitioner(-3), ValueError, "`num_shards` must be positive"),
    (lambda: dds.partitioners.FixedShardsPartitioner(2.5), TypeError, "`num_shards` must be an int"),
    (lambda: dds.partitioners.FixedShardsPartitioner("2"), TypeError, "`num_shards` must be an int"),
    (lambda: dds.partitioners.FixedShardsPartitioner(True), TypeError, "`num_shards` must be an int"),
    (lambda: dds.partitioners.MinSizePartitioner(0), ValueError, "`min_shard_bytes` must be positive"),
    (lambda: dds.partitioners.MinSizePartitioner(max_shards=0), ValueError, "`max_shards`"),
    (lambda: dds.partitioners.MinSizePartitioner(max_shards=1.5), TypeError, "`max_shards` must be an int"),
    (lambda: dds.partitioners.MinSizePartitioner(float("nan")), ValueError, "`min_shard_bytes`"),
    (lambda: dds.partitioners.MinSizePartitioner("1k"), TypeError, "`min_shard_bytes` must be a number"),
    (lambda: dds.partitioners.MaxSizePartitioner(-1), ValueError, "`max_shard_bytes` must be positive"),
    (lambda: dds.partitioners.MaxSizePartitioner(float("inf")), ValueError, "`max_shard_bytes`"),
    (lambda: dds.partitioners.MaxSizePartitioner(10, max_shards=0), ValueError, "`max_shards`"),
    (lambda: dds.partitioners.MaxSizePartitioner(10, bytes_per_string=0), ValueError, "bytes_per_string"),
])
def test_partitioner_arguments_are_checked(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_partitioners_accept_numpy_ints_and_byte_floats():
    assert dds.partitioners.FixedShardsPartitioner(np.int64(3))(shape=(10,), dtype="f4") == [3]
    assert dds.partitioners.MinSizePartitioner(1e3, max_shards=4)(shape=(1000,), dtype="f4") == [4]


# ---------------------------------------------------------------------------------------
# issue 22 s5: values and messages
# ---------------------------------------------------------------------------------------

F4_RANGE = "[-3.4028234663852886e+38, 3.4028234663852886e+38]"


def _overflow(what: str, src: str, dst: str, value: str, bounds: str = F4_RANGE) -> str:
    return re.escape(f"{what}: a value of dtype {src} cannot become {dst} without changing it: "
                     f"{value} is out of its finite range {bounds} (the cast would make it inf; "
                     "TensorFlow refuses such a conversion too)")


@pytest.mark.cluster
@gen_cluster(client=False, nthreads=[PS, PS, WK])
async def test_casts_that_overflow_to_inf_are_refused_on_parameter_servers(s, p0, p1, w0):
    """Issue 22 s5: ``assign`` / ``assign_add`` of 1e39 into float32 (1e6 into float16) gave
    inf silently. Every route refuses it with a ValueError naming the variable, both dtypes
    and the value, and changes nothing; inf and nan themselves are kept (as TensorFlow)."""
    def body(c):
        strategy = dds.ParameterServerStrategy(
            c, variable_partitioner=dds.partitioners.FixedShardsPartitioner(2))
        with strategy.scope():
            v = dds.Variable(np.arange(4, dtype="f4"), name="v")  # two shards
            h = dds.Variable(np.float16(1), name="h")
            with pytest.raises(ValueError, match=_overflow("variable 'big'", "float64",
                                                           "float32", "1e+39")):
                dds.Variable([1.0, 1e39], dtype="f4", name="big")
        with pytest.raises(ValueError, match=_overflow("assign to variable 'v'", "float64",
                                                       "float32", "1e+39")):
            v.assign(1e39)
        with pytest.raises(ValueError, match=_overflow("assign_add to variable 'v'", "float64",
                                                       "float32", "-1e+39")):
            v.assign_add(np.array([0.0, 0.0, 0.0, -1e39]))
        f2 = "[-65504.0, 65504.0]"
        with pytest.raises(ValueError, match=_overflow("assign to variable 'h'", "float64",
                                                       "float16", "1000000.0", f2)):
            h.assign(1e6)
        with pytest.raises(ValueError, match=_overflow("assign_sub to variable 'h'", "int64",
                                                       "float16", "70000", f2)):
            h.assign_sub(70000)
        with pytest.raises(ValueError, match=_overflow("scatter_update to variable 'v'",
                                                       "float64", "float32", "1e+39")):
            v.scatter_update([3], [1e39])
        with pytest.raises(ValueError, match=_overflow("the gradient of variable 'v'",
                                                       "float64", "float32", "1e+39")):
            opt.SGD(0.1).apply_gradients([(np.full(4, 1e39), v)])

        coord = dds.ClusterCoordinator(strategy)
        coord.schedule(lambda: v.assign_add(1e39))
        with pytest.raises(ValueError, match=_overflow("assign_add to variable 'v'", "float64",
                                                       "float32", "1e+39")):
            coord.join()
        np.testing.assert_array_equal(v.numpy(), np.arange(4, dtype="f4"))
        assert h.numpy() == np.float16(1)
        # the server checks too (any client may send it a raw float64 update)
        shard = v.variables[0]
        reply = c.sync(c.rpc(shard.ps_address).ps_update, key=shard.key, kind="assign",
                       value=_wire(np.array([1e39, 0.0])))
        with pytest.raises(ValueError, match=_overflow(f"variable {shard.key!r}", "float64",
                                                       "float32", "1e+39")):
            _routing.check(reply, Call(shard.ps_address, "ps_update", {}))
        np.testing.assert_array_equal(v.numpy(), np.arange(4, dtype="f4"))
        # inf and nan are values of their own: kept, as TensorFlow keeps them
        v.assign([np.inf, -np.inf, np.nan, 3.4028235e38])
        np.testing.assert_array_equal(v.numpy(), np.array([np.inf, -np.inf, np.nan,
                                                           3.4028235e38], "f4"))
        h.assign(np.nan)
        assert np.isnan(h.numpy())
        coord.shutdown()

    await in_thread(s, body)


@pytest.mark.cluster
@gen_cluster(client=False, nthreads=[PS, WK])
async def test_non_finite_hyperparameters_are_refused(s, p0, w0):
    """Issue 22 s5: ``SGD(learning_rate=nan)`` (or inf) was accepted and turned every variable
    it updated into nan. Refused when the optimizer is built, and by the server for a raw
    update (any client may send one), which then changes nothing."""
    for make, message in [
        (lambda: opt.SGD(learning_rate=float("nan")),
         "learning_rate must be a finite, non-negative number, got nan"),
        (lambda: opt.SGD(learning_rate=math.inf),
         "learning_rate must be a finite, non-negative number, got inf"),
        (lambda: opt.SGD(learning_rate=-0.1),
         "learning_rate must be a finite, non-negative number, got -0.1"),
        (lambda: opt.Adagrad(initial_accumulator_value=float("nan")),
         "initial_accumulator_value must be a finite, non-negative number, got nan"),
        (lambda: opt.Adam(epsilon=math.inf),
         "epsilon must be a finite, non-negative number, got inf"),
        (lambda: opt.get({"kind": "sgd", "learning_rate": float("nan")}),
         "learning_rate must be a finite, non-negative number, got nan"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            make()

    def body(c):
        strategy = dds.ParameterServerStrategy(c)
        with strategy.scope():
            w = dds.Variable(np.ones(3, "f4"), name="w")
        sgd = opt.SGD(0.5)
        sgd.apply_gradients([(np.ones(3, "f4"), w)])
        np.testing.assert_array_equal(w.numpy(), np.full(3, 0.5, "f4"))
        for config, message in [
            ({**sgd.get_config(), "learning_rate": float("nan")},
             "optimizer 'SGD': learning_rate must be a finite, non-negative number, got nan"),
            ({**sgd.get_config(), "learning_rate": math.inf},
             "optimizer 'SGD': learning_rate must be a finite, non-negative number, got inf"),
            ({**opt.Adam().get_config(), "beta_1": float("nan")},
             "optimizer 'Adam': beta_1 must be in [0, 1), got nan"),
        ]:
            reply = c.sync(c.rpc(w.ps_address).ps_apply, key=w.key, optimizer=config,
                           grad=_wire(np.ones(3, "f4")))
            with pytest.raises(ValueError, match=re.escape(message)):
                _routing.check(reply, Call(w.ps_address, "ps_apply", {}))
        np.testing.assert_array_equal(w.numpy(), np.full(3, 0.5, "f4"))

    await in_thread(s, body)


@pytest.mark.cluster
@gen_cluster(client=False, nthreads=[PS, PS, WK])
async def test_ids_beyond_int64_are_reported_as_given(s, p0, p1, w0):
    """Issue 22 s5: ``gather([2**63])`` reported id -2**63 (the uint64 id wrapped in a cast to
    int64), and a sharded variable's errors named its first shard. The id is reported as
    given, with the variable's own name, on every row route."""
    def body(c):
        strategy = dds.ParameterServerStrategy(
            c, variable_partitioner=dds.partitioners.FixedShardsPartitioner(2))
        with strategy.scope():
            table = dds.Variable(np.arange(12, dtype="f4").reshape(6, 2), name="table")
        assert isinstance(table, dds.ShardedVariable)

        def out_of_range(i):
            return re.escape(f"id {i} is out of range [0, 6) for variable 'table'")

        for ids, bad in [([2 ** 63], 2 ** 63), (np.array([1, 2 ** 64 - 1], "u8"), 2 ** 64 - 1),
                         ([0, 2 ** 64], 2 ** 64), ([3, -1], -1), ([6], 6)]:
            with pytest.raises(IndexError, match=out_of_range(bad)):
                table.gather(ids)
        with pytest.raises(IndexError, match=out_of_range(2 ** 63)):
            table.scatter_add([2 ** 63], [[1.0, 1.0]])
        with pytest.raises(IndexError, match=out_of_range(2 ** 63)):
            opt.Adagrad(0.1).apply_gradients(
                [(opt.IndexedSlices(np.ones((1, 2), "f4"), np.array([2 ** 63], "u8")), table)])
        np.testing.assert_array_equal(table.gather(np.array([5, 0], "u8")), [[10, 11], [0, 1]])
        np.testing.assert_array_equal(table.numpy(), np.arange(12, dtype="f4").reshape(6, 2))

    await in_thread(s, body)


@pytest.mark.cluster
@gen_cluster(client=False, nthreads=[PS, PS, WK])
async def test_adagrad_gradient_of_the_wrong_width_names_the_variable(s, p0, p1, w0):
    """Issue 22 s5: an Adagrad step with IndexedSlices rows of the wrong width raised numpy's
    "operands could not be broadcast together with remapped shapes", naming nothing. Now a
    ShapeMismatchError names the variable and both shapes, on the coordinator and in a
    scheduled function, and nothing is applied (the next step gives Keras' exact values)."""
    def body(c):
        strategy = dds.ParameterServerStrategy(
            c, variable_partitioner=dds.partitioners.FixedShardsPartitioner(2))
        with strategy.scope():
            emb = dds.Variable(np.ones((6, 4), "f4"), name="emb")
        ada = opt.Adagrad(learning_rate=0.1, initial_accumulator_value=0.1)
        wrong = opt.IndexedSlices(np.ones((2, 3), "f4"), np.array([1, 4]))
        message = re.escape(
            "an IndexedSlices gradient with values of shape (2, 3) does not fit 2 rows of "
            "variable 'emb' of shape (6, 4) (its values need shape (2, 4))")
        with pytest.raises(ShapeMismatchError, match=message):
            ada.apply_gradients([(wrong, emb)])
        with pytest.raises(ShapeMismatchError, match=re.escape(
                "gradient of shape (6, 3) does not fit variable 'emb' of shape (6, 4)")):
            ada.apply_gradients([(np.ones((6, 3), "f4"), emb)])
        coord = dds.ClusterCoordinator(strategy)
        coord.schedule(lambda: ada.apply_gradients([(wrong, emb)]))
        with pytest.raises(ShapeMismatchError, match=message):
            coord.join()
        # the server refuses a raw one too, naming the shard
        shard = emb.variables[1]
        reply = c.sync(c.rpc(shard.ps_address).ps_apply, key=shard.key,
                       optimizer=ada.get_config(), grad=_wire(np.ones((1, 3), "f4")),
                       ids=_wire(np.array([0])))
        with pytest.raises(ShapeMismatchError, match=re.escape(
                f"shape (1, 3) does not fit shard {shard.key!r} of shape (1, 4)")):
            _routing.check(reply, Call(shard.ps_address, "ps_apply", {}))
        np.testing.assert_array_equal(emb.numpy(), np.ones((6, 4), "f4"))
        # one right step: the accumulators were untouched (0.1 + 1), rows 1 and 4 move
        ada.apply_gradients([(opt.IndexedSlices(np.ones((2, 4), "f4"), np.array([1, 4])), emb)])
        expected = np.ones((6, 4), "f4")
        step = np.float32(0.1) * np.float32(1) / (np.sqrt(np.float32(1.1)) + np.float32(1e-7))
        expected[[1, 4]] -= step
        np.testing.assert_allclose(emb.numpy(), expected, rtol=1e-6)
        coord.shutdown()

    await in_thread(s, body)


@pytest.mark.cluster
@gen_cluster(client=False, nthreads=[PS, PS, WK])
async def test_a_variable_without_rows_works_end_to_end(s, p0, p1, w0, tmp_path):
    """Issue 22 s5: ``Variable(np.zeros((0, 4)))`` under a partitioner was refused with "the
    variable_partitioner must return ... (non-zero)", blaming the partitioner. TensorFlow
    allows zero-size variables; a variable without rows has nothing to split, so it is one
    plain variable on one PS (as ``parameter_server_strategy_v2_test.testPartitionToOne`` puts
    a variable too small to split), and reads, updates, row lookups, optimizer steps,
    scheduled functions and a checkpoint round trip all work; so does a (4, 0) variable split
    in two."""
    path = str(tmp_path / "ckpt")

    def body(c):
        strategy = dds.ParameterServerStrategy(
            c, variable_partitioner=dds.partitioners.FixedShardsPartitioner(2))
        with strategy.scope():
            empty = dds.Variable(np.zeros((0, 4), "f4"), name="empty")
            narrow = dds.Variable(np.zeros((4, 0), "f4"), name="narrow")
            made = dds.Variable(lambda shape, dtype: np.zeros(shape, dtype), shape=(0, 3),
                                dtype="f8", name="made")
        assert isinstance(empty, dds.Variable) and empty.ps_address is not None
        assert empty.shape == (0, 4) and made.shape == (0, 3)
        assert isinstance(narrow, dds.ShardedVariable) and narrow.offsets == [0, 2, 4]
        for var, shape, dtype in [(empty, (0, 4), "f4"), (made, (0, 3), "f8"),
                                  (narrow, (4, 0), "f4")]:
            value = var.numpy()
            assert value.shape == shape and value.dtype == np.dtype(dtype)
        empty.assign(np.zeros((0, 4)))
        empty.assign_add(1.0)
        empty.scatter_add([], np.zeros((0, 4), "f4"))
        assert empty.gather([]).shape == (0, 4)
        assert empty.gather(np.zeros((2, 0), "i8")).shape == (2, 0, 4)
        with pytest.raises(IndexError, match=re.escape(
                "id 0 is out of range [0, 0) for variable 'empty'")):
            empty.gather([0])
        assert narrow.gather([3, 0]).shape == (2, 0)
        ada = opt.Adagrad(0.1)
        ada.apply_gradients([(np.zeros((0, 4), "f4"), empty),
                             (opt.IndexedSlices(np.zeros((0, 4), "f4"), np.zeros(0, "i8")), empty),
                             (opt.IndexedSlices(np.zeros((1, 0), "f4"), np.array([3])), narrow)])
        coord = dds.ClusterCoordinator(strategy)
        rv = coord.schedule(lambda: (empty.gather([]).shape, empty.numpy().shape))
        coord.join()
        assert rv.fetch() == ((0, 4), (0, 4))
        dds.Checkpoint(empty=empty, narrow=narrow, made=made, opt=ada).save(path)
        with strategy.scope():
            again = dds.Variable(np.zeros((0, 4), "f4"), name="empty")
            narrow2 = dds.Variable(np.zeros((4, 0), "f4"), name="narrow")
            made2 = dds.Variable(np.zeros((0, 3)), name="made")
        dds.Checkpoint(empty=again, narrow=narrow2, made=made2, opt=ada).restore(path)
        assert again.numpy().shape == (0, 4) and narrow2.numpy().shape == (4, 0)
        # a local variable (outside any scope) without rows, saved and restored the same way
        local = dds.Variable(np.zeros((0, 2), "i4"), name="local")
        dds.Checkpoint(local=local).save(path + "-local")
        dds.Checkpoint(local=local).restore(path + "-local")
        assert local.numpy().shape == (0, 2)
        coord.shutdown()

    await in_thread(s, body)


def _chunk(path: str, name: str, array: str = "value", shard: int = 0) -> str:
    """The one chunk file of a saved 2-D array of variable ``name``'s shard ``shard``."""
    return os.path.join(path, "variables", name, f"shard_{shard}", array, "c", "0", "0")


@pytest.mark.cluster
@gen_cluster(client=False, nthreads=[PS, PS, WK])
async def test_damaged_checkpoint_files_name_the_file_and_the_variable(s, p0, p1, w0, tmp_path):
    """Issue 22 s5: a truncated chunk of a checkpoint raised numpy's "When changing to a
    larger dtype, its size must be a divisor ...", naming neither the variable nor the file.
    Now a CheckpointCorruptedError (a CheckpointMismatchError) names both, for a variable's
    value on a PS and on the coordinator, an optimizer slot, a slot of the wrong width (an
    Adagrad accumulator that does not fit its variable) and a truncated metadata file."""
    root = str(tmp_path)

    def body(c):
        strategy = dds.ParameterServerStrategy(
            c, variable_partitioner=dds.partitioners.FixedShardsPartitioner(2))
        with strategy.scope():
            emb = dds.Variable(np.ones((6, 4), "f4"), name="emb")  # shards of 3 rows
        local = dds.Variable(np.ones((2, 2)), name="local")
        ada = opt.Adagrad(0.1)
        ada.apply_gradients([(opt.IndexedSlices(np.ones((2, 4), "f4"), np.array([1, 4])), emb)])
        ckpt = dds.Checkpoint(emb=emb, local=local, opt=ada)

        def damaged(name, how):
            path = os.path.join(root, name)
            ckpt.save(path)
            return path, how(path)

        def truncate(file):
            with open(file, "r+b") as f:
                f.truncate(5)
            return file

        cases = [
            damaged("value", lambda p: truncate(_chunk(p, "emb", shard=1))),
            damaged("local", lambda p: truncate(_chunk(p, "local"))),
            damaged("slot", lambda p: truncate(_chunk(p, "emb", "slots/Adagrad/accumulator"))),
            damaged("meta", lambda p: truncate(os.path.join(
                p, "variables", "emb", "shard_0", "value", "zarr.json"))),
        ]
        why = ("ValueError: When changing to a larger dtype, its size must be a divisor of the "
               "total size in bytes of the last axis of the array.")
        shard = {"value": "shard_1", "local": "shard_0", "slot": "shard_0", "meta": "shard_0"}
        variable = {"local": "local"}
        for (path, file), case in zip(cases, shard, strict=True):
            with pytest.raises(CheckpointCorruptedError) as info:
                ckpt.restore(path)
            message = str(info.value)
            prefix = (f"checkpoint file {file} (variable {variable.get(case, 'emb')!r}, "
                      f"{shard[case]}) is damaged and cannot be read: ")
            assert message.startswith(prefix), (case, message)
            if case != "meta":
                assert message == prefix + why, (case, message)
            assert isinstance(info.value, dds.CheckpointMismatchError)

        # an accumulator of another width (3 columns for a variable of 4)
        path = os.path.join(root, "width")
        ckpt.save(path)
        slot = os.path.join(path, "variables", "emb", "shard_0", "slots", "Adagrad",
                            "accumulator")
        zarr.create_array(zarr.storage.LocalStore(path),
                          name="variables/emb/shard_0/slots/Adagrad/accumulator",
                          data=np.ones((3, 3), "f4"), overwrite=True)
        with pytest.raises(CheckpointCorruptedError, match=re.escape(
                f"checkpoint file {slot} (variable 'emb', shard_0) is damaged and cannot be "
                "read: this slot has shape (3, 3), which does not fit the variable's shard of "
                "shape (3, 4)")):
            ckpt.restore(path)
        # an intact checkpoint still restores
        ckpt.restore(ckpt.save(os.path.join(root, "intact")))
        np.testing.assert_array_equal(local.numpy(), np.ones((2, 2)))

    await in_thread(s, body)
