"""What an unused registration holds is freed (issue 22, item 2).

A dataset without a job for ``dispatcher.dataset-gc-timeout`` is collected
(``GarbageCollectDataset``: its bytes go, its id stays as a tombstone and is never reused),
and a job that never got an iteration is collected after ``job-gc-timeout``
(``GarbageCollectJob``: its quota slot is free). The core tests drive
:class:`DispatcherCore` on a fake clock (``gc_tick(now)``); the journal tests restart a
fault-tolerant dispatcher on real files; one test runs a real in-process cluster.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgpack
import pytest
from _helpers import ft_dispatcher, ok, poll, read
from distributed.utils_test import gen_cluster, gen_test

import dask_dataservice as dds
from dask_dataservice.errors import DataServiceError, DatasetNotFoundError, ServiceLimitError
from dask_dataservice.service.dispatcher._journal_format import JournalRecord
from dask_dataservice.service.dispatcher._quotas import Limits
from dask_dataservice.service.dispatcher._state_codec import (
    compact,
    decode_state,
    encode_state,
)
from dask_dataservice.service.dispatcher.core import CoreConfig, DispatcherCore, WorkerInfo
from dask_dataservice.service.dispatcher.state import (
    GarbageCollectDataset,
    GarbageCollectIteration,
    GarbageCollectJob,
    ReleaseIterationClient,
    Update,
    encode_update,
    replay,
)

pytestmark = pytest.mark.timeout(120)

PIPELINE = b"pickled-pipeline" * 64  # 1 KiB
SPLITS = b"splits" * 10
#: The bytes a registration of PIPELINE, SPLITS and METADATA holds (_quotas.dataset_size).
METADATA = {"cardinality": 4}
SIZE = len(PIPELINE) + len(SPLITS) + len(msgpack.packb(METADATA, use_bin_type=True))


class Cluster:
    """The core's ClusterView: a plain dict of workers."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerInfo] = {}

    def add(self, address: str) -> WorkerInfo:
        self.workers[address] = info = WorkerInfo(address=address, host="h", name=address)
        return info

    def worker(self, address: str) -> WorkerInfo | None:
        return self.workers.get(address)

    def holders(self, key: Any) -> list[str]:
        return []


