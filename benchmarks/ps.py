"""Parameter-server training benchmarks (issue 6): P1, P2, P3 as JSON lines.

    python benchmarks/ps.py [--ps 2] [--workers 2] [--only P1,P2,P3,P2-scaling] [--quick]

A local cluster of worker *processes* (``--ps`` parameter servers with the ``ps`` resource,
``--workers`` training workers); this process is the coordinator. Each line is one
measurement; ``tf`` is TensorFlow 2.21's figure on the same machine, ``target`` the goal.

- P1: 5,000 scheduled steps that ``assign_add`` a scalar PS variable, then join (steps/s);
  also the same with a step that touches no PS, and a local baseline (the same loop on a
  coordinator-side variable, no cluster).
- P2: a 1,000,000 x 64 float32 embedding table in 2 shards; each step gathers 4,096 random
  ids and applies a sparse SGD update to them (ids/s); local baseline: numpy on one array.
- P2-scaling (issue 16): P2 over 1, 2, 4 shards x 1, 2 training workers (``--p2-shards``,
  ``--p2-workers``; a cluster per worker count), three paths alternated in the same cluster
  (see ``P2_PATHS``): ``old`` (every update and every shard's request its own message, on
  distributed's comms), ``coalesce`` (updates held for the next request to their PS, one
  request per PS) and ``new`` (that on the PS data path, ``dataservice.ps.fast-path``). Each line gives ids/s (best and median) and the CPU each process spent per step
  (``cpu_us_per_step``: parameter servers, training workers, this coordinator, from
  ``getrusage``), which holds up better than ids/s on a shared machine.
- P3: a 16 MiB float32 variable in 2 shards; each step reads it whole and adds a tensor of
  the same size (MiB/s moved, both directions); local baseline: numpy copy + add.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import numpy as np


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


#: How many times each measured loop runs (``--repeat``); lines report the best and median.
REPEAT = 3


def timed(run) -> tuple[float, float]:
    """``(best, median)`` seconds of ``run()`` over REPEAT runs (the machine may be shared)."""
    times = sorted(_once(run) for _ in range(REPEAT))
    return times[0], times[len(times) // 2]


def _once(run) -> float:
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


#: glibc malloc settings for the worker processes (``--malloc default`` keeps distributed's).
#: distributed sets ``MALLOC_TRIM_THRESHOLD_=64 KiB``, which also turns off glibc's adaptive
#: mmap threshold: every buffer of a MiB or more is then a fresh mmap whose pages fault in
#: one by one, and a PS moving 8 MiB shards spends much of its time in page faults. Keeping
#: such buffers on the heap (and not trimming it) makes them reusable.
MALLOC_TUNED = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def cluster(n_ps: int, n_workers: int, malloc: str = "tuned"):
    import dask
    from distributed import Nanny, Scheduler, SpecCluster

    if malloc == "tuned":
        env = dict(dask.config.get("distributed.nanny.pre-spawn-environ"))
        env.update(MALLOC_TUNED)
        dask.config.set({"distributed.nanny.pre-spawn-environ": env})

    workers = {f"ps{i}": {"cls": Nanny, "options": {"nthreads": 1, "resources": {"ps": 1},
                                                     "dashboard_address": ":0"}}
               for i in range(n_ps)}
    workers.update({f"w{i}": {"cls": Nanny, "options": {"nthreads": 1, "dashboard_address": ":0"}}
                    for i in range(n_workers)})
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": None}}
    return SpecCluster(workers=workers, scheduler=scheduler, silence_logs=40)


# -- steps (module level: pickled by reference into the workers) --------------------------

def p1_step(v):
    v.assign_add(1.0)


def p1_empty():
    return None


def p2_step(emb, optimizer, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, emb.shape[0], 4096)
    rows = emb.gather(ids)
    from dask_dataservice.ps.optimizers import IndexedSlices

    optimizer.apply_gradients([(IndexedSlices(rows * 0.001, ids), emb)])


_DELTA = {}


def p3_step(var):
    value = var.numpy()
    delta = _DELTA.get(var.shape)
    if delta is None:
        delta = _DELTA[var.shape] = np.full(var.shape, 1.0, dtype=var.dtype)
    var.assign_add(delta)
    return float(value[0])


def zeros(shape, dtype, partition_offset):
    return np.zeros(shape, dtype)


# -- benchmarks ---------------------------------------------------------------------------

def bench_p1(client, steps: int) -> None:
    import dask_dataservice as dds

    strategy = dds.ParameterServerStrategy(client)
    coord = dds.ClusterCoordinator(strategy)
    with strategy.scope():
        v = dds.Variable(0.0, name="p1")
    for _ in range(2):  # warm-up (imports, connections)
        for _ in range(200):
            coord.schedule(p1_step, args=(v,))
        coord.join()
    v.assign(0.0)

    def run(fn, args):
        for _ in range(steps):
            coord.schedule(fn, args=args)
        coord.join()

    best, median = timed(lambda: run(p1_step, (v,)))
    assert float(v.numpy()) == steps * REPEAT, v.numpy()  # every update applied once
    emit(benchmark="P1", what="scheduled steps that assign_add a scalar PS variable", steps=steps,
         steps_per_s=round(steps / best), median_steps_per_s=round(steps / median),
         target=1200, tf=584)
    best, median = timed(lambda: run(p1_empty, ()))
    emit(benchmark="P1-empty", what="scheduled steps that touch no PS", steps=steps,
         steps_per_s=round(steps / best), median_steps_per_s=round(steps / median), tf=921)
    local = dds.Variable(0.0)
    t0 = time.perf_counter()
    for _ in range(steps):
        p1_step(local)
    dt = time.perf_counter() - t0
    emit(benchmark="P1-local", what="the same step on a coordinator-side variable, no cluster",
         steps=steps, seconds=round(dt, 4), steps_per_s=round(steps / dt))
    coord.shutdown()


def bench_p2(client, steps: int) -> None:
    import dask_dataservice as dds
    from dask_dataservice.ps import optimizers

    strategy = dds.ParameterServerStrategy(
        client, variable_partitioner=dds.partitioners.FixedShardsPartitioner(2))
    coord = dds.ClusterCoordinator(strategy)
    with strategy.scope():
        emb = dds.Variable(zeros, shape=(1_000_000, 64), dtype="f4", name="p2_embedding")
    sgd = optimizers.SGD(0.1, name="p2_sgd")
    for i in range(20):
        coord.schedule(p2_step, args=(emb, sgd, 10**6 + i))
    coord.join()
    def run():
        for i in range(steps):
            coord.schedule(p2_step, args=(emb, sgd, i))
        coord.join()

    best, median = timed(run)
    emit(benchmark="P2", what="gather 4096 random ids + sparse update, 1Mx64 f32 in 2 shards",
         steps=steps, ids_per_s=round(steps * 4096 / best),
         median_ids_per_s=round(steps * 4096 / median), target=2_000_000, tf=649_000)
    from dask_dataservice.ps.optimizers import dedupe_rows

    table = np.full((1_000_000, 64), 0.0, "f4")  # pages touched, as on a PS
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    n = max(20, steps // 4)
    for _ in range(n):
        ids = rng.integers(0, table.shape[0], 4096)
        rows = table[ids]
        uniq, grad = dedupe_rows(ids, rows * 0.001)
        table[uniq] -= 0.1 * grad
    dt = time.perf_counter() - t0
    emit(benchmark="P2-local", what="the same step in numpy on one local array", steps=n,
         ids_per_s=round(n * 4096 / dt))
    coord.shutdown()


def _cpu_seconds() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _set_path(settings: dict, dask_worker=None) -> None:
    """Switch a training worker to a path: set the keys, then close its PS channels (the
    next request makes new ones, of the kind the keys now say). Runs on the worker's loop."""
    import dask

    from dask_dataservice.ps._runner_plugin import RUNNER_NAME

    dask.config.set({f"dataservice.ps.{k}": v for k, v in settings.items()})
    runner = dask_worker.extensions.get(RUNNER_NAME) if dask_worker is not None else None
    channels = getattr(runner, "channels", {})
    for channel in channels.values():
        channel.close()
    channels.clear()


