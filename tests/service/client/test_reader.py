"""Component tier: the reader and its channel, with a fake dispatcher and fake workers."""

from __future__ import annotations

import asyncio
import queue
import threading

import pytest
from distributed.utils_test import gen_test

from dask_dataservice.service.client import _reader
from dask_dataservice.service.client._read_channel import END, Channel, Failure
from dask_dataservice.service.client._reader import IterationReader
from dask_dataservice.service.client._service_source import ReadSpec
from dask_dataservice.testing.fakes import FakeClient, FakeDispatcher, FakeWorker

pytestmark = [pytest.mark.component, pytest.mark.timeout(30)]

A, B = "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"


def _spec() -> ReadSpec:
    return ReadSpec("tcp://127.0.0.1:8786", 1, 0, None, None, None, None, "ANY", None)


async def _drain(channel: Channel) -> list:
    out = []
    while True:
        item = await channel.aget()
        if item is END:
            return out
        if isinstance(item, Failure):
            raise item.exc
        out.extend(item)


@gen_test()
async def test_reader_reads_every_task_then_ends():
    dispatcher = FakeDispatcher([{"task_id": 1, "worker_address": A, "status": "active"},
                                 {"task_id": 2, "worker_address": B, "status": "active"}],
                                finished=True)
    client = FakeClient(dispatcher, {A: FakeWorker({1: range(25)}), B: FakeWorker({2: range(100, 107)})})
    channel = Channel(asyncio.get_running_loop(), capacity=2)
    reader = IterationReader(client, _spec(), iteration_id=7, client_id=70, channel=channel)
    reader.start(dispatcher.view())
    out = await _drain(channel)
    assert sorted(out) == sorted([*range(25), *range(100, 107)])
    await reader.close()
    assert dispatcher.released == dispatcher.read_to_end == [70]
    assert not reader.group.tasks


@gen_test()
async def test_close_mid_read_cancels_requests_and_releases():
    gate = asyncio.Event()  # the worker never answers
    dispatcher = FakeDispatcher([{"task_id": 1, "worker_address": A, "status": "active"}])
    worker = FakeWorker({1: range(5)}, gate=gate)
    client = FakeClient(dispatcher, {A: worker})
    reader = IterationReader(client, _spec(), 1, 5, Channel(asyncio.get_running_loop(), 2))
    reader.start(dispatcher.view())
    while worker.requests < reader.depth:
        await asyncio.sleep(0)
    await reader.close()
    assert dispatcher.released == [5]
    assert not reader.group.tasks  # every request and fetch loop was cancelled and awaited


@gen_test()
async def test_lost_task_is_not_waited_for():
    dispatcher = FakeDispatcher([{"task_id": 1, "worker_address": A, "status": "active"},
                                 {"task_id": 2, "worker_address": B, "status": "lost"}],
                                finished=True)
    client = FakeClient(dispatcher, {A: FakeWorker({1: range(3)})})
    channel = Channel(asyncio.get_running_loop(), 4)
    reader = IterationReader(client, _spec(), 1, 1, channel)
    reader.start(dispatcher.view())
    assert await _drain(channel) == [0, 1, 2]
    await reader.close()


@gen_test()
async def test_channel_bounds_the_loop_side_and_wakes_it_from_a_thread():
    channel = Channel(asyncio.get_running_loop(), capacity=2)
    await channel.put([1])
    await channel.put([2])
    blocked = asyncio.ensure_future(channel.put([3]))
    await asyncio.sleep(0)
    assert not blocked.done()  # full: the loop side waits
    got = []
    t = threading.Thread(target=lambda: got.append(channel.get(timeout=5)))
    t.start()
    await asyncio.wait_for(blocked, 5)  # the thread's get woke it
    t.join()
    assert got == [[1]]
    assert channel.get(timeout=1) == [2] and channel.get(timeout=1) == [3]