class Recorder:
    """A core started at ``now``, and every record its stimuli applied (its journal)."""

    def __init__(self, now: float = 100.0, records: list[Update] | None = None,
                 **config: Any) -> None:
        config = {"dataset_gc_timeout": 100.0, "job_gc_timeout": 5.0, "client_timeout": 1.0,
                  **config}
        self.cluster = Cluster()
        self.secrets = iter(f"secret-{now:g}-{i}" for i in range(1000))
        self.core = DispatcherCore(CoreConfig(**config), self.cluster, now, lineage="L",
                                   new_token=lambda: next(self.secrets), view_nonce="n")
        self.records: list[Update] = list(records or [])
        if records:
            self.core.restore(replay(records))

    def __call__(self, stimulus: Any, *args: Any, **kwargs: Any) -> Any:
        out = stimulus(*args, **kwargs)
        self.records += out.updates
        self.core.state.validate_state()
        return out.reply

    def register(self, fingerprint: str = "fp", now: float = 100.0, **kwargs: Any) -> str:
        return self(self.core.register_dataset, fingerprint, PIPELINE, SPLITS, 4,
                    metadata=METADATA, now=now, **kwargs)["dataset_id"]

    def job(self, credential: str, mode: str = "OFF", now: float = 100.0,
            **kwargs: Any) -> dict[str, Any]:
        return self(self.core.get_or_create_job, credential, mode, now=now, **kwargs)

    def read(self, credential: str, mode: str = "OFF", now: float = 100.0,
             **kwargs: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        job = self.job(credential, mode, now, **kwargs)
        view = self(self.core.get_or_create_iteration, job["job_id"], now,
                    job_token=job["job_token"])
        return job, view

    def release(self, job: dict[str, Any], view: dict[str, Any], now: float) -> None:
        self(self.core.release_iteration_client, view["iteration_client_id"], now,
             job_token=job["job_token"])

    def tick(self, now: float) -> list[Update]:
        out = self.core.gc_tick(now)
        self.records += out.updates
        self.core.state.validate_state()
        return out.updates


def number(credential: str) -> int:
    return int(credential.partition(":")[0])


def collected_message(dataset_id: int, timeout: str) -> str:
    return (f"dataset {dataset_id} was garbage collected after being unused (no job) for "
            f"dataservice.dispatcher.dataset-gc-timeout ({timeout}): register the pipeline "
            "again (register_dataset) and read it by the new id")


def no_iteration_message(job_id: int, timeout: str) -> str:
    return (f"job {job_id} was garbage collected: it had no iteration for "
            f"dataservice.dispatcher.job-gc-timeout ({timeout}); create the job again")


# Datasets
##########
@pytest.mark.pure
def test_a_dataset_without_jobs_is_collected_exactly_at_the_timeout_and_its_bytes_go():
    r = Recorder()
    credential = r.register(now=100.0)
    quotas = r.core.quotas
    assert (quotas.datasets, quotas.bytes) == (1, SIZE)
    assert r.tick(150.0) == []
    assert r.tick(199.999) == []  # 99.999 s idle: kept
    assert r.tick(200.0) == [GarbageCollectDataset(dataset_id=1000)]
    assert (quotas.datasets, quotas.bytes) == (0, 0)
    state = r.core.state
    assert state.list_datasets() == [] and state.dataset_collected(1000)
    snapshot = state.snapshot()
    assert (snapshot["datasets"], snapshot["dataset_by_fingerprint"],
            snapshot["collected_datasets"]) == ({}, {}, [1000])
    assert PIPELINE not in encode_state(state)  # nor in what a snapshot would keep
    assert r.tick(10_000.0) == []  # collected once
    assert credential == "1000:secret-100-0"


@pytest.mark.pure
def test_a_dataset_with_a_live_job_or_iteration_is_never_collected():
    """An anonymous job read by a live consumer, and a named DYNAMIC job its consumer left
    unfinished (kept while it can be read, as in TensorFlow), keep their datasets."""
    r = Recorder(client_timeout=1e9)
    reading = r.register("reading")
    unfinished = r.register("unfinished")
    r.read(reading)
    job, view = r.read(unfinished, "DYNAMIC", job_name="kept")
    r.release(job, view, 101.0)
    for now in (200.0, 1_000.0, 100_000.0):
        assert r.tick(now) == []
    assert [d.dataset_id for d in r.core.state.list_datasets()] == [1000, 1001]
    assert r.core.quotas.datasets == 2


@pytest.mark.pure
def test_a_dataset_that_was_read_is_kept_after_its_jobs_are_gone():
    """Only a registration nobody ever read is freed. A dataset some job of which got an
    iteration is kept for the dispatcher's life, as TensorFlow keeps every dataset: a
    ``distribute()``d dataset read again hours later (a notebook after lunch, an evaluation
    pass) is still there, also after a restart (collected jobs and iterations stay in the
    state, so "was read" is rebuilt from it)."""
    r = Recorder()
    credential = r.register(now=100.0)
    job, view = r.read(credential, now=150.0)
    r.release(job, view, 180.0)  # an anonymous job: collected with its consumer
    assert [type(u) for u in r.records[-2:]] == [ReleaseIterationClient,
                                                 GarbageCollectIteration]
    assert r.core.quotas.live_jobs == 0
    for now in (280.0, 10_000.0, 1e7):
        assert r.tick(now) == []
    restarted = Recorder(now=2e7, records=[*r.records])
    assert restarted.tick(2e7 + 1e6) == []
    assert [d.dataset_id for d in restarted.core.state.list_datasets()] == [1000]
    again, _ = restarted.read(credential, now=2e7 + 1e6)  # read again, by the same id
    assert restarted.core.state.job(again["job_id"]).dataset_id == 1000


@pytest.mark.pure
def test_reading_a_collected_dataset_says_so_and_registering_again_gets_a_new_id():
    r = Recorder()
    credential = r.register(now=100.0)
    named = r.register(now=100.0, dataset_id="train")
    assert r.tick(200.0) == [GarbageCollectDataset(1000), GarbageCollectDataset(1001)]
    for given in (credential, "1000", 1000):
        with pytest.raises(DatasetNotFoundError) as info:
            r.job(given, now=201.0)
        assert str(info.value) == collected_message(1000, "100s")
    with pytest.raises(DatasetNotFoundError) as info:
        r.job("1000:wrong-secret", now=201.0)  # the id is known collected: said so too
    assert str(info.value) == collected_message(1000, "100s")
    with pytest.raises(DatasetNotFoundError) as info:
        r.job(named, now=201.0)  # a name is freed with its dataset, not remembered
    assert str(info.value).startswith("no dataset has the id 'train' with this secret")
    assert r.core.take_effects().updates == []
    again = r.register(now=300.0)
    assert (number(again), again) == (1002, "1002:secret-100-2")
    assert again != credential
    assert r.register(now=300.0) == again  # deduplicated by fingerprint again
    assert r.register(now=300.0, dataset_id="train") == "train:secret-100-3"
    job, view = r.read(again, now=301.0)
    assert r.core.state.job(job["job_id"]).dataset_id == 1002
    assert r.core.quotas.datasets == 2


@pytest.mark.pure
def test_without_a_time_the_timer_starts_at_the_next_tick():
    """A caller that gives no ``now`` (tests, tools): the next GC tick stamps the idle
    dataset and job with its own time, so neither is ever collected early."""
    r = Recorder()
    credential = r(r.core.register_dataset, "fp", PIPELINE, SPLITS, 4)["dataset_id"]
    r(r.core.get_or_create_job, r(r.core.register_dataset, "other", b"p", b"s", 1)[
        "dataset_id"], "OFF")
    assert r.tick(400.0) == []  # stamps both: idle from 400 on
    assert r.tick(404.999) == []
    assert r.tick(405.0) == [GarbageCollectJob(5000)]
    assert r.tick(499.999) == []
    assert r.tick(500.0) == [GarbageCollectDataset(number(credential))]
    assert r.tick(504.999) == []
    assert r.tick(505.0) == [GarbageCollectDataset(1001)]  # idle since its job went at 405


@pytest.mark.pure
def test_no_dataset_is_collected_when_the_timeout_is_none():
    r = Recorder(dataset_gc_timeout=None)
    r.register(now=100.0)
    assert r.tick(1e9) == []
    assert r.core.quotas.datasets == 1


# Jobs without iterations
#########################
@pytest.mark.pure
def test_a_job_without_an_iteration_is_collected_after_job_gc_timeout_freeing_its_slot():
    r = Recorder(limits=Limits(max_jobs=1))
    credential = r.register(now=100.0)
    job = r.job(credential, now=100.0, job_name="never-read")
    assert r.core.quotas.live_jobs == 1
    with pytest.raises(ServiceLimitError, match="holds 1 live jobs, the most it accepts"):
        r.job(credential, now=101.0)
    assert r.tick(104.999) == []
    assert r.tick(105.0) == [GarbageCollectJob(job_id=5000)]
    assert r.core.quotas.live_jobs == 0
    assert r.core.state.job(5000).status == "garbage_collected"
    with pytest.raises(DataServiceError) as info:
        r(r.core.get_or_create_iteration, job["job_id"], 106.0, job_token=job["job_token"])
    assert str(info.value) == no_iteration_message(5000, "5s")
    assert r.core.take_effects().updates == []
    # the slot and the name are free: the same name makes a new job
    again = r.job(credential, now=106.0, job_name="never-read")
    assert (again["job_id"], r.core.quotas.live_jobs) == (5001, 1)


@pytest.mark.pure
def test_a_job_collected_without_iteration_starts_its_datasets_timer():
    r = Recorder()
    credential = r.register(now=100.0)
    r.job(credential, now=150.0)
    assert r.tick(155.0) == [GarbageCollectJob(job_id=5000)]
    assert r.tick(254.999) == []
    assert r.tick(255.0) == [GarbageCollectDataset(dataset_id=1000)]


@pytest.mark.pure
def test_a_job_without_an_iteration_is_kept_for_at_least_the_client_timeout():
    """The consumer that creates a job asks for its iteration right after (``start_read``);
    a tiny job-gc-timeout (tests use 20 ms) must not collect the job in between."""
    r = Recorder(job_gc_timeout=0.02, client_timeout=30.0)
    job = r.job(r.register(now=100.0), now=100.0)
    assert r.tick(100.5) == []
    assert r.tick(129.999) == []
    assert r.tick(130.0) == [GarbageCollectJob(job_id=job["job_id"])]


@pytest.mark.pure
def test_a_job_with_an_iteration_is_left_to_the_iteration_gc():
    r = Recorder(client_timeout=100.0)
    credential = r.register(now=100.0)
    job, view = r.read(credential, now=100.0, job_name="read")
    assert r.tick(110.0) == []  # its consumer is alive (released later)
    r.release(job, view, 111.0)
    assert r.tick(116.0) == [GarbageCollectIteration(iteration_id=view["iteration_id"])]
    assert not any(isinstance(u, GarbageCollectJob) for u in r.records)


# Restarts
##########
def history() -> Recorder:
    """Before the restart: dataset 1000 collected, 1001 idle since 150, 1002 read by a
    job (5000) that never got an iteration, 1003 by a named DYNAMIC job (5001) its consumer
    left unfinished (kept while it can be read)."""
    r = Recorder()
    r.register("collected", now=100.0)
    assert r.tick(200.0) == [GarbageCollectDataset(1000)]
    r.register("idle", now=150.0)
    r.job(r.register("job-only", now=200.0), now=200.0)
    job, view = r.read(r.register("read", now=200.0), "DYNAMIC", now=200.0, job_name="kept")
    r.release(job, view, 201.0)
    assert r.core.state.next_dataset_id() == 1004
    return r


def check_after_restart(r: Recorder) -> None:
    """A core restored at 500: tombstones kept, ids not reused, every timer from 500."""
    core = r.core
    assert core.state.dataset_collected(1000)
    assert [d.dataset_id for d in core.state.list_datasets()] == [1001, 1002, 1003]
    assert (core.quotas.datasets, core.quotas.bytes, core.quotas.live_jobs) == (3, 3 * SIZE, 2)
    with pytest.raises(DatasetNotFoundError) as info:
        r.job("1000:secret-100-0", now=500.0)
    assert str(info.value) == collected_message(1000, "100s")
    assert r.tick(504.999) == []
    assert r.tick(505.0) == [GarbageCollectJob(5000)]  # 1002's, 5 s after the restart
    assert core.quotas.live_jobs == 1
    assert r.tick(599.999) == []  # 1001 idle since 150 before the restart: kept until 600
    assert r.tick(600.0) == [GarbageCollectDataset(1001)]
    assert r.tick(604.999) == []  # 1002 idle since its job went at 505
    assert r.tick(605.0) == [GarbageCollectDataset(1002)]
    assert (core.quotas.datasets, core.quotas.bytes) == (1, SIZE)
    again = r.register("collected", now=606.0)
    assert number(again) == 1004  # a new id, never one of before
    assert again == "1004:secret-500-0"


@pytest.mark.pure
def test_collection_survives_a_restart_from_the_journal():
    before = history()
    records = [*before.records]
    restarted = Recorder(now=500.0, records=records)
    assert restarted.core.state == before.core.state
    check_after_restart(restarted)


@pytest.mark.pure
def test_collection_survives_a_snapshot_and_its_compaction():
    """The state folded into a snapshot (the journal's compaction) and restored from it."""
    before = history()
    rows = [JournalRecord(Path("journal_00000000"), i, encode_update(u))
            for i, u in enumerate(before.records)]
    state = decode_state(compact(None, rows))
    state.validate_state()
    assert state == before.core.state
    restarted = Recorder(now=500.0)
    restarted.core.restore(state)
    check_after_restart(restarted)
    # compacted again, after more collections: the tombstones are all kept
    folded = decode_state(encode_state(restarted.core.state))
    assert folded == restarted.core.state
    assert [i for i in (1000, 1001, 1002) if folded.dataset_collected(i)] == [1000, 1001, 1002]
    assert folded.next_dataset_id() == 1005


@pytest.mark.pure
def test_a_snapshot_written_before_tombstones_existed_still_reads():
    state = Recorder().core.state
    payload = msgpack.unpackb(encode_state(state), raw=False, strict_map_key=False)
    del payload["collected_datasets"]
    old = decode_state(msgpack.packb(payload, use_bin_type=True))
    assert old == state and old.num_collected_datasets() == 0


# A fault-tolerant dispatcher on real files
###########################################
@pytest.mark.cluster
@gen_test(timeout=90)
async def test_collection_survives_restarts_of_a_fault_tolerant_dispatcher(tmp_path):
    tiny = {"dataset-gc-timeout": "100ms", "job-gc-timeout": "50ms", "client-timeout": "50ms",
            "gc-interval": "20ms", "snapshot-records": 0, "snapshot-bytes": 0}
    async with ft_dispatcher(tmp_path, **tiny) as plugin:
        collected = ok(await plugin.register_dataset(
            fingerprint="a", pipeline=PIPELINE, splits=SPLITS, num_splits=4,
            metadata=METADATA))["dataset_id"]
        job_only = ok(await plugin.register_dataset(
            fingerprint="b", pipeline=PIPELINE, splits=SPLITS, num_splits=4,
            metadata=METADATA))["dataset_id"]
        job = ok(await plugin.get_or_create_job(dataset_id=job_only, processing_mode="OFF",
                                                job_name="never-read"))
        state = plugin.state
        await poll(lambda: state.dataset_collected(1000) and state.dataset_collected(1001),
                   what="both datasets collected")
        assert state.job(job["job_id"]).status == "garbage_collected"
        assert plugin.core.quotas.live_jobs == plugin.core.quotas.datasets == 0
    hour = {"dataset-gc-timeout": "1 hour", "snapshot-records": 0, "snapshot-bytes": 0}
    async with ft_dispatcher(tmp_path, **hour) as plugin:  # replayed from the journal
        assert plugin.recovered_updates > 0
        assert (plugin.state.num_collected_datasets(), plugin.state.list_datasets()) == (2, [])
        reply = await plugin.get_or_create_job(dataset_id=collected, processing_mode="OFF")
        assert reply["status"] == "error"
        assert collected_message(1000, "3600s") in reply["exception_text"]
        reply = await plugin.get_or_create_iteration(job_id=job["job_id"],
                                                     job_token=job["job_token"])
        assert reply["status"] == "error"
        assert "job 5000 was garbage collected: it had no iteration" in reply["exception_text"]
        again = ok(await plugin.register_dataset(
            fingerprint="a", pipeline=PIPELINE, splits=SPLITS, num_splits=4,
            metadata=METADATA))["dataset_id"]
        assert number(again) == 1002 and again != collected
    # a restart that folds what it replayed into a snapshot (more than snapshot-records)
    async with ft_dispatcher(tmp_path, **{**hour, "snapshot-records": 2}) as plugin:
        await asyncio.wrap_future(plugin._journal._compaction)
    async with ft_dispatcher(tmp_path, **hour) as plugin:  # the snapshot alone
        assert plugin.recovered_updates == 0
        state = plugin.state
        assert [state.dataset_collected(i) for i in (1000, 1001, 1002)] == [True, True, False]
        assert plugin.core.quotas.datasets == 1
        reply = await plugin.get_or_create_job(dataset_id=collected, processing_mode="OFF")
        assert collected_message(1000, "3600s") in reply["exception_text"]
        new = ok(await plugin.register_dataset(fingerprint="c", pipeline=b"p", splits=b"s",
                                               num_splits=1))["dataset_id"]
        assert number(new) == 1003


# End to end
############
@pytest.mark.cluster
@gen_cluster(client=True, config={"dataservice.dispatcher.dataset-gc-timeout": "200ms",
                                  "dataservice.dispatcher.gc-interval": "20ms"})
async def test_an_unused_registration_is_freed_on_a_real_cluster(c, s, a, b):
    """A client registers a dataset and never reads it: the scheduler lets go of its
    pipeline, and a later read by the old id says what happened."""
    ds = dds.Dataset.range(100).map(lambda x: x + 1)
    dataset_id = await asyncio.to_thread(dds.register_dataset, c, ds)
    plugin = s.extensions["dataservice"]
    key = int(dataset_id.partition(":")[0])
    assert plugin.core.quotas.datasets == 1 and plugin.core.quotas.bytes > 0
    await poll(lambda: plugin.state.dataset_collected(key), timeout=20,
               what="the dataset collected")
    assert plugin.state.list_datasets() == []
    assert plugin.core.quotas.datasets == plugin.core.quotas.bytes == 0
    assert not plugin.state.snapshot()["datasets"]
    with pytest.raises(DatasetNotFoundError) as info:
        await read(dds.from_dataset_id("parallel_epochs", c, dataset_id))
    assert collected_message(key, "0.2s") in str(info.value)
    again = await asyncio.to_thread(dds.register_dataset, c, ds)
    assert int(again.partition(":")[0]) == key + 1
    assert sorted(await read(dds.from_dataset_id("parallel_epochs", c, again))) == \
        sorted(list(range(1, 101)) * 2)  # OFF: each of the two workers reads it all


# Published Dask data
#####################
def register_publishing(r: Recorder, fingerprint: str, names: list[str],
                        now: float = 100.0) -> str:
    return r(r.core.register_dataset, fingerprint, PIPELINE, SPLITS, 4,
             metadata={**METADATA, "published": names}, now=now)["dataset_id"]


@pytest.mark.pure
def test_a_published_name_is_freed_with_the_last_live_dataset_using_it():
    r = Recorder(dataset_gc_timeout=10.0)
    core = r.core
    a = register_publishing(r, "a", ["dask-dataservice-shared", "dask-dataservice-a"])
    plain = r.register("plain")  # lists no name (as registrations of older versions)
    b = register_publishing(r, "b", ["dask-dataservice-shared"], now=105.0)
    assert core.published.users("dask-dataservice-shared") == {number(a), number(b)}
    assert r.tick(110.0) == [GarbageCollectDataset(number(a)),
                             GarbageCollectDataset(number(plain))]
    assert core.published.take() == ["dask-dataservice-a"]  # the other still uses "shared"
    assert core.published.take() == []  # taken once
    # a restart (the journal replayed) counts the live datasets only: a collection replayed
    # names nothing to unpublish again
    restarted = Recorder(now=112.0, records=list(r.records), dataset_gc_timeout=10.0)
    assert restarted.core.published.users("dask-dataservice-shared") == {number(b)}
    assert restarted.core.published.users("dask-dataservice-a") == frozenset()
    assert restarted.core.published.take() == []
    assert restarted.tick(122.0) == [GarbageCollectDataset(number(b))]
    assert restarted.core.published.take() == ["dask-dataservice-shared"]
    # registering the pipeline again (a new dataset) counts it from then on
    again = register_publishing(restarted, "a", ["dask-dataservice-a"], now=123.0)
    assert restarted.core.published.users("dask-dataservice-a") == {number(again)}


@pytest.mark.pure
def test_a_read_dataset_keeps_its_published_names():
    r = Recorder(dataset_gc_timeout=10.0)
    kept = register_publishing(r, "kept", ["dask-dataservice-x"])
    job, view = r.read(kept)
    r.release(job, view, 101.0)
    r.tick(200.0)
    assert not r.core.state.dataset_collected(number(kept))
    assert r.core.published.take() == []
