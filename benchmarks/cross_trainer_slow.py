"""A fast trainer of a cross-trainer cache, alone and beside a blocked slow trainer.

Prints JSON lines (``elements_per_s`` of the fast trainer) for DYNAMIC and OFF, with the
default window (``worker.cross-trainer-cache-bytes``, 256 MiB) and with a 4 KiB window that
holds 8 of the 512-byte elements (issue 22, item 4: such a window stopped producing once
its trainer had read it, so the fast trainer stalled). ``slow``: ``none`` (the fast trainer
alone) or ``blocked`` (a slow trainer read one element first and then stops consuming
without releasing its read) or ``reading`` (a slow trainer reads one element every 10 ms, the
whole time). ``--dataset tiny-repeat`` reads ``Dataset.range(10).repeat()`` instead of
512-byte rows: DYNAMIC then hands out one-element splits, the case whose hand-out was slow
before issue 22 (about 700 elements/s alone). A fast trainer that gets nothing for ``--seconds`` is reported
with ``what: stalled ...``; the script then ends its process without closing the stuck read.

Two data workers as processes, the trainers as threads of this process, loopback; every
line has the machine's load (``uptime``'s 1-minute figure). Usage:
``python benchmarks/cross_trainer_slow.py [--seconds 4]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time


def _rows(x):
    import numpy as np

    return np.full(64, x, dtype=np.int64)  # 512 bytes


def emit(**fields) -> None:
    fields["load_1min"] = float(open("/proc/loadavg").read().split()[0])
    print(json.dumps(fields), flush=True)


def measure(client, dataset_id, mode: str, job: str, slow: str, seconds: float) -> dict:
    import dask_dataservice as dds

    def cached(trainer_id):
        return dds.from_dataset_id(mode, client, dataset_id, job_name=job,
                                   cross_trainer_cache=dds.CrossTrainerCache(trainer_id))

    slow_it = None
    stop = threading.Event()
    if slow == "blocked":
        slow_it = iter(cached("slow"))
        next(slow_it)
    elif slow == "reading":
        def slow_reader():
            it = iter(cached("slow"))
            for _ in it:
                if stop.wait(0.01):
                    break
            it.close()

        slow_thread = threading.Thread(target=slow_reader, daemon=True)
        slow_thread.start()
    count = [0]
    done = threading.Event()

    def fast():
        it = iter(cached("fast"))
        for _ in it:
            count[0] += 1
            if stop.is_set():
                break
        it.close()
        done.set()

    t = threading.Thread(target=fast, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while count[0] == 0 and time.monotonic() < deadline:  # the read started
        time.sleep(0.01)
    start, t0 = count[0], time.perf_counter()
    time.sleep(seconds)
    got, dt = count[0] - start, time.perf_counter() - t0
    stop.set()
    stalled = not done.wait(max(2.0, seconds))
    if slow_it is not None and not stalled:
        slow_it.close()
    what = (f"stalled: {got} elements in {dt:.1f} s" if stalled or not got
            else f"{got} elements in {dt:.1f} s")
    return {"elements_per_s": round(got / dt), "what": what, "stalled": stalled}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--dataset", choices=("rows", "tiny-repeat"), default="rows")
    args = p.parse_args()

    import dask
    from distributed import Client, LocalCluster

    import dask_dataservice as dds

    emit(bench="setup", cores=os.cpu_count(), python=sys.version.split()[0])
    stalled = False
    for window in ("default", "4KiB"):
        cfg = {} if window == "default" else {
            "dataservice.worker.cross-trainer-cache-bytes": "4KiB",
            "dataservice.client.cross-trainer-turn-elements": 64}
        with dask.config.set(cfg), LocalCluster(
                n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                dashboard_address=":0") as cluster:
            client = Client(cluster)
            dds.install(client)
            client.wait_for_workers(2)
            dataset = (dds.Dataset.range(10).repeat() if args.dataset == "tiny-repeat"
                       else dds.Dataset.range(10**9).map(_rows).repeat())
            dataset_id = dds.register_dataset(client, dataset)
            for mode in ("DYNAMIC", "OFF"):
                for slow in ("none", "blocked", "reading"):
                    job = f"{mode}-{slow}"
                    r = measure(client, dataset_id, mode, job, slow, args.seconds)
                    stalled = stalled or r.pop("stalled")
                    emit(bench="X1 fast trainer", mode=mode, window=window, slow=slow,
                         dataset=args.dataset, **r)
                    if stalled:
                        break
                if stalled:
                    break
            if stalled:  # a stuck read cannot be closed: end here
                sys.stdout.flush()
                os._exit(0)
            client.close()


if __name__ == "__main__":
    main()
