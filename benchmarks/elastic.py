"""Data workers that follow the consumers' demand (issue 26): an elastic cluster against a fixed
one of the same maximum size, in the same run.

A LocalCluster (worker processes by default) serves a DYNAMIC read of a pipeline whose elements
take a data worker ``--produce`` seconds each (10 ms: a source bound by per-element latency,
such as object storage, so more workers give more throughput even on 2 cores). One consumer
computes a while per element, in three phases (``--phases``, seconds each):

1. low demand: ``--slow`` seconds per element (less than one worker's output);
2. high demand: ``--fast`` seconds per element (about ``--maximum`` workers' output);
3. low demand again.

The elastic run starts with one worker and ``cluster.adapt(Adaptive=dds.DemandAdaptive,
minimum=1, maximum=M)``; the fixed run has M workers throughout. Every second both record the
workers and the elements per second the consumer took. JSON lines: one per second per run
(``"series": true``), then a summary per run and a comparison (elements taken per phase,
worker-seconds used, seconds to reach M-1 workers after the step up and back to 1 after the
step down, the duplicates/losses check). ``--plot PATH`` draws both runs (matplotlib).

    .venv/bin/python benchmarks/elastic.py --plot docs/_static/elastic.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any

import dask
from distributed import Client, LocalCluster

import dask_dataservice as dds

FAST_CONFIG = {"dataservice.dashboard.interval": "250ms",
               "dataservice.worker.heartbeat-interval": "250ms",
               "dataservice.worker.buffer-elements": 64,
               "distributed.admin.tick.limit": "5s"}


def produce(seconds: float):
    def slow(x):
        time.sleep(seconds)
        return x
    return slow


class Consumer(threading.Thread):
    def __init__(self, client: Client, produce_s: float) -> None:
        super().__init__(name="bench-consumer", daemon=True)
        self.client, self.produce_s = client, produce_s
        self.compute = 1.0
        self.count = 0
        self.seen: list[int] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            # small splits: a retiring worker ends the split it reads before it goes
            dataset_id = dds.register_dataset(
                self.client, dds.Dataset.range(10**7).map(produce(self.produce_s)),
                split_size=20)
            ds = dds.from_dataset_id("distributed_epoch", self.client, dataset_id)
            for x in ds:
                self.seen.append(int(x))
                self.count += 1
                if self.stop.is_set():
                    break
                time.sleep(self.compute)
        except BaseException as e:  # noqa: BLE001 - reported in the summary
            self.error = e


def run(args: argparse.Namespace, elastic: bool) -> dict[str, Any]:
    name = "elastic" if elastic else "fixed"
    n0 = 1 if elastic else args.maximum
    with dask.config.set(FAST_CONFIG), \
            LocalCluster(n_workers=n0, threads_per_worker=1, processes=args.processes,
                         dashboard_address=None, host="127.0.0.1") as cluster, \
            Client(cluster) as client:
        dds.install(client)
        client.wait_for_workers(n0)
        adaptive = None
        if elastic:
            adaptive = cluster.adapt(Adaptive=dds.DemandAdaptive, minimum=1,
                                     maximum=args.maximum, interval="500ms", wait_count=2,
                                     settle=args.settle, cooldown=args.cooldown)
        consumer = Consumer(client, args.produce)
        schedule = [(args.phases[0], args.slow), (args.phases[1], args.fast),
                    (args.phases[2], args.slow)]
        consumer.compute = schedule[0][1]
        consumer.start()
        rows = []
        t0 = time.monotonic()
        last = 0
        boundaries = [sum(args.phases[:i + 1]) for i in range(3)]
        try:
            while (t := time.monotonic() - t0) < boundaries[-1]:
                phase = next(i for i, b in enumerate(boundaries) if t < b)
                consumer.compute = schedule[phase][1]
                time.sleep(1.0)
                count = consumer.count
                workers = len(client.scheduler_info()["workers"])
                row = {"series": True, "run": name, "t": round(time.monotonic() - t0, 2),
                       "phase": phase + 1, "workers": workers,
                       "elements_per_second": count - last}
                last = count
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            consumer.stop.set()
            consumer.join(30)
            if adaptive is not None:
                adaptive.stop()
        seen = consumer.seen
        summary: dict[str, Any] = {
            "run": name, "elements": len(seen), "duplicates": len(seen) - len(set(seen)),
            "error": None if consumer.error is None else repr(consumer.error),
            "worker_seconds": round(sum(r["workers"] for r in rows), 1),
            "max_workers": max(r["workers"] for r in rows),
            "elements_per_phase": [sum(r["elements_per_second"] for r in rows
                                       if r["phase"] == p) for p in (1, 2, 3)]}
        if elastic:
            up = [r["t"] for r in rows if r["phase"] == 2 and r["workers"] >= args.maximum - 1]
            down = [r["t"] for r in rows if r["phase"] == 3 and r["workers"] == 1]
            summary["seconds_to_scale_up"] = round(up[0] - boundaries[0], 1) if up else None
            summary["seconds_to_scale_down"] = round(down[0] - boundaries[1], 1) if down \
                else None
        return {"summary": summary, "rows": rows}


def plot(path: str, runs: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    for name, style in (("fixed", "--"), ("elastic", "-")):
        rows = runs[name]["rows"]
        t = [r["t"] for r in rows]
        top.plot(t, [r["workers"] for r in rows], style, label=f"{name} cluster")
        bottom.plot(t, [r["elements_per_second"] for r in rows], style, label=name)
    for b in (args.phases[0], args.phases[0] + args.phases[1]):
        for ax in (top, bottom):
            ax.axvline(b, color="grey", lw=0.5)
    top.set_ylabel("workers")
    top.legend(loc="upper right")
    bottom.set_ylabel("elements/s taken")
    bottom.set_xlabel("seconds (demand: low, high, low)")
    fig.suptitle("DemandAdaptive against a fixed cluster of the same maximum")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--maximum", type=int, default=4)
    p.add_argument("--produce", type=float, default=0.01, help="seconds per element, worker")
    p.add_argument("--slow", type=float, default=0.04, help="consumer s/element, low demand")
    p.add_argument("--fast", type=float, default=0.003, help="consumer s/element, high demand")
    p.add_argument("--phases", type=float, nargs=3, default=[15, 40, 60])
    p.add_argument("--settle", type=float, default=3.0)
    p.add_argument("--cooldown", type=float, default=5.0)
    p.add_argument("--threads", dest="processes", action="store_false",
                   help="workers as threads of this process (default: processes)")
    p.add_argument("--plot", metavar="PATH")
    args = p.parse_args()
    print(json.dumps({"bench": "elastic", "cpus": os.cpu_count(),
                      "load": os.getloadavg()[0], "python": sys.version.split()[0],
                      "dask": dask.__version__, **{k: v for k, v in vars(args).items()}}),
          flush=True)
    runs = {"fixed": run(args, elastic=False), "elastic": run(args, elastic=True)}
    for r in runs.values():
        print(json.dumps(r["summary"]), flush=True)
    fixed, elastic = runs["fixed"]["summary"], runs["elastic"]["summary"]
    print(json.dumps({
        "compare": True,
        "high_demand_elements_ratio": round(
            elastic["elements_per_phase"][1] / max(1, fixed["elements_per_phase"][1]), 3),
        "worker_seconds_ratio": round(elastic["worker_seconds"]
                                      / max(1.0, fixed["worker_seconds"]), 3),
        "load": os.getloadavg()[0]}), flush=True)
    if args.plot:
        plot(args.plot, runs, args)


if __name__ == "__main__":
    main()
