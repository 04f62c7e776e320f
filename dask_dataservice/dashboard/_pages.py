"""The bokeh pages ``/dataservice`` and ``/parameter-servers`` on the scheduler's dashboard.

They are built as Dask's own pages are (``distributed.dashboard.scheduler``): a function of
``(scheduler, extra, doc)`` per page, served by a ``BokehTornado`` application added to the
scheduler's HTTP application, with Dask's template and theme, and their names appended to the
navigation bar Dask's pages share. Because the application is added to a running server, the
pages also appear on a cluster where the service was installed after the fact
(``dds.install``). Every figure reads :meth:`DashboardPlugin.status`, refreshed every
``dataservice.dashboard.interval``; each data source is named (``dds-...``), which is how the
browser test finds their data.
"""

from __future__ import annotations

from typing import Any

from bokeh.layouts import column, row
from bokeh.models import ColumnDataSource, FactorRange, NumeralTickFormatter
from bokeh.models.widgets import DataTable, TableColumn
from bokeh.models.widgets.markups import Div
from bokeh.plotting import figure
from distributed.dashboard.components import add_periodic_callback
from distributed.dashboard.components.scheduler import BOKEH_THEME, env
from distributed.utils import log_errors

from ..data import _stats

__all__ = ["add_pages", "dataservice_doc", "parameter_servers_doc"]

_APP_ATTR = "_dataservice_bokeh_app"
_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2")


def _plugin(scheduler: Any) -> Any:
    from ._collect import PLUGIN_NAME

    return scheduler.plugins.get(PLUGIN_NAME)


def _status(scheduler: Any) -> dict[str, Any] | None:
    plugin = _plugin(scheduler)
    return plugin.status() if plugin is not None and not plugin._closed else None


def _ms(scheduler: Any) -> int:
    plugin = _plugin(scheduler)
    return int(1000 * (plugin.interval if plugin is not None else 1.0))


def _table(name: str, columns: list[tuple[str, str]], height: int = 180,
           widths: dict[str, int] | None = None) -> tuple[Any, Any]:
    """A table; ``widths``: relative widths of some columns (the others get 100)."""
    widths = widths or {}
    source = ColumnDataSource({k: [] for k, _ in columns}, name=name)
    table = DataTable(source=source, columns=[TableColumn(field=k, title=t,
                                                          width=widths.get(k, 100))
                                              for k, t in columns],
                      height=height, sizing_mode="stretch_width", index_position=None)
    return source, table


def fmt_bytes(n: float) -> str:
    """Bytes for people: ``1.5 MiB``, ``512 B`` (binary units, as the bytes axis shows)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # not reached


def fmt_seconds(s: float) -> str:
    return _stats.fmt_seconds(s, " ")


def shard_label(key: str) -> str:
    """A variable shard's readable name: its key without the strategy's id prefix."""
    parts = str(key).split("/", 2)
    return parts[2] if len(parts) == 3 and parts[1].isdigit() else str(key)


def _timeline(name: str, title: str, fields: list[tuple[str, str, str]],
              fmt: str = "0.0a") -> tuple[Any, Any]:
    source = ColumnDataSource({"time": [], **{f: [] for f, _, _ in fields}}, name=name)
    fig = figure(title=title, x_axis_type="datetime", height=250, sizing_mode="stretch_width",
                 tools="", toolbar_location=None)
    for f, label, color in fields:
        fig.line("time", f, source=source, legend_label=label, color=color, line_width=2)
    fig.legend.location = "top_left"
    fig.yaxis.formatter = NumeralTickFormatter(format=fmt)
    return source, fig


def _bars(name: str, title: str, field: str, color: str) -> tuple[Any, Any]:
    source = ColumnDataSource({"worker": [], field: []}, name=name)
    fig = figure(title=title, y_range=FactorRange(), height=250, sizing_mode="stretch_width", tools="",
                 toolbar_location=None)
    fig.hbar(y="worker", right=field, height=0.8, source=source, color=color)
    fig.xaxis.formatter = NumeralTickFormatter(format="0.0a")
    return source, fig


def _times(timeline: dict[str, list[float]]) -> list[float]:
    return [1000.0 * t for t in timeline["time"]]  # bokeh's datetime axis is in ms


class _Page:
    """One page: its sources, refreshed from the plugin's status every interval."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.summary = Div(text="", sizing_mode="stretch_width", name="dds-summary")
        self.root: Any = None

    def update(self) -> None:
        with log_errors():
            st = _status(self.scheduler)
            if st is None:
                self.summary.text = "<b>The dataservice dashboard is not running.</b>"
                return
            self.refresh(st)

    def refresh(self, st: dict[str, Any]) -> None:
        raise NotImplementedError


