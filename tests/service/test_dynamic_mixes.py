"""``sample_from_datasets`` / ``choose_from_datasets`` under DYNAMIC sharding: each data
input's splits are handed out (issue 24, section 5)."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from _helpers import distribute, read  # noqa: E402

import dask_dataservice as dds
from dask_dataservice.testing import gen_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]

THREE = [("127.0.0.1", 1)] * 3


@gen_cluster(client=True, nthreads=THREE)
async def test_sample_and_choose_from_datasets_under_dynamic_sharding(c, s, a, b, w):
    """``dynamic_sharding_test.py``: ``testSampleFromDatasets`` (three data workers, weights
    .6/.3/.1: the input of the largest weight comes most often) and ``testChooseFromDatasets``
    (num_workers=3: every worker runs the whole choice dataset, the data inputs' splits are
    handed out). Inputs are finite here (a ``repeat()`` inside an input is refused under
    DYNAMIC): the sample shows every element of every input read exactly once, and, with
    ``stop_on_empty_dataset=True`` (every element drawn while all inputs were live, as from
    TensorFlow's endless inputs), the weights in the counts, each element at most once."""
    inputs = [dds.Dataset.range(1000 * k, 1000 * k + 300) for k in range(3)]
    mixed = dds.Dataset.sample_from_datasets(inputs, [.6, .3, .1], seed=5)
    out = [int(x) for x in await read(await distribute(mixed, "DYNAMIC", c))]
    assert sorted(out) == [1000 * k + i for k in range(3) for i in range(300)]
    mixed = dds.Dataset.sample_from_datasets(inputs, [.6, .3, .1], stop_on_empty_dataset=True)
    out = [int(x) for x in await read(await distribute(mixed, "DYNAMIC", c))]
    assert len(set(out)) == len(out)
    freqs = collections.Counter(x // 1000 for x in out)
    assert freqs[0] > freqs[1] > freqs[2], freqs

    words = ["foo", "bar", "baz"]
    choice_array = np.random.default_rng(7).integers(3, size=15)
    datasets = [dds.Dataset.from_tensor_slices([word] * 60) for word in words]
    chosen = dds.Dataset.choose_from_datasets(
        datasets, dds.Dataset.from_tensor_slices(choice_array))
    out = await read(await distribute(chosen, "DYNAMIC", c))
    assert sorted(str(x) for x in out) == sorted([words[i] for i in choice_array] * 3)

    with pytest.raises(dds.errors.NotSplittableError, match=(
            r"repeat\(\) inside an input of zip, concatenate, sample_from_datasets or "
            r"choose_from_datasets cannot be split")):
        await distribute(dds.Dataset.sample_from_datasets([inputs[0].repeat(), inputs[1]]),
                         "DYNAMIC", c)
