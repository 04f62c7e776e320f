"""TensorFlow's cluster setup on Dask: ``ClusterSpec``, cluster resolvers, ``TF_CONFIG``, ``Server``.

What a TensorFlow cluster spec means here
-----------------------------------------
TensorFlow names every task of a parameter-server cluster in a *cluster spec*: one ``chief``
(the coordinator), the ``ps`` tasks and the ``worker`` tasks, each at a ``host:port``
(``TF_CONFIG`` carries the spec and says which task the process is). On Dask:

- the ``chief``'s ``host:port`` is the **Dask scheduler's** address, and the chief process is
  the coordinator (the process holding the ``distributed.Client``). A chief that finds no
  scheduler there starts one, in its own process (``ParameterServerStrategy(cluster_resolver=
  ...)`` on the chief does it); a scheduler already listening there (``dask scheduler --port
  2222``) is used as it is;
- each ``ps`` task is a **Dask worker listening at that address** with the resource ``ps``
  (``dataservice.ps.resource``), named ``/job:ps/task:<i>``; ``ps`` task *i* holds variables
  placed on ``/job:ps/replica:0/task:<i>``;
- each ``worker`` task is a Dask worker listening at that address with the resource
  ``worker`` (``dataservice.ps.worker-resource``), so that only the listed workers train;
- the ``rpc_layer`` (``"grpc"``) is ignored: Dask's own ``tcp://`` carries everything
  (``"tcp"``, ``"tls"``, ``"ws"``, ``"wss"`` and ``"ucx"`` are used as given).

The ``ps`` and ``worker`` tasks start with :class:`Server` (TensorFlow's
``tf.distribute.Server``), which starts that Dask worker in the process and waits for the
scheduler; a worker started otherwise (``dask worker tcp://chief:2222 --listen-address
tcp://ps0:2222``) is found by its address and given the resource by the strategy.
The strategy waits up to ``timeout`` seconds for every listed task, then raises TimeoutError
naming the tasks missing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

from distributed import Client, Scheduler, Worker
from distributed.utils import LoopRunner, sync

from .. import config

logger = logging.getLogger(__name__)

__all__ = ["ClusterSpec", "ClusterResolver", "SimpleClusterResolver", "TFConfigClusterResolver",
           "Server", "connect", "resolver_from_environment", "task_name", "validate"]

#: The task types a parameter-server cluster may have (TensorFlow's list).
TASK_TYPES = ("chief", "worker", "ps", "evaluator")

#: Dask protocols an ``rpc_layer`` may name; any other (``grpc``, ...) means ``tcp``.
_DASK_PROTOCOLS = ("tcp", "tls", "ws", "wss", "ucx")


class ClusterSpec:
    """The tasks of a cluster by job: ``{"ps": ["host:port", ...], "worker": [...]}``
    (TensorFlow's ``tf.train.ClusterSpec``). A job's tasks are a list (indices 0, 1, ...)
    or a dict ``{index: address}``."""

    def __init__(self, cluster: ClusterSpec | Mapping[str, Any] | None = None) -> None:
        if isinstance(cluster, ClusterSpec):
            self._jobs: dict[str, dict[int, str]] = {j: dict(t) for j, t in cluster._jobs.items()}
            return
        if cluster is None:
            cluster = {}
        if not isinstance(cluster, Mapping):
            raise TypeError("ClusterSpec takes a dict {job name: [addresses] or {index: "
                            f"address}} or a ClusterSpec, got {type(cluster).__name__}")
        self._jobs = {}
        for job, tasks in cluster.items():
            if isinstance(tasks, Mapping):
                self._jobs[str(job)] = {int(i): str(a) for i, a in tasks.items()}
            elif isinstance(tasks, list | tuple):
                self._jobs[str(job)] = {i: str(a) for i, a in enumerate(tasks)}
            else:
                raise TypeError(f"the tasks of job {job!r} must be a list or a dict, got "
                                f"{type(tasks).__name__}")

    @property
    def jobs(self) -> list[str]:
        return list(self._jobs)

    def as_dict(self) -> dict[str, list[str] | dict[int, str]]:
        """Each job's addresses: a list when its indices are 0..n-1, else ``{index: address}``."""
        out: dict[str, list[str] | dict[int, str]] = {}
        for job, tasks in self._jobs.items():
            dense = sorted(tasks) == list(range(len(tasks)))
            out[job] = [tasks[i] for i in range(len(tasks))] if dense else dict(tasks)
        return out

    def num_tasks(self, job_name: str) -> int:
        return len(self._tasks(job_name))

    def task_indices(self, job_name: str) -> list[int]:
        return sorted(self._tasks(job_name))

    def task_address(self, job_name: str, task_index: int) -> str:
        tasks = self._tasks(job_name)
        if task_index not in tasks:
            raise ValueError(f"no task with index {task_index} in job {job_name!r}")
        return tasks[task_index]

    def job_tasks(self, job_name: str) -> list[str | None]:
        """The job's addresses by index (``None`` for an index not given)."""
        tasks = self._tasks(job_name)
        return [tasks.get(i) for i in range(max(tasks) + 1)] if tasks else []

    def _tasks(self, job_name: str) -> dict[int, str]:
        if job_name not in self._jobs:
            raise ValueError(f"no such job in cluster: {job_name!r}")
        return self._jobs[job_name]

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterSpec) and self._jobs == other._jobs

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"


