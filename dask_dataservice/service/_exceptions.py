"""The error vocabulary of the data service.

Every error the service raises on purpose is a :class:`DataServiceError`. The "not found"
errors are also :class:`KeyError` and :class:`JobNameInUseError` is also a :class:`ValueError`,
so callers that only know the builtins can still catch them::

    try:
        job = state.job_by_name("shared_job")
    except KeyError:
        ...

Each error carries a single, human-readable message, and ``str(error)`` is that message.
(:class:`KeyError` normally quotes its argument, which would print ``"'Job 5000 not found'"``;
:class:`DataServiceError` restores the plain message.) The errors pickle, so a dispatcher
handler can send one back to a client.
"""

from __future__ import annotations

from .._exceptions import PlainMessage
from .._rpc import ServerClosingError

__all__ = [
    "DataServiceError",
    "DatasetNotFoundError",
    "DispatcherUnavailableError",
    "IllegalUpdateError",
    "IterationClientNotFoundError",
    "IterationNotFoundError",
    "JobNameInUseError",
    "JobNotFoundError",
    "StaleEpochError",
    "TaskNotFoundError",
    "WorkerNotFoundError",
]


class DataServiceError(PlainMessage, RuntimeError):
    """Base class of every error the data service raises on purpose."""


class DatasetNotFoundError(DataServiceError, KeyError):
    """No dataset is registered under this id or fingerprint."""


class JobNotFoundError(DataServiceError, KeyError):
    """No job has this id, or no live job has this name."""


class IterationNotFoundError(DataServiceError, KeyError):
    """No iteration has this id, or no iteration has this ``(job_id, repetition)`` key."""


class IterationClientNotFoundError(DataServiceError, KeyError):
    """No iteration client with this id is currently acquired."""


class TaskNotFoundError(DataServiceError, KeyError):
    """No task has this id (it never existed, or its iteration was garbage collected)."""


class WorkerNotFoundError(DataServiceError, KeyError):
    """No worker was ever registered at this address."""


class IllegalUpdateError(DataServiceError):
    """An update breaks a precondition of the dispatcher state.

    Either the caller has a bug or the update is invalid (for example a journal record that
    cannot be decoded). The state is left exactly as it was before the update.
    """


class StaleEpochError(DataServiceError):
    """A request names an epoch (a split repetition, an iteration, a run) that has moved on.

    This is expected in normal operation, e.g. a task asking for a split of a repetition that
    another task already finished; the dispatcher answers "end of splits" rather than failing.
    """


class JobNameInUseError(DataServiceError, ValueError):
    """A live job already has this name."""


class DispatcherUnavailableError(ServerClosingError):
    """The dispatcher is shutting down (or restarting); retry against the next one."""
