"""Static sharding (FILE, DATA, FILE_OR_DATA, HINT) over a fixed worker list, local reads."""

from __future__ import annotations

import asyncio
import collections

import numpy as np
import pytest
from _helpers import distribute, poll, read  # noqa: E402
from distributed import Worker

import dask_dataservice as dds
from dask_dataservice.data import readers
from dask_dataservice.service.client import _install_async
from dask_dataservice.service.dispatcher.plugin import PLUGIN_NAME
from dask_dataservice.service.worker import current_task
from dask_dataservice.testing import gen_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]

#: gen_cluster names its workers 0, 1, ...: the fixed list names them.
FIXED = {"dataservice.dispatcher.worker-addresses": ["0", "1"]}
TWO_NAMED = [("127.0.0.1", 1), ("127.0.0.1", 1)]


def tag(x):
    """(worker index, element): which fixed worker produced the element."""
    return current_task()["worker_index"], x


def by_worker(out):
    groups = collections.defaultdict(list)
    for index, x in out:
        groups[index].append(x)
    return groups


def _npy_files(tmp_path, n_files=5, rows=4):
    paths = []
    for f in range(n_files):
        p = tmp_path / f"part-{f}.npy"
        np.save(p, np.arange(rows) + 100 * f)
        paths.append(str(p))
    return paths


@gen_cluster(client=True, nthreads=TWO_NAMED, config=FIXED)
async def test_file_sharding_gives_each_worker_its_files(c, s, a, b):
    import tempfile
    from pathlib import Path

    paths = _npy_files(Path(tempfile.mkdtemp()))
    source = dds.Dataset.from_files(paths, readers.npy).map(lambda row: int(row)).map(tag)
    out = await read(await distribute(source, "FILE", c))
    groups = by_worker(out)
    expect = {i: sorted(v for f in range(i, 5, 2) for v in np.arange(4) + 100 * f)
              for i in (0, 1)}
    assert {i: sorted(v) for i, v in groups.items()} == expect


@gen_cluster(client=True, nthreads=TWO_NAMED)
async def test_file_splits_travel_once_inside_the_pipeline(c, s, a, b):
    """Issue 22 s5: a file-based source's splits are its paths, which the pipeline holds:
    registration sends a reference (``PipelineSplits``) and each data worker makes them from
    the pipeline, so DYNAMIC reads every file exactly once."""
    import tempfile
    from pathlib import Path

    import cloudpickle

    from dask_dataservice.data.splits import PipelineSplits

    paths = _npy_files(Path(tempfile.mkdtemp()), n_files=9)
    source = dds.Dataset.from_files(paths, readers.npy).map(lambda row: int(row))
    out = await read(await distribute(source, "DYNAMIC", c))
    assert sorted(out) == sorted(v for f in range(9) for v in np.arange(4) + 100 * f)
    [dataset] = s.plugins[PLUGIN_NAME].state.list_datasets()
    assert cloudpickle.loads(dataset.splits) == PipelineSplits(None)
    assert dataset.num_splits == 9


@gen_cluster(client=True, nthreads=TWO_NAMED, config=FIXED)
async def test_data_sharding_keeps_every_nth_element(c, s, a, b):
    out = await read(await distribute(dds.Dataset.range(101).map(tag), "DATA", c))
    groups = by_worker(out)
    assert sorted(groups[0]) == list(range(0, 101, 2))
    assert sorted(groups[1]) == list(range(1, 101, 2))


@gen_cluster(client=True, nthreads=TWO_NAMED, config=FIXED)
async def test_file_or_data_picks_by_source(c, s, a, b):
    import tempfile
    from pathlib import Path

    # not file based: DATA
    out = await read(await distribute(dds.Dataset.range(10).map(tag), "FILE_OR_DATA", c))
    assert sorted(by_worker(out)[1]) == [1, 3, 5, 7, 9]
    # file based: FILE
    paths = _npy_files(Path(tempfile.mkdtemp()), n_files=2, rows=3)
    source = dds.Dataset.from_files(paths, readers.npy).map(lambda r: int(r)).map(tag)
    out = await read(await distribute(source, "FILE_OR_DATA", c))
    assert {i: sorted(v) for i, v in by_worker(out).items()} == {0: [0, 1, 2], 1: [100, 101, 102]}


