"""Requests coalesced per parameter server (issue 16, target 1).

A runner holds a scheduled function's updates until the next request to their PS and sends
them in its message (``ps_batch``); the requests of a sharded variable's shards on one PS
travel as one (``ps_gather_parts``, ``ps_apply_parts``). Component tier with fake comms,
then a real cluster: the values must be bit for bit those of the old path and of numpy.
"""

from __future__ import annotations

import asyncio

import dask
import numpy as np
import pytest
from distributed.utils_test import gen_test

import dask_dataservice as dds
from dask_dataservice._async import TaskGroup
from dask_dataservice.errors import ParameterServerUnavailableError, ShapeMismatchError
from dask_dataservice.ps import _kernels, _routing
from dask_dataservice.ps import optimizers as opt
from dask_dataservice.ps._channel import BATCH_OP, Channel, Pipeline
from dask_dataservice.ps._types import Call
from dask_dataservice.ps._types import wire as _wire
from dask_dataservice.ps.server import PLUGIN_NAME
from dask_dataservice.testing import gen_cluster
from dask_dataservice.testing._ps import warm_up_zarr

pytestmark = [pytest.mark.component, pytest.mark.timeout(60)]
warm_up_zarr()

from _helpers import PS, WK, in_thread  # noqa: E402


class BatchComm:
    """Answers each message in order, ``ps_batch`` ones with a reply per request; ``fail``
    requests get an error; ``broken=True`` drops the connection at the next message."""

    def __init__(self) -> None:
        self.received: list[dict] = []
        self._replies: asyncio.Queue = asyncio.Queue()
        self._closed = False
        self.broken = False

    @staticmethod
    def _answer(msg):
        if msg["op"] == "fail":
            return {"status": "error", "exception": ValueError(f"update {msg['i']} failed"),
                    "traceback": None}
        return {"status": "OK", "echo": msg["i"]}

    async def write(self, msg):
        if self._closed:
            raise OSError("closed")
        self.received.append(msg)
        if self.broken:
            self.abort()
            return
        if msg["op"] == BATCH_OP:
            await self._replies.put({"status": "OK",
                                     "replies": [self._answer(m) for m in msg["ops"]]})
        else:
            await self._replies.put(self._answer(msg))

    async def read(self):
        reply = await self._replies.get()
        if reply is None:
            raise OSError("aborted")
        return reply

    def closed(self):
        return self._closed

    def abort(self):
        self._closed = True
        self._replies.put_nowait(None)


async def _pipeline(hold: int = 1 << 20, max_messages: int = 100):
    comms: dict[str, BatchComm] = {}

    async def connect(address):
        comms[address] = BatchComm()
        return comms[address]

    group = TaskGroup("test")
    loop = asyncio.get_running_loop()
    channels: dict[str, Channel] = {}

    def channel(address):
        if address not in channels:
            channels[address] = Channel(loop, address, connect, group)
        return channels[address]

    pipeline = Pipeline(channel, _routing.check, 1 << 30, max_messages, timeout=5, hold=hold)
    return pipeline, comms, channels, group


async def _close(channels, group):
    for ch in channels.values():
        ch.close()
    await group.stop()


def _ops(msg):
    return [(m["op"], m["i"]) for m in msg["ops"]] if msg["op"] == BATCH_OP \
        else [(msg["op"], msg["i"])]


@gen_test()
async def test_held_updates_travel_with_the_next_read_to_their_server():
    pipeline, comms, channels, group = await _pipeline()

    def runner():
        pipeline.current = 0
        pipeline.send([Call("ps:1", "upd", {"i": 1}), Call("ps:2", "upd", {"i": 2})], 8)
        pipeline.current = 1
        pipeline.send([Call("ps:1", "upd", {"i": 3})], 8)
        assert comms == {}  # nothing sent yet: held for the next request
        # two reads of one server and its held updates: one message, in order
        replies = pipeline.call_many([Call("ps:1", "get", {"i": 4}),
                                      Call("ps:1", "get", {"i": 5})])
        assert [r["echo"] for r in replies] == [4, 5]
        assert "ps:2" not in comms  # its update waits for the drain
        pipeline.drain()
        return dict(pipeline.errors)

    assert await asyncio.to_thread(runner) == {}
    assert [_ops(m) for m in comms["ps:1"].received] == [
        [("upd", 1), ("upd", 3), ("get", 4), ("get", 5)]]
    assert [_ops(m) for m in comms["ps:2"].received] == [[("upd", 2)]]  # alone: a plain op
    assert all(ch.idle for ch in channels.values())
    await _close(channels, group)


