"""distributed_save / Dataset.load (service/client/snapshot.py, data/snapshot.py), and from_dataset_id(element_spec=...).

Real clusters (gen_cluster and a subprocess killed with SIGKILL), real local and in-memory
(fsspec ``memory://``) filesystems; exact elements, no duplicates."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import uuid

import fsspec
import numpy as np
import pytest
from _helpers import distribute, poll, read, wait

import dask_dataservice as dds
from dask_dataservice.data import Dataset, NotSplittableError, TensorSpec
from dask_dataservice.data.snapshot import (
    CHUNKS,
    SnapshotCorruptedError,
    WriteChunks,
    committed_chunks,
    encode_chunk,
    read_chunk,
    read_manifest,
)
from dask_dataservice.service.client.snapshot import distributed_save
from dask_dataservice.testing import gen_cluster

pytestmark = pytest.mark.pure

load = Dataset.load


# -- chunks and the writer stage, without a cluster ------------------------------------------


@pytest.mark.parametrize("compress", [False, True])
def test_chunk_roundtrip_and_every_kind_of_damage(tmp_path, compress):
    elements = [np.arange(3), {"a": np.float32(1.5), "b": b"x"}, (1, "s"), np.zeros(1000)]
    data = encode_chunk(elements, compress)
    assert (len(data) < 4000) is compress  # 1,000 zeros shrink when compressed
    p = tmp_path / "c.chunk"
    p.write_bytes(data)
    out = read_chunk(str(p), allow_pickle=True)
    assert np.array_equal(out[0], elements[0]) and out[1:3] == elements[1:3]
    assert np.array_equal(out[3], elements[3])
    for damaged, what in ((b"XXXXXXXX" + data[8:], "bad magic"), (data[:-1], "header says"),
                          (data[:-1] + bytes([data[-1] ^ 1]), "checksum mismatch"),
                          (data[:10], "short header")):
        p.write_bytes(damaged)
        with pytest.raises(SnapshotCorruptedError, match=what) as e:
            read_chunk(str(p), allow_pickle=True)
        assert str(p) in str(e.value)


def test_writer_cuts_chunks_by_count_and_bytes(tmp_path):
    ds = Dataset(WriteChunks(Dataset.range(25)._op, str(tmp_path), 10, 1 << 30, 3600.0))
    descs = list(ds)
    assert [d["elements"] for d in descs] == [10, 10, 5]
    names = committed_chunks(str(tmp_path))
    assert sorted(d["chunk"] for d in descs) == names
    assert [x for n in names for x in read_chunk(str(tmp_path / CHUNKS / n))] == list(range(25))
    big = Dataset.from_tensor_slices(np.zeros((6, 1000)))  # 8000 bytes per element
    descs = list(Dataset(WriteChunks(big._op, str(tmp_path / "b"), 100, 16_000, 3600.0)))
    assert [d["elements"] for d in descs] == [2, 2, 2]


def test_writer_abandoned_early_commits_nothing_half_written(tmp_path):
    it = iter(Dataset(WriteChunks(Dataset.range(100)._op, str(tmp_path), 10, 1 << 30, 3600.0)))
    next(it)
    it.close()  # the 2nd chunk was being filled: not written
    assert len(committed_chunks(str(tmp_path))) == 1
    assert os.listdir(tmp_path / CHUNKS) == committed_chunks(str(tmp_path))  # no temp file left


def test_bad_input_is_refused_clearly(tmp_path):
    with pytest.raises(TypeError, match="takes a Dataset"):
        distributed_save([1, 2], str(tmp_path), "tcp://127.0.0.1:1")
    with pytest.raises(NotSplittableError, match="cannot be split"):
        distributed_save(Dataset.from_generator(lambda: iter([1])), str(tmp_path), "tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="infinite"):
        distributed_save(Dataset.range(3).repeat(), str(tmp_path), "tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="compression must be one of 'AUTO', None, 'LZ4', "
                                         "'ZSTD', 'GZIP', 'SNAPPY', got 'lz4'"):
        distributed_save(Dataset.range(3), str(tmp_path), "tcp://127.0.0.1:1", compression="lz4")
    with pytest.raises(ValueError, match="format must be one of 'AUTO', 'arrow', 'parquet', "
                                         "'pickle', got 'npz'"):
        distributed_save(Dataset.range(3), str(tmp_path), "tcp://127.0.0.1:1", format="npz")
    with pytest.raises(ValueError, match="max_chunk_elements must be a positive int"):
        distributed_save(Dataset.range(3), str(tmp_path), "tcp://127.0.0.1:1", max_chunk_elements=0)
    with pytest.raises(FileNotFoundError, match="no snapshot at"):
        load(str(tmp_path / "nothing"))
    (tmp_path / "snapshot.json").write_text("{}")
    with pytest.raises(SnapshotCorruptedError, match="not a dask-dataservice snapshot"):
        load(str(tmp_path))
    with pytest.raises(FileExistsError, match="already holds a snapshot"):
        distributed_save(Dataset.range(3), str(tmp_path), "tcp://127.0.0.1:1")


def test_from_dataset_id_element_spec_is_returned_without_reading():
    spec = {"x": TensorSpec((None, 3), np.float32), "y": TensorSpec((), np.int64)}
    ds = dds.from_dataset_id("parallel_epochs", "tcp://127.0.0.1:1", 7, element_spec=spec)
    assert ds.element_spec is spec  # no service at that address: nothing was read
    with pytest.raises(TypeError, match="element_spec must be a TensorSpec"):
        dds.from_dataset_id("parallel_epochs", "tcp://127.0.0.1:1", 7, element_spec={"x": (3,)})


# -- through the data service ----------------------------------------------------------------


@pytest.mark.cluster
@gen_cluster(client=True, nthreads=[("", 1)] * 2,
             config={"dataservice.dispatcher.worker-addresses": ["0", "1"]})  # for FILE
async def test_save_then_load_local_and_memory(c, s, a, b):
    import tempfile

    data = {"x": np.arange(1000, dtype=np.int64), "v": np.random.default_rng(0).random((1000, 4))}
    ds = Dataset.from_tensor_slices(data).map(lambda e: {"x": e["x"], "v": e["v"] * 2})
    with tempfile.TemporaryDirectory() as d:
        for path in (f"{d}/snap", f"memory://snap{uuid.uuid4().hex}"):
            memory = path.startswith("memory://")
            manifest = await asyncio.to_thread(
                dds.distributed_save, ds, path, c, True, max_chunk_elements=64,
                compression="ZSTD" if memory else "AUTO", format="parquet" if memory else "AUTO")
            assert manifest["state"] == "done" and manifest["num_elements"] == 1000
            assert manifest["complete"] is True and manifest["version"] == 2
            assert manifest["chunk_format"] == ("parquet" if memory else "arrow")
            assert manifest["pickle_chunks"] == 0
            assert sum(manifest["chunk_elements"].values()) == 1000
            assert set(manifest["chunk_elements"]) == set(manifest["chunks"])
            assert [leaf["column"] for leaf in manifest["structure"]["items"]] == ["x", "v"]
            assert read_manifest(path)["chunks"] == manifest["chunks"]
            with fsspec.open(f"{path}/{CHUNKS}/{manifest['chunks'][0]}", "rb") as f:
                magic = f.read(6)
            assert magic[:4] == b"PAR1" if memory else magic == b"ARROW1"
            assert all(n.endswith(".parquet" if memory else ".arrow") for n in manifest["chunks"])
            # both workers wrote (two streams at least), and the chunks are the splits
            assert len({n.split("-")[0] for n in manifest["chunks"]}) >= 2
            loaded = load(path)
            assert loaded.cardinality() == 1000
            assert len(loaded.splits()) == len(manifest["chunks"])
            out = list(loaded)
            assert sorted(int(e["x"]) for e in out) == list(range(1000))  # exact, no duplicate
            for e in out:
                assert np.array_equal(e["v"], data["v"][int(e["x"])] * 2)
            # a snapshot is splittable: read back through the service with DYNAMIC sharding
            job = await asyncio.to_thread(loaded.map(lambda e: int(e["x"])).apply,
                                          dds.distribute("distributed_epoch", c))
            back = await read(job)
            assert sorted(back) == list(range(1000))
            # chunks are files: FILE sharding gives each worker its own chunks
            job = await distribute(loaded.map(lambda e: int(e["x"])), dds.ShardingPolicy.FILE, c)
            assert sorted(await read(job)) == list(range(1000))
            if path.startswith("memory://"):
                fsspec.filesystem("memory").rm(path, recursive=True)


#: Holds the save's pipeline after 300 elements until the loader saw some (module level: the
#: in-process workers unpickle ``_held`` by reference, so they share this event).
_GATE = threading.Event()


def _held(x):
    if x >= 300:
        _GATE.wait(30)
    return x


@pytest.mark.cluster
@gen_cluster(client=True, nthreads=[("", 1)] * 2)
async def test_load_while_the_save_runs(c, s, a, b):
    import tempfile

    gate = _GATE
    gate.clear()
    ds = Dataset.range(600).map(_held)
    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/snap"
        save = await asyncio.to_thread(dds.distributed_save, ds, path, c, max_chunk_elements=25,
                                       max_chunk_seconds=0.2)
        try:
            await asyncio.to_thread(wait, lambda: len(committed_chunks(path)) >= 4, 30, "chunks")
            assert read_manifest(path)["state"] == "running"
            partial = load(path)  # wait=False: the chunks committed so far, as splits
            assert partial.splittable and partial.cardinality() == dds.UNKNOWN
            got = [int(x) for x in partial]
            assert len(got) == len(set(got)) and len(got) >= 100 and max(got) < 600
            follower = load(path, wait=True)
            assert not follower.splittable
            with pytest.raises(NotSplittableError, match="still running"):
                follower.splits()
            it = iter(follower)
            first = await asyncio.to_thread(lambda: [next(it) for _ in range(100)])
            gate.set()
            rest = await asyncio.to_thread(list, it)
            assert sorted(int(x) for x in first + rest) == list(range(600))
        finally:
            gate.set()
            manifest = await asyncio.to_thread(save.result, 60)
        assert manifest["num_elements"] == 600 and save.done()


_KILLED_SAVER = textwrap.dedent("""
    import sys
    import numpy as np
    from distributed import Client, LocalCluster
    from dask_dataservice.data import Dataset
    from dask_dataservice.service.client.snapshot import distributed_save

    if __name__ == "__main__":
        path = sys.argv[1]
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                          dashboard_address=None) as cluster, Client(cluster) as client:
            ds = Dataset.range(10**7).map(lambda i: np.full(4096, i, np.int64))
            distributed_save(ds, path, client, wait=True, max_chunk_elements=40)
