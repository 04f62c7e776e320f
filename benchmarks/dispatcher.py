"""The dispatcher's split-request handler, with and without the journal.

Measures ``dataservice_get_split(iteration_id, task_id, repetition, count=1)`` — the request a
data worker makes for every split of a DYNAMIC job — against a real ``distributed.Scheduler``
running the :class:`~dask_dataservice.service.dispatcher.plugin.DispatcherPlugin` in a **separate
process**, from ``C`` concurrent requesters (coroutines in this process, each with its own
connection, each looping ``await pool(address).dataservice_get_split(...)``).

Prints one JSON object per line on stdout. The first line describes the run (machine, versions,
cores, journal directory and file system, targets); then, for each concurrency, one line per
measurement and one comparison line; then a ``checks`` line (split indices), a ``summary`` line
(targets), and with ``--profile`` one ``profile`` line per server::

    {"bench": "get_split", "server": "journal", "concurrency": 16, "requests_per_s": ...,
     "latency_ms_median": ..., "latency_ms_p90": ..., "latency_ms_p99": ...,
     "records_per_fsync": ..., "server_cpu": ..., "client_cpu": ..., ...}
    {"bench": "compare", "concurrency": 16, "added_median_ms_journal": ..., "target_met": ...}

Measurements, interleaved per concurrency (1, 16, 64, 256 by default):

* ``noop`` (baseline): a handler added in the server process that does nothing and returns a
  reply of the same shape as a split reply. The cost of a scheduler RPC round trip here.
* ``get_split`` on ``server: "no_journal"``: ``DispatcherPlugin(fault_tolerant_mode=False)``.
* ``get_split`` on ``server: "journal"``: ``DispatcherPlugin(fault_tolerant_mode=True,
  work_dir=...)``: every request is one ``ProduceSplits`` record (for its ``count`` splits),
  and the reply waits for its group commit (one ``write`` + ``fdatasync`` shared by every
  record queued meanwhile).

Both servers run for the whole benchmark (an idle scheduler costs little CPU); only one is
loaded at a time. Each server sets up its state directly through the plugin, in its own
process: a dataset of 10**9 splits, a DYNAMIC job, one iteration, and one fake data worker +
task per requester (the state allows one active task per worker and iteration, so each task
gets its own fake worker address; the dispatcher never contacts workers for split requests).

Every reply is checked: ``{"status": "OK"}``, ``count`` indices, not end-of-splits, indices
strictly increasing per requester. At the end the indices handed out by each server, over all
its runs (warm-up included), must be exactly ``0 .. n-1``: no index twice and none skipped.

Per measurement: ``requests_per_s`` counts replies received during the timed window (after a
warm-up); latencies are per request, as the requester sees them (call to reply, so they include
queueing in both processes; the loop is closed, so at concurrency C the median is about
C / requests_per_s). ``server_cpu`` and ``client_cpu`` are CPU seconds per wall second of each
process over the window (1.0 = one core busy; the server's includes its journal thread, split
out in ``server_threads_cpu``), and ``*_cpu_us_per_request`` the same per request: on a busy
machine those are steadier than the rates. ``other_cpu`` is what everything else on the machine
used meanwhile (from ``/proc/stat``: other programs, the idle second server, and kernel time
for the loopback traffic not charged to either process); above ~0.2 the run was disturbed.
For journaled runs: the journal writer's records, fsyncs, ``records_per_fsync`` (the
group-commit factor) and mean write+fsync time over the window, read from
``plugin._journal.metrics`` through a handler added in the server.

The compare line gives ``added_median_ms_journal`` = journaled median − unjournaled median at
the same concurrency, and ``added_median_ms_dispatcher`` = unjournaled median − noop median.

Targets (printed beside the numbers; the ``summary`` line says which were missed, and with
``--check`` a miss makes the exit status 1): journaled ``get_split`` >= 5000 requests/s at the
best concurrency (each journaled line also says whether its own concurrency reaches it; at
concurrency 1 that would take a 0.2 ms round trip including an fsync); journaling adds <= 2 ms
median latency, at every concurrency (``compare`` lines). The loop being closed, at high
concurrency the second target is a throughput one: C * (1/journaled rate - 1/unjournaled rate)
<= 2 ms. ``disturbed_measurements`` in the summary lists the measurements during which the
rest of the machine used more than 0.2 cores.

Options:

* ``--duration 3 --warmup 0.5``: seconds per measurement; ``--concurrency 1 16 64 256``.
* ``--runs N``: N runs of each measurement, interleaved; the best (by requests/s) is reported,
  with every run's rate and median in ``runs_*``. For a shared, busy machine.
* ``--async-baseline [MS]``: also measure ``noop_async``, a no-op handler that waits MS
  milliseconds (default 0.7, about one fsync on the development machine; 0 = one event-loop
  turn) before replying, as a journaled handler waits for its group commit. ``noop_async`` −
  ``noop`` is what a reply that waits costs in Dask's comm loop, without any journal work.
* ``--settle S`` (default 2): before each measurement, wait up to S seconds until the rest of
  the machine uses < 0.25 core; ``settle_wait_s`` and ``settled`` on each line say how it went.
* ``--count K``: ask for K split indices per request (the workers' adaptive batches); adds
  ``splits_per_s``. Each index is its own journal record.
* ``--dir DIR``: parent of the journal directory (default: the system temp dir). On tmpfs fsync
  is free and the journaled figures mean nothing; ``filesystem`` in the first line says.
* ``--profile [C]``: after the measurements, one more ``get_split`` run at concurrency C
  (default 64) on each server with cProfile enabled in the server process (on Python >= 3.12
  cProfile sees every thread, so the journal's I/O thread is included); the top functions by
  own and cumulative time go to stderr, the top 30 by own time to a ``profile`` line.
  Profiled rates are much lower than unprofiled ones.
* ``--server-patch FILE``: run FILE in each server process before its scheduler starts, to try
  a change to the dispatcher or the journal (by monkeypatching) without editing them.
* ``--check``: exit status 1 if a target is missed.

Run from the repository root: ``.venv/bin/python benchmarks/dispatcher.py``. A default run
takes 50 s on a quiet machine, up to 75 s on a busy one (``--settle``), 15 s more with
``--profile``. The server processes are stopped at the end, also on errors and Ctrl-C (they
also exit by themselves if this process dies).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import fs_type

TARGET_RPS = 5000
TARGET_ADDED_MS = 2.0
DEFAULT_CONCURRENCY = (1, 16, 64, 256)
NUM_SPLITS = 10**9
MISSED: list[str] = []


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def note(msg: str) -> None:
    print(f"[dispatcher.py] {msg}", file=sys.stderr, flush=True)


# =============================================================================================
# Server process: a scheduler with the dispatcher plugin, state set up through the plugin
# =============================================================================================


async def serve(args: argparse.Namespace) -> None:
    import cProfile
    import io
    import logging
    import pstats

    from distributed import Scheduler

    from dask_dataservice.service.dispatcher.plugin import DispatcherPlugin
    from dask_dataservice.service.dispatcher.state import (
        CreateIteration,
        CreateJob,
        CreateTask,
        RegisterDataset,
        RegisterWorker,
    )

    logging.getLogger("distributed").setLevel(logging.WARNING)
    if args.server_patch:  # an A/B experiment: patch the package before the scheduler starts
        import runpy

        runpy.run_path(str(args.server_patch), run_name="__dds_bench_patch__")
    journal = args.serve == "journal"
    plugin = DispatcherPlugin(
        fault_tolerant_mode=journal, work_dir=str(args.work_dir) if journal else None
    )
    scheduler = Scheduler(
        host="127.0.0.1", port=0, dashboard=False, dashboard_address=":0", validate=False
    )
    scheduler.add_plugin(plugin)
    await scheduler

    st = plugin.state
    dataset_id = st.next_dataset_id()
    plugin._apply(RegisterDataset(dataset_id=dataset_id, fingerprint="bench", pipeline=b"x",
                                  splits=b"", num_splits=NUM_SPLITS))
    job_id = st.next_job_id()
    plugin._apply(CreateJob(job_id=job_id, job_name=None, dataset_id=dataset_id,
                            processing_mode="DYNAMIC"))
    iteration_id = st.next_iteration_id()
    plugin._apply(CreateIteration(iteration_id=iteration_id, job_id=job_id, repetition=0))
    task_ids = []
    for i in range(args.tasks):
        # One active task per (worker, iteration): one fake worker per requester.
        address = f"tcp://127.0.0.1:{10_000 + i}"
        plugin._apply(RegisterWorker(address=address, host="127.0.0.1", nthreads=1))
        task_id = st.next_task_id()
        plugin._apply(CreateTask(task_id=task_id, iteration_id=iteration_id,
                                 worker_address=address))
        task_ids.append(task_id)
    if plugin._journal_tail is not None:
        await plugin._journal_tail

    done = asyncio.Event()
    profiler: list[cProfile.Profile] = []

    def bench_noop(iteration_id=None, task_id=None, repetition=None, count=1):
        return {"status": "OK", "split_indices": list(range(count)), "end_of_splits": False}

    def thread_cpu() -> dict[str, list[float]]:
        """``{thread name: [user s, system s]}`` from /proc (empty where unavailable)."""
        import threading

        names = {t.native_id: t.name for t in threading.enumerate()}
        out: dict[str, list[float]] = {}
        try:
            tids = os.listdir("/proc/self/task")
        except OSError:
            return out
        for tid in tids:
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            name = names.get(int(tid), f"tid-{tid}")
            user, system = int(fields[11]) / _CLK_TCK, int(fields[12]) / _CLK_TCK
            prev = out.get(name, [0.0, 0.0])
            out[name] = [prev[0] + user, prev[1] + system]
        return out

    async_delay = (args.async_baseline or 0.0) / 1000

    async def bench_noop_async(iteration_id=None, task_id=None, repetition=None, count=1):
        await asyncio.sleep(async_delay)  # the reply waits, as a journaled one does
        return {"status": "OK", "split_indices": list(range(count)), "end_of_splits": False}

    def bench_stats():
        m = plugin._journal.metrics if plugin._journal is not None else None
        times = os.times()
        return {
            "status": "OK",
            "cpu_s": time.process_time(),
            "user_s": times.user,
            "system_s": times.system,
            "threads": thread_cpu(),
            "wall_s": time.perf_counter(),
            "journal": None if m is None else {
                "records_written": m.records_written, "fsyncs": m.fsyncs,
                "bytes_written": m.bytes_written, "max_batch_records": m.max_batch_records,
                "sync_seconds": m.sync_seconds,
                "sync_thread_names": sorted(m.sync_thread_names),
            },
        }

    def bench_profile(action: str, top: int = 30):
        if action == "start":
            profiler[:] = [cProfile.Profile()]
            profiler[0].enable()
            return {"status": "OK"}
        prof = profiler.pop()
        prof.disable()
        out = {"status": "OK"}
        stats = pstats.Stats(prof)
        for key in ("tottime", "cumulative"):
            buf = io.StringIO()
            stats.stream = buf
            stats.sort_stats(key).print_stats(top)
            out[key] = buf.getvalue()
        rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
        out["top_tottime"] = [
            {"function": f"{Path(file).name}:{line}({name})", "ncalls": nc,
             "tottime_s": round(tt, 4), "cumtime_s": round(ct, 4)}
            for (file, line, name), (_cc, nc, tt, ct, _callers) in rows
        ]
        out["total_tt_s"] = round(stats.total_tt, 4)
        return out

    def bench_shutdown():
        done.set()
        return {"status": "OK"}

    scheduler.handlers.update({
        "bench_noop": bench_noop, "bench_noop_async": bench_noop_async,
        "bench_stats": bench_stats,
        "bench_profile": bench_profile, "bench_shutdown": bench_shutdown,
    })
    print(json.dumps({
        "address": scheduler.address, "pid": os.getpid(), "dataset_id": dataset_id,
        "job_id": job_id, "iteration_id": iteration_id, "task_ids": task_ids,
        "journal_path": None if plugin._journal is None else str(plugin._journal.path),
    }), flush=True)

    async def watch_parent() -> None:  # exit if the benchmark process dies
        while os.getppid() == args.parent_pid:
            await asyncio.sleep(0.5)
        done.set()

    watcher = asyncio.create_task(watch_parent())
    await done.wait()
    watcher.cancel()
    await asyncio.sleep(0.05)  # let the shutdown reply go out
    await scheduler.close()


# =============================================================================================
# Benchmark process
# =============================================================================================


class Server:
    def __init__(self, kind: str, scratch: Path, tasks: int,
                 server_patch: Path | None = None, async_baseline: float | None = None) -> None:
        self.kind = kind
        self.log_path = scratch / f"server-{kind}.log"
        self.work_dir = scratch / "journal"
        cmd = [sys.executable, os.path.abspath(__file__), "--serve", kind,
               "--tasks", str(tasks), "--parent-pid", str(os.getpid())]
        if kind == "journal":
            cmd += ["--work-dir", str(self.work_dir)]
        if async_baseline is not None:
            cmd += ["--async-baseline", str(async_baseline)]
        if server_patch:
            cmd += ["--server-patch", str(Path(server_patch).resolve())]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log,
                                     start_new_session=True)
        self.info: dict = {}
        self.indices: list[int] = []  # every split index this server handed out

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if ready:
                line = self.proc.stdout.readline()
                if line:
                    self.info = json.loads(line)
                    return
            if self.proc.poll() is not None:
                break
        raise RuntimeError(f"{self.kind} server did not start:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    @property
    def address(self) -> str:
        return self.info["address"]

    def stop(self, graceful: bool) -> None:
        """Wait for a clean exit (asked by RPC) if ``graceful``, else or then kill the group."""
        if self.proc.poll() is None and graceful:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)  # its own session: the server and its threads
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                continue
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


def _pct(sorted_values: list[float], q: float) -> float:
    n = len(sorted_values)
    return sorted_values[min(n - 1, int(n * q))]


class BenchError(RuntimeError):
    pass


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_busy_s() -> float | None:
    """CPU seconds all processes on the machine have used (``/proc/stat``), or None."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
    return (user + nice + system + irq + softirq + steal) / _CLK_TCK


