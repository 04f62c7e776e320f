"""Callbacks of :func:`~dask_dataservice.ps.fit.fit` (Keras' names and meaning).

A callback gets the :class:`~dask_dataservice.ps.fit.FitRun` of the training it watches as
``self.run`` (Keras: ``self.model``): ``run.stop_training = True`` ends training after the
current epoch, ``run.epoch``/``run.step`` say where training is.

Hooks, all called on the coordinator, in the thread that called ``fit``:

- ``on_train_begin(logs)``, ``on_train_end(logs)``;
- ``on_epoch_begin(epoch, logs)``, ``on_epoch_end(epoch, logs)``: the epoch's metrics,
  each the mean of the steps' values, after every step of the epoch finished (joined);
- ``on_train_batch_begin(batch, logs)`` when step ``batch`` is scheduled,
  ``on_train_batch_end(batch, logs)`` when it finished (in step order; ``logs`` holds the
  running means of the epoch so far).

Steps run asynchronously on the training workers, so a step's end does not mean that the
steps before it had their updates applied. A callback that needs every update in place
(a checkpoint) sets ``join_every = N``: ``fit`` then joins the coordinator before calling
``on_train_batch_end`` of every ``N``-th step (counted from the start of training, across
epochs), and at the end of each epoch.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from typing import Any, Literal

from .._tqdm import progress_bar_class
from ._fit_run import FitRun, Logs
from .checkpoint import Checkpoint

logger = logging.getLogger(__name__)

__all__ = ["Callback", "History", "ModelCheckpoint", "BackupAndRestore", "EarlyStopping",
           "ProgressBar", "LambdaCallback"]



class Callback:
    """Base class: override the hooks you need (see the module documentation)."""

    #: Join the coordinator before ``on_train_batch_end`` of every N-th step (None: never).
    join_every: int | None = None

    def __init__(self) -> None:
        self.run: FitRun | None = None

    def set_run(self, run: FitRun) -> None:
        self.run = run

    def _run(self) -> FitRun:
        if self.run is None:
            raise RuntimeError(f"{type(self).__name__} is used by dds.fit only")
        return self.run

    def on_train_begin(self, logs: Logs | None = None) -> None:
        pass

    def on_train_end(self, logs: Logs | None = None) -> None:
        pass

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        pass

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        pass

    def on_train_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        pass

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        pass


class LambdaCallback(Callback):
    """A callback from plain functions: ``LambdaCallback(on_epoch_end=lambda e, logs: ...)``."""

    _HOOKS = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
              "on_train_batch_begin", "on_train_batch_end")

    def __init__(self, **hooks: Any) -> None:
        super().__init__()
        unknown = sorted(set(hooks) - set(self._HOOKS))
        if unknown:
            raise TypeError(f"LambdaCallback got unknown hooks {unknown}; hooks are "
                            f"{list(self._HOOKS)}")
        for name, fn in hooks.items():
            if not callable(fn):
                raise TypeError(f"LambdaCallback {name} must be callable, got {type(fn).__name__}")
            setattr(self, name, fn)


class History(Callback):
    """Records each epoch's metrics: ``history.history["loss"][epoch]`` (fit returns it)."""

    def __init__(self) -> None:
        super().__init__()
        self.epoch: list[int] = []
        self.history: dict[str, list[float]] = {}

    def on_train_begin(self, logs: Logs | None = None) -> None:
        run = self._run()
        # a run resumed by BackupAndRestore starts with the epochs done before the restart
        self.epoch = list(run.resumed_history.get("epoch", []))
        self.history = {k: list(v) for k, v in run.resumed_history.get("history", {}).items()}

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        self.epoch.append(epoch)
        for key, value in (logs or {}).items():
            self.history.setdefault(key, []).append(value)

    def state(self) -> dict[str, Any]:
        return {"epoch": list(self.epoch), "history": {k: list(v) for k, v in self.history.items()}}


def _check_freq(save_freq: int | str) -> int | None:
    if save_freq == "epoch":
        return None
    if isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1:
        raise ValueError(f"save_freq must be 'epoch' or a positive number of steps, got {save_freq!r}")
    return save_freq


