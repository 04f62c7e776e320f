"""What one dispatcher costs per worker, per consumer and per split, at 10 to 1,000 workers.

These machines have 2 cores; users run 100-1,000 workers. This script measures the
dispatcher's CPU cost per request with many *simulated* workers and consumers, so that
``docs/scaling.md`` can predict how many of them one scheduler serves at a given rate.

The dispatcher is real: a ``distributed.Scheduler`` with the
:class:`~dask_dataservice.service.dispatcher.plugin.DispatcherPlugin`, in this process, and
every request goes through the real handlers (validation, state updates, the journal when
``--journal``). The workers and consumers are fake: a fake worker is a ``WorkerState`` in
``scheduler.workers`` with a key in the access guard and an inbox in place of its stream
(the messages the dispatcher pushes to it are counted, not sent); a consumer is an
iteration client. No network: the figures are the dispatcher's own CPU per request. What the
scheduler spends to receive and answer one RPC message comes on top: ``--rpc`` measures it
with a real TCP round trip to a no-op handler (client in the same process, so its figure is
client + server; the server's share is about half).

Measured, per number of workers ``N`` (10, 100, 1000 by default), with ``J`` DYNAMIC jobs
(each with one iteration; every worker has one task of each), ``C = N`` consumers:

* ``worker_heartbeat``: a data worker's periodic reconciliation (steady state: it reports
  its ``J`` tasks, nothing changes). Cost must not grow with ``N``: O(tasks of the caller).
* ``client_heartbeat``: a consumer's periodic poll, ``sends: "view"`` when the consumer has no
  current view (the answer lists every task of the iteration: O(N) to send, built once per
  view epoch) and ``sends: "unchanged"`` in the steady state (the consumer sends the version it
  has; the answer is "unchanged": O(1); see ``service/dispatcher/_views.py``).
* ``get_split``: a data worker taking ``count`` splits (1 and 64). O(count).
* ``create_job``: ``get_or_create_job`` + ``get_or_create_iteration`` (one task per worker,
  each pushed to its worker): O(N) once per job and epoch.

Output: JSON lines: a header, one line per (bench, N) with ``us_per_call`` (CPU of this process, all threads, best of
``--repeats``; with the machine's load stated in the header) and ``us_per_unit`` where a call
covers several units (splits), and a ``model`` line with the per-request costs the docs use.

Usage::

    .venv/bin/python benchmarks/dispatcher_scale.py               # N = 10, 100, 1000
    .venv/bin/python benchmarks/dispatcher_scale.py --workers 10 100 --jobs 4 --journal
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


class _Inbox:
    """A fake worker's stream: counts what the dispatcher pushes to it."""

    def __init__(self) -> None:
        self.messages = 0

    def send(self, *msgs: object) -> None:
        self.messages += len(msgs)


def _fake_worker(scheduler, plugin, address: str, key: str) -> _Inbox:
    """A ``WorkerState`` in ``scheduler.workers`` with ``key`` in the access guard and an
    :class:`_Inbox` for its stream (returned)."""
    from distributed.scheduler import WorkerState

    scheduler.workers[address] = WorkerState(
        address=address, status=scheduler.status, pid=0, name=address, nthreads=1,
        memory_limit=0, local_directory="/tmp", nanny=None, server_id=f"fake-{key}",
        services={}, versions={}, extra={})
    inbox = scheduler.stream_comms[address] = _Inbox()
    plugin._access._keys[address] = key
    return inbox


def _loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


async def _time_calls(make_call, calls: int, repeats: int, concurrency: int = 16) -> float:
    """Best-of-``repeats`` CPU microseconds per call of ``await make_call(i)``.

    ``concurrency`` requesters run at once (as many workers would), so that journaled
    requests share their group commit instead of each waiting for its own fsync; the figure
    is this process's CPU time (every thread: the journal writer's too) per call, which is
    what the scheduler spends — steadier than wall time on a loaded machine.
    """
    best = float("inf")
    for _ in range(repeats):
        counter = iter(range(calls))

        async def requester(counter=counter) -> None:
            for i in counter:
                result = make_call(i)
                if asyncio.iscoroutine(result):
                    result = await result
                if result.get("status") != "OK":
                    raise RuntimeError(f"request failed: {result}")

        cpu0 = time.process_time()
        await asyncio.gather(*(requester() for _ in range(concurrency)))
        best = min(best, (time.process_time() - cpu0) / calls * 1e6)
    return best