class DataServicePage(_Page):
    def __init__(self, scheduler: Any) -> None:
        super().__init__(scheduler)
        self.throughput, fig_t = _timeline("dds-throughput", "Elements served per second",
                                           [("elements_per_second", "elements/s", "#1f77b4")])
        self.bytes, fig_b = _timeline("dds-bytes", "Bytes served per second",
                                      [("bytes_per_second", "bytes/s", "#ff7f0e")],
                                      fmt="0.0 b")  # numeral's bytes: KiB, MiB, GiB
        # issue 26: the data workers there and wanted (DemandAdaptive / scaling.enabled)
        self.scaling, self.fig_s = _timeline(
            "dds-scaling", "Data workers (elastic scaling)",
            [("data_workers", "data workers", "#1f77b4"), ("wanted", "wanted", "#d62728")],
            fmt="0")
        self.per_worker, fig_w = _bars("dds-workers-rate", "Elements served per second, per "
                                       "data worker", "elements_per_second", "#2ca02c")
        self.fig_w = fig_w
        # per job: its elements per second at each poll (the kept samples)
        self.job_history = ColumnDataSource({"xs": [], "ys": [], "job": [], "color": []},
                                            name="dds-job-history")
        fig_h = figure(title="Elements served per second, per job", x_axis_type="datetime",
                       height=250, sizing_mode="stretch_width", tools="", toolbar_location=None)
        fig_h.multi_line("xs", "ys", source=self.job_history, line_color="color", line_width=2,
                         legend_field="job")
        fig_h.legend.location = "top_left"
        fig_h.yaxis.formatter = NumeralTickFormatter(format="0.0a")
        self.workers, t_w = _table("dds-workers", [
            ("worker", "Data worker"), ("elements_served", "Elements served"),
            ("bytes_served", "Bytes served"), ("elements_per_second", "Elements/s"),
            ("bytes_per_second", "Bytes/s"), ("buffered_elements", "Buffered"),
            ("buffered_bytes", "Buffered bytes"), ("tasks", "Tasks"),
            ("cpu", "Service threads CPU %"), ("latency", "Request latency p50 / p99")],
            widths={"worker": 180, "latency": 160})
        self.jobs, t_j = _table("dds-jobs", [
            ("job_id", "Job"), ("mode", "Sharding"),
            ("consumers", "Consumers"), ("progress", "Epoch progress"),
            ("elements_served", "Elements served"), ("elements_per_second", "Elements/s"),
            ("bytes_per_second", "Bytes/s"), ("buffered_elements", "Buffered (lag)"),
            ("input_bound", "Consumers input-bound %"), ("bottleneck", "Bottleneck op")],
            widths={"job_id": 50, "progress": 300, "bottleneck": 160})
        self.ops, t_o = _table("dds-ops", [
            ("job_id", "Job"), ("op", "Op (source first)"), ("elements_in", "Elements in"),
            ("elements_out", "Elements out"), ("time_per_element", "Own time / element"),
            ("share", "Share of own time %"), ("wait", "Waited on buffer"),
            ("buffer", "Buffer fill"), ("bottleneck", "Bottleneck")], height=200,
            widths={"job_id": 50, "op": 220})
        self.autocache, self.t_a = _table("dds-autocache", [
            ("dataset", "Dataset (fingerprint)"), ("splits", "Splits cached"),
            ("memory", "In memory"), ("disk", "On disk"), ("hits", "Served from cache"),
            ("computed", "Made"), ("why", "Last decision (a worker's)")], height=120,
            widths={"dataset": 140, "why": 420})
        self.consumers, t_c = _table("dds-consumers", [
            ("consumer", "Consumer"), ("job_id", "Job"), ("iteration_id", "Iteration"),
            ("seconds_since_heartbeat", "Seconds since heartbeat"),
            ("input_bound", "Input-bound % (waited on the service)")], height=120,
            widths={"input_bound": 200})
        self.root = column(self.summary, row(fig_t, fig_b, sizing_mode="stretch_width"),
                           row(fig_w, fig_h, sizing_mode="stretch_width"),
                           self.fig_s, Div(text="<h3>Jobs</h3>"), t_j,
                           Div(text="<h3>Pipeline ops</h3><p>Per op of each job's pipeline, "
                                    "summed over its data workers: the bottleneck is the op "
                                    "with the largest own time (see docs/dashboard.md)</p>"),
                           t_o, Div(text="<h3>Data workers</h3>"),
                           t_w, Div(text="<h3>Autocache</h3>"), self.t_a,
                           Div(text="<h3>Consumers</h3>"), t_c,
                           sizing_mode="stretch_width")

    def refresh(self, st: dict[str, Any]) -> None:
        svc = st["service"]
        tl = st["timeline"]
        self.throughput.data = {"time": _times(tl), "elements_per_second":
                                tl["elements_per_second"]}
        self.bytes.data = {"time": _times(tl), "bytes_per_second": tl["bytes_per_second"]}
        scaling = st.get("scaling") or {}
        self.fig_s.visible = bool(scaling.get("enabled"))
        stl = scaling.get("timeline") or {"time": [], "data_workers": [], "wanted": []}
        self.scaling.data = {"time": _times(stl), "data_workers": stl["data_workers"],
                             "wanted": stl["wanted"]}
        data_workers = {a: w for a, w in st["workers"].items() if w["data_worker"]}
        names = list(data_workers)
        self.fig_w.y_range.factors = names
        self.per_worker.data = {"worker": names, "elements_per_second":
                                [w["elements_per_second"] for w in data_workers.values()]}
        self.workers.data = {
            "worker": names,
            **{k: [w[k] for w in data_workers.values()] for k in (
                "elements_served", "buffered_elements", "tasks")},
            **{k: [fmt_bytes(w[k]) for w in data_workers.values()] for k in (
                "bytes_served", "buffered_bytes")},
            "elements_per_second": [round(w["elements_per_second"], 1)
                                    for w in data_workers.values()],
            "bytes_per_second": [fmt_bytes(w["bytes_per_second"]) + "/s"
                                 for w in data_workers.values()],
            "cpu": ["n/a" if w["plugin_cpu_fraction"] is None else
                    f"{100 * w['plugin_cpu_fraction']:.0f}" for w in data_workers.values()],
            "latency": ["n/a" if not w.get("request_seconds") else
                        f"{fmt_seconds(w['request_seconds']['p50'])} / "
                        f"{fmt_seconds(w['request_seconds']['p99'])}"
                        for w in data_workers.values()]}
        cached = st.get("autocache") or {}
        self.autocache.data = {
            "dataset": [fp[:12] for fp in cached],
            **{k: [d[k] for d in cached.values()] for k in ("splits", "hits", "computed")},
            "memory": [fmt_bytes(d["memory_bytes"]) for d in cached.values()],
            "disk": [fmt_bytes(d["disk_bytes"]) for d in cached.values()],
            "why": [next((w["why"] for w in d["decisions"].values() if w["why"]), "")
                    for d in cached.values()]}
        jobs = svc["jobs"]
        self.jobs.data = {
            "job_id": [j["job_id"] for j in jobs],
            "mode": [j["mode"] for j in jobs],
            "consumers": [j["consumers"] for j in jobs],
            "progress": [_progress(j) for j in jobs],
            "elements_served": [j["elements_served"] for j in jobs],
            "elements_per_second": [round(j["elements_per_second"], 1) for j in jobs],
            "bytes_per_second": [fmt_bytes(j["bytes_per_second"]) + "/s" for j in jobs],
            "buffered_elements": [j["buffered_elements"] for j in jobs],
            "bottleneck": [j.get("bottleneck") or "" for j in jobs],
            "input_bound": ["n/a" if j.get("input_bound") is None else
                            round(100 * j["input_bound"], 1) for j in jobs]}
        hist = [(j["job_id"], j.get("history") or {"time": [], "rate": []}) for j in jobs]
        self.job_history.data = {
            "xs": [[1000.0 * t for t in h["time"]] for _, h in hist],
            "ys": [list(h["rate"]) for _, h in hist],
            "job": [f"job {j}" for j, _ in hist],
            "color": [_COLORS[i % len(_COLORS)] for i in range(len(hist))]}
        rows = [(j["job_id"], r) for j in jobs for r in j.get("ops", [])]
        self.ops.data = {
            "job_id": [j for j, _ in rows], "op": [r["op"] for _, r in rows],
            "elements_in": ["" if r["elements_in"] is None else r["elements_in"]
                            for _, r in rows],
            "elements_out": [r["elements_out"] for _, r in rows],
            "time_per_element": [fmt_seconds(r["seconds_per_element"]) for _, r in rows],
            "seconds_per_element": [r["seconds_per_element"] for _, r in rows],
            "share": [round(100 * r["share"], 1) for _, r in rows],
            "wait": [fmt_seconds(r["wait_seconds"]) if r["wait_seconds"] else ""
                     for _, r in rows],
            "buffer": ["" if r["buffer"] is None else f"{r['buffer'][0]}/{r['buffer'][1]}"
                       for _, r in rows],
            "bottleneck": ["yes" if r["bottleneck"] else "" for _, r in rows]}
        cs = svc["consumers"]
        self.consumers.data = {
            "consumer": [c["consumer"] for c in cs], "job_id": [c["job_id"] for c in cs],
            "iteration_id": [c["iteration_id"] for c in cs],
            "seconds_since_heartbeat": [round(c["seconds_since_heartbeat"], 1) for c in cs],
            "input_bound": ["n/a" if c.get("wait_fraction") is None else
                            round(100 * c["wait_fraction"], 1) for c in cs]}
        journal = svc["journal"]
        if journal is None:
            jtext = "journal: off (not fault tolerant)"
        else:
            last = journal["last_fsync_seconds"]
            jtext = (f"journal: {journal['records']} records, {journal['bytes']} bytes, "
                     f"last fsync {'n/a' if last is None else f'{1000 * last:.2f} ms'}")
        t = st["totals"]
        slow = "; ".join(f"job {j['job_id']}: {j['bottleneck']}" for j in jobs
                         if j.get("bottleneck"))
        self.summary.text = (
            f"<b>Data service</b> on {st['scheduler']}: {len(svc['datasets'])} datasets, "
            f"{len(jobs)} jobs, {len(cs)} consumers, {len(data_workers)} data workers; "
            f"{t.get('elements_per_second', 0.0):,.0f} elements/s, "
            f"{fmt_bytes(t.get('bytes_per_second', 0.0))}/s; {jtext}"
            + (f"; <b>bottleneck</b> {slow}" if slow else ""))


