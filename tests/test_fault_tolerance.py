"""Fault-tolerant dispatcher: journal replay, restart in place, workers that come back."""

from __future__ import annotations

import collections
import socket
import time

import pytest
from distributed import Client

import dask_dataservice as dds
from dask_dataservice.service.journal import read_journal
from dask_dataservice.service.state import decode_update, replay

pytestmark = pytest.mark.timeout(90)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(cond, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _state(client):
    return client.sync(client.scheduler.dataservice_state)


def test_restart_in_process_recovers_state_and_workers_return(tmp_path):
    """Stop the dispatcher mid-epoch, start it again on the same port and work_dir."""
    port = _free_port()
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

            dispatcher.stop()  # the workers close themselves; their supervisors restart them
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
            # the workers came back by themselves and registered again
            _wait(lambda: len(_state(c)["workers"]) == 2, what="workers to re-register")
            assert w1.restarts >= 1 and w2.restarts >= 1
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
    finally:
        w1.stop()
        w2.stop()
        dispatcher.stop()


def _buffered_allowance(seen):
    return set()


def test_journal_replays_to_the_same_state(tmp_path):
    cfg = dds.DispatcherConfig(fault_tolerant_mode=True, work_dir=str(tmp_path))
    with dds.DispatchServer(cfg) as dispatcher, dds.WorkerServer(dds.WorkerConfig(dispatcher._address)):
        with Client(dispatcher.target) as c:
            ds = dds.Dataset.range(3000).apply(dds.distribute("distributed_epoch", c))
            assert sorted(ds) == list(range(3000))
            assert sorted(ds) == list(range(3000))
            plugin = dispatcher.server.plugins["dataservice-dispatcher"]
    # every update the dispatcher applied, and nothing else, is in the journal
    restored = replay(decode_update(r) for r in read_journal(tmp_path))
    assert restored.snapshot() == plugin.state.snapshot()
    assert len(restored.list_iterations()) == 2
    restored.validate_state()


def test_fault_tolerant_mode_needs_work_dir():
    import asyncio

    from distributed import Scheduler

    from dask_dataservice.service.dispatcher import DispatcherPlugin

    async def go():
        s = Scheduler(dashboard_address=":0")
        s.add_plugin(DispatcherPlugin(fault_tolerant_mode=True, work_dir=None))
        with pytest.raises(RuntimeError, match="failed to start") as info:
            await s
        assert isinstance(info.value.__cause__, ValueError)
        assert "needs a work_dir" in str(info.value.__cause__)
        await s.close()

    asyncio.run(go())