@gen_cluster(client=True, nthreads=TWO_NAMED, config=FIXED)
async def test_hint_fills_in_shard_hint(c, s, a, b):
    hinted = dds.Dataset.range(20).shard(dds.SHARD_HINT, dds.SHARD_HINT).map(tag)
    out = await read(await distribute(hinted, "HINT", c))
    groups = by_worker(out)
    assert sorted(groups[0]) == list(range(0, 20, 2))
    assert sorted(groups[1]) == list(range(1, 20, 2))
    # no SHARD_HINT in the pipeline: HINT runs it unsharded on every worker, as in TF
    out = await read(await distribute(dds.Dataset.range(5).map(tag), "HINT", c))
    assert {i: sorted(v) for i, v in by_worker(out).items()} == {0: list(range(5)), 1: list(range(5))}


@gen_cluster(client=True, nthreads=TWO_NAMED)
async def test_static_sharding_needs_a_worker_list(c, s, a, b):
    with pytest.raises(ValueError, match="needs a fixed list of workers"):
        await read(await distribute(dds.Dataset.range(10), "DATA", c))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)],
             config={"dataservice.dispatcher.worker-addresses": ["0", "w1"]})
async def test_listed_worker_joining_later_gets_its_shard(c, s, a):
    """The job waits for every listed worker; a worker outside the list gets no task. The
    reader (local to every worker here) waits for w1 even after worker 0's task finished."""
    await _install_async(c)
    ds = await distribute(dds.Dataset.range(10).map(tag), "DATA", c)
    fut = asyncio.ensure_future(read(ds))
    plugin = s.plugins[PLUGIN_NAME]
    await poll(lambda: a.extensions["dataservice"].stats["tasks_finished"] == 1,
               what="worker 0's shard to end")
    assert not fut.done()
    async with Worker(s.address, nthreads=1, name="stranger"):
        async with Worker(s.address, nthreads=1, name="w1"):
            out = await asyncio.wait_for(fut, 20)
    assert {i: sorted(v) for i, v in by_worker(out).items()} == {0: [0, 2, 4, 6, 8], 1: [1, 3, 5, 7, 9]}
    assert all(w.address != "stranger" for w in plugin.state.list_workers()
               if plugin.state.tasks_for_worker(w.address))


# ---------------------------------------------------------------------------------------
# local reads: 127.0.0.2 stands for another machine
# ---------------------------------------------------------------------------------------

LOCAL_AND_REMOTE = [("127.0.0.1", 1), ("127.0.0.2", 1)]


@gen_cluster(client=True, nthreads=LOCAL_AND_REMOTE)
async def test_local_reads_only_local_worker(c, s, a, b):
    assert a.address.startswith("tcp://127.0.0.1") and b.address.startswith("tcp://127.0.0.2")
    ds = await distribute(dds.Dataset.range(50), "parallel_epochs", c, target_workers="LOCAL")
    assert sorted(await read(ds)) == list(range(50))  # one copy: the local worker's
    ds = await distribute(dds.Dataset.range(50), "parallel_epochs", c, target_workers="ANY")
    assert sorted(await read(ds)) == sorted(list(range(50)) * 2)
    # AUTO reads from every worker for OFF/DYNAMIC jobs
    ds = await distribute(dds.Dataset.range(50), "parallel_epochs", c, target_workers="AUTO")
    assert sorted(await read(ds)) == sorted(list(range(50)) * 2)


