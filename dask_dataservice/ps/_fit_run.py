"""FitRun: the training run in progress, as :func:`~.fit.fit`'s callbacks see it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from ._runner_plugin import PerWorkerIterator
from .coordinator import ClusterCoordinator
from .strategy import ParameterServerStrategy

__all__ = ["Aggregate", "FitRun"]

Logs = dict[str, float]


class _HasState(Protocol):
    def state(self) -> dict[str, Any]: ...


class Aggregate(Protocol):
    """How the values steps return become an epoch's logs (``fit(aggregate=...)``).

    The default takes the mean of each number over the epoch's steps. An adapter whose
    steps return something else (the Keras adapter: each step's metric states, merged by
    addition, then Keras' own ``result()``) gives its own. ``state()`` is saved by
    BackupAndRestore (JSON: plain numbers and lists) and given back to ``restore``.
    """

    def add(self, value: Any) -> None: ...

    def logs(self) -> Logs: ...

    def reset(self) -> None: ...

    def state(self) -> dict[str, Any]: ...

    def restore(self, state: Mapping[str, Any]) -> None: ...


class FitRun:
    """The training run in progress, as callbacks see it (``callback.run``)."""

    def __init__(self, coordinator: ClusterCoordinator, iterator: PerWorkerIterator,
                 epochs: int, steps_per_epoch: int, initial_epoch: int,
                 aggregate: Aggregate | None = None) -> None:
        self.coordinator = coordinator
        self.strategy: ParameterServerStrategy = coordinator.strategy
        #: The per-worker iterator every step reads (put it in a Checkpoint to save the
        #: input position with the variables).
        self.iterator = iterator
        self.epochs = epochs
        self.steps_per_epoch = steps_per_epoch
        #: Keras' ``model.stop_training``: training ends after the current epoch.
        self.stop_training = False
        #: True once training ended normally (all epochs, or stopped by a callback).
        self.completed = False
        #: The current epoch, and the steps of it that finished (joined or fetched).
        self.epoch = initial_epoch
        self.step = 0
        #: Steps finished since the start of training (epoch 0), resumed runs included.
        self.global_step = initial_epoch * steps_per_epoch
        self.params = {"epochs": epochs, "steps": steps_per_epoch}
        self.history: _HasState | None = None
        #: What BackupAndRestore restored: epochs done before and their metrics.
        self.resumed_history: dict[str, Any] = {}
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._epoch_over = False
        self._epoch_logs: Logs = {}
        #: Turns the steps' values into logs (None: the mean of each number).
        self.aggregate = aggregate

    # -- what BackupAndRestore saves and restores ---------------------------------------
    def position(self) -> dict[str, Any]:
        """Where training is, for a backup taken now (after a join)."""
        if self._epoch_over:  # at the epoch's end: resume with the next one
            epoch, step, sums, counts = self.epoch + 1, 0, {}, {}
        else:
            epoch, step, sums, counts = self.epoch, self.step, self._sums, self._counts
        history = self.history.state() if self.history is not None else {}
        extra: dict[str, Any] = {}
        if self.aggregate is not None:
            extra["aggregate"] = self.aggregate.state() if not self._epoch_over else {}
        done = history.setdefault("epoch", [])
        if self._epoch_over and (not done or done[-1] != self.epoch):
            # History (the last callback) has not recorded the epoch that just ended yet
            done.append(self.epoch)
            for key, value in self._epoch_logs.items():
                history.setdefault("history", {}).setdefault(key, []).append(value)
        return {"epoch": epoch, "step": step, "global_step": epoch * self.steps_per_epoch + step,
                "sums": dict(sums), "counts": dict(counts), "history": history, **extra}

    def resume(self, state: Mapping[str, Any]) -> None:
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        self.global_step = self.epoch * self.steps_per_epoch + self.step
        self._sums = {k: float(v) for k, v in state.get("sums", {}).items()}
        self._counts = {k: int(v) for k, v in state.get("counts", {}).items()}
        self.resumed_history = dict(state.get("history") or {})
        if self.aggregate is not None:
            self.aggregate.reset()
            if state.get("aggregate"):
                self.aggregate.restore(state["aggregate"])

    # -- metrics --------------------------------------------------------------------------
    def _add(self, value: Any) -> None:
        if self.aggregate is not None:
            self.aggregate.add(value)
            return
        for key, x in _metrics(value).items():
            self._sums[key] = self._sums.get(key, 0.0) + x
            self._counts[key] = self._counts.get(key, 0) + 1

    def logs(self) -> Logs:
        """The epoch's metrics so far: the mean of each over the steps that returned it."""
        if self.aggregate is not None:
            return self.aggregate.logs()
        return {k: self._sums[k] / self._counts[k] for k in self._sums}


    def _reset_metrics(self) -> None:
        """A new epoch: no metrics yet."""
        self._sums, self._counts = {}, {}
        if self.aggregate is not None:
            self.aggregate.reset()


def _metrics(value: Any) -> dict[str, float]:
    if value is None:
        return {}
    if isinstance(value, Mapping):
        out = {}
        for key, x in value.items():
            try:
                out[str(key)] = float(x)
            except (TypeError, ValueError):
                raise TypeError(f"a step's metric {key!r} must be a number, got "
                                f"{type(x).__name__}: {x!r:.80}") from None
        return out
    try:
        return {"loss": float(value)}
    except (TypeError, ValueError):
        raise TypeError("a step returns its metrics as a mapping of names to numbers (or one "
                        f"number, the loss), got {type(value).__name__}: {value!r:.80}") from None