@contextlib.asynccontextmanager
async def _dispatcher(plugin):
    """A real ``distributed.Scheduler`` with ``plugin`` for fake workers; the fake workers are
    forgotten (nothing to close) and the scheduler closed on the way out."""
    import dask
    from distributed import Scheduler

    # Fake workers and consumers heartbeat only when measured: keep the liveness checks from
    # dropping them. No work stealing: its balance loop would walk the fake workers' (empty)
    # occupancy.
    with dask.config.set({"dataservice.dispatcher.worker-timeout": "1h",
                          "dataservice.dispatcher.client-timeout": "1h",
                          "distributed.scheduler.work-stealing": False}):
        scheduler = Scheduler(host="127.0.0.1", port=0, dashboard=False,
                              dashboard_address=":0", validate=False)
        scheduler.add_plugin(plugin)
        await scheduler
        try:
            yield scheduler
        finally:
            for address in list(scheduler.workers):
                scheduler.workers.pop(address, None)
                scheduler.stream_comms.pop(address, None)
            await scheduler.close()


async def scenario(n_workers: int, n_jobs: int, args: argparse.Namespace, scratch: Path) -> list[dict]:
    from dask_dataservice.service.dispatcher.plugin import DispatcherPlugin

    work_dir = scratch / f"journal-{n_workers}-{n_jobs}" if args.journal else None
    plugin = DispatcherPlugin(fault_tolerant_mode=args.journal,
                              work_dir=str(work_dir) if work_dir else None)
    results: list[dict] = []
    async with _dispatcher(plugin) as scheduler:
        addresses, keys, inboxes = [], {}, {}
        for i in range(n_workers):
            address = f"tcp://127.0.0.{2 + i // 50_000}:{10_000 + i % 50_000}"
            inboxes[address] = _fake_worker(scheduler, plugin, address, f"key-{i}")
            keys[address] = f"key-{i}"
            addresses.append(address)
        # Register every fake worker through the real heartbeat.
        for address in addresses:
            reply = await plugin.worker_heartbeat(address=address, host="127.0.0.1", nthreads=1,
                                                  worker_key=keys[address])
            assert reply["status"] == "OK", reply

        # Jobs: one dataset, J DYNAMIC jobs, one iteration each (one task per worker).
        reply = await plugin.register_dataset(fingerprint="scale", pipeline=b"x", splits=None,
                                              num_splits=10**9)
        assert reply["status"] == "OK", reply
        dataset_id = reply["dataset_id"]
        jobs: list[tuple[int, str, int]] = []  # (job id, token, iteration id)

        def create_job(j: int):
            async def go():
                job = await plugin.get_or_create_job(dataset_id=dataset_id,
                                                     processing_mode="DYNAMIC")
                assert job["status"] == "OK", job
                it = await plugin.get_or_create_iteration(job_id=job["job_id"],
                                                          job_token=job["job_token"])
                assert it["status"] == "OK", it
                jobs.append((job["job_id"], job["job_token"], it["iteration_id"]))
                return it
            return go()

        pushed_before = sum(box.messages for box in inboxes.values())
        start = time.perf_counter()
        for j in range(n_jobs):
            await create_job(j)
        per_job = (time.perf_counter() - start) / n_jobs * 1e6
        pushed = sum(box.messages for box in inboxes.values()) - pushed_before
        results.append({"bench": "create_job", "workers": n_workers, "jobs": n_jobs,
                        "us_per_call": round(per_job, 1),
                        "us_per_worker": round(per_job / n_workers, 2),
                        "messages_pushed_per_job": pushed / n_jobs})

        tasks_of = {a: [t.task_id for t in plugin.state.tasks_for_worker(a)] for a in addresses}
        assert all(len(t) == n_jobs for t in tasks_of.values()), "one task per job per worker"

        # Steady-state worker heartbeats: the worker reports its J tasks, nothing changes.
        def heartbeat(i: int):
            address = addresses[i % n_workers]
            return plugin.worker_heartbeat(address=address, host="127.0.0.1", nthreads=1,
                                           active_tasks=tasks_of[address],
                                           worker_key=keys[address])

        calls = max(200, min(5_000, 20 * n_workers))
        us = await _time_calls(heartbeat, calls, args.repeats)
        results.append({"bench": "worker_heartbeat", "workers": n_workers, "jobs": n_jobs,
                        "tasks_per_worker": n_jobs, "us_per_call": round(us, 2)})

        # Consumers: C = N iteration clients spread over the J jobs.
        consumers: list[tuple[int, str]] = []
        for c in range(n_workers):
            job_id, token, iteration_id = jobs[c % n_jobs]
            reply = await plugin.get_or_create_iteration(job_id=job_id, job_token=token)
            assert reply["status"] == "OK", reply
            consumers.append((reply["iteration_client_id"], token))

        def client_heartbeat(i: int):
            client_id, token = consumers[i % len(consumers)]
            return plugin.client_heartbeat(iteration_client_id=client_id, job_token=token)

        us = await _time_calls(client_heartbeat, calls, args.repeats)
        results.append({"bench": "client_heartbeat", "workers": n_workers, "jobs": n_jobs,
                        "consumers": len(consumers), "tasks_in_view": n_workers,
                        "sends": "view", "us_per_call": round(us, 2)})
        # Before versioned views: the view was built afresh for every heartbeat (A/B in this
        # run: the cache is emptied before each call, so each call builds the view again).
        def client_heartbeat_rebuilt(i: int):
            client_id, token = consumers[i % len(consumers)]
            plugin._views._views.clear()
            return plugin.client_heartbeat(iteration_client_id=client_id, job_token=token)

        if n_workers <= 1_000:  # 40 ms a call at 10,000 workers: history, not a curve
            us = await _time_calls(client_heartbeat_rebuilt, calls, args.repeats)
            results.append({"bench": "client_heartbeat", "workers": n_workers, "jobs": n_jobs,
                            "consumers": len(consumers), "tasks_in_view": n_workers,
                            "sends": "view, rebuilt each call (before versioned views)",
                            "us_per_call": round(us, 2)})
        # What a consumer sends in the steady state: the version it has (service/dispatcher/_views.py).
        version = plugin._views.version if hasattr(plugin, "_views") else None

        def client_heartbeat_unchanged(i: int):
            client_id, token = consumers[i % len(consumers)]
            if version is None:
                return plugin.client_heartbeat(iteration_client_id=client_id, job_token=token)
            return plugin.client_heartbeat(iteration_client_id=client_id, job_token=token,
                                           view_version=version)

        us = await _time_calls(client_heartbeat_unchanged, calls, args.repeats)
        results.append({"bench": "client_heartbeat", "workers": n_workers, "jobs": n_jobs,
                        "consumers": len(consumers), "tasks_in_view": n_workers,
                        "sends": "unchanged" if version else "view",
                        "us_per_call": round(us, 2)})

        # Split requests.
        job_id, token, iteration_id = jobs[0]
        task_of = {a: plugin.state.tasks_for_worker(a) for a in addresses}
        split_tasks = [next(t.task_id for t in task_of[a] if t.iteration_id == iteration_id)
                       for a in addresses]
        for count in (1, 64):
            def get_split(i: int, count: int = count):
                return plugin.get_split(iteration_id=iteration_id,
                                        task_id=split_tasks[i % n_workers], repetition=0,
                                        count=count, job_token=token)

            us = await _time_calls(get_split, max(500, calls), args.repeats)
            results.append({"bench": "get_split", "workers": n_workers, "count": count,
                            "journal": args.journal, "us_per_call": round(us, 2),
                            "us_per_unit": round(us / count, 3), "unit": "split"})

        # A worker joining: its first heartbeat registers it and hands it a task of each of
        # the J live iterations. O(J), whatever N.
        joiners = []
        for i in range(min(200, max(20, n_workers // 10))):
            address = f"tcp://127.1.{i // 250}.{i % 250}:{9_000}"
            inboxes[address] = _fake_worker(scheduler, plugin, address, f"joiner-key-{i}")
            keys[address] = f"joiner-key-{i}"
            joiners.append(address)
        cpu0 = time.process_time()
        for address in joiners:
            reply = await plugin.worker_heartbeat(address=address, host="127.1.0.1", nthreads=1,
                                                  worker_key=keys[address])
            assert reply["status"] == "OK" and len(reply["new_tasks"]) == n_jobs, reply
        us = (time.process_time() - cpu0) / len(joiners) * 1e6
        results.append({"bench": "worker_join", "workers": n_workers, "jobs": n_jobs,
                        "us_per_call": round(us, 2), "us_per_unit": round(us / n_jobs, 2),
                        "unit": "task handed out"})

        # A static job (DATA sharding over a worker list naming all N workers): its first
        # iteration creates a task per listed worker, each finding its shard. Then every task
        # finishes (a worker heartbeat reporting it), which ends the iteration.
        plugin._core.config = dataclasses.replace(plugin._core.config,
                                                  worker_addresses=tuple(addresses))
        cpu0 = time.process_time()
        job = await plugin.get_or_create_job(dataset_id=dataset_id, processing_mode="DATA")
        it = await plugin.get_or_create_iteration(job_id=job["job_id"], job_token=job["job_token"])
        us = (time.process_time() - cpu0) * 1e6
        assert it["status"] == "OK", it
        static_tasks = plugin.state.tasks_for_iteration(it["iteration_id"])
        assert sorted(t.shard_index for t in static_tasks) == list(range(n_workers))
        results.append({"bench": "create_job_static", "workers": n_workers,
                        "us_per_call": round(us, 1), "us_per_unit": round(us / n_workers, 2),
                        "unit": "task handed out"})
        cpu0 = time.process_time()
        for t in static_tasks:
            address = t.worker_address
            active = [x.task_id for x in plugin.state.tasks_for_worker(address)
                      if x.task_id != t.task_id]
            reply = await plugin.worker_heartbeat(address=address, host="127.0.0.1", nthreads=1,
                                                  active_tasks=active, finished_tasks=[t.task_id],
                                                  worker_key=keys[address])
            assert reply["status"] == "OK", reply
        us = (time.process_time() - cpu0) / n_workers * 1e6
        assert plugin.state.iteration(it["iteration_id"]).finished
        results.append({"bench": "finish_static_task", "workers": n_workers,
                        "us_per_call": round(us, 2), "unit": "heartbeat finishing one task"})

        # The periodic GC tick (every 500 ms) in the steady state: nobody is silent.
        results.append(_gc_ticks(plugin, n_workers=n_workers + len(joiners),
                                 consumers=len(consumers), repeats=args.repeats))
    for r in results:
        r["loadavg"] = _loadavg()
    return results


def _gc_ticks(plugin, *, n_workers: int, consumers: int, repeats: int, ticks: int = 20) -> dict:
    """CPU per GC tick (``plugin._gc``) when no worker and no consumer is silent."""
    best = float("inf")
    for _ in range(repeats):
        cpu0 = time.process_time()
        for _ in range(ticks):
            plugin._gc()
        best = min(best, (time.process_time() - cpu0) / ticks * 1e6)
    return {"bench": "gc_tick", "workers": n_workers, "consumers": consumers,
            "us_per_call": round(best, 2), "unit": "tick, nobody silent"}


async def consumers_scenario(n_consumers: int, args: argparse.Namespace) -> list[dict]:
    """``n_consumers`` consumers of one named DYNAMIC job on 10 fake workers: what joining
    costs (``get_or_create_iteration``), a steady heartbeat, and the GC tick."""
    from dask_dataservice.service.dispatcher.plugin import DispatcherPlugin

    plugin = DispatcherPlugin()
    results: list[dict] = []
    async with _dispatcher(plugin) as scheduler:
        for i in range(10):
            address = f"tcp://127.0.0.2:{10_000 + i}"
            _fake_worker(scheduler, plugin, address, f"key-{i}")
            await plugin.worker_heartbeat(address=address, host="127.0.0.2", nthreads=1,
                                          worker_key=f"key-{i}")
        reply = await plugin.register_dataset(fingerprint="consumers", pipeline=b"x",
                                              splits=None, num_splits=10**9)
        job = await plugin.get_or_create_job(dataset_id=reply["dataset_id"],
                                       processing_mode="DYNAMIC", job_name="shared")
        clients = []
        cpu0 = time.process_time()
        for _ in range(n_consumers):
            it = await plugin.get_or_create_iteration(job_id=job["job_id"],
                                                      job_token=job["job_token"])
            clients.append(it["iteration_client_id"])
        us = (time.process_time() - cpu0) / n_consumers * 1e6
        results.append({"bench": "client_join", "consumers": n_consumers,
                        "us_per_call": round(us, 2)})
        version = plugin._views.version

        def heartbeat(i: int):
            return plugin.client_heartbeat(iteration_client_id=clients[i % n_consumers],
                                           job_token=job["job_token"], view_version=version)

        us = await _time_calls(heartbeat, max(2_000, min(n_consumers, 20_000)), args.repeats)
        results.append({"bench": "client_heartbeat", "consumers": n_consumers,
                        "sends": "unchanged", "us_per_call": round(us, 2)})
        results.append(_gc_ticks(plugin, n_workers=10, consumers=n_consumers,
                                 repeats=args.repeats))
    for r in results:
        r["loadavg"] = _loadavg()
    return results


def revive_scenario(n_workers: int, n_jobs: int) -> dict:
    """A dispatcher restart: the journal's state (``N`` workers, ``J`` DYNAMIC iterations with
    a task on each) restored into a new core, then every worker's first heartbeat, back with
    its tasks (``resumed``). Pure (the core, no scheduler): CPU per revived worker."""
    from dask_dataservice.service.dispatcher.core import CoreConfig, DispatcherCore, WorkerInfo

    class Cluster:
        def __init__(self) -> None:
            self.workers: dict[str, WorkerInfo] = {}

        def worker(self, address: str) -> WorkerInfo | None:
            return self.workers.get(address)

        def holders(self, key: object) -> list[str]:
            return []

    cluster = Cluster()
    core = DispatcherCore(CoreConfig(worker_timeout=3600.0, client_timeout=3600.0), cluster,
                          100.0, new_token=lambda: "t", view_nonce="n")
    for i in range(n_workers):
        address = f"tcp://10.0.{i // 250}.{i % 250}:9000"
        cluster.workers[address] = WorkerInfo(address=address, host=address[6:-5], nthreads=1,
                                              resources={}, name=address)
        core.worker_heartbeat(cluster.workers[address], 100.0)
    ds = core.register_dataset("fp", b"p", b"s", 10**9).reply["dataset_id"]
    for j in range(n_jobs):
        job = core.get_or_create_job(ds, "DYNAMIC", job_name=f"j{j}").reply
        core.get_or_create_iteration(job["job_id"], 100.0, job_token=job["job_token"])
    held = {a: [t.task_id for t in core.state.tasks_for_worker(a)] for a in cluster.workers}
    restarted = DispatcherCore(CoreConfig(worker_timeout=3600.0, client_timeout=3600.0),
                               cluster, 200.0, new_token=lambda: "t", view_nonce="m")
    cpu0 = time.process_time()
    restarted.restore(core.state)
    restore_us = (time.process_time() - cpu0) * 1e6
    cpu0 = time.process_time()
    for address, info in cluster.workers.items():
        out = restarted.worker_heartbeat(info, 200.0, active_tasks=held[address], resumed=True)
        assert out.reply["new_tasks"] == [], out.reply
    us = (time.process_time() - cpu0) / n_workers * 1e6
    return {"bench": "revive_worker", "workers": n_workers, "jobs": n_jobs,
            "us_per_call": round(us, 2), "restore_us": round(restore_us, 1),
            "unit": "first heartbeat after a dispatcher restart", "loadavg": _loadavg()}


def slopes(results: list[dict]) -> list[dict]:
    """For each curve, the exponent ``b`` of ``cost ~ size**b`` (least squares on logs):
    0 is flat, 1 linear. Size is workers, or consumers for the consumer sweep; the cost is
    per unit where a call covers several (per task handed out, per split), else per call."""
    import math

    curves: dict[tuple, list[tuple[float, float]]] = {}
    for r in results:
        if "us_per_call" not in r or r["bench"] in ("rpc_noop", "model"):
            continue
        size_key = "workers" if r.get("sweep") != "consumers" else "consumers"
        key = (r["bench"], r.get("sweep", "workers"), r.get("count"), r.get("sends"))
        cost = r.get("us_per_unit", r.get("us_per_worker", r["us_per_call"]))
        curves.setdefault(key, []).append((r[size_key], max(cost, 1e-3)))
    out = []
    for (bench, sweep, count, sends), points in curves.items():
        if len(points) < 2:
            continue
        xs = [math.log10(x) for x, _ in points]
        ys = [math.log10(y) for _, y in points]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
        row = {"bench": "slope", "curve": bench, "sweep": sweep, "exponent": round(b, 2),
               "points": points}
        if count is not None:
            row["count"] = count
        if sends is not None:
            row["sends"] = sends
        out.append(row)
    return out


def plot(results: list[dict], path: str, before: list[dict] | None = None) -> None:
    """Cost per request against cluster size, log-log, one line per curve; with ``before``
    (the rows of an earlier run), its curves that grew faster are drawn dashed beside."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 6.2))
    for ax in (left, right):
        ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)
    now = {(r["curve"], r["sweep"], r.get("count"), r.get("sends")): r for r in slopes(results)}
    for row in slopes(before or []):
        later = now.get((row["curve"], row["sweep"], row.get("count"), row.get("sends")))
        if later is None or row["exponent"] < later["exponent"] + 0.3:
            continue
        xs, ys = zip(*row["points"], strict=True)
        (right if row["sweep"] == "consumers" else left).plot(
            xs, ys, marker="x", linestyle="--", color="grey",
            label=f"{row['curve']} before: slope {row['exponent']:.2f}")
    for row in slopes(results):
        label = row["curve"] + (f" ({row['count']} splits)" if "count" in row else "") + \
            (f", {row['sends']}" if "sends" in row and row["sends"] != "unchanged" else "") + \
            f": slope {row['exponent']:.2f}"
        if "rebuilt" in label:
            continue
        xs, ys = zip(*row["points"], strict=True)
        (right if row["sweep"] == "consumers" else left).plot(xs, ys, marker="o", label=label)
    for ax, what in ((left, "data workers"), (right, "consumers (10 data workers)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(what)
        ax.set_ylabel("dispatcher CPU per request or per unit (µs)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def rpc_roundtrip(args: argparse.Namespace) -> dict:
    """A real TCP round trip to a no-op scheduler handler (client in this process)."""
    from distributed import Scheduler
    from distributed.core import rpc

    scheduler = Scheduler(host="127.0.0.1", port=0, dashboard=False, dashboard_address=":0",
                          validate=False)
    scheduler.handlers["bench_noop"] = lambda: {"status": "OK"}
    await scheduler
    try:
        async with rpc(scheduler.address) as r:
            await r.bench_noop()
            cpu0, start = time.process_time(), time.perf_counter()
            n = args.rpc_calls
            for _ in range(n):
                await r.bench_noop()
            wall = (time.perf_counter() - start) / n * 1e6
            cpu = (time.process_time() - cpu0) / n * 1e6
    finally:
        await scheduler.close()
    return {"bench": "rpc_noop", "us_per_call": round(wall, 1),
            "cpu_us_per_call_both_sides": round(cpu, 1), "loadavg": _loadavg()}


def model(results: list[dict], rpc: dict | None) -> dict:
    """The per-request costs the docs' capacity model uses (largest N measured)."""
    def pick(bench: str, **match) -> dict | None:
        rows = [r for r in results if r["bench"] == bench and "sweep" not in r
                and "workers" in r and all(r.get(k) == v for k, v in match.items())]
        return max(rows, key=lambda r: r["workers"]) if rows else None

    out: dict = {"bench": "model"}
    hb = pick("worker_heartbeat")
    ch = pick("client_heartbeat", sends="view")
    chu = pick("client_heartbeat", sends="unchanged")
    s1, s64 = pick("get_split", count=1), pick("get_split", count=64)
    cj = pick("create_job")
    if hb:
        out["worker_heartbeat_us"] = hb["us_per_call"]
    if ch:
        out["client_heartbeat_us_per_task_in_view"] = round(ch["us_per_call"] / ch["tasks_in_view"], 3)
    if chu:
        out["client_heartbeat_unchanged_us"] = chu["us_per_call"]
    if s1 and s64:
        out["get_split_us_per_call"] = s1["us_per_call"]
        out["get_split_us_per_split_at_64"] = s64["us_per_unit"]
    if cj:
        out["create_job_us_per_worker"] = cj["us_per_worker"]
    if rpc:
        out["rpc_server_us_per_message_estimate"] = round(rpc["cpu_us_per_call_both_sides"] / 2, 1)
    return out


async def main_async(args: argparse.Namespace) -> None:
    import dask
    import distributed

    import dask_dataservice

    logging.getLogger("distributed").setLevel(logging.ERROR)

    emit({"bench": "header", "python": platform.python_version(), "dask": dask.__version__,
          "distributed": distributed.__version__, "dask_dataservice": dask_dataservice.__version__,
          "cpus": os.cpu_count(), "loadavg": _loadavg(), "workers": args.workers,
          "jobs": args.jobs, "journal": args.journal, "repeats": args.repeats})
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="dds-scale-") as scratch:
        for n in args.workers:
            rows = await scenario(n, args.jobs, args, Path(scratch))
            for r in rows:
                emit(r)
            results.extend(rows)
    for n in args.revive:
        row = revive_scenario(n, args.jobs)
        emit(row)
        results.append(row)
    for c in args.consumers:
        rows = await consumers_scenario(c, args)
        for r in rows:
            r["sweep"] = "consumers"
            emit(r)
        results.extend(rows)
    rpc = await rpc_roundtrip(args) if args.rpc_calls else None
    if rpc:
        emit(rpc)
    emit(model(results, rpc))
    for row in slopes(results):
        emit(row)
    if args.plot:
        before = None
        if args.before:
            with open(args.before) as f:
                before = [json.loads(line) for line in f if line.strip()]
        plot(results, args.plot, before)


def replot(path: str, out: str, before: str | None) -> None:
    """Draw the plot from a saved run (this script's JSON lines) without measuring again."""
    with open(path) as f:
        results = [json.loads(line) for line in f if line.strip()]
    prior = None
    if before:
        with open(before) as f:
            prior = [json.loads(line) for line in f if line.strip()]
    plot([r for r in results if r.get("bench") not in ("slope", "model", "header")], out, prior)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[10, 100, 1000, 10000])
    parser.add_argument("--consumers", type=int, nargs="*", default=[100, 1000, 10000, 100000],
                        help="the consumer sweep (10 data workers); none: skip it")
    parser.add_argument("--revive", type=int, nargs="*", default=[10, 100, 1000, 10000],
                        help="workers revived after a dispatcher restart; none: skip")
    parser.add_argument("--plot", metavar="PNG", help="write the cost curves (log-log) here")
    parser.add_argument("--before", metavar="JSONL",
                        help="with --plot: this script's output from an earlier version, whose "
                             "steeper curves are drawn dashed beside")
    parser.add_argument("--jobs", type=int, default=2, help="DYNAMIC jobs (tasks per worker)")
    parser.add_argument("--journal", action="store_true",
                        help="fault-tolerant dispatcher: every mutating request is journaled")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rpc-calls", type=int, default=2000,
                        help="no-op TCP round trips to measure (0: skip)")
    parser.add_argument("--replot", metavar="JSONL",
                        help="only draw --plot from this saved output (no measurement)")
    args = parser.parse_args(argv)
    if args.replot:
        replot(args.replot, args.plot, args.before)
        return 0
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
