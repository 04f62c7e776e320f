"""The dispatcher plugin on a real scheduler, driven through its handlers.

These tests call the plugin's handlers directly (as a client's RPC would) on an in-process
``distributed.Scheduler``, so that what the dispatcher decides (and journals) can be checked
without the reader in between. Data workers are real in-process Dask workers with the
data-worker plugin the dispatcher installs.
"""

from __future__ import annotations

import contextlib
import logging

import cloudpickle
import pytest
from _helpers import poll  # noqa: E402
from distributed import Scheduler, Worker
from distributed.utils_test import captured_logger, gen_test

import dask_dataservice as dds
from dask_dataservice.service.dispatcher._credentials import credential
from dask_dataservice.service.dispatcher.journal import read_journal
from dask_dataservice.service.dispatcher.plugin import PLUGIN_NAME, DispatcherPlugin
from dask_dataservice.service.dispatcher.state import CreateJob, CreateTask, decode_update
from dask_dataservice.testing import assert_dispatcher_cleanup, gen_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]


def ok(reply: dict) -> dict:
    assert reply["status"] == "OK", reply
    return reply


async def _off_iteration(c, s):
    """Install the plugins, wait for the worker, and start an OFF iteration of range(3)."""
    from dask_dataservice.service.client import _install_async

    await _install_async(c)
    plugin = s.plugins[PLUGIN_NAME]
    await poll(lambda: plugin.state.list_workers(), what="the worker to register")
    dataset_id = await register(plugin, dds.Dataset.range(3))
    job_id = ok(await plugin.get_or_create_job(dataset_id=dataset_id,
                                               processing_mode="OFF"))["job_id"]
    view = ok(await plugin.get_or_create_iteration(
        job_id=job_id, job_token=plugin.state.job(job_id).token))
    return plugin, job_id, view


async def register(plugin, dataset) -> int:
    reply = await plugin.register_dataset(
        fingerprint=dataset.fingerprint(), pipeline=cloudpickle.dumps(dataset), splits=b"",
        num_splits=-1, metadata={"file_based": False, "cardinality": 10})
    return ok(reply)["dataset_id"]


@contextlib.asynccontextmanager
async def dispatcher(**kwargs):
    """A DispatcherPlugin started on a fresh in-process scheduler; closed at the end."""
    plugin = DispatcherPlugin(**kwargs)
    async with Scheduler(dashboard_address=":0", port=0) as s:
        s.add_plugin(plugin)
        await plugin.start(s)
        try:
            yield plugin, s
        finally:
            await plugin.close()


def tasks_on(plugin, iteration_id, address):
    return [t for t in plugin.state.tasks_for_iteration(iteration_id)
            if t.worker_address == address]


@gen_test(timeout=60)
async def test_restart_with_another_worker_list_keeps_the_journaled_shards():
    import tempfile

    work_dir = tempfile.mkdtemp()
    # 1. A DATA job over ["0", "1"]; only worker "0" is up, so shard 1 is still to run.
    async with dispatcher(fault_tolerant_mode=True, work_dir=work_dir,
                          worker_addresses=["0", "1"]) as (plugin, s):
        job_id = None
        async with Worker(s.address, nthreads=1, name="0") as w0:
            dataset_id = await register(plugin, dds.Dataset.range(10))
            job_id = ok(await plugin.get_or_create_job(
                dataset_id=dataset_id, processing_mode="DATA", job_name="static"))["job_id"]
            view = ok(await plugin.get_or_create_iteration(
                job_id=job_id, job_token=plugin.state.job(job_id).token))
            await poll(lambda: plugin.state.tasks_for_iteration(view["iteration_id"]),
                       what="a task for worker 0")
            task = plugin.state.tasks_for_iteration(view["iteration_id"])[0]
            assert (task.worker_address, task.shard_index) == (w0.address, 0)
    records = [decode_update(r) for r in read_journal(work_dir)]
    assert [r.worker_addresses for r in records if isinstance(r, CreateJob)] == [("0", "1")]
    assert [r.shard_index for r in records if isinstance(r, CreateTask)] == [0]

    # 2. Restart with the list swapped: the job keeps its journaled list, says so, and
    #    worker "1" gets shard 1 (the new config would have made it shard 0).
    with captured_logger("dask_dataservice.service.dispatcher.plugin",
                         level=logging.WARNING) as log:
        async with dispatcher(fault_tolerant_mode=True, work_dir=work_dir,
                              worker_addresses=["1", "0"]) as (plugin, s):
            assert "keeps the worker list it was created with, ['0', '1']" in log.getvalue()
            assert plugin.state.job(job_id).worker_addresses == ("0", "1")
            async with Worker(s.address, nthreads=1, name="1") as w1:
                await poll(lambda: tasks_on(plugin, view["iteration_id"], w1.address),
                           what="a task for worker 1")
                [task] = tasks_on(plugin, view["iteration_id"], w1.address)
                assert task.shard_index == 1
                assert plugin._task_def(task)["worker_index"] == 1
                assert plugin._task_def(task)["num_workers"] == 2
            # a new job uses the new list
            new_job = ok(await plugin.get_or_create_job(
                dataset_id=dataset_id, processing_mode="DATA"))["job_id"]
            assert plugin.state.job(new_job).worker_addresses == ("1", "0")
            plugin.state.validate_state()


