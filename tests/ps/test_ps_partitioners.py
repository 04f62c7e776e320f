"""Partitioners: TensorFlow's tables and errors, and "div" partitioning."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import dask_dataservice as dds
from dask_dataservice.ps.partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Partitioner,
    check_partitions,
    div_offsets,
)

pytestmark = pytest.mark.pure


def test_exported_as_module():
    assert dds.partitioners.FixedShardsPartitioner is FixedShardsPartitioner
    assert issubclass(MinSizePartitioner, Partitioner)


# The examples of TensorFlow's partitioner docstrings (shape, dtype -> partitions).
@pytest.mark.parametrize(
    "partitioner, shape, expected",
    [
        (FixedShardsPartitioner(num_shards=2), (10, 3), [2, 1]),
        (FixedShardsPartitioner(num_shards=20), (10, 3), [10, 1]),
        (FixedShardsPartitioner(num_shards=3), (7,), [3]),
        (MinSizePartitioner(min_shard_bytes=4, max_shards=2), (6, 1), [2, 1]),
        (MinSizePartitioner(min_shard_bytes=4, max_shards=10), (6, 1), [6, 1]),
        (MaxSizePartitioner(max_shard_bytes=4), (6, 1), [6, 1]),
        (MaxSizePartitioner(max_shard_bytes=4, max_shards=2), (6, 1), [2, 1]),
        (MaxSizePartitioner(max_shard_bytes=1024), (6, 1), [1, 1]),
    ],
)
def test_tensorflow_examples(partitioner, shape, expected):
    assert partitioner(shape, np.float32) == expected
    assert partitioner(shape=shape, dtype="float32") == expected


def test_min_size_arithmetic():
    # 1024 x 1024 float32 = 4 MiB; 256 KiB shards -> 16, capped by max_shards.
    assert MinSizePartitioner(256 << 10, max_shards=2)((1024, 1024), "f4") == [2, 1]
    assert MinSizePartitioner(256 << 10, max_shards=100)((1024, 1024), "f4") == [16, 1]
    # ceil: 4 MiB + 4 bytes needs 17 shards of 256 KiB
    assert MinSizePartitioner(256 << 10, max_shards=100)((1024 * 1024 + 1,), "f4") == [17]
    # small variables: at least one shard
    assert MinSizePartitioner()((3, 3), "f8") == [1, 1]
    # never more shards than rows
    assert MinSizePartitioner(1, max_shards=100)((3, 1000), "f8") == [3, 1]
    # defaults: min_shard_bytes=256 KiB, max_shards=1
    assert MinSizePartitioner()((1 << 20, 64), "f4") == [1, 1]


def test_max_size_arithmetic():
    # rows of 3 float32 = 12 bytes; 30 bytes hold 2 rows; 10 rows need 5 shards
    assert MaxSizePartitioner(30)((10, 3), "f4") == [5, 1]
    # a row larger than the limit still gets one row per shard
    assert MaxSizePartitioner(1)((4, 100), "f8") == [4, 1]
    assert MaxSizePartitioner(1, max_shards=3)((4, 100), "f8") == [3, 1]
    # 1M x 64 float32 in 128 MiB shards -> 2
    assert MaxSizePartitioner(128 << 20)((1_000_000, 64), "f4") == [2, 1]


def test_strings_count_bytes_per_string():
    assert MinSizePartitioner(16, max_shards=10, bytes_per_string=16)((4,), np.str_) == [4]
    assert MinSizePartitioner(64, max_shards=10, bytes_per_string=16)((4,), object) == [1]
    assert MaxSizePartitioner(32, bytes_per_string=8)((8,), "U") == [2]


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: MinSizePartitioner(min_shard_bytes=0), "min_shard_bytes"),
        (lambda: MinSizePartitioner(max_shards=0), "max_shards"),
        (lambda: MinSizePartitioner(bytes_per_string=0), "bytes_per_string"),
        (lambda: MaxSizePartitioner(max_shard_bytes=0), "max_shard_bytes"),
        (lambda: MaxSizePartitioner(10, max_shards=-1), "max_shards"),
        (lambda: MaxSizePartitioner(10, bytes_per_string=0), "bytes_per_string"),
    ],
)
def test_invalid_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_only_axis_zero_and_no_scalars():
    with pytest.raises(ValueError, match="axis 0"):
        FixedShardsPartitioner(2)((4, 4), "f4", axis=1)
    with pytest.raises(ValueError, match="rank-0"):
        MinSizePartitioner()((), "f4")


def test_div_offsets():
    # TensorFlow's docstring: 13 ids over 5 shards -> [[0,1,2],[3,4,5],[6,7,8],[9,10],[11,12]]
    offsets = div_offsets(13, 5)
    assert offsets == [0, 3, 6, 9, 11, 13]
    assert [list(range(a, b)) for a, b in zip(offsets, offsets[1:], strict=False)] == [
        [0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10], [11, 12]]
    assert [b - a for a, b in zip(offsets, offsets[1:], strict=False)] == [3, 3, 3, 2, 2]
    assert div_offsets(10, 4) == [0, 3, 6, 8, 10]
    assert div_offsets(4, 4) == [0, 1, 2, 3, 4]
    assert div_offsets(3, 5) == [0, 1, 2, 3]  # no more shards than rows
    assert div_offsets(8, 1) == [0, 8]


@pytest.mark.parametrize("bad", [[0, 1], [2, 2], [], None, (3, 1, 2), [1.5, 1], "2"])
def test_check_partitions_rejects(bad):
    with pytest.raises(ValueError, match="variable_partitioner must return"):
        check_partitions(bad)


def test_check_partitions_accepts():
    assert check_partitions([3, 1, 1]) == 3
    assert check_partitions((1,)) == 1
    assert check_partitions([np.int64(2), 1]) == 2


def test_picklable_and_comparable():
    p = MinSizePartitioner(min_shard_bytes=4, max_shards=2)
    q = pickle.loads(pickle.dumps(p))
    assert q == p and hash(q) == hash(p)
    assert q((6, 1), "f4") == [2, 1]
    assert repr(FixedShardsPartitioner(3)) == "FixedShardsPartitioner(num_shards=3)"
