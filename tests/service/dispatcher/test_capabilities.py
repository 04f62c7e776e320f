"""Job capabilities, dataset credentials and limits (issues 11 §6 and 22) on real
in-process Dask clusters.

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


async def _victim_reads(c, plugin, dataset_id) -> asyncio.Task:
    """The victim reads the named DYNAMIC job "train" of ``dataset_id`` (its pipeline waits at
    the gate): the reading task, once the job's tasks exist."""
    victim = asyncio.create_task(read(dds.from_dataset_id("DYNAMIC", c, dataset_id,
                                                          job_name="train")))
    await poll(lambda: any(plugin.state.tasks_for_iteration(it.iteration_id)
                           for it in plugin.state.list_iterations()),
               what="the victim's tasks")
    return victim


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


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)])
async def test_a_stranger_cannot_find_or_join_a_named_job(c, s, a, b):
    """Issue 22 item 2: a job's name is no capability. The victim reads the named DYNAMIC job
    "train" of a dataset registered under the name "train-data"; a stranger (another client)
    sees no name nor id in the state view, and every id it can guess (numbers, the bare names,
    the id with a wrong secret) names no dataset: it creates or joins no job and takes
    nothing. The victim gets every element once. Before, the view listed the ids and
    ``get_or_create_job(<listed id>, job_name="train")`` answered the job's token: a stranger
    took 240 splits and the victim got 1,101 of 20,000 elements, with no error."""
    GATE.clear()
    await _install_async(c)
    plugin = s.plugins[PLUGIN_NAME]
    dataset_id = await asyncio.to_thread(dds.register_dataset, c,
                                         dds.Dataset.range(N).map(gated), dataset_id="train-data")
    assert isinstance(dataset_id, str) and dataset_id.startswith("train-data:")
    assert len(dataset_id.rpartition(":")[2]) >= 32  # 192 random bits
    victim = await _victim_reads(c, plugin, dataset_id)
    try:
        [job] = plugin.state.list_jobs()
        numeric = plugin.state.list_datasets()[0].dataset_id
        async with Client(s.address, asynchronous=True, set_as_default=False) as stranger:
            seen = raise_for_status(await stranger.scheduler.dataservice_state(), "state")
            assert (seen["num_datasets"], seen["num_jobs"], seen["num_iterations"]) == (1, 1, 1)
            assert list(seen["datasets"]) == [] and seen["jobs"] == {} and seen["iterations"] == {}
            for name in ("train", "train-data", str(job.job_id), str(numeric)):
                assert name not in repr(seen)
            secret = dataset_id.rpartition(":")[2]
            guesses = [numeric, str(numeric), "train-data", f"{numeric}:{secret}",
                       f"train-data:{secret[:-1]}", "train-data:", *range(1000, 1010)]
            for guess in guesses:
                for request in ({"dataset_id": guess, "processing_mode": "DYNAMIC",
                                 "job_name": "train"},
                                {"dataset_id": guess, "processing_mode": "OFF"}):
                    reply = await stranger.scheduler.dataservice_get_or_create_job(**request)
                    with pytest.raises(dds.DatasetNotFoundError,
                                       match="no dataset has the id .* with this secret"):
                        raise_for_status(reply, "stranger's job")
                    assert secret[:16] not in repr(reply)  # messages never show a secret
                reply = await stranger.scheduler.dataservice_start_read(job={
                    "dataset_id": guess, "processing_mode": "DYNAMIC", "job_name": "train"})
                with pytest.raises(dds.DatasetNotFoundError):
                    raise_for_status(reply, "stranger's read")
                reply = await stranger.scheduler.dataservice_check_position(
                    dataset_id=guess, processing_mode="DYNAMIC")
                with pytest.raises(dds.DatasetNotFoundError):
                    raise_for_status(reply, "stranger's position check")
                reply = await stranger.scheduler.dataservice_dataset_metadata(dataset_id=guess)
                with pytest.raises(dds.DatasetNotFoundError):
                    raise_for_status(reply, "stranger's metadata")
                assert secret[:16] not in repr(reply)
            # a wrong credential does not widen the view either
            refused(await stranger.scheduler.dataservice_state(dataset_id="train-data"),
                    "no dataset's credential")
            # the credential holder sees its dataset and jobs, no tasks without the token
            mine = raise_for_status(await stranger.scheduler.dataservice_state(
                dataset_id=dataset_id), "state")
            assert list(mine["datasets"]) == [numeric]
            assert mine["jobs"] == {job.job_id: {"name": "train", "dataset_id": numeric,
                                                 "mode": "DYNAMIC", "status": "live"}}
            assert all("tasks" not in it for it in mine["iterations"].values())
        assert [j.job_id for j in plugin.state.list_jobs()] == [job.job_id]  # none created
        assert len(plugin.state.list_iteration_clients()) == 1  # nobody joined
        assert plugin.state.split_position(plugin.state.list_iterations()[0].iteration_id)[1] < N
    finally:
        GATE.set()
    got = await asyncio.wait_for(victim, 30)
    assert sorted(got) == list(range(N))  # no loss, no duplicate


