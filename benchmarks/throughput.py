"""The throughput gate's workloads (issue 22): small elements, many clients, tiny repeats.

Prints one JSON object per line on stdout, like ``service.py`` (whose cluster it uses: a
``dask scheduler`` and single-threaded ``dask worker --no-nanny`` processes on 127.0.0.1,
this process the consumer). Meant to run under ``ab.py`` against a git ref::

    .venv/bin/python benchmarks/ab.py --ref 13df877 --script head --rounds 3 -- throughput.py

Workloads (``--only``, comma-separated):

- ``one``: one consumer of ``Dataset.range(200_000)`` (scalars): 1 worker OFF, and 2 workers
  DYNAMIC: elements/s (best of ``--runs`` reads after a warm-up read).
- ``ten``: ten consumer processes at once, each reading its own pass of
  ``Dataset.range(200_000)`` under DYNAMIC from 2 workers: ``value`` is all their elements
  over the wall time from the common start to the last end (elements/s); ``per_client_s``
  is the median of the clients' own read times. The clients connect first and start
  together (a file they wait for), so their imports and connections are not timed.
- ``repeat``: ``Dataset.range(10).repeat()`` under DYNAMIC from 2 workers, the first
  ``--repeat-elements`` (20,000) elements: elements/s (each repetition is 10 one-element
  splits: what a split hand-out costs).
- ``1mib``: ``Dataset.range(500)`` mapped to 1 MiB float32 arrays under DYNAMIC from 2
  workers: GiB/s.

Every read is checked (count and sum; for ``repeat``, count and every value in 0..9). Every
line carries ``load`` (the 1-minute load average after the figure). A run takes ~40-60 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import service as S  # benchmarks/service.py: the cluster, consumers, pipelines

import dask_dataservice as dds
from dask_dataservice.data import Dataset

WORKLOADS = ("one", "ten", "repeat", "1mib")

CHILD = r"""
import json, os, sys, time
import dask_dataservice as dds
from dask_dataservice.data import Dataset
from distributed import Client

address, n, go = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with Client(address, timeout="60s") as client:
    ds = Dataset.range(n).apply(dds.distribute("DYNAMIC", client))
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.001)
    t0 = time.perf_counter()
    k = s = 0
    for x in ds:
        k += 1
        s += x
    t1 = time.perf_counter()
    print(json.dumps({"start": t0, "end": t1, "elements": k, "sum": s,
                      "clock": time.time() - time.perf_counter()}), flush=True)