def _format_master(address: str, rpc_layer: str | None) -> str:
    return f"{rpc_layer}://{address}" if rpc_layer and address else address


class ClusterResolver:
    """What a cluster resolver gives (TensorFlow's ``ClusterResolver``): the cluster spec,
    and which task this process is (``task_type``, ``task_id``)."""

    task_type: str | None
    task_id: int | None
    rpc_layer: str | None

    def cluster_spec(self) -> ClusterSpec:
        raise NotImplementedError

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """The address of task ``task_type``/``task_id`` (default: this task), prefixed by
        ``rpc_layer://`` when there is one; ``""`` when the task is unknown."""
        task_type = task_type if task_type is not None else self.task_type
        task_id = task_id if task_id is not None else self.task_id
        if task_type is None or task_id is None:
            return ""
        address = self.cluster_spec().task_address(task_type, task_id)
        return _format_master(address, rpc_layer or self.rpc_layer)

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto: Any = None) -> dict[str, int]:
        """Accelerators by type: none (numpy on CPUs)."""
        return {}

    @property
    def environment(self) -> str:
        return ""


class SimpleClusterResolver(ClusterResolver):
    """A resolver that answers what it is given (TensorFlow's ``SimpleClusterResolver``)."""

    def __init__(self, cluster_spec: ClusterSpec | Mapping[str, Any], master: str = "",
                 task_type: str | None = None, task_id: int | None = None,
                 environment: str = "", num_accelerators: dict[str, int] | None = None,
                 rpc_layer: str | None = None) -> None:
        self._cluster_spec = ClusterSpec(cluster_spec)
        self._master = master
        self.task_type = task_type
        self.task_id = task_id
        self._environment = environment
        self._num_accelerators = dict(num_accelerators or {})
        self.rpc_layer = rpc_layer

    def cluster_spec(self) -> ClusterSpec:
        return self._cluster_spec

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        if task_type is not None and task_id is not None:
            return super().master(task_type, task_id, rpc_layer)
        return _format_master(self._master, rpc_layer or self.rpc_layer)

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto: Any = None) -> dict[str, int]:
        return dict(self._num_accelerators)

    @property
    def environment(self) -> str:
        return self._environment