def _progress(job: dict[str, Any]) -> str:
    its = job["iterations"]
    if job["mode"] == "DYNAMIC" and its:
        it = its[-1]
        return (f"{it['splits_done']}/{it['splits_total']} splits done "
                f"({it['splits_handed_out']} handed out)")
    return f"{job['elements_produced']} elements"


class ParameterServersPage(_Page):
    def __init__(self, scheduler: Any) -> None:
        super().__init__(scheduler)
        self.steps, fig_s = _timeline("dds-steps", "Training steps per second",
                                      [("steps_per_second", "steps/s", "#9467bd")])
        self.ops, fig_o = _timeline("dds-ps-ops", "Parameter-server requests per second",
                                    [("gathers_per_second", "gathers/s", "#1f77b4"),
                                     ("updates_per_second", "updates/s", "#d62728")])
        self.per_ps, fig_p = _bars("dds-ps-rate", "Updates per second, per parameter server",
                                   "updates_per_second", "#d62728")
        self.fig_p = fig_p
        self.shards, t_s = _table("dds-shards", [
            ("ps", "Parameter server"), ("variable", "Variable shard"), ("shape", "Shape"),
            ("rows", "Rows"), ("size", "Bytes"), ("dtype", "dtype"),
            ("optimizers", "Optimizer slots"), ("gathers_per_second", "Gathers/s"),
            ("updates_per_second", "Update requests/s")], height=220,
            widths={"ps": 180, "variable": 200})
        self.servers, t_p = _table("dds-ps", [
            ("ps", "Parameter server"), ("shards", "Shards"), ("gathers", "Gathers"),
            ("updates", "Updates"), ("gathers_per_second", "Gathers/s"),
            ("updates_per_second", "Updates/s"), ("dropped", "Duplicates dropped")], height=140)
        self.trainers, t_t = _table("dds-trainers", [
            ("worker", "Training worker"), ("steps", "Steps"),
            ("batches", "Function batches received"), ("steps_per_second", "Steps/s")],
            height=140, widths={"worker": 180})
        self.root = column(self.summary, row(fig_s, fig_o, sizing_mode="stretch_width"),
                           row(fig_p, sizing_mode="stretch_width"),
                           Div(text="<h3>Parameter servers</h3>"), t_p,
                           Div(text="<h3>Variable shards</h3>"), t_s,
                           Div(text="<h3>Training workers</h3>"), t_t,
                           sizing_mode="stretch_width")

    def refresh(self, st: dict[str, Any]) -> None:
        tl = st["timeline"]
        self.steps.data = {"time": _times(tl), "steps_per_second": tl["steps_per_second"]}
        self.ops.data = {"time": _times(tl), "gathers_per_second": tl["gathers_per_second"],
                         "updates_per_second": tl["updates_per_second"]}
        pss = st["parameter_servers"]
        names = list(pss)
        self.fig_p.y_range.factors = names
        self.per_ps.data = {"worker": names,
                            "updates_per_second": [p["updates_per_second"] for p in pss.values()]}
        self.servers.data = {
            "ps": names, "shards": [len(p["shards"]) for p in pss.values()],
            "gathers": [p["stats"].get("gathers", 0) for p in pss.values()],
            "updates": [p["stats"].get("updates", 0) for p in pss.values()],
            "gathers_per_second": [round(p["gathers_per_second"], 1) for p in pss.values()],
            "updates_per_second": [round(p["updates_per_second"], 1) for p in pss.values()],
            "dropped": [p["duplicates_dropped"] for p in pss.values()]}
        rows = [(a, k, s) for a, p in pss.items() for k, s in sorted(p["shards"].items())]
        self.shards.data = {
            "ps": [a for a, _, _ in rows], "variable": [shard_label(k) for _, k, _ in rows],
            "shape": [str(tuple(s["shape"])) for _, _, s in rows],
            "rows": [s["rows"] for _, _, s in rows], "bytes": [s["bytes"] for _, _, s in rows],
            "size": [fmt_bytes(s["bytes"]) for _, _, s in rows],
            "dtype": [s["dtype"] for _, _, s in rows],
            "optimizers": [", ".join(s["optimizers"]) for _, _, s in rows],
            "gathers_per_second": [round(s["gathers_per_second"], 1) for _, _, s in rows],
            "updates_per_second": [round(s["updates_per_second"], 1) for _, _, s in rows]}
        tws = st["training_workers"]
        self.trainers.data = {
            "worker": list(tws), "steps": [t["stats"].get("closures", 0) for t in tws.values()],
            "batches": [t["stats"].get("batches", 0) for t in tws.values()],
            "steps_per_second": [round(t["steps_per_second"], 1) for t in tws.values()]}
        t = st["totals"]
        self.summary.text = (
            f"<b>Parameter servers</b> on {st['scheduler']}: {len(pss)} parameter servers, "
            f"{len(rows)} variable shards, {len(tws)} training workers; "
            f"{t.get('steps_per_second', 0.0):,.1f} steps/s, "
            f"{t.get('updates_per_second', 0.0):,.1f} updates/s; coordinators: "
            + (", ".join(f"{c['queued']} functions queued, {c['finished']} finished"
                         for c in st["coordinators"].values()) or "none reporting"))


