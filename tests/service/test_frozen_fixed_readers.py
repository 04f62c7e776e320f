"""Coordinated reads and the cross-trainer cache with a frozen (SIGSTOP) data worker.

Both read a fixed list of tasks: every round (turn) needs every task. A frozen worker keeps
its Dask comms open, so without a request deadline the read waited forever. Now their
requests have the DYNAMIC reader's deadline: after ``client.request-timeout`` the consumer
reports the worker, the dispatcher's probe gets no answer and drops it, and the read ends
with an error naming the task and the worker, within seconds (the dispatcher's own
heartbeat deadline is set out of reach, so only the consumer's path can notice).

One thread owns the consumer's iterator from ``iter()`` to ``close()``: a Python generator
must not be closed from one thread while another still runs it ("generator already
executing", which once hid the real failure below: the test's ``to_thread(list(it))`` was
abandoned by ``wait_for`` and ``it.close()`` ran in a second thread). The read's deadline is
checked inside that thread, so a read that does not end fails the test saying so.

The failure it hid: the read started before the second data worker had registered with the
dispatcher, so its view listed one task, and the reader chose the plain DYNAMIC reader for a
cross-trainer cache (then the rule for one task), which goes on with the other worker when one
is lost: the infinite read never ended. Now the kind of reader depends on what is read, never
on how many workers happened to be registered (:func:`~dask_dataservice.service.client._reader.reader_class`),
and the test starts reading only once both workers are registered (the fixed readers read the
tasks present when they start). ``test_cross_trainer_read_started_before_a_worker_joined``
forces that interleaving: the second worker starts after the read did.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import threading
import time

import pytest
from _helpers import poll
from distributed import Nanny

import dask_dataservice as dds
from dask_dataservice.errors import DataServiceError
from dask_dataservice.service.dispatcher.plugin import PLUGIN_NAME
from dask_dataservice.testing import gen_cluster

pytestmark = [pytest.mark.process, pytest.mark.timeout(120), pytest.mark.slow]

CONFIG = {
    "distributed.scheduler.allowed-failures": 0,
    "dataservice.dispatcher.worker-timeout": "300s",
    "dataservice.client.request-timeout": "2s",
    "dataservice.dispatcher.worker-probe-timeout": "2s",
}

READS = {
    "coordinated": dict(job_name="coordinated", consumer_index=0, num_consumers=1),
    "cross-trainer": dict(job_name="cached", cross_trainer_cache=dds.CrossTrainerCache("t1")),
}

#: Seconds the read may take to fail after the freeze (it takes about 4 s: a 2 s request
#: timeout, then a 2 s probe); past it the consumer thread stops reading and fails the test.
READ_DEADLINE = 60.0


class Consumer:
    """Reads ``ds`` in one thread of its own, from ``iter()`` to ``close()``: the first
    ``first`` elements, then (once :meth:`go_on` was called) until the read raises."""

    def __init__(self, ds, first: int = 100) -> None:
        self.ds = ds
        self.first_n = first
        self.first: list | None = None
        self.got_first = threading.Event()
        self._go_on = threading.Event()
        self.error: BaseException | None = None
        self.failed_at: float | None = None

    def go_on(self) -> None:
        self._go_on.set()

    def run(self) -> None:
        it = iter(self.ds)
        try:
            self.first = list(itertools.islice(it, self.first_n))
            self.got_first.set()
            if not self._go_on.wait(READ_DEADLINE):
                raise AssertionError("the test never let the consumer go on")
            deadline = time.monotonic() + READ_DEADLINE
            try:
                for _ in it:
                    if time.monotonic() > deadline:
                        raise AssertionError(
                            f"the read did not end within {READ_DEADLINE:g}s of the freeze")
            except DataServiceError as e:
                self.error, self.failed_at = e, time.monotonic()
                return
            raise AssertionError("the read ended without an error")
        finally:
            self.got_first.set()
            it.close()  # this thread ran the generator: closing it here is safe


async def read_until_frozen(plugin, consumer: Consumer, victim_pid: int, n_tasks: int,
                            reading: asyncio.Future | None = None):
    """Run ``consumer`` (or wait for ``reading``, its thread already started); freeze
    ``victim_pid`` once it read its first elements and the iteration has ``n_tasks`` tasks;
    answer ``(error, seconds from the freeze to the error)``."""
    if reading is None:
        reading = asyncio.ensure_future(asyncio.to_thread(consumer.run))
    frozen_at = None
    try:
        await poll(consumer.got_first.is_set, 60, what="the first elements")
        assert consumer.first is not None and len(consumer.first) == consumer.first_n
        await poll(lambda: len([t for i in plugin.state.list_iterations()
                                for t in plugin.state.tasks_for_iteration(i.iteration_id)])
                   == n_tasks, 30, what=f"{n_tasks} tasks")
        os.kill(victim_pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
    finally:
        consumer.go_on()
        try:
            await reading  # the thread ends by itself: with the error, or past its deadline
        finally:
            if frozen_at is not None:
                os.kill(victim_pid, signal.SIGCONT)
    assert consumer.error is not None and consumer.failed_at is not None
    assert frozen_at is not None
    return consumer.error, consumer.failed_at - frozen_at


@pytest.mark.parametrize("kind", sorted(READS))
def test_a_frozen_worker_ends_the_read_with_an_error(kind):
    @gen_cluster(client=True, Worker=Nanny, nthreads=[("", 1), ("", 1)], timeout=100,
                 config=CONFIG)
    async def test(c, s, a, b):
        victim_pid = a.process.process.pid
        victim = a.worker_address
        dataset_id = await asyncio.to_thread(
            dds.register_dataset, c, dds.Dataset.range(10**6).repeat())
        plugin = s.plugins[PLUGIN_NAME]
        # the fixed readers read the tasks present when they start: both workers must be
        # registered by then, or the read would not involve the victim
        await poll(lambda: len(plugin.state.list_workers()) == 2, 30,
                   what="both data workers registered")
        ds = dds.from_dataset_id("distributed_epoch", c, dataset_id, **READS[kind])
        error, took = await read_until_frozen(plugin, Consumer(ds), victim_pid, 2)
        with pytest.raises(DataServiceError, match=r"stopped answering"):
            raise error
        assert victim in str(error)
        assert victim in plugin._liveness.dropped or victim not in [
            w.address for w in plugin.state.list_workers()]
        print(f"[{kind}] the read failed {took:.1f}s after the freeze")
        assert took < 30, f"the read took {took:.1f}s to fail after the freeze"

    test()


def test_cross_trainer_read_started_before_a_worker_joined():
    """The interleaving of the flaky run, forced: a cross-trainer read under DYNAMIC starts
    while one data worker is registered, and a second joins afterwards. The read is the
    cross-trainer turn reader all the same (it used to be the plain reader, chosen because
    the view listed one task: it dropped the frozen worker's task and went on with the
    newcomer's, so the infinite read never ended), reads the task it started with, and ends
    with an error naming the frozen worker."""

    @gen_cluster(client=True, Worker=Nanny, nthreads=[("", 1)], timeout=100, config=CONFIG)
    async def test(c, s, a):
        victim_pid = a.process.process.pid
        victim = a.worker_address
        dataset_id = await asyncio.to_thread(
            dds.register_dataset, c, dds.Dataset.range(10**6).repeat())
        plugin = s.plugins[PLUGIN_NAME]
        await poll(lambda: len(plugin.state.list_workers()) == 1, 30,
                   what="the data worker registered")
        ds = dds.from_dataset_id("distributed_epoch", c, dataset_id, **READS["cross-trainer"])
        consumer = Consumer(ds)
        reading = asyncio.ensure_future(asyncio.to_thread(consumer.run))
        try:
            await poll(consumer.got_first.is_set, 60, what="the first elements")
            async with Nanny(s.address, nthreads=1):  # joins after the read started
                error, took = await read_until_frozen(plugin, consumer, victim_pid, 2, reading)
        finally:
            consumer.go_on()
            await reading
        assert victim in str(error) and "stopped answering" in str(error), error
        print(f"the read failed {took:.1f}s after the freeze")

    test()