@gen_cluster(client=True, nthreads=LOCAL_AND_REMOTE, config=FIXED)
async def test_auto_reads_locally_under_static_sharding(c, s, a, b):
    ds = await distribute(dds.Dataset.range(20).map(tag), "DATA", c, target_workers="AUTO")
    out = await read(ds)
    assert {i for i, _ in out} == {0}  # the local worker's shard only
    assert sorted(x for _, x in out) == list(range(0, 20, 2))


@gen_cluster(client=True, nthreads=[("127.0.0.2", 1)])
async def test_local_without_local_worker_is_an_error(c, s, b):
    ds = await distribute(dds.Dataset.range(5), "parallel_epochs", c, target_workers="LOCAL")
    with pytest.raises(dds.errors.DataServiceError,
                       match=r"target_workers='LOCAL', but no data worker .* on this host"):
        await read(ds)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3,
             config={"dataservice.dispatcher.worker-addresses": ["127.0.0.1:%port%"] * 2})
async def test_port_wildcard_entries_give_each_worker_of_a_host_its_own_shard(c, s, a, b, extra):
    """TensorFlow's worker list form ``"host:%port%"`` (its static-sharding tests list
    ``"localhost:%port%"`` once per worker, data_service_test_base.TestCluster): each of the
    host's workers takes the first entry no other live worker holds, so two workers of one
    host read one shard each and the third, with no entry left, gets no task."""
    await _install_async(c)
    out = await read(await distribute(dds.Dataset.range(10).map(tag), "DATA", c))
    assert {i: sorted(v) for i, v in by_worker(out).items()} == {0: [0, 2, 4, 6, 8],
                                                                   1: [1, 3, 5, 7, 9]}
    finished = sorted(w.extensions["dataservice"].stats["tasks_finished"] for w in (a, b, extra))
    assert finished == [0, 1, 1]  # one worker of the host had no entry left: no task


@pytest.mark.pure
def test_worker_list_entries_match_a_worker_an_address_or_a_host():
    from dask_dataservice.service.protocol._job_checks import resolve_entry_hosts, shard_index

    entries = ("127.0.0.1:%port%", "127.0.0.1", "10.0.0.5:7000", "w-name")
    assert shard_index(entries, "tcp://127.0.0.1:4000") == 0
    assert shard_index(entries, "tcp://127.0.0.1:4001", taken=[0]) == 1  # a bare host: any port
    assert shard_index(entries, "tcp://127.0.0.1:4002", taken=[0, 1]) is None
    assert shard_index(entries, "tcp://10.0.0.5:7000", taken=[0, 1]) == 2
    assert shard_index(entries, "tcp://10.0.0.5:7001") is None  # a fixed port is that port
    assert shard_index(entries, "tcp://10.9.9.9:1", "w-name") == 3
    assert shard_index(("tcp://[::1]:%port%",), "tcp://[::1]:5") == 0
    assert resolve_entry_hosts(["localhost:%port%", "grpc://localhost:5000", "w0",
                                "nohost.invalid:%port%"]) == [
        "127.0.0.1:%port%", "grpc://127.0.0.1:5000", "w0", "nohost.invalid:%port%"]


def test_a_dispatch_server_lists_localhost_port_wildcards_as_tensorflow_does():
    """TF's form end to end: ``DispatcherConfig(worker_addresses=["localhost:%port%"] * 2)``
    with two ``WorkerServer(worker_address="localhost:%port%")``: FILE_OR_DATA (DATA here)
    reads every element once, one shard per worker."""
    dispatcher = dds.DispatchServer(dds.DispatcherConfig(
        worker_addresses=["localhost:%port%"] * 2))
    workers = [dds.WorkerServer(dds.WorkerConfig(dispatcher._address,
                                                 worker_address="localhost:%port%"))
               for _ in range(2)]
    try:
        ds = dds.Dataset.range(20).apply(dds.distribute("DATA", dispatcher.target))
        assert sorted(int(x) for x in ds) == list(range(20))
    finally:
        for w in workers:
            w.stop()
        dispatcher.stop()
