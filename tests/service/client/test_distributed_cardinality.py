"""``cardinality()`` and ``len()`` of ``distribute``d datasets (docs/data-service.md,
"Cardinality"): known where one pass is determined, else UNKNOWN with ``len()`` saying why."""

from __future__ import annotations

import asyncio

import pytest
from _helpers import distribute, read

import dask_dataservice as dds
from dask_dataservice import Dataset
from dask_dataservice.service.client._cardinality import count_preserving, service_cardinality
from dask_dataservice.service.client._connection import _install_async
from dask_dataservice.service.protocol._sharding import ShardingPolicy
from dask_dataservice.testing import gen_cluster

TWO = [("127.0.0.1", 1), ("127.0.0.1", 1)]


def unknown_length(ds) -> str:
    with pytest.raises(TypeError) as info:
        len(ds)
    assert ds.cardinality() == dds.UNKNOWN
    return str(info.value)


@pytest.mark.cluster
@pytest.mark.timeout(60)
@gen_cluster(client=True, nthreads=TWO,
             config={"dataservice.dispatcher.worker-addresses": ["0", "1"]})
async def test_cardinality_is_known_where_a_pass_is_determined(c, s, a, b):
    source = Dataset.range(100).map(lambda x: x + 1).shuffle(8)
    for mode in ("DYNAMIC", "DATA"):  # a private job: every element once, in all
        ds = await distribute(source, mode, c)
        assert ds.cardinality() == len(ds) == ds.total_cardinality() == 100
        out = await read(ds)
        assert len(out) == 100
        if mode == "DYNAMIC":  # (DATA keeps every other element of each worker's shuffle)
            assert sorted(out) == list(range(1, 101))
        assert len(ds.map(str).prefetch(2)) == 100  # local ops keep it
        assert len(ds.batch(32)) == 4  # ... and compute on it
    # each worker batches its own share: the number of batches depends on the shares
    batched = await distribute(Dataset.range(100).batch(8), "DYNAMIC", c)
    assert batched.total_cardinality() == 13
    assert unknown_length(batched) == (
        "the length of the dataset is unknown: under DYNAMIC sharding each data worker runs "
        "the pipeline on its own share of the source, and an op of it (batch, take, filter, "
        "...) does not keep one element per element; the pipeline has 13 elements when read "
        "whole (total_cardinality())")
    assert len(await read(batched)) >= 13
    shared = await distribute(source, "DYNAMIC", c, job_name="shared")
    assert unknown_length(shared) == (
        "the length of the dataset is unknown: the consumers of the shared job 'shared' split "
        "its elements between them first come first served; the dataset has 100 elements in "
        "all (total_cardinality())")
    off = await distribute(source, "OFF", c)
    assert unknown_length(off) == (
        "the length of the dataset is unknown: under OFF sharding every data worker produces "
        "the whole dataset (100 elements), so a pass yields that many times the number of "
        "data workers")
    assert len(await read(off)) == 200  # two workers
    dataset_id = await asyncio.to_thread(dds.register_dataset, c, source)
    by_id = dds.from_dataset_id("DYNAMIC", c, dataset_id)  # asks the dispatcher (see below)
    assert await asyncio.to_thread(by_id.total_cardinality) == 100
    assert (await distribute(Dataset.range(5).repeat(), "DYNAMIC", c)).cardinality() == dds.INFINITE
    assert (await distribute(Dataset.range(0), "DYNAMIC", c)).cardinality() == 0


def length_or_reason(ds) -> int | str:
    try:
        return len(ds)
    except TypeError as e:
        return str(e)


@pytest.mark.cluster
@pytest.mark.timeout(60)
@gen_cluster(client=True, nthreads=TWO,
             config={"dataservice.dispatcher.worker-addresses": ["0", "1"]})
async def test_from_dataset_id_reports_what_distribute_reports(c, s, a, b):
    """A reader that did not register the dataset asks the dispatcher (once, lazily) for the
    registration's cardinality and count preservation: its answers are distribute's."""
    await _install_async(c)
    asked = []
    metadata = s.handlers["dataservice_dataset_metadata"]

    def counting(**kwargs):
        asked.append(kwargs["dataset_id"])
        return metadata(**kwargs)

    s.handlers["dataservice_dataset_metadata"] = counting
    source = Dataset.range(100).map(lambda x: x + 1).shuffle(8)
    cases = [(source, "DYNAMIC", None), (source, "DATA", None), (source, "FILE_OR_DATA", None),
             (Dataset.range(100).batch(8), "DYNAMIC", None), (source, "DYNAMIC", "shared"),
             (source, "OFF", None), (Dataset.range(5).repeat(), "DYNAMIC", None),
             (Dataset.range(5).repeat(), "DATA", None), (Dataset.range(0), "DYNAMIC", None)]
    for pipeline, mode, job_name in cases:
        distributed = await distribute(pipeline, mode, c, job_name=job_name)
        dataset_id = await asyncio.to_thread(dds.register_dataset, c, pipeline)  # the same
        by_id = dds.from_dataset_id(mode, c, dataset_id, job_name=job_name)
        assert "cardinality=UNKNOWN" in repr(by_id) and not asked  # a repr asks nothing
        case = (pipeline, mode, job_name)
        assert await asyncio.to_thread(by_id.cardinality) == distributed.cardinality(), case
        assert await asyncio.to_thread(length_or_reason, by_id) == \
            length_or_reason(distributed), case
        assert by_id.total_cardinality() == distributed.total_cardinality(), case
        assert asked == [dataset_id], case  # once per object
        assert f"cardinality={distributed.cardinality()}" in repr(by_id) or \
            distributed.cardinality() < 0
        asked.clear()
    assert len(by_id.batch(2).map(str)) == 0  # local ops compute on the answer
    # on the client's own event loop the call cannot block: UNKNOWN, saying what to do
    on_loop = dds.from_dataset_id("DYNAMIC", c, dataset_id)
    assert unknown_length(on_loop) == (
        "the length of the dataset is unknown: from_dataset_id() asks the dispatcher for the "
        "dataset's cardinality, which cannot be waited for on the client's event loop: call "
        "cardinality() from another thread (await asyncio.to_thread(...))")
    assert await asyncio.to_thread(on_loop.cardinality) == 0  # asked from a thread