class TFConfigClusterResolver(ClusterResolver):
    """The cluster and this task from the ``TF_CONFIG`` environment variable (JSON), read at
    each call as TensorFlow does: ``{"cluster": {...}, "task": {"type": "ps", "index": 1},
    "rpc_layer": "grpc"}``. ``task_type``, ``task_id`` and ``rpc_layer`` given here (or set
    later) override it."""

    def __init__(self, task_type: str | None = None, task_id: int | None = None,
                 rpc_layer: str | None = None, environment: str | None = None) -> None:
        self._task_type = task_type
        self._task_id = task_id
        self._rpc_layer = rpc_layer
        self._environment = environment

    @staticmethod
    def _config() -> dict[str, Any]:
        raw = os.environ.get("TF_CONFIG", "")
        if not raw.strip():
            return {}
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"TF_CONFIG is not valid JSON: {e}") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"TF_CONFIG must be a JSON object, got {type(parsed).__name__}")
        return parsed

    def cluster_spec(self) -> ClusterSpec:
        return ClusterSpec(self._config().get("cluster") or {})

    @property
    def task_type(self) -> str | None:
        if self._task_type is not None:
            return self._task_type
        task = self._config().get("task") or {}
        return None if task.get("type") is None else str(task["type"])

    @task_type.setter
    def task_type(self, value: str | None) -> None:
        self._task_type = value

    @property
    def task_id(self) -> int | None:
        if self._task_id is not None:
            return self._task_id
        task = self._config().get("task") or {}
        return None if task.get("index") is None else int(task["index"])

    @task_id.setter
    def task_id(self, value: int | None) -> None:
        self._task_id = value

    @property
    def rpc_layer(self) -> str | None:
        if self._rpc_layer is not None:
            return self._rpc_layer
        layer = self._config().get("rpc_layer")
        return None if layer is None else str(layer)

    @rpc_layer.setter
    def rpc_layer(self, value: str | None) -> None:
        self._rpc_layer = value

    @property
    def environment(self) -> str:
        if self._environment is not None:
            return self._environment
        return str(self._config().get("environment", ""))

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        if task_type is None and task_id is None:
            session_master = self._config().get("session_master")
            if session_master:
                return _format_master(str(session_master), rpc_layer or self.rpc_layer)
        return super().master(task_type, task_id, rpc_layer)


# ---------------------------------------------------------------------------------------
# the cluster spec on Dask
# ---------------------------------------------------------------------------------------


def validate(resolver: ClusterResolver) -> ClusterSpec:
    """The resolver's cluster spec, checked as TensorFlow checks it for this strategy."""
    if not isinstance(resolver, ClusterResolver):
        raise TypeError("cluster_resolver must be a ClusterResolver (TFConfigClusterResolver, "
                        f"SimpleClusterResolver), got {type(resolver).__name__}")
    spec = resolver.cluster_spec()
    if not spec:
        raise ValueError("Cluster spec must be non-empty in the ClusterResolver (is TF_CONFIG "
                         "set, with a \"cluster\"?)")
    bad = [j for j in spec.jobs if j not in TASK_TYPES]
    if bad:
        raise ValueError(f"Disallowed task type found in cluster spec: {bad} (allowed: "
                         f"{list(TASK_TYPES)})")
    task_type, task_id = resolver.task_type, resolver.task_id
    if task_type is not None and task_type not in TASK_TYPES:
        raise ValueError(f"Unrecognized task_type: {task_type}")
    if "chief" in spec.jobs and spec.num_tasks("chief") > 1:
        raise ValueError("There must be at most one 'chief' job.")
    if task_type is not None and task_id is not None and task_type in spec.jobs \
            and task_id not in spec.task_indices(task_type):
        raise ValueError(f"task_id {task_id} is out of range for task_type {task_type!r} "
                         f"({spec.num_tasks(task_type)} tasks)")
    if "ps" not in spec.jobs or spec.num_tasks("ps") < 1:
        raise ValueError("There must be at least one ps.")
    if "worker" not in spec.jobs or spec.num_tasks("worker") < 1:
        raise ValueError("There must be at least one worker.")
    if "chief" not in spec.jobs:
        raise ValueError("The cluster spec has no 'chief' task: on Dask the chief's address "
                         "is the scheduler's (the chief runs the scheduler and the "
                         "coordinator); add \"chief\": [\"host:port\"]")
    return spec


def _protocol(rpc_layer: str | None) -> str:
    return rpc_layer if rpc_layer in _DASK_PROTOCOLS else "tcp"


def _host_port(address: str) -> tuple[str, int]:
    if "://" in address:
        address = address.split("://", 1)[1]
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"a task address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def _normal(address: str) -> tuple[str, int]:
    """``(ip, port)`` of an address: names resolved, so ``localhost:1`` is ``127.0.0.1:1``."""
    host, port = _host_port(address)
    try:
        host = socket.gethostbyname(host)
    except OSError:
        pass
    return host, port


def task_name(job_name: str, task_index: int) -> str:
    """The Dask worker name of a task: ``/job:ps/task:0``."""
    return f"/job:{job_name}/task:{task_index}"


