"""Input position saved with the variables: train, back up at step k, lose every server
(scheduler, parameter server, training workers and coordinator), start again, finish; each
example is trained on exactly as often as one pass over each worker's stream says."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import zarr
from distributed import Client, Scheduler, Worker
from distributed.utils_test import gen_test

import dask_dataservice as dds
from dask_dataservice.ps.callbacks import BackupAndRestore
from dask_dataservice.ps.fit import fit
from dask_dataservice.ps.input_position import CountingIterator, InputPositionError, reposition
from dask_dataservice.testing import gen_cluster
from dask_dataservice.testing._ps import warm_up_zarr

pytestmark = [pytest.mark.pure, pytest.mark.timeout(90)]

warm_up_zarr()

from _helpers import wait  # noqa: E402
from test_callbacks import _Crash  # noqa: E402


@contextlib.asynccontextmanager
async def _cluster(trainers: int):
    """A fresh cluster whose workers have the same names each time."""
    async with Scheduler(dashboard_address=":0", port=0) as s:
        async with Worker(s.address, name="ps-0", nthreads=1, resources={"ps": 1}) as p:
            workers = [Worker(s.address, name=f"trainer-{i}", nthreads=1) for i in range(trainers)]
            await asyncio.gather(*workers)
            try:
                yield s, p, workers
            finally:
                await asyncio.gather(*(w.close() for w in workers))


def _shard_of_worker(size: int, trainers: int, batch: int):
    def dataset_fn():
        from distributed import get_worker

        index = int(str(get_worker().name).rsplit("-", 1)[1])
        return dds.Dataset.range(size).shard(trainers, index).batch(batch).repeat()

    return dataset_fn


def _train(address, directory, dataset_fn, size, steps, crash_at, crash=_Crash, workers=2):
    """One coordinator's life: returns the counts of examples trained on (or None)."""
    with Client(address, set_as_default=False) as c:
        c.wait_for_workers(workers, timeout=60)
        strategy = dds.ParameterServerStrategy(c)
        coordinator = dds.ClusterCoordinator(strategy)
        with strategy.scope():
            seen = dds.Variable(np.zeros(size, "i8"), name="seen")

        def step(iterator):
            ids = np.asarray(next(iterator))
            seen.scatter_add(ids, np.ones(len(ids), "i8"))
            return {"examples": float(len(ids))}

        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
        backup = BackupAndRestore(dds.Checkpoint(seen=seen, input=iterator), directory,
                                  save_freq=4, delete_checkpoint=False)
        callbacks = [backup] + ([crash(crash_at)] if crash_at else [])
        try:
            fit(coordinator, step, iterator, epochs=1, steps_per_epoch=steps,
                callbacks=callbacks, verbose=False)
        except RuntimeError as e:
            assert "crash for the test" in str(e)
            return None, backup.restored
        return seen.numpy(), backup.restored


async def _two_lives(trainers: int, size: int, batch: int, steps: int, crash_at: int):
    directory = tempfile.mkdtemp()
    dataset_fn = _shard_of_worker(size, trainers, batch)
    try:
        async with _cluster(trainers) as (s, _, _):
            seen, restored = await asyncio.to_thread(_train, s.address, directory, dataset_fn,
                                                     size, steps, crash_at, _Crash, trainers + 1)
            assert seen is None and restored is None
        # every server of the first life is gone; the backup is all that is left
        attrs = dict(zarr.open_group(os.path.join(directory, "backup-1"), mode="r").attrs)
        async with _cluster(trainers) as (s, _, _):
            seen, restored = await asyncio.to_thread(_train, s.address, directory, dataset_fn,
                                                     size, steps, None, _Crash, trainers + 1)
        return seen, restored, attrs
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.cluster
@pytest.mark.slow
@gen_test(timeout=80)
async def test_one_epoch_exactly_after_losing_every_server():
    # 40 examples in batches of 4: one epoch is 10 steps; backup at step 4, crash at 6
    seen, restored, attrs = await _two_lives(trainers=1, size=40, batch=4, steps=10,
                                             crash_at=6)
    assert attrs["inputs"] == {"input": {"trainer-0": 4}}
    assert restored["global_step"] == 4
    np.testing.assert_array_equal(seen, np.ones(40, "i8"))  # each example exactly once


