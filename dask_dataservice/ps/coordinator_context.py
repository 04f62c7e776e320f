"""Inside a scheduled function: which training worker runs it (TensorFlow's
``tf.distribute.coordinator.experimental_get_current_worker_index``)."""

from __future__ import annotations

from . import _routing

__all__ = ["get_current_worker_index"]


def get_current_worker_index() -> int:
    """The index of the training worker running this scheduled function (0, 1, ...).

    Indices are given in worker-name order when the coordinator starts, and to later
    workers in the order they join; a worker restarted under its name keeps its index.
    Raises RuntimeError outside a function scheduled with ``ClusterCoordinator.schedule``.
    """
    ctx = getattr(_routing._thread, "fn", None)
    if ctx is None or ctx.worker_index is None:
        raise RuntimeError("get_current_worker_index() is only available inside a function "
                           "scheduled with ClusterCoordinator.schedule")
    return int(ctx.worker_index)
