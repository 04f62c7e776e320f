"""The demo's input pipeline: synthetic click-through data, generated where it is read."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..data.dataset import Dataset

__all__ = ["DENSE_FEATURES", "SPARSE_FEATURES", "VOCAB_SIZE", "make_click_dataset"]

#: Shape of the synthetic click-through data, loosely after the Criteo display-ads layout.
DENSE_FEATURES = 13
SPARSE_FEATURES = 26
VOCAB_SIZE = 100_000
#: Rows are generated in blocks of at most this many; a block is the unit of work.
_MAX_BLOCK_ROWS = 4096
#: ... and of at least this many, unless the dataset is smaller.
_MIN_BLOCK_ROWS = 256


def _block_rows(n: int) -> int:
    """Rows per generated block: about 64 blocks, each between 256 and 4096 rows."""
    return max(1, min(n, max(_MIN_BLOCK_ROWS, min(_MAX_BLOCK_ROWS, -(-n // 64)))))


def _click_block(index: int, *, n: int, block_rows: int, seed: int) -> dict[str, Any]:
    """Rows ``[index * block_rows, ...)`` of the synthetic dataset, as a dict of columns.

    Each block has its own generator, seeded by ``(seed, index)``, so a block is the same
    whichever process makes it, and in whatever order.
    """
    import numpy as np

    start = index * block_rows
    rows = min(block_rows, n - start)
    rng = np.random.default_rng([seed, index])
    dense = rng.lognormal(mean=1.0, sigma=1.5, size=(rows, DENSE_FEATURES)).astype(np.float32)
    sparse = rng.integers(0, 2**31 - 1, size=(rows, SPARSE_FEATURES), dtype=np.int64)
    # The first categorical feature takes few values (an "advertiser"), so that the model
    # can learn per-id effects; clicks depend on it and on two dense features.
    sparse[:, 0] = rng.integers(0, 1000, size=rows)
    d = np.log1p(dense)
    logit = 1.5 * (d[:, 0] - 1.3) - 1.0 * (d[:, 1] - 1.3) + 3.0 * (sparse[:, 0] % 7 == 0) - 2.5
    label = rng.random(rows) < 1.0 / (1.0 + np.exp(-logit))
    return {"dense": dense, "sparse": sparse, "label": label.astype(np.int8)}


def _preprocess(batch: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    return {
        "dense": np.log1p(batch["dense"]),
        "sparse": batch["sparse"] % VOCAB_SIZE,
        "label": batch["label"].astype(np.float32),
    }


def make_click_dataset(
    n: int, *, batch_size: int = 256, shuffle_buffer: int = 10_000, seed: int = 0
) -> Dataset:
    """A synthetic click-through pipeline: generate → shuffle → batch → preprocess → prefetch.

    Each example is a dict with ``dense`` (13 float32 features, log-normal like counts),
    ``sparse`` (26 categorical ids) and ``label`` (0/1, about 20% positives, depending on two
    dense features and the first categorical one, so a model can learn it). Batches come out
    with ``dense`` log-transformed and ``sparse`` hashed into ``VOCAB_SIZE`` buckets.

    The examples are generated where the pipeline runs, a block of rows at a time from a
    ``Dataset.range`` of block indices, so the pipeline is small to ship and splittable: under
    DYNAMIC sharding the dispatcher hands out block indices and each data worker generates,
    shuffles, batches and preprocesses the blocks it is given.
    """
    from dask_dataservice.data import AUTOTUNE, Dataset

    block_rows = _block_rows(n)
    blocks = -(-n // block_rows)
    make_block = functools.partial(_click_block, n=n, block_rows=block_rows, seed=seed)
    return (
        Dataset.range(blocks)
        .map(make_block)
        .flat_map(Dataset.from_tensor_slices)  # one dict per example
        .shuffle(shuffle_buffer, seed=seed)
        .batch(batch_size)
        .map(_preprocess, num_parallel_calls=AUTOTUNE)
        .prefetch(2)
    )