@pytest.mark.pure
def test_end_of_sequence_wins_over_a_reader_that_stopped(monkeypatch):
    """issue 9, 2.13: the end arrives just as the consumer's wait times out."""

    class Reader:
        done = threading.Event()
        channel = Channel.__new__(Channel)

    reader = Reader()
    reader.done.set()
    q = queue.SimpleQueue()
    q.put(END)
    calls = []

    def get(timeout=None):  # the wait timed out; the end is queued behind it
        calls.append("get")
        raise queue.Empty

    reader.channel.get = get
    reader.channel.get_nowait = lambda: q.get_nowait()

    class Client:
        status = "running"
        asynchronous = False

    monkeypatch.setattr(_reader._connection, "check_can_block", lambda c, what: None)
    monkeypatch.setattr(_reader._connection, "ensure_installed", lambda c: None)
    monkeypatch.setattr(_reader._connection, "run_blocking", lambda c, fn, *a: reader)
    monkeypatch.setattr(_reader, "_close_soon", lambda c, r: None)
    assert list(_reader.read(_spec(), 0, Client())) == []  # no "the reader stopped" error
    assert calls == ["get"]


@gen_test()
async def test_unanswered_request_is_reported_then_the_lost_task_ends_the_read():
    """A worker that never answers (frozen): after client.request-timeout the reader asks the
    dispatcher to check it; once the dispatcher reports the task lost, the read ends."""
    import dask

    gate = asyncio.Event()  # the worker never answers
    dispatcher = FakeDispatcher([{"task_id": 1, "worker_address": A, "status": "active"},
                                 {"task_id": 2, "worker_address": B, "status": "active"}])
    client = FakeClient(dispatcher, {A: FakeWorker({1: range(5)}, gate=gate),
                                     B: FakeWorker({2: range(100, 103)})})
    with dask.config.set({"dataservice.client.request-timeout": "200ms",
                          "dataservice.client.heartbeat-interval": "50ms"}):
        reader = IterationReader(client, _spec(), 1, 5, Channel(asyncio.get_running_loop(), 4))
    reader.start(dispatcher.view())
    deadline = asyncio.get_running_loop().time() + 10
    while not dispatcher.suspected:
        assert asyncio.get_running_loop().time() < deadline, "the worker was never reported"
        await asyncio.sleep(0.01)
    assert dispatcher.suspected[0] == A
    # the dispatcher dropped it: its task is lost, the other finished
    dispatcher.tasks = [{"task_id": 1, "worker_address": A, "status": "lost"},
                        {"task_id": 2, "worker_address": B, "status": "finished"}]
    dispatcher.finished = True
    assert sorted(await asyncio.wait_for(_drain(reader.channel), 10)) == [100, 101, 102]
    await reader.close()


@gen_test()
async def test_no_task_warns_then_fails_with_the_dispatchers_reason():
    import dask

    dispatcher = FakeDispatcher([])
    client = FakeClient(dispatcher, {})
    with dask.config.set({"dataservice.client.no-workers-warning": "100ms",
                          "dataservice.client.no-workers-timeout": "500ms",
                          "dataservice.client.heartbeat-interval": "20ms"}):
        reader = IterationReader(client, _spec(), 1, 5, Channel(asyncio.get_running_loop(), 4))
    reader.start(dispatcher.view())
    with pytest.raises(_reader.DataServiceError, match="no worker is connected.*no-workers-timeout"):
        await asyncio.wait_for(_drain(reader.channel), 10)
    await reader.close()


@pytest.mark.pure
def test_tracker_warns_every_interval_and_fails_after_the_timeout():
    t = _reader._Tracker(warning=1.0, timeout=5.0)
    assert [t.state(w) for w in (0.5, 1.0, 1.5, 2.1, 4.9, 5.0)] == [
        None, "warn", None, "warn", "warn", "fail"]
    t.reset()
    assert t.state(1.0) == "warn"
    assert _reader._Tracker(warning=None, timeout=None).state(1e9) is None