KEY = "dataservice.client.registration-key"


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)])
async def test_a_registration_key_keeps_a_rebuilt_pipeline_out_of_a_named_job(c, s, a, b):
    """Issue 22 item 2: without a key a credential is only as secret as the pipeline (who
    rebuilds ``range(N)`` and registers it gets the credential, as in TensorFlow). With
    ``dataservice.client.registration-key`` the victim's trainers share their dataset (the
    same key answers the same credential), while a stranger who rebuilds the pipeline, with
    no key or another, gets another dataset: its job "train" is another job, it takes none of
    the victim's splits, and the victim reads every element once."""
    GATE.clear()
    await _install_async(c)
    plugin = s.plugins[PLUGIN_NAME]
    pipeline = dds.Dataset.range(N).map(gated)

    def register(key):
        with dask.config.set({KEY: key}):
            return dds.register_dataset(c, pipeline)

    mine = await asyncio.to_thread(register, "victims-shared-key")
    assert await asyncio.to_thread(register, "victims-shared-key") == mine  # a second trainer
    victim = await _victim_reads(c, plugin, mine)
    try:
        [victims_job] = plugin.state.list_jobs()
        theirs = [await asyncio.to_thread(register, key) for key in (None, "a-guess")]
        assert len({mine, *theirs}) == 3  # three datasets, three secrets
        assert len(plugin.state.list_datasets()) == 3
        for credential in theirs:
            reply = raise_for_status(await c.scheduler.dataservice_get_or_create_job(
                dataset_id=credential, processing_mode="DYNAMIC", job_name="train"), "job")
            assert reply["job_id"] != victims_job.job_id  # "train" of another dataset
            assert reply["job_token"] != victims_job.token
        with dask.config.set({KEY: ""}), pytest.raises(TypeError, match=KEY):
            dds.register_dataset(c, pipeline)
    finally:
        GATE.set()
    got = await asyncio.wait_for(victim, 30)
    assert sorted(got) == list(range(N))  # no loss, no duplicate
    assert [it.job_id for it in plugin.state.list_iterations()] == [victims_job.job_id]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_every_field_and_the_dispatchers_total_are_bounded(c, s, a):
    """Issue 22 item 2: each field of a registration and a job request is bounded, with a
    ``ServiceLimitError`` naming the limit; so are the datasets, live jobs and bytes the
    dispatcher holds. Before, 100 MiB each in element_spec, metadata and fingerprint, 20 MiB
    job names and 20,000 jobs were accepted (scheduler 83 -> 1,229 MB)."""
    with dask.config.set({"dataservice.dispatcher.max-name-length": 64,
                          "dataservice.dispatcher.max-field-bytes": "8 KiB",
                          "dataservice.dispatcher.max-pipeline-bytes": "64 KiB",
                          "dataservice.dispatcher.max-datasets": 3,
                          "dataservice.dispatcher.max-jobs": 4,
                          "dataservice.dispatcher.max-dataset-bytes": "100 KiB"}):
        await _install_async(c)
    plugin = s.plugins[PLUGIN_NAME]

    async def register(**fields):
        request = {"fingerprint": "f", "pipeline": b"p", "splits": b"", "num_splits": -1,
                   **fields}
        return await c.scheduler.dataservice_register_dataset(**request)

    def limited(reply, match):
        with pytest.raises(dds.ServiceLimitError, match=match):
            raise_for_status(reply, "request")

    big = "x" * 65
    limited(await register(fingerprint=big), "fingerprint has 65 characters.*max-name-length")
    limited(await register(dataset_id=big), "dataset_id has 65 characters.*max-name-length")
    limited(await register(element_spec=b"x" * 9000), "element_spec takes 8.79 kiB.*max-field-bytes")
    limited(await register(metadata={"k": "x" * 9000}), "metadata takes .*max-field-bytes")
    limited(await register(pipeline=b"x" * 70_000), "max-pipeline-bytes")
    assert plugin.state.list_datasets() == []  # nothing of the refused requests is kept
    # the total bytes: 60 kB + 60 kB would pass 100 KiB
    first = raise_for_status(await register(fingerprint="a", pipeline=b"x" * 60_000), "ok")
    limited(await register(fingerprint="b", pipeline=b"x" * 60_000),
            "holds 58.59 kiB of datasets; 58.59 kiB more would pass its limit of 100.00 kiB.*"
            "max-dataset-bytes")
    raise_for_status(await register(fingerprint="c"), "ok")
    raise_for_status(await register(fingerprint="d"), "ok")
    limited(await register(fingerprint="e"), "holds 3 datasets, the most it accepts.*max-datasets")
    # a known dataset is answered, not counted
    assert raise_for_status(await register(fingerprint="a", pipeline=b"x" * 60_000),
                            "ok")["dataset_id"] == first["dataset_id"]
    credential = first["dataset_id"]
    limited(await c.scheduler.dataservice_get_or_create_job(
        dataset_id=credential, processing_mode="OFF", job_name=big), "job_name has 65.*")
    for _ in range(4):
        raise_for_status(await c.scheduler.dataservice_get_or_create_job(
            dataset_id=credential, processing_mode="OFF"), "job")
    limited(await c.scheduler.dataservice_get_or_create_job(
        dataset_id=credential, processing_mode="OFF"),
        "holds 4 live jobs, the most it accepts .*max-jobs")
    assert len(plugin.state.list_jobs()) == 4


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_the_per_host_quota_is_not_reset_by_a_new_client(c, s, a):
    """Issue 22 item 2: new datasets are counted by the host the request comes from (its
    connection's peer address), not by the client id a client chooses: a second client, or a
    made-up ``client_id``, on the same host shares the allowance. Before, each new client id
    had an allowance of its own."""
    with dask.config.set({"dataservice.dispatcher.max-pipeline-bytes": "64 KiB",
                          "dataservice.dispatcher.max-datasets-per-host": 2}):
        await _install_async(c)

    def register(ds, client=c):
        return asyncio.to_thread(dds.register_dataset, client, ds)

    big = dds.Dataset.from_tensor_slices(np.arange(100_000))  # ~800 kB captured
    with pytest.raises(dds.ServiceLimitError, match="max-pipeline-bytes"):
        await register(big)
    first = await register(dds.Dataset.range(1))
    await register(dds.Dataset.range(2))
    assert await register(dds.Dataset.range(1)) == first  # the same dataset: not a new one
    with pytest.raises(dds.ServiceLimitError,
                       match="host 127.0.0.1 already registered 2 datasets.*max-datasets-per-host"):
        await register(dds.Dataset.range(3))
    reply = await c.scheduler.dataservice_register_dataset(
        fingerprint="new", pipeline=b"p", splits=b"", num_splits=-1, client_id="made-up")
    with pytest.raises(dds.ServiceLimitError, match="host 127.0.0.1 already registered 2"):
        raise_for_status(reply, "registration")
    async with Client(s.address, asynchronous=True, set_as_default=False) as other:
        with pytest.raises(dds.ServiceLimitError, match="host 127.0.0.1 already registered 2"):
            await asyncio.to_thread(dds.register_dataset, other, dds.Dataset.range(3))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_the_state_view_shows_a_stranger_counts_only(c, s, a):
    """``dataservice_state``: counts and worker addresses for anyone (issue 22: no names or
    ids); a dataset's jobs with its credential, a job's tasks and lost splits with its token
    (or a worker key), pipelines and tokens never."""
    await _install_async(c)
    plugin = s.plugins[PLUGIN_NAME]
    dataset_id = await asyncio.to_thread(dds.register_dataset, c, dds.Dataset.range(10))
    numeric = plugin.state.list_datasets()[0].dataset_id
    job = raise_for_status(await c.scheduler.dataservice_get_or_create_job(
        dataset_id=dataset_id, processing_mode="OFF"), "job")
    view = raise_for_status(await c.scheduler.dataservice_get_or_create_iteration(
        job_id=job["job_id"], job_token=job["job_token"]), "iteration")
    iteration_id = view["iteration_id"]
    await poll(lambda: plugin.state.tasks_for_iteration(iteration_id), what="a task")
    async with Client(s.address, asynchronous=True, set_as_default=False) as stranger:
        seen = raise_for_status(await stranger.scheduler.dataservice_state(), "state")
        assert {k: list(v) if isinstance(v, tuple) else v for k, v in seen.items()} == {
            "status": "OK", "num_datasets": 1, "num_jobs": 1, "num_iterations": 1,
            "workers": [a.address], "datasets": [], "jobs": {}, "iterations": {}}
        # with the dataset's credential: its jobs and their iterations' counts
        by_dataset = raise_for_status(await stranger.scheduler.dataservice_state(
            dataset_id=dataset_id), "state")
        assert list(by_dataset["datasets"]) == [numeric]
        assert by_dataset["jobs"] == {job["job_id"]: {"name": None, "dataset_id": numeric,
                                                      "mode": "OFF", "status": "live"}}
        it = by_dataset["iterations"][iteration_id]
        assert sum(it["num_tasks"].values()) == 1 and it["num_lost_splits"] == 0
        assert "tasks" not in it and "lost_splits" not in it
        for secret in (job["job_token"], "pipeline"):
            assert secret not in repr(by_dataset)
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
    def where(view):  # the task's status may have gone from active to finished meanwhile
        return [(t["task_id"], t["worker_address"]) for t in view["iterations"][iteration_id]["tasks"]]

    assert where(full) == where(mine) == [(task["task_id"], a.address)]
    raise_for_status(await c.scheduler.dataservice_release_iteration_client(
        iteration_client_id=view["iteration_client_id"], job_token=job["job_token"]), "release")


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_reader_is_told_when_another_consumer_joins_its_named_job(c, s, a):
    """Issue 22 item 2: a reader never loses elements silently to another holder of the
    credential. When a second consumer joins a named job, the first one's heartbeat says so
    (``consumers`` in its reply) and the reader logs a warning naming the job and the number
    of consumers; together they read every element once. Before, nothing told it."""
    from distributed.utils_test import captured_logger

    GATE.clear()
    await _install_async(c)
    plugin = s.plugins[PLUGIN_NAME]
    dataset_id = await asyncio.to_thread(dds.register_dataset, c,
                                         dds.Dataset.range(N).map(gated))
    with captured_logger("dask_dataservice.service.client._reader") as log:
        first = asyncio.create_task(read(dds.from_dataset_id("DYNAMIC", c, dataset_id,
                                                             job_name="train")))
        try:
            await poll(lambda: len(plugin.state.list_iteration_clients()) == 1,
                       what="the first consumer")
            second = asyncio.create_task(read(dds.from_dataset_id("DYNAMIC", c, dataset_id,
                                                                  job_name="train")))
            await poll(lambda: log.getvalue().count("2 consumers now read") >= 2,
                       what="both readers to say that two consumers share the job")
        finally:
            GATE.set()
        got = await asyncio.wait_for(asyncio.gather(first, second), 30)
    assert sorted(got[0] + got[1]) == list(range(N))  # each element once between them
    assert "of job 'train' (dataset 1000)" in log.getvalue()
    assert dataset_id.rpartition(":")[2] not in log.getvalue()  # the secret is never logged
