"""TensorFlow's cluster setup (TF_CONFIG, cluster resolvers) and the rest of the strategy API
(issue 24, sections 2 and 5): per-worker variables, variables made inside scheduled
functions, nested reduce, ``run``/``reduce`` warnings, values from a function."""

from __future__ import annotations

import json
import logging
import socket
from collections import namedtuple

import cloudpickle
import dask
import numpy as np
import pytest
from distributed import Worker
from distributed.utils import LoopRunner, sync

import dask_dataservice as dds
from dask_dataservice.ps import cluster_resolver as cr
from dask_dataservice.ps.per_worker import PerWorkerVariable
from dask_dataservice.ps.strategy import NOT_SCHEDULED_WARNING, ValueContext
from dask_dataservice.testing import gen_cluster
from dask_dataservice.testing._ps import warm_up_zarr

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]

warm_up_zarr()

from _helpers import PS, WK, free_port, in_thread  # noqa: E402

STRATEGY_LOG = "dask_dataservice.ps.strategy"


def _loopback_cluster(num_ps: int, num_workers: int) -> dict[str, list[str]]:
    ports = [free_port() for _ in range(1 + num_ps + num_workers)]
    addr = [f"127.0.0.1:{p}" for p in ports]
    return {"chief": addr[:1], "ps": addr[1:1 + num_ps], "worker": addr[1 + num_ps:]}


async def _plain_worker(scheduler: str, host: str, port: int) -> Worker:
    worker = Worker(scheduler, host=host, port=port, nthreads=1)
    await worker
    return worker


def _add_one(v):
    v.assign_add(1.0)
    return v.name


# -- section 2: TF_CONFIG and the cluster resolvers --------------------------------------------

def test_a_tf_config_cluster_on_loopback_becomes_a_dask_cluster(monkeypatch):
    """The chief of a TF_CONFIG starts the scheduler at its address; the ``ps`` and ``worker``
    tasks are Dask workers at theirs, started before the chief (as TensorFlow's servers may
    be); ps task i holds the variables placed on /job:ps/task:i.

    Re-expresses tensorflow/python/distribute/parameter_server_strategy_v2_test.py
    (ParameterServerStrategyV2Test.testVariablePlacement, with the strategy built from a
    TFConfigClusterResolver as the seed's "Cluster setup" does) and
    cluster_resolver/tfconfig_cluster_resolver_test.py (testNormalClusterSpecRead).
    """
    cluster = _loopback_cluster(num_ps=3, num_workers=2)
    # the ps and worker tasks first, in no particular order: they wait for the scheduler
    servers = [cr.Server(cluster, "ps", 2), cr.Server(cluster, "worker", 1),
               cr.Server(cluster, "ps", 0), cr.Server(cluster, "worker", 0),
               cr.Server(cluster, "ps", 1)]
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": cluster, "task": {"type": "chief", "index": 0}, "rpc_layer": "grpc"}))
    try:
        resolver = dds.TFConfigClusterResolver()
        assert resolver.cluster_spec().as_dict() == cluster
        assert (resolver.task_type, resolver.task_id) == ("chief", 0)
        assert resolver.master() == f"grpc://{cluster['chief'][0]}"
        strategy = dds.ParameterServerStrategy(cluster_resolver=resolver)
        try:
            assert strategy.cluster_resolver is resolver
            assert strategy.client.scheduler.address == f"tcp://{cluster['chief'][0]}"
            assert strategy.ps_addresses == [f"tcp://{a}" for a in cluster["ps"]]
            assert (strategy.num_ps, strategy.num_workers) == (3, 2)
            assert sorted(strategy.worker_addresses) == sorted(f"tcp://{a}" for a in cluster["worker"])
            roles = {a: w["resources"] for a, w in
                     strategy.client.scheduler_info(n_workers=-1)["workers"].items()}
            assert roles == {**{f"tcp://{a}": {"ps": 1} for a in cluster["ps"]},
                             **{f"tcp://{a}": {"worker": 1} for a in cluster["worker"]}}
            v1 = dds.Variable(initial_value=0.0)
            with strategy.scope():
                v2, v3, v4, v5 = (dds.Variable(initial_value=float(i)) for i in range(1, 5))
            assert v1.ps_address is None
            assert [v.device for v in (v2, v3, v4, v5)] == [
                f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in (0, 1, 2, 0)]
            assert [v.ps_address for v in (v2, v3, v4)] == strategy.ps_addresses
            coordinator = dds.ClusterCoordinator(strategy)
            results = [coordinator.schedule(_add_one, args=(v3,)) for _ in range(4)]
            coordinator.join()
            assert [r.fetch() for r in results] == [v3.name] * 4
            assert float(v3.numpy()) == 6.0
            coordinator.shutdown()
        finally:
            for server in servers:  # the workers first: the scheduler is the chief's
                server.stop()
            strategy.close()
    finally:
        for server in servers:
            server.stop()


