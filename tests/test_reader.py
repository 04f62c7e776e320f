"""Component tier: the reader and its channel, with a fake dispatcher and fake workers."""

from __future__ import annotations

import asyncio
import queue
import threading

import pytest
from distributed.utils_test import gen_test

from dask_dataservice.service import _reader
from dask_dataservice.service._reader import END, Channel, Failure, IterationReader, ReadSpec
from dask_dataservice.testing.fakes import FakeClient, FakeDispatcher, FakeWorker

pytestmark = pytest.mark.timeout(30)

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
    assert dispatcher.released == [70]
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
