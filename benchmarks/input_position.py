"""What tracking input positions costs a data-service epoch (issue 13, section 2).

One epoch of a DYNAMIC job read with and without ``track_position=True``, A/B interleaved
in the same run on the same cluster (a scheduler and two data workers as processes), and
checked (each element exactly once). Prints JSON lines: a ``run`` line (machine, load,
versions), one line per workload with ``plain`` and ``tracked`` (best of ``--runs``
reads, elements/s), every run's figure, ``ratio = tracked / plain``, and the load average
before and after.

Workloads:

- ``scalars``: ``Dataset.range(N)``: the most elements per byte, the worst case.
- ``rows``: ``Dataset.range(N // 4).map(i -> 256 float32s)``: unbatched 1 KiB rows.
- ``batches``: ``Dataset.range(N).batch(256)``: one count per batch (a run or two).
- ``arrays``: ``Dataset.range(N // 4).map(i -> 256 float32s).batch(64)``: some work per
  element, as a real pipeline has.

Usage: ``python benchmarks/input_position.py [--n 200000] [--runs 3] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

import numpy as np


def _emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def _read(ds: Any, expect_sum: int, expect_n: int) -> float:
    t0 = time.perf_counter()
    total = count = 0
    for x in ds:
        a = np.asarray(x)
        total += int(a.sum())
        count += a.size
    seconds = time.perf_counter() - t0
    if (count, total) != (expect_n, expect_sum):
        raise AssertionError(f"read {count} elements summing to {total}, expected "
                             f"{expect_n} and {expect_sum}")
    return seconds


def _row(i: Any) -> Any:
    return np.full(256, i, np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smoke run (small sizes)")
    args = parser.parse_args()
    n = 20_000 if args.quick else args.n

    import dask
    import distributed
    from distributed import Client, LocalCluster

    import dask_dataservice as dds

    _emit(bench="input_position", kind="run", python=platform.python_version(),
          dask=dask.__version__, distributed=distributed.__version__,
          cpus=os.cpu_count(), load_avg_1m=os.getloadavg()[0], n=n, runs=args.runs,
          quick=args.quick)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        m = n // 4
        workloads = {
            "scalars": (dds.Dataset.range(n), n, n * (n - 1) // 2, n),
            "rows": (dds.Dataset.range(m).map(_row), m, 256 * m * (m - 1) // 2, 256 * m),
            "batches": (dds.Dataset.range(n).batch(256), n, n * (n - 1) // 2, n),
            "arrays": (dds.Dataset.range(m).map(_row).batch(64), m,
                       256 * m * (m - 1) // 2, 256 * m),
        }
        for name, (pipeline, elements, expect, values) in workloads.items():
            readers = {
                "plain": pipeline.apply(dds.distribute("distributed_epoch", client)),
                "tracked": pipeline.apply(dds.distribute("distributed_epoch", client,
                                                         track_position=True)),
            }
            for ds in readers.values():  # warm-up: pipelines downloaded, tasks started once
                _read(ds, expect, values)
            times: dict[str, list[float]] = {"plain": [], "tracked": []}
            load_before = os.getloadavg()[0]
            for _ in range(args.runs):  # A/B interleaved: the same machine state for both
                for label, ds in readers.items():
                    times[label].append(_read(ds, expect, values))
            rate = {k: elements / min(v) for k, v in times.items()}
            _emit(bench="input_position", workload=name, metric="elements_per_s",
                  plain=round(rate["plain"]), tracked=round(rate["tracked"]),
                  ratio=round(rate["tracked"] / rate["plain"], 3),
                  runs_seconds={k: [round(t, 4) for t in v] for k, v in times.items()},
                  load_avg_1m_before=load_before, load_avg_1m_after=os.getloadavg()[0])


if __name__ == "__main__":
    sys.exit(main())
