"""Locality-aware vs locality-blind DYNAMIC reads of a persisted dask.array (issue 12 s1).

A ``LocalCluster`` of 2 single-threaded worker processes persists a float64 dask.array of
``--gib`` GiB (chunks of ``--chunk-mib`` MiB along axis 0), spread by Dask over both workers.
Each run reads it once through the data service under DYNAMIC sharding with
``Dataset.from_dask(x, rows=False, locality=...)`` and a map that reduces each block to its
sum (so only the data workers touch the blocks). Per run: the bytes moved between workers
(the sum of the workers' ``transfer_incoming_log`` totals, i.e. Dask's own worker-to-worker
transfers) and the epoch time. Runs alternate aware and blind; extra replicas a run made are
dropped (Active Memory Manager) before the next one, so every run starts from one copy.

The local baseline in the same run is the same reduction computed by Dask itself
(``x.map_blocks(sum)``), which moves nothing.

    .venv/bin/python benchmarks/locality.py                # 1 GiB, 3 runs of each
    .venv/bin/python benchmarks/locality.py --gib 0.25 --runs 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np


def transferred(client: Any) -> int:
    def total(dask_worker: Any) -> int:
        return int(sum(e.get("total", 0) for e in dask_worker.transfer_incoming_log))

    return sum(client.run(total).values())


def single_copies(client: Any, keys: list[Any], timeout: float = 60.0) -> None:
    """Drop the replicas the last run made (AMM ReduceReplicas), until one copy is left."""
    deadline = time.monotonic() + timeout
    while True:
        client.amm.run_once()
        who = client.sync(client.scheduler.who_has, keys=keys)
        if all(len(v) == 1 for v in who.values()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError("extra replicas were not dropped")
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--chunk-mib", type=float, default=16.0)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    import dask.array as da
    from distributed import Client, LocalCluster, wait

    import dask_dataservice as dds

    cols = 1024
    rows_per_chunk = max(1, int(args.chunk_mib * 2**20 / (8 * cols)))
    n_rows = int(args.gib * 2**30 / (8 * cols))
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                      memory_limit=0) as cluster, Client(cluster) as client:
        dds.install(client)
        x = da.random.random((n_rows, cols), chunks=(rows_per_chunk, cols)).persist()
        wait(x)
        keys = [k for k in x.__dask_keys__() for k in k]
        who = client.sync(client.scheduler.who_has, keys=keys)
        per_worker: dict[str, int] = {}
        for holders in who.values():
            per_worker[holders[0]] = per_worker.get(holders[0], 0) + 1
        load = os.getloadavg()[0]
        print(json.dumps({"bench": "locality", "gib": round(x.nbytes / 2**30, 3),
                          "chunks": len(keys), "chunk_mib": round(rows_per_chunk * cols * 8 / 2**20, 2),
                          "workers": 2, "chunks_per_worker": sorted(per_worker.values()),
                          "cpus": os.cpu_count(), "load_1min": round(load, 2),
                          "python": sys.version.split()[0]}), flush=True)
        start = time.perf_counter()
        expect = float(x.map_blocks(lambda b: np.array([[b.sum()]]), chunks=(1, 1)).sum().compute())
        local_s = time.perf_counter() - start
        results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
        for _ in range(args.runs):
            for aware in (True, False):
                single_copies(client, keys)
                before = transferred(client)
                ds = dds.Dataset.from_dask(x, rows=False, locality=aware).map(lambda b: float(b.sum()))
                start = time.perf_counter()
                out = list(ds.apply(dds.distribute("DYNAMIC", client, job_name=f"bench-{aware}-{_}")))
                seconds = time.perf_counter() - start
                moved = transferred(client) - before
                assert len(out) == len(keys) and abs(sum(out) - expect) <= 1e-6 * abs(expect), \
                    "a run lost or repeated a block"
                results[aware].append({"seconds": seconds, "bytes_moved": moved})
                print(json.dumps({"bench": "locality_run", "locality_aware": aware,
                                  "seconds": round(seconds, 3), "bytes_moved": moved,
                                  "mib_moved": round(moved / 2**20, 1)}), flush=True)
        best = {a: min(r["seconds"] for r in rs) for a, rs in results.items()}
        moved = {a: int(np.median([r["bytes_moved"] for r in rs])) for a, rs in results.items()}
        print(json.dumps({
            "bench": "locality_summary", "aware_seconds": round(best[True], 3),
            "blind_seconds": round(best[False], 3),
            "aware_mib_moved": round(moved[True] / 2**20, 1),
            "blind_mib_moved": round(moved[False] / 2**20, 1),
            "speedup": round(best[False] / best[True], 2),
            "baseline": "dask map_blocks(sum) on the same persisted array",
            "baseline_seconds": round(local_s, 3), "load_1min_end": round(os.getloadavg()[0], 2),
            "target": "aware moves fewer bytes than blind",
            "target_met": moved[True] < moved[False]}), flush=True)


if __name__ == "__main__":
    main()
