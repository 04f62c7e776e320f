"""Readers over a fixed task list: coordinated reads and the cross-trainer cache.

Both read the tasks that existed when the iteration started (workers joining later take no
part, as for TF's coordinated reads): :class:`CoordinatedReader` takes rounds of
``num_consumers`` elements from task ``r mod T``; :class:`CrossTrainerReader` takes turns of
``client.cross-trainer-turn-elements`` per task so that every trainer reads the same sequence.
Their requests have the DYNAMIC reader's deadline (``client.request-timeout``, then the
dispatcher's probe of the worker): a frozen worker ends the read with an error naming it.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable
from typing import Any

from ... import config
from ...errors import DataServiceError
from ..protocol._messages import raise_for_status
from . import _reader
from ._reader import CROSS_TRAINER_TURN, IterationReader
from .reader_core import fixed_tasks, join_rounds, join_turns, task_lost, turn_reply

logger = logging.getLogger("dask_dataservice.service.client._reader")


class _FixedTasksReader(IterationReader):
    """A reader that walks the job's tasks present when it starts, in task-id order, turn by
    turn: every turn asks each task for its part at once, the next turn is requested while
    this one is handed over, and the parts are joined in task order. Consumers that read the
    same job this way see the same sequence."""

    what = "reads"

    async def _read(self, view: dict[str, Any]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.dispatcher_timeout
        delay = 0.01
        start = loop.time()
        while not (tasks := fixed_tasks(view)):
            if loop.time() > deadline:
                raise DataServiceError(f"{self.what}: the job has no data workers")
            await self._no_workers(loop.time() - start)  # warns, with the reason
            await asyncio.sleep(delay)
            delay = min(2 * delay, 0.25)
            view = await self._heartbeat()
        self.group.spawn(self._heartbeats)

        def request(turn: int) -> list[asyncio.Task[Any]]:
            out = []
            for tid, addr in tasks:
                t = self.group.spawn(self._part, tid, addr, turn)
                t._dds_awaited = True  # type: ignore[attr-defined]  # see TaskGroup
                out.append(t)
            return out

        turn = 0
        pending = request(turn)
        try:
            while not self.stopped:
                parts = await asyncio.gather(*pending)
                turn += 1
                pending = request(turn)
                await self.channel.put(self._join(parts))
        finally:
            for f in pending:
                f.cancel()

    async def _part(self, task_id: int, address: str, turn: int) -> list[Any]:
        raise NotImplementedError

    async def _answer(self, task_id: int, address: str, request: Awaitable[Any]) -> Any:
        """The reply to ``request`` (to task ``task_id`` on ``address``), as the DYNAMIC
        reader waits for one: after ``client.request-timeout`` without it, the worker is
        reported to the dispatcher (which probes it and drops a silent one); once the task
        is lost the read fails saying so (every round or turn needs every task, so the
        read cannot go on without it), instead of waiting forever on a frozen worker."""
        pending = self.group.spawn(_awaited, request)
        pending._dds_awaited = True  # type: ignore[attr-defined]
        try:
            while True:
                done, _ = await asyncio.wait((pending,), timeout=self.request_timeout)
                if done:
                    return pending.result()
                await self._unresponsive(task_id, address)
                if task_lost(await self._heartbeat(), task_id):
                    raise DataServiceError(
                        f"{self.what}: the worker of task {task_id} ({address}) stopped "
                        f"answering (no reply for {self.request_timeout:g}s, "
                        "dataservice.client.request-timeout) and the dispatcher dropped it; "
                        f"{self.what} need every task of the job, so this read ends")
        finally:
            pending.cancel()

    def _join(self, parts: list[list[Any]]) -> list[Any]:
        return join_turns(parts)

    async def _heartbeats(self) -> None:
        while not self.stopped:
            await asyncio.sleep(self.heartbeat_interval)
            try:
                await self._heartbeat()
            except DataServiceError as e:
                logger.info("dataservice: %s: heartbeat failed: %r", self.what, e)


class CoordinatedReader(_FixedTasksReader):
    """Coordinated reads: round ``r`` comes from task ``r mod T``, element ``consumer_index``.

    Every consumer of the job walks the same fixed list of tasks (sorted by id), so in each
    round all consumers read from the same worker. Rounds are fetched ``rounds-per-request``
    at a time from every task.
    """

    what = "coordinated reads"

    async def _part(self, task_id: int, address: str, turn: int) -> list[Any]:
        k = max(1, int(config.get("client.rounds-per-request")))
        resp = await self._answer(task_id, address, self.client.rpc(address).dataservice_get_rounds(
            task_id=task_id, first_round=turn * k, count=k,
            consumer_index=self.spec.consumer_index, num_consumers=self.spec.num_consumers,
            job_token=self.job_token))
        items: list[Any] = raise_for_status(resp, "coordinated read")["elements"].items
        return items

    def _join(self, parts: list[list[Any]]) -> list[Any]:
        return join_rounds(parts)


class CrossTrainerReader(_FixedTasksReader):
    """The cross-trainer cache under DYNAMIC with several tasks: their windows hold
    different splits, so every trainer takes exactly ``cross-trainer-turn-elements`` elements
    from each task in task order, turn after turn, and all trainers see the same sequence
    (issue 9, 2.11). It reads so with one task too, and whatever the number of tasks when the
    read starts (:func:`._reader.reader_class`). The price: a trainer reads ahead by whole
    turns, so one that pauses skips less of the window."""

    what = "cross-trainer cache"

    async def _part(self, task_id: int, address: str, turn: int) -> list[Any]:
        k = max(1, int(config.get("client.cross-trainer-turn-elements", CROSS_TRAINER_TURN)))
        rpc = self.client.rpc(address)
        out: list[Any] = []
        while len(out) < k:
            resp = await self._answer(task_id, address, rpc.dataservice_get_elements(
                task_id=task_id, max_elements=k - len(out), max_bytes=self.max_bytes,
                wait=self.long_poll, trainer_id=self.trainer_id, job_token=self.job_token))
            kind = turn_reply(resp)
            if kind == "closing":
                raise DataServiceError(f"cross-trainer cache: the worker of task {task_id} "
                                       f"({address}) is shutting down")
            batch = raise_for_status(resp, "element request").get("elements")
            if batch is not None:  # kind "elements"
                out.extend(batch.items)
            elif kind == "end":
                raise DataServiceError("the cross-trainer cache needs an infinite dataset, and "
                                       f"task {task_id} ended")
            elif kind == "unknown" and task_lost(await self._heartbeat(), task_id):
                # its worker never got the task, or restarted without it: it would answer
                # "unknown" for ever (found by the simulator, cross-trainer seed 7)
                raise DataServiceError(
                    f"cross-trainer cache: the worker of task {task_id} ({address}) does not "
                    "run it and the dispatcher lost it; the cross-trainer cache needs every "
                    "task of the job, so this read ends")
        return out


async def _awaited(request: Awaitable[Any]) -> Any:
    return await request


_reader._FIXED_READERS[:] = [sys.modules[__name__]]  # see _reader._fixed_readers
