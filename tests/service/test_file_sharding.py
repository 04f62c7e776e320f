"""FILE sharding of TensorFlow's file pipelines: the file names below interleave / flat_map /
map, and FILE_OR_DATA's fall back to DATA (issue 24, section 3)."""

from __future__ import annotations

import collections
import logging
import re
import tempfile
from pathlib import Path

import pytest
from _helpers import distribute, read  # noqa: E402
from distributed.utils_test import captured_logger

import dask_dataservice as dds
from dask_dataservice.data.tfrecord import read_records, write_records
from dask_dataservice.service.worker import current_task
from dask_dataservice.testing import gen_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]

#: gen_cluster names its workers 0, 1: the fixed worker list of static sharding.
FIXED = {"dataservice.dispatcher.worker-addresses": ["0", "1"]}
TWO = [("127.0.0.1", 1), ("127.0.0.1", 1)]
LOGGER = "dask_dataservice.service.protocol._job_checks"


def _records(n_files: int, n_records: int) -> list[str]:
    """TFRecord files of ``b"Record r of file f"``, as TensorFlow's tf_record_test_base."""
    directory = Path(tempfile.mkdtemp())
    paths = []
    for f in range(n_files):
        path = str(directory / f"tf_record.{f}.txt")
        write_records(path, (b"Record %d of file %d" % (r, f) for r in range(n_records)))
        paths.append(path)
    return paths


def tag(x):
    """(worker index, element): which fixed worker produced the element."""
    return current_task()["worker_index"], bytes(x)


def by_worker(out):
    groups = collections.defaultdict(list)
    for index, x in out:
        groups[index].append(x)
    return dict(groups)


def read_whole(path):
    """A ``map`` reader: the whole file as one element (its records joined)."""
    return b"|".join(read_records(path))


@gen_cluster(client=True, nthreads=TWO, config=FIXED)
async def test_file_sharding_finds_the_file_names_below_the_readers(c, s, a, b):
    """``auto_shard_test.py`` (tf.data service): ``testTFRecordDataset_AutoShard`` (list_files
    + flat_map, FILE and FILE_OR_DATA) and ``testInterleaveDataset``; the same with
    ``from_tensor_slices(filenames)`` (TensorFlow's ``auto_shard_dataset_test.py``
    ``testTFRecordDataset``/``testFlatMapReaderPipeline``) and a ``map`` reading whole files.
    Each worker reads every other file whole, each file exactly once, in its own order."""
    paths = _records(5, 3)
    record = [[b"Record %d of file %d" % (r, f) for r in range(3)] for f in range(5)]
    flat = {i: [x for f in range(i, 5, 2) for x in record[f]] for i in (0, 1)}
    # cycle_length=2: files i and i+2 alternate, then file i+4 (worker 0) alone
    woven = {0: [record[f][r] for r in range(3) for f in (0, 2)] + record[4],
             1: [record[f][r] for r in range(3) for f in (1, 3)]}
    whole = {i: [b"|".join(record[f]) for f in range(i, 5, 2)] for i in (0, 1)}
    pattern = str(Path(paths[0]).parent / "tf_record.*.txt")
    cases = [
        (dds.Dataset.list_files(pattern).flat_map(dds.Dataset.from_tfrecord), flat),
        (dds.Dataset.from_tensor_slices(paths).flat_map(dds.Dataset.from_tfrecord), flat),
        (dds.Dataset.from_tensor_slices(paths).interleave(
            dds.Dataset.from_tfrecord, cycle_length=2, num_parallel_calls=2).prefetch(4), woven),
        (dds.Dataset.from_tensor_slices(paths).map(read_whole), whole),
    ]
    for mode in ("FILE", "FILE_OR_DATA"):
        for pipeline, expected in cases:
            out = by_worker(await read(await distribute(pipeline.map(tag), mode, c)))
            assert out == expected, (mode, pipeline)


@gen_cluster(client=True, nthreads=TWO, config=FIXED)
async def test_every_sharding_policy_reads_the_file_pipeline(c, s, a, b):
    """``auto_shard_test.py`` ``testEnumerateShardingPolicies``: every policy reads
    ``list_files(...).flat_map(reader)`` with no error; here with the exact elements: each
    record once under DYNAMIC, FILE, DATA and FILE_OR_DATA, once per worker under OFF and
    under HINT without a ``SHARD_HINT`` (``testTFRecordDataset_NoShard``)."""
    paths = _records(4, 2)
    records = sorted(b"Record %d of file %d" % (r, f) for f in range(4) for r in range(2))
    pipeline = dds.Dataset.list_files(paths).flat_map(dds.Dataset.from_tfrecord)
    for policy in dds.ShardingPolicy:
        out = sorted(bytes(x) for x in await read(await distribute(pipeline, policy, c)))
        copies = 2 if policy in (dds.ShardingPolicy.OFF, dds.ShardingPolicy.HINT) else 1
        assert out == sorted(records * copies), policy