def _write_json_atomically(path: str, value: object) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class ModelCheckpoint(Callback):
    """Saves ``checkpoint`` under ``directory/ckpt-<n>`` each epoch or every ``save_freq`` steps.

    Parameters
    ----------
    checkpoint : Checkpoint
        What to save (its variables, optimizers and input iterators).
    directory : str
        One sub-directory per save, ``ckpt-<save number>``; ``directory/latest`` names the
        newest complete one (written after it, atomically).
    save_freq : "epoch" or int
        At each epoch's end, or every that many steps (``fit`` joins first: every update of
        the steps before is in the checkpoint, none of the steps after).
    max_to_keep : int, optional
        Delete older checkpoints beyond the newest ``max_to_keep``.
    monitor, mode, save_best_only :
        With ``save_best_only``, an epoch-end save happens only when ``monitor`` improved.
    """

    def __init__(self, checkpoint: Checkpoint, directory: str | os.PathLike[str],
                 save_freq: int | Literal["epoch"] = "epoch", max_to_keep: int | None = None,
                 monitor: str = "loss", mode: Literal["auto", "min", "max"] = "auto",
                 save_best_only: bool = False) -> None:
        super().__init__()
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(f"checkpoint must be a dds.Checkpoint, got {type(checkpoint).__name__}")
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"max_to_keep must be a positive integer or None, got {max_to_keep!r}")
        self.checkpoint = checkpoint
        self.directory = os.fspath(directory)
        self.join_every = _check_freq(save_freq)
        if save_best_only and self.join_every is not None:
            raise ValueError("save_best_only compares epoch metrics: use save_freq='epoch'")
        self.max_to_keep = max_to_keep
        self.monitor = monitor
        self.save_best_only = save_best_only
        self._better = _comparison(mode, monitor, 0.0)
        self._best = math.nan
        #: Directories written by this callback, oldest first.
        self.saved: list[str] = []

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        run = self._run()
        if self.join_every is not None and run.global_step % self.join_every == 0:
            self._save()

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self.join_every is not None:
            return
        if self.save_best_only:
            value = (logs or {}).get(self.monitor)
            if value is None:
                logger.warning("ModelCheckpoint: metric %r is not in the logs %s: not saved",
                               self.monitor, sorted(logs or {}))
                return
            if not math.isnan(self._best) and not self._better(value, self._best):
                return
            self._best = value
        self._save()

    def on_train_end(self, logs: Logs | None = None) -> None:
        # a SidecarEvaluator stops after the checkpoint marked final
        if self._run().completed and self.saved:
            latest = os.path.join(self.directory, "latest")
            with open(latest) as f:
                state = json.load(f)
            _write_json_atomically(latest, {**state, "final": True})

    def _save(self) -> None:
        os.makedirs(self.directory, exist_ok=True)
        # never reuse a name: after a restart (the save counter restored from an older
        # checkpoint) a later save must not replace one a SidecarEvaluator may have seen
        taken = [int(d[5:]) for d in os.listdir(self.directory)
                 if d.startswith("ckpt-") and d[5:].isdigit()]
        number = max([self.checkpoint.save_counter, *taken]) + 1
        path = os.path.join(self.directory, f"ckpt-{number}")
        self.checkpoint.save(path)
        _write_json_atomically(os.path.join(self.directory, "latest"),
                               {"path": os.path.basename(path), **self._run().position()})
        self.saved.append(path)
        if self.max_to_keep is not None:
            while len(self.saved) > self.max_to_keep:
                shutil.rmtree(self.saved.pop(0), ignore_errors=True)


def latest_checkpoint(directory: str | os.PathLike[str]) -> str | None:
    """The newest complete checkpoint that ModelCheckpoint wrote in ``directory`` (or None)."""
    try:
        with open(os.path.join(os.fspath(directory), "latest")) as f:
            name = json.load(f)["path"]
    except FileNotFoundError:
        return None
    return os.path.join(os.fspath(directory), name)