def _proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) of a process, or 0.0."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK
    except (OSError, IndexError, ValueError):
        return 0.0


async def settle(servers: dict[str, Server], timeout: float) -> dict:
    """Wait (up to ``timeout`` s) until the rest of the machine uses < 0.25 core over 0.25 s."""
    if timeout <= 0 or _machine_busy_s() is None:
        return {}
    pids = [s.proc.pid for s in servers.values()]
    start = time.perf_counter()
    other = None
    while True:
        m0, p0, c0 = _machine_busy_s(), sum(map(_proc_cpu_s, pids)), time.process_time()
        await asyncio.sleep(0.25)
        m1, p1, c1 = _machine_busy_s(), sum(map(_proc_cpu_s, pids)), time.process_time()
        other = max(0.0, (m1 - m0) - (p1 - p0) - (c1 - c0)) / 0.25
        waited = time.perf_counter() - start
        if other < 0.25 or waited >= timeout:
            return {"settle_wait_s": round(waited, 2), "settled": other < 0.25}


async def measure(pool, server: Server, bench: str, concurrency: int, warmup: float,
                  duration: float, *, count: int = 1, profile: bool = False) -> dict:
    """``concurrency`` requesters on ``server`` for ``warmup + duration`` seconds."""
    addr = server.address
    iteration_id = server.info["iteration_id"]
    task_ids = server.info["task_ids"][:concurrency]
    op = {"get_split": "dataservice_get_split", "noop": "bench_noop",
          "noop_async": "bench_noop_async"}[bench]
    phase = 0  # 0 warm-up, 1 timed, 2 stop
    latencies: list[float] = []
    per_requester: list[list[int]] = [[] for _ in task_ids]

    async def requester(i: int, task_id: int) -> None:
        rpc = pool(addr)
        call = getattr(rpc, op)
        mine = per_requester[i]
        last = -1
        perf = time.perf_counter
        while phase < 2:
            t = perf()
            reply = await call(iteration_id=iteration_id, task_id=task_id, repetition=0,
                               count=count)
            lat = perf() - t
            if phase == 1:
                latencies.append(lat)
            if bench != "get_split":
                continue
            if (reply.get("status") != "OK" or reply.get("end_of_splits")
                    or len(reply.get("split_indices", ())) != count):
                raise BenchError(f"{server.kind}: unexpected reply to task {task_id}: {reply!r}")
            for index in reply["split_indices"]:
                if index <= last:
                    raise BenchError(
                        f"{server.kind}: task {task_id} got index {index} after {last}")
                last = index
                mine.append(index)

    stats_rpc = pool(addr)
    if profile:
        await stats_rpc.bench_profile(action="start")
    tasks = [asyncio.create_task(requester(i, t)) for i, t in enumerate(task_ids)]
    try:
        await asyncio.sleep(warmup)
        s0 = await stats_rpc.bench_stats()
        c0, t0, m0 = time.process_time(), time.perf_counter(), _machine_busy_s()
        phase = 1
        await asyncio.sleep(duration)
        phase = 2
        c1, t1, m1 = time.process_time(), time.perf_counter(), _machine_busy_s()
        s1 = await stats_rpc.bench_stats()
        await asyncio.gather(*tasks)
    finally:
        phase = 2
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    prof = await stats_rpc.bench_profile(action="stop") if profile else None

    seconds = t1 - t0
    server_cpu_s = s1["cpu_s"] - s0["cpu_s"]
    lat = sorted(latencies)
    n = len(lat)
    if n == 0:
        raise BenchError(f"{server.kind}: no replies in {seconds:.1f}s")
    got = [i for mine in per_requester for i in mine]
    server.indices.extend(got)
    result = {
        "bench": bench,
        "server": server.kind,
        "concurrency": concurrency,
        "requests": n,
        "seconds": round(seconds, 3),
        "requests_per_s": round(n / seconds),
        **({"count": count, "splits_per_s": round(n * count / seconds)} if count > 1 else {}),
        "latency_ms_median": round(_pct(lat, 0.5) * 1e3, 3),
        "latency_ms_p90": round(_pct(lat, 0.9) * 1e3, 3),
        "latency_ms_p99": round(_pct(lat, 0.99) * 1e3, 3),
        "server_cpu": round(server_cpu_s / (s1["wall_s"] - s0["wall_s"]), 3),
        "client_cpu": round((c1 - c0) / seconds, 3),
        # CPU per request: what bounds requests/s once a process has a core to itself
        "server_cpu_us_per_request": round(server_cpu_s / n * 1e6, 1),
        "client_cpu_us_per_request": round((c1 - c0) / n * 1e6, 1),
        "server_cpu_system": round((s1["system_s"] - s0["system_s"]) / seconds, 3),
        "server_threads_cpu": {
            name: round((sum(v) - sum(s0["threads"].get(name, (0.0, 0.0)))) / seconds, 3)
            for name, v in s1["threads"].items()
            if sum(v) - sum(s0["threads"].get(name, (0.0, 0.0))) > 0
        },
        # CPU used meanwhile by everything else on the machine (other benchmarks, tests...)
        "other_cpu": None if m0 is None else round(
            max(0.0, (m1 - m0) - server_cpu_s - (c1 - c0)) / seconds, 3),
    }
    if bench == "get_split":
        result["splits_handed_out"] = len(got)
    j0, j1 = s0["journal"], s1["journal"]
    if bench == "get_split" and j1 is not None:
        records = j1["records_written"] - j0["records_written"]
        fsyncs = j1["fsyncs"] - j0["fsyncs"]
        sync_s = j1["sync_seconds"] - j0["sync_seconds"]
        result.update({
            "journal_records": records,
            "fsyncs": fsyncs,
            "records_per_fsync": round(records / fsyncs, 2) if fsyncs else None,
            "fsyncs_per_s": round(fsyncs / seconds),
            "write_fsync_ms_mean": round(sync_s / fsyncs * 1e3, 3) if fsyncs else None,
            "fsync_busy": round(sync_s / seconds, 3),
            "max_batch_records_so_far": j1["max_batch_records"],
            "fsync_threads": j1["sync_thread_names"],
        })
    if prof is not None:
        result["profile"] = prof
    return result


