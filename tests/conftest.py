"""Leak checks on every test, as distributed's ``gen_cluster`` applies them to its own.

- Tests decorated with ``gen_cluster``/``gen_test`` (``dask_dataservice.testing.gen_cluster``
  or distributed's) already run inside ``distributed.utils_test.clean()``; they are left alone.
- Every other test runs inside ``clean()`` too: no thread, subprocess (multiprocessing child),
  Client, Worker, Nanny or comm it started may outlive it (threads get distributed's 5 s grace).
  A test that must share such a resource with later tests is marked ``no_leak_check`` and says
  why.
- The test files live in folders that mirror the package (docs/architecture.md, "Tests"); this
  file puts tests/ itself on ``sys.path`` so that every one of them imports the shared
  ``_helpers`` and ``_browser`` modules by name.
- Every test has exactly one tier marker (``pure``, ``component``, ``cluster``, ``process``;
  pyproject.toml says what each means): a module's ``pytestmark`` gives its dominant tier, a
  decorator on a test (or class) overrides it, the closest one wins. The collection fails,
  naming every test, when a test has none, so a new test cannot forget it.
- zarr runs its I/O on a process-wide event loop thread ("zarr_io") and thread pool, created on
  first use and closed at exit (zarr's design, like distributed's offload pool). They are started
  once, before the first test, so the leak checks count them as pre-existing instead of blaming
  whichever test touched zarr first.
- Worker processes of the clusters a test starts in this process (``LocalCluster``, ``Nanny``)
  are forked from a fork server that imported distributed and its dependencies once
  (``distributed.worker.multiprocessing-method: forkserver``, as distributed's own test suite
  does): two worker processes start in about 0.4 s instead of 1.5 s of CPU each. The fork server
  starts before the first test, like zarr's threads. Scripts, notebooks and commands the tests
  run keep Dask's default (``spawn``), as users run them: the page that starts worker processes
  without a ``__main__`` guard still fails as it would for a user.
- The suite writes bytecode caches even where ``PYTHONDONTWRITEBYTECODE`` is set (this file
  clears it for its test processes and the subprocesses they start): otherwise each of the
  three test processes rewrites and compiles all 320 test modules at collection (17 s instead
  of 10 s of CPU each) and every subprocess compiles the package again. The caches go to the
  ``__pycache__`` folders git ignores.
- Modules with a ``slow`` test run first, in their own order, so that the long tests start
  while every test process still has work behind them (``--dist worksteal``: an idle process
  takes half of a busy one's queue), and the suite does not end on one long test.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
from pathlib import Path

import dask
import pytest
from distributed.utils_test import clean

dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"})
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

#: The tiers, cheapest first (pyproject.toml ``markers`` says what each may start).
TIERS = ("pure", "component", "cluster", "process")

#: Threads of zarr's process-wide pool (fixed, so it cannot grow during a test).
ZARR_THREADS = 4


@pytest.fixture(scope="session", autouse=True)
def _fork_server_up_front():
    import multiprocessing.forkserver

    from distributed.utils import get_mp_context

    get_mp_context()  # sets the fork server's preload: distributed and its dependencies
    multiprocessing.forkserver.ensure_running()
    return


@pytest.fixture(scope="session", autouse=True)
def _zarr_threads_up_front():
    import zarr
    from zarr.core.sync import _get_executor, sync

    zarr.config.set({"threading.max_workers": ZARR_THREADS})

    async def noop() -> None:
        return None

    sync(noop())  # starts the zarr_io loop thread and creates the pool
    pool = _get_executor()
    barrier = threading.Barrier(ZARR_THREADS + 1)
    for _ in range(ZARR_THREADS):  # every pool thread exists once all wait together
        pool.submit(barrier.wait, 10)
    barrier.wait(10)
    yield


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


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects: it must see the tier that wins
def pytest_collection_modifyitems(session, config, items):
    """Give every test its closest tier marker only; fail the collection if one has none."""
    missing, doubled, chosen = [], [], {}
    for item in items:
        own = {m.name for m in item.own_markers if m.name in TIERS}
        if len(own) > 1:
            doubled.append(f"{item.nodeid} ({', '.join(sorted(own))})")
        chosen[item] = next((m for m in item.iter_markers() if m.name in TIERS), None)
        if chosen[item] is None:
            missing.append(item.nodeid)
    if missing or doubled:
        lines = [f"{len(missing)} test(s) without a tier marker (one of {', '.join(TIERS)}; "
                 "see pyproject.toml and docs/architecture.md, 'Tests'):", *missing]
        if doubled:
            lines += ["test(s) with more than one tier marker of their own:", *doubled]
        raise pytest.UsageError("\n  ".join(lines))
    # The closest marker wins: drop the farther ones (module, class) so that ``-m pure`` does
    # not select a test of a ``pure`` module that is marked ``cluster`` itself.
    nodes = {node for item in items for node in item.listchain()[:-1]}
    for node in nodes:
        node.own_markers[:] = [m for m in node.own_markers if m.name not in TIERS]
    for item, mark in chosen.items():
        item.own_markers[:] = [m for m in item.own_markers if m.name not in TIERS]
        item.add_marker(mark.name)
    # modules with a slow test first (a stable sort: each module keeps its order)
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)
