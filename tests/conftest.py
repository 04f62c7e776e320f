"""Leak checks on every test, as distributed's ``gen_cluster`` applies them to its own.

- Tests decorated with ``gen_cluster``/``gen_test`` (``dask_dataservice.testing.gen_cluster``
  or distributed's) already run inside ``distributed.utils_test.clean()``; they are left alone.
- Every other test runs inside ``clean()`` too: no thread, subprocess (multiprocessing child),
  Client, Worker, Nanny or comm it started may outlive it (threads get distributed's 5 s grace).
  A test that must share such a resource with later tests is marked ``no_leak_check`` and says
  why.
"""

from __future__ import annotations

import inspect

import pytest
from distributed.utils_test import clean


def _is_gen_test(fn) -> bool:
    """gen_cluster/gen_test wrap an ``async def`` in a synchronous test function."""
    return not inspect.iscoroutinefunction(fn) and inspect.iscoroutinefunction(inspect.unwrap(fn))


@pytest.fixture(autouse=True)
def _leak_checks(request):
    fn = getattr(request, "function", None)
    if fn is None or _is_gen_test(fn) or request.node.get_closest_marker("no_leak_check"):
        yield
        return
    with clean(threads=True, processes=True, instances=True):
        yield