def _check_indices(server: Server) -> dict:
    got = server.indices
    unique = len(set(got)) == len(got)
    contiguous = unique and (not got or (min(got) == 0 and max(got) == len(got) - 1))
    if not unique:
        raise BenchError(f"{server.kind}: a split index was handed out twice")
    if not contiguous:
        raise BenchError(f"{server.kind}: split indices are not 0..n-1 (min {min(got)}, "
                         f"max {max(got)}, n {len(got)})")
    return {"server": server.kind, "splits_checked": len(got), "unique": unique,
            "contiguous_from_0": contiguous}


async def run(args: argparse.Namespace, servers: dict[str, Server]) -> list[dict]:
    from distributed.core import ConnectionPool

    pool = await ConnectionPool(limit=4 * max(args.concurrency) + 64)
    results: list[dict] = []
    try:
        for server in servers.values():  # open the stats connection, check the handlers
            reply = await pool(server.address).bench_stats()
            assert reply["status"] == "OK", reply
        for c in args.concurrency:
            row = {}
            combos = (("noop", "no_journal"),
                      *((("noop_async", "no_journal"),)
                        if args.async_baseline is not None else ()),
                      ("get_split", "no_journal"), ("get_split", "journal"))
            runs: dict[tuple[str, str], list[dict]] = {combo: [] for combo in combos}
            for _ in range(args.runs):  # interleaved, so that drifting background load is shared
                for bench, kind in combos:
                    settled = await settle(servers, args.settle)
                    r = await measure(pool, servers[kind], bench, c, args.warmup,
                                      args.duration, count=args.count)
                    runs[(bench, kind)].append({**r, **settled})
            for bench, kind in combos:
                r = max(runs[(bench, kind)], key=lambda r: r["requests_per_s"])
                if args.runs > 1:
                    r["best_of_runs"] = args.runs
                    r["runs_requests_per_s"] = [x["requests_per_s"] for x in runs[(bench, kind)]]
                    r["runs_latency_ms_median"] = [
                        x["latency_ms_median"] for x in runs[(bench, kind)]]
                if bench == "get_split" and kind == "journal":
                    r["target"] = f">= {TARGET_RPS} requests/s (at the best concurrency)"
                    r["met_at_this_concurrency"] = r["requests_per_s"] >= TARGET_RPS
                emit(r)
                results.append(r)
                row[(bench, kind)] = r
            noop = row[("noop", "no_journal")]
            nj = row[("get_split", "no_journal")]
            j = row[("get_split", "journal")]
            added = j["latency_ms_median"] - nj["latency_ms_median"]
            cmp = {
                "bench": "compare",
                "concurrency": c,
                "requests_per_s": {"noop": noop["requests_per_s"],
                                   "no_journal": nj["requests_per_s"],
                                   "journal": j["requests_per_s"]},
                "latency_ms_median": {"noop": noop["latency_ms_median"],
                                      "no_journal": nj["latency_ms_median"],
                                      "journal": j["latency_ms_median"]},
                **({"noop_async_requests_per_s": row[("noop_async", "no_journal")][
                    "requests_per_s"]} if args.async_baseline is not None else {}),
                "added_median_ms_journal": round(added, 3),
                "added_median_ms_dispatcher": round(
                    nj["latency_ms_median"] - noop["latency_ms_median"], 3),
                "journal_throughput_ratio": round(j["requests_per_s"] / nj["requests_per_s"], 3),
                "records_per_fsync": j.get("records_per_fsync"),
                "target": f"added_median_ms_journal <= {TARGET_ADDED_MS}",
                "target_met": added <= TARGET_ADDED_MS,
            }
            emit(cmp)
            results.append(cmp)
        emit({"bench": "checks", "servers": [_check_indices(s) for s in servers.values()]})
        emit(summary(results))
        if args.profile:
            c = args.profile
            for kind in ("journal", "no_journal"):
                r = await measure(pool, servers[kind], "get_split", c, args.warmup,
                                  args.duration, count=args.count, profile=True)
                prof = r.pop("profile")
                note(f"cProfile of the {kind} server process, get_split at concurrency {c} "
                     f"({r['requests_per_s']} requests/s under the profiler)\n"
                     f"{prof['tottime']}\n{prof['cumulative']}")
                emit({"bench": "profile", **r, "under_profiler": True,
                      "profiled_total_tt_s": prof["total_tt_s"],
                      "top_tottime": prof["top_tottime"]})
            for server in servers.values():
                _check_indices(server)  # raises if the profiled runs broke uniqueness
        for server in servers.values():
            try:
                await pool(server.address).bench_shutdown()
            except Exception as e:  # noqa: BLE001 - the server is killed anyway
                note(f"{server.kind}: shutdown request failed: {e!r}")
    finally:
        await pool.close()
    return results