class Server:
    """One task of a TensorFlow cluster spec, on Dask (``tf.distribute.Server``).

    A ``ps`` or ``worker`` task starts a Dask worker listening at the task's address, named
    ``/job:<type>/task:<index>``, with the resource ``ps`` or ``worker``, connected to the
    scheduler at the chief's address (it waits for it); a ``chief`` task starts the
    scheduler. The process keeps serving until :meth:`join` returns (the worker or scheduler
    closed) or :meth:`stop` is called.

    Parameters
    ----------
    server_or_cluster_def : ClusterSpec, dict or ClusterResolver
        The cluster; a resolver also gives ``job_name`` and ``task_index`` when they are
        not given.
    job_name, task_index : str, int
        Which task this process is.
    protocol : str, optional
        Ignored unless a Dask protocol (``tcp``, ``tls``, ...); ``grpc`` means ``tcp``.
    config : dict, optional
        Extra keyword arguments for ``distributed.Worker`` (or ``Scheduler``), e.g.
        ``{"nthreads": 4}``.
    start : bool
        Start now (else call :meth:`start`).
    """

    def __init__(self, server_or_cluster_def: ClusterSpec | Mapping[str, Any] | ClusterResolver,
                 job_name: str | None = None, task_index: int | None = None,
                 protocol: str | None = None, config: dict[str, Any] | None = None,
                 start: bool = True) -> None:
        if isinstance(server_or_cluster_def, ClusterResolver):
            resolver = server_or_cluster_def
            spec = resolver.cluster_spec()
            job_name = job_name if job_name is not None else resolver.task_type
            task_index = task_index if task_index is not None else resolver.task_id
            protocol = protocol or resolver.rpc_layer
        else:
            spec = ClusterSpec(server_or_cluster_def)
        if job_name is None:
            raise ValueError("job_name must be given (or a resolver that knows the task type)")
        if job_name not in ("chief", "ps", "worker"):
            raise ValueError(f"a Server runs a 'chief', 'ps' or 'worker' task, got {job_name!r} "
                             "(an evaluator runs dask_dataservice.SidecarEvaluator)")
        if "chief" not in spec.jobs:
            raise ValueError("The cluster spec has no 'chief' task: on Dask the chief's "
                             "address is the scheduler's")
        self.job_name = job_name
        self.task_index = int(task_index or 0)
        self._proto = _protocol(protocol)
        self._address = spec.task_address(job_name, self.task_index)
        self._scheduler_address = f"{self._proto}://{spec.task_address('chief', 0)}"
        self._options = dict(config or {})
        self._runner: LoopRunner | None = None
        self._node: Scheduler | Worker | None = None
        self._starting: asyncio.Future[Any] | None = None
        if start:
            self.start()

    @property
    def target(self) -> str:
        """The address this task listens at (``tcp://host:port``)."""
        return f"{self._proto}://{self._address}"

    @property
    def scheduler_address(self) -> str:
        return self._scheduler_address

    def start(self) -> None:
        """Start the task's scheduler or worker on an event loop thread of its own."""
        if self._node is not None:
            return
        runner = LoopRunner(asynchronous=False)
        runner.start()
        try:
            self._node = sync(runner.loop, self._start_node)
        except BaseException:
            runner.stop()
            raise
        self._runner = runner

    async def _start_node(self) -> Scheduler | Worker:
        host, port = _host_port(self._address)
        if self.job_name == "chief":
            options = {"dashboard_address": ":0", **self._options}
            scheduler = Scheduler(host=host, port=port, protocol=self._proto, **options)
            await scheduler
            return scheduler
        resource = config.get("ps.resource" if self.job_name == "ps" else "ps.worker-resource")
        options = {"nthreads": 1, **self._options}
        resources = {**options.pop("resources", {}), resource: 1}
        worker = Worker(self._scheduler_address, host=host, port=port, protocol=self._proto,
                        name=task_name(self.job_name, self.task_index), resources=resources,
                        **options)
        # A TensorFlow server starts whether or not the chief is up: return once the
        # worker listens; it keeps waiting for the scheduler in this task (owned: stop()).
        self._starting = asyncio.ensure_future(worker.start())
        while not self._starting.done() and not worker.listeners:
            await asyncio.sleep(0.005)
        if self._starting.done():
            self._starting.result()  # the error that stopped it (the port is taken, ...)
        return worker

    async def _close_node(self, node: Scheduler | Worker) -> None:
        starting, self._starting = self._starting, None
        if starting is not None and not starting.done():
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
        await node.close()

    def join(self) -> None:
        """Block until the task's scheduler or worker closes."""
        node, runner = self._node, self._runner
        if node is None or runner is None:
            raise RuntimeError("the server is not started")
        sync(runner.loop, node.finished)

    def stop(self) -> None:
        """Close the scheduler or worker and the event loop thread."""
        node, runner = self._node, self._runner
        self._node = self._runner = None
        if runner is None or node is None:
            return
        try:
            sync(runner.loop, self._close_node, node)
        finally:
            runner.stop()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<dds.Server {task_name(self.job_name, self.task_index)} at {self.target}>"