@gen_test()
async def test_handlers_answer_errors_as_values():
    async with dispatcher() as (plugin, s):
        reply = await plugin.get_or_create_job(dataset_id=999, processing_mode="OFF")
        assert reply["status"] == "error"
        assert "no dataset has the id '999' with this secret" in reply["exception_text"]
        reply = plugin.get_dataset(dataset_id=999)
        assert reply["status"] == "error"
        await plugin.close()
        assert await plugin.get_split(iteration_id=1, task_id=1, repetition=0) == {
            "status": "closing"}
        assert s.plugins[PLUGIN_NAME] is plugin
        await assert_dispatcher_cleanup(s, timeout=1)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_installation_wires_every_handler(c, s, a):
    from dask_dataservice.service.client import _install_async

    await _install_async(c)
    plugin = s.plugins[PLUGIN_NAME]
    for op in ("register_dataset", "get_dataset", "get_or_create_job", "get_or_create_iteration",
               "client_heartbeat", "release_iteration_client", "get_split", "finish_task",
               "ack_splits", "worker_heartbeat"):
        assert s.handlers[f"dataservice_{op}"] == getattr(plugin, op)
    assert s.handlers["dataservice_state"] == plugin.state_summary
    assert s.extensions["dataservice"] is plugin
    assert "dataservice-gc" in s.periodic_callbacks
    # the data worker registers itself with its first heartbeat
    await poll(lambda: [w.address for w in plugin.state.list_workers()] == [a.address],
               what="the worker to register")


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_iteration_views_carry_task_infos(c, s, a):
    """The wire shape readers rely on: tasks are TaskInfo dicts (issue 10 finding 4)."""
    plugin, job_id, view = await _off_iteration(c, s)
    [task] = view["tasks"]
    assert task == {"task_id": task["task_id"], "worker_address": a.address,
                    "status": task["status"]}
    assert view["processing_mode"] == "OFF" and view["num_consumers"] is None
    ok(await plugin.release_iteration_client(iteration_client_id=view["iteration_client_id"],
                                             job_token=plugin.state.job(job_id).token))
    # an anonymous job is collected as soon as its last client leaves
    assert plugin.state.iteration(view["iteration_id"]).garbage_collected


@gen_cluster(client=True, nthreads=[])
async def test_cleanup_assert_sees_what_is_left(c, s):
    from dask_dataservice.service.client import _install_async

    await _install_async(c)
    plugin = s.plugins[PLUGIN_NAME]
    dataset_id = await register(plugin, dds.Dataset.range(3))
    job_id = ok(await plugin.get_or_create_job(dataset_id=dataset_id,
                                               processing_mode="OFF"))["job_id"]
    view = ok(await plugin.get_or_create_iteration(
                job_id=job_id, job_token=plugin.state.job(job_id).token))
    with pytest.raises(AssertionError, match=r"1 iteration client\(s\) still acquired.*"
                       r"iteration \d+ of an anonymous job is not collected"):
        await assert_dispatcher_cleanup(s, timeout=0.05)
    ok(await plugin.release_iteration_client(iteration_client_id=view["iteration_client_id"],
                                             job_token=plugin.state.job(job_id).token))
    await assert_dispatcher_cleanup(s, timeout=0.05)


