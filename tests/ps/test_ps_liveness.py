"""Frozen (SIGSTOP) training workers and parameter servers (issue 11 s2), with Nanny
processes: ``join()`` never waits for Dask's worker-ttl (minutes), only for
``dataservice.ps.liveness-timeout`` (seconds)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from contextlib import contextmanager

import pytest
from distributed import Client, Nanny

# the same gated step as the kill test: the 11th function of a worker's first batch lands
# the updates of the 10 before it, writes a marker, and waits for the gate file
from test_ps_faults import _count_step, _gated_step

import dask_dataservice as dds
from dask_dataservice.errors import ParameterServerUnavailableError
from dask_dataservice.testing import gen_cluster

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

PS = ("127.0.0.1", 1, {"resources": {"ps": 1}})
WK = ("127.0.0.1", 1)
LIVENESS = 2.0
CONFIG = {"dataservice.ps.liveness-timeout": f"{LIVENESS}s",
          "dataservice.ps.membership-interval": "200ms",
          "dataservice.ps.closures-per-batch": 20}


@contextmanager
def frozen(nanny):
    """SIGSTOP the worker process of ``nanny``; SIGCONT on the way out (whatever happens)."""
    pid = nanny.process.process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield pid
    finally:
        os.kill(pid, signal.SIGCONT)


def wait_until(predicate, timeout: float, what: str, state=None) -> None:
    """Wait for ``predicate`` (polled) for at most ``timeout`` s; ``state()`` says where
    things stood when it did not come."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what}"
                                 + (f": {state()}" if state is not None else ""))
        time.sleep(0.02)


@pytest.mark.slow
def test_frozen_training_worker(tmp_path):
    gate = str(tmp_path / "gate")

    @gen_cluster(client=False, Worker=Nanny, nthreads=[PS, PS, WK, WK], timeout=110,
                 config=CONFIG)
    async def run(s, p0, p1, w0, w1):
        c = await asyncio.to_thread(Client, s.address, set_as_default=False)
        try:
            await asyncio.to_thread(_frozen_training_worker, c, w0, gate)
        finally:
            await asyncio.to_thread(c.close)

    run()


def _frozen_training_worker(c, victim, gate):
    """A training worker frozen mid-batch: its functions re-run elsewhere within seconds and
    join() returns with every update applied exactly once; woken up after join, its stale
    updates are dropped by the parameter servers, and it is used again."""
    n_steps = 400
    strategy = dds.ParameterServerStrategy(c)
    coord = dds.ClusterCoordinator(strategy)
    with strategy.scope():
        counter = dds.Variable(0, dtype="i8", name="counter")
        total = dds.Variable(0, dtype="i8", name="total")
    rvs = [coord.schedule(_gated_step, args=(counter, total, i, gate)) for i in range(n_steps)]
    marker = f"{gate}.{victim.worker_address.rsplit(':', 1)[1]}"
    wait_until(lambda: os.path.exists(marker), 30, "the victim to wait mid-batch")
    with frozen(victim):
        started = time.monotonic()
        open(gate, "w").close()  # the other worker goes on; the victim is stopped
        coord.join()
        took = time.monotonic() - started
        print(f"join() with a frozen training worker took {took:.1f} s")
        assert took < LIVENESS + 15, took  # not Dask's worker-ttl (5 min)
        assert [rv.fetch() for rv in rvs] == list(range(n_steps))
        assert coord.stats["workers_silent"] == 1 and coord.stats["requeued"] >= 1
        assert int(counter.numpy()) == n_steps
        assert int(total.numpy()) == n_steps * (n_steps - 1) // 2
        before = _skipped(c, strategy)
        # join() pruned the exactly-once records of the finished functions
        records = c.run(lambda dask_worker: sum(
            len(s.applied) for s in dask_worker.extensions["dataservice-ps"].shards.values()),
            workers=strategy.ps_addresses)
        assert sum(records.values()) == 0, records
    # woken up after join(): the victim finishes what it started of its stale batch, whose
    # functions re-ran elsewhere and were forgotten by join: the gated one (2 updates) and
    # those after it (up to 9 more) that were not withdrawn meanwhile (an idle worker may
    # have asked for the later half while the victim was frozen: it is told when it wakes,
    # and stops before them). Every one of those updates is dropped: by the parameter
    # servers (``skipped``), or, when the woken worker's probe of a parameter server is not
    # answered within the liveness timeout first (a loaded machine), by the function failing
    # before they land. The batch's end says which: its updates are answered by then.
    def runner():
        return c.run(lambda dask_worker: (lambda r: {
            "running": len(r._sizes), "failed": len(r.poisoned), **r.stats})(
                dask_worker.extensions["dataservice-ps-runner"]),
            workers=[victim.worker_address])[victim.worker_address]

    def where():
        return {"skipped": _skipped(c, strategy) - before, "counter": int(counter.numpy()),
                "total": int(total.numpy()), "coordinator": dict(coord.stats),
                "ps": {a: c.sync(c.rpc(a).ps_info)["stats"] for a in strategy.ps_addresses},
                "victim": runner()}

    wait_until(lambda: runner()["running"] == 0, 30, "the stale batch to end", where)
    assert _skipped(c, strategy) >= before + 2 or runner()["failed"], where()
    assert int(counter.numpy()) == n_steps
    assert int(total.numpy()) == n_steps * (n_steps - 1) // 2
    wait_until(lambda: coord.stats["workers_back"] >= 1, 30, "the victim to be used again")
    for _ in range(200):
        coord.schedule(_count_step, args=(counter,))
    coord.join()
    assert int(counter.numpy()) == n_steps + 200
    # the stale batch ran before the new ones: its updates dropped, none applied (above)
    ran = c.run(lambda dask_worker: dask_worker.extensions["dataservice-ps-runner"].stats[
        "batches"], workers=[victim.worker_address])
    assert ran[victim.worker_address] >= 2  # the stale batch, and new ones
    coord.shutdown()