@pytest.mark.cluster
@pytest.mark.timeout(60)
@gen_cluster(client=True, nthreads=TWO)
async def test_from_dataset_id_cardinality_needs_the_secret(c, s, a, b):
    """Only the holder of the id learns the metadata: a wrong secret is an unknown id."""
    dataset_id = await asyncio.to_thread(dds.register_dataset, c, Dataset.range(10))
    key = dataset_id.partition(":")[0]
    for wrong in (f"{key}:not-the-secret", "12345:abc"):
        ds = dds.from_dataset_id("DYNAMIC", c, wrong)
        with pytest.raises(dds.DatasetNotFoundError) as info:
            await asyncio.to_thread(ds.cardinality)
        assert str(info.value) == (
            f"no dataset has the id {wrong.partition(':')[0]!r} with this secret: read a dataset by the string id "
            "register_dataset returned ('<id or name>:<secret>'; bare integer ids and names "
            "are not accepted, register the pipeline again to get its id)")
        assert "cardinality=UNKNOWN" in repr(ds)  # a repr never raises (nor asks)
    assert await asyncio.to_thread(dds.from_dataset_id("DYNAMIC", c, dataset_id).cardinality) == 10


@pytest.mark.cluster
@pytest.mark.timeout(60)
@gen_cluster(client=True, nthreads=TWO)
async def test_from_dataset_id_of_an_older_registration_says_what_it_lacks(c, s, a, b):
    """A dataset journaled by an older version has no count preservation (or no metadata):
    UNKNOWN, saying so; where the answer does not need it, it is given."""
    await _install_async(c)
    plugin = s.extensions["dataservice"]

    async def register(fingerprint, metadata):
        resp = await plugin.register_dataset(fingerprint=fingerprint, pipeline=b"p",
                                             splits=b"", num_splits=-1, metadata=metadata)
        return resp["dataset_id"]

    no_preservation = await register("old-1", {"cardinality": 10})
    ds = dds.from_dataset_id("DYNAMIC", c, no_preservation)
    assert await asyncio.to_thread(length_or_reason, ds) == (
        "the length of the dataset is unknown: the dataset was registered without saying "
        "whether its ops keep one element per element (by an older version of "
        "dask_dataservice): register it again to know its cardinality")
    assert ds.total_cardinality() == 10
    off = dds.from_dataset_id("OFF", c, no_preservation)  # OFF's reason does not need it
    assert (await asyncio.to_thread(length_or_reason, off)).startswith(
        "the length of the dataset is unknown: under OFF sharding every data worker")
    nothing = dds.from_dataset_id("DYNAMIC", c, await register("old-2", {}))
    assert await asyncio.to_thread(length_or_reason, nothing) == (
        "the length of the dataset is unknown: the dataset was registered without its "
        "cardinality (by an older version of dask_dataservice): register it again to know it")
    assert nothing.total_cardinality() == dds.UNKNOWN


@pytest.mark.pure
def test_tensorflow_answers_and_ours():
    D, OFF, F = ShardingPolicy.DYNAMIC, ShardingPolicy.OFF, ShardingPolicy.FILE
    inf, unk = dds.INFINITE, dds.UNKNOWN
    assert service_cardinality(D, "j", True, 10, True) == inf  # coordinated reads (TF)
    assert service_cardinality(OFF, None, False, inf, True) == inf  # TF
    assert service_cardinality(F, None, False, inf, True) == unk  # TF
    assert service_cardinality(F, None, False, 0, False) == 0  # TF
    assert service_cardinality(F, None, False, 10, True) == 10  # TF: UNKNOWN
    assert service_cardinality(D, None, False, 10, False) == unk
    assert service_cardinality(D, None, False, None, True) == unk
    assert count_preserving(Dataset.range(3).map(str).prefetch(1).enumerate()._op)
    assert not count_preserving(Dataset.range(3).take(2)._op)
    assert not count_preserving(Dataset.zip(Dataset.range(3), Dataset.range(3))._op)
