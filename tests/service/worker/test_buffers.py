"""Component tier: the data worker's buffers on their own (no cluster).

Each test runs on a real event loop (``gen_test``, with distributed's leak checks); producer
threads are real threads, gated with events, never synchronised by sleeps.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from distributed.utils_test import gen_test

from dask_dataservice.errors import DataServiceError
from dask_dataservice.service.worker._buffers import (
    CrossTrainerWindow,
    ElementBuffer,
    RoundBuffer,
    TaskCancelled,
    element_size,
)
from dask_dataservice.service.worker.core import FINISHED_MEMORY as _FINISHED_MEMORY
from dask_dataservice.service.worker.core import Recent as _Recent
from dask_dataservice.service.worker.core import TrainerCursors

pytestmark = [pytest.mark.component, pytest.mark.timeout(30)]


def _producer(buf, chunks, done: threading.Event, errors: list):
    def run():
        try:
            for chunk in chunks:
                buf.put_many(chunk)
        except TaskCancelled:
            errors.append("cancelled")
        finally:
            done.set()

    t = threading.Thread(target=run, name="test-producer")
    t.start()
    return t


async def _wait_event(event: threading.Event, timeout: float = 5.0) -> None:
    """Wait for a thread's event without blocking the loop (yields between checks)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not event.is_set():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


@pytest.mark.pure
def test_element_size():
    assert element_size(3) == 8
    assert element_size(np.float32(1)) == 8
    assert element_size(np.zeros(10, "f8")) == 80
    assert element_size((np.zeros(2, "i4"), np.zeros(3, "i4"))) == 20


@gen_test()
async def test_element_buffer_bounds_the_producer_by_count():
    buf = ElementBuffer(asyncio.get_running_loop(), max_bytes=1 << 30, max_elements=4)
    done, errors = threading.Event(), []
    t = _producer(buf, [[0, 1, 2, 3], [4, 5], [6]], done, errors)
    # the first chunk fills the buffer: the producer waits for room
    while len(buf) < 4:
        await buf.wait(1)
        if len(buf) < 4:
            await asyncio.sleep(0.005)
    assert not done.is_set()
    assert buf.take(2, 1 << 30) == [0, 1]  # room: the producer goes on
    got = [0, 1]
    while len(got) < 7:
        items = buf.take(100, 1 << 30)
        got += items
        if not items:
            await buf.wait(1)
    await _wait_event(done)
    t.join()
    assert got == list(range(7)) and not errors
    assert buf.produced == 7


@gen_test()
async def test_element_buffer_wakes_a_waiting_consumer():
    buf = ElementBuffer(asyncio.get_running_loop(), max_bytes=1 << 30, max_elements=100)
    assert buf.take(10, 100) == []  # nothing yet: the consumer now waits
    assert buf.consumer_waiting
    done, errors = threading.Event(), []
    t = _producer(buf, [["x"]], done, errors)
    await asyncio.wait_for(buf.wait(10), 5)  # woken by the producer, not by the timeout
    assert buf.take(10, 100) == ["x"]
    await _wait_event(done)
    t.join()


@gen_test()
async def test_element_buffer_take_respects_byte_budget_but_returns_one():
    buf = ElementBuffer(asyncio.get_running_loop(), max_bytes=1 << 30, max_elements=100)
    big = [np.zeros(100, "u1") for _ in range(5)]
    buf.put_many(big)
    assert len(buf.take(100, 250)) == 3  # stops once the budget is reached
    assert len(buf.take(100, 1)) == 1  # at least one element, whatever its size
    assert buf.nbytes == 100


@gen_test()
async def test_close_cancels_a_blocked_producer_and_releases_memory():
    buf = ElementBuffer(asyncio.get_running_loop(), max_bytes=1 << 30, max_elements=1)
    done, errors = threading.Event(), []
    t = _producer(buf, [[1], [2], [3]], done, errors)
    while len(buf) < 1:
        await asyncio.sleep(0.005)
    buf.close()
    await _wait_event(done)
    t.join()
    assert errors == ["cancelled"]
    assert len(buf) == 0 and buf.nbytes == 0


@gen_test()
async def test_end_becomes_visible_only_when_shown():
    buf = ElementBuffer(asyncio.get_running_loop(), max_bytes=100, max_elements=100)
    buf.finish()
    assert buf.produced_all and not buf.end_visible
    assert buf.take(1, 1) == []
    buf.show_end()
    await asyncio.wait_for(buf.wait(10), 5)
    assert buf.end_visible