class Connection:
    """A client of the cluster a resolver names, and what the strategy opened for it."""

    def __init__(self, client: Client, ps: list[str], workers: list[str],
                 server: Server | None) -> None:
        self.client = client
        #: Dask addresses of the ``ps`` tasks and of the ``worker`` tasks, by task index.
        self.ps = ps
        self.workers = workers
        self._server = server

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            if self._server is not None:
                self._server.stop()


def connect(resolver: ClusterResolver, timeout: float = 60.0) -> Connection:
    """Connect to the Dask cluster ``resolver`` names (see the module doc): start the
    scheduler when this process is the chief and none listens there, wait up to ``timeout``
    seconds for every ``ps`` and ``worker`` task, give them their resources."""
    spec = validate(resolver)
    proto = _protocol(resolver.rpc_layer)
    address = f"{proto}://{spec.task_address('chief', 0)}"
    server = None
    if resolver.task_type == "chief" and not _listening(spec.task_address("chief", 0)):
        server = Server(spec, "chief", 0, protocol=proto)
    try:
        client = Client(address, timeout=timeout, set_as_default=False)
    except BaseException:
        if server is not None:
            server.stop()
        raise
    try:
        ps, workers = _wait_for_tasks(client, address, spec, timeout)
        _give_resources(client, ps, config.get("ps.resource"))
        _give_resources(client, workers, config.get("ps.worker-resource"))
    except BaseException:
        client.close()
        if server is not None:
            server.stop()
        raise
    return Connection(client, ps, workers, server)


def _listening(address: str) -> bool:
    """Whether something accepts connections at ``host:port`` (a scheduler started already)."""
    try:
        with socket.create_connection(_host_port(address), timeout=1.0):
            return True
    except OSError:
        return False


def _wait_for_tasks(client: Client, address: str, spec: ClusterSpec,
                    timeout: float) -> tuple[list[str], list[str]]:
    want = {(job, i): _normal(spec.task_address(job, i))
            for job in ("ps", "worker") for i in spec.task_indices(job)}
    deadline = time.monotonic() + timeout
    while True:
        info = client.scheduler_info(n_workers=-1)
        listed = {_normal(a): a for a in info.get("workers", {})}
        missing = [task for task, where in want.items() if where not in listed]
        if not missing:
            break
        if time.monotonic() > deadline:
            names = ", ".join(f"{task_name(j, i)} ({spec.task_address(j, i)})"
                              for j, i in missing)
            raise TimeoutError(f"{len(missing)} task(s) of the cluster spec did not join the "
                               f"scheduler at {address} within {timeout:g} "
                               f"s: {names}")
        time.sleep(0.05)
    found = {task: listed[where] for task, where in want.items()}
    return ([found["ps", i] for i in spec.task_indices("ps")],
            [found["worker", i] for i in spec.task_indices("worker")])


async def _set_resource(dask_worker: Worker, resource: str) -> None:
    await dask_worker.set_resources(**{resource: 1})


def _give_resources(client: Client, addresses: list[str], resource: str) -> None:
    info = client.scheduler_info(n_workers=-1)["workers"]
    lacking = [a for a in addresses if not (info[a].get("resources") or {}).get(resource)]
    if lacking:
        logger.info("giving the resource %r to %s", resource, lacking)
        client.run(_set_resource, resource=resource, workers=lacking)


def resolver_from_environment() -> TFConfigClusterResolver | None:
    """A TFConfigClusterResolver when ``TF_CONFIG`` names a cluster, else None."""
    resolver = TFConfigClusterResolver()
    return resolver if resolver.cluster_spec() else None
