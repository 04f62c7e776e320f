"""A read creates its job and iteration in one round trip (issue 16, target 7), and still reads
from a dispatcher without that handler (an older version)."""

from __future__ import annotations

import pytest
from _helpers import distribute, read

import dask_dataservice as dds
from dask_dataservice.service.protocol._start_read import START_READ
from dask_dataservice.testing import gen_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]


def _count_calls(s, name):
    calls = []
    original = s.handlers[name]

    async def counting(*args, **kwargs):
        calls.append(name)
        return await original(*args, **kwargs)

    s.handlers[name] = counting
    return calls


@gen_cluster(client=True)
async def test_one_round_trip_creates_job_and_iteration(c, s, a, b):
    ds = await distribute(dds.Dataset.range(100), "distributed_epoch", c)
    starts = _count_calls(s, START_READ)
    jobs = _count_calls(s, "dataservice_get_or_create_job")
    assert sorted(await read(ds)) == list(range(100))
    assert sorted(await read(ds)) == list(range(100))  # a second pass: a new iteration
    assert len(starts) == 2 and jobs == []


@gen_cluster(client=True)
async def test_named_job_errors_travel_through_start_read(c, s, a, b):
    ds = dds.Dataset.range(10)
    one = await distribute(ds, "distributed_epoch", c, job_name="shared")
    await read(one)
    other = await distribute(ds, "parallel_epochs", c, job_name="shared")
    with pytest.raises(ValueError, match="already exists with processing mode DYNAMIC"):
        await read(other)


@gen_cluster(client=True)
async def test_a_dispatcher_without_start_read_is_read_in_two_requests(c, s, a, b):
    ds = await distribute(dds.Dataset.range(100), "distributed_epoch", c)
    del s.handlers[START_READ]  # as an older dispatcher
    jobs = _count_calls(s, "dataservice_get_or_create_job")
    assert sorted(await read(ds)) == list(range(100))
    assert len(jobs) == 1