""")


@pytest.mark.process
@pytest.mark.slow
def test_a_killed_save_loses_no_committed_chunk(tmp_path):
    """SIGKILL the process that runs scheduler, data workers and saver, mid-save: every chunk
    under a final name is complete and exact; the torn write is at most a hidden temp file."""
    path = str(tmp_path / "snap")
    script = tmp_path / "saver.py"
    script.write_text(_KILLED_SAVER)
    proc = subprocess.Popen([sys.executable, str(script), path], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        wait(lambda: proc.poll() is not None or len(committed_chunks(path)) >= 6, 90,
             "the saver to commit 6 chunks")
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        proc.send_signal(signal.SIGKILL)  # at an arbitrary moment of the save
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stderr.close()
    assert read_manifest(path)["state"] == "running"  # never finished
    names = committed_chunks(path)
    seen: list[int] = []
    for name in names:
        rows = read_chunk(os.path.join(path, CHUNKS, name))  # complete and checksummed
        assert len(rows) == 40
        for row in rows:
            assert row.shape == (4096,) and (row == row[0]).all()
            seen.append(int(row[0]))
    assert len(seen) == len(set(seen)) == 40 * len(names)  # no element twice
    leftovers = set(os.listdir(os.path.join(path, CHUNKS))) - set(names)
    assert all(n.startswith(".") and n.endswith(".tmp") for n in leftovers)
    out = [int(r[0]) for r in load(path)]  # load reads the committed chunks, ignores the rest
    assert sorted(out) == sorted(seen)
    with pytest.raises(TimeoutError, match="no chunk committed for 0.3s"):
        list(load(path, wait=True, timeout=0.3))


def _fail_at_700(x):
    if x == 700:
        raise ValueError("bad record 700")
    return x


@pytest.mark.cluster
@gen_cluster(client=True, nthreads=[("", 1)] * 2)
async def test_a_failing_pipeline_marks_the_save_failed(c, s, a, b):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/snap"
        save = await asyncio.to_thread(dds.distributed_save, Dataset.range(1000).map(_fail_at_700),
                                       path, c, max_chunk_elements=50)
        with pytest.raises(ValueError, match="bad record 700"):
            await asyncio.to_thread(save.result, 60)
        manifest = read_manifest(path)
        assert manifest["state"] == "failed" and "bad record 700" in manifest["error"]
        with pytest.raises(RuntimeError, match="the save to .* failed: ValueError"):
            list(load(path, wait=True))
        # the other worker's pipeline thread ends once its task is cancelled (it may commit a
        # chunk until then): wait for it before the directory goes away
        await poll(lambda: not any(r.thread.is_alive() for w in (a, b)
                                   for r in w.extensions["dataservice"]._runners),
                   timeout=30, what="the save's task threads to end")
        got = [int(x) for x in load(path)]  # what was committed
        assert len(got) == len(set(got)) and 700 not in got and set(got) <= set(range(1000))


def _with_objects(i):
    return {"i": i, "meta": None if i % 2 else [i]}  # lists and None: no Arrow type


@pytest.mark.cluster
@gen_cluster(client=True, nthreads=[("", 1)] * 2)
async def test_objects_are_pickled_under_auto_and_refused_under_arrow(c, s, a, b):
    """The data workers fall back to pickle chunks for arbitrary objects (AUTO) and say so in
    the manifest; loading them needs allow_pickle; format='arrow' fails the save instead."""
    import tempfile

    ds = Dataset.range(40).map(_with_objects)
    with tempfile.TemporaryDirectory() as d:
        manifest = await asyncio.to_thread(dds.distributed_save, ds, f"{d}/auto", c, True,
                                           max_chunk_elements=10)
        assert manifest["chunk_format"] == "arrow" and manifest["pickle_fallback"] is True
        assert manifest["pickle_chunks"] == len(manifest["chunks"]) >= 4
        assert manifest["structure"] is None and manifest["num_elements"] == 40
        with pytest.raises(ValueError, match="it holds pickle chunks .* pass allow_pickle=True"):
            load(f"{d}/auto")
        out = list(load(f"{d}/auto", allow_pickle=True))
        assert sorted(out, key=lambda e: e["i"]) == [_with_objects(i) for i in range(40)]
        save = await asyncio.to_thread(dds.distributed_save, ds, f"{d}/strict", c,
                                       max_chunk_elements=10, format="arrow")
        with pytest.raises(TypeError, match=r"distributed_save\(format='arrow'\): the elements "
                           r"cannot be stored in arrow \(column 'meta'"):
            await asyncio.to_thread(save.result, 60)
        assert read_manifest(f"{d}/strict")["state"] == "failed"
        await poll(lambda: not any(r.thread.is_alive() for w in (a, b)
                                   for r in w.extensions["dataservice"]._runners),
                   timeout=30, what="the save's task threads to end")
