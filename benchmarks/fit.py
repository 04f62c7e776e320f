"""dds.fit overhead per step against a hand-written schedule/join loop (issue 13), JSON lines.

    python benchmarks/fit.py [--steps 2000] [--epochs 4] [--repeat 3]

A local cluster of worker processes (1 parameter server, 2 training workers); this process
is the coordinator. Both loops run the same step (``next(iterator)``, ``assign_add`` on a
PS scalar, return ``{"loss": ...}``) and both fetch every step's metrics and average them
per epoch, so the difference is what fit adds: callbacks' hooks, per-step bookkeeping and
the ordered fetch. Target: fit's time per step within 5 % of the hand-written loop.
"""

from __future__ import annotations

import argparse
import json
import platform
import time


def emit(**record: object) -> None:
    print(json.dumps(record), flush=True)


def step(iterator, v):
    x = next(iterator)
    v.assign_add(1.0)
    return {"loss": float(x)}


def dataset():
    import dask_dataservice as dds

    return dds.Dataset.range(1000).repeat()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="steps per epoch")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    from distributed import Client, Nanny, Scheduler, SpecCluster

    import dask_dataservice as dds

    workers = {"ps0": {"cls": Nanny, "options": {"nthreads": 1, "resources": {"ps": 1}}}}
    workers.update({f"w{i}": {"cls": Nanny, "options": {"nthreads": 1}} for i in range(2)})
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": None}}
    with SpecCluster(workers=workers, scheduler=scheduler, silence_logs=40) as cluster, \
            Client(cluster) as client:
        client.wait_for_workers(3)
        strategy = dds.ParameterServerStrategy(client)
        coordinator = dds.ClusterCoordinator(strategy)
        with strategy.scope():
            v = dds.Variable(0.0, name="v")
        iterator = iter(coordinator.create_per_worker_dataset(dataset))

        def by_hand() -> None:
            for _ in range(args.epochs):
                rvs = [coordinator.schedule(step, args=(iterator, v)) for _ in range(args.steps)]
                coordinator.join()
                losses = [rv.fetch()["loss"] for rv in rvs]
                _ = sum(losses) / len(losses)

        def with_fit() -> None:
            dds.fit(coordinator, lambda it: step(it, v), iterator, epochs=args.epochs,
                    steps_per_epoch=args.steps, verbose=False)

        by_hand()  # warm-up: connections, imports, per-worker iterators
        with_fit()
        times: dict[str, list[float]] = {"hand": [], "fit": []}
        for _ in range(args.repeat):  # interleaved: both see the same machine load
            for name, fn in (("hand", by_hand), ("fit", with_fit)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        total = args.steps * args.epochs
        best = {k: min(v) for k, v in times.items()}
        median = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        for name in ("hand", "fit"):
            emit(bench="fit-overhead", loop=name, steps=total,
                 us_per_step_best=round(1e6 * best[name] / total, 1),
                 us_per_step_median=round(1e6 * median[name] / total, 1))
        emit(bench="fit-overhead", overhead_best_pct=round(100 * (best["fit"] / best["hand"] - 1), 1),
             overhead_median_pct=round(100 * (median["fit"] / median["hand"] - 1), 1),
             target_pct=5, load=open("/proc/loadavg").read().split()[0],
             python=platform.python_version())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
