"""Element batches on the wire (issue 16): small buffers packed into one frame, compression
negotiated between reader and worker, malloc tuning.

Unit tests run the serializer through distributed's own ``dumps``/``loads`` (what a comm does);
the end-to-end ones read through real clusters (in-process servers over tcp).
"""

from __future__ import annotations

import asyncio
import pickle
import subprocess
import sys

import dask
import numpy as np
import pytest
from _helpers import distribute, needs, read
from distributed.protocol.core import dumps, loads

import dask_dataservice as dds
from dask_dataservice.service.protocol._frames import (
    ALIGN,
    PACK_FRAME_BYTES,
    check_compression,
    choose_codec,
    reader_codecs,
)
from dask_dataservice.service.worker._worker_util import serialized_batch
from dask_dataservice.testing import gen_cluster

pytestmark = [pytest.mark.pure, pytest.mark.timeout(60)]

lz4 = needs("lz4", "compression")


def _wire(items, codec=None):
    """``items`` as a worker sends them and a reader receives them: (header, items back)."""
    s = serialized_batch(None, items, codec)
    frames = dumps({"elements": s})
    # a comm hands the reader writable buffers
    back = loads([bytearray(memoryview(f).cast("B")) for f in frames])["elements"].items
    return s.header, s.frames, back


def _elements(n, floats):
    return [(i, np.full(floats, i, np.float32), np.arange(i % 5, dtype="i8")) for i in range(n)]


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x[0] == y[0]
        np.testing.assert_array_equal(x[1], y[1])
        np.testing.assert_array_equal(x[2], y[2])
        assert x[1].dtype == y[1].dtype and x[2].dtype == y[2].dtype


def test_small_buffers_travel_in_one_frame():
    items = _elements(100, 1024)  # 4 KiB arrays, plus tiny ones (empty arrays are in band)
    header, frames, back = _wire(items)
    _same(items, back)
    sub = header["sub-header"]
    # one pickle frame and one packed frame, not one frame per array
    assert len(frames) == 2
    assert len(sub["packed"]) == sub["buffers"] > 100
    assert all(off % ALIGN == 0 for off in sub["offsets"])
    # the reader's arrays are views of the received frame: writable, as before packing
    assert all(x[1].flags.writeable for x in back)


def test_many_small_buffers_fill_several_packed_frames():
    items = _elements(2500, 1000)  # 4,000-byte arrays: about 10 MB, more than one packed frame
    header, frames, back = _wire(items)
    _same(items, back)
    sub = header["sub-header"]
    assert sub["pack_frames"] == len(frames) - 1 >= 2
    assert all(memoryview(f).nbytes <= PACK_FRAME_BYTES for f in frames[1:])
    assert all(x[1].ctypes.data % ALIGN == back[0][1].ctypes.data % ALIGN for x in back[:900])


def test_big_buffers_keep_their_own_frames_in_order():
    big = np.arange(300_000, dtype="f8")  # 2.4 MB > pack-bytes
    items = [np.full(10, 1.0), big, np.full(10, 2.0), big + 1, np.full(20, 3.0)]
    header, frames, back = _wire(items)
    assert len(frames) == 1 + 1 + 2  # pickle, packed (3 small), 2 big
    assert list(header["sub-header"]["packed"]) == [0, 2, 4]
    for x, y in zip(items, back, strict=True):
        np.testing.assert_array_equal(x, y)


def test_packing_off_sends_a_frame_per_buffer():
    items = _elements(10, 256)
    with dask.config.set({"dataservice.worker.pack-bytes": 0}):
        header, frames, back = _wire(items)
    _same(items, back)
    assert "packed" not in header["sub-header"]
    assert len(frames) == 1 + header["sub-header"]["buffers"]


def test_compressed_batch_round_trip_and_codecs_in_the_header():
    items = _elements(200, 8192)  # 32 KiB of one value each: compresses well
    header, frames, back = _wire(items, "lz4")
    _same(items, back)
    assert header["compression"][1] == "lz4"  # the packed frame
    assert sum(memoryview(f).nbytes for f in frames) < 200 * 8192 * 4 / 10
    assert all(x[1].flags.writeable for x in back)