def test_a_simple_cluster_resolver_finds_a_running_scheduler_and_waits_for_its_tasks():
    """A resolver naming a scheduler that runs already (the chief's Server) connects to it
    (the resolver passed as the first argument, TensorFlow's form); a task that never joins
    is a TimeoutError naming it, and the scheduler the chief started for it is stopped.

    Re-expresses tensorflow/python/distribute/coordinator/cluster_coordinator_test.py
    (make_coordinator: SimpleClusterResolver(ClusterSpec(cluster_def)) handed to the
    strategy) and parameter_server_strategy_v2_test.py (ClusterTypeNameTest).
    """
    cluster = _loopback_cluster(num_ps=1, num_workers=1)
    chief = cr.Server(dds.ClusterSpec(cluster), job_name="chief", task_index=0)
    servers = [cr.Server(cluster, "ps", 0)]
    # the worker task is a plain Dask worker (`dask worker ... --listen-address`): no resource
    runner = LoopRunner(asynchronous=False)
    runner.start()
    host, port = cr._host_port(cluster["worker"][0])
    plain = sync(runner.loop, _plain_worker, chief.target, host, port)
    try:
        spec = dds.ClusterSpec(cluster)
        # this process is the chief, but a scheduler listens at its address: it is used
        strategy = dds.ParameterServerStrategy(dds.SimpleClusterResolver(
            spec, task_type="chief", task_id=0, rpc_layer="grpc"))
        try:
            assert strategy.ps_addresses == [servers[0].target]
            assert strategy.worker_addresses == [plain.address] == [f"tcp://{cluster['worker'][0]}"]
            assert strategy.client.scheduler_info(n_workers=-1)["workers"][plain.address][
                "resources"] == {"worker": 1}  # given by the strategy
            with strategy.scope():
                v = dds.Variable(np.arange(3, dtype="i8"), name="v")
            assert v.numpy().tolist() == [0, 1, 2]
        finally:
            for server in servers:
                server.stop()
            sync(runner.loop, plain.close)
            strategy.close()
    finally:
        for server in servers:
            server.stop()
        runner.stop()
        chief.stop()
    # nobody at the ps and worker addresses: the chief starts its scheduler, waits, gives up
    lonely = _loopback_cluster(num_ps=1, num_workers=1)
    resolver = dds.SimpleClusterResolver(dds.ClusterSpec(lonely), task_type="chief", task_id=0)
    with dask.config.set({"dataservice.ps.cluster-timeout": "300ms"}):
        with pytest.raises(TimeoutError) as info:
            dds.ParameterServerStrategy(cluster_resolver=resolver)
    assert str(info.value) == (
        f"2 task(s) of the cluster spec did not join the scheduler at tcp://{lonely['chief'][0]} "
        f"within 0.3 s: /job:ps/task:0 ({lonely['ps'][0]}), "
        f"/job:worker/task:0 ({lonely['worker'][0]})")
    with socket.socket() as s:  # the scheduler it started is gone: nothing listens there
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # closed connections linger
        s.bind(tuple(cr._host_port(lonely["chief"][0])))


