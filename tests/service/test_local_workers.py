"""Which data workers are local to a consumer (``target_workers`` AUTO / LOCAL under static
sharding): on its host (the default), or in its process (TensorFlow's meaning)."""

from __future__ import annotations

import dask
import pytest
from _helpers import distribute, poll, read  # noqa: E402
from distributed import Nanny

import dask_dataservice as dds
from dask_dataservice.testing import gen_cluster

pytestmark = [pytest.mark.process, pytest.mark.timeout(60)]

#: workers "0" (this process, this host), "1" (this process, 127.0.0.2: another host) and
#: "n" (a Nanny's process on this host)
FIXED = {"dataservice.dispatcher.worker-addresses": ["0", "1", "n"]}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.2", 1)], config=FIXED)
async def test_local_means_this_host_or_this_process(c, s, a, b):
    """``local_workers_test.py``: ``testLocalWorkers`` / ``testAnonymousJobWithDifferentTarget
    Workers`` (LOCAL reads the local workers only, ANY all of them) and ``auto_shard_test.py``
    (static sharding read with AUTO takes the local worker's shard): by default a worker on
    the consumer's host is local, in the consumer's process or not; with
    ``dataservice.client.local-workers: process`` only the workers of its process are
    (TensorFlow's local workers), whatever their host."""
    from dask_dataservice.service.worker import current_task

    def tagged():
        return dds.Dataset.range(30).map(lambda x: (current_task()["worker_index"], x))

    async with Nanny(s.address, nthreads=1, name="n", host="127.0.0.1"):
        await poll(lambda: len(s.workers) == 3, what="the Nanny's worker")
        shares = {i: list(range(i, 30, 3)) for i in range(3)}

        async def shards(target, local_workers):
            with dask.config.set({"dataservice.client.local-workers": local_workers}):
                out = await read(await distribute(tagged(), "DATA", c, target_workers=target))
            got = {}
            for i, x in out:
                got.setdefault(i, []).append(x)
            return {i: sorted(v) for i, v in got.items()}

        assert await shards("AUTO", "host") == {0: shares[0], 2: shares[2]}
        assert await shards("LOCAL", "host") == {0: shares[0], 2: shares[2]}
        assert await shards("AUTO", "process") == {0: shares[0], 1: shares[1]}
        assert await shards("LOCAL", "process") == {0: shares[0], 1: shares[1]}
        with dask.config.set({"dataservice.client.local-workers": "process"}):
            # OFF: AUTO reads every worker, LOCAL this process's (each a whole copy)
            off = await read(await distribute(dds.Dataset.range(4), "OFF", c))
            assert sorted(off) == sorted(list(range(4)) * 3)
            off = await read(await distribute(dds.Dataset.range(4), "OFF", c,
                                              target_workers="LOCAL"))
            assert sorted(off) == sorted(list(range(4)) * 2)
