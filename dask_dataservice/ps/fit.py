"""``fit``: epochs of scheduled steps with callbacks (TensorFlow's ``Model.fit`` on PS).

::

    def step(iterator):                      # runs on a training worker
        batch = next(iterator)
        ...                                  # read variables, apply gradients
        return {"loss": loss, "accuracy": acc}

    history = dds.fit(strategy, step, dds.DatasetCreator(dataset_fn), epochs=3,
                      steps_per_epoch=500, callbacks=[
                          dds.callbacks.BackupAndRestore(ckpt, "/backup"),
                          dds.callbacks.EarlyStopping(monitor="loss", patience=1)])

Why a function and not a ``Trainer`` object: a training run has no state of its own that
outlives the call. The model's state is its variables (on the parameter servers), the input
position is in the per-worker iterator, and everything a restart needs is saved by the
callbacks (BackupAndRestore). A function cannot be half-configured or reused by mistake
across runs, and it reads like ``model.fit``. What callbacks see of the run in progress
(epoch, step, ``stop_training``) is a :class:`FitRun`, their ``self.run``.

Theory of operation
-------------------
- The input is built once per ``fit`` call on each training worker: a
  :class:`DatasetCreator` (``dataset_fn(input_context)``), a function ``dataset_fn()``, a
  per-worker dataset or iterator of ``coordinator.create_per_worker_dataset``. Every step
  gets the same per-worker iterator; epochs continue it (give an infinite dataset, e.g.
  ``.repeat()``: ``steps_per_epoch`` is required, as in TensorFlow with a PS strategy,
  because a step cannot know when a worker's data ends while others still have some).
  When ``fit`` returns or raises, the per-worker iterators of an input it built are
  closed on every training worker (a data-service dataset's readers release their
  iteration clients); a per-worker dataset or iterator given as input is left open.
- Each epoch's steps are scheduled with the coordinator up to the next *sync point* and
  their results fetched in step order, calling ``on_train_batch_end`` as each finishes.
  A sync point is the end of the epoch or a step at which a callback asked for a join
  (``join_every``): ``fit`` calls ``coordinator.join()`` before that step's
  ``on_train_batch_end``, so a checkpoint saved there has every earlier update and none
  of the later ones.
- Metrics: a step returns a mapping of names to numbers (or one number: ``loss``); the
  coordinator averages them over the epoch's steps (the running mean in batch logs).
- A step that raises stops training: ``fit`` joins (cancelling what is queued) and raises
  the step's error; a ``StopIteration`` from the input becomes :class:`InputExhaustedError`.
  A callback that raises stops training at once, without a join (the cluster may be what
  failed): steps already scheduled may still finish; ``coordinator.join()`` waits for them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

from .._tqdm import interactive
from ..errors import InputExhaustedError
from ._fit_run import Aggregate, FitRun, Logs
from ._runner_plugin import PerWorkerDataset, PerWorkerIterator
from .callbacks import BackupAndRestore, Callback, History, ProgressBar
from .coordinator import ClosureCancelledError, ClusterCoordinator, RemoteValue
from .strategy import InputContext, ParameterServerStrategy

logger = logging.getLogger(__name__)

__all__ = ["fit", "FitRun", "DatasetCreator", "InputExhaustedError"]


class DatasetCreator:
    """``dataset_fn(input_context)`` built on each training worker (Keras' DatasetCreator)."""

    def __init__(self, dataset_fn: Callable[[InputContext], Any],
                 input_options: Any = None) -> None:
        if not callable(dataset_fn):
            raise TypeError(f"dataset_fn must be callable, got {type(dataset_fn).__name__}")
        self.dataset_fn = dataset_fn
        self.input_options = input_options

    def __call__(self, input_context: InputContext | None = None) -> Any:
        return self.dataset_fn(input_context or InputContext())


def _coordinator(strategy: Any) -> ClusterCoordinator:
    if isinstance(strategy, ClusterCoordinator):
        return strategy
    if isinstance(strategy, ParameterServerStrategy):
        return ClusterCoordinator(strategy)
    raise TypeError("fit needs a ParameterServerStrategy or its ClusterCoordinator, got "
                    f"{type(strategy).__name__}")


def _iterator(coordinator: ClusterCoordinator, x: Any) -> PerWorkerIterator:
    if isinstance(x, PerWorkerIterator):
        return x
    if isinstance(x, PerWorkerDataset):
        return iter(x)
    if isinstance(x, DatasetCreator):
        creator = x
        return iter(coordinator.create_per_worker_dataset(
            coordinator.strategy.distribute_datasets_from_function(creator.dataset_fn)))
    if callable(x):
        return iter(coordinator.create_per_worker_dataset(x))
    if isinstance(x, Iterable):  # a Dataset: the same on each worker
        dataset = x
        return iter(coordinator.create_per_worker_dataset(lambda: dataset))
    raise TypeError("fit's input is a DatasetCreator, a dataset_fn, a Dataset or a per-worker "
                    f"dataset or iterator, got {type(x).__name__}")


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def fit(strategy: ParameterServerStrategy | ClusterCoordinator,
        step_fn: Callable[[PerWorkerIterator], Any], x: Any, *, epochs: int = 1,
        steps_per_epoch: int | None = None, callbacks: Sequence[Callback] = (),
        initial_epoch: int = 0, verbose: bool | Literal["auto"] = "auto",
        aggregate: Aggregate | None = None) -> History:
    """Train: ``epochs`` times, ``steps_per_epoch`` calls of ``step_fn(iterator)`` on the
    training workers, with ``callbacks``; returns the :class:`History`.

    Parameters
    ----------
    strategy : ParameterServerStrategy or ClusterCoordinator
    step_fn : callable
        ``step_fn(iterator) -> metrics``, run on a training worker: reads
        ``next(iterator)``, updates variables, returns ``{"loss": ..., ...}`` (or a number,
        the loss, or None).
    x : DatasetCreator, callable, Dataset, per-worker dataset or iterator
        The input (see the module documentation).
    steps_per_epoch : int
        Required (TensorFlow requires it with a parameter-server strategy too).
    verbose : bool or "auto"
        Show a progress bar (tqdm; a widget in Jupyter with ipywidgets). "auto": in a
        Jupyter kernel with ipywidgets or on a terminal, not in a pipe or a log file.
    aggregate : Aggregate, optional
        How the steps' values become the logs (``add``, ``logs``, ``reset``, ``state``,
        ``restore``; see :class:`~._fit_run.Aggregate`). Default: the mean of each number
        over the epoch's steps. The Keras adapter gives one that merges metric states.
    """
    if steps_per_epoch is None:
        raise ValueError("steps_per_epoch is required: with parameter-server training each "
                         "worker reads its own input, so the end of the data cannot mark the "
                         "end of an epoch (as in TensorFlow); give the steps of an epoch and a "
                         "dataset that repeats")
    steps = _positive("steps_per_epoch", steps_per_epoch)
    epochs = _positive("epochs", epochs)
    if not isinstance(initial_epoch, int) or not 0 <= initial_epoch < epochs:
        raise ValueError(f"initial_epoch must be in [0, epochs), got {initial_epoch!r}")
    if not callable(step_fn):
        raise TypeError(f"step_fn must be callable, got {type(step_fn).__name__}")
    for cb in callbacks:
        if not isinstance(cb, Callback):
            raise TypeError(f"callbacks must be dds.callbacks.Callback instances, got "
                            f"{type(cb).__name__} (wrap functions in LambdaCallback)")
    coordinator = _coordinator(strategy)
    iterator = _iterator(coordinator, x)
    try:
        return _fit(coordinator, step_fn, iterator, epochs, steps, callbacks, initial_epoch,
                    verbose, aggregate)
    finally:
        if not isinstance(x, PerWorkerIterator | PerWorkerDataset):
            # the input fit built is released on every worker (its data-service readers);
            # one given as a per-worker dataset or iterator is the caller's, to go on with
            coordinator.release_per_worker_dataset(iterator)


def _fit(coordinator: ClusterCoordinator, step_fn: Callable[[PerWorkerIterator], Any],
         iterator: PerWorkerIterator, epochs: int, steps: int, callbacks: Sequence[Callback],
         initial_epoch: int, verbose: bool | Literal["auto"],
         aggregate: Aggregate | None) -> History:
    run = FitRun(coordinator, iterator, epochs, steps, initial_epoch, aggregate)
    history = run.history = History()
    # Keras' order: the progress bar first, History last (it records what the others added)
    if verbose == "auto":
        verbose = interactive()
    cbs: list[Callback] = [*([ProgressBar(leave=False)] if verbose else []), *callbacks, history]
    for cb in cbs:
        cb.set_run(run)
    for cb in cbs:  # before any other hook: the others see the resumed position
        if isinstance(cb, BackupAndRestore):
            cb.restore_into(run)
    try:
        _train(run, step_fn, cbs)
    finally:
        for cb in cbs:
            if isinstance(cb, ProgressBar):
                cb.close()
    return history


def _train(run: FitRun, step_fn: Callable[[PerWorkerIterator], Any],
           cbs: list[Callback]) -> None:
    coordinator = run.coordinator
    joins = sorted({cb.join_every for cb in cbs if cb.join_every})
    for cb in cbs:
        cb.on_train_begin({})
    logs: Logs = {}
    while run.epoch < run.epochs and not run.stop_training:
        run._epoch_over = False
        for cb in cbs:
            cb.on_epoch_begin(run.epoch, {})
        while run.step < run.steps_per_epoch:
            end = _next_sync(run, joins)
            chunk = [coordinator.schedule(step_fn, args=(run.iterator,))
                     for _ in range(end - run.step)]
            for i in range(len(chunk)):
                for cb in cbs:
                    cb.on_train_batch_begin(run.step + i, {})
            _collect(run, chunk, cbs)
        logs = run._epoch_logs = run.logs()  # one dict: a callback may add to it (Keras)
        run._epoch_over = True
        for cb in cbs:
            cb.on_epoch_end(run.epoch, logs)
        run.epoch, run.step = run.epoch + 1, 0
        run._reset_metrics()
        run._epoch_over = False
    run.completed = True
    for cb in cbs:
        cb.on_train_end(dict(logs))


def _next_sync(run: FitRun, joins: list[int]) -> int:
    """The step (in the epoch) up to which to schedule before the next join."""
    end = run.steps_per_epoch
    for every in joins:
        nxt = (run.global_step // every + 1) * every  # next global multiple
        end = min(end, run.step + (nxt - run.global_step))
    return end


def _collect(run: FitRun, chunk: list[RemoteValue[Any]], cbs: list[Callback]) -> None:
    coordinator = run.coordinator
    for i, rv in enumerate(chunk):
        try:
            if i == len(chunk) - 1:
                coordinator.join()  # a sync point: every update of the chunk landed
            value = rv.fetch()
        except BaseException as e:
            failed = _settle(coordinator)
            if isinstance(e, ClosureCancelledError) and failed is not None:
                # this step was cancelled because another one failed (whichever ran first):
                # the user sees that one's error, as join() would raise it
                e = failed
            if isinstance(e, StopIteration):
                raise InputExhaustedError(
                    f"the input ran out of data in epoch {run.epoch} ({run.step} of its "
                    f"{run.steps_per_epoch} steps had finished): make the dataset repeat, "
                    "or lower steps_per_epoch") from e
            raise e
        run._add(value)
        run.step += 1
        run.global_step += 1
        batch_logs = run.logs()
        for cb in cbs:
            cb.on_train_batch_end(run.step - 1, batch_logs)


def _settle(coordinator: ClusterCoordinator) -> BaseException | None:
    """After a failed step: wait for the rest (cancelled) and clear the recorded error,
    which is returned (the first step that failed)."""
    try:
        coordinator.join()
    except Exception as e:  # noqa: BLE001 - the error that stopped training is raised
        logger.debug("join after a failed step: %r", e)
        return e
    return None

