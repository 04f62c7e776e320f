"""SidecarEvaluator: evaluate each checkpoint that training writes, in a process of its own.

::

    # evaluate.py, started next to the training coordinator (no cluster needed)
    w = dds.Variable(np.zeros(10, "f4"), name="w")            # local variables, same names
    evaluator = SidecarEvaluator(dds.Checkpoint(model={"w": w}), eval_fn, eval_data,
                                 checkpoint_dir="/ckpts", metrics_file="/ckpts/eval.jsonl")
    evaluator.start()    # returns after the checkpoint that training marked final

Theory of operation
-------------------
- Training saves with :class:`~.callbacks.ModelCheckpoint` into ``checkpoint_dir``: one
  ``ckpt-<n>`` directory per save, each complete once its attributes are written (a
  checkpoint being written is not picked up), and ``latest`` naming the newest. When
  training ends normally, ``latest`` says ``"final": true``.
- The evaluator looks at the directory every ``poll_interval`` seconds (TensorFlow's
  side-car polls too) and evaluates every complete checkpoint it has not evaluated yet, in
  save order (never only the newest: each checkpoint gets its metrics). A checkpoint
  deleted before its turn (``max_to_keep``) is skipped with a warning.
- Evaluating one: restore it onto the evaluator's own variables (local, in this process),
  then ``eval_fn(batch)`` for each batch of ``data`` (at most ``steps``), averaging the
  returned metrics. One JSON line per checkpoint goes to ``metrics_file`` (flushed) and
  to the log.
- It stops after the final checkpoint, after ``max_evaluations``, or when no new
  checkpoint appeared for ``timeout`` seconds (then :class:`TimeoutError`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import zarr

from ._fit_run import _metrics
from ._store import checkpoint_store
from .checkpoint import FORMAT, Checkpoint

logger = logging.getLogger(__name__)

__all__ = ["SidecarEvaluator"]

_NAME = re.compile(r"^ckpt-(\d+)$")


def _complete(path: str) -> dict[str, Any] | None:
    """The attributes of a complete checkpoint at ``path`` (None: absent or being written)."""
    try:
        attrs = dict(zarr.open_group(checkpoint_store(path, read_only=True), mode="r").attrs)
    except (FileNotFoundError, zarr.errors.NodeNotFoundError):
        return None
    return attrs if attrs.get("format") == FORMAT else None


class SidecarEvaluator:
    """Evaluates every checkpoint in ``checkpoint_dir`` (see the module documentation).

    Parameters
    ----------
    checkpoint : Checkpoint
        Of this process's own (local) variables, named as in training.
    eval_fn : callable
        ``eval_fn(batch) -> {"metric": number}`` on the restored variables.
    data : iterable, or a function returning one
        Iterated again for each checkpoint (a function is called each time).
    steps : int, optional
        At most this many batches per evaluation.
    """

    def __init__(self, checkpoint: Checkpoint, eval_fn: Callable[[Any], Any],
                 data: Iterable[Any] | Callable[[], Iterable[Any]],
                 checkpoint_dir: str | os.PathLike[str], steps: int | None = None,
                 max_evaluations: int | None = None,
                 metrics_file: str | os.PathLike[str] | None = None,
                 poll_interval: float = 1.0, timeout: float | None = None) -> None:
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(f"checkpoint must be a dds.Checkpoint, got {type(checkpoint).__name__}")
        if not callable(eval_fn):
            raise TypeError(f"eval_fn must be callable, got {type(eval_fn).__name__}")
        for name, value in (("steps", steps), ("max_evaluations", max_evaluations)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        self.checkpoint = checkpoint
        self.eval_fn = eval_fn
        self.data = data
        self.checkpoint_dir = os.fspath(checkpoint_dir)
        self.steps = steps
        self.max_evaluations = max_evaluations
        self.metrics_file = os.fspath(metrics_file) if metrics_file is not None else None
        self.poll_interval = poll_interval
        self.timeout = timeout
        #: One record per evaluated checkpoint: its name, save counter and metrics.
        self.results: list[dict[str, Any]] = []
        self._done: set[int] = set()

    # -- the loop ---------------------------------------------------------------------------
    def start(self) -> list[dict[str, Any]]:
        """Evaluate checkpoints until the final one (blocking); returns :attr:`results`."""
        last_new = time.monotonic()
        while True:
            found = self._pending()
            for number in found:
                self._evaluate(number)
                if self.max_evaluations is not None and len(self.results) >= self.max_evaluations:
                    return self.results
            if found:
                last_new = time.monotonic()
            final = self._final()
            if final is not None and all(n in self._done for n in self._listed() if n <= final):
                return self.results
            if self.timeout is not None and time.monotonic() - last_new > self.timeout:
                raise TimeoutError(f"no new checkpoint in {self.checkpoint_dir} for "
                                   f"{self.timeout:g} s (and none marked final)")
            time.sleep(self.poll_interval)  # watching a directory: polling, as TF's side-car

    def _listed(self) -> list[int]:
        try:
            names = os.listdir(self.checkpoint_dir)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for m in map(_NAME.match, names) if m)

    def _pending(self) -> list[int]:
        out = []
        for number in self._listed():
            if number in self._done:
                continue
            if _complete(self._path(number)) is None:
                break  # being written: later ones wait for it (save order)
            out.append(number)
        return out

    def _final(self) -> int | None:
        try:
            with open(os.path.join(self.checkpoint_dir, "latest")) as f:
                latest = json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        match = _NAME.match(str(latest.get("path", "")))
        return int(match.group(1)) if latest.get("final") and match else None

    def _path(self, number: int) -> str:
        return os.path.join(self.checkpoint_dir, f"ckpt-{number}")

    # -- one evaluation -----------------------------------------------------------------------
    def _evaluate(self, number: int) -> None:
        self._done.add(number)
        path = self._path(number)
        try:
            self.checkpoint.restore(path)
        except Exception:
            if os.path.exists(path):
                raise
            # deleted before or while it was read (ModelCheckpoint's max_to_keep)
            logger.warning("SidecarEvaluator: %s was deleted before it was evaluated", path)
            return
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        data = self.data() if callable(self.data) else self.data
        for i, batch in enumerate(data):
            if self.steps is not None and i >= self.steps:
                break
            for key, value in _metrics(self.eval_fn(batch)).items():
                sums[key] = sums.get(key, 0.0) + value
                counts[key] = counts.get(key, 0) + 1
        record: dict[str, Any] = {"checkpoint": os.path.basename(path),
                                  "save_counter": self.checkpoint.save_counter,
                                  **{k: sums[k] / counts[k] for k in sums}}
        self.results.append(record)
        logger.info("SidecarEvaluator: %s", record)
        if self.metrics_file is not None:
            with open(self.metrics_file, "a") as f:
                f.write(json.dumps(record) + "\n")


def read_metrics(path: str | os.PathLike[str]) -> list[Mapping[str, Any]]:
    """The records a SidecarEvaluator wrote to ``metrics_file``."""
    with open(os.fspath(path)) as f:
        return [json.loads(line) for line in f if line.strip()]
