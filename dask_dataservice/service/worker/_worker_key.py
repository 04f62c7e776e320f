"""A data worker's key: the proof that a request to the dispatcher comes from that worker.

The dispatcher draws one random key per data worker and sends it only over the scheduler's
own stream to the worker (stream op :data:`~._messages.WORKER_KEY_OP`); a request for it
(``dataservice_worker_key``) is answered with a plain OK, whoever sends it. A worker shows the
key in its heartbeat (whose reply carries task definitions, with their jobs' tokens) and when
it downloads a pipeline, so that neither reaches a process that is not a worker.

:class:`WorkerKey` is the worker's half: it asks for the key when it has none, waits for the
stream message with a deadline (asking again after it), and forgets a key the dispatcher
refused (a new dispatcher draws new keys).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from ..protocol._messages import WORKER_KEY_OP, raise_for_status

if TYPE_CHECKING:
    from distributed import Worker

__all__ = ["WorkerKey"]

#: Seconds to wait for the key's stream message before asking again.
_WAIT = 5.0


class WorkerKey:
    """The key of one worker (see the module docstring). Lives on the worker's loop."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._key: str | None = None
        self._arrived = asyncio.Event()

    def install(self) -> None:
        self.worker.stream_handlers[WORKER_KEY_OP] = self.received

    def uninstall(self) -> None:
        # Keep a no-op: an unknown stream op would break the scheduler stream.
        self.worker.stream_handlers[WORKER_KEY_OP] = _ignore

    def received(self, key: str = "", **kwargs: Any) -> None:
        """Stream handler: the dispatcher sent this worker its key. Never raises."""
        if isinstance(key, str) and key:
            self._key = key
            self._arrived.set()

    def forget(self) -> None:
        """The dispatcher refused the key (it was restarted): ask for a new one next time."""
        self._key = None
        self._arrived.clear()

    async def get(self, attempts: int = 3) -> str | None:
        """The key; ``None`` if the scheduler has no dispatcher (yet)."""
        for _ in range(attempts):
            if self._key is not None:
                return self._key
            resp = await self.worker.scheduler.dataservice_worker_key(address=self.worker.address)
            if resp is None:  # the dispatcher is not installed (yet)
                return None
            raise_for_status(resp, "worker key request")
            try:
                await asyncio.wait_for(self._arrived.wait(), _WAIT)
            except TimeoutError:
                continue
        if self._key is None:
            raise TimeoutError(
                f"the dispatcher did not send worker {self.worker.address} its key within "
                f"{attempts * _WAIT:.0f}s")
        return self._key


def _ignore(**kwargs: Any) -> None:
    pass
