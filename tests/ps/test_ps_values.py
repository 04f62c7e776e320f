"""Values are never silently wrong (issue 11 s4): unsafe casts and nonsense partitioner
arguments are clear errors, on local variables, on parameter servers, and at the server."""

from __future__ import annotations

import numpy as np
import pytest

import dask_dataservice as dds
from dask_dataservice.ps import _routing
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
])
def test_unsafe_casts_are_refused(value, dtype, error, match):
    with pytest.raises(error, match=match):
        cast_value(value, dtype, "assign_add to variable 'v'")


@pytest.mark.parametrize(("value", "dtype", "expected"), [
    (2.0, "i8", 2), (-2.0 ** 63, "i8", -2 ** 63), (1, "i4", 1), (True, "i8", 1),
    (0.1, "f4", np.float32(0.1)), (3, "f4", 3.0), (2 ** 62, "f8", float(2 ** 62)),
    (1.5, "c8", 1.5), ([1, 2], "u1", [1, 2]),
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