@pytest.mark.pure
def test_cluster_specs_and_resolvers_as_tensorflow_reads_them(monkeypatch):
    """Re-expresses tensorflow/python/distribute/cluster_resolver/tfconfig_cluster_resolver_test.py
    (testNormalClusterSpecRead, testAutomaticMasterRead, testSpecifiedTaskTypeAndIndexMasterRead,
    testSessionMasterRead, testRpcLayerRead, testParameterOverrides, testTaskTypeCastToString,
    testTaskIndexCastToInteger, testTaskIndexOverride, testZeroItemsInClusterSpecMasterRead,
    testOneItemInClusterSpecMasterRead)."""
    cluster = {"ps": ["ps0:2222", "ps1:2222"],
               "worker": ["worker0:2222", "worker1:2222", "worker2:2222"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster,
                                                "task": {"type": "ps", "index": 0}}))
    r = dds.TFConfigClusterResolver()
    assert r.cluster_spec() == dds.ClusterSpec(cluster)
    assert r.cluster_spec().as_dict() == cluster
    assert r.master() == "ps0:2222"
    assert r.master("worker", 1) == "worker1:2222"
    assert r.num_accelerators() == {}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "session_master":
                                                "sessionmaster:2222",
                                                "task": {"type": "ps", "index": 0}}))
    assert dds.TFConfigClusterResolver().master() == "sessionmaster:2222"
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "rpc_layer": "grpc",
                                                "task": {"type": "ps", "index": 1}}))
    r = dds.TFConfigClusterResolver()
    assert (r.task_type, r.task_id, r.rpc_layer, r.master()) == ("ps", 1, "grpc", "grpc://ps1:2222")
    r = dds.TFConfigClusterResolver(task_type="ps", task_id=0)
    assert r.master() == "grpc://ps0:2222"
    r.task_type, r.task_id, r.rpc_layer = "worker", 1, "test"
    assert (r.master(), r.task_type, r.task_id, r.rpc_layer) == (
        "test://worker1:2222", "worker", 1, "test")
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"123456": ["a:1"]},
                                                "task": {"type": 123456, "index": "1"}}))
    assert (dds.TFConfigClusterResolver().task_type, dds.TFConfigClusterResolver().task_id) == (
        "123456", 1)
    assert dds.TFConfigClusterResolver(task_id=0).task_id == 0
    monkeypatch.setenv("TF_CONFIG", "{}")
    assert dds.TFConfigClusterResolver().master() == ""
    assert not dds.TFConfigClusterResolver().cluster_spec()
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["worker0:2222"]}}))
    assert dds.TFConfigClusterResolver().master() == ""
    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(ValueError, match="TF_CONFIG is not valid JSON"):
        dds.TFConfigClusterResolver().cluster_spec()
    # ClusterSpec: sparse jobs, equality, bad input
    spec = dds.ClusterSpec({"ps": {1: "b:1", 3: "d:1"}, "worker": ["w:1"]})
    assert spec.as_dict() == {"ps": {1: "b:1", 3: "d:1"}, "worker": ["w:1"]}
    assert (spec.jobs, spec.num_tasks("ps"), spec.task_indices("ps")) == (["ps", "worker"], 2, [1, 3])
    assert spec.job_tasks("ps") == [None, "b:1", None, "d:1"]
    assert dds.ClusterSpec(spec) == spec and dds.ClusterSpec(spec) is not spec
    with pytest.raises(ValueError, match="no task with index 0 in job 'ps'"):
        spec.task_address("ps", 0)
    with pytest.raises(TypeError, match="ClusterSpec takes a dict"):
        dds.ClusterSpec(["a:1"])
    simple = dds.SimpleClusterResolver(spec, master="m:1", task_type="worker", task_id=0,
                                       rpc_layer="grpc", num_accelerators={"GPU": 2})
    assert (simple.master(), simple.master("ps", 3), simple.num_accelerators()) == (
        "grpc://m:1", "grpc://d:1", {"GPU": 2})


