"""Parameter servers, variable handles and server-side optimizers on a real cluster.

Clusters are in-process (``gen_cluster``: tcp between the servers, so every request is
serialised); the blocking API runs in a thread with its own synchronous Client.
"""

from __future__ import annotations

import os
import pickle

import dask
import numpy as np
import pytest
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st

import dask_dataservice as dds
from dask_dataservice.errors import (
    ParameterServerError,
    ShapeMismatchError,
    VariableNotFoundError,
)
from dask_dataservice.ps import _routing
from dask_dataservice.ps import optimizers as opt
from dask_dataservice.ps._runner_plugin import RUNNER_NAME
from dask_dataservice.ps._store import zarr_name as _zarr_name
from dask_dataservice.ps._types import Call
from dask_dataservice.ps._types import wire as _wire
from dask_dataservice.ps.server import HANDLERS, PLUGIN_NAME, ParameterServerPlugin
from dask_dataservice.testing import gen_cluster
from dask_dataservice.testing._ps import warm_up_zarr

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]

# zarr runs its I/O on process-wide daemon threads; start them all before gen_cluster's
# thread-leak check takes its snapshot.
warm_up_zarr()

from _helpers import PS, WK, in_thread  # noqa: E402


@gen_cluster(client=False, nthreads=[PS, PS, WK, WK])
async def test_installation_placement_and_local_variables(s, p0, p1, w0, w1):
    def body(c):
        strategy = dds.ParameterServerStrategy(c)
        assert strategy.ps_addresses == [p0.address, p1.address]
        assert strategy.worker_addresses == [w0.address, w1.address]
        outside = dds.Variable(0.0)
        with strategy.scope():
            vs = [dds.Variable(float(i), name=f"v{i}") for i in range(5)]
        assert outside.ps_address is None and outside.device == ""
        assert [v.ps_address for v in vs] == [p0.address, p1.address] * 2 + [p0.address]
        assert [v.device for v in vs][:3] == [
            "/job:ps/replica:0/task:0/device:CPU:0", "/job:ps/replica:0/task:1/device:CPU:0",
            "/job:ps/replica:0/task:0/device:CPU:0"]
        assert [float(v.numpy()) for v in vs] == [0.0, 1.0, 2.0, 3.0, 4.0]
        # arithmetic reads the value, as a TensorFlow variable converts to a tensor
        assert vs[3] * 2 == 6.0 and 1 + vs[1] == 2.0 and -vs[2] == -2.0 and float(vs[4]) == 4.0
        outside.assign_add(2.5)
        assert float(outside.numpy()) == 2.5
        return strategy

    await in_thread(s, body)
    # one place wires the plugin: every handler is the plugin's method
    for w in (p0, p1, w0):
        plugin = w.plugins[PLUGIN_NAME]
        for op, method in HANDLERS.items():
            assert w.handlers[op] == getattr(plugin, method)
    runner = w0.plugins[RUNNER_NAME]
    assert w0.handlers["ps_run_closures"] == runner.run_closures
    assert w0.extensions[RUNNER_NAME] is runner and p0.extensions[PLUGIN_NAME] is p0.plugins[PLUGIN_NAME]
    assert p0.plugins[PLUGIN_NAME].is_ps and not w0.plugins[PLUGIN_NAME].is_ps
    assert sorted(k.split("/")[-1] for k in p0.plugins[PLUGIN_NAME].shards) == ["v0", "v2", "v4"]


@gen_cluster(client=False, nthreads=[WK, WK])
async def test_no_parameter_server_is_an_error(s, a, b):
    def body(c):
        with pytest.raises(ValueError, match="at least one ps"):
            dds.ParameterServerStrategy(c)

    await in_thread(s, body)


@gen_cluster(client=False, nthreads=[PS, PS])
async def test_no_training_worker_is_an_error(s, a, b):
    def body(c):
        with pytest.raises(ValueError, match="at least one worker"):
            dds.ParameterServerStrategy(c)

    await in_thread(s, body)


