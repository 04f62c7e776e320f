"""The package's shared foundation on its own: handler/reply conventions, addresses, owned tasks,
the thread-to-loop waker, the plain-message errors (no cluster)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from distributed.core import AsyncTaskGroupClosedError, error_message
from distributed.protocol import dumps, loads

from dask_dataservice._async import LoopWaker, TaskGroup, owned_executor, shutdown_executor
from dask_dataservice._rpc import (
    handler,
    normalize_address,
    raise_for_status,
    strip_protocol,
)
from dask_dataservice.errors import (
    DispatcherUnavailableError,
    JobNotFoundError,
    PlainMessage,
    ServerClosingError,
    VariableNotFoundError,
)
from dask_dataservice.service.protocol._messages import raise_for_status as service_raise_for_status

pytestmark = pytest.mark.pure


class Boom(KeyError):
    pass


def wire(reply):
    """A reply as the caller gets it: through distributed's serialization, as over a comm."""
    return loads(dumps(reply))


def test_handler_turns_errors_into_values_and_keeps_the_handlers_kind():
    @handler
    def sync_ok(x):
        return {"status": "OK", "x": x}

    @handler
    def sync_bad():
        raise Boom("no such thing")

    @handler
    async def async_bad():
        raise ValueError("bad value")

    assert sync_ok(3) == {"status": "OK", "x": 3}
    reply = wire(sync_bad())
    assert reply["status"] == "error"
    with pytest.raises(Boom, match="no such thing") as info:
        raise_for_status(reply, "lookup")
    assert info.traceback  # the remote traceback travels along
    assert asyncio.iscoroutinefunction(async_bad) and not asyncio.iscoroutinefunction(sync_bad)
    with pytest.raises(ValueError, match="bad value"):
        raise_for_status(wire(asyncio.run(async_bad())))


def test_handler_lets_cancellation_through():
    @handler
    async def cancelled():
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(cancelled())


def test_raise_for_status_missing_and_closing():
    with pytest.raises(RuntimeError, match="no answer to the split request: the server does not know"):
        raise_for_status(None, "split request")
    with pytest.raises(ConnectionError, match="shutting down"):
        raise_for_status({"status": "closing"})
    with pytest.raises(ServerClosingError, match="shutting down"):
        raise_for_status({"status": "closing"}, closing_error=ServerClosingError)
    # the data service's flavour names what to install and its own closing error
    with pytest.raises(RuntimeError, match="dds.install"):
        service_raise_for_status(None, "registration")
    with pytest.raises(DispatcherUnavailableError):
        service_raise_for_status({"status": "closing"})
    assert issubclass(DispatcherUnavailableError, ConnectionError)
    with pytest.raises(JobNotFoundError):
        service_raise_for_status(wire(error_message(JobNotFoundError("job 5 not found"))))


def test_addresses():
    assert normalize_address("localhost:8786") == "tcp://localhost:8786"
    assert normalize_address(" tls://h:1 ") == "tls://h:1"
    assert strip_protocol("tcp://127.0.0.1:5") == "127.0.0.1:5"
    for bad in ("", "tcp://", "tcp://127.0.0.1", ":80", None):
        with pytest.raises(ValueError, match="address"):
            normalize_address(bad)


def test_plain_messages():
    assert str(JobNotFoundError("Job 5 not found")) == "Job 5 not found"  # not "'Job 5 ...'"
    assert str(VariableNotFoundError("v")) == "v"
    assert isinstance(JobNotFoundError("x"), KeyError) and isinstance(JobNotFoundError("x"), PlainMessage)


@pytest.mark.component
def test_task_group_owns_and_stops_its_tasks():
    async def main():
        group = TaskGroup("t")
        started = asyncio.Event()
        finished = []

        async def forever():
            started.set()
            try:
                await asyncio.Event().wait()
            finally:
                finished.append("cancelled")

        async def fails():
            raise RuntimeError("background failure")

        task = group.spawn(forever)
        group.spawn(fails)
        await started.wait()
        assert task in group.tasks
        await asyncio.sleep(0)  # let `fails` end: its exception is retrieved, not left dangling
        await group.stop()
        assert finished == ["cancelled"] and task.cancelled() and len(group) == 0
        with pytest.raises(AsyncTaskGroupClosedError):
            group.spawn(forever)

    asyncio.run(main())


