"""Prometheus collectors on the scheduler's and workers' own ``/metrics`` (``dataservice_*``).

Distributed serves ``/metrics`` from ``prometheus_client``'s process-wide registry, with one
collector per kind of server (``distributed.http.scheduler.prometheus``,
``distributed.http.worker.prometheus``). These collectors are registered there the same way,
once per process, and report every dashboard plugin (scheduler) or worker of the process that
is alive: ``dataservice_*`` from the scheduler (the service's state and the figures it polls),
``dataservice_worker_*`` from each worker (its own counters, labelled with its address). As for
Dask's own metrics, a process that holds both a scheduler and workers (``LocalCluster(
processes=False)``) shows both kinds on each ``/metrics``. Without ``prometheus_client``
nothing is registered (distributed then serves its "not available" page).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._collect import DashboardPlugin

__all__ = ["register_scheduler", "register_worker", "unregister_worker"]

_lock = threading.Lock()
_plugins: weakref.WeakSet[DashboardPlugin] = weakref.WeakSet()
#: Live workers -> their figures function (``_worker.worker_figures``, passed by the worker
#: plugin, which imports this module).
_workers: weakref.WeakKeyDictionary[Any, Callable[[Any], dict[str, Any]]] = (
    weakref.WeakKeyDictionary())
_registered: set[str] = set()


def _register(kind: str, collector: Any) -> None:
    try:
        import prometheus_client
    except ImportError:  # distributed serves its own "not available" page then
        return
    with _lock:
        if kind not in _registered:
            prometheus_client.REGISTRY.register(collector)
            _registered.add(kind)


def register_scheduler(plugin: DashboardPlugin) -> None:
    _plugins.add(plugin)
    _register("scheduler", SchedulerCollector())


def register_worker(worker: Any, figures: Callable[[Any], dict[str, Any]]) -> None:
    _workers[worker] = figures
    _register("worker", WorkerCollector())


def unregister_worker(worker: Any) -> None:
    _workers.pop(worker, None)


def _no_figures(worker: Any) -> dict[str, Any]:
    return {}  # the worker left between the listing and the read


def _families() -> tuple[Any, Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    return CounterMetricFamily, GaugeMetricFamily


class SchedulerCollector:
    """``dataservice_*``: what the scheduler's dashboard plugin knows (see the module doc)."""

    def collect(self) -> Iterator[Any]:
        counter, gauge = _families()
        plugins = [p for p in list(_plugins) if getattr(p, "_started", False)
                   and not getattr(p, "_closed", True)]
        if not plugins:
            return
        statuses = [p.status() for p in plugins]
        datasets = gauge("dataservice_datasets", "Datasets registered", labels=["scheduler"])
        jobs = gauge("dataservice_jobs", "Live jobs", labels=["scheduler", "mode"])
        consumers = gauge("dataservice_consumers", "Consumers reading (iteration clients)",
                          labels=["scheduler"])
        job_el = counter("dataservice_job_elements", "Elements served to a job's consumers",
                         labels=["scheduler", "job"])
        job_bytes = counter("dataservice_job_bytes", "Bytes served to a job's consumers",
                            labels=["scheduler", "job"])
        splits = counter("dataservice_job_splits", "Splits handed out (DYNAMIC jobs)",
                         labels=["scheduler", "job"])
        elements = counter("dataservice_elements_served", "Elements served by a data worker",
                           labels=["scheduler", "worker"])
        nbytes = counter("dataservice_bytes_served", "Bytes served by a data worker",
                         labels=["scheduler", "worker"])
        records = counter("dataservice_journal_records", "Journal records written and fsync'd",
                          labels=["scheduler"])
        jbytes = counter("dataservice_journal_bytes", "Journal bytes written",
                         labels=["scheduler"])
        fsyncs = counter("dataservice_journal_fsyncs", "Journal fsyncs", labels=["scheduler"])
        fsync_s = gauge("dataservice_journal_last_fsync_seconds",
                        "Mean write+fsync latency over the last poll interval",
                        labels=["scheduler"])
        updates = counter("dataservice_ps_updates", "Updates applied by a parameter server",
                          labels=["scheduler", "worker"])
        gathers = counter("dataservice_ps_gathers", "Gathers served by a parameter server",
                          labels=["scheduler", "worker"])
        dropped = counter("dataservice_ps_duplicates_dropped",
                          "Repeated updates dropped by a parameter server (exactly once)",
                          labels=["scheduler", "worker"])
        steps = counter("dataservice_training_steps", "Scheduled functions run by a training "
                        "worker", labels=["scheduler", "worker"])
        queued = gauge("dataservice_coordinator_queued", "Functions queued by a "
                       "ClusterCoordinator (reported by it)", labels=["scheduler", "coordinator"])
        for st in statuses:
            s = st["scheduler"]
            for uid, c in st["coordinators"].items():
                queued.add_metric([s, uid], c["queued"])
            svc = st["service"]
            datasets.add_metric([s], len(svc["datasets"]))
            by_mode: dict[str, int] = {}
            for j in svc["jobs"]:
                by_mode[j["mode"]] = by_mode.get(j["mode"], 0) + 1
                job_el.add_metric([s, str(j["job_id"])], j["elements_served"])
                job_bytes.add_metric([s, str(j["job_id"])], j["bytes_served"])
                splits.add_metric([s, str(j["job_id"])],
                                  sum(it.get("splits_done", 0) for it in j["iterations"]))
            for mode, n in sorted(by_mode.items()):
                jobs.add_metric([s, mode], n)
            consumers.add_metric([s], len(svc["consumers"]))
            for a, w in st["workers"].items():
                if w["data_worker"]:
                    elements.add_metric([s, a], w["elements_served"])
                    nbytes.add_metric([s, a], w["bytes_served"])
            j = svc["journal"]
            if j is not None:
                records.add_metric([s], j["records"])
                jbytes.add_metric([s], j["bytes"])
                fsyncs.add_metric([s], j["fsyncs"])
                if j["last_fsync_seconds"] is not None:
                    fsync_s.add_metric([s], j["last_fsync_seconds"])
            for a, ps in st["parameter_servers"].items():
                updates.add_metric([s, a], ps["stats"].get("updates", 0))
                gathers.add_metric([s, a], ps["stats"].get("gathers", 0))
                dropped.add_metric([s, a], ps["duplicates_dropped"])
            for a, tw in st["training_workers"].items():
                steps.add_metric([s, a], tw["stats"].get("closures", 0))
        yield from (datasets, jobs, consumers, job_el, job_bytes, splits, elements, nbytes,
                    records, jbytes, fsyncs, fsync_s, updates, gathers, dropped, steps, queued)


