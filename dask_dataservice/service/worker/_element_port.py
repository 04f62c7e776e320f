"""A data worker's element port: ``get_elements`` on plain asyncio streams (issue 25, target 1).

A consumer on a ``tcp://`` cluster reads a task's elements over a connection of its own to this
port (:mod:`dask_dataservice._wire`), not through distributed's comms: no per-message comm
overhead, and the reply's frames are received straight into the arrays the consumer gets. The
requests are answered by the worker's ``dataservice_get_elements`` handler, the same coroutine
as on Dask comms (turns, tokens, codecs, kept replies and replays are the same), one request of
a connection after the other, so its replies come back in order.

The port listens on the host of the worker's Dask address; ``dataservice_element_port`` tells
a consumer where. TLS and in-process clusters have none (``dataservice.worker.fast-path``): their
consumers keep distributed's comms, encrypted where the cluster is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from distributed.comm.addressing import get_address_host, parse_address

from ... import config
from ..._wire import StreamServer

__all__ = ["ELEMENT_OP", "ElementPort"]

#: The one request the port serves.
ELEMENT_OP = "dataservice_get_elements"


class ElementPort:
    """The element port of ``worker`` (:meth:`open`; ``port`` None when it has none)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.server: StreamServer | None = None

    @classmethod
    async def open(cls, worker: Any) -> ElementPort:
        self = cls(worker)
        worker.handlers["dataservice_element_port"] = self.where
        if config.get("worker.fast-path") and parse_address(worker.address)[0] == "tcp":
            self.server = StreamServer(self._handler, "element port")
            await self.server.start(get_address_host(worker.address))
        return self

    def _handler(self, op: str) -> Callable[..., Any] | None:
        # the worker's handler, as on Dask comms (at teardown: the one that answers "closing")
        return self.worker.handlers.get(op) if op == ELEMENT_OP else None

    @property
    def port(self) -> int | None:
        return None if self.server is None else self.server.port

    def where(self) -> dict[str, Any]:
        """``{"port": ...}``: where the element port listens (None: read through the comms)."""
        return {"status": "OK", "port": self.port}

    async def close(self) -> None:
        self.worker.handlers.pop("dataservice_element_port", None)
        if self.server is not None:
            await self.server.stop()
            self.server = None
