"""``cardinality()`` and ``len()`` of ``distribute``d datasets (docs/data-service.md,
"Cardinality"): known where one pass is determined, else UNKNOWN with ``len()`` saying why."""

from __future__ import annotations

import asyncio

import pytest
from _helpers import distribute, read

import dask_dataservice as dds
from dask_dataservice import Dataset
from dask_dataservice.service.client._cardinality import count_preserving, service_cardinality
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
    by_id = dds.from_dataset_id("DYNAMIC", c, dataset_id)
    assert by_id.total_cardinality() == dds.UNKNOWN
    assert unknown_length(by_id) == (
        "the length of the dataset is unknown: this process did not register the dataset "
        "(from_dataset_id), so it does not know the dataset's cardinality")
    assert (await distribute(Dataset.range(5).repeat(), "DYNAMIC", c)).cardinality() == dds.INFINITE
    assert (await distribute(Dataset.range(0), "DYNAMIC", c)).cardinality() == 0


@pytest.mark.pure
def test_tensorflow_answers_and_ours():
    D, O, F = ShardingPolicy.DYNAMIC, ShardingPolicy.OFF, ShardingPolicy.FILE
    inf, unk = dds.INFINITE, dds.UNKNOWN
    assert service_cardinality(D, "j", True, 10, True) == inf  # coordinated reads (TF)
    assert service_cardinality(O, None, False, inf, True) == inf  # TF
    assert service_cardinality(F, None, False, inf, True) == unk  # TF
    assert service_cardinality(F, None, False, 0, False) == 0  # TF
    assert service_cardinality(F, None, False, 10, True) == 10  # TF: UNKNOWN
    assert service_cardinality(D, None, False, 10, False) == unk
    assert service_cardinality(D, None, False, None, True) == unk
    assert count_preserving(Dataset.range(3).map(str).prefetch(1).enumerate()._op)
    assert not count_preserving(Dataset.range(3).take(2)._op)
    assert not count_preserving(Dataset.zip(Dataset.range(3), Dataset.range(3))._op)