@gen_test()
async def test_a_failed_held_update_is_charged_to_its_function_not_to_the_read():
    pipeline, comms, channels, group = await _pipeline()

    def runner():
        pipeline.current = 0
        pipeline.send([Call("ps:1", "upd", {"i": 1})], 8)
        pipeline.current = 1
        pipeline.send([Call("ps:1", "fail", {"i": 2})], 8)
        pipeline.current = 2
        reply = pipeline.call_many([Call("ps:1", "get", {"i": 3})])
        pipeline.drain()
        return reply, dict(pipeline.errors)

    reply, errors = await asyncio.to_thread(runner)
    assert reply == [{"status": "OK", "echo": 3}]
    assert list(errors) == [1] and str(errors[1]) == "update 2 failed"
    await _close(channels, group)


@gen_test()
async def test_a_lost_message_fails_the_read_and_its_held_updates():
    pipeline, comms, channels, group = await _pipeline()

    def runner():
        pipeline.current = 0
        pipeline.send([Call("ps:1", "upd", {"i": 1})], 8)
        pipeline.call_many([Call("ps:1", "get", {"i": 2})])  # connects
        comms["ps:1"].broken = True
        pipeline.current = 1
        pipeline.send([Call("ps:1", "upd", {"i": 3})], 8)
        pipeline.current = 2
        with pytest.raises(ParameterServerUnavailableError, match="unreachable"):
            pipeline.call_many([Call("ps:1", "get", {"i": 4})])
        pipeline.drain()
        return dict(pipeline.errors)

    errors = await asyncio.to_thread(runner)
    assert list(errors) == [1] and isinstance(errors[1], ParameterServerUnavailableError)
    await _close(channels, group)


@gen_test()
async def test_held_updates_are_sent_past_the_byte_or_message_bound():
    pipeline, comms, channels, group = await _pipeline(hold=100, max_messages=3)

    def runner():
        pipeline.send([Call("ps:1", "upd", {"i": 1})], 60)
        assert comms == {}
        pipeline.send([Call("ps:1", "upd", {"i": 2})], 60)  # 120 bytes > 100: sent
        for i in range(3, 7):  # 4 messages > 3: sent
            pipeline.send([Call("ps:1", "upd", {"i": i})], 0)
        assert not pipeline._held  # nothing left for the drain to send
        pipeline.drain()

    await asyncio.to_thread(runner)
    assert [_ops(m) for m in comms["ps:1"].received] == [
        [("upd", 1), ("upd", 2)], [("upd", 3), ("upd", 4), ("upd", 5), ("upd", 6)]]
    await _close(channels, group)


@gen_test()
async def test_without_holding_each_request_travels_alone():
    pipeline, comms, channels, group = await _pipeline(hold=0)

    def runner():
        pipeline.send([Call("ps:1", "upd", {"i": 1})], 8)
        pipeline.call_many([Call("ps:1", "get", {"i": 2}), Call("ps:1", "get", {"i": 3})])
        pipeline.drain()

    await asyncio.to_thread(runner)
    assert [_ops(m) for m in comms["ps:1"].received] == [[("upd", 1)], [("get", 2)], [("get", 3)]]
    await _close(channels, group)


# -- a real cluster ----------------------------------------------------------------------

ROWS, DIM, STEPS = 1000, 8, 12


def _ids(step):
    return np.random.default_rng(step).integers(0, ROWS, 300)  # with repeats


def _train_step(emb, sgd, step):
    ids = _ids(step)
    rows = emb.gather(ids)
    sgd.apply_gradients([(opt.IndexedSlices(rows * 0.5 + 1.0, ids), emb)])
    emb.scatter_add(ids[:7], np.ones((7, DIM), "f4"))
    return rows


def _reference():
    table = np.arange(ROWS * DIM, dtype="f4").reshape(ROWS, DIM) / 100
    seen = []
    for step in range(STEPS):
        ids = _ids(step)
        rows = table[ids]
        seen.append(rows)
        _kernels.apply_sparse({"kind": "sgd", "learning_rate": 0.1}, table, {}, ids,
                              rows * 0.5 + 1.0)
        np.add.at(table, ids[:7], np.ones((7, DIM), "f4"))
    return table, seen


@pytest.mark.cluster
@pytest.mark.parametrize("coalesce", ["8 MiB", 0])
@gen_cluster(client=False, nthreads=[PS, PS, WK], timeout=60,
             config={"dataservice.ps.batches-in-flight": 1})
