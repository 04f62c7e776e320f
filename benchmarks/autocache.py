"""Autocache (issue 26, part 3): a pipeline with an expensive map read for three epochs, with
``autocache()`` and without, side by side in one run.

A LocalCluster of ``--workers`` worker processes (one thread each) serves a DYNAMIC read of
``Dataset.range(N).map(expensive)`` (``expensive``: an eigendecomposition, about 2 ms of CPU per
element, deterministic per element), ``--epochs`` times, each epoch a new job as a training
loop makes one. The cached pipeline adds ``.autocache()``. Epochs alternate between the two
(cached epoch 1, plain epoch 1, cached epoch 2, ...) so both see the same machine. The local
baseline is the map alone in this process (what one core makes). JSON lines: one per epoch
and pipeline, then a summary: epoch seconds, the cached epochs' speedup over the plain ones
(target: epochs 2 and 3 at least 3x faster), the cache's hits, and the exactly-once check.

    .venv/bin/python benchmarks/autocache.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np
from distributed import Client, LocalCluster

import dask_dataservice as dds


def expensive(x: int) -> tuple[int, np.ndarray]:
    rng = np.random.default_rng(x)
    m = rng.standard_normal((96, 96))
    return x, np.linalg.eigvalsh(m @ m.T)[:16]


def epoch(client: Client, ds: dds.Dataset, split_size: int) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    dist = ds.apply(dds.distribute("distributed_epoch", client, split_size=split_size))
    ids = [int(x) for x, _ in dist]
    return time.perf_counter() - t0, ids


def cache_totals(client: Client) -> dict[str, int]:
    out = {"splits": 0, "hits": 0, "computed": 0}
    for worker in client.run(lambda dask_worker: dask_worker.extensions[
            "dataservice"].autocache.status()).values():
        for d in worker["datasets"].values():
            for k in out:
                out[k] += d[k]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", type=int, default=3000, help="elements per epoch")
    p.add_argument("--split-size", type=int, default=25)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", action="store_true", help="in-process workers (threads)")
    p.add_argument("--check", action="store_true", help="exit 1 if the target is missed")
    args = p.parse_args(argv)
    n = args.n
    t0 = time.perf_counter()
    for i in range(min(n, 300)):
        expensive(i)
    local = min(n, 300) / (time.perf_counter() - t0)
    print(json.dumps({"bench": "autocache", "elements": n, "split_size": args.split_size,
                      "workers": args.workers, "processes": not args.threads,
                      "local_elements_per_s": round(local, 1), "cpus": os.cpu_count(),
                      "load": os.getloadavg()[0], "target": "epochs 2+ >= 3x the plain ones"}),
          flush=True)
    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=not args.threads,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        dds.install(client)
        plain = dds.Dataset.range(n).map(expensive)
        cached = dds.Dataset.range(n).map(expensive).autocache()
        seconds: dict[str, list[float]] = {"cached": [], "plain": []}
        ok = True
        for e in range(args.epochs):
            for name, ds in (("cached", cached), ("plain", plain)):
                took, ids = epoch(client, ds, args.split_size)
                exact = sorted(ids) == list(range(n))
                ok &= exact
                seconds[name].append(took)
                row: dict[str, Any] = {"epoch": e + 1, "pipeline": name,
                                       "seconds": round(took, 3),
                                       "elements_per_s": round(n / took, 1),
                                       "exactly_once": exact}
                if name == "cached":
                    row["cache"] = cache_totals(client)
                print(json.dumps(row), flush=True)
        later = [p / c for c, p in zip(seconds["cached"][1:], seconds["plain"][1:], strict=True)]
        met = bool(later) and min(later) >= 3.0
        print(json.dumps({
            "summary": True, "cached_seconds": [round(s, 3) for s in seconds["cached"]],
            "plain_seconds": [round(s, 3) for s in seconds["plain"]],
            "speedup_later_epochs": [round(s, 1) for s in later],
            "first_epoch_cost": round(seconds["cached"][0] / seconds["plain"][0], 2),
            "cache": cache_totals(client), "exactly_once": ok, "target_met": met,
            "load": os.getloadavg()[0]}), flush=True)
    return 1 if args.check and not (met and ok) else 0


if __name__ == "__main__":
    sys.exit(main())
