"""Fine-grained DYNAMIC splits (issue 16, target 3): elements/s of one epoch of
``Dataset.range(N)`` registered with ``split_size`` 10 (100,000 splits for N = 10**6), read by
one consumer from two data workers (separate processes), with ``worker.split-batch-max`` 64
(the old fixed cap) against 1,024 (the new default), A B A B in the same cluster, and the
same dataset with its default ~256 splits as the baseline.

Prints one JSON object per line: ``split_batch_max``, ``splits``, ``elements_per_s``, wall
``seconds``, CPU seconds of each process during the read (``cpu_s``: ``client`` also holds the
scheduler, which LocalCluster runs in this process), ``us_per_split`` (worker CPU above the
baseline's, per split) and the machine load. Every read is checked: count and sum (each
element exactly once). Options: ``--elements N`` (default 10**6), ``--rounds R`` (default 2).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import psutil
from distributed import Client, LocalCluster

import dask_dataservice as dds
from dask_dataservice import Dataset


def _set_batch_max(value: int) -> None:
    import dask

    dask.config.set({"dataservice.worker.split-batch-max": value})


def _read(client: Client, n: int, split_size: int | None) -> tuple[float, dict[str, float]]:
    pids = {"client": os.getpid(), **{f"worker-{i}": pid for i, pid in
                                      enumerate(client.run(os.getpid).values())}}
    procs = {k: psutil.Process(pid) for k, pid in pids.items()}
    before = {k: sum(p.cpu_times()[:2]) for k, p in procs.items()}
    ds = Dataset.range(n).apply(dds.distribute("distributed_epoch", client,
                                                split_size=split_size))
    start = time.perf_counter()
    count = total = 0
    for x in ds:
        count += 1
        total += x
    seconds = time.perf_counter() - start
    if count != n or total != n * (n - 1) // 2:
        raise AssertionError(f"read {count} elements summing to {total}")
    cpu = {k: round(sum(p.cpu_times()[:2]) - before[k], 3) for k, p in procs.items()}
    return seconds, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=int, default=10**6)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    n = args.elements
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        client.run(_set_batch_max, 1024)
        _read(client, n, None)  # warm-up
        base_s, base_cpu = _read(client, n, None)
        base_worker = sum(v for k, v in base_cpu.items() if k.startswith("worker"))
        print(json.dumps({"bench": "fine-splits-baseline", "splits": 256,
                          "elements_per_s": round(n / base_s), "seconds": round(base_s, 3),
                          "cpu_s": base_cpu, "load": round(os.getloadavg()[0], 2)}), flush=True)
        splits = -(-n // 10)
        for _ in range(args.rounds):
            for batch_max in (64, 1024):
                client.run(_set_batch_max, batch_max)
                seconds, cpu = _read(client, n, 10)
                worker = sum(v for k, v in cpu.items() if k.startswith("worker"))
                print(json.dumps({
                    "bench": "fine-splits", "split_batch_max": batch_max, "splits": splits,
                    "elements_per_s": round(n / seconds), "seconds": round(seconds, 3),
                    "cpu_s": cpu, "us_per_split": round((worker - base_worker) / splits * 1e6, 2),
                    "target": ">= 500000 elements/s", "load": round(os.getloadavg()[0], 2)}),
                    flush=True)


if __name__ == "__main__":
    main()
