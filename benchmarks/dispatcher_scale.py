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


async def scenario(n_workers: int, n_jobs: int, args: argparse.Namespace, scratch: Path) -> list[dict]:
    import dask
    from distributed import Scheduler
    from distributed.scheduler import WorkerState

    from dask_dataservice.service.dispatcher.plugin import DispatcherPlugin

    # Fake workers heartbeat only when measured: keep the liveness check from dropping them.
    # No work stealing: its balance loop would walk the fake workers' (empty) occupancy.
    stack = dask.config.set({"dataservice.dispatcher.worker-timeout": "1h",
                             "distributed.scheduler.work-stealing": False})
    stack.__enter__()
    work_dir = scratch / f"journal-{n_workers}-{n_jobs}" if args.journal else None
    plugin = DispatcherPlugin(fault_tolerant_mode=args.journal,
                              work_dir=str(work_dir) if work_dir else None)
    scheduler = Scheduler(host="127.0.0.1", port=0, dashboard=False, dashboard_address=":0",
                          validate=False)
    scheduler.add_plugin(plugin)
    await scheduler
    results: list[dict] = []
    try:
        addresses, keys, inboxes = [], {}, {}
        for i in range(n_workers):
            address = f"tcp://127.0.0.{2 + i // 50_000}:{10_000 + i % 50_000}"
            ws = WorkerState(address=address, status=scheduler.status, pid=0, name=address,
                             nthreads=1, memory_limit=0, local_directory="/tmp", nanny=None,
                             server_id=f"fake-{i}", services={}, versions={}, extra={})
            scheduler.workers[address] = ws
            inboxes[address] = scheduler.stream_comms[address] = _Inbox()
            keys[address] = plugin._access._keys[address] = f"key-{i}"
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
    finally:
        for address in list(scheduler.workers):  # fake: nothing to close, just forget them
            scheduler.workers.pop(address, None)
            scheduler.stream_comms.pop(address, None)
        await scheduler.close()
        stack.__exit__(None, None, None)
    for r in results:
        r["loadavg"] = _loadavg()
    return results


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
        rows = [r for r in results if r["bench"] == bench
                and all(r.get(k) == v for k, v in match.items())]
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
    rpc = await rpc_roundtrip(args) if args.rpc_calls else None
    if rpc:
        emit(rpc)
    emit(model(results, rpc))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--jobs", type=int, default=2, help="DYNAMIC jobs (tasks per worker)")
    parser.add_argument("--journal", action="store_true",
                        help="fault-tolerant dispatcher: every mutating request is journaled")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rpc-calls", type=int, default=2000,
                        help="no-op TCP round trips to measure (0: skip)")
    args = parser.parse_args(argv)
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
