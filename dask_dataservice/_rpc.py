"""One convention for every handler, reply and address in the package.

- :func:`handler` wraps a request handler (sync or async) so that expected errors travel
  back as values (``error_message(e)``), as P2P's handlers do. It is the only place that
  catches "any exception of a handler".
- :func:`raise_for_status` is the caller's half: it returns an OK reply and re-raises the
  remote exception, with its remote traceback, otherwise. ``None`` (the op is unknown on
  that server: the plugin is not installed) becomes a clear error naming what is missing.
- :func:`normalize_address` turns what users type (``"host:port"``, ``"tcp://host:port"``,
  ``"tls://..."``) into a full address with :mod:`distributed.comm.addressing`.

Replies are dicts (a bare array breaks the comm, see dask-notes §0.5); ``{"status": "OK", ...}``
for success, ``error_message(e)`` for an expected failure, ``{"status": "closing"}`` when the
server is shutting down and the caller should retry against the next one.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, TypedDict, cast

from distributed.comm.addressing import get_address_host_port, parse_address
from distributed.comm.addressing import normalize_address as _normalize
from distributed.core import clean_exception, error_message

__all__ = [
    "OKMessage",
    "error_message",
    "handler",
    "normalize_address",
    "raise_for_status",
]

logger = logging.getLogger(__name__)


class OKMessage(TypedDict):
    """The base of every successful reply."""

    status: str  # "OK"


def handler[H: Callable[..., Any]](fn: H) -> H:
    """Make a request handler answer ``error_message(e)`` instead of raising.

    Works for plain and ``async`` handlers (the wrapper keeps the kind, so a synchronous
    handler stays synchronous: ordering guarantees that rely on it are kept). Only
    :class:`Exception` is caught: cancellation and ``KeyboardInterrupt`` pass through.
    """
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return await fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - errors travel as values
                return error_message(e)

        return cast(H, async_wrapper)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - errors travel as values
            return error_message(e)

    return cast(H, wrapper)


def raise_for_status(
    response: Any,
    what: str = "request",
    *,
    missing: str = "the server does not know this request",
    missing_error: type[Exception] = RuntimeError,
    closing_error: type[Exception] = ConnectionError,
) -> dict[str, Any]:
    """Return ``response`` if it is OK; raise what it carries otherwise.

    Parameters
    ----------
    response
        The reply of a handler wrapped with :func:`handler` (or ``None``).
    what
        Names the request in error messages.
    missing
        The message when the server answered ``None`` (unknown op: plugin not installed).
    missing_error, closing_error
        The exception types for an unknown op and a closing server (each service passes its
        own, e.g. :class:`~dask_dataservice.errors.DispatcherUnavailableError`; this module
        imports no other of the package's foundations).
    """
    if response is None:
        raise missing_error(f"no answer to the {what}: {missing}")
    status = response.get("status")
    if status == "OK":
        return cast(dict[str, Any], response)
    if status == "closing":
        raise closing_error(f"the server is shutting down ({what})")
    _, exc, tb = clean_exception(**response)
    assert exc is not None, response
    raise exc.with_traceback(tb)


def normalize_address(address: str) -> str:
    """``"host:port"`` → ``"tcp://host:port"``; full addresses are kept (``tls://``, ...).

    Raises ValueError naming the address when it cannot be parsed.
    """
    if not isinstance(address, str) or not address.strip():
        raise ValueError(f"expected an address such as 'host:port' or 'tcp://host:port', got {address!r}")
    address = address.strip()
    try:
        full = _normalize(address if "://" in address else f"tcp://{address}")
        scheme, location = parse_address(full)
        if scheme in ("tcp", "tls", "ws", "wss"):
            host, port = get_address_host_port(full)
            if not host or not port:
                raise ValueError("it needs a host and a port")
    except (ValueError, TypeError) as e:
        raise ValueError(f"cannot parse the address {address!r}: {e}") from None
    return full


def strip_protocol(address: str) -> str:
    """``"tcp://host:port"`` → ``"host:port"`` (the form TensorFlow's configs use)."""
    return parse_address(normalize_address(address))[1]
