"""The error vocabulary of parameter-server training.

Every error raised on purpose is a :class:`ParameterServerError`; each also derives from the
builtin a caller would naturally catch (``KeyError``, ``ValueError``, ``ConnectionError``).
The errors pickle, so a parameter server can send one back as a value.
"""

from __future__ import annotations

from .._exceptions import PlainMessage

__all__ = [
    "ParameterServerError",
    "VariableNotFoundError",
    "ParameterServerUnavailableError",
    "CheckpointMismatchError",
    "ShapeMismatchError",
]


class ParameterServerError(PlainMessage, RuntimeError):
    """Base class of every error parameter-server training raises on purpose."""


class VariableNotFoundError(ParameterServerError, KeyError):
    """A parameter server holds no shard under this key."""


class ParameterServerUnavailableError(ParameterServerError, ConnectionError):
    """A parameter server could not be reached (it died or is shutting down)."""


def silent_server(address: str, op: str, limit: float) -> ParameterServerUnavailableError:
    """A PS that answered neither ``op`` nor a liveness probe within ``limit`` seconds."""
    return ParameterServerUnavailableError(
        f"parameter server {address} did not answer a liveness probe within {limit:g} s "
        f"during {op} (dataservice.ps.liveness-timeout): frozen, hung or unreachable")


class ShapeMismatchError(ParameterServerError, ValueError):
    """An update does not fit the shape or the rows of the variable it targets."""


class CheckpointMismatchError(ParameterServerError, ValueError):
    """A checkpoint does not fit the objects it is restored into."""
