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

from ..service.worker.plugin import PLUGIN_NAME as DATA_PLUGIN
from ._prometheus import register_worker, unregister_worker

__all__ = ["DashboardWorkerPlugin", "WORKER_PLUGIN_NAME", "worker_figures", "plugin_cpu_seconds"]

WORKER_PLUGIN_NAME = "dataservice-dashboard-worker"
_PS_PLUGIN = "dataservice-ps"
_RUNNER_PLUGIN = "dataservice-ps-runner"
#: The fine-performance-metric key under which plugin CPU time is reported to Dask.
DIGEST_KEY = ("dataservice", "plugin-threads", "thread-cpu", "seconds")
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def plugin_cpu_seconds() -> float | None:
    """CPU seconds used so far by this process's live ``dds-*`` threads (None off Linux)."""
    if not os.path.isdir("/proc/self/task"):
        return None
    total = 0.0
    for t in threading.enumerate():
        if not t.name.startswith("dds-") or t.native_id is None:
            continue
        try:
            with open(f"/proc/self/task/{t.native_id}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:  # the thread exited meanwhile
            continue
        total += (int(fields[11]) + int(fields[12])) / _TICKS  # utime + stime
    return total


class DashboardWorkerPlugin(WorkerPlugin):
    """Adds the ``dataservice_figures`` handler (the scheduler's dashboard polls it)."""

    name = WORKER_PLUGIN_NAME
    idempotent = True

    def setup(self, worker: Any) -> None:
        self.worker = worker
        self._cpu_seen = 0.0
        self._cpu_total = 0.0
        worker.handlers["dataservice_figures"] = self.figures
        register_worker(worker, worker_figures)
        from ._http_tls import secure_http

        secure_http(worker, "worker")  # issue 22: a TLS cluster's HTTP is TLS too

    def teardown(self, worker: Any) -> None:
        # a poll still in flight gets "nothing" rather than an unknown-op error in the log
        worker.handlers["dataservice_figures"] = _no_figures
        unregister_worker(worker)

    def figures(self) -> dict[str, Any]:
        out = worker_figures(self.worker)
        cpu = out.get("plugin_cpu_seconds")
        if cpu is not None:
            # live threads only: a thread that exited takes its seconds with it, so count
            # increments and never let the total go down
            delta = cpu - self._cpu_seen if cpu >= self._cpu_seen else cpu
            self._cpu_seen = cpu
            if delta > 0:
                self._cpu_total += delta
                self.worker.digest_metric(DIGEST_KEY, delta)
            out["plugin_cpu_seconds"] = self._cpu_total
        return out


def worker_figures(worker: Any) -> dict[str, Any]:
    """Plain data (msgpack-able) about the service's work on ``worker``."""
    out: dict[str, Any] = {"address": worker.address, "name": str(worker.name),
                           "time": time.time(), "plugin_cpu_seconds": plugin_cpu_seconds()}
    data = worker.plugins.get(DATA_PLUGIN)
    if data is not None and hasattr(data, "stats"):
        tasks = {}
        for tid, r in list(data.tasks.items()):
            if r is None:
                continue
            buf = r.buffer
            tasks[str(tid)] = {"produced": int(buf.produced), "buffered": len(buf),
                               "buffered_bytes": int(getattr(buf, "_bytes", 0)),
                               "done": bool(buf.end_visible)}
        out["data"] = {
            "is_data_worker": bool(getattr(data, "is_data_worker", True)),
            "stats": {k: int(v) for k, v in data.stats.items()},
            "tasks": tasks,
            "threads": len(getattr(data, "_runners", ())),
            "served_by_task": {str(t): [int(c[0]), int(c[1])]
                               for t, c in list(getattr(data, "served_by_task", {}).items())},
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


def _no_figures() -> None:
    return None
