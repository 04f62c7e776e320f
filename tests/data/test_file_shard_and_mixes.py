"""Where FILE sharding finds a pipeline's files, and the splits of sample/choose_from_datasets
(the pipeline library alone: no cluster)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from dask_dataservice.data import Dataset
from dask_dataservice.data.splits import (
    ComponentSplit,
    IndexRange,
    IndexRanges,
    ListSplitProvider,
    MixRouter,
    mixed_splits,
)

pytestmark = pytest.mark.pure

NAMES = [f"part-{i}" for i in range(300)]


def read(path):
    return Dataset.from_tensor_slices([f"{path}/a", f"{path}/b"])


def test_file_names_below_the_readers_are_a_file_source():
    """TensorFlow's auto-shard walks through the ops that pass elements on and the readers
    (interleave, flat_map) to the file names; so does a map here."""
    names = Dataset.from_tensor_slices(NAMES)
    shardable = [
        names.interleave(read, cycle_length=2).batch(3).prefetch(1),
        names.shuffle(10, seed=1).flat_map(read),
        names.map(len),
        Dataset.from_tensor_slices(np.array([b"x", b"y"])).flat_map(read),
        Dataset.list_files(__file__),
        names.flat_map(read).concatenate(Dataset.list_files(__file__).flat_map(read)),
    ]
    for ds in shardable:
        assert ds.why_not_file_shardable() is None and ds.is_file_based, ds
    # one file name per split, whatever their number (the default would cut 300 in 2s)
    assert names.flat_map(read).splits() == IndexRanges(300, 1)
    assert names.flat_map(read).splits(7) == IndexRanges(300, 7)  # asked for: as asked
    assert Dataset.from_tensor_slices(NAMES).splits() == IndexRanges(300, 2)  # no reader
    both = names.flat_map(read).concatenate(Dataset.list_files(__file__).flat_map(read))
    assert [s.split for s in both.splits()][:300] == list(IndexRanges(300, 1))
    assert len(both.splits()) == 301


@pytest.mark.parametrize(("ds", "reason"), [
    (Dataset.range(5).map(str), "range() is not a list of files"),
    (Dataset.from_tensor_slices(NAMES), "from_tensor_slices() of strings that no interleave, "
                                        "flat_map or map reads as file names"),
    (Dataset.from_tensor_slices([[1, 2]]).flat_map(read), "from_tensor_slices() is not a list"),
    (Dataset.from_tensor_slices(np.array([["a", "b"]])).flat_map(read),
     "from_tensor_slices() is not a list"),
    (Dataset.zip(Dataset.list_files(__file__), Dataset.range(1)), "range() is not a list"),
    (Dataset.list_files(__file__).shard(2, 0), "shard(2, 0) comes after the source"),
])
def test_what_is_not_a_file_source_says_why(ds, reason):
    assert not ds.is_file_based or ds.why_not_file_shardable()
    assert reason in ds.why_not_file_shardable()


def test_mixed_splits_follow_the_rates():
    parts = [IndexRanges(60, 1), IndexRanges(30, 1), IndexRanges(10, 1), IndexRanges(5, 1)]
    plan = mixed_splits(parts, [.6, .3, .1, 0.0], [60, 30, 10, 5])
    assert len(plan) == 105 and all(isinstance(s, ComponentSplit) for s in plan)
    first = [s.component for s in plan[:50]]
    assert [first.count(k) for k in range(4)] == [30, 15, 5, 0]  # the rates, in any prefix
    assert [s.component for s in plan[-5:]] == [3] * 5  # weight 0: last
    for k, part in enumerate(parts):  # each input's splits once, in order
        assert [s.split for s in plan if s.component == k] == list(part)
    # elements per split count: an input cut in fewer, larger splits comes less often
    plan = mixed_splits([IndexRanges(40, 4), IndexRanges(40, 1)], [.5, .5], [40, 40])
    assert [s.component for s in plan[:10]] == [1, 1, 0, 1, 1, 1, 1, 0, 1, 1]


def test_sample_and_choose_read_their_inputs_splits():
    inputs = [Dataset.range(0, 20), Dataset.range(100, 110), Dataset.range(200, 205)]
    mixed = Dataset.sample_from_datasets(inputs, [.6, .3, .1], seed=3)
    plan = mixed.splits(2)
    assert len(plan) == 10 + 5 + 3
    halves = [list(mixed.iterate(ListSplitProvider(plan[i::2]))) for i in (0, 1)]
    assert sorted(halves[0] + halves[1]) == list(range(20)) + list(range(100, 110)) + list(
        range(200, 205))
    assert mixed.repeat(2).splits(2) == plan  # a repeat after the mix: its splits again
    # choose: the choice dataset is not split, every reader runs it whole
    chosen = Dataset.choose_from_datasets(
        [Dataset.from_tensor_slices(["a"] * 4), Dataset.from_tensor_slices(["b"] * 4)],
        Dataset.from_tensor_slices([0, 1, 0, 1]), stop_on_empty_dataset=False)
    plan = chosen.splits(1)
    assert sorted((s.component, s.split.start) for s in plan) == [
        (k, i) for k in (0, 1) for i in range(4)]
    assert [str(x) for x in chosen.iterate(ListSplitProvider(plan))] == ["a", "b", "a", "b"]
    one = Dataset.sample_from_datasets([Dataset.range(3)])  # one input: still tagged
    assert one.splits() == [ComponentSplit(0, IndexRange(i, i + 1)) for i in range(3)]
    assert list(one.iterate(ListSplitProvider(one.splits()))) == [0, 1, 2]


def test_a_mix_router_refuses_an_untagged_split():
    router = MixRouter(ListSplitProvider([IndexRange(0, 1)]), 2)
    with pytest.raises(TypeError, match=re.escape(
            "2 mixed inputs read ComponentSplit splits of inputs 0..1, the provider served "
            "IndexRange(start=0, stop=1)")):
        router.component(1).get_next()
    router = MixRouter(ListSplitProvider([ComponentSplit(1, "x"), ComponentSplit(0, "y")]), 2)
    assert router.component(0).get_next() == "y"  # "x" waits for input 1
    assert router.component(0).get_next() is None
    assert router.component(1).get_next() == "x"
