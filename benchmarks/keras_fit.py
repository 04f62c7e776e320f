"""Keras ``model.fit`` on parameter servers against ``dds.fit`` with a hand-written JAX step on
the same model (steps/s), and the loss curves of Keras' local fit and of the PS fit; JSON lines.

    python benchmarks/keras_fit.py [--steps 100] [--epochs 3] [--repeat 2] [--batch 256]

A local cluster of worker processes (1 parameter server, 2 training workers); this process is
the coordinator. The model: ``Embedding(10_000, 16)`` over 4 ids a row, ``Flatten``,
``Dense(32, relu)``, ``Dense(1)``, mse loss, ``Adagrad(0.05)`` (the table partitioned in 2 by
a MinSizePartitioner). Both training loops read the batch's rows of the table and the other
weights from the PS, differentiate on the worker and send the gradients (the table's as
rows) to the same server-side Adagrad:

- ``keras``: ``model.fit(DatasetCreator, steps_per_epoch=...)`` of the model created in
  ``strategy.scope()`` (the adapter: Keras' stateless loss, compiled metrics (mae) merged
  on the coordinator, Keras' History);
- ``hand``: ``dds.fit`` with a step written by hand: ``gather`` of the batch's distinct ids,
  the same forward pass in ``jax.numpy`` on those rows, ``jax.value_and_grad``,
  ``optimizer.apply_gradients``; it returns the loss only.

Then the curves: the same model from the same initial weights, fit by Keras in this process
and on the cluster with one training worker (steps in order: the curves should be the same)
and with two (asynchronous steps).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

ROWS, DIM, IDS = 10_000, 16, 4


def emit(**record: object) -> None:
    print(json.dumps(record), flush=True)


def make_model():
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((IDS,), dtype="int32"),
                             keras.layers.Embedding(ROWS, DIM, name="emb"),
                             keras.layers.Flatten(),
                             keras.layers.Dense(32, activation="relu", name="hidden"),
                             keras.layers.Dense(1, name="out")])


def make_data(batch: int, n_batches: int = 64):
    import numpy as np

    rng = np.random.default_rng(1)
    ids = rng.integers(0, ROWS, (batch * n_batches, IDS)).astype("int32")
    y = ((ids % 13) / 13.0).mean(axis=1, keepdims=True).astype("float32")
    return ids, y


def dataset_fn(batch: int):
    def fn(input_context=None):
        import dask_dataservice as dds

        ids, y = make_data(batch)
        return dds.Dataset.from_tensor_slices((ids, y)).batch(batch).repeat()
    return fn


def hand_step(variables, optimizer):
    """A training step written by hand: the batch's rows of the table (``gather``), the
    other weights whole, a jnp forward pass, value_and_grad, the PS update."""
    def step(iterator):
        import jax
        import jax.numpy as jnp
        import numpy as np
        from distributed import get_worker

        from dask_dataservice.ps.optimizers import IndexedSlices
        from dask_dataservice.ps.variables import read_values

        worker = get_worker()
        grad_fn = getattr(worker, "_bench_grad_fn", None)
        if grad_fn is None:
            def loss(params, inverse, y):
                rows, k1, b1, k2, b2 = params
                h = rows[inverse].reshape(inverse.shape[0], -1)
                h = jax.nn.relu(h @ k1 + b1)
                return jnp.mean((h @ k2 + b2 - y) ** 2)
            grad_fn = worker._bench_grad_fn = jax.jit(jax.value_and_grad(loss))
        ids, y = next(iterator)
        uniq, inverse = np.unique(ids, return_inverse=True)
        rows = variables[0].gather(uniq)
        params = [rows, *read_values(*variables[1:])]
        value, grads = grad_fn(params, inverse.reshape(ids.shape), y)
        updates = [(IndexedSlices(np.asarray(grads[0]), uniq), variables[0])]
        updates += [(np.asarray(g), v) for g, v in zip(grads[1:], variables[1:], strict=True)]
        optimizer.apply_gradients(updates)
        return {"loss": float(value)}
    return step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="steps per epoch")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()

    import keras
    import numpy as np
    from distributed import Client, Nanny, Scheduler, SpecCluster

    import dask_dataservice as dds
    import dask_dataservice.keras  # noqa: F401 - wraps keras.Model.fit

    emit(bench="keras_fit", python=platform.python_version(), keras=keras.__version__,
         cpus=os.cpu_count(), load=os.getloadavg(), steps=args.steps, epochs=args.epochs,
         batch=args.batch)
    workers = {"ps0": {"cls": Nanny, "options": {"nthreads": 1, "resources": {"ps": 1}}}}
    workers.update({f"w{i}": {"cls": Nanny, "options": {"nthreads": 1}} for i in range(2)})
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": None}}
    partitioner = dds.partitioners.MinSizePartitioner(min_shard_bytes=64 << 10, max_shards=2)
    with SpecCluster(workers=workers, scheduler=scheduler, silence_logs=40) as cluster, \
            Client(cluster) as client:
        client.wait_for_workers(3)
        strategy = dds.ParameterServerStrategy(client, variable_partitioner=partitioner)
        coordinator = dds.ClusterCoordinator(strategy)
        with strategy.scope():
            model = make_model()
        model.compile(optimizer=keras.optimizers.Adagrad(0.05), loss="mse", metrics=["mae"])
        placed = dds.keras.on_ps(model)
        hand = hand_step(placed.variables, placed.optimizer)
        creator = dds.DatasetCreator(dataset_fn(args.batch))

        def with_keras() -> None:
            model.fit(creator, epochs=args.epochs, steps_per_epoch=args.steps, verbose=0)

        def with_hand() -> None:
            dds.fit(coordinator, hand, creator, epochs=args.epochs, steps_per_epoch=args.steps,
                    verbose=False)

        for fn in (with_keras, with_hand):  # warm-up: imports, jit, connections
            model.fit(creator, epochs=1, steps_per_epoch=8, verbose=0) if fn is with_keras \
                else dds.fit(coordinator, hand, creator, epochs=1, steps_per_epoch=8, verbose=False)
        times: dict[str, list[float]] = {"keras": [], "hand": []}
        for _ in range(args.repeat):  # interleaved: both see the same machine load
            for name, fn in (("keras", with_keras), ("hand", with_hand)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        total = args.steps * args.epochs
        best = {k: total / min(v) for k, v in times.items()}
        emit(bench="throughput", workers=2, ps=1, keras_steps_per_s=round(best["keras"], 1),
             hand_steps_per_s=round(best["hand"], 1),
             ratio=round(best["keras"] / best["hand"], 3),
             examples_per_s_keras=round(best["keras"] * args.batch),
             load=os.getloadavg())

        # the loss curves: local Keras fit, PS fit with one and with two training workers
        curves = {}
        ids, y = make_data(args.batch)
        batches = [(ids[i:i + args.batch], y[i:i + args.batch])
                   for i in range(0, len(ids), args.batch)]

        def forever():
            while True:
                yield from batches

        def fresh(on_ps: bool):
            if on_ps:
                with strategy.scope():
                    m = make_model()
            else:
                m = make_model()
            m.compile(optimizer=keras.optimizers.Adagrad(0.05), loss="mse", metrics=["mae"])
            return m

        local = fresh(False)
        curves["local"] = local.fit(forever(), epochs=args.epochs, steps_per_epoch=args.steps,
                                    verbose=0).history["loss"]
        two = fresh(True)
        curves["ps_2_workers"] = two.fit(creator, epochs=args.epochs,
                                         steps_per_epoch=args.steps, verbose=0).history["loss"]
        client.retire_workers([cluster.workers["w1"].worker_address], close_workers=True)
        one = fresh(True)
        curves["ps_1_worker"] = one.fit(creator, epochs=args.epochs,
                                        steps_per_epoch=args.steps, verbose=0).history["loss"]
        gap = max(abs(a - b) / abs(b) for a, b in zip(curves["ps_1_worker"], curves["local"],
                                                       strict=True))
        emit(bench="loss_curves", optimizer="Adagrad(0.05)", steps_per_epoch=args.steps,
             **{k: [round(x, 6) for x in v] for k, v in curves.items()},
             max_rel_gap_1_worker=float(f"{gap:.2e}"), load=os.getloadavg())
        weights_gap = max(float(np.max(np.abs(a - b))) for a, b in
                          zip(one.get_weights(), local.get_weights(), strict=True))
        emit(bench="final_weights", max_abs_gap_1_worker=float(f"{weights_gap:.2e}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