"""


def make_1mib(i):  # here (in __main__), so that cloudpickle ships it by value
    import numpy as np

    return np.full(262_144, i, np.float32)


def emit(rec: dict) -> None:
    rec["load"] = round(os.getloadavg()[0], 2)
    print(json.dumps(rec), flush=True)


def best_rate(c: S.Cluster, ds, consume, expect, runs: int, amount: float) -> dict:
    c.wait_idle()
    if consume(iter(ds)) != expect:
        raise SystemExit("warm-up read: wrong elements")
    values = []
    for _ in range(runs):
        c.wait_idle()
        t0 = time.perf_counter()
        got = consume(iter(ds))
        dt = time.perf_counter() - t0
        if got != expect:
            raise SystemExit(f"read {got}, expected {expect}")
        values.append(amount / dt)
    return {"value": S._round(max(values)), "runs_values": [S._round(v) for v in values]}


def one(c: S.Cluster, mode: str, workers: int, n: int, runs: int) -> None:
    ds = Dataset.range(n).apply(dds.distribute(mode, c.client))
    r = best_rate(c, ds, S.consume_scalars, (n, n * (n - 1) // 2), runs, n)
    emit({"bench": "one-consumer", "mode": mode, "workers": workers,
          "metric": "elements_per_s", "elements": n, **r})


def ten(c: S.Cluster, address: str, n: int, clients: int) -> None:
    c.wait_idle()
    with tempfile.TemporaryDirectory() as tmp:
        go = Path(tmp) / "go"
        procs = [subprocess.Popen([sys.executable, "-c", CHILD, address, str(n), str(go)],
                                  stdout=subprocess.PIPE, text=True) for _ in range(clients)]
        try:
            for p in procs:
                line = p.stdout.readline()
                if line.strip() != "ready":
                    raise SystemExit(f"a client did not get ready: {line!r}")
            go.touch()
            t_go = time.time()
            outs = []
            for p in procs:
                out, _ = p.communicate(timeout=600)
                if p.returncode != 0:
                    raise SystemExit(f"a client failed ({p.returncode})")
                outs.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    for o in outs:
        if (o["elements"], o["sum"]) != (n, n * (n - 1) // 2):
            raise SystemExit(f"a client read {o['elements']} elements (sum {o['sum']})")
    ends = [o["end"] + o["clock"] for o in outs]
    wall = max(ends) - t_go
    per_client = [o["end"] - o["start"] for o in outs]
    emit({"bench": "ten-clients", "mode": "DYNAMIC", "workers": 2, "clients": clients,
          "metric": "elements_per_s (all clients, wall time)", "elements": n,
          "value": round(clients * n / wall), "wall_s": round(wall, 3),
          "per_client_s": round(statistics.median(per_client), 3),
          "per_client_max_s": round(max(per_client), 3)})


def repeat(c: S.Cluster, k: int, runs: int) -> None:
    ds = Dataset.range(10).repeat().apply(dds.distribute("DYNAMIC", c.client))

    def consume(it) -> tuple[int, bool]:
        got = ok = 0
        for x in it:
            got += 1
            ok += 0 <= x < 10
            if got == k:
                break
        close = getattr(it, "close", None)
        if close is not None:
            close()
        return got, ok == got

    r = best_rate(c, ds, consume, (k, True), runs, k)
    emit({"bench": "repeat", "mode": "DYNAMIC", "workers": 2,
          "metric": "elements_per_s", "elements": k, **r})


def mib(c: S.Cluster, n: int, runs: int) -> None:
    ds = Dataset.range(n).map(make_1mib).apply(dds.distribute("DYNAMIC", c.client))
    r = best_rate(c, ds, S.consume_arrays, (n, n * (n - 1) // 2), runs, n / 1024)
    emit({"bench": "1mib", "mode": "DYNAMIC", "workers": 2, "metric": "GiB_per_s",
          "elements": n, **r})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(WORKLOADS),
                        help=f"comma-separated subset of {','.join(WORKLOADS)}")
    parser.add_argument("--runs", type=int, default=3, help="reads per figure (best of)")
    parser.add_argument("--elements", type=int, default=200_000, help="one, ten: elements")
    parser.add_argument("--clients", type=int, default=10, help="ten: consumer processes")
    parser.add_argument("--repeat-elements", type=int, default=20_000)
    parser.add_argument("--mib-elements", type=int, default=500)
    args = parser.parse_args()
    only = [w.strip() for w in args.only.split(",") if w.strip()]
    if set(only) - set(WORKLOADS):
        parser.error(f"unknown workloads {sorted(set(only) - set(WORKLOADS))}")
    emit({"run": "benchmarks/throughput.py", "package_path": dds.__file__,
          "cores": os.cpu_count(), "only": only})
    c = S.Cluster()
    try:
        address = c.start()
        c.add_worker()
        if "one" in only:
            one(c, "OFF", 1, args.elements, args.runs)
        c.add_worker()
        if "one" in only:
            one(c, "DYNAMIC", 2, args.elements, args.runs)
        if "repeat" in only:
            repeat(c, args.repeat_elements, args.runs)
        if "1mib" in only:
            mib(c, args.mib_elements, args.runs)
        if "ten" in only:
            ten(c, address, args.elements, args.clients)
    finally:
        c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