# -- issue 9, section 2: tf.data service semantics ---------------------------------------------


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_job_names_are_scoped_per_dataset(c, s, a):
    """Two different datasets may each have a job named "shared_job" (TF, 2.1)."""
    from _helpers import distribute, read

    first = await distribute(dds.Dataset.range(5), "OFF", c, job_name="shared_job")
    second = await distribute(dds.Dataset.range(100, 103), "OFF", c, job_name="shared_job")
    assert sorted(await read(first)) == list(range(5))
    assert sorted(await read(second)) == [100, 101, 102]
    plugin = s.plugins[PLUGIN_NAME]
    jobs = [j for j in plugin.state.list_jobs() if j.job_name == "shared_job"]
    assert len({j.dataset_id for j in jobs}) == 2
    # the same dataset in another mode under that name is still refused
    dataset_id = credential(plugin.state.dataset(jobs[0].dataset_id))
    reply = await plugin.get_or_create_job(dataset_id=dataset_id, processing_mode="DYNAMIC",
                                           job_name="shared_job")
    assert reply["status"] == "error"
    assert "already exists with processing mode OFF" in reply["exception_text"]


@gen_test()
async def test_explicit_dataset_ids():
    """register_dataset(dataset_id="name") (TF, 2.2): the string names the dataset, and the
    answered id is ``"name:<secret>"`` (issue 22: the bare name is no credential). A name in
    use registers nothing new (issue 24, TF's rule): another pipeline of the same structure
    gets the name's id, one of another structure (cardinality) is an error naming the
    difference, and one under another registration key is refused."""
    async with dispatcher() as (plugin, s):

        async def register_as(dataset, name, **scope):
            return await plugin.register_dataset(
                fingerprint=dataset.fingerprint(), pipeline=cloudpickle.dumps(dataset),
                splits=b"", num_splits=-1,
                metadata={"cardinality": dataset.cardinality(), **scope}, dataset_id=name)

        train, other = dds.Dataset.range(10), dds.Dataset.range(20)
        train_id = ok(await register_as(train, "train"))["dataset_id"]
        assert train_id.startswith("train:")
        assert ok(await register_as(train, "train"))["dataset_id"] == train_id  # idempotent
        reply = await register_as(other, "train")
        assert reply["status"] == "error"
        assert ("'train' is registered for a dataset of another structure: cardinality 10 "
                "(registered) vs 20") in reply["exception_text"]
        same_shape = dds.Dataset.range(10).map(lambda x: -x)
        assert ok(await register_as(same_shape, "train"))["dataset_id"] == train_id
        reply = await register_as(train.map(abs), "train", name_scope="another key's tag")
        assert "'train' is already registered for a different dataset, under another " \
            "registration key" in reply["exception_text"]
        assert [d.dataset_name for d in plugin.state.list_datasets()] == ["train"]
        copy_id = ok(await register_as(train, "copy"))["dataset_id"]
        assert copy_id.startswith("copy:") and copy_id[5:] != train_id[6:]  # its own secret
        # readers name the dataset by its string id
        got = plugin.state.dataset_by_name("train")
        assert cloudpickle.loads(got.pipeline).fingerprint() == train.fingerprint()
        # only a data worker (showing the key the dispatcher streamed to it) may download it
        assert "only data workers may ask" in plugin.get_dataset(dataset_id="train")["exception_text"]
        job = ok(await plugin.get_or_create_job(dataset_id=train_id, processing_mode="OFF",
                                                job_name="j"))
        assert plugin.state.job(job["job_id"]).dataset_id == \
            plugin.state.dataset_by_name("train").dataset_id
        for bare in ("nope", "train", f"copy:{train_id[6:]}"):
            reply = await plugin.get_or_create_job(dataset_id=bare, processing_mode="OFF")
            assert f"no dataset has the id {bare.partition(':')[0]!r} with this secret" in \
                reply["exception_text"]
        plugin.state.validate_state()


