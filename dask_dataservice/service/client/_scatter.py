"""Large in-memory inputs go to the workers through Dask, not in the pipeline's pickle.

When a dataset is registered, :func:`large_inputs` finds (on the registering thread, no RPC):

- every ``from_tensor_slices`` source whose arrays take more than
  ``dataservice.client.scatter-threshold`` bytes, and
- every ``from_dask`` source over a collection that is not persisted and whose pickled
  graph is larger than that (a graph that embeds its data, e.g. ``da.from_array(x)``).

:func:`move` then, on the client's loop:

- scatters each such array (arrays above 64 KiB; smaller ones stay in the pipeline) to the
  workers in chunks of rows, ``client.scatter(..., direct=True)`` (the bytes go from the
  client to the workers, not through the scheduler), under keys derived from the array's
  bytes, dtype, shape and chunking: registering the same array again finds its chunks on the
  cluster and scatters nothing;
- persists each such collection (its graph goes through the scheduler once, as
  ``client.persist`` sends it: the scheduler then keeps it for recomputation);
- publishes the chunks (or the persisted partitions) on the scheduler under a name derived
  from their keys (``dask-dataservice-<digest>``), so that they outlive the registering
  client: they stay on the cluster while the scheduler runs, until the name is unpublished
  (``client.unpublish_dataset(name)``).

The pipeline is then pickled with :func:`~dask_dataservice.data.dask_source.pickling_with`:
the moved sources carry :class:`~dask_dataservice.data.dask_source.ScatteredArray`
references (or the persisted keys), so it stays small. The splits do not change (index
ranges of the source; a chunk holds the rows of one split), so every sharding policy sees the
same elements in the same order as without the move. The fingerprint is the source's own (the
array's bytes), so the same array registered twice is the same dataset.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import cloudpickle
import numpy as np
from distributed import Future

from ... import config
from ...data._base import Op, walk
from ...data.dask_source import FromDask, ScatteredArray, _pin_name, _scheduler_id
from ...data.sources import TensorSlices
from ...data.splits import default_split_size
from ...data.structure import flatten, map_structure

__all__ = ["large_inputs", "move", "threshold"]

#: Arrays this small stay in the pipeline even when their source is moved.
MIN_LEAF_BYTES = 64 << 10
#: A chunk holds whole splits, about this many bytes (fewer fetches: a data worker keeps the
#: chunks it read last, see ``data/dask_source.py``), ...
CHUNK_BYTES = 4 << 20
#: ... and at most this many (a split of bigger rows reads several chunks).
MAX_CHUNK_BYTES = 64 << 20


def threshold() -> int | None:
    """``dataservice.client.scatter-threshold`` in bytes (None: never move)."""
    if config.get("client.scatter-threshold") is None:
        return None
    return config.get_bytes("client.scatter-threshold")


def large_inputs(op: Op) -> list[Op]:
    """The sources of the pipeline rooted at ``op`` to move out of its pickle (see the module
    docstring). Cheap for arrays (sizes only); a ``from_dask`` graph is pickled to size it."""
    limit = threshold()
    if limit is None:
        return []
    found: list[Op] = []
    for node in walk(op):
        if isinstance(node, TensorSlices):
            if node._chunk_rows() is None and sum(
                    leaf.nbytes for leaf in flatten(node.data)) > limit:
                found.append(node)
        elif (isinstance(node, FromDask) and node.scheduler_id is None
              and node._collection is not None
              and len(cloudpickle.dumps(node._collection)) > limit):
            found.append(node)
    return found


async def move(client: Any, ops: list[Op], split_size: int | None) -> dict[int, Any]:
    """Move ``ops`` (from :func:`large_inputs`) to the cluster: ``{id(op): replacement}`` for
    :func:`~dask_dataservice.data.dask_source.pickling_with`."""
    replacements: dict[int, Any] = {}
    for op in ops:
        if isinstance(op, TensorSlices):
            replacements[id(op)] = await _scatter_slices(client, op, split_size)
        else:
            assert isinstance(op, FromDask)
            replacements[id(op)] = await _persist(client, op)
    return replacements


def chunk_rows(leaf: np.ndarray, n: int, split_size: int | None) -> int:
    """Rows per chunk: whole splits of the source (``split_size`` rows, or the default),
    about :data:`CHUNK_BYTES`, at most :data:`MAX_CHUNK_BYTES`."""
    split = split_size or default_split_size(n)
    row_bytes = max(1, leaf.nbytes // max(1, n))
    splits = max(1, CHUNK_BYTES // max(1, split * row_bytes))
    return max(1, min(split * splits, n, MAX_CHUNK_BYTES // row_bytes))


def _digest(leaf: np.ndarray, rows: int) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{leaf.dtype.str}{leaf.shape}{rows}".encode())
    h.update(np.ascontiguousarray(leaf).view(np.uint8).data)
    return h.hexdigest()


async def _scatter_slices(client: Any, op: TensorSlices, split_size: int | None) -> Any:
    leaves = flatten(op.data)
    scheduler_id = _scheduler_id(client)
    refs: list[Any] = []
    for leaf in leaves:
        if leaf.nbytes <= MIN_LEAF_BYTES:
            refs.append(leaf)
            continue
        rows = chunk_rows(leaf, op.n, split_size)
        # hashing 100 MB takes ~0.1 s: not on the event loop
        digest = await asyncio.to_thread(_digest, leaf, rows)
        keys = tuple(f"dds-slices-{digest}-{i}" for i in range(-(-op.n // rows)))
        holders = await client.scheduler.who_has(keys=list(keys))
        if all(holders.get(k) for k in keys):  # registered before: the chunks are there
            futures: list[Any] = [Future(k, client) for k in keys]
        else:
            chunks = {key: np.ascontiguousarray(leaf[i * rows:(i + 1) * rows])
                      for i, key in enumerate(keys)}
            scattered = await client.scatter(chunks, direct=True, hash=False)
            futures = [scattered[k] for k in keys]
        pin = _pin_name(keys)
        await _publish(client, pin, futures)
        refs.append(ScatteredArray(keys, rows, tuple(leaf.shape), leaf.dtype.str,
                                   scheduler_id, pin))
    it = iter(refs)
    return map_structure(lambda _leaf: next(it), op.data)


async def _publish(client: Any, name: str, futures: list[Any]) -> None:
    """Publish ``futures`` under ``name``: kept while the scheduler runs, beyond this client.
    A name published already holds the same keys (it is derived from them) and is left alone:
    replacing it would release them before these futures' own claim reaches the scheduler."""
    if name not in await client.scheduler.publish_list():
        await client._publish_dataset(**{name: futures})


async def _persist(client: Any, op: FromDask) -> FromDask:
    collection = op._collection
    if client.asynchronous:
        persisted = client.persist(collection)
    else:  # pickling a large graph: not on the event loop
        persisted = await asyncio.to_thread(client.persist, collection)
    moved = FromDask(persisted, op.rows, op.locality)
    assert moved.pin_name is not None  # persisted: its graph holds Futures
    futures = moved._futures(dict(persisted.__dask_graph__()))
    await _publish(client, moved.pin_name, futures)
    return moved