class BackupAndRestore(Callback):
    """Backs training up so that a coordinator started again resumes where it was.

    Each epoch (or every ``save_freq`` steps) ``checkpoint`` is saved to a new directory in
    ``backup_dir`` and then ``backup_dir/state.json`` is replaced atomically by a record of
    the position (epoch, step, the history so far) that names it: a coordinator killed at
    any moment leaves a state that points at a complete backup. When ``fit`` starts with a
    backup present, the checkpoint is restored and training resumes at the same epoch and
    step (the steps after the backup are trained again, on variables as they were then).
    With ``delete_checkpoint`` the backup is removed once training ends normally.
    """

    def __init__(self, checkpoint: Checkpoint, backup_dir: str | os.PathLike[str],
                 save_freq: int | Literal["epoch"] = "epoch",
                 delete_checkpoint: bool = True) -> None:
        super().__init__()
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(f"checkpoint must be a dds.Checkpoint, got {type(checkpoint).__name__}")
        self.checkpoint = checkpoint
        self.backup_dir = os.fspath(backup_dir)
        self.join_every = _check_freq(save_freq)
        self.delete_checkpoint = delete_checkpoint
        #: The position restored at the start of fit (None: started afresh).
        self.restored: dict[str, Any] | None = None

    @property
    def _state_path(self) -> str:
        return os.path.join(self.backup_dir, "state.json")

    def restore_into(self, run: FitRun) -> None:
        """Called by fit before any other hook: restore the backup, if there is one."""
        self.set_run(run)
        try:
            with open(self._state_path) as f:
                state = json.load(f)
        except FileNotFoundError:
            return
        self.checkpoint.restore(os.path.join(self.backup_dir, state["path"]))
        run.resume(state)
        self.restored = state
        logger.info("BackupAndRestore: resuming at epoch %d, step %d from %s",
                    state["epoch"], state["step"], state["path"])

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        run = self._run()
        if self.join_every is not None and run.global_step % self.join_every == 0:
            self._backup()

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self.join_every is None:
            self._backup()

    def on_train_end(self, logs: Logs | None = None) -> None:
        run = self._run()
        if self.delete_checkpoint and run.completed:
            shutil.rmtree(self.backup_dir, ignore_errors=True)

    def _backup(self) -> None:
        os.makedirs(self.backup_dir, exist_ok=True)
        previous = [d for d in os.listdir(self.backup_dir) if d.startswith("backup-")]
        name = f"backup-{self.checkpoint.save_counter + 1}"
        self.checkpoint.save(os.path.join(self.backup_dir, name))
        _write_json_atomically(self._state_path, {"path": name, **self._run().position()})
        for old in previous:
            if old != name:
                shutil.rmtree(os.path.join(self.backup_dir, old), ignore_errors=True)


def _comparison(mode: str, monitor: str, min_delta: float) -> Any:
    if mode not in ("auto", "min", "max"):
        raise ValueError(f"mode must be 'auto', 'min' or 'max', got {mode!r}")
    if mode == "auto":
        mode = "max" if any(k in monitor for k in ("acc", "auc", "precision", "recall")) else "min"
    if mode == "min":
        return lambda value, best: value < best - min_delta
    return lambda value, best: value > best + min_delta


class EarlyStopping(Callback):
    """Stops training when ``monitor`` has not improved for ``patience`` epochs.

    ``mode`` "auto" maximises metrics named like accuracy and minimises the others;
    ``min_delta`` is the smallest change that counts as an improvement; ``baseline`` a value
    the metric must beat. ``stopped_epoch`` is the epoch after which training stopped.
    """

    def __init__(self, monitor: str = "loss", min_delta: float = 0.0, patience: int = 0,
                 mode: Literal["auto", "min", "max"] = "auto",
                 baseline: float | None = None) -> None:
        super().__init__()
        if patience < 0:
            raise ValueError(f"patience must be >= 0, got {patience}")
        self.monitor = monitor
        self.patience = patience
        self.baseline = baseline
        self._better = _comparison(mode, monitor, abs(min_delta))
        self.best = math.nan
        self.wait = 0
        self.stopped_epoch: int | None = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self.wait, self.stopped_epoch = 0, None
        self.best = math.nan if self.baseline is None else float(self.baseline)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        value = (logs or {}).get(self.monitor)
        if value is None:
            logger.warning("EarlyStopping: metric %r is not in the logs %s", self.monitor,
                           sorted(logs or {}))
            return
        if math.isnan(self.best) or self._better(value, self.best):
            self.best, self.wait = value, 0
            return
        self.wait += 1
        if self.wait > self.patience:
            self.stopped_epoch = epoch
            self._run().stop_training = True


class ProgressBar(Callback):
    """A tqdm progress bar per epoch (a widget in Jupyter with ipywidgets, else text:
    :func:`progress_bar_class`)."""

    def __init__(self, **tqdm_kwargs: Any) -> None:
        super().__init__()
        self._kwargs = tqdm_kwargs
        self._bar: Any = None

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        run = self._run()
        self._bar = progress_bar_class()(total=run.steps_per_epoch, initial=run.step,
                         desc=f"epoch {epoch + 1}/{run.epochs}", **self._kwargs)

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        if self._bar is not None:
            self._bar.update(1)
            if logs:
                self._bar.set_postfix({k: f"{v:.4g}" for k, v in logs.items()}, refresh=False)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        self.close()

    def on_train_end(self, logs: Logs | None = None) -> None:
        self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
