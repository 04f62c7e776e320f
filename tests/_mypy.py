"""The project's one ``mypy --strict`` run: the package and a user's typed snippets together.

Imported as ``_mypy`` (tests/ is on sys.path) by tests/project/conftest.py, which starts the
session's run (:func:`session_run`) in the background as soon as the collection selected its
test, and by tests/project/test_typing.py, which waits for it and checks its report.

One process for both: almost all of a cold run (a fresh clone has no ``.mypy_cache``) is
spent on the third-party modules the package imports (distributed, numpy, zarr, torch, bokeh),
which a second process checking the snippets analysed again. The snippets import
``dask_dataservice`` from the tree being checked; that the installed wheel is typed for a
user's checker too is its ``py.typed``, asserted in tests/project/test_packaging.py.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The longest the run may take, from its start (cold, 45 s at load 1 on 2 cores; minutes at
#: load 8).
TIMEOUT = 840.0

#: A user's typed code against the public API: checks clean.
TYPED_SNIPPET = """
from __future__ import annotations

import numpy as np
from distributed import Client

import dask_dataservice as dds


def train(client: Client) -> float:
    ds = dds.Dataset.range(8).map(lambda x: x * 2).batch(4)
    dataset_id = dds.register_dataset(client, ds)
    read = dds.from_dataset_id(dds.ShardingPolicy.DYNAMIC, client, dataset_id)
    shared = ds.apply(dds.distribute("distributed_epoch", client, job_name="train"))
    total = 0
    for batch in read:
        total += int(np.sum(batch))
    for batch in shared:
        total += int(np.sum(batch))

    strategy = dds.ParameterServerStrategy(client)
    coordinator = dds.ClusterCoordinator(strategy)
    with strategy.scope():
        w = dds.Variable(np.zeros(4), name="w")

    def step(x: np.ndarray) -> float:
        w.assign_add(x)
        return float(np.sum(w.read_value()))

    per_worker = coordinator.create_per_worker_dataset(
        strategy.distribute_datasets_from_function(lambda ctx: dds.Dataset.range(4))
    )
    per_worker_iterator = iter(per_worker)

    def reduced(x: np.ndarray) -> float:
        return float(strategy.reduce("SUM", strategy.run(np.square, args=(x,)), axis=0))

    remote = coordinator.schedule(step, args=(np.ones(4),))
    summed = coordinator.schedule(reduced, args=[np.ones(4)])
    first = coordinator.schedule(next, args=(per_worker_iterator,))
    coordinator.join()
    values = coordinator.fetch([remote, summed, first])
    return float(remote.fetch()) + total + len(values)
"""

#: The same names misused: proves the checker sees real types, not ``Any``.
MISTYPED_SNIPPET = """
import dask_dataservice as dds

dds.register_dataset(None, 5)
dds.ClusterCoordinator(5)


def length(coordinator: dds.ClusterCoordinator) -> str:
    return coordinator.schedule(len, args=("ab",)).fetch()
"""


#: The snippets, by file name (written next to each other in a temporary folder).
SNIPPETS = {"snippet.py": TYPED_SNIPPET, "mistyped.py": MISTYPED_SNIPPET}


class MypyRun:
    """``mypy --strict dask_dataservice snippet.py mistyped.py`` in a subprocess, from the
    repository root (so ``[tool.mypy]`` of pyproject.toml applies), output to a file."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="dds-mypy-")
        self.folder = Path(self._dir.name)
        for name, code in SNIPPETS.items():
            (self.folder / name).write_text(code)
        self.command = [sys.executable, "-m", "mypy", "--strict", "dask_dataservice",
                        *(str(self.folder / name) for name in SNIPPETS)]
        self._out = open(self.folder / "report.txt", "w+")  # noqa: SIM115 - closed in stop()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(self.command, cwd=ROOT, stdout=self._out,
                                     stderr=subprocess.STDOUT, text=True)

    def result(self) -> tuple[int, str]:
        """Wait for the run (at most :data:`TIMEOUT` from its start): its exit code and
        report."""
        left = TIMEOUT - (time.monotonic() - self.started)
        try:
            code = self.proc.wait(max(left, 1.0))
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"mypy did not finish within {TIMEOUT:g}s") from None
        self._out.seek(0)
        return code, self._out.read()

    def stop(self) -> None:
        """End the run if it is still going (the session ends), and remove its folder."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._out.close()
        self._dir.cleanup()


_session: MypyRun | None = None


def session_run() -> MypyRun:
    """The session's run (started now if the collection did not start it)."""
    global _session
    if _session is None:
        _session = MypyRun()
    return _session


def stop_session_run() -> None:
    global _session
    if _session is not None:
        _session.stop()
        _session = None