@gen_cluster(client=False, nthreads=[PS, PS, WK])
async def test_partitioned_variables(s, p0, p1, w0):
    def body(c):
        part = dds.partitioners.MinSizePartitioner(min_shard_bytes=4, max_shards=5)
        strategy = dds.ParameterServerStrategy(c, variable_partitioner=part)
        value = np.arange(26, dtype="f4").reshape(13, 2)
        with strategy.scope():
            scalar = dds.Variable(3.0, name="scalar")           # rank 0: never partitioned
            emb = dds.Variable(value, name="emb")
            small = dds.Variable(np.ones(1, "f8"), name="one_row")   # 1 row: one shard
        assert isinstance(scalar, dds.Variable) and isinstance(small, dds.Variable)
        assert isinstance(emb, dds.ShardedVariable)
        assert emb.shape == (13, 2) and emb.dtype == np.float32
        assert [v.shape for v in emb.variables] == [(3, 2)] * 3 + [(2, 2)] * 2
        assert emb.offsets == [0, 3, 6, 9, 11, 13]
        assert [v.name for v in emb.variables] == [f"emb/part_{i}" for i in range(5)]
        # round-robin continues over the shards: scalar took PS 0
        assert [v.ps_address for v in emb.variables] == [p1.address, p0.address] * 2 + [p1.address]
        assert small.ps_address == p0.address
        np.testing.assert_array_equal(emb.numpy(), value)
        for v, a, b in zip(emb.variables, emb.offsets, emb.offsets[1:], strict=False):
            np.testing.assert_array_equal(v.numpy(), value[a:b])

        bad = dds.ParameterServerStrategy(c, variable_partitioner=lambda shape, dtype: [2, 2])
        with bad.scope(), pytest.raises(ValueError, match="variable_partitioner must return"):
            dds.Variable(value)

    await in_thread(s, body)


@gen_cluster(client=False, nthreads=[PS, PS, WK])
async def test_callable_initial_value_runs_per_shard_on_its_ps(s, p0, p1, w0):
    def init(shape, dtype, partition_offset):
        import threading

        assert threading.current_thread().name.startswith("dds-ps-io")  # on the PS
        rows = np.arange(partition_offset[0], partition_offset[0] + shape[0], dtype=dtype)
        return np.repeat(rows[:, None], shape[1], axis=1)

    def whole_only():
        return np.arange(10, dtype="f4").reshape(10, 1)

    def body(c):
        strategy = dds.ParameterServerStrategy(
            c, variable_partitioner=dds.partitioners.FixedShardsPartitioner(3))
        with strategy.scope():
            v = dds.Variable(init, shape=(10, 4), dtype="f4", name="v")
        assert [x.shape for x in v.variables] == [(4, 4), (3, 4), (3, 4)]
        np.testing.assert_array_equal(v.numpy(), np.repeat(np.arange(10, dtype="f4")[:, None], 4, 1))
        # the TF warning for a large variable built whole and sliced
        with dask.config.set({"dataservice.ps.large-variable-elements": 5}):
            with strategy.scope(), pytest.warns(UserWarning, match="partitioned but was built whole"):
                w = dds.Variable(np.zeros((10, 1), "f4"), name="big")
            with strategy.scope(), pytest.warns(UserWarning, match="built whole"):
                u = dds.Variable(whole_only, shape=(10, 1), dtype="f4", name="sliced_on_ps")
        np.testing.assert_array_equal(u.numpy(), whole_only())
        assert w.shape == (10, 1)

    await in_thread(s, body)


@gen_cluster(client=False, nthreads=[PS, PS, WK])
async def test_gather_scatter_match_numpy(s, p0, p1, w0):
    rows, width = 37, 3

    def body(c):
        strategy = dds.ParameterServerStrategy(
            c, variable_partitioner=dds.partitioners.FixedShardsPartitioner(4))
        start = np.arange(rows * width, dtype="f8").reshape(rows, width)
        with strategy.scope():
            sharded = dds.Variable(start, name="sharded")
        plain_strategy = dds.ParameterServerStrategy(c)
        with plain_strategy.scope():
            plain = dds.Variable(start, name="plain")
        assert isinstance(sharded, dds.ShardedVariable) and isinstance(plain, dds.Variable)
        model = start.copy()

        @settings(max_examples=40, deadline=None, database=None)
        @given(ids=st.lists(st.integers(0, rows - 1), min_size=0, max_size=30),
               op=st.sampled_from(["add", "sub", "update"]), seed=st.integers(0, 2**16))
        def check(ids, op, seed):
            ids = np.array(ids, dtype=np.int64)
            upd = np.random.default_rng(seed).integers(-5, 5, (ids.size, width)).astype("f8")
            for var in (sharded, plain):
                np.testing.assert_array_equal(var.gather(ids), model[ids])
                getattr(var, f"scatter_{op}")(ids, upd)
            if op == "add":
                np.add.at(model, ids, upd)
            elif op == "sub":
                np.subtract.at(model, ids, upd)
            else:  # the last duplicate wins
                for i, r in zip(ids, upd, strict=False):
                    model[i] = r
            np.testing.assert_array_equal(sharded.numpy(), model)
            np.testing.assert_array_equal(plain.numpy(), model)

        check()
        # ids of any shape; results in order, duplicates repeated
        ids = np.array([[36, 0], [0, 20], [36, 36]])
        np.testing.assert_array_equal(sharded.gather(ids), model[ids])
        assert sharded.gather(ids).shape == (3, 2, width)
        # IndexedSlices form
        sharded.scatter_add(opt.IndexedSlices(np.ones((2, width)), np.array([5, 5])))
        model[5] += 2
        np.testing.assert_array_equal(sharded.numpy(), model)
        with pytest.raises(IndexError, match="out of range"):
            sharded.gather([rows])
        with pytest.raises(IndexError, match="out of range"):
            plain.scatter_add([-1], np.ones((1, width)))

    await in_thread(s, body)


