"""Data workers that scale with the consumers' demand (issue 26, part 1), on a real LocalCluster.

TensorFlow's tf.data service has no counterpart (the user sizes the workers); the rules are
Cachew's (USENIX ATC'22), whose policy has pure tests in
tests/service/dispatcher/test_autoscale.py. Here Dask's own ``Adaptive`` machinery resizes a
real cluster: a consumer that needs about three workers' throughput, starting from one, and
then slowing down to less than one worker's.
"""

from __future__ import annotations

import threading
import time

import dask
import pytest
from _helpers import wait
from distributed import Client, LocalCluster

import dask_dataservice as dds

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(150)]

#: One element takes a data worker 10 ms (100 elements/s each, not CPU: threads in one
#: process do not compete for the GIL).
PRODUCE = 0.01
FAST = {"dataservice.dashboard.interval": "250ms",
        "dataservice.worker.heartbeat-interval": "200ms",
        "dataservice.worker.buffer-elements": 16,
        # a small prefetch: a retiring worker's last elements wait behind what the
        # consumer holds (at 20 elements/s, 25 s of default prefetch under load)
        "dataservice.client.request-elements": 16,
        "dataservice.client.max-outstanding-batches": 2,
        # ... and behind the splits it was handed ahead (the batch grows under load)
        "dataservice.worker.split-batch-max": 2}


def _slow(x):
    time.sleep(PRODUCE)
    return x


class Consumer(threading.Thread):
    """Reads a DYNAMIC job, computing ``compute`` seconds per element (changeable)."""

    def __init__(self, client: Client, compute: float) -> None:
        super().__init__(name="test-consumer", daemon=True)
        self.client, self.compute = client, compute
        self.stop = threading.Event()
        self.seen: list[int] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            # small splits: a retiring worker ends the split it reads before it goes
            dataset_id = dds.register_dataset(
                self.client, dds.Dataset.range(10**6).map(_slow), split_size=5)
            ds = dds.from_dataset_id("distributed_epoch", self.client, dataset_id)
            for x in ds:
                self.seen.append(int(x))
                if self.stop.is_set():
                    break
                time.sleep(self.compute)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


def _drains(dask_scheduler):
    """The dispatcher's drains: those under way and those done (seconds each)."""
    ext = dask_scheduler.extensions["dataservice"]
    return {"draining": sorted(ext._core.draining), "drained": ext.retirements.drained}


def _scaling_figure(dask_scheduler):
    """The dashboard page's scaling figure, as the page builds it on the scheduler."""
    from dask_dataservice.dashboard._pages import DataServicePage

    page = DataServicePage(dask_scheduler)
    page.update()
    return {"visible": page.fig_s.visible, **dict(page.scaling.data)}


def test_data_workers_follow_a_consumers_demand_up_and_down():
    with dask.config.set(FAST), \
            LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                         dashboard_address=None) as cluster, Client(cluster) as client:
        dds.install(client)
        adaptive = cluster.adapt(Adaptive=dds.DemandAdaptive, minimum=1, maximum=4,
                                 interval="250ms", wait_count=2, settle=2.0, cooldown=3.0)
        consumer = Consumer(client, compute=0.004)  # takes ~250/s: 2.5 workers' worth
        consumer.start()
        try:
            t0 = time.monotonic()
            wait(lambda: len(cluster.scheduler_info["workers"]) >= 3 or consumer.error, 60,
                 "three data workers")
            assert consumer.error is None, consumer.error
            up = time.monotonic() - t0
            scaling = dds.status(client)["scaling"]
            assert scaling["enabled"]
            rows = scaling["timeline"]
            assert any(w > 0.05 and want > n for w, want, n in
                       zip(rows["wait"], rows["wanted"], rows["data_workers"], strict=True))
            assert max(rows["data_workers"]) <= 4
            consumer.compute = 0.05  # now ~20/s: less than one worker's 100/s
            t1 = time.monotonic()
            try:
                wait(lambda: len(cluster.scheduler_info["workers"]) == 1 or consumer.error,
                     90, "back to one data worker")
            except AssertionError as e:  # say where it stood
                raise AssertionError(f"{e}: {dds.status(client)['scaling']['latest']}; "
                                     f"{client.run_on_scheduler(_drains)}") from None
            assert consumer.error is None, consumer.error
            down = time.monotonic() - t1
            rows = dds.status(client)["scaling"]["timeline"]
            assert any(want < n for want, n in zip(rows["wanted"], rows["data_workers"],
                                                   strict=True))
            n = len(consumer.seen)
            wait(lambda: len(consumer.seen) > n + 20, 30, "the consumer to keep reading")
            seen = consumer.seen
            assert len(seen) == len(set(seen))  # retiring workers duplicated nothing
            page = client.run_on_scheduler(_scaling_figure)
            assert page["visible"] and max(page["data_workers"]) >= 3
            assert min(page["wanted"]) == 1 and len(page["time"]) == len(page["wanted"])
            print(f"\nscaled 1 -> 3 in {up:.1f}s, back to 1 in {down:.1f}s; drains "
                  f"{client.run_on_scheduler(_drains)}")
        finally:
            consumer.stop.set()
            consumer.join(30)
            adaptive.stop()


def test_parameter_servers_are_never_retired_for_the_data_service():
    """A worker with the ``ps`` resource is neither counted as a data worker nor closed."""
    with dask.config.set(FAST), \
            LocalCluster(n_workers=0, threads_per_worker=1, processes=False,
                         dashboard_address=None) as cluster, Client(cluster) as client:
        dds.install(client)
        cluster.scale(3)
        client.wait_for_workers(3)
        ps = sorted(client.scheduler_info()["workers"])[0]

        async def give(dask_worker):
            await dask_worker.set_resources(ps=1)

        client.run(give, workers=[ps])
        wait(lambda: client.run_on_scheduler(
            lambda dask_scheduler: dask_scheduler.extensions["dataservice"]._core
            .is_data_worker(ps)) is False, 10, "the ps worker to be excluded")
        demand = client.run_on_scheduler(
            lambda dask_scheduler: dask_scheduler.handlers["dataservice_demand"]())
        assert demand["data_workers"] == 2 and demand["other_workers"] == 1
        to_close = client.run_on_scheduler(
            lambda dask_scheduler: dask_scheduler.handlers["dataservice_workers_to_close"](
                target=0, attribute="address"))
        assert sorted(to_close) == sorted(a for a in client.scheduler_info()["workers"]
                                          if a != ps)
