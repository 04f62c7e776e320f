"""TensorFlow's ClusterCoordinator error scenarios (``cluster_coordinator_test.py``:
``ErrorReportingTest`` and the queue tests it builds on), re-expressed on a real cluster: a
parameter server and training workers in one process. Functions here pickle by reference, so
the workers share this module's events with the test thread: a "long" function runs until the
test releases it (TensorFlow's is a long computation, cancelled when another one fails)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from distributed import Client, Worker

import dask_dataservice as dds
from dask_dataservice.ps._runner_plugin import RUNNER_NAME
from dask_dataservice.ps.coordinator import ClosureCancelledError
from dask_dataservice.testing import gen_cluster
from dask_dataservice.testing._ps import warm_up_zarr

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]

warm_up_zarr()

from _helpers import PS, WK, in_thread, wait  # noqa: E402

LONG_STARTED = threading.Event()
RELEASE = threading.Event()


def _normal(v):
    v.assign_add(1.0)
    return 1.0


def _long():
    LONG_STARTED.set()
    assert RELEASE.wait(30), "never released"
    return "finished late"


def _error():
    raise ValueError("assert_non_positive failed")


def _next(it):
    return next(it)


def _reset():
    LONG_STARTED.clear()
    RELEASE.clear()


def _cancellation(c):
    """testCancellation: three normal functions, a long one and a failing one."""
    strategy = dds.ParameterServerStrategy(c)
    coord = dds.ClusterCoordinator(strategy)
    with strategy.scope():
        v = dds.Variable(0.0, name="iteration")
    normals = [coord.schedule(_normal, args=(v,)) for _ in range(3)]
    long_function = coord.schedule(_long)
    failing = coord.schedule(_error)
    try:
        # the failing function runs while the long one runs (never queued behind it)
        wait(failing.done, 20, "the failing function to run while the long one runs")
        with pytest.raises(ValueError, match="assert_non_positive"):
            coord.join()
    finally:
        RELEASE.set()
    with pytest.raises(ClosureCancelledError):
        long_function.fetch()
    # join() does not wait for the functions still running (they cannot be interrupted):
    # wait until all settled. A normal one that waited behind a slower one may have been
    # cancelled with the long one (functions start in no promised order): 0-3 ran.
    wait(lambda: all(rv.done() for rv in normals), 20, "the normal functions to settle")
    before = float(v.numpy())
    assert before in (0.0, 1.0, 2.0, 3.0)
    for _ in range(3):
        coord.schedule(_normal, args=(v,))
    coord.join()
    assert v.numpy() == before + 3


@gen_cluster(client=False, nthreads=[PS, WK, WK, WK])
async def test_cancellation(s, p0, w0, w1, w2):
    """cluster_coordinator_test.ErrorReportingTest.testCancellation, on three workers as there:
    ``join()`` raises the failure; ``fetch()`` of the long function, which was running when it
    failed, raises ClosureCancelledError (TensorFlow's CancelledError); scheduling works
    again afterwards."""
    _reset()
    await in_thread(s, _cancellation)


@gen_cluster(client=False, nthreads=[PS, WK, WK])
async def test_cancellation_on_two_workers(s, p0, w0, w1):
    """testCancellation on two workers: five functions on four batch slots, so the failing
    function was sent behind the long one; the idle worker takes it over. Before, it waited
    for the long one: the long one finished first and its ``fetch()`` returned its value."""
    _reset()
    await in_thread(s, _cancellation)


@gen_cluster(client=False, nthreads=[PS, WK])
async def test_a_function_sent_behind_a_long_one_runs_on_a_worker_that_becomes_free(s, p0, w0):
    """The cause of testCancellation's failure, forced: with one worker, the failing function
    is sent to it behind the long one (its second batch slot). A second worker joins: being
    idle with nothing queued, it takes the waiting function over, which fails there while the
    long one still runs. Before, it stayed behind the long one (the wait below timed out)."""
    _reset()
    state = {}

    def first(c):
        strategy = dds.ParameterServerStrategy(c)
        coord = dds.ClusterCoordinator(strategy)
        long_function = coord.schedule(_long)
        assert LONG_STARTED.wait(10)
        failing = coord.schedule(_error)
        wait(lambda: sum(len(b) for b in coord._sent.get(w0.address, {}).values()) == 2, 10,
             "both functions sent to the only worker")
        assert not failing.done()
        state.update(coord=coord, long=long_function, failing=failing)

    def second(c):
        coord, failing = state["coord"], state["failing"]
        try:
            wait(failing.done, 20, "the failing function to run on the new worker")
            with pytest.raises(ValueError, match="assert_non_positive"):
                coord.join()
        finally:
            RELEASE.set()
        with pytest.raises(ClosureCancelledError):
            state["long"].fetch()
        assert coord.stats["withdrawn"] == 1
        assert coord.schedule(_next, args=(iter([5]),)).fetch() == 5
        coord.shutdown()

    client = await asyncio.to_thread(Client, s.address, set_as_default=False)
    try:
        await asyncio.to_thread(first, client)
        async with Worker(s.address, nthreads=1) as w1:
            await asyncio.to_thread(second, client)
            assert w0.extensions[RUNNER_NAME].stats["withdrawn"] == 1
            assert w1.extensions[RUNNER_NAME].stats["closures"] >= 1
    finally:
        await asyncio.to_thread(client.close)


def _error_reporting(c):
    strategy = dds.ParameterServerStrategy(c)
    coord = dds.ClusterCoordinator(strategy)
    with strategy.scope():
        v = dds.Variable(0.0, name="iteration")
    passed = []

    # testJoinRaiseError
    for _ in range(3):
        coord.schedule(_normal, args=(v,))
    coord.schedule(_error)
    with pytest.raises(ValueError, match="assert_non_positive"):
        coord.join()
    coord.join()  # raised once, then cleared
    passed.append("testJoinRaiseError")

    # testScheduleRaiseError: schedule() raises the error of an earlier function
    for _ in range(3):
        coord.schedule(_normal, args=(v,))
    coord.schedule(_error)
    with pytest.raises(ValueError, match="assert_non_positive"):
        wait_raises(lambda: coord.schedule(_normal, args=(v,)))
    coord.join()  # schedule() cleared it
    passed.append("testScheduleRaiseError")

    # testScheduleRaiseErrorWithMultipleFailure: one error raised; the others, of the
    # cancelled generation, are not raised by the next join()
    for _ in range(3):
        coord.schedule(_normal, args=(v,))
    coord.schedule(_error)
    with pytest.raises(ValueError, match="assert_non_positive"):
        wait_raises(lambda: coord.schedule(_error))
    coord.join()
    passed.append("testScheduleRaiseErrorWithMultipleFailure")

    # testErrorWillbeCleared
    coord.schedule(_error)
    with pytest.raises(ValueError, match="assert_non_positive"):
        coord.join()
    for _ in range(3):
        coord.schedule(_normal, args=(v,))
    coord.schedule(_error)
    with pytest.raises(ValueError, match="assert_non_positive"):
        coord.join()
    passed.append("testErrorWillbeCleared")

    # testRemoteValueReturnError: fetch() raises the function's own error; join() too, once
    result = coord.schedule(_error)
    with pytest.raises(ValueError, match="assert_non_positive"):
        result.fetch()
    with pytest.raises(ValueError, match="assert_non_positive"):
        coord.join()
    with pytest.raises(ValueError, match="assert_non_positive"):
        result.fetch()  # the function's error stays with its RemoteValue
    passed.append("testRemoteValueReturnError")

    # CoordinatedClosureQueueTest.testDoneRaiseError
    coord.schedule(_error)
    with pytest.raises(ValueError, match="assert_non_positive"):
        wait_raises(coord.done)
    assert coord.done() is True  # raised once, cleared; nothing else pending
    coord.join()
    passed.append("testDoneRaiseError")

    # testResourceCanStillbeUsedAfterCancellation: a per-worker iterator keeps working
    per_worker = coord.create_per_worker_dataset(lambda: dds.Dataset.range(5))
    it = iter(per_worker)
    coord.schedule(_next, args=(it,))
    coord.schedule(_error)
    with pytest.raises(ValueError, match="assert_non_positive"):
        coord.join()
    got = coord.schedule(_next, args=(it,)).fetch()
    assert got in range(5)
    coord.join()
    passed.append("testResourceCanStillbeUsedAfterCancellation")
    return passed


def wait_raises(call, timeout: float = 20.0):
    """Call ``call()`` until it raises (its error propagates), failing after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        call()
        time.sleep(0.005)
    raise AssertionError(f"{call} did not raise within {timeout} s")


@gen_cluster(client=False, nthreads=[PS, WK, WK, WK])
async def test_error_reporting_scenarios(s, p0, w0, w1, w2):
    """cluster_coordinator_test.ErrorReportingTest: testJoinRaiseError,
    testScheduleRaiseError, testScheduleRaiseErrorWithMultipleFailure, testErrorWillbeCleared,
    testRemoteValueReturnError (skipped in TF's OSS run), testResourceCanStillbeUsedAfter-
    Cancellation, and CoordinatedClosureQueueTest.testDoneRaiseError, in that order on one
    coordinator (each leaves it clean for the next)."""
    passed = await in_thread(s, _error_reporting)
    assert passed == [
        "testJoinRaiseError", "testScheduleRaiseError",
        "testScheduleRaiseErrorWithMultipleFailure", "testErrorWillbeCleared",
        "testRemoteValueReturnError", "testDoneRaiseError",
        "testResourceCanStillbeUsedAfterCancellation"]


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_a_per_worker_dataset_fn_taking_an_input_context_and_closing_mid_read():
    """The seed's ``coordinator.create_per_worker_dataset(new_dataset_fn)``, where
    ``new_dataset_fn(input_context)`` returns ``from_dataset_id(...)`` (TensorFlow's tf.data
    service module documentation, "coordinator.create_per_worker_dataset"): the function is
    given an ``InputContext``, and the cluster closes while each worker's reader is mid-read.

    Closing dropped each training worker's half-read iterator on the worker's event loop,
    whose release then waited (``sync``) for the scheduler running on that same loop: 20 s
    per worker with every server of the process frozen. The deadline is far below that.
    """
    from distributed import Scheduler, SpecCluster

    from dask_dataservice.ps.strategy import InputContext

    specs = {"ps0": {"cls": Worker, "options": {"nthreads": 1, "resources": {"ps": 1}}},
             **{f"w{i}": {"cls": Worker, "options": {"nthreads": 1}} for i in range(2)}}
    with SpecCluster(workers=specs, scheduler={"cls": Scheduler,
                     "options": {"dashboard_address": ":0"}}) as cluster, \
            Client(cluster) as client:
        address = client.scheduler.address
        coordinator = dds.ClusterCoordinator(dds.ParameterServerStrategy(client))
        dataset_id = dds.register_dataset(address, dds.Dataset.range(1000).repeat())

        def new_dataset_fn(input_context):
            assert isinstance(input_context, InputContext), input_context
            return dds.from_dataset_id(processing_mode="parallel_epochs", service=address,
                                       dataset_id=dataset_id, job_name="shared")

        iterator = iter(coordinator.create_per_worker_dataset(new_dataset_fn))
        got = [coordinator.schedule(lambda it: int(next(it)), args=(iterator,))
               for _ in range(6)]
        coordinator.join()
        assert all(0 <= r.fetch() < 1000 for r in got)
        client.close()
        start = time.monotonic()
        cluster.close()
        assert time.monotonic() - start < 10
    # the client the workers' readers opened by address (this process holds it; on worker
    # processes it ends with them)
    dds.service.client.close_clients(address)
