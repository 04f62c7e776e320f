"""The reader of an equal split: a DYNAMIC pass whose consumers deliver the same count.

:class:`EqualReader` reads its job as the plain reader does (every task, first come, first
served: dynamic balance between the consumers), but keeps what it receives in a bounded
holding queue and hands it on to the consumer only as far as the dispatcher allows
(:mod:`.equal_core` keeps the counts, the dispatcher's ``_equal`` the rules). Two
coroutines talk to the dispatcher, both through ``dataservice_equal_sync``: a reporter
that sends the counts when they changed (one request in flight: counts travel in batches),
and a waiter that, while the consumer may not go on, keeps one request parked at the
dispatcher until the answer changes. A full holding queue stops the fetches
(backpressure), so a consumer that runs ahead leaves the job's remaining elements to the
others.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import sys
from typing import Any

from ... import config
from ...errors import DataServiceError
from ..protocol._messages import raise_for_status
from . import _reader
from ._reader import IterationReader
from .equal_core import REPORT_INTERVAL, EqualGate, take

logger = logging.getLogger("dask_dataservice.service.client._reader")

#: ``pad``: the consumer repeats (cyclically) its last this many delivered elements.
PAD_KEEP = 64
#: Batches received that a consumer holds before it may hand them on (then it stops
#: fetching): what it can hold beyond the others, so what ``drop`` may drop of it.
HELD_BATCHES = 2


class EqualReader(IterationReader):
    """Reads one pass of an equal split (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        spec = self.spec
        assert spec.equal is not None and spec.consumer_index is not None
        self.gate = EqualGate(spec.equal)
        self.index = spec.consumer_index
        self.num_consumers = spec.num_consumers
        #: Batches received and not handed on yet, and their element count.
        self.held: collections.deque[list[Any]] = collections.deque()
        self.held_elements = 0
        self._space = asyncio.Event()
        self._changed = asyncio.Event()  # counts or answers changed: the mover looks again
        self._info = asyncio.Event()  # counts changed: the reporter sends them
        self._blocked = asyncio.Event()  # the mover may not go on: the waiter parks a request
        self._recent: collections.deque[Any] = collections.deque(maxlen=PAD_KEEP)
        #: Requests sent and parked ones answered (what the barrier cost).
        self.syncs = 0
        self.request_elements = max(1, min(self.max_elements, int(
            config.get("client.equal-request-elements", 8))))

    async def _read(self, view: dict[str, Any]) -> None:
        self.group.spawn(self._fetch_pass, view)
        self.group.spawn(self._report_loop)
        self.group.spawn(self._wait_loop)
        await self._move()

    async def _fetch_pass(self, view: dict[str, Any]) -> None:
        """The plain reader's pass; then the counts are final."""
        try:
            await IterationReader._read(self, view)
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except BaseException as e:  # noqa: BLE001 - the first error ends the pass
            self._fail(e)
            return
        self.gate.end()
        self._poke()

    def _count_consumers(self, consumers: int) -> None:
        """The split's consumers sharing the job is the point: said only past ``num_consumers``."""
        if consumers > (self.num_consumers or 0):
            super()._count_consumers(consumers)

    def _request_size(self) -> int:
        """Requests stay at ``client.equal-request-elements``: what a consumer holds beyond
        the others is what ``drop`` drops (docs/data-service.md, "Equal splits")."""
        return self.request_elements

    async def _put(self, items: list[Any]) -> None:
        while len(self.held) >= HELD_BATCHES and not self.stopped:
            self._space.clear()
            await self._space.wait()
        self.held.append(items)
        self.held_elements += len(items)
        self.gate.got(len(items))
        self._poke()

    def _poke(self) -> None:
        self._info.set()
        self._changed.set()

    async def _move(self) -> None:
        """Hand held elements on as far as allowed; return once the count was delivered."""
        gate = self.gate
        while not self.stopped:
            self._changed.clear()
            limit = gate.may_move()
            if self.held and (limit is None or limit > 0):
                batch = self.held.popleft()
                part, rest = take(batch, limit)
                if rest:
                    self.held.appendleft(rest)
                self.held_elements -= len(part)
                self._space.set()
                gate.moved_out(len(part))
                if gate.remainder == "pad":
                    self._recent.extend(part[-PAD_KEEP:])
                await self.channel.put(part)
                continue
            if gate.done(self.held_elements):
                await self._pad()
                return
            if gate.waiting(self.held_elements):
                self._blocked.set()
            await self._changed.wait()

    async def _pad(self) -> None:
        count = self.gate.pad_count()
        if not count:
            return
        if not self._recent:
            raise DataServiceError(
                f"consumer {self.index} of an equal split of job {self.spec.job_name!r} got no "
                f"element in this pass, so it cannot pad to the other consumers' {self.gate.final} "
                "(equal='pad' repeats elements a consumer delivered): use equal='drop', or a "
                "dataset of at least num_consumers elements")
        logger.debug("dataservice: consumer %d pads %d elements", self.index, count)
        padding = list(itertools.islice(itertools.cycle(list(self._recent)), count))
        for start in range(0, count, max(1, self.max_elements)):
            await self.channel.put(padding[start:start + self.max_elements])
        self.gate.moved_out(count)

    async def _sync(self, wait: float) -> None:
        """One ``dataservice_equal_sync``; rides out a dispatcher restart for
        ``client.dispatcher-timeout`` (the counts are resent: the group is rebuilt)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.dispatcher_timeout
        delay = 0.05
        while not self.stopped:
            report = self.gate.report()
            try:
                resp = await self.client.scheduler.dataservice_equal_sync(  # type: ignore[union-attr]
                    iteration_client_id=self.client_id, job_token=self.job_token,
                    consumer_index=self.index, num_consumers=self.num_consumers,
                    remainder=self.gate.remainder, received=report.received,
                    ended=report.ended, need=report.need, wait=wait)
            except (OSError, TimeoutError) as e:
                if loop.time() > deadline:
                    raise DataServiceError(
                        f"lost contact with the data service at {self.spec.address}: {e!r}"
                    ) from e
                await asyncio.sleep(delay)
                delay = min(2 * delay, 0.25)
                continue
            self.syncs += 1
            if resp is not None and resp.get("status") == "closing":
                await asyncio.sleep(delay)
                continue
            self.gate.on_reply(raise_for_status(resp, "equal split sync"))
            self._changed.set()
            return

    async def _report_loop(self) -> None:
        """Send the counts when they changed (one request in flight): at once when the others
        may wait for them (:attr:`.equal_core.EqualGate.urgent`), else within
        ``REPORT_INTERVAL``."""
        loop = asyncio.get_running_loop()
        try:
            while not self.stopped:
                gate = self.gate
                if not gate.unreported:
                    self._info.clear()
                    await self._info.wait()
                    continue
                due = loop.time() + REPORT_INTERVAL
                while not (gate.urgent or self.stopped) and loop.time() < due:
                    self._info.clear()
                    try:
                        await asyncio.wait_for(self._info.wait(), due - loop.time())
                    except TimeoutError:
                        break
                await self._sync(0.0)
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except BaseException as e:  # noqa: BLE001 - ends the pass
            self._fail(e)

    async def _wait_loop(self) -> None:
        """While the consumer may not go on, keep one request parked at the dispatcher."""
        try:
            while not self.stopped:
                if not self.gate.waiting(self.held_elements):
                    self._blocked.clear()
                    await self._blocked.wait()
                    continue
                await self._sync(self.long_poll)
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except BaseException as e:  # noqa: BLE001 - ends the pass
            self._fail(e)

    def _fail(self, e: BaseException) -> None:
        super()._fail(e)
        self._wake_all()

    def stop(self) -> None:
        super().stop()
        self._wake_all()

    def _wake_all(self) -> None:
        for event in (self._changed, self._space, self._info, self._blocked):
            event.set()

    def _start_release(self, read_to_end: bool = False) -> None:
        super()._start_release(read_to_end and self.gate.ended)


_reader._EQUAL_READER[:] = [EqualReader]
assert sys.modules[__name__]