def _channel_kinds(dask_worker=None) -> list[str]:
    """The kinds of PS channels a training worker used (the path really taken)."""
    from dask_dataservice.ps._runner_plugin import RUNNER_NAME

    runner = dask_worker.extensions.get(RUNNER_NAME) if dask_worker is not None else None
    return sorted({type(c).__name__ for c in getattr(runner, "channels", {}).values()})


#: The P2-scaling paths (``dataservice.ps.*`` on the training workers): ``old`` is every
#: update and every shard's request a message of its own on distributed's comms,
#: ``coalesce`` one message per PS per step on distributed's comms, ``new`` that on the
#: PS data path (``ps/_fastpath.py``).
P2_PATHS = {"old": {"coalesce-bytes": "0", "fast-path": False},
            "coalesce": {"coalesce-bytes": "8 MiB", "fast-path": False},
            "new": {"coalesce-bytes": "8 MiB", "fast-path": True}}


def bench_p2_scaling(client, n_ps: int, n_workers: int, shards: list[int], steps: int) -> None:
    """P2 over ``shards`` with the old and the new path, A B A B (see the module doc)."""
    import dask_dataservice as dds
    from dask_dataservice.ps import optimizers

    names = {a: w["name"] for a, w in client.scheduler_info()["workers"].items()}
    for n_shards in shards:
        strategy = dds.ParameterServerStrategy(
            client, variable_partitioner=dds.partitioners.FixedShardsPartitioner(n_shards))
        coord = dds.ClusterCoordinator(strategy)
        with strategy.scope():
            emb = dds.Variable(zeros, shape=(1_000_000, 64), dtype="f4",
                               name=f"p2s_{n_shards}_{n_workers}")
        sgd = optimizers.SGD(0.1, name=f"p2s_sgd_{n_shards}_{n_workers}")
        runs: dict[str, list[tuple[float, dict[str, float], list[str]]]] = {
            k: [] for k in P2_PATHS}
        for rep in range(REPEAT + 1):  # the first round warms both paths up
            for path, value in P2_PATHS.items():
                client.run(_set_path, value)
                for i in range(20 if rep == 0 else 0):
                    coord.schedule(p2_step, args=(emb, sgd, 10**6 + i))
                coord.join()
                if rep == 0:
                    continue
                before, me = client.run(_cpu_seconds), _cpu_seconds()
                t0 = time.perf_counter()
                for i in range(steps):
                    coord.schedule(p2_step, args=(emb, sgd, i))
                coord.join()
                dt = time.perf_counter() - t0
                after = client.run(_cpu_seconds)
                cpu = {names[a]: (after[a] - before[a]) / steps for a in after}
                cpu["coordinator"] = (_cpu_seconds() - me) / steps
                kinds = sorted({k for ks in client.run(_channel_kinds).values() for k in ks})
                runs[path].append((dt, cpu, kinds))
        best = {}
        for path, got in runs.items():
            got.sort(key=lambda r: r[0])
            dt, cpu, kinds = got[0]
            median = got[len(got) // 2][0]
            best[path] = steps * 4096 / dt
            cpu_us = {k: round(v * 1e6) for k, v in sorted(cpu.items())}
            emit(benchmark="P2-scaling", path=path, ps=n_ps, workers=n_workers, shards=n_shards,
                 steps=steps, ids_per_s=round(best[path]),
                 median_ids_per_s=round(steps * 4096 / median),
                 cpu_us_per_step=cpu_us, cpu_us_per_step_total=sum(cpu_us.values()),
                 channels=kinds,
                 target=2_000_000, load=open("/proc/loadavg").read().split()[0])
        emit(benchmark="P2-scaling-ratio", ps=n_ps, workers=n_workers, shards=n_shards,
             new_over_old=round(best["new"] / best["old"], 2),
             coalesce_over_old=round(best["coalesce"] / best["old"], 2))
        client.run(_set_path, P2_PATHS["new"])
        coord.shutdown()


def bench_p3(client, steps: int) -> None:
    import dask_dataservice as dds

    strategy = dds.ParameterServerStrategy(
        client, variable_partitioner=dds.partitioners.FixedShardsPartitioner(2))
    coord = dds.ClusterCoordinator(strategy)
    n = (16 << 20) // 4
    with strategy.scope():
        var = dds.Variable(zeros, shape=(n,), dtype="f4", name="p3_dense")
    for _ in range(6):
        coord.schedule(p3_step, args=(var,))
    coord.join()
    def run():
        for _ in range(steps):
            coord.schedule(p3_step, args=(var,))
        coord.join()

    best, median = timed(run)
    mib = steps * 2 * 16
    emit(benchmark="P3", what="read a 16 MiB variable (2 shards) whole + assign_add same size",
         steps=steps, mib_per_s=round(mib / best), median_mib_per_s=round(mib / median),
         target=1700, tf=1400)
    value = np.zeros(n, "f4")
    delta = np.ones(n, "f4")
    t0 = time.perf_counter()
    for _ in range(steps):
        value.copy()
        value += delta
    dt = time.perf_counter() - t0
    emit(benchmark="P3-local", what="numpy copy + add of 16 MiB", steps=steps,
         mib_per_s=round(mib / dt))
    coord.shutdown()


def _bench_fixed(client, only: set[str], quick: bool) -> None:
    if "P1" in only:
        bench_p1(client, 1000 if quick else 5000)
    if "P2" in only:
        bench_p2(client, 50 if quick else 300)
    if "P3" in only:
        bench_p3(client, 20 if quick else 100)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--only", default="P1,P2,P3,P2-scaling")
    parser.add_argument("--quick", action="store_true", help="fewer steps (smoke run)")
    parser.add_argument("--malloc", choices=["tuned", "default"], default="tuned",
                        help="glibc malloc settings of the worker processes (see MALLOC_TUNED)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each measured loop")
    parser.add_argument("--p2-shards", default="1,2,4", help="P2-scaling: shard counts")
    parser.add_argument("--p2-workers", default="1,2", help="P2-scaling: training worker counts")
    args = parser.parse_args(argv)
    global REPEAT
    REPEAT = max(1, args.repeat)
    only = {x.strip().upper() for x in args.only.split(",")}
    from distributed import Client

    emit(benchmark="env", python=platform.python_version(), machine=platform.machine(),
         ps=args.ps, workers=args.workers, malloc=args.malloc,
         load=open("/proc/loadavg").read().split()[0])
    if only & {"P1", "P2", "P3"}:
        with cluster(args.ps, args.workers, args.malloc) as c, Client(c) as client:
            client.wait_for_workers(args.ps + args.workers)
            _bench_fixed(client, only, args.quick)
    if "P2-SCALING" in only:
        shards = [int(x) for x in args.p2_shards.split(",")]
        for n_workers in (int(x) for x in args.p2_workers.split(",")):
            with cluster(args.ps, n_workers, args.malloc) as c, Client(c) as client:
                client.wait_for_workers(args.ps + n_workers)
                bench_p2_scaling(client, args.ps, n_workers, shards, 50 if args.quick else 300)
    return 0


if __name__ == "__main__":
    sys.exit(main())