def _skipped(c, strategy) -> int:
    return sum(c.sync(c.rpc(a).ps_info)["stats"]["skipped"] for a in strategy.ps_addresses)


@pytest.mark.slow
@gen_cluster(client=False, Worker=Nanny, nthreads=[PS, WK], timeout=110,
             config={**CONFIG, "dataservice.ps.request-timeout": "30s"})
async def test_frozen_parameter_server(s, ps, w0):
    c = await asyncio.to_thread(Client, s.address, set_as_default=False)
    try:
        await asyncio.to_thread(_frozen_parameter_server, c, ps)
    finally:
        await asyncio.to_thread(c.close)


def _frozen_parameter_server(c, ps):
    """A frozen PS is reported within seconds (not after the 30 s request timeout, nor
    Dask's worker-ttl), and new functions fail at once while it stays frozen; resumed, it is
    used again and updates are exact."""
    strategy = dds.ParameterServerStrategy(c)
    coord = dds.ClusterCoordinator(strategy)
    with strategy.scope():
        counter = dds.Variable(0, dtype="i8", name="counter")
    for _ in range(50):
        coord.schedule(_count_step, args=(counter,))
    coord.join()
    assert int(counter.numpy()) == 50
    with frozen(ps):
        started = time.monotonic()
        rvs = [coord.schedule(_count_step, args=(counter,)) for _ in range(20)]
        with pytest.raises(ParameterServerUnavailableError,
                           match=rf"did not answer within {LIVENESS:g} s .*liveness-timeout"):
            coord.join()
        took = time.monotonic() - started
        print(f"join() with a frozen parameter server raised after {took:.1f} s")
        assert took < LIVENESS + 6
        # the training worker's runner, waiting for the frozen PS's replies, probes it and
        # gives up after about two liveness timeouts, not the 30 s request timeout: the
        # functions it held come back (cancelled: their generation failed)
        wait_until(lambda: all(rv.done() for rv in rvs), 3 * LIVENESS + 3,
                   "the runner to give up on the frozen PS")
        # while it stays frozen, new functions fail at once with the same error
        wait_until(lambda: coord.stats["ps_silent"] == 1, 10, "the PS to be marked silent")
        started = time.monotonic()
        coord.schedule(_count_step, args=(counter,))
        with pytest.raises(ParameterServerUnavailableError, match="did not answer within"):
            coord.join()
        assert time.monotonic() - started < 3
        # requests from the coordinator, bulk ones too (not bounded by the request
        # timeout), fail after a liveness probe instead of waiting for the frozen PS
        for request in (counter.numpy, strategy.flush):
            started = time.monotonic()
            with pytest.raises(ParameterServerUnavailableError,
                               match="did not answer a liveness probe"):
                request()
            assert time.monotonic() - started < 2 * LIVENESS + 3
    wait_until(lambda: coord.stats["ps_back"] == 1, 15, "the PS to answer again")
    # the training worker's functions that were in flight when the PS froze finish now;
    # one more round drains them (one runner thread: batches run in order)
    for _ in range(10):
        coord.schedule(_count_step, args=(counter,))
    coord.join()
    settled = int(counter.numpy())
    assert 60 <= settled <= 81
    for _ in range(10):
        coord.schedule(_count_step, args=(counter,))
    coord.join()
    assert int(counter.numpy()) == settled + 10
    coord.shutdown()