@pytest.mark.cluster
@pytest.mark.slow
@gen_test(timeout=80)
async def test_each_worker_stream_resumes_where_it_was():
    # two workers, each reading its shard (20 examples, batches of 2, repeated); steps go
    # to either worker, so each worker trains on a prefix of its own stream
    seen, restored, attrs = await _two_lives(trainers=2, size=40, batch=2, steps=14,
                                             crash_at=7)
    saved = attrs["inputs"]["input"]
    assert sum(saved.values()) == 4  # one batch per step, 4 steps before the backup
    assert restored["global_step"] == 4
    assert seen.sum() == 14 * 2
    for index in range(2):
        stream = np.arange(40)[index::2]
        n = int(seen[stream].sum())
        expected = np.array([n // 20 + (i < n % 20) for i in range(20)])
        np.testing.assert_array_equal(seen[stream], expected)


def test_counting_iterator_skips_then_counts():
    it = CountingIterator(dds.Dataset.range(10), skip=3)
    assert it.count == 0  # nothing happens before the first next
    assert [int(next(it)) for _ in range(2)] == [3, 4]
    assert it.count == 5
    assert [int(x) for x in it] == [5, 6, 7, 8, 9]
    assert it.count == 10


def test_reposition_checks_counts():
    class Handle:
        uid = "a"
        start: dict = {}

    h = Handle()
    reposition(h, {"w": 3})
    assert h.start == {"w": 3} and h.uid != "a"
    with pytest.raises(InputPositionError, match="counts >= 0"):
        reposition(h, {"w": -1})


@pytest.mark.cluster
@gen_cluster(client=True, nthreads=[("", 1)])
async def test_a_data_service_dataset_is_not_repositioned(c, s, a):
    from _helpers import distribute

    ds = await distribute(dds.Dataset.range(10), "distributed_epoch", c)
    # in a thread: iterating a data-service dataset blocks
    values = await asyncio.to_thread(lambda: [int(x) for x in CountingIterator(ds, skip=0)])
    assert sorted(values) == list(range(10))  # no position to restore: read as usual
    with pytest.raises(InputPositionError, match="data-service dataset .* is not a count"):
        await asyncio.to_thread(next, CountingIterator(ds, skip=3))


def test_checkpoint_attributes_are_written_once(monkeypatch):
    """The attributes that make a checkpoint complete (format) and its contents (variables,
    inputs) reach zarr.json in one write: a reader never sees one without the other."""
    import json

    from zarr.storage import LocalStore

    writes: list[dict] = []
    original = LocalStore.set

    async def spy(self, key, value):  # records, then writes as zarr does
        if key == "zarr.json":
            writes.append(json.loads(value.to_bytes()).get("attributes", {}))
        return await original(self, key, value)

    monkeypatch.setattr(LocalStore, "set", spy)
    directory = tempfile.mkdtemp()
    try:
        w = dds.Variable(np.arange(3, dtype="f4"), name="w")
        dds.Checkpoint(w=w).save(os.path.join(directory, "ckpt"))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    complete = [a for a in writes if "format" in a]
    assert complete and all({"variables", "save_counter", "inputs"} <= set(a) for a in complete)


class _KillEveryServer(_Crash):
    """At step ``at``: SIGKILL the scheduler, the PS and the training workers, then stop."""

    pids: list[int] = []

    def on_train_batch_end(self, batch, logs=None):
        if self.run.global_step == self.at:
            for pid in self.pids:
                os.kill(pid, signal.SIGKILL)
            raise RuntimeError("crash for the test: every server was killed")


def _address_in(scheduler_file: str) -> str | None:
    """The address in a scheduler file, or None while it is not (completely) written."""
    try:
        with open(scheduler_file) as f:
            return json.load(f)["address"]
    except (OSError, ValueError, KeyError):
        return None


@contextlib.contextmanager
def _process_cluster(directory: str, trainers: int, data_workers: int = 0):
    """A scheduler, a PS and training workers as processes, named the same each time (and
    ``data_workers`` workers that only serve data: the trainers then have the resource
    ``worker``)."""
    scheduler_file = os.path.join(directory, f"scheduler-{time.monotonic_ns()}.json")
    common = ["--host", "127.0.0.1", "--no-dashboard"]
    procs = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--port",
                               "0", "--scheduler-file", scheduler_file, *common],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        wait(lambda: _address_in(scheduler_file), 30, "the scheduler file")
        trainer = ["--resources", "worker=1"] if data_workers else []
        for name, extra in [("ps-0", ["--resources", "ps=1"])] + [
                (f"trainer-{i}", trainer) for i in range(trainers)] + [
                (f"data-{i}", []) for i in range(data_workers)]:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "distributed.cli.dask_worker", "--scheduler-file",
                 scheduler_file, "--nthreads", "1", "--no-nanny", "--name", name, *extra,
                 *common], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        address = _address_in(scheduler_file)
        yield address, [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait(30)


@pytest.mark.process
@pytest.mark.slow
def test_one_epoch_exactly_after_sigkilling_every_process():
    directory = tempfile.mkdtemp()
    backup = os.path.join(directory, "backup")
    dataset_fn = _shard_of_worker(40, 1, 4)
    try:
        with _process_cluster(directory, 1) as (address, pids):
            _KillEveryServer.pids = pids
            seen, restored = _train(address, backup, dataset_fn, 40, 10, 6, _KillEveryServer)
            assert seen is None and restored is None
        with _process_cluster(directory, 1) as (address, _):
            seen, restored = _train(address, backup, dataset_fn, 40, 10, None)
        assert restored["global_step"] == 4
        np.testing.assert_array_equal(seen, np.ones(40, "i8"))  # each example exactly once
    finally:
        shutil.rmtree(directory, ignore_errors=True)
