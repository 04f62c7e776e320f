"""fit's callbacks: ModelCheckpoint, BackupAndRestore (a killed coordinator process),
EarlyStopping, ProgressBar."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import textwrap

import numpy as np
import pytest
import zarr

import dask_dataservice as dds
from dask_dataservice.ps.callbacks import (
    BackupAndRestore,
    Callback,
    EarlyStopping,
    LambdaCallback,
    ModelCheckpoint,
    ProgressBar,
    latest_checkpoint,
)
from dask_dataservice.ps.fit import fit
from dask_dataservice.testing import gen_cluster
from dask_dataservice.testing._ps import warm_up_zarr

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(90)]

warm_up_zarr()

from _helpers import PS, WK, in_thread  # noqa: E402


def _step(counter):
    def step(iterator):
        next(iterator)
        counter.assign_add(1)
        return {"loss": 1.0}

    return step


def _data():
    return dds.Dataset.range(10).repeat()


def _strategy_and_counter(c):
    strategy = dds.ParameterServerStrategy(c)
    with strategy.scope():
        counter = dds.Variable(0, dtype="i8", name="counter")
    return strategy, counter


@contextlib.contextmanager
def _tempdir():
    directory = tempfile.mkdtemp()
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@gen_cluster(client=False, nthreads=[PS, WK, WK])
async def test_model_checkpoint_every_n_steps_keeps_last_k(s, p0, w0, w1):
    def body(c, directory):
        strategy, counter = _strategy_and_counter(c)
        ckpt = dds.Checkpoint(counter=counter)
        mc = ModelCheckpoint(ckpt, directory, save_freq=5, max_to_keep=2)
        fit(strategy, _step(counter), _data, epochs=2, steps_per_epoch=8, callbacks=[mc],
            verbose=False)
        # saves at global steps 5, 10, 15: the last two kept, each with exactly its steps
        assert sorted(os.listdir(directory)) == ["ckpt-2", "ckpt-3", "latest"]
        assert latest_checkpoint(directory) == os.path.join(directory, "ckpt-3")
        for name, steps in (("ckpt-2", 10), ("ckpt-3", 15)):
            attrs = dict(zarr.open_group(os.path.join(directory, name), mode="r").attrs)
            assert attrs["save_counter"] == int(name[-1])
            with strategy.scope():
                fresh = dds.Variable(0, dtype="i8", name="counter")
            dds.Checkpoint(counter=fresh).restore(os.path.join(directory, name))
            assert int(fresh.numpy()) == steps
        with open(os.path.join(directory, "latest")) as f:
            assert json.load(f)["global_step"] == 15

    with _tempdir() as directory:
        await in_thread(s, lambda c: body(c, directory))


@gen_cluster(client=False, nthreads=[PS, WK])
async def test_model_checkpoint_save_best_only_and_bad_arguments(s, p0, w0):
    def body(c, directory):
        strategy, counter = _strategy_and_counter(c)
        ckpt = dds.Checkpoint(counter=counter)

        def step(iterator):
            return {"loss": 0.0}

        best = ModelCheckpoint(ckpt, directory, monitor="val", save_best_only=True)

        class Val(Callback):  # adds a metric to the epoch's logs, as Keras' callbacks may
            def on_epoch_end(self, epoch, logs=None):
                logs["val"] = [3.0, 2.0, 2.5, 1.0][epoch]

        fit(strategy, step, _data, epochs=4, steps_per_epoch=2, callbacks=[Val(), best],
            verbose=False)
        # improvements at epochs 0, 1, 3 (2.5 is worse than 2.0)
        assert [os.path.basename(p) for p in best.saved] == ["ckpt-1", "ckpt-2", "ckpt-3"]
        with pytest.raises(ValueError, match="save_freq must be 'epoch' or a positive number"):
            ModelCheckpoint(ckpt, directory, save_freq=0)
        with pytest.raises(ValueError, match="save_best_only compares epoch metrics"):
            ModelCheckpoint(ckpt, directory, save_freq=3, save_best_only=True)
        with pytest.raises(TypeError, match="checkpoint must be a dds.Checkpoint"):
            BackupAndRestore(counter, directory)
        with pytest.raises(ValueError, match="mode must be 'auto', 'min' or 'max'"):
            EarlyStopping(mode="lowest")

    with _tempdir() as directory:
        await in_thread(s, lambda c: body(c, directory))


@gen_cluster(client=False, nthreads=[PS, WK])
async def test_early_stopping_and_progress_bar(s, p0, w0):
    def body(c):
        strategy, counter = _strategy_and_counter(c)
        # the loss is flat: best at epoch 0, then no improvement; patience 1 stops after 2
        stop = EarlyStopping(monitor="loss", patience=1)
        out = io.StringIO()
        bar = ProgressBar(file=out, mininterval=0)
        history = fit(strategy, _step(counter), _data, epochs=10, steps_per_epoch=4,
                      callbacks=[stop, bar], verbose=False)
        assert history.epoch == [0, 1, 2]
        assert stop.stopped_epoch == 2
        assert int(counter.numpy()) == 12
        text = out.getvalue()
        assert "epoch 3/10" in text and "4/4" in text and "epoch 4/10" not in text
        # a growing accuracy never triggers it ("auto": accuracy is maximised)
        acc = iter(range(100))

        def rising(iterator):
            return {"accuracy": 0.0}

        class Acc(Callback):
            def on_epoch_end(self, epoch, logs=None):
                logs["accuracy"] = float(next(acc))

        stop = EarlyStopping(monitor="accuracy", patience=0)
        history = fit(strategy, rising, _data, epochs=4, steps_per_epoch=1,
                      callbacks=[Acc(), stop], verbose=False)
        assert history.epoch == [0, 1, 2, 3] and stop.stopped_epoch is None

    await in_thread(s, body)


class _Crash(Callback):
    def __init__(self, at: int):
        super().__init__()
        self.at = at

    def on_train_batch_end(self, batch, logs=None):
        if self.run.global_step == self.at:
            raise RuntimeError("crash for the test")


@gen_cluster(client=False, nthreads=[PS, WK, WK])
async def test_backup_and_restore_in_process(s, p0, w0, w1):
    def body(c, directory):
        strategy, counter = _strategy_and_counter(c)
        backup = BackupAndRestore(dds.Checkpoint(counter=counter), directory, save_freq=3)
        # backups at global steps 3 and 6 (epoch 1, step 2); the crash at step 7
        with pytest.raises(RuntimeError, match="crash for the test"):
            fit(strategy, _step(counter), _data, epochs=3, steps_per_epoch=4,
                callbacks=[backup, _Crash(7)], verbose=False)
        assert backup.restored is None
        with open(os.path.join(directory, "state.json")) as f:
            state = json.load(f)
        assert (state["epoch"], state["step"], state["global_step"]) == (1, 2, 6)
        assert state["history"] == {"epoch": [0], "history": {"loss": [1.0]}}
        with strategy.scope():
            fresh = dds.Variable(0, dtype="i8", name="counter")
        ends = []
        again = BackupAndRestore(dds.Checkpoint(counter=fresh), directory, save_freq=3)
        history = fit(strategy, _step(fresh), _data, epochs=3, steps_per_epoch=4,
                      callbacks=[again, LambdaCallback(
                          on_train_batch_end=lambda b, logs: ends.append(b))], verbose=False)
        assert again.restored["global_step"] == 6
        assert ends == [2, 3, 0, 1, 2, 3]  # epoch 1 from step 2, then epoch 2
        assert int(fresh.numpy()) == 12  # 6 restored + 6 trained
        assert history.epoch == [0, 1, 2] and history.history == {"loss": [1.0] * 3}
        assert not os.path.exists(directory)  # deleted after a normal end

    with _tempdir() as tmp:
        await in_thread(s, lambda c: body(c, os.path.join(tmp, "backup")))


_COORDINATOR = textwrap.dedent("""
    import json, os, signal, sys
    from distributed import Client
    import dask_dataservice as dds
    from dask_dataservice.ps.callbacks import BackupAndRestore, LambdaCallback
    from dask_dataservice.ps.fit import fit

    address, directory, log = sys.argv[1:4]
    with Client(address) as c:
        strategy = dds.ParameterServerStrategy(c)
        with strategy.scope():
            counter = dds.Variable(0, dtype="i8", name="counter")

        def step(iterator):
            next(iterator)
            counter.assign_add(1)
            return {"loss": 1.0}

        def batch_end(batch, logs):
            run = cb.run
            with open(log, "a") as f:
                f.write(json.dumps([run.epoch, batch, run.global_step]) + "\\n")
            if run.global_step == 7 and not os.path.exists(log + ".killed"):
                open(log + ".killed", "w").close()
                os.kill(os.getpid(), signal.SIGKILL)  # the coordinator dies, no cleanup

        cb = LambdaCallback(on_train_batch_end=batch_end)
        backup = BackupAndRestore(dds.Checkpoint(counter=counter), directory, save_freq=3)
        history = fit(strategy, step, lambda: dds.Dataset.range(10).repeat(), epochs=3,
                      steps_per_epoch=4, callbacks=[backup, cb], verbose=False)
        print(json.dumps({"counter": int(counter.numpy()), "epochs": history.epoch,
                          "restored": backup.restored["global_step"]}))
