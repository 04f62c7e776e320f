"""A client host of the multi-host tier: ``python _agent.py SCHEDULER`` in a namespace.

It connects a ``distributed.Client`` (TLS when ``DDS_AGENT_TLS`` holds the certificate files
as JSON), prints ``{"ready": ...}``, then answers commands: one JSON line on stdin
(``{"op": NAME, ...}``), one JSON line on stdout (the reply; ``{"error": ...}`` with the
traceback if the command raised). A read runs in a thread of its own (``read`` starts it,
``progress`` counts what arrived, ``result`` waits for its end), so the test can look at the
cluster and change the network while it goes on. The state it keeps between commands (the
strategy, variables, datasets) lives in ``STATE``.

Run by the tests of tests/multihost/ (see _netns.Network.agent); not a test module.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any

import numpy as np
from distributed import Client
from distributed.security import Security

import dask_dataservice as dds

STATE: dict[str, Any] = {"reads": {}}


class _Log(logging.Handler):
    """The package's log records (INFO and up), for ``op_log``."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


LOG = _Log()


def op_log(client: Client, contains: str) -> dict[str, Any]:
    """The log lines of the package in this process that contain ``contains``."""
    return {"lines": [line for line in LOG.lines if contains in line]}


def _client(address: str) -> Client:
    tls = os.environ.get("DDS_AGENT_TLS")
    security = None
    if tls:
        files = json.loads(tls)
        security = Security(tls_ca_file=files["ca"], tls_client_cert=files["cert"],
                            tls_client_key=files["key"], require_encryption=True)
    return Client(address, security=security, timeout="60s", set_as_default=False)


# -- datasets ---------------------------------------------------------------------------------


def _dataset(kind: str, n: int, size: int = 0, slow_host: str = "", delay: float = 0.0):
    ds = dds.Dataset.range(n)
    if kind == "arrays":  # compressible elements (zeros) with their index
        def element(i, size=size):
            import numpy

            return i, numpy.zeros(size, "f4")

        ds = ds.map(element)
    elif kind == "slow":  # slower on one host, so that it is mid-split when it is cut off
        def slow(i, slow_host=slow_host, delay=delay):
            import os
            import time

            if slow_host in ("*", os.environ.get("DDS_HOST")):
                time.sleep(delay)
            return i

        ds = ds.map(slow)
    return ds


def op_register(client: Client, kind: str, n: int, compression: str | None = "AUTO",
                **kwargs: Any) -> dict[str, Any]:
    dataset_id = dds.register_dataset(client, _dataset(kind, n, **kwargs),
                                      compression=compression)
    STATE.setdefault("splits", {})[str(dataset_id)] = [
        [s.start, s.stop] for s in _dataset(kind, n, **kwargs).splits()
    ] if kind != "arrays" else None
    return {"dataset_id": dataset_id}


def _element_index(x: Any) -> int:
    return int(x[0]) if isinstance(x, tuple) else int(x)


def op_read(client: Client, name: str, dataset_id: Any, mode: str = "distributed_epoch",
            **kwargs: Any) -> dict[str, Any]:
    """Start reading ``dataset_id`` in a thread (``kwargs``: from_dataset_id's)."""
    ds = dds.from_dataset_id(mode, client, dataset_id, **kwargs)
    read = {"ds": ds, "elements": [], "error": None, "done": threading.Event()}

    def run() -> None:
        try:
            for x in ds:
                read["elements"].append(_element_index(x))
        except BaseException as e:  # noqa: BLE001 - reported to the test
            read["error"] = f"{type(e).__name__}: {e}"
        finally:
            read["done"].set()

    read["thread"] = threading.Thread(target=run, name=f"read-{name}", daemon=True)
    STATE["reads"][name] = read
    read["thread"].start()
    return {"started": name}


def op_progress(client: Client, name: str) -> dict[str, Any]:
    read = STATE["reads"][name]
    return {"count": len(read["elements"]), "done": read["done"].is_set()}


def op_result(client: Client, name: str, timeout: float = 60) -> dict[str, Any]:
    read = STATE["reads"].pop(name)
    if not read["done"].wait(timeout):
        return {"timed_out": True, "count": len(read["elements"])}
    read["thread"].join()
    stats = read["ds"].stats()
    return {"elements": read["elements"], "read_error": read["error"],
            "workers": {a: w["elements"] for a, w in stats.get("workers", {}).items()}}


# -- the cluster as the service sees it -------------------------------------------------------


def op_workers(client: Client, n: int, timeout: float = 60) -> dict[str, Any]:
    client.wait_for_workers(n, timeout=timeout)
    info = client.scheduler_info(n_workers=-1)["workers"]
    return {"workers": {a: w.get("name") for a, w in info.items()}}


def _worker_stats(dask_worker: Any) -> dict[str, Any]:
    plugin = dask_worker.extensions.get("dataservice")
    if plugin is None:
        return {}
    return {**plugin.stats, "element_port": plugin._port.port}


def op_worker_stats(client: Client, workers: list[str] | None = None) -> dict[str, Any]:
    return {"stats": client.run(_worker_stats, workers=workers)}


def _dispatcher(dask_scheduler: Any) -> dict[str, Any]:
    plugin = dask_scheduler.plugins["dataservice-dispatcher"]
    state = plugin.state
    iterations = []
    for it in state.list_iterations():
        tasks = [{"task_id": t.task_id, "worker": t.worker_address,
                  "splits": [list(s) for s in state.task_splits(t.task_id)]}
                 for t in state.tasks_for_iteration(it.iteration_id)]
        iterations.append({"iteration_id": it.iteration_id, "tasks": tasks,
                           "lost": [list(s) for s in state.lost_splits(it.iteration_id)]})
    return {"workers": sorted(w.address for w in state.list_workers()),
            "dropped": sorted(plugin._liveness.dropped), "iterations": iterations,
            "dask_workers": sorted(dask_scheduler.workers)}