@pytest.mark.component
def test_loop_waker_folds_a_burst_into_one_callback():
    async def main():
        loop = asyncio.get_running_loop()
        calls = []
        woken = asyncio.Event()
        waker = LoopWaker(loop, lambda: (calls.append(1), woken.set()))
        threads = [threading.Thread(target=lambda: [waker.wake() for _ in range(100)]) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        await woken.wait()
        n = len(calls)
        assert 1 <= n <= 4  # 400 wakes from 4 threads, at most one callback per burst
        waker.wake()
        await asyncio.sleep(0.01)
        assert len(calls) == n + 1

    asyncio.run(main())


def test_waking_a_closed_loop_is_dropped():
    loop = asyncio.new_event_loop()
    waker = LoopWaker(loop, lambda: None)
    loop.close()
    waker.wake()  # no error: the owner is shutting down
    waker.wake()


@pytest.mark.component
def test_owned_executor_threads_are_named_and_joined():
    ex = owned_executor("dds-test", 2)
    assert ex.submit(lambda: threading.current_thread().name).result().startswith("dds-test")
    shutdown_executor(ex)
    assert not any(t.name.startswith("dds-test") for t in threading.enumerate())
    shutdown_executor(None)


# ---------------------------------------------------------------------------------------
# _wire.BufferPool: receive buffers reused once released (issue 25, target 1)
# ---------------------------------------------------------------------------------------


def test_a_receive_buffer_comes_back_once_nothing_made_of_it_is_alive():
    import pickle

    import numpy as np

    from dask_dataservice._wire import BufferPool

    pool = BufferPool(max_free=8 << 20)
    frame = pool.get(1 << 20)
    element = frame.view(np.float32)[:10]  # what a reader makes of a frame: views
    del frame
    assert pool.free_bytes == 0  # `element` holds the buffer
    second = pool.get(1 << 20)
    assert not np.shares_memory(second, element)
    assert (pool.made, pool.reused) == (2, 0)
    del element
    assert pool.free_bytes == 1 << 20
    third = pool.get(1000 << 10)  # the same size class (1 MiB)
    assert third.nbytes == 1000 << 10 and third.flags.writeable
    assert (pool.made, pool.reused, pool.free_bytes) == (2, 1, 0)
    # an unpickled element (pickle 5, its buffer out of band) holds its frame as well
    src = np.arange(100_000, dtype=np.float32)
    buffers = []
    data = pickle.dumps([src], protocol=5, buffer_callback=buffers.append)
    third[:src.nbytes] = np.frombuffer(buffers[0].raw(), np.uint8)
    [got] = pickle.loads(data, buffers=[third[:src.nbytes]])
    del third
    assert pool.free_bytes == 0 and np.array_equal(got, src)
    del got
    assert pool.free_bytes == 1 << 20
    del second


def test_a_buffer_pool_keeps_at_most_its_bound_waiting():
    from dask_dataservice._wire import BufferPool

    pool = BufferPool(max_free=3 << 20)
    held = [pool.get(1 << 20) for _ in range(5)]  # all in use at once
    assert pool.made == 5 and pool.free_bytes == 0
    del held
    assert pool.free_bytes == 3 << 20  # two were freed
    again = [pool.get(1 << 20) for _ in range(4)]
    assert (pool.reused, pool.made) == (3, 6)
    del again
    pool.clear()
    assert pool.free_bytes == 0


def test_a_buffer_pools_size_classes_waste_at_most_an_eighth():
    from dask_dataservice._wire import BufferPool

    assert BufferPool.size_class(1 << 20) == 1 << 20
    assert BufferPool.size_class(4 << 20) == 4 << 20
    for n in (65_536, 65_537, 100_000, 1_100_000, (4 << 20) - 1, 3_000_000, 33_554_433):
        size = BufferPool.size_class(n)
        assert n <= size <= n * 1.125 + 4096, (n, size)
