"""ClusterCoordinator, per-worker datasets, end-to-end training and checkpoints."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import zarr
from distributed import Scheduler, Worker

import dask_dataservice as dds
from dask_dataservice.errors import CheckpointMismatchError, VariableNotFoundError
from dask_dataservice.ps import optimizers as opt
from dask_dataservice.ps._runner_plugin import RUNNER_NAME
from dask_dataservice.ps.coordinator import ClosureCancelledError
from dask_dataservice.testing import gen_cluster
from dask_dataservice.testing._ps import warm_up_zarr

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]

# zarr runs its I/O on process-wide daemon threads; start them all before gen_cluster's
# thread-leak check takes its snapshot.
warm_up_zarr()

from _helpers import PS, WK, in_thread  # noqa: E402


def wait_until(cond, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@gen_cluster(client=False, nthreads=[PS, WK, WK])
async def test_schedule_join_fetch(s, p0, w0, w1):
    def body(c):
        strategy = dds.ParameterServerStrategy(c)
        coord = dds.ClusterCoordinator(strategy)
        assert dds.ClusterCoordinator(strategy) is coord
        with strategy.scope():
            counter = dds.Variable(0, dtype="i8", name="counter")

        def step(i):
            counter.assign_add(1)
            return i * i, threading.current_thread().name

        started = time.monotonic()
        rvs = [coord.schedule(step, args=(i,)) for i in range(300)]
        assert time.monotonic() - started < 5  # schedule returns at once
        coord.join()
        assert coord.done()
        assert [rv.fetch()[0] for rv in rvs] == [i * i for i in range(300)]
        assert {rv.get()[1].split("_")[0] for rv in rvs} == {"dds-ps-runner"}
        assert int(counter.numpy()) == 300
        # both workers took part
        assert coord.stats["finished"] == 300
        # fetch() of structures; a finished RemoteValue's value may be an argument
        assert coord.fetch({"a": rvs[2], "b": [rvs[3], counter], "c": 5}) == {
            "a": (4, rvs[2].fetch()[1]), "b": [(9, rvs[3].fetch()[1]), 300], "c": 5}
        # a RemoteValue argument is refused (TF); its fetched value is fine
        with pytest.raises(ValueError, match="RemoteValue"):
            coord.schedule(lambda x: x, args=([rvs[4]],))
        rv = coord.schedule(lambda x: x[0] + 1, args=(rvs[4].fetch(),))
        assert rv.fetch() == 17
        coord.join()

    await in_thread(s, body)
    ran = [w.extensions[RUNNER_NAME].stats["closures"] for w in (w0, w1)]
    assert sum(ran) == 301 and min(ran) > 0


@gen_cluster(client=False, nthreads=[PS, WK, WK])
async def test_errors_join_raises_first_and_cancels_pending(s, p0, w0, w1):
    def body(c):
        strategy = dds.ParameterServerStrategy(c)
        coord = dds.ClusterCoordinator(strategy)

        def step(i):
            if i == 3:
                raise ValueError(f"boom {i}")
            return i

        rvs = [coord.schedule(step, args=(i,)) for i in range(40)]
        with pytest.raises(ValueError, match="boom 3"):
            coord.join()
        with pytest.raises(ValueError, match="boom 3"):
            rvs[3].fetch()
        outcomes = []
        for i, rv in enumerate(rvs):
            if i == 3:
                continue
            try:
                assert rv.fetch() == i
                outcomes.append("done")
            except ClosureCancelledError:
                outcomes.append("cancelled")
        assert "cancelled" in outcomes  # functions after the failure did not all run
        coord.join()  # the error was cleared
        assert coord.done()
        # an error is also raised by the next schedule() (and done()), then cleared
        bad = coord.schedule(step, args=(3,))
        wait_until(bad.done, what="the failing function")
        with pytest.raises(ValueError, match="boom 3"):
            coord.schedule(step, args=(1,))
        assert coord.schedule(step, args=(5,)).fetch() == 5
        coord.join()
        # an update that fails on its PS (sent without waiting, inside a scheduled function)
        # is charged to the function that sent it
        with strategy.scope():
            doomed = dds.Variable(np.zeros(2), name="doomed")
        assert c.sync(c.rpc(doomed.ps_address).ps_delete, key=doomed.key)["deleted"]

        def bad_update(i):
            doomed.assign_add(np.ones(2))
            return i

        rv = coord.schedule(bad_update, args=(1,))
        with pytest.raises(VariableNotFoundError, match="holds no shard"):
            coord.join()
        with pytest.raises(VariableNotFoundError):
            rv.fetch()
        # an unpicklable argument fails that function alone
        rv = coord.schedule(step, args=(threading.Lock(),))
        with pytest.raises(TypeError, match="do not pickle"):
            coord.join()
        with pytest.raises(TypeError):
            rv.fetch()

    await in_thread(s, body)


@gen_cluster(client=False, nthreads=[PS, WK, WK])
async def test_per_worker_dataset_is_built_lazily_on_each_worker(s, p0, w0, w1):
    def body(c):
        strategy = dds.ParameterServerStrategy(c)
        coord = dds.ClusterCoordinator(strategy)
        with strategy.scope():
            builds = dds.Variable(0, dtype="i8", name="builds")
            total = dds.Variable(0, dtype="i8", name="total")

        def dataset_fn():
            builds.assign_add(1)
            return dds.Dataset.range(1000)

        per_worker = coord.create_per_worker_dataset(dataset_fn)
        assert int(builds.numpy()) == 0  # lazy
        it = iter(per_worker)

        def step(iterator):
            x = next(iterator)
            total.assign_add(x)
            return x

        rvs = [coord.schedule(step, args=(it,)) for i in range(40)]
        coord.join()
        values = [rv.fetch() for rv in rvs]
        nbuilt = int(builds.numpy())
        assert 1 <= nbuilt <= 2
        # each worker reads its own copy of the dataset from the start: the values are
        # nbuilt runs 0, 1, 2, ... so value k occurs at most nbuilt times, never increasing
        counts = np.bincount(values)
        assert counts[0] == nbuilt and counts.sum() == 40
        assert all(a >= b for a, b in zip(counts, counts[1:], strict=False))
        assert int(total.numpy()) == sum(values)
        # a new iterator starts every worker's dataset again; a Dataset may be given directly
        it2 = iter(coord.create_per_worker_dataset(dds.Dataset.range(5).map(lambda x: x * 10)))
        assert coord.schedule(step, args=(it2,)).fetch() == 0
        with pytest.raises(RuntimeError, match="inside a function scheduled"):
            next(it2)
        # TensorFlow's spelling: a dataset function that takes an InputContext
        seen_ctx = []

        def dataset_fn_ctx(ctx):
            seen_ctx.append(ctx.num_input_pipelines)
            return dds.Dataset.range(3).map(lambda x: x + ctx.input_pipeline_id + 100)

        it3 = iter(coord.create_per_worker_dataset(
            strategy.distribute_datasets_from_function(dataset_fn_ctx)))
        assert coord.schedule(step, args=(it3,)).fetch() == 100
        it4 = iter(coord.create_per_worker_dataset(
            strategy.experimental_distribute_dataset(dds.Dataset.range(7, 9))))
        assert coord.schedule(step, args=(it4,)).fetch() == 7

    await in_thread(s, body)


@gen_cluster(client=False, nthreads=[PS, WK, WK], timeout=60)
async def test_dataset_fn_may_return_a_data_service_dataset(s, p0, w0, w1):
    def body(c):
        strategy = dds.ParameterServerStrategy(c)
        coord = dds.ClusterCoordinator(strategy)
        with strategy.scope():
            seen = dds.Variable(np.zeros(100, "i8"), name="seen")
        dataset_id = dds.register_dataset(c, dds.Dataset.range(100).batch(10))
        address = c.scheduler.address

        def dataset_fn():
            return dds.from_dataset_id("distributed_epoch", address, dataset_id,
                                       job_name="ps-train")

        it = iter(coord.create_per_worker_dataset(dataset_fn))

        def step(iterator):
            try:
                batch = next(iterator)
            except StopIteration:
                return 0
            seen.scatter_add(batch, np.ones(len(batch), "i8"))
            return len(batch)

        # The workers share one DYNAMIC job, but each worker's reader keeps what it fetched
        # ahead, so a worker whose stream ended answers 0 while the other still has batches:
        # schedule rounds until every element was trained on (bounded).
        total = 0
        for _ in range(50):
            rvs = [coord.schedule(step, args=(it,)) for _ in range(10)]
            coord.join()
            total += sum(rv.fetch() for rv in rvs)
            if total >= 100:
                break
        # DYNAMIC sharding: every element exactly once over both workers
        assert total == 100
        np.testing.assert_array_equal(seen.numpy(), np.ones(100, "i8"))

    await in_thread(s, body)


@gen_cluster(client=False, nthreads=[PS, PS, WK, WK], timeout=60)
async def test_logistic_regression_reaches_95_percent(s, p0, p1, w0, w1):
    rng = np.random.default_rng(42)
    X = rng.normal(size=(2000, 8)).astype("f4")
    w_true = rng.normal(size=8).astype("f4")
    y = (X @ w_true > 0).astype("f4")

    def body(c):
        strategy = dds.ParameterServerStrategy(c)
        coord = dds.ClusterCoordinator(strategy)
        with strategy.scope():
            w = dds.Variable(np.zeros(8, "f4"), name="w")
            b = dds.Variable(np.float32(0), name="b")
            steps = dds.Variable(0, dtype="i8", name="steps")
        assert w.ps_address != b.ps_address
        sgd = opt.SGD(learning_rate=1.0)

        def dataset_fn():
            return dds.Dataset.from_tensor_slices((X, y)).shuffle(500, seed=1).repeat().batch(64)

        it = iter(coord.create_per_worker_dataset(dataset_fn))

        def train_step(iterator):
            xb, yb = next(iterator)
            p = 1 / (1 + np.exp(-(xb @ w.numpy() + b.numpy())))
            err = p - yb
            sgd.apply_gradients([(xb.T @ err / len(yb), w), (np.float32(err.mean()), b)])
            steps.assign_add(1)
            return float(-np.mean(yb * np.log(p + 1e-7) + (1 - yb) * np.log(1 - p + 1e-7)))

        losses = [coord.schedule(train_step, args=(it,)) for _ in range(300)]
        coord.join()
        assert int(steps.numpy()) == 300
        acc = float(np.mean(((X @ w.numpy() + b.numpy()) > 0) == (y > 0)))
        assert acc >= 0.95, acc
        # the loss on all of X, before (w = 0, b = 0: log 2) and after. Not the first and
        # the last scheduled steps' losses: on two workers functions start in no promised
        # order, so "the first 20 scheduled" may have run after others had trained
        p = 1 / (1 + np.exp(-(X @ w.numpy() + b.numpy())))
        final = float(-np.mean(y * np.log(p + 1e-7) + (1 - y) * np.log(1 - p + 1e-7)))
        assert final < np.log(2) / 2, final
        fetched = [r.fetch() for r in losses]
        assert len(fetched) == 300 and all(np.isfinite(fetched))

    await in_thread(s, body)


@gen_cluster(client=False, nthreads=[PS, PS, WK, WK], timeout=60)
async def test_embedding_model_with_sparse_updates(s, p0, p1, w0, w1):
    vocab, dim = 200, 4
    labels = (np.random.default_rng(7).random(vocab) < 0.5).astype("f4")

    def body(c):
        strategy = dds.ParameterServerStrategy(
            c, variable_partitioner=dds.partitioners.FixedShardsPartitioner(2))
        coord = dds.ClusterCoordinator(strategy)
        with strategy.scope():
            emb = dds.Variable(lambda shape, dtype, partition_offset: np.zeros(shape, dtype),
                               shape=(vocab, dim), dtype="f4", name="emb")
        assert isinstance(emb, dds.ShardedVariable)
        assert [v.ps_address for v in emb.variables] == [p0.address, p1.address]
        adagrad = opt.Adagrad(learning_rate=0.5)

        def dataset_fn():
            ids = np.arange(vocab, dtype="i8")
            return dds.Dataset.from_tensor_slices(ids).shuffle(vocab, seed=3).repeat().batch(50)

        it = iter(coord.create_per_worker_dataset(dataset_fn))

        def train_step(iterator):
            ids = next(iterator)
            rows = emb.gather(ids)
            p = 1 / (1 + np.exp(-rows.sum(axis=1)))
            g = (p - labels[ids])[:, None] * np.ones((1, dim), "f4") / len(ids)
            adagrad.apply_gradients([(opt.IndexedSlices(g.astype("f4"), ids), emb)])

        for _ in range(160):
            coord.schedule(train_step, args=(it,))
        coord.join()
        table = emb.numpy()
        acc = float(np.mean((table.sum(axis=1) > 0) == (labels > 0)))
        assert acc >= 0.95, acc
        # the optimizer's accumulator lives beside each shard on its PS
        for v in emb.variables:
            info = c.sync(c.rpc(v.ps_address).ps_info)["shards"][v.key]
            assert info["slots"] == {adagrad.name: ("accumulator",)}

    await in_thread(s, body)


# -- checkpoints ------------------------------------------------------------------------

async def _cluster(n_ps: int, n_workers: int, body):
    async with Scheduler(dashboard_address=":0", protocol="tcp") as s:
        workers = [Worker(s.address, nthreads=1, resources={"ps": 1}, name=f"ps{i}")
                   for i in range(n_ps)]
        workers += [Worker(s.address, nthreads=1, name=f"w{i}") for i in range(n_workers)]
        await asyncio.gather(*workers)
        try:
            return await in_thread(s, body)
        finally:
            await asyncio.gather(*(w.close() for w in workers))


def test_checkpoint_saved_on_2_ps_restores_onto_3_ps(tmp_path):
    path = str(tmp_path / "ckpt")
    rng = np.random.default_rng(0)
    table = rng.normal(size=(13, 3)).astype("f4")
    dense = rng.normal(size=(5,))
    adam = opt.Adam(0.05, name="adam")

    def save(c):
        strategy = dds.ParameterServerStrategy(
            c, variable_partitioner=dds.partitioners.FixedShardsPartitioner(2))
        with strategy.scope():
            emb = dds.Variable(table, name="emb")
            w = dds.Variable(dense, name="w")
            step = dds.Variable(0, dtype="i8", name="step")
        assert len({v.ps_address for v in emb.variables}) == 2
        adam.apply_gradients([(opt.IndexedSlices(np.ones((2, 3), "f4"), np.array([1, 12])), emb),
                              (np.ones(5), w)])
        step.assign_add(7)
        local = dds.Variable(np.arange(3.0))  # on the coordinator: saved by the coordinator
        ckpt = dds.Checkpoint(model={"emb": emb, "w": w}, step=step, optimizer=adam, local=local)
        assert ckpt.save(path) == path
        assert ckpt.save_counter == 1
        slots = {k: c.sync(c.rpc(v.ps_address).ps_read_slots, key=v.key, optimizer="adam")["slots"]
                 for k, v in enumerate(emb.variables)}
        return emb.numpy(), w.numpy(), slots

    emb_saved, w_saved, slots_saved = asyncio.run(_cluster(2, 1, save))
    root = zarr.open_group(path, mode="r")
    meta = root.attrs["variables"]
    assert meta["model/emb"]["offsets"] == [0, 7, 13]
    assert meta["model/emb"]["slots"] == {"adam": ["iterations", "m", "v"]}
    assert meta["step"]["shape"] == []

    def restore(c):
        strategy = dds.ParameterServerStrategy(
            c, variable_partitioner=dds.partitioners.FixedShardsPartitioner(3))
        with strategy.scope():
            emb = dds.Variable(np.zeros((13, 3), "f4"), name="emb")
            w = dds.Variable(np.zeros(5), name="w")
            step = dds.Variable(0, dtype="i8", name="step")
        assert [v.shape[0] for v in emb.variables] == [5, 4, 4]
        assert len({v.ps_address for v in emb.variables}) == 3
        local = dds.Variable(np.zeros(3))
        ckpt = dds.Checkpoint(model={"emb": emb, "w": w}, step=step, optimizer=adam, local=local)
        ckpt.restore(path)
        assert ckpt.save_counter == 1
        np.testing.assert_array_equal(local.numpy(), np.arange(3.0))
        np.testing.assert_array_equal(emb.numpy(), emb_saved)
        np.testing.assert_array_equal(w.numpy(), w_saved)
        assert int(step.numpy()) == 7
        # the optimizer slots were resharded too: rows 0..4 come from saved shard 0
        got = c.sync(c.rpc(emb.variables[0].ps_address).ps_read_slots,
                     key=emb.variables[0].key, optimizer="adam")["slots"]
        np.testing.assert_array_equal(got["m"], slots_saved[0]["m"][:5])
        got2 = c.sync(c.rpc(emb.variables[2].ps_address).ps_read_slots,
                      key=emb.variables[2].key, optimizer="adam")["slots"]
        np.testing.assert_array_equal(got2["v"], slots_saved[1]["v"][2:])
        # training continues from the restored state
        adam.apply_gradients([(np.ones(5), w)])
        assert not np.array_equal(w.numpy(), w_saved)

        # incompatible checkpoints: a clear error naming the variable and the shapes
        with strategy.scope():
            other = dds.Variable(np.zeros((12, 3), "f4"), name="emb")
        with pytest.raises(CheckpointMismatchError,
                           match=r"'model/emb' has shape \(12, 3\) but .* shape \(13, 3\)"):
            dds.Checkpoint(model={"emb": other}).restore(path)
        with pytest.raises(CheckpointMismatchError, match="'extra' .* is not in checkpoint"):
            dds.Checkpoint(extra=w).restore(path)
        with strategy.scope():
            wrong = dds.Variable(np.zeros(5, "f4"), name="w")
        with pytest.raises(CheckpointMismatchError, match="dtype float32 .* dtype float64"):
            dds.Checkpoint(model={"w": wrong}).restore(path)
        with pytest.raises(FileNotFoundError):
            dds.Checkpoint(w=w).restore(str(tmp_path / "missing"))
        np.testing.assert_array_equal(other.numpy(), np.zeros((12, 3), "f4"))  # untouched

    asyncio.run(_cluster(3, 1, restore))


def test_demo_trains_on_a_data_service_stream(tmp_path):
    from dask_dataservice.demo import VOCAB_SIZE as _VOCAB_SIZE
    from dask_dataservice.demo import make_click_dataset, train_click_model

    path = str(tmp_path / "demo-ckpt")
    seen = []

    def body(c):
        ds = make_click_dataset(3000, batch_size=100, shuffle_buffer=500, seed=3)
        result = train_click_model(c, ds, examples=3000, batch_size=100, vocab_size=_VOCAB_SIZE,
                                   checkpoint_dir=path, progress=lambda d, t: seen.append((d, t)))
        assert result.examples == 3000  # DYNAMIC sharding: every example once
        assert 30 <= result.steps <= 32 and result.scheduled >= result.steps
        assert 0.0 <= result.accuracy <= 1.0 and result.logloss > 0
        assert seen[-1] == (3000, 3000)
        assert result.checkpoint == path
        meta = zarr.open_group(path, mode="r").attrs["variables"]
        assert meta["model/embedding"]["shape"] == [_VOCAB_SIZE, 8]
        assert len(meta["model/embedding"]["offsets"]) == 3  # 2 shards on 2 PS
        assert meta["model/embedding"]["slots"] == {"demo_adagrad": ["accumulator"]}
        step = dds.Variable(0, dtype="int64")
        dds.Checkpoint(step=step).restore(path)
        assert int(step.numpy()) == result.steps

    asyncio.run(_cluster(2, 2, body))
