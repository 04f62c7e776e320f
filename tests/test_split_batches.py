"""DYNAMIC split batches (issue 16, target 3): a data worker asks for more splits at once while
its pipeline waits for them, up to ``dataservice.worker.split-batch-max``, never more; every
element is read exactly once. The journal of a fault-tolerant dispatcher holds one
``ProduceSplits`` record per request, with its count."""

from __future__ import annotations

import dask
import pytest
from distributed import Client, LocalCluster

import dask_dataservice as dds
from dask_dataservice.service._state_codec import decode_update
from dask_dataservice.service._updates import ProduceSplits
from dask_dataservice.service.journal import read_journal


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