def _shard_count(ws, key_suffix):
    return [k for k in ws.plugins[PLUGIN_NAME].shards if k.endswith(key_suffix)]


@gen_cluster(client=False, nthreads=[PS, PS, WK, WK])
async def test_concurrent_updates_from_two_workers_sum_exactly(s, p0, p1, w0, w1):
    def body(c):
        strategy = dds.ParameterServerStrategy(
            c, variable_partitioner=dds.partitioners.FixedShardsPartitioner(2))
        with strategy.scope():
            counter = dds.Variable(0, dtype="i8", name="counter")
            table = dds.Variable(np.zeros((10, 2), "i8"), name="table")

        def hammer(n, seed):  # an ordinary Dask task: the worker's rpc pool, direct to the PS
            rng = np.random.default_rng(seed)
            for _ in range(n):
                counter.assign_add(1)
                table.scatter_add(rng.integers(0, 10, 3), np.ones((3, 2), "i8"))
            return n

        futs = [c.submit(hammer, 150, i, workers=[w], pure=False)
                for i, w in enumerate([w0.address, w1.address])]
        assert c.gather(futs) == [150, 150]
        assert int(counter.numpy()) == 300
        assert int(table.numpy().sum()) == 300 * 3 * 2

    await in_thread(s, body)


@gen_cluster(client=False, nthreads=[PS, WK])
async def test_handler_errors_travel_as_values(s, p0, w0):
    def body(c):
        strategy = dds.ParameterServerStrategy(c)
        with strategy.scope():
            v = dds.Variable(np.zeros((4, 2)), name="v")
        with pytest.raises(ShapeMismatchError, match=r"shape \(3,\) does not fit"):
            v.assign(np.zeros(3))
        with pytest.raises(ValueError):
            v.scatter_update([0, 1], np.zeros((3, 2)))
        reply = c.sync(c.rpc(p0.address).ps_read, key="nope")
        with pytest.raises(VariableNotFoundError, match="holds no shard 'nope'"):
            _routing.check(reply, Call(p0.address, "ps_read", {}))
        reply = c.sync(c.rpc(w0.address).ps_read, key="x")
        with pytest.raises(VariableNotFoundError, match="not a parameter server"):
            _routing.check(reply, Call(w0.address, "ps_read", {}))
        np.testing.assert_array_equal(v.numpy(), np.zeros((4, 2)))
        # an unpickled handle finds its own strategy's client; one whose strategy is not
        # in this process says so (no "most recent strategy" to fall back on)
        w = pickle.loads(pickle.dumps(v))
        np.testing.assert_array_equal(w.numpy(), np.zeros((4, 2)))
        w._owner = "a strategy of another process"
        with pytest.raises(ParameterServerError, match="inside a function scheduled"):
            w.numpy()

    await in_thread(s, body)