""")


@pytest.mark.process
@pytest.mark.slow
@gen_cluster(client=False, nthreads=[PS, WK, WK], timeout=80)
async def test_backup_and_restore_coordinator_process_killed(s, p0, w0, w1):
    with _tempdir() as tmp:
        await _kill_and_resume(s, os.path.join(tmp, "backup"), os.path.join(tmp, "log"))


async def _kill_and_resume(s, directory, log):

    async def coordinator():
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _COORDINATOR, s.address, directory, log,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        return proc.returncode, out.decode(), err.decode()

    code, out, err = await coordinator()
    assert code == -9, err  # killed by SIGKILL at global step 7
    code, out, err = await coordinator()
    assert code == 0, err
    with open(log) as f:
        rows = [tuple(json.loads(line)) for line in f]
    first = [(e, b) for e, b, g in rows[:7]]
    assert first == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2)]
    # the second coordinator resumes at the last backup (global step 6: epoch 1, step 2)
    assert [(e, b) for e, b, g in rows[7:]] == [(1, 2), (1, 3), (2, 0), (2, 1), (2, 2), (2, 3)]
    result = json.loads(out.strip().splitlines()[-1])
    assert result == {"counter": 12, "epochs": [0, 1, 2], "restored": 6}


@pytest.mark.pure
def test_metrics_must_be_numbers():
    from dask_dataservice.ps._fit_run import _metrics

    assert _metrics(None) == {}
    assert _metrics(np.float32(0.5)) == {"loss": 0.5}
    assert _metrics({"acc": np.int64(1)}) == {"acc": 1.0}
    with pytest.raises(TypeError, match="mapping of names to numbers"):
        _metrics([1, 2])


@gen_cluster(client=False, nthreads=[PS, WK])
async def test_model_checkpoint_never_reuses_a_name(s, p0, w0):
    def body(c, directory):
        strategy, counter = _strategy_and_counter(c)
        ckpt = dds.Checkpoint(counter=counter)
        fit(strategy, _step(counter), _data, epochs=3, steps_per_epoch=2,
            callbacks=[ModelCheckpoint(ckpt, directory)], verbose=False)
        ckpt.restore(os.path.join(directory, "ckpt-1"))  # save counter back to 1
        fit(strategy, _step(counter), _data, epochs=1, steps_per_epoch=2,
            callbacks=[ModelCheckpoint(ckpt, directory)], verbose=False)
        assert latest_checkpoint(directory) == os.path.join(directory, "ckpt-4")
        attrs = dict(zarr.open_group(os.path.join(directory, "ckpt-2"), mode="r").attrs)
        assert attrs["save_counter"] == 2  # the first run's ckpt-2 is untouched

    with _tempdir() as directory:
        await in_thread(s, lambda c: body(c, directory))
