"""Job capabilities and limits (issue 11 §6) on real in-process Dask clusters.

A *stranger* is a second Dask client of the same scheduler that is not a consumer of the
job: it knows (or guesses) the small integer ids of datasets, jobs and tasks, and the
workers' addresses, but not the job's token nor any worker's key. It must not read the
job's elements, take or finish its splits, download the pipeline, or pose as a worker;
the victim, reading meanwhile, must lose nothing.
"""

from __future__ import annotations

import asyncio
import threading

import dask
import numpy as np
import pytest
from _helpers import distribute, poll, read
from distributed import Client

import dask_dataservice as dds
from dask_dataservice.service.client import _install_async
from dask_dataservice.service.dispatcher._state_codec import decode_state, encode_state
from dask_dataservice.service.dispatcher.plugin import PLUGIN_NAME
from dask_dataservice.service.dispatcher.state import CreateJob, DispatcherState, RegisterDataset
from dask_dataservice.service.protocol._job_checks import JobAccessDeniedError
from dask_dataservice.service.protocol._messages import raise_for_status
from dask_dataservice.testing import gen_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]

#: Holds the victim's pipeline until the stranger has tried everything (module level: the
#: in-process workers run the pickled-by-reference function in this process).
GATE = threading.Event()
N = 2000


def gated(x):
    GATE.wait(30)
    return x


def refused(reply, match: str) -> None:
    with pytest.raises(JobAccessDeniedError, match=match):
        raise_for_status(reply, "stranger's request")


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)])
async def test_a_stranger_is_refused_and_the_victim_loses_nothing(c, s, a, b):
    GATE.clear()
    await _install_async(c)
    plugin = s.plugins[PLUGIN_NAME]
    ds = await distribute(dds.Dataset.range(N).map(gated), "DYNAMIC", c)
    victim = asyncio.create_task(read(ds))
    try:
        await poll(lambda: any(plugin.state.tasks_for_iteration(it.iteration_id)
                               for it in plugin.state.list_iterations()),
                   what="the victim's tasks")
        [iteration] = plugin.state.list_iterations()
        job = plugin.state.job(iteration.job_id)
        assert job.token
        tasks = plugin.state.tasks_for_iteration(iteration.iteration_id)
        workers = {w.address: w for w in (a, b)}
        # the tasks run (their pipelines wait at the gate): a request meets a runner
        await poll(lambda: all(workers[t.worker_address].extensions["dataservice"].tasks.get(
            t.task_id) is not None for t in tasks), what="the tasks to start")
        async with Client(s.address, asynchronous=True, set_as_default=False) as stranger:
            for t in tasks:
                rpc = stranger.rpc(t.worker_address)
                for token in (None, "guess", job.token[:-1]):
                    refused(await rpc.dataservice_get_elements(
                        task_id=t.task_id, wait=0.1, job_token=token), "reading elements")
                refused(await stranger.scheduler.dataservice_get_split(
                    iteration_id=iteration.iteration_id, task_id=t.task_id, repetition=0,
                    count=1024), "taking splits")
                refused(await stranger.scheduler.dataservice_finish_task(task_id=t.task_id),
                        "finishing a task")
                refused(await stranger.scheduler.dataservice_ack_splits(
                    task_id=t.task_id, repetition=0), "acknowledging splits")
            refused(await stranger.scheduler.dataservice_get_or_create_iteration(
                job_id=job.job_id), "reading of job")
            # nor act for the victim's consumer (releasing it would end the victim's read)
            [consumer] = plugin.state.list_iteration_clients()
            refused(await stranger.scheduler.dataservice_release_iteration_client(
                iteration_client_id=consumer.iteration_client_id), "releasing a consumer")
            refused(await stranger.scheduler.dataservice_client_heartbeat(
                iteration_client_id=consumer.iteration_client_id), "a client heartbeat")
            # pipelines are for workers only; the key a worker needs never travels in a reply
            refused(await stranger.scheduler.dataservice_get_dataset(
                dataset_id=job.dataset_id), "only data workers may ask")
            reply = raise_for_status(await stranger.scheduler.dataservice_worker_key(
                address=a.address), "worker key")
            assert reply == {"status": "OK"}
            for key in (None, "guess"):
                refused(await stranger.scheduler.dataservice_get_dataset(
                    dataset_id=job.dataset_id, address=a.address, worker_key=key),
                    "only data workers may ask")
                refused(await stranger.scheduler.dataservice_worker_heartbeat(
                    address=a.address, host="127.0.0.1", nthreads=1, worker_key=key),
                    "heartbeat refused")
        assert plugin.state.split_position(iteration.iteration_id)[1] < N  # nothing stolen
        assert all(plugin.state.task_status(t.task_id) == "active" for t in tasks)
    finally:
        GATE.set()
    got = await asyncio.wait_for(victim, 30)
    assert sorted(got) == list(range(N))  # no loss, no duplicate


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_consumers_of_a_named_job_share_its_token(c, s, a):
    await _install_async(c)
    plugin = s.plugins[PLUGIN_NAME]
    dataset_id = await asyncio.to_thread(dds.register_dataset, c, dds.Dataset.range(10))

    async def job(**kwargs):
        return raise_for_status(await c.scheduler.dataservice_get_or_create_job(
            dataset_id=dataset_id, processing_mode="OFF", **kwargs), "job")

    first, second = await job(job_name="shared"), await job(job_name="shared")
    assert first["job_id"] == second["job_id"] and first["job_token"] == second["job_token"]
    anonymous = [await job(), await job()]
    tokens = {first["job_token"], *(j["job_token"] for j in anonymous)}
    assert len(tokens) == 3 and all(len(t) >= 32 for t in tokens)
    # and the consumers of a named job share its elements, with the one token
    readers = [dds.from_dataset_id("OFF", c, dataset_id, job_name="both") for _ in range(2)]
    got = await asyncio.gather(*(read(r) for r in readers))
    assert sorted(got[0] + got[1]) == list(range(10))
    assert plugin.state.job(first["job_id"]).token == first["job_token"]