@gen_cluster(client=False, nthreads=[PS, WK])
async def test_updates_are_applied_at_most_once_per_function_and_sequence(s, p0, w0):
    def body(c):
        strategy = dds.ParameterServerStrategy(c)
        with strategy.scope():
            v = dds.Variable(np.zeros(3, "f4"), name="v")
        rpc = c.rpc(p0.address)
        one = _wire(np.ones(3, "f4"))
        replies = [c.sync(rpc.ps_update, key=v.key, kind="assign_add", value=one,
                          fn_id=7, seq=seq) for seq in (1, 2, 1, 2, 3)]
        assert [r["applied"] for r in replies] == [True, True, False, False, True]
        np.testing.assert_array_equal(v.numpy(), np.full(3, 3, "f4"))
        assert c.sync(rpc.ps_forget, below=8, above=7)["forgotten"] == 1
        assert c.sync(rpc.ps_update, key=v.key, kind="assign_add", value=one, fn_id=7,
                      seq=1)["applied"]

    await in_thread(s, body)


# -- optimizers: an independent numpy reference -----------------------------------------

def _ref_step(kind, cfg, var, slots, g, t):
    lr = cfg["learning_rate"]
    if kind == "sgd":
        slots["vel"] = cfg["momentum"] * slots.get("vel", 0) - lr * g
        if cfg["nesterov"]:
            return var + cfg["momentum"] * slots["vel"] - lr * g
        return var + slots["vel"]
    if kind == "adagrad":
        slots["acc"] = slots.get("acc", cfg["initial_accumulator_value"]) + g * g
        return var - lr * g / (np.sqrt(slots["acc"]) + cfg["epsilon"])
    b1, b2 = cfg["beta_1"], cfg["beta_2"]
    slots["m"] = b1 * slots.get("m", 0) + (1 - b1) * g
    slots["v"] = b2 * slots.get("v", 0) + (1 - b2) * g * g
    alpha = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    return var - alpha * slots["m"] / (np.sqrt(slots["v"]) + cfg["epsilon"])