def summary(results: list[dict]) -> dict:
    """The targets over the whole run (the throughput one at the best concurrency)."""
    journaled = [r for r in results if r["bench"] == "get_split" and r["server"] == "journal"]
    best = max(journaled, key=lambda r: r["requests_per_s"])
    rps_met = best["requests_per_s"] >= TARGET_RPS
    if not rps_met:
        MISSED.append(f"journaled get_split requests/s (best {best['requests_per_s']})")
    added = {r["concurrency"]: r["added_median_ms_journal"]
             for r in results if r["bench"] == "compare"}
    latency_met = all(v <= TARGET_ADDED_MS for v in added.values())
    MISSED.extend(f"added median latency at concurrency {c} ({v} ms)"
                  for c, v in added.items() if v > TARGET_ADDED_MS)
    disturbed = [f"{r['bench']} {r['server']} C={r['concurrency']} ({r['other_cpu']})"
                 for r in results if r.get("other_cpu") is not None and r["other_cpu"] > 0.2]
    return {
        "bench": "summary",
        "journal_requests_per_s_by_concurrency": {
            r["concurrency"]: r["requests_per_s"] for r in journaled},
        "journal_requests_per_s_best": best["requests_per_s"],
        "best_at_concurrency": best["concurrency"],
        "rps_target": f">= {TARGET_RPS} journaled get_split requests/s",
        "rps_target_met": rps_met,
        "added_median_ms_by_concurrency": added,
        "latency_target": f"journaling adds <= {TARGET_ADDED_MS} ms median latency, at every "
                          "concurrency",
        "latency_target_met": latency_met,
        "targets_missed": list(MISSED),
        "target_met": not MISSED,
        "disturbed_measurements": disturbed,
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_commit() -> str | None:
    try:
        root = Path(__file__).resolve().parent.parent
        env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, env=env,
                              timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def header(args: argparse.Namespace, scratch: Path) -> dict:
    import dask
    import distributed
    import msgpack
    import tornado

    cpus = os.cpu_count()
    return {
        "bench": "run",
        "handler": f"dataservice_get_split(iteration_id, task_id, repetition=0, "
                   f"count={args.count})",
        "python": platform.python_version(),
        "dask": dask.__version__,
        "distributed": distributed.__version__,
        "tornado": tornado.version,
        "msgpack": ".".join(map(str, msgpack.version)),
        "git_commit": _git_commit(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpus": cpus,
        "loadavg_1min_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "processes": ("scheduler + DispatcherPlugin: one process per server (journal, "
                      "no_journal); requesters: all coroutines in this process, one "
                      "connection each"),
        "cpu_note": (f"{cpus}-core machine: the requester process and the loaded scheduler "
                     "process (with its journal I/O thread) compete for the cores; see "
                     "server_cpu/client_cpu (1.0 = one core) on each line, and other_cpu "
                     "for what the rest of the machine used meanwhile"
                     if cpus and cpus <= 4 else None),
        "journal_dir": str(scratch / "journal"),
        "filesystem": fs_type(scratch.resolve()),
        "concurrency": args.concurrency,
        "warmup_s": args.warmup,
        "runs": args.runs,
        "settle_s": args.settle,
        "async_baseline_ms": args.async_baseline,
        "server_patch": str(args.server_patch) if args.server_patch else None,
        "duration_s": args.duration,
        "targets": {"journaled_get_split_requests_per_s": f">= {TARGET_RPS}",
                    "added_median_latency_ms": f"<= {TARGET_ADDED_MS}"},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(DEFAULT_CONCURRENCY))
    parser.add_argument("--duration", type=float, default=3.0, help="timed seconds per run")
    parser.add_argument("--warmup", type=float, default=0.5, help="warm-up seconds per run")
    parser.add_argument("--async-baseline", type=float, nargs="?", const=0.7, default=None,
                        metavar="MS",
                        help="also measure a no-op handler that waits MS milliseconds "
                             "(default 0.7, about one fsync here) before replying")
    parser.add_argument("--settle", type=float, default=2.0, metavar="S",
                        help="before each measurement, wait up to S seconds for the rest of "
                             "the machine to use < 0.25 core (0: don't wait)")
    parser.add_argument("--count", type=int, default=1,
                        help="split indices per request (the handler's count argument)")
    parser.add_argument("--runs", type=int, default=1,
                        help="runs per measurement (interleaved); the best is reported")
    parser.add_argument("--dir", type=Path, default=None, help="parent of the scratch directory")
    parser.add_argument("--profile", type=int, nargs="?", const=64, default=0, metavar="C",
                        help="also profile the journaled server at concurrency C (default 64)")
    parser.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    parser.add_argument("--server-patch", type=Path, default=None, metavar="FILE",
                        help="run FILE in each server process before its scheduler starts (to "
                             "try a change to the dispatcher or journal without editing them)")
    # internal: the server process
    parser.add_argument("--serve", choices=("journal", "no_journal"), help=argparse.SUPPRESS)
    parser.add_argument("--work-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--tasks", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.serve:
        asyncio.run(serve(args))
        return 0

    scratch = Path(tempfile.mkdtemp(prefix="dds-dispatcher-bench-", dir=args.dir))
    emit(header(args, scratch))
    tasks = max(args.concurrency + ([args.profile] if args.profile else []))
    servers: dict[str, Server] = {}

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    graceful = False
    try:
        for kind in ("no_journal", "journal"):
            servers[kind] = Server(kind, scratch, tasks, args.server_patch, args.async_baseline)
        for server in servers.values():
            server.wait_ready()
        asyncio.run(run(args, servers))
        graceful = True
    except KeyboardInterrupt:
        note("interrupted; stopping the servers")
        return 130
    except BaseException:
        for server in servers.values():
            if server.proc.poll() is not None and server.proc.returncode != 0:
                note(f"{server.kind} server exited with {server.proc.returncode}:\n"
                     f"{server.log_tail()}")
        raise
    finally:
        for server in servers.values():
            server.stop(graceful)
        shutil.rmtree(scratch, ignore_errors=True)
    return 1 if (args.check and MISSED) else 0


if __name__ == "__main__":
    sys.exit(main())