@pytest.mark.pure
def test_a_cluster_spec_the_strategy_cannot_use_is_refused_naming_what_is_missing(monkeypatch):
    """Re-expresses tensorflow/python/distribute/parameter_server_strategy_v2_test.py
    (ClusterTypeNameTest: testArbitraryJobName, testArbitraryCurrentTaskType,
    testMoreThanOneChief, testLessThanOneWorker, testLessThanOnePs), plus what Dask needs:
    a chief (the scheduler's address) and a cluster at all."""
    def strategy(cluster, **task):
        return dds.ParameterServerStrategy(
            cluster_resolver=dds.SimpleClusterResolver(dds.ClusterSpec(cluster), **task))

    ok = {"chief": ["c:1"], "ps": ["p:1"], "worker": ["w:1"]}
    cases = [
        ({**ok, "some_arbitrary_name": ["x:1"]}, {},
         "Disallowed task type found in cluster spec: ['some_arbitrary_name'] (allowed: "
         "['chief', 'worker', 'ps', 'evaluator'])"),
        (ok, {"task_type": "foobar"}, "Unrecognized task_type: foobar"),
        ({**ok, "chief": ["c:1", "c:2", "c:3"]}, {"task_type": "chief", "task_id": 1},
         "There must be at most one 'chief' job."),
        ({**ok, "worker": []}, {"task_type": "ps", "task_id": 0}, "There must be at least one worker."),
        ({"chief": ["c:1"], "worker": ["w:1"]}, {"task_type": "worker", "task_id": 0},
         "There must be at least one ps."),
        ({"ps": ["p:1"], "worker": ["w:1"]}, {},
         "The cluster spec has no 'chief' task: on Dask the chief's address is the "
         "scheduler's (the chief runs the scheduler and the coordinator); add \"chief\": "
         "[\"host:port\"]"),
        ({}, {}, "Cluster spec must be non-empty in the ClusterResolver (is TF_CONFIG set, "
                 "with a \"cluster\"?)"),
    ]
    for cluster, task, message in cases:
        with pytest.raises(ValueError) as info:
            strategy(cluster, **task)
        assert str(info.value) == message
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match="TF_CONFIG is not set"):
        dds.ParameterServerStrategy()
    with pytest.raises(TypeError, match="not both"):
        dds.ParameterServerStrategy(object(), cluster_resolver=dds.TFConfigClusterResolver())
    with pytest.raises(TypeError, match="cluster_resolver must be a ClusterResolver"):
        dds.ParameterServerStrategy(cluster_resolver={"ps": ["p:1"]})
    with pytest.raises(ValueError, match="an evaluator runs"):
        cr.Server(ok | {"evaluator": ["e:1"]}, "evaluator", 0)
    # TensorFlow's ShardedVariable type for an empty (or not a) list of variables
    for bad in ([], None, [dds.Variable([0]), "not-a-variable"]):
        with pytest.raises(TypeError, match="should be a non-empty list of Variable objects"):
            dds.ShardedVariable(bad)
    with pytest.raises(ValueError, match="create it inside strategy.scope"):
        dds.Variable(0.0, per_worker_variable=True)


# -- section 5: the rest of the strategy API ------------------------------------------------

def _per_worker_step(var):
    var.assign_add(np.ones(1, "f4"))