@gen_test()
async def test_named_dynamic_jobs_are_kept_while_readable():
    """2.4: an idle named DYNAMIC iteration is not collected while it can be read (TF keeps
    it: data_service_ops_test.testDontGcJobsWithVisitationGuarantees); other named iterations
    are collected after job-gc-timeout, and so is a DYNAMIC one a consumer read to its end.
    Its task finishing is not enough: the elements may still wait in the worker's buffer."""
    from dask_dataservice.service.dispatcher.state import FinishTask, RegisterWorker

    async with dispatcher(job_gc_timeout=0.0, gc_interval=3600) as (plugin, s):
        ds = dds.Dataset.range(10)
        reply = await plugin.register_dataset(
            fingerprint=ds.fingerprint(), pipeline=cloudpickle.dumps(ds),
            splits=cloudpickle.dumps(ds.splits()), num_splits=len(ds.splits()),
            metadata={"cardinality": 10})
        dataset_id = ok(reply)["dataset_id"]
        views = {}
        for mode in ("DYNAMIC", "OFF"):
            job_id = ok(await plugin.get_or_create_job(
                dataset_id=dataset_id, processing_mode=mode, job_name=f"named-{mode}"))["job_id"]
            views[mode] = ok(await plugin.get_or_create_iteration(
                job_id=job_id, job_token=plugin.state.job(job_id).token))
            ok(await plugin.release_iteration_client(
                iteration_client_id=views[mode]["iteration_client_id"],
                job_token=plugin.state.job(job_id).token))
        plugin._gc()  # the timeout (0 s) has passed for both
        dynamic = views["DYNAMIC"]["iteration_id"]
        assert not plugin.state.iteration(dynamic).garbage_collected
        assert plugin.state.iteration(views["OFF"]["iteration_id"]).garbage_collected
        plugin._apply(RegisterWorker(address="tcp://fake:1", host="fake", nthreads=1))
        task_id = plugin.state.next_task_id()
        plugin._apply(CreateTask(task_id=task_id, iteration_id=dynamic,
                                 worker_address="tcp://fake:1"))
        plugin._gc()
        assert not plugin.state.iteration(dynamic).garbage_collected  # still running
        # its task finished producing: its elements may still be buffered, unread
        plugin._apply(FinishTask(task_id=task_id))
        plugin._gc()
        assert not plugin.state.iteration(dynamic).garbage_collected
        # once a consumer read it to its end, the idle DYNAMIC iteration goes too
        job_id = plugin.state.iteration(dynamic).job_id
        token = plugin.state.job(job_id).token
        again = ok(await plugin.get_or_create_iteration(job_id=job_id, job_token=token))
        assert again["iteration_id"] == dynamic
        ok(await plugin.release_iteration_client(
            iteration_client_id=again["iteration_client_id"], job_token=token,
            read_to_end=True))
        assert plugin.state.iteration(dynamic).read_to_end
        plugin._gc()
        assert plugin.state.iteration(dynamic).garbage_collected


@gen_test()
async def test_coordinated_reads_refuse_only_a_known_finite_cardinality():
    """2.9: TF refuses a known finite cardinality only (a flat_map's is unknown)."""
    from dask_dataservice.data._base import INFINITE, UNKNOWN

    async with dispatcher() as (plugin, s):
        results = {}
        for name, cardinality in (("finite", 10), ("unknown", UNKNOWN), ("infinite", INFINITE)):
            ds = dds.Dataset.range(10).map(lambda x, n=name: x)
            dataset_id = ok(await plugin.register_dataset(
                fingerprint=name, pipeline=cloudpickle.dumps(ds), splits=b"", num_splits=-1,
                metadata={"cardinality": cardinality}))["dataset_id"]
            results[name] = await plugin.get_or_create_job(
                dataset_id=dataset_id, processing_mode="OFF", job_name=f"c-{name}",
                num_consumers=2)
        assert results["unknown"]["status"] == results["infinite"]["status"] == "OK"
        assert results["finite"]["status"] == "error"
        assert "coordinated reads need an infinite dataset" in results["finite"]["exception_text"]
        assert "has cardinality 10" in results["finite"]["exception_text"]