@pytest.mark.parametrize("codec", ["zlib", "lz4"])
def test_incompressible_frames_are_sent_raw(codec):
    rng = np.random.default_rng(0)
    items = [rng.random(200_000) for _ in range(3)]  # 1.6 MB of random doubles each
    header, frames, back = _wire(items, codec)
    for x, y in zip(items, back, strict=True):
        np.testing.assert_array_equal(x, y)
        assert y.flags.writeable
    codecs = header.get("compression") or (None,) * len(frames)
    assert codecs[1:] == (None, None, None)


def test_zlib_frames_arrive_writable():
    items = [np.zeros(100_000)]  # compresses; zlib gives bytes, which numpy would wrap read-only
    header, _, back = _wire(items, "zlib")
    assert header["compression"][1] == "zlib"
    assert back[0].flags.writeable
    back[0][0] = 1.0


def test_compression_argument_is_checked():
    assert check_compression("AUTO") == "AUTO"
    assert check_compression(None) is None
    assert check_compression("LZ4") == "lz4"
    with pytest.raises(ValueError, match=r"compression must be 'AUTO', None or one of lz4, zstd, "
                                         r"snappy, zlib; got 'brotli'"):
        check_compression("brotli")
    with pytest.raises(ValueError, match="got 'GZIP'"):  # a snapshot's codec, not a wire codec
        check_compression("GZIP")
    with pytest.raises(ValueError, match="got 3"):
        check_compression(3)


def test_register_dataset_refuses_an_unknown_codec():
    # refused before any cluster is contacted
    with pytest.raises(ValueError, match="compression must be 'AUTO', None or one of"):
        dds.register_dataset("tcp://127.0.0.1:1", dds.Dataset.range(3), compression="bzip9")


def test_codec_choice():
    assert choose_codec("AUTO", ["lz4", "zlib"]) == "lz4"
    assert choose_codec("AUTO", ["zlib"]) is None  # too slow for AUTO
    assert choose_codec("zlib", ["lz4", "zlib"]) == "zlib"
    assert choose_codec("zlib", ["lz4"]) is None  # the reader cannot decompress it
    assert choose_codec(None, ["lz4"]) is None
    assert choose_codec("AUTO", None) is None


def test_reader_policy_no_codecs_on_the_same_host():
    assert reader_codecs("tcp://127.0.0.1:4000", "127.0.0.1") is None
    assert reader_codecs("tcp://10.0.0.5:4000", "10.0.0.5") is None
    assert reader_codecs("inproc://10.0.0.5/1/2", "10.0.0.7") is None
    assert "lz4" in reader_codecs("tcp://10.0.0.6:4000", "10.0.0.5")
    with dask.config.set({"dataservice.client.compression": "always"}):
        assert "lz4" in reader_codecs("tcp://127.0.0.1:4000", "127.0.0.1")
    with dask.config.set({"dataservice.client.compression": "never"}):
        assert reader_codecs("tcp://10.0.0.6:4000", "10.0.0.5") is None
    with dask.config.set({"dataservice.client.compression": "sometimes"}), \
            pytest.raises(ValueError, match="must be 'auto', 'always' or 'never'"):
        reader_codecs("tcp://10.0.0.6:4000", "10.0.0.5")


def _served(*workers):
    stats = [w.extensions["dataservice"].stats for w in workers]
    return sum(s["batches_served"] for s in stats), sum(s["batches_compressed"] for s in stats)


def _compressible(i):
    return np.full(16_384, i, np.float32)  # 64 KiB


def _random(i):
    return np.random.default_rng(i).random(8192)  # 64 KiB of random doubles


@pytest.mark.cluster
@pytest.mark.parametrize("compression", ["AUTO", "lz4"])
@gen_cluster(client=True, config={"dataservice.client.compression": "always"})
async def test_compressed_read_through_a_cluster(c, s, a, b, compression):
    ds = await distribute(dds.Dataset.range(500).map(_compressible), "distributed_epoch", c,
                          compression=compression)
    out = await read(ds)
    assert sorted(int(x[0]) for x in out) == list(range(500))
    for x in out:
        np.testing.assert_array_equal(x, np.full(16_384, x[0], np.float32))
    served, compressed = _served(a, b)
    assert served > 0 and compressed == served