@gen_cluster(client=False, nthreads=[PS, WK, WK])
async def test_per_worker_variables_keep_one_copy_per_training_worker(s, p0, w0, w1):
    """Re-expresses tensorflow/python/distribute/coordinator/cluster_coordinator_test.py
    (ClusterCoordinatorTest.testPerWorkerVariableCreation): each scheduled function adds 1 to
    the copy of the worker it runs on; the copies sum to the number of functions."""
    def body(c):
        strategy = dds.ParameterServerStrategy(c)
        coordinator = dds.ClusterCoordinator(strategy)
        with strategy.scope():
            var = dds.Variable(initial_value=[0.0], shape=[1], dtype="f4", name="var",
                               per_worker_variable=True)
        assert isinstance(var, PerWorkerVariable) and isinstance(var, dds.Variable)
        assert (var.trainable, var.shape, var.ps_address) == (False, (1,), None)
        for i in range(4):
            coordinator.schedule(_per_worker_step, args=(var,))
            coordinator.join()
            assert sum(var.read_all()).tolist() == [i + 1]
        for _ in range(6):
            coordinator.schedule(_per_worker_step, args=(var,))
        coordinator.join()
        copies = var.read_all()
        assert len(copies) == 2 and sum(copies).tolist() == [10.0]
        assert all(c.dtype == np.float32 for c in copies)
        assert var.numpy().tolist() == [0.0]  # the coordinator's copy is its own
        var.assign_add([5.0])
        assert var.numpy().tolist() == [5.0] and sum(var.read_all()).tolist() == [10.0]
        # the function's own copy is what it reads, and one comes back as the live variable
        assert coordinator.schedule(lambda: var.numpy().tolist()).fetch() in ([c.tolist() for c in copies])
        with pytest.raises(ValueError, match="created on the coordinator"):
            coordinator.schedule(_make_per_worker, args=(strategy,)).fetch()
        coordinator.shutdown()

    await in_thread(s, body)


def _make_per_worker(strategy):
    with strategy.scope():
        return dds.Variable(0.0, per_worker_variable=True)


def _create_vars(strategy):
    with strategy.scope():
        v1 = dds.Variable(np.array([[1.0, 0.0], [0.0, 1.0]], "f4"))
        v2 = dds.Variable(lambda: np.eye(2, dtype="f4"))
        v3 = dds.Variable(lambda shape, dtype: np.eye(*shape, dtype=dtype), shape=(2, 2),
                          dtype="f4")
        v1.assign_add(np.ones((2, 2), "f4"))
    return v1, v2, v3


@gen_cluster(client=False, nthreads=[PS, PS, WK, WK])
async def test_variables_created_in_a_scheduled_function_are_placed_on_the_ps(s, p0, p1, w0, w1):
    """Variables created in the strategy's scope inside a scheduled function are partitioned
    and placed on the parameter servers, as TensorFlow places those created inside a
    tf.function; each call creates its own, and the handles come back to the coordinator.
    A function run again on another worker (what the coordinator does when a worker dies:
    the same closure, same id) finds the variables of its first run, and their updates
    count once.

    Re-expresses tensorflow/python/distribute/parameter_server_strategy_v2_test.py
    (VariablePartitioningTest.testCreateInsideTFFunction).
    """
    def body(c):
        strategy = dds.ParameterServerStrategy(
            c, variable_partitioner=dds.partitioners.FixedShardsPartitioner(2))
        coordinator = dds.ClusterCoordinator(strategy)
        first = coordinator.schedule(_create_vars, args=(strategy,)).fetch()
        second = coordinator.schedule(_create_vars, args=(strategy,)).fetch()
        for v in (*first, *second):
            assert isinstance(v, dds.ShardedVariable) and len(v.variables) == 2
            assert [p.device for p in v.variables] == [
                "/job:ps/replica:0/task:0/device:CPU:0", "/job:ps/replica:0/task:1/device:CPU:0"]
        assert [v.numpy().tolist() for v in first] == [[[2.0, 1.0], [1.0, 2.0]],
                                                     [[1.0, 0.0], [0.0, 1.0]],
                                                     [[1.0, 0.0], [0.0, 1.0]]]
        assert len({p.key for v in (*first, *second) for p in v.variables}) == 12
        assert strategy._variables == []  # the coordinator's list: only its own
        # the same closure run on w0, then again on w1 (a re-run after a worker loss)
        payload = cloudpickle.dumps([((1234 << 32) + 1, _create_vars, (strategy,), {})])
        runs = [c.sync(c.rpc(w).ps_run_closures, payload=payload, coordinator=1234,
                       generation=0) for w in (w0.address, w1.address)]
        (ok0, v0), (ok1, v1) = (r["results"][0] for r in runs)
        assert ok0 and ok1
        again, rerun = cloudpickle.loads(v0), cloudpickle.loads(v1)
        assert [p.key for v in again for p in v.variables] == \
            [p.key for v in rerun for p in v.variables]
        assert again[0].numpy().tolist() == [[2.0, 1.0], [1.0, 2.0]]  # assign_add counted once
        held = {k for a in strategy.ps_addresses for k in c.sync(c.rpc(a).ps_info)["shards"]}
        assert len(held) == 18  # 6 variables of 2 shards: the re-run made none
        coordinator.shutdown()

    await in_thread(s, body)


