"""DYNAMIC and FILE sharding of pipelines with several sources: zip and concatenate.

tf.data service shards both: the components of a zip share each split (so elements stay
paired), and a concatenation hands out the splits of its first input, then of its second.
Real in-process clusters; each read is checked element by element (exactly once, pairs intact).
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
from _helpers import distribute, py, read

import dask_dataservice as dds
from dask_dataservice.testing import gen_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]


@gen_cluster(client=True, nthreads=[("", 1)] * 2)
async def test_dynamic_concatenate_exactly_once(c, s, a, b):
    ds = dds.Dataset.range(3000).concatenate(dds.Dataset.range(10_000, 12_000).map(lambda x: -x))
    out = await read(await distribute(ds, "distributed_epoch", c))
    want = list(range(3000)) + [-x for x in range(10_000, 12_000)]
    assert sorted(out) == sorted(want)
    # both workers took part
    produced = [w.extensions["dataservice"].stats["elements_produced"] for w in (a, b)]
    assert all(n > 0 for n in produced), produced


@gen_cluster(client=True, nthreads=[("", 1)] * 2)
async def test_dynamic_zip_keeps_pairs(c, s, a, b):
    xs = np.arange(4000, dtype=np.int64)
    ds = dds.Dataset.zip({"i": dds.Dataset.range(4000),
                          "sq": dds.Dataset.from_tensor_slices(xs * xs)})
    out = [py(x) for x in await read(await distribute(ds, "distributed_epoch", c))]
    assert len(out) == 4000
    assert all(e["sq"] == e["i"] * e["i"] for e in out)  # every pair intact
    assert sorted(e["i"] for e in out) == list(range(4000))


@gen_cluster(client=True, nthreads=[("", 1)] * 2)
async def test_dynamic_nested_with_repeat_after(c, s, a, b):
    inner = dds.Dataset.zip(dds.Dataset.range(500), dds.Dataset.range(1000, 1500))
    ds = inner.concatenate(dds.Dataset.range(7)).repeat(2)
    out = await read(await distribute(ds, "distributed_epoch", c))
    want = [(i, 1000 + i) for i in range(500)] + list(range(7))
    assert collections.Counter(map(str, out)) == collections.Counter(map(str, want * 2))


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_dynamic_refuses_a_component_that_cannot_share_splits(c, s, a):
    gen = dds.Dataset.from_generator(lambda: iter(range(3)))
    with pytest.raises(ValueError, match="from_generator"):
        await read(await distribute(dds.Dataset.range(5).concatenate(gen), "distributed_epoch", c))
