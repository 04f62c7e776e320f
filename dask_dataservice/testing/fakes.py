"""Fakes for the component tier: readers and buffers without a Dask cluster.

- :class:`FakeDispatcher`: answers a reader's heartbeats with a scripted iteration view and
  records releases and the workers readers report as unresponsive.
- :class:`FakeWorker`: serves ``dataservice_get_elements`` from lists of elements per task,
  in batches, optionally held by a gate (an :class:`asyncio.Event`).
- :class:`FakeClient`: what a reader uses of a ``distributed.Client`` (``scheduler``,
  ``rpc(address)``, ``status``, ``loop``), wired to the two fakes.

Everything runs on a real event loop: only the network and the other processes are fake.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..service.protocol._messages import ElementBatch, TaskInfo

__all__ = ["FakeClient", "FakeDispatcher", "FakeWorker"]


class FakeDispatcher:
    """The dispatcher half a reader talks to: heartbeats and releases."""

    def __init__(self, tasks: list[TaskInfo], finished: bool = False) -> None:
        self.tasks = tasks
        self.finished = finished
        self.released: list[int] = []
        #: Released clients that said they read to the end (every task's end of sequence).
        self.read_to_end: list[int] = []
        #: Workers readers reported as unresponsive (``dataservice_suspect_worker``).
        self.suspected: list[str] = []
        self.heartbeats = 0

    def view(self) -> dict[str, Any]:
        return {"status": "OK", "tasks": list(self.tasks), "finished": self.finished,
                "garbage_collected": False, "processing_mode": "OFF", "num_consumers": None}

    async def dataservice_client_heartbeat(self, iteration_client_id: int,
                                           job_token: str | None = None,
                                           view_version: str | None = None) -> dict[str, Any]:
        self.heartbeats += 1
        return self.view()

    async def dataservice_data_workers(self) -> dict[str, Any]:
        return {"status": "OK", "registered": 0, "present": 0,
                "reason": "no worker is connected to the scheduler"}

    async def dataservice_suspect_worker(self, address: str) -> dict[str, Any]:
        self.suspected.append(address)
        return {"status": "OK", "dropped": False}

    async def dataservice_release_iteration_client(self, iteration_client_id: int,
                                                   job_token: str | None = None,
                                                   read_to_end: bool = False) -> dict[str, Any]:
        self.released.append(iteration_client_id)
        if read_to_end:
            self.read_to_end.append(iteration_client_id)
        return {"status": "OK"}


class FakeWorker:
    """Serves each task's elements in batches of ``batch`` (end of sequence after the last)."""

    def __init__(self, elements: dict[int, list[Any]], batch: int = 10, gate: asyncio.Event | None = None) -> None:
        self.elements = {tid: list(xs) for tid, xs in elements.items()}
        self.batch = batch
        self.gate = gate
        self.requests = 0

    async def dataservice_get_elements(self, task_id: int, max_elements: int, **kwargs: Any) -> dict[str, Any]:
        self.requests += 1
        if self.gate is not None:
            await self.gate.wait()
        xs = self.elements[task_id]
        n = min(self.batch, max_elements)
        if not xs:
            return {"status": "OK", "elements": None, "end_of_sequence": True}
        out, self.elements[task_id] = xs[:n], xs[n:]
        return {"status": "OK", "elements": ElementBatch(out), "end_of_sequence": False}


class FakeClient:
    """A ``distributed.Client`` stand-in for readers (see the module docstring)."""

    asynchronous = False

    def __init__(self, dispatcher: FakeDispatcher, workers: dict[str, FakeWorker], loop: Any = None) -> None:
        self.scheduler = dispatcher
        self.workers = workers
        self.status = "running"
        self.loop = loop

    def rpc(self, address: str) -> FakeWorker:
        return self.workers[address]
