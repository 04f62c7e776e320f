"""The autocache decision (issue 26, part 3), pure: service/worker/_autocache_policy.py."""

from __future__ import annotations

import pytest

from dask_dataservice.service.worker._autocache_policy import (
    CacheDecision,
    CacheFigures,
    CachePolicy,
)

pytestmark = [pytest.mark.pure, pytest.mark.timeout(30)]

MiB = 1 << 20


def _figures(**kw) -> CacheFigures:
    base = {"produce_seconds": 5e-3, "write_seconds": 0.0, "read_seconds": 0.0,
            "element_bytes": 1024.0, "elements": 10_000, "passes": 0}
    return CacheFigures(**{**base, **kw})


def test_an_expensive_pipeline_is_cached_in_memory_then_served_from_it():
    policy = CachePolicy(memory_bytes=64 * MiB, disk_bytes=1024 * MiB)
    first = policy.decide(_figures())
    assert (first.mode, first.where) == ("put", "memory")
    later = policy.decide(_figures(write_seconds=2e-6, read_seconds=1e-6, passes=1,
                                   complete=True, cached_in="memory"))
    assert (later.mode, later.where) == ("get", "memory")
    assert "5000.0x cheaper" in later.why


def test_a_pass_larger_than_memory_goes_to_disk_and_one_larger_than_both_is_computed():
    policy = CachePolicy(memory_bytes=1 * MiB, disk_bytes=100 * MiB)
    assert policy.decide(_figures()).where == "disk"  # 10 MB
    big = policy.decide(_figures(elements=1_000_000))  # 1 GB
    assert big == CacheDecision("compute", None,
                                "a pass of 1,024,000,000 bytes fits no cache")
    assert CachePolicy(1 * MiB, 0).decide(_figures()).mode == "compute"  # no disk
    endless = policy.decide(_figures(elements=-1))
    assert endless.mode == "compute" and "endless" in endless.why


def test_a_cheap_pipeline_is_not_worth_the_writes():
    policy = CachePolicy(memory_bytes=64 * MiB)
    d = policy.decide(_figures(produce_seconds=2e-6, write_seconds=3e-6))
    assert d.mode == "compute" and "not cached" in d.why


def test_a_cache_slower_than_the_pipeline_is_dropped():
    """Measured, not assumed: a cache on a slow disk loses to a fast pipeline."""
    policy = CachePolicy(memory_bytes=0, disk_bytes=1024 * MiB)
    d = policy.decide(_figures(produce_seconds=1e-4, read_seconds=2e-4, passes=1,
                               complete=True, cached_in="disk"))
    assert d.mode == "compute" and "dropped" in d.why


def test_a_cache_being_written_is_not_read():
    policy = CachePolicy(memory_bytes=64 * MiB)
    d = policy.decide(_figures(passes=1, cached_in="memory"))
    assert d == CacheDecision("compute", None, "the cache is still being written")


def test_forcing_either_way():
    cheap = _figures(produce_seconds=1e-7, write_seconds=1e-6)
    assert CachePolicy(64 * MiB, force="always").decide(cheap).mode == "put"
    assert CachePolicy(64 * MiB, force="never").decide(_figures()).mode == "compute"
    slow_cache = _figures(produce_seconds=1e-6, read_seconds=1e-3, complete=True,
                          cached_in="memory", passes=1)
    assert CachePolicy(64 * MiB, force="always").decide(slow_cache).mode == "get"


@pytest.mark.parametrize("kwargs, match", [
    ({"memory_bytes": -1}, "must not be negative"),
    ({"memory_bytes": 1, "force": "sometimes"}, "force must be"),
    ({"memory_bytes": 1, "min_speedup": 0.5}, "at least 1"),
])
def test_nonsense_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CachePolicy(**kwargs)
