"""Every public error type of the package, in one module (re-exported at the package root).

The data service
----------------
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

Parameter-server training
-------------------------
Every error raised on purpose is a :class:`ParameterServerError`; each also derives from the
builtin a caller would naturally catch (``KeyError``, ``ValueError``, ``ConnectionError``).
The errors pickle, so a parameter server can send one back as a value.

The pipeline library
--------------------
Its errors derive from the builtin a caller would catch (``ValueError``, ``LookupError``).

This module imports nothing of the package (the foundations below every layer import it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = [
    "CheckpointCorruptedError",
    "CheckpointMismatchError",
    "ClosureCancelledError",
    "DaskPartitionLostError",
    "DataServiceError",
    "DatasetNotFoundError",
    "DemoError",
    "DemoUsageError",
    "DispatcherUnavailableError",
    "IllegalUpdateError",
    "InputExhaustedError",
    "InputPositionError",
    "IterationClientNotFoundError",
    "IterationNotFoundError",
    "JobAccessDeniedError",
    "JobNameInUseError",
    "JobNotFoundError",
    "JournalClosedError",
    "JournalCorruptedError",
    "JournalError",
    "NotSplittableError",
    "ParameterServerError",
    "ParameterServerUnavailableError",
    "RemoteValueArgumentError",
    "ServerClosingError",
    "ServiceLimitError",
    "ShapeMismatchError",
    "SnapshotCorruptedError",
    "StaleEpochError",
    "TFRecordCorruptError",
    "TaskNotFoundError",
    "VariableNotFoundError",
    "WorkerNotFoundError",
]


def install_hint(extra: str) -> str:
    """The command that adds the optional dependencies of ``extra`` to an installed package.

    Every error about a missing optional dependency ends with it, worded in this one place.
    ``pip install 'dask-dataservice[EXTRA]'`` works on an installed dask-dataservice, whether
    it came from a wheel or a clone (pip keeps the installed package and adds the extra's
    packages); in a clone, ``pip install -e '.[EXTRA]'`` does the same.
    """
    return f"pip install 'dask-dataservice[{extra}]' (in a clone: pip install -e '.[{extra}]')"


class PlainMessage(Exception):  # noqa: N818 - a mixin, not an error of its own
    """``str(error)`` is the message, even when a builtin base such as KeyError would quote it.

    ``KeyError.__str__`` comes before ``BaseException.__str__`` in the MRO of errors that are
    also KeyErrors and would print ``"'Job 5000 not found'"``; this mixin restores the plain form.
    """

    def __str__(self) -> str:
        return BaseException.__str__(self)


class ServerClosingError(ConnectionError):
    """The server is shutting down (or restarting); retry against the next one."""


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


class JobAccessDeniedError(DataServiceError):
    """A request came without the capability it needs: a job's token (reading elements,
    taking splits) or a data worker's key (downloading a pipeline, a worker heartbeat).

    Not a :class:`PermissionError`: that is an :class:`OSError`, whose instances do not
    travel through distributed's exception pickling together with :class:`RuntimeError`.
    """


class ServiceLimitError(DataServiceError, ValueError):
    """A request the dispatcher refuses for its size: a field larger than its bound, or a
    dispatcher (or one host) that holds as many datasets, jobs or bytes as it accepts
    (``dataservice.dispatcher.max-*``). Also a :class:`ValueError`: the size limits raised
    that before they had a type of their own."""


class JournalError(DataServiceError):
    """Base class of the journal's errors (a :class:`RuntimeError`)."""


class JournalCorruptedError(JournalError):
    """The journal is damaged somewhere a crash cannot explain.

    Parameters
    ----------
    path : str or os.PathLike
        The segment file (or, for a missing segment, the file that follows the gap), or
        its URL for a journal kept on a URL.
    offset : int
        Byte offset in ``path`` of the damaged record or header.
    reason : str
        What is wrong, e.g. ``"payload checksum mismatch (...)"``.
    """

    def __init__(self, path: str | os.PathLike[str] | object, offset: int, reason: str) -> None:
        text = str(path)
        #: The file: a :class:`~pathlib.Path`, or the URL (a ``str``) of a journal on a URL.
        self.path: Path | str = text if "://" in text else Path(text)
        self.offset = offset
        self.reason = reason
        super().__init__(f"journal {self.path} is corrupted at byte offset {offset}: {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.path, self.offset, self.reason)


class JournalClosedError(JournalError):
    """The writer is closed, or failed after an I/O error, and accepts no more records."""


# -- parameter-server training ------------------------------------------------------------


class ParameterServerError(PlainMessage, RuntimeError):
    """Base class of every error parameter-server training raises on purpose."""


class VariableNotFoundError(ParameterServerError, KeyError):
    """A parameter server holds no shard under this key."""


class ParameterServerUnavailableError(ParameterServerError, ConnectionError):
    """A parameter server could not be reached (it died or is shutting down)."""


class ShapeMismatchError(ParameterServerError, ValueError):
    """An update does not fit the shape or the rows of the variable it targets."""


class CheckpointMismatchError(ParameterServerError, ValueError):
    """A checkpoint does not fit the objects it is restored into."""


class CheckpointCorruptedError(CheckpointMismatchError):
    """A checkpoint's file is damaged (truncated, unreadable): the message names the file and
    the variable whose shard it holds."""


class InputExhaustedError(ParameterServerError):
    """A training step found its worker's input at its end (``steps_per_epoch`` too big for
    the data: make the dataset repeat)."""


class InputPositionError(ParameterServerError, ValueError):
    """An input position cannot be saved or restored for this input."""


class ClosureCancelledError(ParameterServerError):
    """A scheduled function was cancelled because an earlier one failed."""


class RemoteValueArgumentError(ValueError):
    """A RemoteValue was passed to ``schedule``: fetch it first (as TensorFlow requires)."""


# -- the pipeline library -----------------------------------------------------------------


class NotSplittableError(ValueError):
    """The pipeline cannot be cut into splits (the message says why)."""


class TFRecordCorruptError(ValueError):
    """A TFRecord file is damaged: a CRC does not match, or a record is cut short.

    The message names the file and the byte offset of the record (TensorFlow's DataLossError).
    """


class SnapshotCorruptedError(ValueError):
    """A snapshot file is damaged (the message names the file and what is wrong)."""


class DaskPartitionLostError(LookupError):
    """A persisted partition's key is no longer on the cluster (its futures were released)."""


# -- the demo (dask-dataservice demo) ------------------------------------------------------


class DemoError(Exception):
    """A failure the demo explains in one line (no traceback): exit code 1."""

    exit_code = 1


class DemoUsageError(DemoError):
    """Options that do not make sense together: exit code 2."""

    exit_code = 2
