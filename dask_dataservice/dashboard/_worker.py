"""The worker's half of the dashboard: one handler that answers the figures of this worker.

``dataservice_figures`` reads the counters the data-worker plugin, the parameter server and the
training runner keep (their ``stats``), the tasks' buffers and the shards, and the CPU time of
the plugins' threads (every thread the package starts is named ``dds-...``). That CPU time is
also given to Dask's fine performance metrics (``worker.digest_metric``), so a worker busy with
the service is no longer idle in Dask's own accounting (see docs/dashboard.md).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from ..service.protocol._metrics import percentiles
from ..service.worker.plugin import PLUGIN_NAME as DATA_PLUGIN
from ._prometheus import register_worker, unregister_worker

__all__ = ["DashboardWorkerPlugin", "WORKER_PLUGIN_NAME", "worker_figures", "plugin_cpu_seconds",
           "cpu_delta"]

WORKER_PLUGIN_NAME = "dataservice-dashboard-worker"
_PS_PLUGIN = "dataservice-ps"
_RUNNER_PLUGIN = "dataservice-ps-runner"
#: The fine-performance-metric key under which plugin CPU time is reported to Dask.
DIGEST_KEY = ("dataservice", "plugin-threads", "thread-cpu", "seconds")
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_cpu_seconds() -> dict[int, float] | None:
    """``{native thread id: CPU seconds}`` of this process's live ``dds-*`` threads (None off
    Linux)."""
    if not os.path.isdir("/proc/self/task"):
        return None
    out: dict[int, float] = {}
    for t in threading.enumerate():
        if not t.name.startswith("dds-") or t.native_id is None:
            continue
        try:
            with open(f"/proc/self/task/{t.native_id}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:  # the thread exited meanwhile
            continue
        out[t.native_id] = (int(fields[11]) + int(fields[12])) / _TICKS  # utime + stime
    return out


def plugin_cpu_seconds() -> float | None:
    """CPU seconds used so far by this process's live ``dds-*`` threads (None off Linux)."""
    per_thread = thread_cpu_seconds()
    return None if per_thread is None else sum(per_thread.values())


def cpu_delta(previous: dict[int, float], now: dict[int, float]) -> float:
    """CPU seconds the threads used between two readings (``{thread id: seconds}``).

    Per thread: a thread seen before adds what it used since; a new thread (or a new one
    that reuses an id: its seconds went down) adds all it used; a thread that exited adds
    nothing more (what it used since the last reading is lost: the figure errs low, never
    high). So the sum over an interval never exceeds the threads' number times the interval.
    """
    delta = 0.0
    for tid, seconds in now.items():
        before = previous.get(tid, 0.0)
        delta += seconds - before if seconds >= before else seconds
    return delta


class DashboardWorkerPlugin(WorkerPlugin):
    """Adds the ``dataservice_figures`` handler (the scheduler's dashboard polls it)."""

    name = WORKER_PLUGIN_NAME
    idempotent = True

    def setup(self, worker: Any) -> None:
        self.worker = worker
        self._cpu_seen: dict[int, float] = {}
        self._cpu_total = 0.0
        worker.handlers["dataservice_figures"] = self.figures
        # the scheduler polls only workers whose heartbeat says the handler is there: a worker
        # in the scheduler's list that is still setting up its plugins would log an unknown-op
        # warning with a traceback for each poll (a user's first script showed one)
        worker.metrics[FIGURES_READY] = _ready
        register_worker(worker, worker_figures)
        from ._http_tls import secure_http

        secure_http(worker, "worker")  # issue 22: a TLS cluster's HTTP is TLS too

    def teardown(self, worker: Any) -> None:
        # a poll still in flight gets "nothing" rather than an unknown-op error in the log
        worker.handlers["dataservice_figures"] = _no_figures
        worker.metrics.pop(FIGURES_READY, None)
        unregister_worker(worker)

    def figures(self) -> dict[str, Any]:
        out = worker_figures(self.worker)
        per_thread = thread_cpu_seconds()
        if per_thread is not None:
            # per thread and per interval: a thread that exits takes its seconds with it,
            # which must not make the live threads' whole total count again
            delta = cpu_delta(self._cpu_seen, per_thread)
            self._cpu_seen = per_thread
            if delta > 0:
                self._cpu_total += delta
                self.worker.digest_metric(DIGEST_KEY, delta)
            out["plugin_cpu_seconds"] = self._cpu_total
            out["plugin_threads"] = len(per_thread)
        return out


