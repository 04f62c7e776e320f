"""Lazy split enumeration (issue 9, 2.7): what the dispatcher's split cursor indexes into."""

from __future__ import annotations

import pickle

import pytest

from dask_dataservice.data.splits import IndexRange, ListSplitProvider, index_ranges

pytestmark = pytest.mark.pure


@pytest.mark.parametrize("n, size", [(0, 3), (1, 3), (9, 3), (10, 3), (10, 1), (5, 100)])
def test_index_ranges_match_the_eager_enumeration(n, size):
    eager = [IndexRange(i, min(i + size, n)) for i in range(0, n, size)]
    lazy = index_ranges(n, size)
    assert len(lazy) == len(eager) and list(lazy) == eager and lazy == eager
    assert [lazy[i] for i in range(len(lazy))] == eager
    assert [lazy[-i] for i in range(1, len(lazy) + 1)] == eager[::-1]
    assert lazy[1::2] == eager[1::2]  # a static shard's splits
    assert pickle.loads(pickle.dumps(lazy)) == lazy


def test_index_ranges_of_an_endless_range_cost_nothing():
    lazy = index_ranges(2**55, 65_536)
    assert len(lazy) == 2**39
    assert lazy[2**39 - 1] == IndexRange(2**55 - 65_536, 2**55)
    assert len(pickle.dumps(lazy)) < 100
    with pytest.raises(IndexError, match="out of range"):
        lazy[2**39]
    with pytest.raises(ValueError, match="split_size must be a positive integer"):
        index_ranges(10, 0)


def test_list_provider_reads_a_lazy_sequence_on_demand():
    provider = ListSplitProvider(index_ranges(2**55, 65_536))
    assert provider.splits == index_ranges(2**55, 65_536)  # not copied into a list
    assert [provider.get_next(), provider.get_next()] == [IndexRange(0, 65_536),
                                                           IndexRange(65_536, 131_072)]
    assert provider.num_splits == 2**39
