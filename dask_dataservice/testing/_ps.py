"""Cleanup asserts for parameter-server training (see :mod:`dask_dataservice.testing`)."""

from __future__ import annotations

import asyncio
import tempfile
import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from distributed import Worker


def _leftovers(worker: Worker) -> list[str]:
    from ..ps._runner_plugin import RUNNER_NAME
    from ..ps.server import PLUGIN_NAME

    out = []
    ps = worker.extensions.get(PLUGIN_NAME)
    if ps is not None:
        busy = {k: s.lane.pending for k, s in ps.shards.items() if s.lane.pending}
        if busy:
            out.append(f"{worker.address}: shard lanes still have work {busy}")
    runner = worker.extensions.get(RUNNER_NAME)
    if runner is not None:
        waiting = [a for a, ch in runner.channels.items() if not ch.idle]
        if waiting:
            out.append(f"{worker.address}: channels to {waiting} still wait for replies")
        if runner._group.tasks and not runner.channels:
            out.append(f"{worker.address}: runner tasks without channels {runner._group.tasks}")
    return out


async def assert_ps_cleanup(*workers: Worker, timeout: float = 10.0) -> None:
    """No shard lane has queued or running work and no channel waits for a reply.

    Polls until ``timeout`` (work in flight when a test body returns may still finish).
    """
    deadline = time.monotonic() + timeout
    while True:
        left = [line for w in workers for line in _leftovers(w)]
        if not left:
            return
        if time.monotonic() > deadline:
            raise AssertionError("parameter-server plugins are not idle:\n" + "\n".join(left))
        await asyncio.sleep(0.01)


_zarr_warm = False


def warm_up_zarr() -> None:
    """Start zarr's process-wide I/O threads (its loop and the loop's pool, at full size).

    zarr keeps them for the life of the process; a test module calls this at import so that
    a leak check's snapshot already holds them. Once per process: the second call returns.
    """
    global _zarr_warm
    if _zarr_warm:
        return
    import zarr

    zarr.create_array(zarr.storage.MemoryStore(), shape=(1,), dtype="f4")[:] = 1
    with tempfile.TemporaryDirectory() as d:
        arr = zarr.create_array(zarr.storage.LocalStore(d), shape=(64,), chunks=(1,),
                                dtype="f4", compressors=None)
        arr[:] = np.ones(64, "f4")  # 64 concurrent chunk writes: every pool thread starts
        _ = arr[:]
    _zarr_warm = True
