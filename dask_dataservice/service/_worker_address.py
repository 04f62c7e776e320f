"""TensorFlow's ``WorkerConfig(worker_address="host:%port%")``: the address a data worker
gives its dispatcher, with the port it bound substituted.

TensorFlow's worker passes ``worker_address`` to the dispatcher, which hands it to readers;
``%port%`` in it becomes the port the worker bound (its default is ``"localhost:%port%"``).
A Dask worker does the same with its ``contact_address`` (the address it registers with the
scheduler, by which everyone reaches it), except that Dask needs it before the worker
listens. :class:`AdvertisingWorker` fills it in once the port is bound, before the worker
registers, so ``port=0`` (any free port) works with a template. Its host name is resolved to
an IP address there, as Dask's scheduler resolves every worker address it registers.
"""

from __future__ import annotations

from typing import Any

from distributed.comm.addressing import get_address_host_port, parse_address, resolve_address

from .._rpc import normalize_address
from .protocol._job_checks import ANY_PORT
from .worker._reconnect import ReconnectingWorker

__all__ = ["PORT", "AdvertisingWorker", "advertised_address"]

#: TensorFlow's placeholder for the port the worker bound.
PORT = ANY_PORT


def advertised_address(worker_address: str, protocol: str) -> tuple[str, str]:
    """``(host to listen on, address template)`` for ``WorkerConfig.worker_address``.

    ``worker_address`` is ``"host"``, ``"host:port"`` or ``"host:%port%"``, optionally with a
    protocol (``tcp://``, ``tls://``, TensorFlow's ``grpc://``: the worker's own protocol is
    used). A bare host means ``host:%port%``. A fixed port is advertised as given (a port
    forward's, say), as TensorFlow does: the worker still binds ``WorkerConfig.port``.
    Raises ValueError for an address that cannot be parsed.
    """
    if not isinstance(worker_address, str) or not worker_address.strip():
        raise ValueError(f"worker_address must be 'host', 'host:port' or 'host:%port%', got "
                         f"{worker_address!r}")
    text = worker_address.strip()
    if "://" in text:
        text = parse_address(text)[1]
    host, sep, port = text.rpartition(":")
    if not sep or (not host.startswith("[") and ":" in host):  # "host", or bare IPv6
        host, port = text, PORT
    try:
        full = normalize_address(f"{protocol}://{host}:{1 if port == PORT else port}")
    except ValueError:
        raise ValueError(f"cannot parse worker_address {worker_address!r}: use 'host', "
                         f"'host:port' or 'host:{PORT}'") from None
    listen_host = get_address_host_port(full)[0]
    return listen_host, full if port != PORT else f"{protocol}://{host}:{PORT}"


class AdvertisingWorker(ReconnectingWorker):
    """A reconnecting data worker that registers under ``contact_template``, ``%port%``
    replaced by the port it bound (:func:`advertised_address`); None: Dask's own address."""

    def __init__(self, *args: Any, contact_template: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: The address template (``"tcp://host:%port%"``), or None.
        self.contact_template = contact_template

    async def listen(self, *args: Any, **kwargs: Any) -> None:
        await super().listen(*args, **kwargs)  # type: ignore[no-untyped-call]  # distributed
        if self.contact_template is not None:
            assert self.listener is not None  # listening now
            _, port = get_address_host_port(self.listener.contact_address)
            # the scheduler resolves a host name to its IP address when the worker registers
            # (Scheduler.coerce_address); the worker, the dispatcher and readers use that form
            address = resolve_address(self.contact_template.replace(PORT, str(port)))
            self._address = self.contact_address = address