Pair = namedtuple("Pair", "plus minus")


def _replica_fn(x, v):
    return x + v.numpy(), x - v.numpy()


def _worker_fn(strategy, v, x):
    run_result = strategy.run(_replica_fn, args=(x, v))
    reduced = strategy.reduce("SUM", run_result, axis=None)
    nested = strategy.reduce(dds.ps.strategy.ReduceOp.MEAN,
                             {"pair": Pair(np.array([1.0, 3.0]), None), "list": [np.array([[1.0], [2.0]])]},
                             axis=0)
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync))
    return reduced, nested, strategy.experimental_local_results(value)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@gen_cluster(client=False, nthreads=[PS, WK])
async def test_run_and_reduce_nested_values_and_warn_outside_schedule(s, p0, w0):
    """``strategy.reduce`` maps over nested structures; ``run`` and ``reduce`` called
    outside a scheduled function log TensorFlow's warning (every call), and not inside one.

    Re-expresses tensorflow/python/distribute/coordinator/cluster_coordinator_test.py
    (StrategyIntegrationTest.testRunAndReduce, testRunNotUsedWithClusterCoordinatorSchedule)
    and parameter_server_strategy_v2_test.py (testRunNotUsedWithClusterCoordinator,
    testReduceNotUsedWithClusterCoordinator).
    """
    def body(c):
        strategy = dds.ParameterServerStrategy(c)
        coordinator = dds.ClusterCoordinator(strategy)
        with strategy.scope():
            v = dds.Variable(initial_value=1.0)
        logged = _Records()
        logger = logging.getLogger(STRATEGY_LOG)
        logger.addHandler(logged)
        try:
            reduced, nested, local = coordinator.schedule(
                _worker_fn, args=(strategy, v, np.float64(3.0))).fetch()
            assert logged.messages == []  # inside a scheduled function: no warning
            assert tuple(x.tolist() for x in reduced) == (4.0, 2.0)
            assert nested["pair"].plus.tolist() == 2.0 and nested["pair"].minus is None
            assert isinstance(nested["pair"], Pair) and nested["list"][0].tolist() == [1.5]
            assert local == ((0, 1),)
            assert strategy.run(_replica_fn, args=(np.float64(1.0), v)) == (2.0, 0.0)
            assert strategy.reduce("SUM", None, axis=None) is None
            strategy.run(lambda: None)
        finally:
            logger.removeHandler(logged)
        assert logged.messages == [NOT_SCHEDULED_WARNING.format(method=m)
                                   for m in ("run", "reduce", "run")]
        with pytest.raises(ValueError, match="reduce_op must be ReduceOp.SUM or ReduceOp.MEAN"):
            strategy.reduce("MAX", 1.0)
        with pytest.raises(TypeError, match="value_fn must be callable"):
            strategy.experimental_distribute_values_from_function(3)
        assert repr(ValueContext()) == "ValueContext(replica_id_in_sync_group=0, num_replicas_in_sync=1)"
        coordinator.shutdown()

    await in_thread(s, body)

