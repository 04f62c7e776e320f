"""Helpers shared by the test modules (imported as ``_helpers``: tests/ is on sys.path)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
from hypothesis import settings

#: Hypothesis settings for the pipeline-library tests: quick, no deadline.
FAST = settings(max_examples=60, deadline=None)

#: gen_cluster worker specs: a parameter server (resource ``ps``) and a training worker.
PS = ("127.0.0.1", 1, {"resources": {"ps": 1}})
WK = ("127.0.0.1", 1)


def py(x):
    """A comparable plain-Python form of an element (arrays become lists)."""
    if isinstance(x, dict):
        return {k: py(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(py(v) for v in x)
    if isinstance(x, (np.ndarray, np.generic)):
        return x.tolist()
    return x


def elements(ds):
    """Every element of a dataset, in plain-Python form."""
    return [py(x) for x in ds]


def in_thread(s, body):
    """Run ``body(client)`` in a thread with a synchronous client of scheduler ``s``."""
    from distributed import Client

    def run():
        with Client(s.address, set_as_default=False) as c:
            return body(c)

    return asyncio.to_thread(run)


async def poll(cond, timeout: float = 10.0, what: str = "condition") -> None:
    """Wait (without blocking the loop) until ``cond()`` is true, or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def wait(cond, timeout: float = 20.0, what: str = "condition") -> None:
    """Block until ``cond()`` is true, or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


async def read(ds) -> list:
    """Iterate a (data-service) dataset to the end, in a thread: the loop stays free."""
    return await asyncio.to_thread(list, ds)


async def distribute(ds, mode, client, **kwargs):
    """``ds.apply(dds.distribute(mode, client, ...))`` from a thread (it registers: blocking)."""
    import dask_dataservice as dds

    return await asyncio.to_thread(ds.apply, dds.distribute(mode, client, **kwargs))