def worker_figures(worker: Any) -> dict[str, Any]:
    """Plain data (msgpack-able) about the service's work on ``worker``."""
    out: dict[str, Any] = {"address": worker.address, "name": str(worker.name),
                           "time": time.time(), "plugin_cpu_seconds": plugin_cpu_seconds()}
    data = worker.plugins.get(DATA_PLUGIN)
    if data is not None and hasattr(data, "stats"):
        figures = getattr(data, "figures", None)
        tasks = {}
        for tid, r in list(data.tasks.items()):
            if r is None:
                continue
            buf = r.buffer
            tasks[str(tid)] = {"produced": int(buf.produced), "buffered": len(buf),
                               "buffered_bytes": int(getattr(buf, "_bytes", 0)),
                               "done": bool(buf.end_visible),
                               "job_id": int(r.task["job_id"]),
                               "iteration_id": int(r.task["iteration_id"]),
                               "ops": r.pipeline_stats.rows()
                               if hasattr(r, "pipeline_stats") else []}
        out["data"] = {
            "is_data_worker": bool(getattr(data, "is_data_worker", True)),
            "stats": {k: int(v) for k, v in data.stats.items()},
            "tasks": tasks,
            "threads": len(getattr(data, "_runners", ())),
            "finished_ops": {str(t): {"job_id": j, "iteration_id": i, "ops": rows}
                             for t, (j, i, rows) in list(getattr(figures, "finished_ops",
                                                                 {}).items())},
            "request_seconds": percentiles(getattr(figures, "request_seconds", ())),
            "served_by_task": {str(t): [int(c[0]), int(c[1])]
                               for t, c in list(getattr(data, "served_by_task", {}).items())},
            "element_port": _element_port(data),
            # issue 26: what this worker's autocache() caches hold, and its last decisions
            "autocache": data.autocache.status() if hasattr(data, "autocache") else None,
        }
    ps = worker.plugins.get(_PS_PLUGIN)
    if ps is not None and getattr(ps, "is_ps", False):
        shards = {}
        ops = getattr(ps, "shard_ops", {})
        for key in [k for k in list(ops) if k not in ps.shards]:  # deleted shards
            ops.pop(key, None)
        for key, s in list(ps.shards.items()):
            v = s.value
            counts = ops.get(key, {})
            shards[key] = {"shape": [int(d) for d in v.shape], "dtype": str(v.dtype),
                           "rows": int(v.shape[0]) if v.ndim else 1, "bytes": int(v.nbytes),
                           "optimizers": sorted(s.slots),
                           "gathers": int(counts.get("gathers", 0)),
                           "updates": int(counts.get("updates", 0))}
        out["ps"] = {"stats": {k: int(v) for k, v in ps.stats.items()}, "shards": shards}
    runner = worker.plugins.get(_RUNNER_PLUGIN)
    if runner is not None and hasattr(runner, "stats"):
        out["runner"] = {"stats": {k: int(v) for k, v in runner.stats.items()}}
    return out


#: the heartbeat metric (``WorkerState.metrics``) that says ``dataservice_figures`` answers
FIGURES_READY = "dataservice_figures_ready"


def _ready(worker: Any) -> bool:
    return True


def _no_figures() -> None:
    return None


def _element_port(data: Any) -> dict[str, int] | None:
    """The element port's figures (issue 25): None where the worker has none (TLS,
    in-process, ``worker.fast-path`` off)."""
    server = getattr(getattr(data, "_port", None), "server", None)
    if server is None:
        return None
    return {"port": int(server.port or 0), "connections": int(server.connections),
            "requests": int(server.answered)}
