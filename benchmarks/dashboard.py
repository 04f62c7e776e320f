"""What the dashboard costs: read throughput with the figures polled every 50 ms vs 1 s, and the
time of one poll and one ``status()`` on the scheduler.

A ``LocalCluster`` (in-process workers) streams ``Dataset.range(n).batch(256)`` under DYNAMIC
sharding; the two polling intervals alternate over ``--rounds`` (the 1 s interval is the
baseline: at most one poll per read). One JSON line per read, then a summary::

    {"bench": "dashboard_read", "interval": "50ms", "elements_per_s": ..., "round": 0}
    {"bench": "summary", "elements_per_s": {"1s": ..., "50ms": ...}, "ratio": ...,
     "poll_ms": ..., "status_ms": ..., "workers": 2, "cpus": ...}

Run: ``python benchmarks/dashboard.py [--n 2000000] [--rounds 3] [--workers 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import dask
from distributed import Client, LocalCluster

import dask_dataservice as dds
from dask_dataservice.dashboard import PLUGIN_NAME


def _read(client: Client, n: int) -> float:
    ds = dds.Dataset.range(n).batch(256).apply(dds.distribute("DYNAMIC", client))
    start = time.perf_counter()
    count = sum(len(b) for b in ds)
    elapsed = time.perf_counter() - start
    assert count == n, count
    return n / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--n", type=int, default=2_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    rates: dict[str, list[float]] = {"1s": [], "50ms": []}
    poll_ms: list[float] = []
    status_ms: list[float] = []
    for r in range(args.rounds):
        for interval in ("1s", "50ms"):
            with dask.config.set({"dataservice.dashboard.interval": interval}), \
                    LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=False,
                                 dashboard_address=":0") as cluster, Client(cluster) as client:
                dds.install(client)
                rate = _read(client, args.n)
                rates[interval].append(rate)
                print(json.dumps({"bench": "dashboard_read", "interval": interval,
                                  "elements_per_s": round(rate), "round": r}), flush=True)
                plugin = cluster.scheduler.plugins[PLUGIN_NAME]

                async def timed(plugin=plugin) -> tuple[float, float]:  # noqa: ANN001
                    t0 = time.perf_counter()
                    await plugin.poll()
                    t1 = time.perf_counter()
                    plugin.status()
                    return t1 - t0, time.perf_counter() - t1

                p, s = client.sync(timed)
                poll_ms.append(1000 * p)
                status_ms.append(1000 * s)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(json.dumps({"bench": "summary", "elements_per_s": {k: round(v) for k, v in med.items()},
                      "ratio": round(med["50ms"] / med["1s"], 3),
                      "poll_ms": round(statistics.median(poll_ms), 2),
                      "status_ms": round(statistics.median(status_ms), 2),
                      "workers": args.workers, "n": args.n, "cpus": os.cpu_count(),
                      "loadavg": os.getloadavg()[0]}), flush=True)


if __name__ == "__main__":
    main()
