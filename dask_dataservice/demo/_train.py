"""The parameter-server stage of ``dask-dataservice demo``: train a click-through model.

:func:`train_click_model` takes a connected client and a click-through input pipeline
(:func:`~dask_dataservice.demo.make_click_dataset`: batches of ``{"dense", "sparse",
"label"}``), registers the
pipeline with the data service, and trains on it with parameter-server training:

- each training worker reads the *same* data-service job under DYNAMIC sharding as its
  per-worker dataset, so every example is trained on once across the workers;
- the model is an embedding of the categorical ids (a ``ShardedVariable`` over the parameter
  servers), summed per example and projected, plus a logistic regression on the dense
  features; gradients are applied on the parameter servers by a server-side optimizer;
- steps are scheduled with ``ClusterCoordinator.schedule`` and joined; a callback reports
  progress; the model is saved to a checkpoint directory at the end.

Accuracy and log loss are "progressive validation" figures: each batch is scored with the
parameters of the moment, before its own update, so they are measured on examples the model
had not seen yet.

The demo is an application of the package: it uses the public API (``import
dask_dataservice as dds``), as a user's script would; nothing in the package imports it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from distributed import Client

    from ..data.dataset import Dataset
    from ..ps.variables import ShardedVariable, Variable

__all__ = ["TrainResult", "train_click_model"]


@dataclass(frozen=True)
class TrainResult:
    """What :func:`train_click_model` did."""

    #: Training steps: scheduled calls that got a batch and trained on it.
    steps: int
    #: All scheduled calls: also those that found their worker's stream over while another
    #: worker still had batches (they train on nothing).
    scheduled: int
    #: Examples trained on (each exactly once under DYNAMIC sharding).
    examples: int
    seconds: float
    #: Progressive-validation accuracy and mean log loss.
    accuracy: float
    logloss: float
    #: Where the checkpoint was written (or None).
    checkpoint: str | None

    @property
    def examples_per_second(self) -> float:
        return self.examples / self.seconds if self.seconds > 0 else float("inf")


def _embedding_init(shape: tuple[int, ...], dtype: Any,
                    partition_offset: tuple[int, ...]) -> np.ndarray:
    # Deterministic per row, whatever the sharding: seeded by the shard's first row.
    rng = np.random.default_rng(1234 + partition_offset[0])
    return (rng.standard_normal(shape) * 0.01).astype(dtype)


def _train_step(iterator: Iterator[dict[str, Any]], emb: ShardedVariable | Variable,
                u: Variable, w: Variable, b: Variable, optimizer: Any,
                steps: Variable) -> tuple[int, int, float]:
    """One step on a training worker: returns ``(rows, correct, logloss_sum)``."""
    from dask_dataservice.ps.optimizers import IndexedSlices
    from dask_dataservice.ps.variables import read_values

    try:
        batch = next(iterator)
    except StopIteration:
        return 0, 0, 0.0
    dense = np.asarray(batch["dense"], dtype=np.float32)
    ids = np.asarray(batch["sparse"])
    y = np.asarray(batch["label"], dtype=np.float32)
    n, fields = ids.shape
    vectors = emb.gather(ids)                        # (n, fields, dim): one request per shard
    uu, ww, bb = read_values(u, w, b)                # in parallel
    h = vectors.sum(axis=1)
    logit = h @ uu + dense @ ww + bb
    p = 1.0 / (1.0 + np.exp(-np.clip(logit, -30, 30)))
    eps = 1e-7
    loss = float(-np.sum(y * np.log(p + eps) + (1 - y) * np.log(1 - p + eps)))
    correct = int(np.sum((p > 0.5) == (y > 0.5)))
    err = (p - y) / n
    g_rows = np.repeat(err[:, None] * uu[None, :], fields, axis=0)   # d loss / d vector
    optimizer.apply_gradients([
        (IndexedSlices(g_rows.astype(np.float32), ids.reshape(-1)), emb),
        ((h.T @ err).astype(np.float32), u),
        ((dense.T @ err).astype(np.float32), w),
        (np.float32(err.sum()), b),
    ])
    steps.assign_add(1)
    return n, correct, loss


def train_click_model(client: Client, dataset: Dataset, *, examples: int, batch_size: int,
                      vocab_size: int, dense_features: int = 13, embedding_dim: int = 8,
                      optimizer: str = "adagrad", learning_rate: float = 0.05,
                      checkpoint_dir: str | None = None, job_name: str | None = None,
                      progress: Callable[[int, int], None] | None = None) -> TrainResult:
    """Train on ``dataset`` (``examples`` rows in batches of ``batch_size``); see module doc.

    ``client`` is a synchronous ``distributed.Client`` of a cluster with at least one worker
    with the ``ps`` resource and one other worker (which also serve data). ``progress`` is
    called as ``progress(examples_done, examples)`` while training runs.
    """
    import dask_dataservice as dds
    from dask_dataservice.ps import optimizers
    from dask_dataservice.ps import strategy as ps_strategy

    num_ps = max(1, len(ps_strategy.cluster_roles(client)[0]))
    strategy = dds.ParameterServerStrategy(
        client, variable_partitioner=dds.partitioners.MinSizePartitioner(
            min_shard_bytes=64 << 10, max_shards=num_ps))
    coordinator = dds.ClusterCoordinator(strategy)
    try:
        with strategy.scope():
            emb = dds.Variable(_embedding_init, shape=(vocab_size, embedding_dim), dtype="float32",
                               name="embedding")
            u = dds.Variable(np.full(embedding_dim, 0.1, np.float32), name="projection")
            w = dds.Variable(np.zeros(dense_features, np.float32), name="dense_weights")
            b = dds.Variable(np.float32(0), name="bias")
            steps = dds.Variable(0, dtype="int64", name="step")
        opt = optimizers.get({"kind": optimizer, "learning_rate": learning_rate,
                              "name": f"demo_{optimizer}"})

        dataset_id = dds.register_dataset(client, dataset)
        assert client.scheduler is not None  # a connected client
        address = str(client.scheduler.address)
        job = job_name or f"ps-demo-{dataset_id}"

        def dataset_fn() -> Dataset:
            return dds.from_dataset_id("distributed_epoch", address, dataset_id, job_name=job)

        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
        # The workers share one DYNAMIC job, but not evenly: a worker whose stream has ended
        # answers its steps with nothing while another still has batches. So steps go out in
        # rounds, each sized to what is left (and at least a few steps per worker feeder, so
        # every worker gets some), until every example was trained on, or rounds keep finding
        # no data at all (the stream is over: examples were lost).
        start = time.perf_counter()
        rows: list[tuple[int, int, float]] = []
        done, empty_rounds = 0, 0
        feeders = len(strategy.worker_addresses) * 4
        while done < examples and empty_rounds < 5:
            left = max(feeders, math.ceil((examples - done) / batch_size))
            results = [coordinator.schedule(_train_step, args=(iterator, emb, u, w, b, opt, steps))
                       for _ in range(left)]
            new = 0
            for result in results:  # in order: each fetch waits for its step, no polling
                got = result.fetch()
                rows.append(got)
                new += got[0]
                if progress is not None:
                    progress(done + new, examples)
            coordinator.join()
            done += new
            empty_rounds = 0 if new else empty_rounds + 1
        seconds = time.perf_counter() - start
        n = sum(r[0] for r in rows)
        path = None
        if checkpoint_dir is not None:
            ckpt = dds.Checkpoint(model={"embedding": emb, "projection": u, "dense_weights": w,
                                         "bias": b}, step=steps, optimizer=opt)
            path = ckpt.save(checkpoint_dir)
    finally:
        coordinator.shutdown()
    return TrainResult(
        steps=sum(1 for r in rows if r[0]), scheduled=len(rows), examples=n, seconds=seconds,
        accuracy=sum(r[1] for r in rows) / n if n else float("nan"),
        logloss=sum(r[2] for r in rows) / n if n else float("nan"), checkpoint=path)