@gen_test()
async def test_cross_trainer_window_gives_every_trainer_every_element():
    win = CrossTrainerWindow(asyncio.get_running_loop(), max_bytes=1 << 20, lookahead=8)
    win.put_many(list(range(8)))
    assert win.take(100, 1 << 20, "a") == list(range(8))
    assert win.take(3, 1 << 20, "b") == [0, 1, 2]
    assert win.take(100, 1 << 20, "b") == [3, 4, 5, 6, 7]
    # the same id shares a cursor: two consumers split the elements
    win.put_many([8, 9])
    assert win.take(1, 1 << 20, "a") == [8]
    assert win.take(1, 1 << 20, "a") == [9]


@gen_test()
async def test_cross_trainer_window_production_follows_the_fastest_trainer():
    win = CrossTrainerWindow(asyncio.get_running_loop(), max_bytes=1 << 20, lookahead=4)
    win.put_many([0, 1, 2, 3])
    assert not win._room()  # 4 ahead of every trainer: no demand
    win.take(2, 1 << 20, "fast")
    assert win._room()


@gen_test()
async def test_cross_trainer_window_evicts_and_a_slow_trainer_skips_ahead():
    win = CrossTrainerWindow(asyncio.get_running_loop(), max_bytes=8 * 4, lookahead=1000)
    assert win.take(1, 100, "slow") == []
    win.put_many(list(range(10)))  # 8 bytes each, none read yet: all stay (over the bound)
    assert win.take(100, 1 << 20, "fast") == list(range(10))
    win.put_many([10, 11])  # the fastest trainer read 0..9: the oldest go, 4 elements stay
    assert win.take(100, 1 << 20, "slow") == [8, 9, 10, 11]
    assert win.skipped == 8


def test_cross_trainer_window_of_one_chunk_produces_for_its_lead():
    """issue 22, item 4: a window smaller than two producer chunks (8 elements of 512 bytes
    in 4 KiB) asks for production whenever its fastest trainer has read it all, and never
    evicts what that trainer has not read (it used to stop producing for ever)."""
    cursors = TrainerCursors(256)
    assert cursors.has_demand(0, 0, 4096, 8)
    cursors.took("fast", 0, 8)  # read the 8 cached elements of 512 bytes
    assert cursors.has_demand(8, 8 * 512, 4096, 8)
    assert cursors.evictable() == 8
    assert not cursors.has_demand(16, 16 * 512, 4096, 8)  # 8 unread: wait for the lead


@gen_test()
async def test_round_buffer_serves_consecutive_elements_in_step():
    buf = ElementBuffer(asyncio.get_running_loop(), max_bytes=1 << 20, max_elements=1000)
    buf.put_many(list(range(20)))
    rounds = RoundBuffer(buf, num_consumers=2, timeout=5)
    assert [await rounds.get(0, 0), await rounds.get(0, 1)] == [0, 1]
    assert await rounds.get(1, 1) == 3
    assert await rounds.get(1, 0) == 2
    assert rounds.oldest == 2 and not rounds.rounds  # every round served is dropped
    with pytest.raises(DataServiceError, match="out of step"):
        await rounds.get(0, 0)


@gen_test()
async def test_round_buffer_times_out_naming_the_laggard():
    buf = ElementBuffer(asyncio.get_running_loop(), max_bytes=1 << 20, max_elements=1000)
    buf.put_many(list(range(100)))
    rounds = RoundBuffer(buf, num_consumers=2, timeout=0.2, max_ahead=3)
    for r in range(3):
        await rounds.get(r, 0)
    with pytest.raises(TimeoutError, match=r"consumers \[1\] have not read round 0"):
        await rounds.get(3, 0)


@gen_test()
async def test_round_buffer_refuses_a_finite_dataset():
    buf = ElementBuffer(asyncio.get_running_loop(), max_bytes=1 << 20, max_elements=1000)
    buf.put_many([1])
    buf.finish()
    buf.show_end()
    rounds = RoundBuffer(buf, num_consumers=2, timeout=1)
    with pytest.raises(DataServiceError, match="need an infinite dataset"):
        await rounds.get(0, 0)


@pytest.mark.pure
def test_finished_task_ids_are_bounded():
    recent = _Recent(_FINISHED_MEMORY)
    for i in range(3 * _FINISHED_MEMORY):
        recent.add(i)
    assert len(recent) == _FINISHED_MEMORY
    assert 3 * _FINISHED_MEMORY - 1 in recent and 0 not in recent
