"""dds.torch.ShardedEmbedding steps/s against a local torch.nn.Embedding (issue 13), JSON lines.

    python benchmarks/torch_ps.py [--rows 1000000] [--dim 16] [--batch 4096] [--steps 200]

Same model both ways: an embedding of ``rows x dim`` float32, a batch of ``batch`` random
ids (with repeats) per step, the loss ``(emb(ids).sum(1) ** 2).mean()`` and plain SGD.

- local: ``torch.nn.Embedding(sparse=True)`` and ``torch.optim.SGD`` in this process;
- ps: the table is a ShardedVariable over 2 parameter servers (worker processes), the step
  runs on 2 training workers via ``ClusterCoordinator.schedule``: gather of the unique ids,
  backward, sparse gradient to the PS's SGD.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np


def emit(**record: object) -> None:
    print(json.dumps(record), flush=True)


def ps_step(emb, rows, batch, seed):
    import torch

    ids = torch.from_numpy(np.random.default_rng(seed).integers(0, rows, batch))
    loss = emb(ids).pow(2).sum(1).mean()
    loss.backward()


def zeros(shape, dtype, partition_offset):
    return np.full(shape, 0.01, dtype)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()

    import torch
    from distributed import Client, Nanny, Scheduler, SpecCluster

    import dask_dataservice as dds
    from dask_dataservice.ps import optimizers
    from dask_dataservice.torch import ShardedEmbedding

    load = open("/proc/loadavg").read().split()[0]
    # local baseline
    emb = torch.nn.Embedding(args.rows, args.dim, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.01)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        ids = torch.from_numpy(rng.integers(0, args.rows, args.batch))
        opt.zero_grad()
        emb(ids).pow(2).sum(1).mean().backward()
        opt.step()
    local = args.steps / (time.perf_counter() - t0)
    emit(bench="torch-embedding", mode="local", steps_per_s=round(local, 1), load=load,
         torch=torch.__version__, python=platform.python_version())

    workers = {f"ps{i}": {"cls": Nanny, "options": {"nthreads": 1, "resources": {"ps": 1}}}
               for i in range(2)}
    workers.update({f"w{i}": {"cls": Nanny, "options": {"nthreads": 1}} for i in range(2)})
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": None}}
    with SpecCluster(workers=workers, scheduler=scheduler, silence_logs=40) as cluster, \
            Client(cluster) as client:
        client.wait_for_workers(4)
        strategy = dds.ParameterServerStrategy(
            client, variable_partitioner=dds.partitioners.FixedShardsPartitioner(2))
        coordinator = dds.ClusterCoordinator(strategy)
        with strategy.scope():
            table = dds.Variable(zeros, shape=(args.rows, args.dim), dtype="float32", name="emb")
        sharded = ShardedEmbedding(table, optimizers.SGD(learning_rate=0.01))
        for seed in range(20):  # warm-up: imports of torch on the workers, connections
            coordinator.schedule(ps_step, args=(sharded, args.rows, args.batch, seed))
        coordinator.join()
        t0 = time.perf_counter()
        for seed in range(args.steps):
            coordinator.schedule(ps_step, args=(sharded, args.rows, args.batch, seed))
        coordinator.join()
        ps = args.steps / (time.perf_counter() - t0)
    emit(bench="torch-embedding", mode="ps", steps_per_s=round(ps, 1), ratio_to_local=round(
        ps / local, 3), ps=2, workers=2, rows=args.rows, dim=args.dim, batch=args.batch,
        load=open("/proc/loadavg").read().split()[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