def op_dispatcher(client: Client) -> dict[str, Any]:
    return client.run_on_scheduler(_dispatcher)


def op_splits(client: Client, dataset_id: Any) -> dict[str, Any]:
    return {"splits": STATE["splits"][str(dataset_id)]}


def op_codecs(client: Client, workers: list[str]) -> dict[str, Any]:
    """The codecs this reader offers each worker (what the reader itself computes)."""
    from dask_dataservice.service.client._reader import _local_host
    from dask_dataservice.service.protocol._frames import reader_codecs

    local = _local_host(client.scheduler.address)
    return {"local_host": local, "codecs": {w: reader_codecs(w, local) for w in workers}}


def _worker_state(dask_worker: Any) -> dict[str, Any]:
    plugin = dask_worker.extensions.get("dataservice")
    state = plugin.worker_state()
    return {"tasks": sorted(state["tasks"]), "finished": sorted(state["finished_tasks"])}


def op_worker_tasks(client: Client, worker: str) -> dict[str, Any]:
    return client.run(_worker_state, workers=[worker])[worker]


def op_get_elements(client: Client, worker: str, task_id: int) -> dict[str, Any]:
    reply = client.sync(client.rpc(worker).dataservice_get_elements, task_id=task_id, wait=0.1)
    return {"elements": None if reply.get("elements") is None else "some",
            "end_of_sequence": bool(reply.get("end_of_sequence")),
            "status": reply.get("status")}


# -- parameter servers ------------------------------------------------------------------------


def _fast_port(dask_worker: Any) -> Any:
    from dask_dataservice.ps.server import PLUGIN_NAME

    plugin = dask_worker.extensions.get(PLUGIN_NAME)
    return plugin.fast_port() if plugin is not None else None


def _channels(dask_worker: Any) -> dict[str, str]:
    from dask_dataservice.ps._runner_plugin import RUNNER_NAME

    runner = dask_worker.extensions.get(RUNNER_NAME)
    if runner is None:
        return {}
    return {a: type(ch).__name__ for a, ch in runner.channels.items()}


def op_strategy(client: Client, rows: int = 8) -> dict[str, Any]:
    """A strategy, a coordinator, and two variables: one per PS (round robin)."""
    strategy = dds.ParameterServerStrategy(client)
    coord = dds.ClusterCoordinator(strategy)
    with strategy.scope():
        counter = dds.Variable(0, dtype="i8", name="counter")
        table = dds.Variable(np.zeros((rows, 2), "f8"), name="table")
    STATE.update(strategy=strategy, coord=coord, counter=counter, table=table)
    placement = {v.name: getattr(v, "ps_address", None) for v in (counter, table)}
    ports = client.run(_fast_port, workers=list(strategy.ps_addresses))
    return {"ps": list(strategy.ps_addresses), "ports": ports, "placement": placement}


def op_train(client: Client, steps: int, start: int = 0) -> dict[str, Any]:
    """``steps`` scheduled steps: each adds 1 to the counter and ``[1, i]`` to row ``i % rows``;
    the values every exactly-once run ends with are the test's to compute."""
    coord, counter, table = STATE["coord"], STATE["counter"], STATE["table"]
    rows = table.shape[0]

    def step(i, counter=counter, table=table, rows=rows):
        import numpy

        counter.assign_add(1)
        table.scatter_add([i % rows], numpy.array([[1.0, float(i)]]))
        return i

    rvs = [coord.schedule(step, args=(i,)) for i in range(start, start + steps)]
    try:
        coord.join()
        error = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        error = f"{type(e).__name__}: {e}"
    STATE.setdefault("scheduled", []).extend(rvs)
    results = [rv.fetch() if rv.done() and not _failed(rv) else None for rv in rvs]
    return {"join_error": error, "results": results, "stats": dict(coord.stats)}


def _failed(rv: Any) -> bool:
    try:
        rv.fetch()
    except Exception:  # noqa: BLE001
        return True
    return False


def op_all_done(client: Client) -> dict[str, Any]:
    """Whether every function scheduled so far has finished (or failed)."""
    return {"done": all(rv.done() for rv in STATE.get("scheduled", []))}


def op_values(client: Client) -> dict[str, Any]:
    return {"counter": int(STATE["counter"].numpy()), "table": STATE["table"].numpy().tolist()}


def op_coord_stats(client: Client) -> dict[str, Any]:
    return {"stats": dict(STATE["coord"].stats)}


def op_channels(client: Client) -> dict[str, Any]:
    ps = set(STATE["strategy"].ps_addresses)
    workers = [a for a in client.scheduler_info(n_workers=-1)["workers"] if a not in ps]
    return {"channels": client.run(_channels, workers=workers)}


def op_shutdown(client: Client) -> dict[str, Any]:
    if "coord" in STATE:
        STATE.pop("coord").shutdown()
    return {"shutdown": True}


def main() -> None:
    package = logging.getLogger("dask_dataservice")
    package.addHandler(LOG)
    package.setLevel(logging.INFO)
    client = _client(sys.argv[1])
    print(json.dumps({"ready": client.scheduler.address}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        started = time.monotonic()
        try:
            op = globals()[f"op_{command.pop('op')}"]
            reply = op(client, **command)
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the test
            reply = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
        reply["seconds"] = round(time.monotonic() - started, 3)
        print(json.dumps(reply), flush=True)
    client.close()


if __name__ == "__main__":
    main()