@pytest.mark.pure
def test_job_tokens_are_journaled_and_old_records_have_none():
    state = DispatcherState()
    dataset_id = state.next_dataset_id()
    state.apply(RegisterDataset(dataset_id=dataset_id, fingerprint="f", pipeline=b"p",
                                splits=b"", num_splits=-1))
    first = state.next_job_id()
    state.apply(CreateJob(job_id=first, job_name=None, dataset_id=dataset_id,
                          processing_mode="OFF", token="secret"))
    # a record written before the field existed decodes with the default: no token
    second = state.next_job_id()
    state.apply(CreateJob(job_id=second, job_name=None, dataset_id=dataset_id,
                          processing_mode="OFF"))
    restored = decode_state(encode_state(state))
    assert restored.job(first).token == "secret"
    assert restored.job(second).token == ""


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_limits_on_pipeline_size_and_datasets_per_client(c, s, a):
    with dask.config.set({"dataservice.dispatcher.max-pipeline-bytes": "64 KiB",
                          "dataservice.dispatcher.max-datasets-per-client": 2}):
        await _install_async(c)

    def register(ds):
        return asyncio.to_thread(dds.register_dataset, c, ds)

    big = dds.Dataset.from_tensor_slices(np.arange(100_000))  # ~800 kB captured
    with pytest.raises(ValueError, match="max-pipeline-bytes"):
        await register(big)
    first = await register(dds.Dataset.range(1))
    await register(dds.Dataset.range(2))
    assert await register(dds.Dataset.range(1)) == first  # the same dataset: not a new one
    with pytest.raises(ValueError, match="already registered 2 datasets.*max-datasets-per-client"):
        await register(dds.Dataset.range(3))
    # another client has its own allowance
    async with Client(s.address, asynchronous=True, set_as_default=False) as other:
        await asyncio.to_thread(dds.register_dataset, other, dds.Dataset.range(3))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_the_state_view_shows_a_stranger_names_and_counts_only(c, s, a):
    """``dataservice_state``: names and counts for anyone, a job's tasks and lost splits with
    its token (or a worker key), pipelines and tokens never."""
    await _install_async(c)
    plugin = s.plugins[PLUGIN_NAME]
    dataset_id = await asyncio.to_thread(dds.register_dataset, c, dds.Dataset.range(10))
    job = raise_for_status(await c.scheduler.dataservice_get_or_create_job(
        dataset_id=dataset_id, processing_mode="OFF"), "job")
    view = raise_for_status(await c.scheduler.dataservice_get_or_create_iteration(
        job_id=job["job_id"], job_token=job["job_token"]), "iteration")
    iteration_id = view["iteration_id"]
    await poll(lambda: plugin.state.tasks_for_iteration(iteration_id), what="a task")
    async with Client(s.address, asynchronous=True, set_as_default=False) as stranger:
        seen = raise_for_status(await stranger.scheduler.dataservice_state(), "state")
        assert list(seen["datasets"]) == [dataset_id] and list(seen["workers"]) == [a.address]
        assert seen["jobs"] == {job["job_id"]: {"name": None, "dataset_id": dataset_id,
                                                "mode": "OFF", "status": "live"}}
        it = seen["iterations"][iteration_id]
        assert sum(it["num_tasks"].values()) == 1 and it["num_lost_splits"] == 0
        assert "tasks" not in it and "lost_splits" not in it
        for secret in (job["job_token"], "pipeline"):
            assert secret not in repr(seen)
        # with the job's token: its tasks and lost splits
        mine = raise_for_status(await stranger.scheduler.dataservice_state(
            job_token=job["job_token"]), "state")
        [task] = mine["iterations"][iteration_id]["tasks"]
        assert task["worker_address"] == a.address
        assert list(mine["iterations"][iteration_id]["lost_splits"]) == []
        assert job["job_token"] not in repr(mine)
        refused(await stranger.scheduler.dataservice_state(job_token="guess"),
                "token of no job")
        refused(await stranger.scheduler.dataservice_state(address=a.address,
                                                             worker_key="guess"),
                "only data workers may ask")
    # a data worker (with its key) sees every job's detail
    key = await a.extensions["dataservice"]._key.get()
    full = raise_for_status(await c.scheduler.dataservice_state(address=a.address,
                                                                 worker_key=key), "state")
    assert full["iterations"][iteration_id]["tasks"] == mine["iterations"][iteration_id]["tasks"]
    raise_for_status(await c.scheduler.dataservice_release_iteration_client(
        iteration_client_id=view["iteration_client_id"], job_token=job["job_token"]), "release")
