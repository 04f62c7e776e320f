"""Component tier: the ordered channel and the runner's pipeline, with fake comms (no cluster)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import pytest
from distributed.utils_test import gen_test

from dask_dataservice._async import TaskGroup
from dask_dataservice.errors import ParameterServerUnavailableError
from dask_dataservice.ps import _routing
from dask_dataservice.ps._channel import Channel, Pipeline
from dask_dataservice.ps._types import Call

pytestmark = pytest.mark.component


class FakeComm:
    """Answers each message in order, unless ``gate`` holds it; records what it got."""

    def __init__(self, gate: asyncio.Event | None = None):
        self.received: list[dict] = []
        self._replies: asyncio.Queue = asyncio.Queue()
        self._closed = False
        self._aborted = asyncio.Event()
        self.gate = gate

    async def write(self, msg):
        if self._closed:
            raise OSError("closed")
        self.received.append(msg)
        await self._replies.put(msg)

    async def read(self):
        msg = await self._replies.get()
        if msg is None:
            raise OSError("aborted")
        if self.gate is not None:
            waits = [asyncio.ensure_future(e.wait()) for e in (self.gate, self._aborted)]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
            if self._aborted.is_set():
                raise OSError("aborted")
        if msg["op"] == "fail":
            # as a real comm delivers error_message(e): the exception deserialized
            return {"status": "error", "exception": ValueError("remote failure"),
                    "traceback": None}
        return {"status": "OK", "echo": msg["i"]}

    def closed(self):
        return self._closed

    def abort(self):
        self._closed = True
        self._aborted.set()
        self._replies.put_nowait(None)


async def _result(fut: concurrent.futures.Future, timeout=5):
    return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)


@gen_test()
async def test_channel_replies_in_order_and_reconnects_after_a_failure():
    comms: list[FakeComm] = []

    async def connect(address):
        comms.append(FakeComm())
        return comms[-1]

    group = TaskGroup("test")
    ch = Channel(asyncio.get_running_loop(), "tcp://ps:1", connect, group)
    futs = [ch.submit("op", {"i": i}) for i in range(50)]
    assert [(await _result(f))["echo"] for f in futs] == list(range(50))
    assert len(comms) == 1 and [m["i"] for m in comms[0].received] == list(range(50))
    comms[0].abort()  # the PS went away: the next message reconnects
    await asyncio.sleep(0)
    assert (await _result(ch.submit("op", {"i": 99})))["echo"] == 99
    assert len(comms) == 2 and ch.idle
    ch.close()
    await group.stop()


@gen_test()
async def test_a_broken_connection_fails_every_waiting_future():
    gate = asyncio.Event()
    comm = FakeComm(gate)

    async def connect(address):
        return comm

    group = TaskGroup("test")
    ch = Channel(asyncio.get_running_loop(), "tcp://ps:1", connect, group)
    futs = [ch.submit("op", {"i": i}) for i in range(3)]
    while len(comm.received) < 3:
        await asyncio.sleep(0)
    comm.abort()
    for f in futs:
        with pytest.raises(ParameterServerUnavailableError, match="unreachable"):
            await _result(f)
    assert ch.idle
    ch.close()
    await group.stop()


@gen_test()
async def test_connect_failures_fail_the_messages_not_the_channel():
    attempts = []

    async def connect(address):
        attempts.append(address)
        if len(attempts) == 1:
            raise OSError("connection refused")
        return FakeComm()

    group = TaskGroup("test")
    ch = Channel(asyncio.get_running_loop(), "tcp://ps:1", connect, group)
    with pytest.raises(ParameterServerUnavailableError, match="connection refused"):
        await _result(ch.submit("op", {"i": 1}))
    assert (await _result(ch.submit("op", {"i": 2})))["echo"] == 2
    ch.close()
    await group.stop()


@gen_test()
async def test_pipeline_times_out_a_hung_server_and_charges_updates_to_their_function():
    gate = asyncio.Event()  # never set: the PS hangs
    comm = FakeComm(gate)

    async def connect(address):
        return comm

    group = TaskGroup("test")
    loop = asyncio.get_running_loop()
    ch = Channel(loop, "tcp://ps:1", connect, group)
    pipeline = Pipeline(lambda address: ch, _routing.check, max_bytes=1 << 20,
                        max_messages=100, timeout=0.2)

    def runner():
        pipeline.current = 0
        pipeline.send([Call("tcp://ps:1", "op", {"i": 1})])
        pipeline.current = 1
        pipeline.send([Call("tcp://ps:1", "op", {"i": 2})])
        pipeline.drain()
        return dict(pipeline.errors)

    errors = await asyncio.to_thread(runner)
    # the first reply timed out, which resets the channel and fails the second as well
    assert set(errors) == {0, 1}
    assert isinstance(errors[0], ParameterServerUnavailableError)
    assert "did not answer op within 0.2 s" in str(errors[0])
    ch.close()
    await group.stop()


@gen_test()
async def test_pipeline_probes_a_server_that_does_not_reply():
    """No reply for a liveness timeout: the PS is probed. One that answers the probe is
    waited for; a silent one fails the wait at once, long before the request timeout."""
    loop = asyncio.get_running_loop()
    gate = asyncio.Event()  # the server replies once the gate opens
    comm = FakeComm(gate)

    async def connect(address):
        return comm

    group = TaskGroup("test")
    ch = Channel(loop, "tcp://ps:1", connect, group)
    probes: list[str] = []
    alive = True

    def probe(address, limit):
        probes.append(address)
        if alive and len(probes) == 3:  # slow, but alive: it replies after three probes
            loop.call_soon_threadsafe(gate.set)
        return alive

    pipeline = Pipeline(lambda address: ch, _routing.check, 1 << 20, 100, timeout=60,
                        probe=probe, liveness=0.05)
    reply = await asyncio.to_thread(pipeline.call_many, [Call("tcp://ps:1", "op", {"i": 1})])
    # the reply was waited for; a loaded machine may probe again (every 50 ms) before the
    # reply the third probe let out arrives (ci99: 5 probes)
    assert reply == [{"status": "OK", "echo": 1}] and len(probes) >= 3

    gate.clear()
    probes.clear()
    alive = False
    started = time.monotonic()
    with pytest.raises(ParameterServerUnavailableError, match="did not answer a liveness probe "
                       r"within 0.05 s during op \(dataservice.ps.liveness-timeout\)"):
        await asyncio.to_thread(pipeline.call_many, [Call("tcp://ps:1", "op", {"i": 2})])
    assert time.monotonic() - started < 5 and probes == ["tcp://ps:1"]
    ch.close()
    await group.stop()


@gen_test()
async def test_pipeline_reads_raise_the_remote_error():
    async def connect(address):
        return FakeComm()

    group = TaskGroup("test")
    ch = Channel(asyncio.get_running_loop(), "tcp://ps:1", connect, group)
    pipeline = Pipeline(lambda address: ch, _routing.check, 1 << 20, 100, timeout=5)
    calls = [Call("tcp://ps:1", "op", {"i": 1}), Call("tcp://ps:1", "fail", {"i": 2})]
    with pytest.raises(ValueError, match="remote failure"):
        await asyncio.to_thread(pipeline.call_many, calls)
    ch.close()
    await group.stop()


@pytest.mark.pure
def test_runner_poisoned_records_are_dropped_and_bounded():
    from dask_dataservice.ps import _runner_plugin
    from dask_dataservice.ps._runner_plugin import TrainingWorkerPlugin

    runner = TrainingWorkerPlugin()
    runner.poisoned = _runner_plugin.OrderedDict()
    runner._poison(coordinator=1, generation=0)
    assert runner._poisoned(1, 0)  # the rest of generation 0 is skipped
    assert not runner._poisoned(1, 1) and runner.poisoned == {}  # a newer one: forgotten
    for uid in range(_runner_plugin._MAX_POISONED + 10):
        runner._poison(coordinator=uid, generation=3)
    assert len(runner.poisoned) == _runner_plugin._MAX_POISONED
    assert 0 not in runner.poisoned and _runner_plugin._MAX_POISONED + 9 in runner.poisoned


@gen_test()
async def test_reads_are_bounded_by_the_request_timeout_but_bulk_requests_are_not():
    loop = asyncio.get_running_loop()

    class SlowServer:
        """``ps_read`` never answers; ``ps_save`` answers after 4x the timeout."""

        def __init__(self, address):
            pass

        def __getattr__(self, op):
            async def call(**kwargs):
                done = asyncio.Event()
                if op == "ps_save":
                    loop.call_later(0.2, done.set)
                await done.wait()
                return {"status": "OK"}

            return call

    save = Call("tcp://ps:1", "ps_save", {})
    assert await _routing.call_async(SlowServer, save, 0.05) == {"status": "OK"}
    with pytest.raises(ParameterServerUnavailableError, match="did not answer within 0.05 s"):
        await _routing.call_async(SlowServer, Call("tcp://ps:1", "ps_read", {}), 0.05)