class WorkerCollector:
    """``dataservice_worker_*``: each live worker's own counters (see the module doc)."""

    def collect(self) -> Iterator[Any]:
        counter, gauge = _families()
        workers = [w for w in list(_workers) if getattr(w, "address", None)]
        if not workers:
            return
        served = counter("dataservice_worker_elements_served", "Elements served to consumers",
                         labels=["worker"])
        nbytes = counter("dataservice_worker_bytes_served", "Bytes served to consumers",
                         labels=["worker"])
        produced = counter("dataservice_worker_elements_produced",
                           "Elements produced by finished tasks", labels=["worker"])
        tasks = gauge("dataservice_worker_tasks", "Tasks on this worker", labels=["worker"])
        buffered = gauge("dataservice_worker_buffered_bytes", "Bytes buffered by tasks",
                         labels=["worker"])
        cpu = counter("dataservice_worker_plugin_cpu_seconds",
                      "CPU seconds of the service's threads (dds-*), Linux only",
                      labels=["worker"])
        updates = counter("dataservice_worker_ps_updates", "Updates applied", labels=["worker"])
        gathers = counter("dataservice_worker_ps_gathers", "Gathers served", labels=["worker"])
        dropped = counter("dataservice_worker_ps_duplicates_dropped",
                          "Repeated updates dropped (exactly once)", labels=["worker"])
        shard_bytes = gauge("dataservice_worker_ps_shard_bytes", "Bytes of a variable shard",
                            labels=["worker", "variable"])
        shard_gathers = counter("dataservice_worker_ps_shard_gathers", "Gathers of a shard",
                                labels=["worker", "variable"])
        shard_updates = counter("dataservice_worker_ps_shard_updates",
                                "Update requests that reached a shard", labels=["worker", "variable"])
        steps = counter("dataservice_worker_training_steps", "Scheduled functions run",
                        labels=["worker"])
        for w in workers:
            a = w.address
            plugin = w.plugins.get("dataservice-dashboard-worker")
            fig = _workers.get(w, _no_figures)(w)
            if plugin is not None and getattr(plugin, "_cpu_total", None) is not None:
                cpu.add_metric([a], max(plugin._cpu_total, 0.0))
            data = fig.get("data")
            if data is not None:
                st = data["stats"]
                served.add_metric([a], st.get("elements_served", 0))
                nbytes.add_metric([a], st.get("bytes_served", 0))
                produced.add_metric([a], st.get("elements_produced", 0))
                tasks.add_metric([a], len(data["tasks"]))
                buffered.add_metric([a], sum(t["buffered_bytes"] for t in data["tasks"].values()))
            ps = fig.get("ps")
            if ps is not None:
                updates.add_metric([a], ps["stats"].get("updates", 0))
                gathers.add_metric([a], ps["stats"].get("gathers", 0))
                dropped.add_metric([a], ps["stats"].get("skipped", 0))
                for key, sh in ps["shards"].items():
                    shard_bytes.add_metric([a, key], sh["bytes"])
                    shard_gathers.add_metric([a, key], sh["gathers"])
                    shard_updates.add_metric([a, key], sh["updates"])
            runner = fig.get("runner")
            if runner is not None:
                steps.add_metric([a], runner["stats"].get("closures", 0))
        yield from (served, nbytes, produced, tasks, buffered, cpu, updates, gathers, dropped,
                    shard_bytes, shard_gathers, shard_updates, steps)
