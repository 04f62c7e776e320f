"""The PS data path (ps/_fastpath.py): codec, stream parsing, server, and a real cluster."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random

import dask
import numpy as np
import pytest
from distributed.protocol.serialize import to_serialize
from distributed.utils_test import gen_test

import dask_dataservice as dds
from dask_dataservice import _wire
from dask_dataservice._rpc import handler, raise_for_status
from dask_dataservice.errors import ParameterServerUnavailableError
from dask_dataservice.ps import _fastpath
from dask_dataservice.ps import optimizers as opt
from dask_dataservice.ps._runner_plugin import RUNNER_NAME
from dask_dataservice.ps.server import PLUGIN_NAME
from dask_dataservice.testing import gen_cluster
from dask_dataservice.testing._ps import warm_up_zarr

pytestmark = [pytest.mark.pure, pytest.mark.timeout(60)]
warm_up_zarr()

from _helpers import PS, WK, in_thread  # noqa: E402


def _arrays():
    rng = np.random.default_rng(0)
    return {
        "f4": rng.random((300, 64)).astype("f4"),           # > 64 KiB: received in place
        "i8": np.arange(7, dtype="i8"),
        "scalar": np.array(2.5),
        "empty": np.zeros((0, 3), "f8"),
        "strided": np.arange(20, dtype="i4").reshape(4, 5)[:, ::2],
        "bool": np.array([True, False]),
    }


def _roundtrip(msg):
    buffers = _fastpath.encode(msg)
    got = []
    protocol = _wire.StreamProtocol(got.append, lambda exc: None)
    data = b"".join(bytes(b) for b in buffers)
    protocol_feed(protocol, data, [len(data)])
    assert len(got) == 1
    return got[0]


def protocol_feed(protocol, data: bytes, chunks: list[int]) -> None:
    """Feed ``data`` to ``protocol`` as a transport would, ``chunks`` bytes at a time (at
    most what each get_buffer offers)."""
    pos = 0
    for n in chunks:
        while n and pos < len(data):
            buf = protocol.get_buffer(-1)
            k = min(n, len(buf), len(data) - pos)
            buf[:k] = data[pos:pos + k]
            protocol.buffer_updated(k)
            pos += k
            n -= k
    assert pos == len(data)


def test_codec_round_trips_arrays_writable_and_owned():
    arrays = _arrays()
    msg = {"op": "x", "values": [to_serialize(arrays["f4"]), arrays["i8"]],
           "nested": {"a": arrays["scalar"], "b": arrays["empty"], "c": arrays["strided"],
                      "d": arrays["bool"]},
           "blob": to_serialize(b"\x00pickled"), "n": np.int64(3), "t": (1, 2), "s": "ok"}
    got = _roundtrip(msg)
    want = [arrays["f4"], arrays["i8"]]
    for g, w in zip(got["values"], want, strict=True):
        np.testing.assert_array_equal(g, w)
        assert g.dtype == w.dtype and g.flags.writeable
    for k in "abcd":
        w = msg["nested"][k]
        np.testing.assert_array_equal(got["nested"][k], w)
        assert got["nested"][k].shape == w.shape and got["nested"][k].dtype == w.dtype
    assert got["blob"] == b"\x00pickled" and got["n"] == 3 and got["t"] == [1, 2]
    assert got["s"] == "ok"


def test_codec_pickles_what_msgpack_cannot_carry():
    objects = np.array([{"a": 1}, "text", None], dtype=object)
    got = _roundtrip({"v": objects, "s": {1, 2}, "frac": __import__("fractions").Fraction(1, 3)})
    assert got["v"].dtype == object and got["v"].tolist() == objects.tolist()
    assert got["s"] == {1, 2} and str(got["frac"]) == "1/3"


@pytest.mark.parametrize("seed", range(6))
def test_messages_split_anywhere_are_parsed_in_order(seed):
    rnd = random.Random(seed)
    rng = np.random.default_rng(seed)
    msgs = [{"i": i, "v": rng.random((rnd.choice([0, 1, 100, 300, 2000]), 16)).astype("f4"),
             "ids": np.arange(rnd.randint(0, 50)), "pad": "x" * rnd.randint(0, 300_000)}
            for i in range(12)]
    data = b"".join(bytes(b) for m in msgs for b in _fastpath.encode(m))
    chunks = []
    while sum(chunks) < len(data):
        chunks.append(rnd.choice([1, 7, 100, 4096, 70_000, 1 << 20]))
    got = []
    protocol = _wire.StreamProtocol(got.append, lambda exc: None)
    protocol_feed(protocol, data, chunks)
    assert [g["i"] for g in got] == list(range(12))
    for g, m in zip(got, msgs, strict=True):
        np.testing.assert_array_equal(g["v"], m["v"])
        np.testing.assert_array_equal(g["ids"], m["ids"])
        assert g["pad"] == m["pad"]


@pytest.mark.component
@gen_test()
async def test_server_answers_in_order_errors_and_unknown_ops_and_stops():
    log = []

    @handler
    async def op(n, value=None):
        if n < 0:
            raise ValueError(f"bad n {n}")
        if n == 1:
            await asyncio.sleep(0.01)  # a slow request is still answered before the next
        log.append(n)
        return {"status": "OK", "n": n, "value": None if value is None else to_serialize(value * 2)}

    server = _fastpath.FastServer(lambda name: op if name == "ps_op" else None)
    await server.start("127.0.0.1")
    ch = _fastpath.SocketChannel("tcp://ps:1", lambda a: ("127.0.0.1", server.port), 5, 5)

    def runner():
        replies = [ch.submit("ps_op", {"n": n, "value": np.ones(3)}) for n in (1, 2, 3)]
        got = [r.result(5) for r in replies]
        bad = ch.submit("ps_op", {"n": -1}).result(5)
        unknown = ch.submit("ps_nope", {}).result(5)
        return got, bad, unknown

    got, bad, unknown = await asyncio.to_thread(runner)
    assert [r["n"] for r in got] == [1, 2, 3] and log == [1, 2, 3]
    np.testing.assert_array_equal(got[0]["value"], np.full(3, 2.0))
    with pytest.raises(ValueError, match="bad n -1"):
        raise_for_status(bad)
    assert unknown is None  # as a Dask server answers an unknown op
    await server.stop()

    def after_stop():
        with pytest.raises(ParameterServerUnavailableError, match="unreachable"):
            ch.submit("ps_op", {"n": 4}).result(5)
        ch.close()

    await asyncio.to_thread(after_stop)


# -- the runner thread's socket ----------------------------------------------------------


@pytest.mark.component
@gen_test()
async def test_socket_channel_orders_replies_times_out_and_reconnects():
    release = asyncio.Event()
    loop = asyncio.get_running_loop()

    @handler
    async def op(n, value=None):
        if n == 99:
            await release.wait()  # a hung request
        return {"status": "OK", "n": n, "value": None if value is None else to_serialize(value)}

    server = _fastpath.FastServer(lambda name: op if name == "ps_op" else None)
    await server.start("127.0.0.1")
    located = []

    def locate(address):
        located.append(address)
        return "127.0.0.1", server.port

    def runner():
        ch = _fastpath.SocketChannel("tcp://ps:1", locate, 5, 5)
        big = np.arange(300_000, dtype="f4")  # > socket buffers: sends read replies meanwhile
        replies = [ch.submit("ps_op", {"n": i, "value": big if i % 2 else None})
                   for i in range(8)]
        assert replies[7].result(5)["n"] == 7  # the earlier ones were read on the way
        assert all(r.done() for r in replies) and ch.idle
        np.testing.assert_array_equal(replies[5].result()["value"], big)
        assert [r.result()["n"] for r in replies] == list(range(8))

        hung = ch.submit("ps_op", {"n": 99})
        after = ch.submit("ps_op", {"n": 100})
        with pytest.raises(concurrent.futures.TimeoutError):
            hung.result(0.2)
        ch.reset(TimeoutError("no reply"))  # what the pipeline does after its timeout
        for r in (hung, after):
            with pytest.raises(ParameterServerUnavailableError, match="unreachable: TimeoutError"):
                r.result(1)
        loop.call_soon_threadsafe(release.set)
        assert ch.submit("ps_op", {"n": 5}).result(5)["n"] == 5  # a new connection
        assert len(located) == 2
        ch.close()
        with pytest.raises(ParameterServerUnavailableError, match="the channel is closed"):
            ch.submit("ps_op", {"n": 6}).result(1)

    await asyncio.to_thread(runner)

    def lost():
        ch = _fastpath.SocketChannel("tcp://ps:1", locate, 5, 5)
        assert ch.submit("ps_op", {"n": 1}).result(5)["n"] == 1
        connected.set_result(None)
        stopped.result(10)
        with pytest.raises(ParameterServerUnavailableError, match="unreachable"):
            ch.submit("ps_op", {"n": 2}).result(5)
        ch.close()

    connected, stopped = concurrent.futures.Future(), concurrent.futures.Future()
    thread = asyncio.ensure_future(asyncio.to_thread(lost))
    await asyncio.wait_for(asyncio.wrap_future(connected), 10)
    await server.stop()  # the PS goes away under an open connection
    stopped.set_result(None)
    await thread


def test_a_send_to_a_frozen_server_fails_after_a_silent_probe():
    import socket
    import time

    with socket.socket() as frozen:  # accepts connections (the backlog) and never reads
        frozen.bind(("127.0.0.1", 0))
        frozen.listen()
        probes = []

        def probe(address, limit):
            probes.append((address, limit))
            return len(probes) < 2  # it answers once, then falls silent

        ch = _fastpath.SocketChannel("tcp://ps:1", lambda a: frozen.getsockname(), 5, 60,
                                     probe=probe, liveness=0.2)
        started = time.monotonic()
        reply = ch.submit("ps_op", {"value": np.zeros(16 << 20, "f4")})  # 64 MiB: no room
        with pytest.raises(ParameterServerUnavailableError,
                           match=r"did not answer a liveness probe within 0.2 s during ps_op"):
            reply.result(1)
        assert time.monotonic() - started < 10 and probes == [("tcp://ps:1", 0.2)] * 2
        ch.close()


# -- a real cluster ----------------------------------------------------------------------


@pytest.mark.cluster
@gen_cluster(client=False, nthreads=[PS, WK], timeout=60)
async def test_an_unreachable_data_port_falls_back_to_distributed_comms(s, p0, w0):
    import socket

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]

    def body(c):
        strategy = dds.ParameterServerStrategy(c)
        p0.handlers["ps_fast_port"] = lambda: {"status": "OK", "port": closed_port,
                                               "host": "127.0.0.1"}
        coord = dds.ClusterCoordinator(strategy)
        with strategy.scope():
            v = dds.Variable(np.zeros((4, 2), "f4"), name="v")
        rvs = [coord.schedule(lambda i: v.scatter_add([i % 4], np.ones((1, 2), "f4"))
                              .gather([i % 4]).sum(), args=(i,)) for i in range(8)]
        coord.join()
        coord.shutdown()
        return v.numpy(), [float(rv.fetch()) for rv in rvs]

    value, sums = await in_thread(s, body)
    np.testing.assert_array_equal(value, np.full((4, 2), 2.0, "f4"))
    # each step reads its own write (never 0): per row one step sees 2, the other 4, in
    # whichever order the coordinator ran them (not always schedule order: one CI run)
    assert sorted(sums) == [2.0] * 4 + [4.0] * 4
    kinds = {type(ch).__name__ for ch in w0.extensions[RUNNER_NAME].channels.values()}
    assert kinds == {"Channel"}, kinds



def _step(emb, sgd, seed):
    ids = np.random.default_rng(seed).integers(0, 500, 200)
    rows = emb.gather(ids)
    sgd.apply_gradients([(opt.IndexedSlices(rows * 0.5 + 1.0, ids), emb)])
    return rows.sum()


@pytest.mark.cluster
@pytest.mark.parametrize("fast", [True, False])
@gen_cluster(client=False, nthreads=[PS, PS, WK], timeout=60,
             config={"dataservice.ps.batches-in-flight": 1})
async def test_training_on_the_data_path_matches_distributed_comms(s, p0, p1, w0, fast):
    """Ten steps on one worker, compared with numpy step after step. One batch in flight:
    only then do the steps run in schedule order (two batches travel on two connections and
    either may start first; a CI run saw step 0's gather read a later step's update)."""
    def body(c):
        strategy = dds.ParameterServerStrategy(
            c, variable_partitioner=dds.partitioners.FixedShardsPartitioner(3))
        coord = dds.ClusterCoordinator(strategy)
        with strategy.scope():
            emb = dds.Variable(np.arange(500 * 4, dtype="f4").reshape(500, 4), name="emb")
        sgd = opt.SGD(0.1)
        rvs = [coord.schedule(_step, args=(emb, sgd, i)) for i in range(10)]
        coord.join()
        coord.shutdown()
        return emb.numpy(), [rv.fetch() for rv in rvs]

    with dask.config.set({"dataservice.ps.fast-path": fast}):  # read as the strategy
        table, sums = await in_thread(s, body)                   # installs the plugins
    kinds = {type(ch).__name__ for ch in w0.extensions[RUNNER_NAME].channels.values()}
    assert kinds == ({"SocketChannel"} if fast else {"Channel"}), kinds
    assert [bool(p.extensions[PLUGIN_NAME]._fast) for p in (p0, p1)] == [fast, fast]

    # numpy, step after step, is the reference
    ref = np.arange(500 * 4, dtype="f4").reshape(500, 4)
    from dask_dataservice.ps import _kernels

    want = []
    for i in range(10):
        ids = np.random.default_rng(i).integers(0, 500, 200)
        rows = ref[ids]
        want.append(rows.sum())
        _kernels.apply_sparse({"kind": "sgd", "learning_rate": 0.1}, ref, {}, ids,
                              rows * 0.5 + 1.0)
    assert sums == want
    np.testing.assert_array_equal(table, ref)


@pytest.mark.component
@pytest.mark.parametrize("prefix, why", [
    (_wire.PREFIX.pack(2**31, 1), "2147483648-byte header"),
    (_wire.PREFIX.pack(10, 2**20), "1048576 frames"),
    (_wire.PREFIX.pack(10, 2) + np.array([2**40, 1], "<u8").tobytes(),
     "1099511627777 bytes of frames"),
])
@gen_test()
async def test_a_stranger_announcing_a_huge_message_is_disconnected(prefix, why, caplog):
    # the PS's data port is reachable by anyone who can reach the PS: a bogus prefix must not
    # make it allocate what it announces; the connection is closed, the server goes on
    @handler
    async def op(n):
        return {"status": "OK", "n": n}

    server = _fastpath.FastServer(lambda name: op if name == "ps_op" else None)
    await server.start("127.0.0.1")
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(prefix + b"x" * 64)
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the server
        writer.close()
        assert why in caplog.text and "closing the connection" in caplog.text
        ch = _fastpath.SocketChannel("tcp://ps:1", lambda a: ("127.0.0.1", server.port), 5, 5)
        try:  # a well-formed client is still served
            reply = await asyncio.to_thread(lambda: ch.submit("ps_op", {"n": 7}).result(5))
            assert reply["n"] == 7
        finally:
            await asyncio.to_thread(ch.close)
    finally:
        await server.stop()
