"""``repr(dataset)``: the pipeline as its calls, and its cardinality, without running anything."""

from __future__ import annotations

import numpy as np
import pytest

import dask_dataservice as dds
from dask_dataservice import Dataset

pytestmark = pytest.mark.pure


def double(x):
    return 2 * x


@pytest.mark.parametrize("build, expected", [
    (lambda: Dataset.range(1000).shuffle(1024).batch(32),
     "<Dataset.range(1000).shuffle(1024).batch(32) cardinality=32>"),
    (lambda: Dataset.range(2, 10, 2).map(double, num_parallel_calls=4).repeat().take(3),
     "<Dataset.range(2, 10, 2).map(test_data_repr.double, 4).repeat().take(3) cardinality=3>"),
    (lambda: Dataset.range(10).filter(lambda x: x > 1).batch(4, drop_remainder=True),
     "<Dataset.range(10).filter(test_data_repr.<lambda>.<locals>.<lambda>).batch(4, True) "
     "cardinality=UNKNOWN>"),
    (lambda: Dataset.range(5).repeat(), "<Dataset.range(5).repeat() cardinality=INFINITE>"),
    (lambda: Dataset.from_tensor_slices({"x": np.zeros((5, 3), np.float32),
                                         "y": np.arange(5)}).prefetch(2),
     "<Dataset.from_tensor_slices({'x': <float32 (5, 3)>, 'y': <int64 (5,)>}).prefetch(2) "
     "cardinality=5>"),
    (lambda: Dataset.zip(Dataset.range(3), Dataset.range(4)).enumerate(),
     "<Dataset.zip((Dataset.range(3), Dataset.range(4))).enumerate() cardinality=3>"),
    (lambda: Dataset.zip({"a": Dataset.range(3), "b": Dataset.range(3)}),
     "<Dataset.zip({'a': Dataset.range(3), 'b': Dataset.range(3)}) cardinality=3>"),
    (lambda: Dataset.range(3).concatenate(Dataset.range(2)).shard(2, 1),
     "<Dataset.range(3).concatenate(Dataset.range(2)).shard(2, 1) cardinality=2>"),
])
def test_exact_reprs(build, expected):
    assert repr(build()) == expected


def test_long_arguments_are_shortened(tmp_path):
    for i in range(6):
        (tmp_path / f"f{i}.txt").write_text("x\n")
    text = repr(Dataset.from_text_lines(str(tmp_path)))
    first = repr(str(tmp_path / "f0.txt"))
    assert text.startswith(f"<Dataset.from_files(({first[:28]}...{first[-29:]}, "), text
    assert text.endswith("f3.txt', ... 6 items), dask_dataservice.data.readers.text_lines) "
                         "cardinality=UNKNOWN>"), text
    assert "\n" not in repr(Dataset.from_tensor_slices(np.zeros((1000, 1000))))


def test_a_service_source_shows_its_job_without_the_secret_and_asks_nothing():
    # an address nobody listens on: a repr (and cardinality) makes no request
    ds = dds.from_dataset_id("distributed_epoch", "tcp://127.0.0.1:1", "7:s3cr3t",
                             job_name="shared", consumer_index=1, num_consumers=2)
    assert repr(ds) == (
        "<DistributedDataset Dataset.from_dataset_id(processing_mode=DYNAMIC, "
        "service='tcp://127.0.0.1:1', dataset_id='7', job_name='shared', consumer_index=1, "
        "num_consumers=2) cardinality=INFINITE>")
    local = dds.from_dataset_id("OFF", "tcp://127.0.0.1:1", "7:s3cr3t").map(double).batch(2)
    assert repr(local) == (
        "<Dataset.from_dataset_id(processing_mode=OFF, service='tcp://127.0.0.1:1', "
        "dataset_id='7').map(test_data_repr.double).batch(2) cardinality=UNKNOWN>")
    assert "s3cr3t" not in repr(ds) + repr(local)
