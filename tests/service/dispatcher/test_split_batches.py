"""DYNAMIC split batches (issue 16, target 3): a data worker asks for more splits at once while
its pipeline waits for them, up to ``dataservice.worker.split-batch-max``, never more; every
element is read exactly once. The journal of a fault-tolerant dispatcher holds one
``ProduceSplits`` record per request, with its count."""

from __future__ import annotations

import dask
import pytest
from distributed import Client, LocalCluster

import dask_dataservice as dds
from dask_dataservice.service.dispatcher._state_codec import decode_update
from dask_dataservice.service.dispatcher._updates import ProduceSplits
from dask_dataservice.service.dispatcher.journal import read_journal

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("batch_max", [1, 8])
def test_split_requests_grow_up_to_the_configured_batch(tmp_path, batch_max):
    with dask.config.set({"dataservice.dispatcher.fault-tolerant-mode": True,
                          "dataservice.dispatcher.work-dir": str(tmp_path),
                          "dataservice.worker.split-batch-max": batch_max}), \
            LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                         dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        dds.install(client)
        ds = dds.Dataset.range(2000).apply(dds.distribute("DYNAMIC", client, split_size=5))
        assert sorted(ds) == list(range(2000))  # 400 splits, each read once
        counts = [r.count for r in map(decode_update, read_journal(str(tmp_path)))
                  if isinstance(r, ProduceSplits) and r.count]
    assert sum(counts) == 400
    assert max(counts) == batch_max  # a fast pipeline waits for splits: batches reach the cap
    assert counts[0] == 1  # and start at one split (a slow pipeline keeps asking for one)


async def _fair_share(tmp_path) -> list[int]:
    from test_snapshots import ft_dispatcher

    from dask_dataservice.service.dispatcher.state import CreateTask, RegisterWorker

    async with ft_dispatcher(tmp_path) as plugin:
        dataset_id = (await plugin.register_dataset(
            fingerprint="fp", pipeline=b"p", splits=b"s", num_splits=256))["dataset_id"]
        job_id = (await plugin.get_or_create_job(
            dataset_id=dataset_id, processing_mode="DYNAMIC"))["job_id"]
        token = plugin.state.job(job_id).token
        it = (await plugin.get_or_create_iteration(job_id=job_id, job_token=token))["iteration_id"]
        tasks = []
        for address in ("tcp://10.0.0.1:1", "tcp://10.0.0.2:1"):
            plugin._apply(RegisterWorker(address, address.split("//")[1].split(":")[0], 1))
            task_id = plugin.state.next_task_id()
            plugin._apply(CreateTask(task_id, it, address))
            tasks.append(task_id)
        sizes = []
        while True:
            reply = await plugin.get_split(iteration_id=it, task_id=tasks[0], repetition=0,
                                     count=1024, job_token=token)
            sizes.append(len(reply["split_indices"]))
            if reply["end_of_splits"]:
                return sizes


def test_a_task_gets_at_most_half_a_fair_share_of_the_splits_left(tmp_path):
    # two active tasks, 256 splits, one greedy task asking for 1,024 each time: 64 (256 / 4),
    # then a quarter of what is left each time, down to single splits at the end
    import asyncio

    sizes = asyncio.run(_fair_share(tmp_path))
    assert sizes[:3] == [64, 48, 36] and sizes[-1] == 1 and sum(sizes) == 256


@pytest.mark.pure
@pytest.mark.parametrize("bad", ["many", 0, 2.5])
def test_a_bad_split_batch_max_is_an_error_naming_the_key(bad):
    from dask_dataservice import config

    with dask.config.set({"dataservice.worker.split-batch-max": bad}):
        with pytest.raises(ValueError, match=r"config dataservice\.worker\.split-batch-max "
                                             r"must be an integer >= 1, got"):
            config.get_int("worker.split-batch-max", minimum=1)
    with dask.config.set({"dataservice.worker.split-batch-max": "16"}):
        assert config.get_int("worker.split-batch-max", minimum=1) == 16


def test_a_bad_split_batch_max_reaches_the_reader(tmp_path):
    # the data worker's task fails with the error, and the consumer sees it (not a hang)
    with dask.config.set({"dataservice.worker.split-batch-max": "many"}), \
            LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                         dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        ds = dds.Dataset.range(10).apply(dds.distribute("DYNAMIC", client))
        with pytest.raises(ValueError, match="split-batch-max must be an integer"):
            list(ds)
