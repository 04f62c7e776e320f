"""The reader's pure decisions, without a cluster."""

from __future__ import annotations

import pytest

import dask_dataservice as dds
from dask_dataservice.service._fixed_readers import CoordinatedReader, CrossTrainerReader
from dask_dataservice.service._reader import IterationReader, ReadSpec, reader_class
from dask_dataservice.service._sharding import ShardingPolicy


def spec(mode=ShardingPolicy.DYNAMIC, cache=None, num_consumers=None, job_name="job"):
    return ReadSpec(address="tcp://127.0.0.1:1", dataset_id=1, processing_mode=int(mode),
                    job_name=job_name, consumer_index=0 if num_consumers else None,
                    num_consumers=num_consumers, max_outstanding_requests=None,
                    target_workers="AUTO", cross_trainer_cache=cache)


@pytest.mark.parametrize(("read", "expected"), [
    (spec(cache=dds.CrossTrainerCache("t1")), CrossTrainerReader),
    (spec(ShardingPolicy.OFF, cache=dds.CrossTrainerCache("t1")), IterationReader),
    (spec(num_consumers=2), CoordinatedReader),
    (spec(), IterationReader),
    (spec(ShardingPolicy.OFF, job_name=None), IterationReader),
])
def test_reader_class_depends_on_the_read_only(read, expected):
    """The reader's kind is a function of what is read: a cross-trainer read under DYNAMIC
    takes turns whatever the number of tasks when it starts (it used to be the plain reader
    when the view listed one task, a race with the second worker's registration)."""
    assert reader_class(read) is expected
