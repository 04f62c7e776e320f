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
- gives ``register_dataset`` the futures of the chunks (or of the persisted partitions) by a
  name derived from their keys (``dask-dataservice-<digest>``). Once the dispatcher has
  registered the dataset (the names are in its metadata, ``"published"``),
  :func:`publish` publishes them on the scheduler, so that they outlive the registering
  client. They stay while a live dataset lists the name: when the dispatcher collects the
  last such dataset (``dataservice.dispatcher.dataset-gc-timeout``, a dataset never read),
  it unpublishes the name and the keys are released; else until the scheduler stops (or
  ``client.unpublish_dataset(name)``). Publishing after the registration, not before, is
  what keeps a name shared with a dataset being collected at the same moment: either the
  dispatcher counts the new dataset before it collects the old one, or it unpublished the
  name before this client publishes it again (this client's futures hold the keys meanwhile).

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

__all__ = ["large_inputs", "move", "publish", "threshold"]

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


async def move(client: Any, ops: list[Op], split_size: int | None,
               pins: dict[str, list[Any]]) -> dict[int, Any]:
    """Move ``ops`` (from :func:`large_inputs`) to the cluster: ``{id(op): replacement}`` for
    :func:`~dask_dataservice.data.dask_source.pickling_with`; the futures to publish once the
    dataset is registered go to ``pins`` (by name, see :func:`publish`)."""
    replacements: dict[int, Any] = {}
    for op in ops:
        if isinstance(op, TensorSlices):
            replacements[id(op)] = await _scatter_slices(client, op, split_size, pins)
        else:
            assert isinstance(op, FromDask)
            replacements[id(op)] = await _persist(client, op, pins)
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


async def _scatter_slices(client: Any, op: TensorSlices, split_size: int | None,
                          pins: dict[str, list[Any]]) -> Any:
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
        pins[pin] = futures
        refs.append(ScatteredArray(keys, rows, tuple(leaf.shape), leaf.dtype.str,
                                   scheduler_id, pin))
    it = iter(refs)
    return map_structure(lambda _leaf: next(it), op.data)


async def publish(client: Any, pins: dict[str, list[Any]]) -> None:
    """Publish each name's futures (after the registration, see the module docstring): kept
    beyond this client, until the dispatcher frees the last dataset using the name. A name
    published already holds the same keys (it is derived from them) and is left alone:
    replacing it would release them before these futures' own claim reaches the scheduler."""
    if not pins:
        return
    published = set(await client.scheduler.publish_list())
    fresh = {name: futures for name, futures in pins.items() if name not in published}
    if fresh:
        await client._publish_dataset(**fresh)


async def _persist(client: Any, op: FromDask, pins: dict[str, list[Any]]) -> FromDask:
    collection = op._collection
    if client.asynchronous:
        persisted = client.persist(collection)
    else:  # pickling a large graph: not on the event loop
        persisted = await asyncio.to_thread(client.persist, collection)
    moved = FromDask(persisted, op.rows, op.locality)
    assert moved.pin_name is not None  # persisted: its graph holds Futures
    pins[moved.pin_name] = moved._futures(dict(persisted.__dask_graph__()))
    return moved