@gen_cluster(client=False, nthreads=[PS, PS, WK])
async def test_server_side_optimizers_match_reference(s, p0, p1, w0):
    optimizers = [opt.SGD(0.1), opt.SGD(0.1, momentum=0.9, nesterov=True),
                  opt.Adagrad(0.5), opt.Adam(0.01)]

    def body(c):
        strategy = dds.ParameterServerStrategy(
            c, variable_partitioner=dds.partitioners.FixedShardsPartitioner(2))
        rng = np.random.default_rng(0)
        start = rng.normal(size=(6, 3))
        for o in optimizers:
            with strategy.scope():
                dense = dds.Variable(start, name=f"dense_{o.name}")
                sparse = dds.Variable(start, name=f"sparse_{o.name}")
            ref_d, ref_s = start.copy(), start.copy()
            sd, ss = {}, {}
            cfg = o.get_config()
            for t in range(1, 4):
                g = rng.normal(size=(6, 3))
                ids = np.array([4, 0, 4, 1])  # duplicate id 4; rows on both shards
                rows = rng.normal(size=(4, 3))
                o.apply_gradients([(g, dense), (opt.IndexedSlices(rows, ids), sparse)])
                ref_d = _ref_step(o.kind, cfg, ref_d, sd, g, t)
                # sparse: duplicates summed, then only rows {0, 1, 4} move (lazy moments)
                uniq = np.array([0, 1, 4])
                gsum = np.zeros((3, 3))
                np.add.at(gsum, np.searchsorted(uniq, ids), rows)
                sub = {k: (v[uniq] if isinstance(v, np.ndarray) else v) for k, v in ss.items()}
                ref_s[uniq] = _ref_step(o.kind, cfg, ref_s[uniq], sub, gsum, t)
                for k, v in sub.items():
                    full = ss.get(k)
                    if not isinstance(full, np.ndarray):
                        init = cfg.get("initial_accumulator_value", 0.0) if k == "acc" else 0.0
                        full = np.full((6, 3), init)
                    full[uniq] = v
                    ss[k] = full
            np.testing.assert_allclose(dense.numpy(), ref_d, rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(sparse.numpy(), ref_s, rtol=1e-12, atol=1e-12)
        # rank-0 variables (a bias) too: never partitioned, slots are scalars
        for o in optimizers:
            with strategy.scope():
                bias = dds.Variable(np.float64(1.5), name=f"bias_{o.name}")
            ref, slots, cfg = np.float64(1.5), {}, o.get_config()
            for t in range(1, 4):
                g = np.float64(0.25 * t)
                o.apply_gradients([(g, bias)])
                ref = _ref_step(o.kind, cfg, ref, slots, g, t)
            np.testing.assert_allclose(bias.numpy(), ref, rtol=1e-12, atol=1e-12)
        with pytest.raises(ValueError, match="not on a parameter server"):
            optimizers[0].apply_gradients([(np.zeros(2), dds.Variable(np.zeros(2)))])

    await in_thread(s, body)


@pytest.mark.pure
@settings(max_examples=200, deadline=None, database=None)
@given(ids=st.lists(st.integers(0, 49), max_size=60), cut=st.integers(1, 49),
       seed=st.integers(0, 2**16))
def test_row_routing_and_duplicate_sums(ids, cut, seed):
    from dask_dataservice.ps.variables import _Plan

    ids = np.array(ids, dtype=np.int64)
    rows = np.random.default_rng(seed).integers(-9, 9, (ids.size, 2)).astype("f8")
    offsets = [0, cut, 50]
    plan = _Plan(ids, offsets)
    assert np.array_equal(plan.uniq, np.unique(ids))
    assert np.array_equal(plan.expand(plan.uniq), ids)
    expected = np.zeros((plan.uniq.size, 2))
    np.add.at(expected, np.searchsorted(plan.uniq, ids), rows)
    np.testing.assert_array_equal(plan.combine(rows, np.add), expected)
    last = {int(i): r for i, r in zip(ids, rows, strict=True)}
    got = plan.combine(rows, None)
    for k, i in enumerate(plan.uniq):
        np.testing.assert_array_equal(got[k], last[int(i)])
    for shard, a, b, local in plan.parts:  # each shard gets its own rows, shard-local
        assert offsets[shard] <= plan.uniq[a] and plan.uniq[b - 1] < offsets[shard + 1]
        np.testing.assert_array_equal(local + offsets[shard], plan.uniq[a:b])
    u, summed = opt.dedupe_rows(ids, rows)
    np.testing.assert_array_equal(u, plan.uniq)
    np.testing.assert_array_equal(summed, expected)


@pytest.mark.pure
def test_optimizer_configs_round_trip():
    a = opt.Adam(0.01, beta_1=0.8, name="adam")
    assert opt.get(a.get_config()).get_config() == a.get_config()
    assert isinstance(opt.get("adagrad"), opt.Adagrad)
    r = opt.RMSprop(0.01, rho=0.8, momentum=0.5, centered=True)
    assert opt.get(r.get_config()).get_config() == r.get_config()
    assert r.slot_names == ("velocity", "momentum", "average_gradient")
    with pytest.raises(ValueError, match="unknown optimizer 'adadelta'"):
        opt.get("adadelta")
    with pytest.raises(ValueError):
        opt.SGD(momentum=2)


def test_zarr_backing_flush_and_reload(tmp_path):
    work_dir = str(tmp_path / "ps")

    @gen_cluster(client=False, nthreads=[PS, WK])
    async def run(s, p0, w0):
        await in_thread(s, lambda c: body(c, p0))
        assert p0.plugins[PLUGIN_NAME].store_path.startswith(work_dir)

    def body(c, p0):
        c.register_plugin(ParameterServerPlugin(work_dir=work_dir), name=PLUGIN_NAME)
        strategy = dds.ParameterServerStrategy(c)
        with strategy.scope():
            v = dds.Variable(np.arange(12, dtype="f4").reshape(6, 2), name="v")
        o = opt.Adagrad(0.1, name="ada")
        o.apply_gradients([(np.ones((6, 2), "f4"), v)])
        expected = v.numpy()
        written = strategy.flush()
        assert written == {p0.address: [v.key]}
        store_dir = os.path.join(work_dir, str(p0.name))
        root = zarr.open_group(store_dir, mode="r")
        arr = root["values"][_zarr_name(v.key)]
        assert arr.chunks[0] <= 6 and arr.shape == (6, 2)
        np.testing.assert_array_equal(arr[...], expected)
        acc = root["slots"][_zarr_name(v.key)]["ada"]["accumulator"]
        np.testing.assert_allclose(acc[...], np.full((6, 2), 1.1, "f4"), rtol=1e-6)
        # a fresh plugin (as after a restart) reloads the shard and its slots
        c.unregister_worker_plugin(PLUGIN_NAME)
        c.register_plugin(ParameterServerPlugin(work_dir=work_dir), name=PLUGIN_NAME)
        np.testing.assert_array_equal(v.numpy(), expected)
        o.apply_gradients([(np.ones((6, 2), "f4"), v)])
        np.testing.assert_allclose(
            v.numpy(), expected - 0.1 / (np.sqrt(np.float32(2.1)) + 1e-7), rtol=1e-6)

    run()