@gen_test()
async def test_target_workers_validations():
    """2.10: coordinated + LOCAL, static + ANY, and consumers of one job that disagree."""
    from dask_dataservice.data._base import INFINITE

    async with dispatcher(worker_addresses=["0"]) as (plugin, s):
        ds = dds.Dataset.range(10)
        dataset_id = ok(await plugin.register_dataset(
            fingerprint="endless", pipeline=cloudpickle.dumps(ds), splits=b"", num_splits=-1,
            metadata={"cardinality": INFINITE}))["dataset_id"]

        async def job(**kwargs):
            return await plugin.get_or_create_job(dataset_id=dataset_id, **kwargs)

        reply = await job(processing_mode="OFF", job_name="c", num_consumers=2,
                          target_workers="LOCAL")
        assert "coordinated reads" in reply["exception_text"] and "not 'LOCAL'" in reply["exception_text"]
        reply = await job(processing_mode="DATA", target_workers="ANY")
        assert "static sharding (DATA)" in reply["exception_text"]
        assert "'ANY' is not allowed" in reply["exception_text"]
        ok(await job(processing_mode="DATA", target_workers="local"))  # case-insensitive
        ok(await job(processing_mode="OFF", job_name="shared", target_workers="LOCAL"))
        ok(await job(processing_mode="OFF", job_name="shared", target_workers="local"))
        reply = await job(processing_mode="OFF", job_name="shared", target_workers="ANY")
        assert "is read with target_workers='LOCAL'" in reply["exception_text"]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_huge_range_registers_in_constant_time_and_reads_dynamically(c, s, a):
    """2.7: Dataset.range(2**55) (TF's endless idiom) registers at once: its splits are
    computed on demand (IndexRanges), and the dispatcher only journals a cursor."""
    import asyncio
    import itertools

    from _helpers import distribute

    ds = dds.Dataset.range(2**55)
    assert len(cloudpickle.dumps(ds.splits())) < 200  # two numbers, not 2**39 splits
    distributed_ds = await asyncio.wait_for(distribute(ds, "DYNAMIC", c), 30)

    def first(n):
        it = iter(distributed_ds)
        try:
            return list(itertools.islice(it, n))
        finally:
            it.close()

    out = await asyncio.wait_for(asyncio.to_thread(first, 100), 30)
    assert out == list(range(100))  # one worker: the first split, in order
    plugin = s.plugins[PLUGIN_NAME]
    [dataset] = plugin.state.list_datasets()
    assert dataset.num_splits == 2**55 // 65_536


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_worker_joining_mid_read_serves_a_finished_off_iteration(c, s, a):
    """2.6 (dispatcher side): a task finishes when its elements were *produced*; a worker
    that joins (or is restarted) while consumers still read an OFF iteration gets a task
    and serves a full repetition, as in TensorFlow. Before, it got none."""
    plugin, job_id, view = await _off_iteration(c, s)
    iteration_id = view["iteration_id"]
    # worker a produced its 3 elements (they wait in its buffer: nobody read them yet)
    await poll(lambda: plugin.state.iteration(iteration_id).status == "finished",
               what="the first task to finish producing")
    async with Worker(s.address, nthreads=1) as late:
        await poll(lambda: tasks_on(plugin, iteration_id, late.address),
                   what="a task for the worker that joined mid-read")
        heartbeat = ok(plugin.client_heartbeat(
            iteration_client_id=view["iteration_client_id"],
            job_token=plugin.state.job(job_id).token))
        assert {t["worker_address"] for t in heartbeat["tasks"]} == {a.address, late.address}
        ok(await plugin.release_iteration_client(
            iteration_client_id=view["iteration_client_id"],
            job_token=plugin.state.job(job_id).token))
    assert plugin.state.iteration(iteration_id).garbage_collected


@pytest.mark.parametrize("snapshot_records", [10_000, 1])
@gen_test(timeout=60)
async def test_dataset_credentials_survive_a_restart(tmp_path, snapshot_records):
    """Issue 22: a dataset's secret is journaled with it (``RegisterDataset.secret``; with
    ``snapshot_records=1`` the restart reads it from a snapshot): after a restart the same
    credential reads the dataset and registering the pipeline again answers it; the bare id
    and name still name nothing; the counts the limits bound are recounted."""
    import dask

    work_dir = str(tmp_path / "journal")
    with dask.config.set({"dataservice.dispatcher.snapshot-records": snapshot_records}):
        async with dispatcher(fault_tolerant_mode=True, work_dir=work_dir) as (plugin, s):
            anonymous = ok(await plugin.register_dataset(
                fingerprint="f", pipeline=b"p", splits=b"", num_splits=-1))["dataset_id"]
            named = ok(await plugin.register_dataset(
                fingerprint="g", pipeline=b"q", splits=b"", num_splits=-1,
                dataset_id="train"))["dataset_id"]
        for round_ in range(2):
            async with dispatcher(fault_tolerant_mode=True, work_dir=work_dir) as (plugin, s):
                assert (plugin._core.quotas.datasets, plugin._core.quotas.live_jobs) == \
                    (2, 2 * round_)
                assert ok(await plugin.register_dataset(
                    fingerprint="f", pipeline=b"p", splits=b"", num_splits=-1))["dataset_id"] \
                    == anonymous
                assert ok(await plugin.register_dataset(
                    fingerprint="g", pipeline=b"q", splits=b"", num_splits=-1,
                    dataset_id="train"))["dataset_id"] == named
                for held in (anonymous, named):
                    ok(await plugin.get_or_create_job(dataset_id=held, processing_mode="OFF"))
                for bare in (anonymous.partition(":")[0], "train"):
                    reply = await plugin.get_or_create_job(dataset_id=bare, processing_mode="OFF")
                    assert reply["status"] == "error"
                    assert "with this secret" in reply["exception_text"]
