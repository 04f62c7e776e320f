"""Where a per-worker input pipeline was: saved in checkpoints, restored with them.

A :class:`~dask_dataservice.ps.coordinator.PerWorkerIterator` given to a
:class:`~dask_dataservice.Checkpoint` (``Checkpoint(model=..., input=iterator)``) has its
position saved with the variables, in the same final write of the checkpoint's attributes
(a checkpoint is complete, variables and position, or not there at all):

- the position is, per training worker *name*, how many elements that worker's iterator
  handed out (``next`` calls that returned). Worker names, unlike addresses, survive a
  restart of the worker processes (``dask worker --name``, a nanny, a restarted cluster
  that names its workers the same).
- restoring gives the iterator a fresh identity and the saved counts: the next function
  scheduled on a worker builds that worker's dataset again and skips the elements it had
  handed out, so training resumes where the checkpoint was taken.

Counts are exact only when read after ``ClusterCoordinator.join()`` (``fit`` and its
callbacks save only then): a function still running may have taken an element whose
updates are not in the variables yet. Skipping re-runs the pipeline up to the position,
so the pipeline must be deterministic (a seeded shuffle, a fixed file order).

Not yet: a data-service dataset (``from_dataset_id``) cannot be repositioned this way (its
elements come from a job shared with other readers); restoring a position onto one raises
:class:`InputPositionError`. The design for DYNAMIC jobs (the splits consumed) is in
``docs/training.md``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from distributed import Client

from ._exceptions import ParameterServerError

__all__ = ["CountingIterator", "InputPositionError", "positions", "reposition"]


class InputPositionError(ParameterServerError, ValueError):
    """An input position cannot be saved or restored for this input."""


#: The training-worker plugin's extension name (``_runner_plugin.RUNNER_NAME``, which
#: imports this module).
_RUNNER_NAME = "dataservice-ps-runner"


class PerWorkerIterator(Protocol):
    uid: str
    start: dict[str, int]


class CountingIterator:
    """An iterator that counts what it hands out, after skipping ``skip`` elements first.

    The skip happens on the first ``next`` (in the runner thread of the training worker,
    never on an event loop).
    """

    def __init__(self, dataset: Any, skip: int = 0) -> None:
        self._dataset = dataset
        self._it: Iterator[Any] | None = None
        self._skip = int(skip)
        #: Elements handed out, the skipped ones included.
        self.count = 0

    def __iter__(self) -> CountingIterator:
        return self

    def __next__(self) -> Any:
        if self._it is None:
            if self._skip and _is_service_dataset(self._dataset):
                raise InputPositionError(
                    "the input position of a data-service dataset (from_dataset_id, "
                    "distribute) cannot be restored: its elements come from a job shared "
                    "with other readers (see docs/training.md, 'Input position')")
            self._it = iter(self._dataset)
            for _ in range(self._skip):
                next(self._it)
                self.count += 1
        value = next(self._it)
        self.count += 1
        return value


def _is_service_dataset(dataset: Any) -> bool:
    # by module, not isinstance: ps/ does not import the service (tests/test_ps_layering.py)
    return any(c.__module__.startswith("dask_dataservice.service")
               for c in type(dataset).__mro__)


def _counts_on_worker(uid: str, extension: str, dask_worker: Any = None) -> dict[str, int]:
    """Run on each worker by ``client.run``: ``{worker name: count}`` of iterator ``uid``."""
    plugin = dask_worker.extensions.get(extension) if dask_worker is not None else None
    it = plugin._iterators.get(uid) if plugin is not None else None
    if not isinstance(it, CountingIterator):
        return {}
    return {str(dask_worker.name): it.count}


def positions(client: Client, iterator: PerWorkerIterator) -> dict[str, int]:
    """``{training worker name: elements handed out}`` of ``iterator`` now.

    Workers that never read it are absent; so are those gone since, and a worker restarted
    since its last checkpoint restore counts from its start position again.
    """
    replies = client.run(_counts_on_worker, iterator.uid, _RUNNER_NAME, on_error="ignore")
    out: dict[str, int] = dict(iterator.start)
    for reply in replies.values():
        if isinstance(reply, dict):
            out.update(reply)
    return out


def reposition(iterator: PerWorkerIterator, counts: dict[str, int]) -> None:
    """Make ``iterator`` start again at ``counts`` (a fresh iterator on every worker)."""
    import secrets

    bad = {k: v for k, v in counts.items() if not isinstance(v, int) or v < 0}
    if bad:
        raise InputPositionError(f"input positions must be counts >= 0, got {bad}")
    iterator.start = dict(counts)
    iterator.uid = secrets.token_hex(6)
