"""The scheduler's half of the dashboard: poll the workers' figures, keep rates, build status.

:class:`DashboardPlugin` is a scheduler plugin that :func:`~dask_dataservice.dashboard.attach`
adds next to the dispatcher. Every ``dataservice.dashboard.interval`` it asks each worker for
its figures (``dataservice_figures``, one small request per worker, each with a deadline so a
frozen worker delays nothing), turns the cumulative counters into rates
(:class:`~dask_dataservice.service.protocol._metrics.RateSeries`) and keeps a timeline of the totals.
:meth:`DashboardPlugin.status` joins them with the dispatcher's state into plain data: the JSON
route, ``dds.status(client)``, the bokeh pages and the Prometheus collector all read it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from .. import config
from .._async import TaskGroup
from ..data._stats import bottleneck, merge_rows
from ..service.protocol._metrics import RateSeries
from ._scaling import DemandScaler
from ._worker import FIGURES_READY

__all__ = ["DashboardPlugin", "PLUGIN_NAME"]

logger = logging.getLogger(__name__)

PLUGIN_NAME = "dataservice-dashboard"
_DISPATCHER = "dataservice-dispatcher"
#: Seconds over which rates are averaged (at least two poll intervals).
WINDOW = 2.0
#: Consumers whose wait/compute reports are kept (the latest to report).
READERS = 256
#: Tasks whose per-op figures are kept (the newest; those of tasks that ended included).
TASK_OPS = 1024


class DashboardPlugin(SchedulerPlugin):
    """Polls the workers' figures and answers ``dataservice_status`` (see the module doc)."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self) -> None:
        self.scheduler: Any = None
        self._started = False

    async def start(self, scheduler: Any) -> None:
        if self._started:
            return
        self._started = True
        self.scheduler = scheduler
        self.interval = config.get_seconds("dashboard.interval")
        history = int(config.get("dashboard.history"))
        if self.interval <= 0 or history < 2:
            raise ValueError("dataservice.dashboard.interval must be > 0 and "
                             f".history >= 2, got {self.interval} and {history}")
        self._series: dict[tuple[str, ...], RateSeries] = collections.defaultdict(
            lambda: RateSeries(history))
        #: ``{address: the worker's last figures}``
        self.workers: dict[str, dict[str, Any]] = {}
        #: ``{task_id: [elements produced, elements served, bytes served]}`` (max seen).
        self._tasks: dict[int, list[int]] = {}
        self.timeline: collections.deque[dict[str, float]] = collections.deque(maxlen=history)
        self._journal: dict[str, float] = {}
        self._job_totals: dict[int, list[int]] = {}
        #: ``{task_id: (job_id, iteration_id, its pipeline's per-op rows)}`` (latest seen;
        #: the newest TASK_OPS tasks, so a finished read's figures stay a while).
        self._task_ops: collections.OrderedDict[int, tuple[int, int, list[dict[str, Any]]]] = \
            collections.OrderedDict()
        self._job_ops: dict[int, list[dict[str, Any]]] = {}
        self.polls = 0
        #: When the last poll was taken (None before the first).
        self._last_poll: float | None = None
        self._closed = False
        self._group = TaskGroup("dataservice dashboard")
        scheduler.handlers["dataservice_status"] = self._status_request
        scheduler.handlers["dataservice_coordinator_report"] = self.coordinator_report
        scheduler.handlers["dataservice_job_ops"] = self.job_ops
        scheduler.handlers["dataservice_consumer_report"] = self.consumer_report
        scheduler.handlers["dataservice_demand"] = self.demand  # issue 26: scaling
        #: The data service's share of ``adaptive_target`` (one decision per poll).
        self.scaler = DemandScaler(self, history)
        self.scaler.install(scheduler)
        #: ``{iteration client id: [(time, wait seconds, compute seconds, elements)]}`` of
        #: the latest READERS consumers (bounded), and each one's iteration.
        self._reading: collections.OrderedDict[
            int, collections.deque[tuple[float, float, float, int]]] = \
            collections.OrderedDict()
        self._reading_iteration: dict[int, int] = {}
        self._history = history
        #: ``{coordinator uid: its last report}`` (the coordinator's queue is in its process).
        self.coordinators: dict[int, dict[str, Any]] = {}
        self._group.spawn(self._poll_loop)

    async def close(self) -> None:
        if not self._started or self._closed:
            return
        self._closed = True
        self.scaler.uninstall()
        await self._group.stop()

    def coordinator_report(self, uid: int, queued: int, finished: int, requeued: int,
                           workers: int) -> dict[str, Any]:
        """A ClusterCoordinator's report (every ``dataservice.ps.membership-interval``)."""
        self.coordinators[int(uid)] = {"queued": int(queued), "finished": int(finished),
                                       "requeued": int(requeued), "workers": int(workers),
                                       "time": time.time()}
        return {"status": "OK"}

    # polling ---------------------------------------------------------------------------
    async def _poll_loop(self) -> None:
        while not self._closed:
            try:
                await self.poll()
            except Exception as e:  # noqa: BLE001 - a dashboard must not stop on one bad poll
                logger.warning("dataservice dashboard: poll failed: %r", e)
            await asyncio.sleep(self.interval)

    async def _ask(self, address: str) -> dict[str, Any] | None:
        try:
            reply = await asyncio.wait_for(
                self.scheduler.rpc(address).dataservice_figures(), max(2.0, 2 * self.interval))
        except (TimeoutError, OSError):
            return None
        return reply if isinstance(reply, dict) else None

    async def poll(self) -> None:
        """Ask every worker for its figures once and update the rates."""
        addresses = [a for a, ws in self.scheduler.workers.items()
                     if ws.metrics.get(FIGURES_READY)]  # set up: see DashboardWorkerPlugin
        replies = await asyncio.gather(*(self._ask(a) for a in addresses))
        now = time.time()
        for address in [a for a in self.workers if a not in self.scheduler.workers]:
            del self.workers[address]
            for key in [k for k in self._series if len(k) > 1 and k[1] == address]:
                del self._series[key]
        for address, fig in zip(addresses, replies, strict=True):
            if fig is None:
                continue
            prev = self.workers.get(address)
            self.workers[address] = fig
            self._update_worker(now, address, fig, prev)
        self._update_journal(now)
        self._update_jobs(now)
        window = max(WINDOW, 2 * self.interval)
        total = {name: sum(s.rate(window) for k, s in self._series.items() if k[0] == kind)
                 for name, kind in (("elements_per_second", "served"),
                                    ("bytes_per_second", "bytes"),
                                    ("steps_per_second", "closures"),
                                    ("gathers_per_second", "gathers"),
                                    ("updates_per_second", "updates"))}
        self.timeline.append({"time": now, **total})
        self.polls += 1
        self._last_poll = now
        self.scaler.tick()

    def _update_worker(self, now: float, address: str, fig: dict[str, Any],
                       prev: dict[str, Any] | None = None) -> None:
        data = fig.get("data")
        if data is not None:
            stats = data["stats"]
            self._series["served", address].add(now, stats.get("elements_served", 0))
            self._series["bytes", address].add(now, stats.get("bytes_served", 0))
            served, tasks = data.get("served_by_task", {}), data["tasks"]
            seen = {**data.get("finished_ops", {}), **tasks}
            for tid, task in seen.items():
                if task.get("ops"):
                    self._task_ops[int(tid)] = (int(task["job_id"]), int(task["iteration_id"]),
                                                list(task["ops"]))
                    self._task_ops.move_to_end(int(tid))
            while len(self._task_ops) > TASK_OPS:
                self._task_ops.popitem(last=False)
            for tid in served.keys() | tasks.keys():
                counts = self._tasks.setdefault(int(tid), [0, 0, 0])
                e, b = served.get(tid, (0, 0))
                counts[0] = max(counts[0], tasks.get(tid, {}).get("produced", 0))
                counts[1] = max(counts[1], e)
                counts[2] = max(counts[2], b)
        if fig.get("plugin_cpu_seconds") is not None:
            self._series["cpu", address].add(now, fig["plugin_cpu_seconds"])
        ps = fig.get("ps")
        if ps is not None:
            for k in [k for k in self._series if k[0].startswith("shard_") and k[1] == address
                      and k[2] not in ps["shards"]]:
                del self._series[k]
            self._series["gathers", address].add(now, ps["stats"].get("gathers", 0))
            self._series["updates", address].add(now, ps["stats"].get("updates", 0))
            for key, shard in ps["shards"].items():
                self._series["shard_gathers", address, key].add(now, shard["gathers"])
                self._series["shard_updates", address, key].add(now, shard["updates"])
        runner = fig.get("runner")
        if runner is not None:
            key = ("closures", address)
            if key not in self._series and prev is not None and prev.get("runner") is None \
                    and self._last_poll is not None:
                # the last poll saw this worker with no runner yet: its count was 0 then, and
                # training that began and ended between two polls still shows
                self._series[key].add(self._last_poll, 0)
            self._series[key].add(now, runner["stats"].get("closures", 0))

    def _update_jobs(self, now: float) -> None:
        """Per job: elements produced and served, bytes served, elements buffered."""
        plugin = self._dispatcher()
        state = getattr(plugin, "state", None)
        totals: dict[int, list[int]] = {}
        live: set[int] = set()
        if state is not None:
            for it in state.list_iterations():
                if it.garbage_collected:
                    continue
                row = totals.setdefault(it.job_id, [0, 0, 0, 0])
                for t in state.tasks_for_iteration(it.iteration_id):
                    live.add(t.task_id)
                    counts = self._tasks.get(t.task_id, (0, 0, 0))
                    for i in range(3):
                        row[i] += counts[i]
                    fig = self.workers.get(t.worker_address, {}).get("data") or {}
                    task_fig = fig.get("tasks", {}).get(str(t.task_id))
                    if task_fig is not None:
                        row[3] += task_fig["buffered"]
        for job_id, row in totals.items():
            self._series["job_elements", str(job_id)].add(now, row[1])
            self._series["job_bytes", str(job_id)].add(now, row[2])
        for key in [k for k in self._series if k[0].startswith("job_")
                    and int(k[1]) not in totals]:
            del self._series[key]
        self._job_totals = totals
        latest: dict[int, int] = {}  # job: its latest iteration with figures
        for job, it, _ in self._task_ops.values():
            latest[job] = max(it, latest.get(job, it))
        self._job_ops = {job: self._iteration_ops(it) for job, it in latest.items()}
        if state is not None:  # forget the counts of tasks whose iteration is gone
            for tid in [t for t in self._tasks if t not in live]:
                del self._tasks[tid]

    def _dispatcher(self) -> Any:
        return self.scheduler.plugins.get(_DISPATCHER) if self.scheduler is not None else None

    def _update_journal(self, now: float) -> None:
        journal = getattr(self._dispatcher(), "_journal", None)
        if journal is None:
            return
        m = journal.metrics
        prev = self._journal
        if m.fsyncs > prev.get("fsyncs", 0):
            prev["last_fsync_seconds"] = (m.sync_seconds - prev.get("sync_seconds", 0.0)) / (
                m.fsyncs - prev.get("fsyncs", 0))
        prev.update(fsyncs=m.fsyncs, sync_seconds=m.sync_seconds)
        self._series["journal_records", ""].add(now, m.records_written)

    def consumer_report(self, consumer: int, iteration_id: int, wait_seconds: float,
                        compute_seconds: float, elements: int) -> dict[str, Any]:
        """A consumer's totals of time waiting on the service and computing (each second)."""
        consumer = int(consumer)
        series = self._reading.setdefault(consumer, collections.deque(maxlen=self._history))
        self._reading.move_to_end(consumer)
        self._reading_iteration[consumer] = int(iteration_id)
        series.append((time.time(), float(wait_seconds), float(compute_seconds),
                       int(elements)))
        while len(self._reading) > READERS:
            gone, _ = self._reading.popitem(last=False)
            self._reading_iteration.pop(gone, None)
        return {"status": "OK"}

    def demand(self) -> dict[str, Any]:
        """What the consumers took and waited, and what the data workers served, over the
        last window (issue 26: :class:`._scaling.DemandScaler` decides from it after each
        poll). O(consumers reporting + workers).

        ``consumers``: those that reported reading within the window; ``rate``: elements
        per second they took; ``wait``: the mean share of their time spent waiting for
        elements; ``served_rate``: elements per second the data workers served;
        ``data_workers``: the workers that take data tasks now (neither excluded by their
        resources nor retiring); ``other_workers``: the rest.
        """
        now = time.time()
        window = max(WINDOW, 2 * self.interval)
        consumers, rate, waits = 0, 0.0, []
        for series in self._reading.values():
            recent = [x for x in series if now - x[0] <= window + self.interval]
            if len(recent) < 2 or recent[-1][0] <= recent[0][0]:
                continue
            (t0, w0, c0, e0), (t1, w1, c1, e1) = recent[0], recent[-1]
            if e1 <= e0:
                continue  # not reading: a paused or finished consumer
            consumers += 1
            rate += (e1 - e0) / (t1 - t0)
            busy = (w1 - w0) + (c1 - c0)
            if busy > 0:
                waits.append((w1 - w0) / busy)
        core = getattr(self._dispatcher(), "_core", None)
        data = [a for a in self.scheduler.workers
                if core is not None and core.is_data_worker(a)]
        served = sum(self._series["served", a].rate(window) for a in data
                     if ("served", a) in self._series)
        return {"status": "OK", "time": now, "consumers": consumers, "rate": rate,
                "wait": sum(waits) / len(waits) if waits else 0.0, "served_rate": served,
                "data_workers": len(data),
                "other_workers": len(self.scheduler.workers) - len(data)}

    def _job_input_bound(self, state: Any, job_id: int) -> float | None:
        """The mean input-bound share of the job's consumers that reported one."""
        shares = []
        for consumer, it in self._reading_iteration.items():
            try:
                if state.iteration(it).job_id != job_id:
                    continue
            except KeyError:
                continue
            share = self._input_bound(consumer)[0]
            if share is not None:
                shares.append(share)
        return sum(shares) / len(shares) if shares else None

    def _input_bound(self, consumer: int) -> tuple[float | None, dict[str, list[float]]]:
        """The consumer's input-bound share (waited / (waited + computed)) over the last
        window, or over its latest report interval with reading in it if it read nothing in
        the window; and the share per report interval."""
        s = list(self._reading.get(consumer, ()))
        times, shares, spans = [], [], []
        for (_, w0, c0, _), (t1, w1, c1, _) in zip(s, s[1:], strict=False):
            busy = (w1 - w0) + (c1 - c0)
            times.append(t1)
            shares.append((w1 - w0) / busy if busy > 0 else 0.0)
            if busy > 0:
                spans.append((t1, w1 - w0, busy))
        window = max(WINDOW, 2 * self.interval)
        recent = [x for x in spans if s[-1][0] - x[0] <= window] or spans[-1:]
        busy = sum(b for _, _, b in recent)
        share = sum(w for _, w, _ in recent) / busy if busy > 0 else None
        return share, {"time": times, "wait_fraction": shares}

    def job_ops(self, iteration_id: int) -> dict[str, Any]:
        """The per-op rows of the job an iteration reads (``DistributedDataset.stats()``), as
        of the last poll, summed over the job's tasks on every data worker."""
        rows = self._iteration_ops(int(iteration_id))
        return {"status": "OK", "ops": rows, "bottleneck": _bottleneck_name(rows)}

    def _iteration_ops(self, iteration_id: int) -> list[dict[str, Any]]:
        return merge_rows(rows for _, it, rows in self._task_ops.values() if it == iteration_id)

    # status ----------------------------------------------------------------------------
    def rate(self, kind: str, address: str, key: str | None = None) -> float:
        s = self._series.get((kind, address) if key is None else (kind, address, key))
        return s.rate(max(WINDOW, 2 * self.interval)) if s is not None else 0.0

    async def _status_request(self, fresh: bool = False) -> dict[str, Any]:
        """``dataservice_status``: :meth:`status`, after a poll of its own if ``fresh``
        (``dds.status()``: figures as of the call, not of the last periodic poll)."""
        if fresh:
            await self.poll()
        return self.status()

    def status(self) -> dict[str, Any]:
        """Everything the pages show, as plain data (string keys: it is also JSON)."""
        out: dict[str, Any] = {"time": time.time(), "scheduler": self.scheduler.address,
                               "interval": self.interval, "polls": self.polls}
        out["service"] = self._service()
        out["workers"] = {a: self._worker_status(a, f) for a, f in sorted(self.workers.items())}
        out["parameter_servers"] = {
            a: {"shards": {k: {**sh, "gathers_per_second": self.rate("shard_gathers", a, k),
                               "updates_per_second": self.rate("shard_updates", a, k)}
                           for k, sh in f["ps"]["shards"].items()},
                "stats": f["ps"]["stats"],
                "gathers_per_second": self.rate("gathers", a),
                "updates_per_second": self.rate("updates", a),
                "duplicates_dropped": f["ps"]["stats"].get("skipped", 0)}
            for a, f in sorted(self.workers.items()) if f.get("ps") is not None}
        out["training_workers"] = {
            a: {"stats": f["runner"]["stats"], "steps_per_second": self.rate("closures", a)}
            for a, f in sorted(self.workers.items())
            if f.get("runner") is not None and f.get("ps") is None}
        stale = time.time() - max(10.0, 5 * self.interval)  # a coordinator that stopped
        for uid in [u for u, c in self.coordinators.items() if c["time"] < stale]:
            del self.coordinators[uid]
        out["coordinators"] = {str(u): {k: v for k, v in c.items() if k != "time"}
                               for u, c in sorted(self.coordinators.items())}
        out["scaling"] = self.scaler.status()
        out["autocache"] = self._autocache()
        last = self.timeline[-1] if self.timeline else {}
        out["totals"] = {k: v for k, v in last.items() if k != "time"}
        out["timeline"] = {k: [row.get(k, 0.0) for row in self.timeline]
                           for k in ("time", "elements_per_second", "bytes_per_second",
                                     "steps_per_second", "gathers_per_second",
                                     "updates_per_second")}
        return out

    def _autocache(self) -> dict[str, Any]:
        """Per cached dataset (its fingerprint), summed over the data workers: splits cached,
        bytes in memory and on disk, hits, splits made; each worker's last decision."""
        out: dict[str, Any] = {}
        for address, fig in sorted(self.workers.items()):
            cache = (fig.get("data") or {}).get("autocache") or {}
            for fp, d in (cache.get("datasets") or {}).items():
                row = out.setdefault(fp, {"splits": 0, "memory_bytes": 0, "disk_bytes": 0,
                                          "hits": 0, "computed": 0, "decisions": {}})
                for k in ("splits", "memory_bytes", "disk_bytes", "hits", "computed"):
                    row[k] += d.get(k, 0)
                row["decisions"][address] = {"decision": d.get("decision"),
                                             "why": d.get("why")}
        return out

    def _worker_status(self, address: str, fig: dict[str, Any]) -> dict[str, Any]:
        data = fig.get("data") or {}
        stats = data.get("stats", {})
        tasks = data.get("tasks", {})
        cpu = fig.get("plugin_cpu_seconds")
        served = self._series.get(("served", address))
        return {
            "history": _history(served),
            "request_seconds": data.get("request_seconds"),
            "plugin_threads": fig.get("plugin_threads"),
            "name": fig.get("name", address),
            "data_worker": bool(data.get("is_data_worker", False)),
            "elements_served": stats.get("elements_served", 0),
            "bytes_served": stats.get("bytes_served", 0),
            "elements_per_second": self.rate("served", address),
            "bytes_per_second": self.rate("bytes", address),
            "tasks": len(tasks),
            "tasks_finished": stats.get("tasks_finished", 0),
            "buffered_elements": sum(t["buffered"] for t in tasks.values()),
            "buffered_bytes": sum(t["buffered_bytes"] for t in tasks.values()),
            "plugin_cpu_seconds": cpu,
            "plugin_cpu_fraction": self.rate("cpu", address) if cpu is not None else None,
            # issue 25: requests answered on the worker's element port (None: it has none)
            "element_port": data.get("element_port"),
        }

    def _service(self) -> dict[str, Any]:
        plugin = self._dispatcher()
        if plugin is None or getattr(plugin, "state", None) is None:
            return {"installed": False, "datasets": [], "jobs": [], "consumers": [],
                    "journal": None}
        state = plugin.state
        now_us = time.time() * 1e6
        clients_by_iteration: dict[int, int] = collections.Counter()
        consumers = []
        for c in state.list_iteration_clients():
            clients_by_iteration[c.iteration_id] += 1
            seen = plugin._client_seen.get(c.iteration_client_id, c.last_seen_micros)
            share, shares = self._input_bound(c.iteration_client_id)
            consumers.append({"consumer": c.iteration_client_id, "iteration_id": c.iteration_id,
                              "job_id": state.iteration(c.iteration_id).job_id,
                              "seconds_since_heartbeat": max(0.0, (now_us - seen) / 1e6),
                              "wait_fraction": share, "wait_fraction_history": shares})
        jobs = []
        for job in state.list_jobs():
            if job.garbage_collected:
                continue
            its = [it for it in state.list_iterations()
                   if it.job_id == job.job_id and not it.garbage_collected]
            produced, served, nbytes, buffered = self._job_totals.get(job.job_id, (0, 0, 0, 0))
            iterations = []
            for it in its:
                entry: dict[str, Any] = {
                    "iteration_id": it.iteration_id, "repetition": it.repetition,
                    "finished": it.finished, "tasks": it.num_tasks,
                    "finished_tasks": it.num_finished_tasks,
                    "consumers": clients_by_iteration.get(it.iteration_id, 0)}
                if job.processing_mode == "DYNAMIC":
                    # handed out: every pass of the splits so far (repetition) plus the
                    # current one; done: handed out and acknowledged by the task's pipeline
                    rep, nxt, total = state.split_position(it.iteration_id)
                    handed = rep * total + nxt
                    held = len(state.splits_in_flight(it.iteration_id))
                    entry.update(splits_total=total, splits_handed_out=handed,
                                 splits_done=handed - held)
                iterations.append(entry)
            jobs.append({  # no name, no dataset id: they are credentials' (issue 22)
                "job_id": job.job_id, "mode": job.processing_mode, "target_workers": job.target_workers,
                "num_consumers": job.num_consumers,
                "consumers": sum(e["consumers"] for e in iterations),
                "elements_produced": produced, "elements_served": served,
                "bytes_served": nbytes, "buffered_elements": buffered,
                "elements_per_second": self.rate("job_elements", str(job.job_id)),
                "history": _history(self._series.get(("job_elements", str(job.job_id)))),
                "ops": self._job_ops.get(job.job_id, []),
                "input_bound": self._job_input_bound(state, job.job_id),
                "bottleneck": _bottleneck_name(self._job_ops.get(job.job_id, [])),
                "bytes_per_second": self.rate("job_bytes", str(job.job_id)),
                "iterations": iterations})
        journal = None
        writer = getattr(plugin, "_journal", None)
        if writer is not None:
            m = writer.metrics
            journal = {"records": m.records_written, "bytes": m.bytes_written,
                       "fsyncs": m.fsyncs, "records_per_fsync": m.records_per_fsync,
                       "last_fsync_seconds": self._journal.get("last_fsync_seconds"),
                       "snapshots": m.snapshots_written}
        return {"installed": True, "fault_tolerant": bool(plugin.fault_tolerant_mode),
                "datasets": [{"num_splits": d.num_splits} for d in state.list_datasets()],
                "jobs": jobs, "consumers": consumers, "journal": journal}


def _history(series: RateSeries | None) -> dict[str, list[float]]:
    """A counter's rate per sample, over the kept samples (``dataservice.dashboard.history``)."""
    rates = series.rates() if series is not None else []
    return {"time": [t for t, _ in rates], "rate": [r for _, r in rates]}


def _bottleneck_name(rows: list[dict[str, Any]]) -> str | None:
    worst = bottleneck(rows)
    return None if worst is None else str(worst["op"])