@gen_cluster(client=True, nthreads=TWO, config=FIXED)
async def test_file_or_data_falls_back_to_data_and_says_so(c, s, a, b):
    """``auto_shard_test.py``: ``testRangeDataset_AutoShard`` (FILE_OR_DATA over range is
    DATA), ``testRangeDataset_FileShard`` (FILE refuses range: "Found an unshardable source
    dataset"), ``testTFRecordDataset_FewerFilesThanWorkers`` (FILE refuses one file for two
    workers, "not enough for the required 2 shards/workers"; FILE_OR_DATA reads it with DATA
    sharding here, where TensorFlow raises: see docs/compatibility.md),
    ``testTFRecordDataset_ReadFromAllWorkers`` (static sharding read with ANY is refused). A
    log line on the dispatcher says which policy FILE_OR_DATA chose and why."""
    paths = _records(3, 4)
    one_file = dds.Dataset.from_tensor_slices(paths[:1]).interleave(dds.Dataset.from_tfrecord)
    with captured_logger(LOGGER, level=logging.INFO) as log:
        out = by_worker(await read(await distribute(one_file.map(tag), "FILE_OR_DATA", c)))
        assert out == {0: [b"Record 0 of file 0", b"Record 2 of file 0"],
                       1: [b"Record 1 of file 0", b"Record 3 of file 0"]}
        out = by_worker(await read(await distribute(
            dds.Dataset.range(7).map(lambda x: (current_task()["worker_index"], x)),
            "FILE_OR_DATA", c)))
        assert out == {0: [0, 2, 4, 6], 1: [1, 3, 5]}
        three = dds.Dataset.from_tensor_slices(paths).interleave(dds.Dataset.from_tfrecord)
        out = by_worker(await read(await distribute(three.map(tag), "FILE_OR_DATA", c)))
        assert sorted(out) == [0, 1] and sorted(out[0] + out[1]) == sorted(
            b"Record %d of file %d" % (r, f) for f in range(3) for r in range(4))
    lines = re.sub(r"dataset \d+", "dataset N", log.getvalue()).splitlines()
    assert len(lines) == 3, lines
    assert lines[0].startswith("dataservice: FILE_OR_DATA sharding of dataset N chose DATA, "
                               "since FILE sharding does not apply: dataset N has 1 files, "
                               "fewer than the 2 workers: not enough for the required 2 "
                               "shards/workers")
    assert lines[1] == (
        "dataservice: FILE_OR_DATA sharding of dataset N chose DATA, since FILE sharding does "
        "not apply: dataset N: found an unshardable source dataset: range() is not a list of "
        "files; FILE sharding reads list_files, from_files, a format reader (from_csv, "
        "from_tfrecord, ...) or from_tensor_slices(filenames) read by interleave, flat_map "
        "or map")
    assert lines[2] == ("dataservice: FILE_OR_DATA sharding of dataset N chose FILE: its 3 "
                        "files are shared among 2 workers")

    with pytest.raises(ValueError, match=r"^FILE sharding does not apply: dataset \d+: found an "
                       r"unshardable source dataset: range\(\) is not a list of files"):
        await read(await distribute(dds.Dataset.range(20), "FILE", c))
    with pytest.raises(ValueError, match=r"^FILE sharding does not apply: dataset \d+ has 1 "
                       r"files, fewer than the 2 workers: not enough for the required 2 "
                       r"shards/workers \(each worker reads whole files\) \(use DATA or "
                       r"FILE_OR_DATA\)$"):
        await read(await distribute(one_file.map(tag), "FILE", c))
    with pytest.raises(ValueError, match=re.escape(
            "static sharding (FILE) reads each worker's shard from that worker's host: "
            "target_workers='ANY' is not allowed (use 'AUTO' or 'LOCAL')")):
        await read(await distribute(three, "FILE_OR_DATA", c, target_workers="ANY"))
    strings = dds.Dataset.from_tensor_slices(["a", "b"])  # names no reader reads
    with pytest.raises(ValueError, match=r"from_tensor_slices\(\) of strings that no "
                       "interleave, flat_map or map reads as file names"):
        await read(await distribute(strings, "FILE", c))


@gen_cluster(client=True, nthreads=TWO)
async def test_dynamic_sharding_hands_out_one_file_name_per_split(c, s, a, b):
    """``dynamic_sharding_test.py`` ``DynamicShardingFilesTest.testShuffleFiles``: the file
    names of ``from_tensor_slices(filenames).interleave(reader)`` are handed out one per
    split, so each file is read whole by one worker and every record exactly once."""
    paths = _records(5, 5)
    ds = dds.Dataset.from_tensor_slices(paths[::-1]).interleave(dds.Dataset.from_tfrecord)
    assert len(ds.splits()) == 5
    out = await read(await distribute(ds, "DYNAMIC", c))
    assert sorted(bytes(r) for r in out) == sorted(
        b"Record %d of file %d" % (r, f) for f in range(5) for r in range(5))
