"""Data-worker heartbeat latency on a journaled dispatcher that is busy writing records.

A fault-tolerant dispatcher (real ``distributed.Scheduler`` with the dispatcher plugin, journal
in a temporary directory, real in-process data worker) is kept busy by ``--writers``
coroutines that register datasets in a loop (one journaled record each, so a group commit
is almost always in flight). Meanwhile the worker's steady-state heartbeat (nothing changed,
nothing new to tell) is timed, ``--n`` times per variant, variants interleaved in rounds:

* ``waits`` (baseline, the behaviour before issue 11 s3): every heartbeat waits for the
  journal's next group commit, as any mutating request;
* ``answers_at_once``: a heartbeat that journaled nothing and carries no task change answers
  without waiting.

The handler is called in the scheduler's own process (no network round trip: what is timed
is the handler and what it waits for). One JSON line per variant and round, then a summary::

    {"bench": "heartbeat", "variant": "waits", "median_ms": ..., "p90_ms": ..., "n": ...}
    {"bench": "summary", "median_ms": {"waits": ..., "answers_at_once": ...}, ...}

Run: ``python benchmarks/heartbeat.py [--n 200] [--writers 4] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import cloudpickle
import dask
from _common import fs_type
from distributed import Scheduler, Worker

import dask_dataservice as dds
from dask_dataservice.service.dispatcher.plugin import DispatcherPlugin
from dask_dataservice.service.worker import PLUGIN_NAME as WORKER_PLUGIN


async def _writer(plugin: DispatcherPlugin, stop: asyncio.Event, prefix: str) -> None:
    pipeline = cloudpickle.dumps(dds.Dataset.range(3))
    i = 0
    while not stop.is_set():
        await plugin.register_dataset(fingerprint=f"{prefix}-{i}", pipeline=pipeline, splits=b"",
                                      num_splits=-1, metadata={"file_based": False},
                                      client_id=prefix)
        i += 1


async def _time_heartbeats(plugin: DispatcherPlugin, w: Worker, key: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        started = time.perf_counter()
        reply = await plugin.worker_heartbeat(address=w.address, host="127.0.0.1", nthreads=1,
                                              active_tasks=[], finished_tasks=[],
                                              worker_key=key)
        out.append(time.perf_counter() - started)
        assert reply["status"] == "OK", reply
        await asyncio.sleep(0.002)  # pacing, as real heartbeats are
    return out


async def main(n: int, writers: int, rounds: int) -> None:
    work_dir = Path(tempfile.mkdtemp(prefix="dds-heartbeat-bench-"))
    print(json.dumps({"bench": "machine", "python": platform.python_version(),
                      "cores": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
                      "journal_fs": fs_type(work_dir), "n": n, "writers": writers}), flush=True)
    plugin = DispatcherPlugin(fault_tolerant_mode=True, work_dir=str(work_dir))
    results: dict[str, list[float]] = {"waits": [], "answers_at_once": []}
    with dask.config.set({"dataservice.dispatcher.max-datasets-per-host": None,
                          "dataservice.dispatcher.max-datasets": None,
                          "dataservice.dispatcher.max-dataset-bytes": None}):
        async with Scheduler(dashboard_address=":0", port=0) as s:
            s.add_plugin(plugin)
            await plugin.start(s)
            try:
                async with Worker(s.address, nthreads=1) as w:
                    while not plugin.state.list_workers():
                        await asyncio.sleep(0.01)
                    key = await w.plugins[WORKER_PLUGIN]._key.get()
                    stop = asyncio.Event()
                    tasks = [asyncio.create_task(_writer(plugin, stop, f"w{i}"))
                             for i in range(writers)]
                    try:
                        for r in range(rounds):
                            for variant in results:
                                plugin._heartbeat_waits_always = variant == "waits"
                                times = await _time_heartbeats(plugin, w, key, n)
                                results[variant] += times
                                print(json.dumps({
                                    "bench": "heartbeat", "variant": variant, "round": r,
                                    "median_ms": 1e3 * statistics.median(times),
                                    "p90_ms": 1e3 * statistics.quantiles(times, n=10)[-1],
                                    "n": len(times),
                                    "load_avg_1m": os.getloadavg()[0]}), flush=True)
                    finally:
                        stop.set()
                        await asyncio.gather(*tasks)
            finally:
                await plugin.close()
    print(json.dumps({
        "bench": "summary",
        "median_ms": {k: 1e3 * statistics.median(v) for k, v in results.items()},
        "p90_ms": {k: 1e3 * statistics.quantiles(v, n=10)[-1] for k, v in results.items()},
        "records_journaled": plugin.state.next_dataset_id()}), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.n, args.writers, args.rounds))