def _doc(page_cls: type[_Page], title: str) -> Any:
    @log_errors
    def make(scheduler: Any, extra: dict[str, Any], doc: Any) -> None:
        page = page_cls(scheduler)
        page.update()
        add_periodic_callback(doc, page, _ms(scheduler))
        doc.title = f"Dask: {title}"
        doc.add_root(page.root)
        doc.template = env.get_template("simple.html")
        doc.template_variables.update(extra)
        doc.theme = BOKEH_THEME

    return make


dataservice_doc = _doc(DataServicePage, "Data service")
parameter_servers_doc = _doc(ParameterServersPage, "Parameter servers")


def add_pages(scheduler: Any) -> None:
    """Serve the pages from ``scheduler``'s HTTP server and link them in Dask's navigation."""
    if getattr(scheduler, _APP_ATTR, None) is not None:
        return
    if not any(hasattr(a, "app_paths") for a in scheduler.http_application.applications):
        return  # Dask's dashboard is off on this scheduler (dashboard=False): no pages either
    from distributed.dashboard.core import BokehApplication
    from distributed.dashboard.scheduler import template_variables
    from tornado.ioloop import IOLoop

    from ._names import PAGES
    from ._routes import http_prefix

    try:
        variables = template_variables(scheduler)  # Dask's own (memoized per scheduler)
    except Exception:  # noqa: BLE001 - a scheduler started without Dask's dashboard
        variables = {"pages": [], "plots": []}
    for page in PAGES:
        if page not in variables["pages"]:
            variables["pages"].append(page)  # the list Dask's pages render their nav from
    prefix = http_prefix(scheduler)
    docs = {"/dataservice": dataservice_doc, "/parameter-servers": parameter_servers_doc}
    app = BokehApplication(docs, scheduler, prefix=prefix, template_variables=variables)
    scheduler.http_application.add_application(app)
    app.initialize(IOLoop.current())
    app.start()
    setattr(scheduler, _APP_ATTR, app)
