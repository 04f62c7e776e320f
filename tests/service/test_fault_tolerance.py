"""Fault-tolerant dispatcher: journal replay, restart in place, workers that come back."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys

import dask
import pytest
from _helpers import free_port  # noqa: E402
from _helpers import wait as _wait  # noqa: E402
from distributed import Client

import dask_dataservice as dds
from dask_dataservice.service.dispatcher._state_codec import restore
from dask_dataservice.service.dispatcher.journal import list_snapshots, load_journal

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(90)]


def _state(client):
    """The dispatcher's full state view (tasks and lost splits of every job): code run on the
    scheduler sees everything (``dataservice_state`` shows a stranger names and counts)."""
    # a nested function: cloudpickle sends it by value (the scheduler process cannot import
    # this test module)
    def full_summary(dask_scheduler):
        return {"status": "OK", **dask_scheduler.extensions["dataservice"].state.summary()}

    return client.run_on_scheduler(full_summary)


def test_restart_in_process_recovers_state_and_workers_return(tmp_path):
    """Stop the dispatcher mid-epoch, start it again on the same port and work_dir."""
    port = free_port()
    cfg = dds.DispatcherConfig(port=port, fault_tolerant_mode=True, work_dir=str(tmp_path))
    dispatcher = dds.DispatchServer(cfg)
    w1 = dds.WorkerServer(dds.WorkerConfig(dispatcher._address))
    w2 = dds.WorkerServer(dds.WorkerConfig(dispatcher._address))
    try:
        with Client(dispatcher.target, timeout="20s") as c:
            c.wait_for_workers(2)
            source = dds.Dataset.range(20_000)
            dataset_id = dds.register_dataset(c, source)
            ds = dds.from_dataset_id("distributed_epoch", c, dataset_id, job_name="ft",
                                     max_outstanding_requests=1)
            it = iter(ds)
            seen = [next(it) for _ in range(500)]
            before = _state(c)
            old = dispatcher.server.plugins["dataservice-dispatcher"]
            it_id = old.state.list_iterations()[0].iteration_id

            dispatcher.stop()  # the workers wait for it (they keep their tasks)
            cursor_before = old.state.split_cursor(it_id)  # frozen now
            dispatcher = dds.DispatchServer(cfg)
            plugin = dispatcher.server.plugins["dataservice-dispatcher"]
            assert plugin.recovered_updates > 0
            after = _state(c)
            assert after["datasets"] == before["datasets"]
            assert after["jobs"] == before["jobs"]
            cursor_after = plugin.state.split_cursor(it_id)
            # nothing handed out before the restart is handed out again (workers that already
            # re-registered may have taken more splits since)
            assert (cursor_after.repetition, cursor_after.next_index) >= (
                cursor_before.repetition, cursor_before.next_index)
            assert plugin.recovered_updates >= old.state.snapshot()["next_ids"]["task"] - 4000
            # the workers came back by themselves and registered again, with their tasks
            _wait(lambda: w1.reconnects >= 1 and w2.reconnects >= 1,
                  what="workers to re-register")
            assert w1.restarts == 0 and w2.restarts == 0
            # the consumer goes on reading the same job
            seen += list(it)
        counts = collections.Counter(seen)
        assert max(counts.values()) == 1, "no element twice (at-most-once across the restart)"
        lost = plugin.state.lost_splits(it_id)
        splits = source.splits()
        allowed = set()
        for _, index in lost:
            allowed.update(range(splits[index].start, splits[index].stop))
        missing = set(range(20_000)) - set(seen)
        assert missing <= allowed | _buffered_allowance(seen), "lost only in-flight splits"
        assert not missing and not lost, "the restart is invisible: nothing lost"
    finally:
        w1.stop()
        w2.stop()
        dispatcher.stop()


def _buffered_allowance(seen):
    return set()


def test_journal_replays_to_the_same_state(tmp_path):
    """Snapshots every few records: replay = the newest snapshot + the records after it."""
    cfg = dds.DispatcherConfig(fault_tolerant_mode=True, work_dir=str(tmp_path))
    with dask.config.set({"dataservice.dispatcher.snapshot-records": 4}), \
            dds.DispatchServer(cfg) as dispatcher, \
            dds.WorkerServer(dds.WorkerConfig(dispatcher._address)):
        with Client(dispatcher.target) as c:
            ds = dds.Dataset.range(3000).apply(dds.distribute("distributed_epoch", c))
            assert sorted(ds) == list(range(3000))
            assert sorted(ds) == list(range(3000))
            plugin = dispatcher.server.plugins["dataservice-dispatcher"]
            journal = plugin._journal
            _wait(lambda: journal.metrics.snapshots_written >= 1, what="a snapshot")
    assert list_snapshots(tmp_path)
    # every update the dispatcher applied, and nothing else, is in the journal
    contents = load_journal(tmp_path)
    assert contents.snapshot is not None
    restored, _ = restore(*contents)
    assert restored.snapshot() == plugin.state.snapshot()
    assert len(restored.list_iterations()) == 2
    restored.validate_state()


def test_fault_tolerant_mode_needs_work_dir():
    import asyncio

    from distributed import Scheduler

    from dask_dataservice.service.dispatcher.plugin import DispatcherPlugin

    async def go():
        s = Scheduler(dashboard_address=":0")
        s.add_plugin(DispatcherPlugin(fault_tolerant_mode=True, work_dir=None))
        with pytest.raises(RuntimeError, match="failed to start") as info:
            await s
        assert isinstance(info.value.__cause__, ValueError)
        assert "needs a work_dir" in str(info.value.__cause__)
        await s.close()

    asyncio.run(go())


# ---------------------------------------------------------------------------------------
# real processes: SIGKILL the scheduler mid-epoch and start it again in place (the tests
# are in test_invisible_restart.py; this module keeps the cluster they share)
# ---------------------------------------------------------------------------------------


#: Elements a worker task may buffer in these tests. Production is then held back by
#: consumption (back-pressure), so a scheduler killed after the consumer read 2,000 of 20,000
#: elements always lands mid-epoch: at most ~(buffer + the consumer's read-ahead) elements
#: were produced. This replaces a sleep per element that only made the kill *likely* early.
BUFFER_ELEMENTS = 256


#: The console script, as a user runs it (installed beside this interpreter).
CLI = os.path.join(os.path.dirname(sys.executable), "dask-dataservice")


class _Cluster:
    """A fault-tolerant dispatcher process and supervised worker processes, started with
    the commands a user runs: ``dask-dataservice scheduler --work-dir`` and
    ``dask-dataservice worker --supervise``. Used by tests/service/test_invisible_restart.py,
    the real-process tests of a scheduler killed mid-epoch (SIGKILL) and restarted from its
    journal; the same fault on other workloads and interleavings is the simulator's
    (``kill_dispatcher``, tests/testing/test_sim.py)."""

    def __init__(self, tmp_path, nworkers=2):
        self.port = free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.logs = tmp_path
        self.work_dir = tmp_path / "journal"
        # snapshots every few records: the kill lands on a journal of snapshot + tail, maybe
        # in the middle of a compaction
        self.env = dict(os.environ, DASK_DATASERVICE__WORKER__BUFFER_ELEMENTS=str(BUFFER_ELEMENTS),
                        DASK_DATASERVICE__DISPATCHER__SNAPSHOT_RECORDS="8")
        self.starts = 0
        self.scheduler = self._start_scheduler()
        self.workers = [
            subprocess.Popen(
                [CLI, "worker", "--supervise", self.address, "--host", "127.0.0.1"],
                env=self.env, stdout=open(tmp_path / f"worker{i}.log", "w"),
                stderr=subprocess.STDOUT,
            )
            for i in range(nworkers)
        ]

    def _start_scheduler(self):
        self.starts += 1
        return subprocess.Popen(
            [CLI, "scheduler", "--work-dir", str(self.work_dir), "--host", "127.0.0.1",
             "--port", str(self.port), "--dashboard-address", "127.0.0.1:0"],
            env=self.env, stdout=open(self.logs / f"scheduler{self.starts}.log", "w"),
            stderr=subprocess.STDOUT,
        )

    def kill_and_restart_scheduler(self):
        self.scheduler.send_signal(signal.SIGKILL)
        self.scheduler.wait(10)
        self.scheduler = self._start_scheduler()

    def close(self):
        for p in [*self.workers, self.scheduler]:
            p.terminate()
        for p in [*self.workers, self.scheduler]:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def _lost_elements(state, splits):
    lost = set()
    for it in state["iterations"].values():
        for _, index in it["lost_splits"]:
            lost.update(range(splits[index].start, splits[index].stop))
    return lost


def test_a_restart_without_the_journal_never_mixes_old_tasks_with_new_ones():
    """A dispatcher restarted *without* fault-tolerant mode starts from an empty state and
    reuses task ids; a worker that reconnected with the tasks of the previous run must drop
    them (and forget their ids), so that a new task with a reused id runs the new job."""
    port = free_port()
    cfg = dds.DispatcherConfig(port=port)
    dispatcher = dds.DispatchServer(cfg)
    worker = dds.WorkerServer(dds.WorkerConfig(dispatcher._address))
    try:
        with Client(dispatcher.target, timeout="20s") as c:
            c.wait_for_workers(1)
            first = dds.Dataset.range(10**6).apply(dds.distribute("parallel_epochs", c))
            it = iter(first)
            assert [next(it) for _ in range(10)] == list(range(10))
            old = dispatcher.server.plugins["dataservice-dispatcher"]
            [old_task] = [t.task_id for i in old.state.list_iterations()
                          for t in old.state.tasks_for_iteration(i.iteration_id)]
            it.close()  # the worker remembers the task (finished) and caches its pipeline
            _wait(lambda: old_task in worker.server.worker.extensions["dataservice"]
                  .finished_tasks, what="the old task to end on the worker")
            dispatcher.stop()
            dispatcher = dds.DispatchServer(cfg)
            _wait(lambda: worker.reconnects >= 1, what="the worker to reconnect")
            second = dds.Dataset.range(100, 200).apply(dds.distribute("parallel_epochs", c))
            it2 = iter(second)
            head = [next(it2)]
            # read while the iteration is live (its tasks are gone once it is collected)
            plugin = dispatcher.server.plugins["dataservice-dispatcher"]
            new_tasks = [t.task_id for i in plugin.state.list_iterations()
                         for t in plugin.state.tasks_for_iteration(i.iteration_id)]
            assert sorted(head + list(it2)) == list(range(100, 200))
            assert old_task in new_tasks, (
                f"the id was reused (what makes the test bite): {old_task} not in {new_tasks}")
    finally:
        worker.stop()
        dispatcher.stop()