async def test_sharded_training_on_one_request_per_server(s, p0, p1, w0, coalesce):
    """4 shards on 2 PSs, one worker running the steps in order: every gather reads the
    updates of the steps before it, and both paths give numpy's values bit for bit.

    One batch in flight: the steps run in schedule order only then. With two, the worker's
    two batches are pickled on two threads and sent on two connections, and either may start
    first (scheduled functions have no promised order, as in TensorFlow): a fresh-clone CI
    run saw step 0 read rows that a later batch had already updated (58.02 where 68.0 was
    due), and delaying the pickling of step 0's batch reproduces it every time."""
    def body(c):
        strategy = dds.ParameterServerStrategy(
            c, variable_partitioner=dds.partitioners.FixedShardsPartitioner(4))
        coord = dds.ClusterCoordinator(strategy)
        with strategy.scope():
            emb = dds.Variable(np.arange(ROWS * DIM, dtype="f4").reshape(ROWS, DIM) / 100,
                               name="emb")
        sgd = opt.SGD(0.1)
        with dask.config.set({"dataservice.ps.coalesce-bytes": coalesce}):
            rvs = [coord.schedule(_train_step, args=(emb, sgd, i)) for i in range(STEPS)]
            coord.join()
        coord.shutdown()
        return emb.numpy(), [rv.fetch() for rv in rvs]

    table, seen = await in_thread(s, body)
    want_table, want_seen = _reference()
    for step, (got, want) in enumerate(zip(seen, want_seen, strict=True)):
        np.testing.assert_array_equal(got, want, err_msg=f"step {step}")
    np.testing.assert_array_equal(table, want_table)
    stats = [p.plugins[PLUGIN_NAME].stats for p in (p0, p1)]

    def touched(ids, ps):  # requests a PS serves: one per shard it holds that has an id
        return len({i // (ROWS // 4) for i in ids} & {ps, ps + 2})

    steps = [_ids(step) for step in range(STEPS)]
    for ps, st in enumerate(stats):
        assert st["gathers"] == sum(touched(ids, ps) for ids in steps)
        # the dashboard's per-shard counts see the gathers of ps_gather_parts too
        ops = (p0, p1)[ps].plugins[PLUGIN_NAME].shard_ops
        assert sum(c["gathers"] for c in ops.values()) == st["gathers"], ops
        assert st["updates"] == sum(touched(ids, ps) + touched(ids[:7], ps) for ids in steps)
    # the apply and the scatter of step k travel with the gather of step k + 1
    if coalesce:
        assert all(st["batches"] >= STEPS - 1 for st in stats), stats
    else:
        assert [st["batches"] for st in stats] == [0, 0]


@pytest.mark.cluster
@gen_cluster(client=False, nthreads=[PS, WK])
async def test_batch_and_parts_requests_refuse_bad_input(s, p0, w0):
    def body(c):
        strategy = dds.ParameterServerStrategy(
            c, variable_partitioner=dds.partitioners.FixedShardsPartitioner(2))
        with strategy.scope():
            emb = dds.Variable(np.ones((10, 2), "f4"), name="emb")
        keys = [v.key for v in emb.variables]
        ps = c.rpc(p0.address)
        reply = c.sync(ps.ps_batch, ops=[
            {"op": "ps_gather", "key": keys[0], "ids": _wire(np.array([1]))},
            {"op": "ps_flush"},
            {"op": "ps_gather", "key": keys[1], "ids": _wire(np.array([9]))},
        ])
        ok, refused, bad_id = reply["replies"]
        assert ok["status"] == "OK" and ok["value"].tolist() == [[1.0, 1.0]]
        with pytest.raises(ValueError, match="ps_batch cannot carry 'ps_flush'"):
            _routing.check(refused, Call(p0.address, "ps_flush", {}))
        with pytest.raises(IndexError, match=r"id 9 is out of range \[0, 5\)"):
            _routing.check(bad_id, Call(p0.address, "ps_gather", {}))
        with pytest.raises(TypeError, match="ps_batch takes a list of requests, got str"):
            _routing.check(c.sync(ps.ps_batch, ops="nope"), Call(p0.address, "ps_batch", {}))
        with pytest.raises(ValueError, match=r"counts \[1, 1\] do not add up to the 3 ids"):
            _routing.check(c.sync(ps.ps_gather_parts, keys=keys, counts=[1, 1],
                                  ids=_wire(np.array([0, 1, 2]))), Call(p0.address, "x", {}))
        with pytest.raises(ValueError, match="2 keys but 1 counts"):
            _routing.check(c.sync(ps.ps_gather_parts, keys=keys, counts=[3],
                                  ids=_wire(np.array([0, 1, 2]))), Call(p0.address, "x", {}))
        with pytest.raises(ShapeMismatchError, match=r"a gradient of shape \(2, 2\) for 3 ids"):
            _routing.check(c.sync(ps.ps_apply_parts, keys=keys, counts=[1, 2],
                                  optimizer={"kind": "sgd", "learning_rate": 0.1, "name": "s"},
                                  grad=_wire(np.ones((2, 2), "f4")),
                                  ids=_wire(np.array([0, 1, 2]))), Call(p0.address, "x", {}))
        got = c.sync(ps.ps_gather_parts, keys=keys, counts=[1, 2], ids=_wire(np.array([4, 0, 3])))
        return got["value"]

    value = await in_thread(s, body)
    np.testing.assert_array_equal(value, np.ones((3, 2), "f4"))
