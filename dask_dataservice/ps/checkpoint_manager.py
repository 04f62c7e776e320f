"""CheckpointManager: numbered checkpoints in a directory, the newest ``max_to_keep`` kept.

TensorFlow's ``tf.train.CheckpointManager`` over :class:`~.checkpoint.Checkpoint`::

    ckpt = dds.Checkpoint(model=model, optimizer=opt)
    manager = dds.CheckpointManager(ckpt, "s3://bucket/run-7", max_to_keep=3)
    manager.restore_or_initialize()        # the newest checkpoint, if there is one
    ...
    manager.save()                         # s3://bucket/run-7/ckpt-1, then ckpt-2, ...

Theory of operation
-------------------
- ``directory`` is a local path or any fsspec URL (``s3://``, ``gs://``, ``memory://``...);
  each save writes a complete checkpoint to ``<directory>/<checkpoint_name>-<number>`` (a
  zarr group, complete once its attributes are written: :mod:`.checkpoint`), then replaces the
  state file ``<directory>/latest`` whole (a JSON object: ``path``, the newest checkpoint's
  name; ``all`` and ``timestamps``, the managed checkpoints, oldest first;
  ``last_preserved_timestamp``). Locally it is written to a temporary file, fsync'd and
  renamed; on an object store it is one PUT, which is atomic. So a crash at any point leaves a
  state naming complete checkpoints only. It is the file :class:`~.callbacks.ModelCheckpoint`
  writes and :class:`~.evaluator.SidecarEvaluator` reads (``ckpt-<n>`` names, ``latest``).
- Numbering: ``save()`` numbers a checkpoint with the Checkpoint's ``save_counter`` after the
  save (1, 2, ...), ``save(checkpoint_number=n)`` with ``n`` (an int or a variable).
- Deletion: after each save, while more than ``max_to_keep`` checkpoints are managed, the
  oldest leaves the list; it is deleted unless ``keep_checkpoint_every_n_hours`` says to
  preserve it (at least that many hours after the last preserved one: kept on storage, no
  longer managed). ``max_to_keep=None`` keeps every checkpoint.
- A new manager on the same directory takes up the state file: the same checkpoints,
  ``latest_checkpoint`` and preservation clock (a clock that went back behind the last
  preserved timestamp makes it manage none of the older ones, with a warning: they are kept).
- ``checkpoint_interval`` with ``step_counter``: ``save()`` writes only when the step counter
  moved at least that far since the last save (``check_interval=False`` saves anyway).

Saves and deletions are blocking I/O on the calling thread (the coordinator's: never an
event loop), as :meth:`.checkpoint.Checkpoint.save` is.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable
from typing import Any

from .checkpoint import Checkpoint

logger = logging.getLogger(__name__)

__all__ = ["CheckpointManager"]

_STATE = "latest"


class _Directory:
    """The manager's directory on its filesystem (fsspec's; the local one for a path)."""

    def __init__(self, directory: str) -> None:
        import fsspec

        self.fs, self.root = fsspec.core.url_to_fs(directory)
        self.local = "file" in _protocols(self.fs) or "local" in _protocols(self.fs)
        #: How paths are shown and handed to Checkpoint: as given, without a trailing slash.
        self.display = directory.rstrip("/") or directory

    def path(self, name: str) -> str:
        return f"{self.display}/{name}"

    def read_state(self) -> dict[str, Any] | None:
        try:
            data = self.fs.cat_file(f"{self.root}/{_STATE}")
        except FileNotFoundError:
            return None
        try:
            state = json.loads(data)
        except ValueError:
            logger.warning("CheckpointManager: %s is not JSON: ignored", self.path(_STATE))
            return None
        return state if isinstance(state, dict) else None

    def write_state(self, state: dict[str, Any]) -> None:
        data = json.dumps(state).encode()
        target = f"{self.root}/{_STATE}"
        if not self.local:
            self.fs.pipe_file(target, data)  # one object, written whole
            return
        tmp = f"{target}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)

    def exists(self, name: str) -> bool:
        self.fs.invalidate_cache(self.root)
        return bool(self.fs.exists(f"{self.root}/{name}"))

    def remove(self, name: str) -> None:
        try:
            self.fs.rm(f"{self.root}/{name}", recursive=True)
        except FileNotFoundError:
            pass

    def makedirs(self) -> None:
        self.fs.makedirs(self.root, exist_ok=True)


def _protocols(fs: Any) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def _as_int(value: Any, what: str) -> int:
    if hasattr(value, "read_value"):
        value = value.read_value()
    try:
        return int(value)
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be an integer or an integer variable, got "
                        f"{type(value).__name__}") from None


class CheckpointManager:
    """Saves numbered checkpoints of ``checkpoint`` in ``directory`` and deletes old ones.

    TensorFlow's ``tf.train.CheckpointManager`` (same arguments, in the same order).

    Parameters
    ----------
    checkpoint : Checkpoint
        What to save and restore.
    directory : str or os.PathLike
        Where: a local directory or an fsspec URL (``s3://bucket/run``); created if missing.
    max_to_keep : int or None
        How many checkpoints to keep (the newest); ``None`` keeps all.
    keep_checkpoint_every_n_hours : float, optional
        Preserve (never delete) one checkpoint per this many hours among those that leave
        the ``max_to_keep`` window.
    checkpoint_name : str, default "ckpt"
        The checkpoints' name prefix: ``<directory>/<checkpoint_name>-<number>``.
    step_counter : variable or int-like, optional
        Read at each :meth:`save` when ``checkpoint_interval`` is set.
    checkpoint_interval : int, optional
        Minimum steps of ``step_counter`` between two saves.
    init_fn : callable, optional
        Called by :meth:`restore_or_initialize` when there is no checkpoint to restore.

    Raises
    ------
    TypeError
        If ``checkpoint`` is not a :class:`Checkpoint`.
    ValueError
        For a ``max_to_keep`` that is not a positive integer or None, a
        ``checkpoint_interval`` without ``step_counter``, or a ``checkpoint_name`` that is
        not a plain name.
    """

    def __init__(self, checkpoint: Checkpoint, directory: str | os.PathLike[str],
                 max_to_keep: int | None, keep_checkpoint_every_n_hours: float | None = None,
                 checkpoint_name: str = "ckpt", step_counter: Any = None,
                 checkpoint_interval: int | None = None,
                 init_fn: Callable[[], Any] | None = None) -> None:
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(f"checkpoint must be a dds.Checkpoint, got {type(checkpoint).__name__}")
        if max_to_keep is not None and (isinstance(max_to_keep, bool)
                                        or not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(
                f"max_to_keep must be a positive integer or None, got {max_to_keep!r}")
        if checkpoint_interval is not None and step_counter is None:
            raise ValueError("step_counter should be passed if checkpoint_interval is not None")
        if not re.fullmatch(r"[A-Za-z0-9_.]+", checkpoint_name or ""):
            raise ValueError(f"checkpoint_name must be a plain name (letters, digits, '_', "
                             f"'.'), got {checkpoint_name!r}")
        self._checkpoint = checkpoint
        self._dir = _Directory(os.fspath(directory))
        self._max_to_keep = max_to_keep
        self._keep_every = keep_checkpoint_every_n_hours
        self._name = checkpoint_name
        self._step_counter = step_counter
        self._interval = checkpoint_interval
        self._init_fn = init_fn
        self._last_step: int | None = None
        #: Managed checkpoints (names) and their save times, oldest first.
        self._managed: dict[str, float] = {}
        self._latest: str | None = None
        now = time.time()
        self._last_preserved = now
        state = self._dir.read_state()
        if state is not None:
            latest = state.get("path")
            self._latest = str(latest) if latest else None
            names = [str(n) for n in state.get("all") or []]
            stamps = [float(t) for t in state.get("timestamps") or []]
            last = float(state.get("last_preserved_timestamp", now))
            if last > now:
                logger.warning(
                    "CheckpointManager: the clock (%.0f) is behind the last preserved "
                    "checkpoint timestamp (%.0f) of %s: its earlier checkpoints are kept and "
                    "no longer managed", now, last, self._dir.display)
            else:
                self._last_preserved = last
                self._managed = {n: t for n, t in zip(names, stamps, strict=False) if t <= now}

    # -- TensorFlow's properties ---------------------------------------------------------------
    @property
    def directory(self) -> str:
        """The directory (or URL) given."""
        return self._dir.display

    @property
    def checkpoint(self) -> Checkpoint:
        return self._checkpoint

    @property
    def checkpoint_interval(self) -> int | None:
        return self._interval

    @property
    def checkpoints(self) -> list[str]:
        """The managed checkpoints' paths, oldest first."""
        return [self._dir.path(n) for n in self._managed]

    @property
    def latest_checkpoint(self) -> str | None:
        """The newest checkpoint's path (None before the first save in a new directory)."""
        return self._dir.path(self._latest) if self._latest is not None else None

    # -- saving --------------------------------------------------------------------------------
    def save(self, checkpoint_number: Any = None, check_interval: bool = True) -> str | None:
        """Save a checkpoint, then delete those beyond ``max_to_keep``.

        Parameters
        ----------
        checkpoint_number : int or integer variable, optional
            The number in its name; by default the Checkpoint's ``save_counter`` after it.
        check_interval : bool, default True
            With ``checkpoint_interval``: skip the save unless ``step_counter`` moved that far.

        Returns
        -------
        str or None
            The checkpoint's path, or None when ``checkpoint_interval`` skipped it.
        """
        step = None
        if self._interval is not None:
            step = _as_int(self._step_counter, "step_counter")
            if (check_interval and self._last_step is not None
                    and step - self._last_step < self._interval):
                return None
        number = (self._checkpoint.save_counter + 1 if checkpoint_number is None
                  else _as_int(checkpoint_number, "checkpoint_number"))
        name = f"{self._name}-{number}"
        self._dir.makedirs()
        self._checkpoint.save(self._dir.path(name))
        self._managed.pop(name, None)  # saved again: now the newest
        self._managed[name] = time.time()
        self._latest = name
        self._sweep()
        self._dir.write_state({
            "path": name, "all": list(self._managed), "timestamps": list(self._managed.values()),
            "last_preserved_timestamp": self._last_preserved})
        if step is not None:
            self._last_step = step
        return self._dir.path(name)

    def _sweep(self) -> None:
        """Leave at most ``max_to_keep`` managed; delete (or preserve) the oldest."""
        if self._max_to_keep is None:
            return
        while len(self._managed) > self._max_to_keep:
            name = next(iter(self._managed))
            stamp = self._managed.pop(name)
            if (self._keep_every is not None
                    and stamp - self._keep_every * 3600.0 >= self._last_preserved):
                self._last_preserved = stamp
                continue
            self._dir.remove(name)

    def sync(self) -> None:
        """Wait for pending saves: none are (every save is complete when it returns)."""

    # -- restoring -----------------------------------------------------------------------------
    def restore_or_initialize(self) -> str | None:
        """Restore the newest checkpoint, or call ``init_fn`` when there is none.

        Returns
        -------
        str or None
            The path restored, or None (initialized).
        """
        latest = self.latest_checkpoint
        if latest is not None:
            self._checkpoint.restore(latest)
            return latest
        if self._init_fn is not None:
            self._init_fn()
        return None

    def __repr__(self) -> str:
        return (f"<dds.CheckpointManager {self.directory} max_to_keep={self._max_to_keep} "
                f"checkpoints={len(self._managed)}>")