@pytest.mark.cluster
@gen_cluster(client=True, config={"dataservice.client.compression": "always"})
async def test_incompressible_elements_travel_raw(c, s, a, b):
    ds = await distribute(dds.Dataset.range(200).map(_random), "distributed_epoch", c)
    out = await read(ds)
    got = {round(float(x[0]), 12) for x in out}
    assert got == {round(float(_random(i)[0]), 12) for i in range(200)}
    served, compressed = _served(a, b)
    assert served > 0 and compressed == 0


@pytest.mark.cluster
@gen_cluster(client=True, config={"dataservice.client.compression": "always"})
async def test_compression_none_sends_raw(c, s, a, b):
    ds = await distribute(dds.Dataset.range(300).map(_compressible), "parallel_epochs", c,
                          compression=None)
    out = await read(ds)
    assert sorted(int(x[0]) for x in out) == sorted(list(range(300)) * 2)  # OFF: each worker
    served, compressed = _served(a, b)
    assert served > 0 and compressed == 0


@pytest.mark.cluster
@gen_cluster(client=True)
async def test_same_host_reads_are_not_compressed_by_default(c, s, a, b):
    ds = await distribute(dds.Dataset.range(300).map(_compressible), "distributed_epoch", c)
    out = await read(ds)
    assert sorted(int(x[0]) for x in out) == list(range(300))
    served, compressed = _served(a, b)
    assert served > 0 and compressed == 0


@pytest.mark.process
def test_malloc_tuning_config_applies_mallopt():
    """In a fresh process (mallopt cannot be undone): the key tunes, its absence does not."""
    code = (
        "import dask, dask_dataservice\n"
        "from dask_dataservice.service.protocol._malloc import tune_malloc_from_config as t\n"
        "print(t())\n"
        "dask.config.set({'dataservice.malloc-tuning': True})\n"
        "print(t(), t())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    expected = ["False", "True", "True"] if sys.platform.startswith("linux") else ["False"] * 3
    assert out == expected


def test_element_batches_still_pickle_by_protocol_5():
    # the pickle frame itself: elements without buffers stay in band
    items = [1, "a", (2.0, None)]
    header, frames, back = _wire(items)
    assert back == items and len(frames) == 1
    assert pickle.loads(frames[0]) == items


def _worker_stats(dask_worker):
    return dict(dask_worker.extensions["dataservice"].stats)


@pytest.mark.process
def test_compressed_read_from_worker_processes():
    """Worker processes (nannies) compress, this process decompresses: exact elements, every
    batch compressed; a second dataset, of random data, travels raw."""
    from distributed import Client, LocalCluster

    with dask.config.set({"dataservice.client.compression": "always"}), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                         dashboard_address="127.0.0.1:0", host="127.0.0.1") as cluster, \
            Client(cluster) as client:
        dds.install(client)
        ds = dds.Dataset.range(400).map(_compressible).apply(
            dds.distribute("parallel_epochs", client, compression="lz4"))
        out = [int(x[0]) for x in ds]
        # OFF: each worker produces the whole range, in order
        assert sorted(out) == sorted(list(range(400)) * 2)
        stats = client.run(_worker_stats)
        assert all(s["batches_served"] > 0 for s in stats.values())
        assert all(s["batches_compressed"] == s["batches_served"] for s in stats.values())
        before = sum(s["batches_compressed"] for s in stats.values())
        rnd = dds.Dataset.range(100).map(_random).apply(
            dds.distribute("distributed_epoch", client))
        got = sorted(round(float(x[0]), 12) for x in rnd)
        assert got == sorted(round(float(_random(i)[0]), 12) for i in range(100))
        after = sum(s["batches_compressed"] for s in client.run(_worker_stats).values())
        assert after == before


@pytest.mark.cluster
@gen_cluster(client=True, config={"dataservice.client.compression": "always"})
async def test_the_same_pipeline_with_another_compression_is_another_dataset(c, s, a, b):
    # before: registering it again returned the first registration, and its compression
    ds = dds.Dataset.range(300).map(_compressible)
    raw = await asyncio.to_thread(dds.register_dataset, c, ds, compression=None)
    lz4 = await asyncio.to_thread(dds.register_dataset, c, ds, compression="lz4")
    assert raw != lz4
    assert await asyncio.to_thread(dds.register_dataset, c, ds, compression=None) == raw
    out = await read(await distribute(ds, "distributed_epoch", c, compression="lz4"))
    assert sorted(int(x[0]) for x in out) == list(range(300))
    served, compressed = _served(a, b)
    assert served > 0 and compressed == served
