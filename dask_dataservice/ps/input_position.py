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

A data-service dataset (``from_dataset_id``, ``distribute``) read with
``track_position=True`` saves, per training worker, the position its reads reached (which
source elements it was given: see ``dask_dataservice.service.protocol._positions``); restoring
starts a new job from the union of the saved positions of a shared (named) job, or from
the worker's own for a private one. Read without ``track_position``, it has no position:
saving raises :class:`InputPositionError`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from distributed import Client

from ..errors import InputPositionError

__all__ = ["CountingIterator", "InputPositionError", "positions", "reposition"]

#: The key of a restore's nonce in a repositioned iterator's start positions: training
#: workers that resume a shared data-service job from one restore share the new job.
RESTORE_KEY = "__restore__"


#: The training-worker plugin's extension name (``_runner_plugin.RUNNER_NAME``, which
#: imports this module).
_RUNNER_NAME = "dataservice-ps-runner"


class PerWorkerIterator(Protocol):
    uid: str
    start: dict[str, Any]


class CountingIterator:
    """An iterator that counts what it hands out, after skipping ``skip`` elements first.

    The skip happens on the first ``next`` (in the runner thread of the training worker,
    never on an event loop). A data-service dataset is not skipped through: with saved
    ``positions`` (``{worker name: position}`` of the checkpoint) it reads a new job that
    starts where they say.
    """

    def __init__(self, dataset: Any, skip: int = 0,
                 positions: dict[str, Any] | None = None, worker: str = "") -> None:
        self._dataset = dataset
        self._it: Iterator[Any] | None = None
        self._skip = int(skip)
        self._positions = positions
        self._worker = worker
        #: Elements handed out, the skipped ones included.
        self.count = 0

    @classmethod
    def at(cls, dataset: Any, start: dict[str, Any], worker: str) -> CountingIterator:
        """Worker ``worker``'s iterator from a handle's start positions."""
        mine = start.get(worker, 0)
        if isinstance(mine, int) and not any(isinstance(v, dict) for v in start.values()):
            return cls(dataset, mine)
        return cls(dataset, 0, start, worker)

    def __iter__(self) -> CountingIterator:
        return self

    def __next__(self) -> Any:
        if self._it is None:
            dataset = self._dataset
            if _is_service_dataset(dataset):
                dataset = self._resumed(dataset)
            elif self._positions is not None:
                raise InputPositionError(
                    "the checkpoint holds a data-service input position, but this input is "
                    "not a data-service dataset")
            self._it = iter(dataset)
            for _ in range(self._skip):
                next(self._it)
                self.count += 1
            self._dataset = dataset
        value = next(self._it)
        self.count += 1
        return value

    def close(self) -> None:
        """Close the dataset's iterator (its threads; a data-service reader releases its
        iteration client)."""
        it, self._it = self._it, None
        close = getattr(it, "close", None)
        if close is not None:
            close()

    def _resumed(self, dataset: Any) -> Any:
        if self._skip:
            raise InputPositionError(
                "the input position of a data-service dataset (from_dataset_id, distribute) "
                "is not a count of elements: this checkpoint was saved with another input "
                "(see docs/training.md, 'Input position')")
        if self._positions is None:
            return dataset
        source = _position_source(dataset)
        if source is None:
            raise InputPositionError(
                "restoring a data-service input position needs a dataset read with "
                "track_position=True (from_dataset_id or distribute)")
        saved = {k: v for k, v in self._positions.items() if isinstance(v, dict)}
        return source.resumed(dataset, saved, self._worker,
                              str(self._positions.get(RESTORE_KEY, "")))

    def position(self) -> int | dict[str, Any]:
        """Elements handed out, or a data-service dataset's input position."""
        if self._it is None and self._positions is not None:  # not read since the restore
            saved = self._positions.get(self._worker, 0)
            return saved if isinstance(saved, dict | int) else 0
        if self._it is not None and _is_service_dataset(self._dataset):
            source = _position_source(self._dataset)
            if source is None:
                raise InputPositionError(
                    "a data-service dataset has an input position only when read with "
                    "track_position=True (from_dataset_id or distribute)")
            position: dict[str, Any] = source.position_of(self._dataset)
            return position
        return self.count


def _position_source(dataset: Any) -> Any:
    """The op of ``dataset`` that tracks a data-service input position, or None (by duck
    typing: ps/ does not import the service)."""
    op = getattr(dataset, "_op", None)
    while op is not None:
        if hasattr(op, "resumed") and hasattr(op, "position_of"):
            return op
        inputs: tuple[Any, ...] = tuple(getattr(op, "inputs", ()))
        op = inputs[0] if len(inputs) == 1 else None
    return None


def _is_service_dataset(dataset: Any) -> bool:
    # by module, not isinstance: ps/ does not import the service (tests/project/test_layering.py)
    return any(c.__module__.startswith("dask_dataservice.service")
               for c in type(dataset).__mro__)


def _counts_on_worker(uid: str, extension: str,
                      dask_worker: Any = None) -> dict[str, int | dict[str, Any]]:
    """Run on each worker by ``client.run``: ``{worker name: position}`` of iterator ``uid``
    (a count, or a data-service position; ``{"error": message}`` if it has none)."""
    plugin = dask_worker.extensions.get(extension) if dask_worker is not None else None
    it = plugin._iterators.get(uid) if plugin is not None else None
    if not isinstance(it, CountingIterator):
        return {}
    try:
        return {str(dask_worker.name): it.position()}
    except InputPositionError as e:
        return {str(dask_worker.name): {"error": str(e)}}


def positions(client: Client, iterator: PerWorkerIterator) -> dict[str, Any]:
    """``{training worker name: elements handed out}`` of ``iterator`` now (for a
    data-service dataset, the worker's input position instead of a count).

    Workers that never read it are absent; so are those gone since, and a worker restarted
    since its last checkpoint restore counts from its start position again.
    """
    replies = client.run(_counts_on_worker, iterator.uid, _RUNNER_NAME, on_error="ignore")
    out: dict[str, Any] = {k: v for k, v in iterator.start.items() if k != RESTORE_KEY}
    for reply in replies.values():
        if isinstance(reply, dict):
            for name, value in reply.items():
                if isinstance(value, dict) and "error" in value:
                    raise InputPositionError(
                        f"no input position on training worker {name}: {value['error']}")
                out[name] = value
    return out


def reposition(iterator: PerWorkerIterator, counts: dict[str, Any]) -> None:
    """Make ``iterator`` start again at ``counts`` (a fresh iterator on every worker):
    per worker name, a count of elements, or a data-service input position (a dict)."""
    import secrets

    bad = {k: v for k, v in counts.items()
           if not isinstance(v, dict) and (isinstance(v, bool) or not isinstance(v, int) or v < 0)}
    if bad:
        raise InputPositionError(f"input positions must be counts >= 0 (or data-service "
                                 f"positions), got {bad}")
    iterator.start = dict(counts)
    iterator.uid = secrets.token_hex(6)
    if any(isinstance(v, dict) for v in counts.values()):
        iterator.start[RESTORE_KEY] = iterator.uid
