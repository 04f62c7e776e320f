"""Pure accounting of the dashboard's figures: CPU per interval, latency, formats, names."""

from __future__ import annotations

import pytest

from dask_dataservice.dashboard._pages import fmt_bytes, shard_label
from dask_dataservice.dashboard._worker import cpu_delta
from dask_dataservice.service.protocol._metrics import ReadStats, percentiles, wait_history
from dask_dataservice.service.protocol._metrics import percentiles as latency_percentiles

pytestmark = pytest.mark.pure


def test_a_thread_that_exits_does_not_make_the_live_threads_count_again():
    # one worker thread at 1 s of CPU per 1 s poll; a short-lived helper thread exits
    polls = [{1: 1.0, 2: 0.2}, {1: 2.0, 2: 0.3}, {1: 3.0}, {1: 4.0}]
    prev: dict[int, float] = {}
    deltas = []
    for now in polls:
        deltas.append(cpu_delta(prev, now))
        prev = now
    assert deltas == pytest.approx([1.2, 1.1, 1.0, 1.0])  # the old accounting gave 3.0 at poll 3
    assert all(d <= len(p) * 1.0 + 1e-9 for d, p in zip(deltas[1:], polls[1:], strict=True))


def test_a_new_thread_reusing_an_id_counts_from_zero():
    assert cpu_delta({7: 5.0}, {7: 0.25}) == 0.25
    assert cpu_delta({}, {}) == 0.0


def test_latency_percentiles():
    assert latency_percentiles([]) is None
    p = latency_percentiles([i / 100 for i in range(100)])
    assert p == {"p50": 0.5, "p90": 0.9, "p99": 0.99, "count": 100}
    assert percentiles([0.3]) == {"p50": 0.3, "p90": 0.3, "p99": 0.3, "count": 1}


def test_bytes_are_formatted_as_bytes():
    assert [fmt_bytes(n) for n in (0, 1023, 1024, 3 << 19, 5 << 29)] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 MiB", "2.5 GiB"]


def test_shard_names_lose_the_strategys_id():
    assert shard_label("9f8e7d6c/3/embedding/part_1") == "embedding/part_1"
    assert shard_label("counter") == "counter"


def test_the_consumers_wait_history_is_a_share_per_interval():
    assert wait_history([(0.0, 0.0, 0.0), (1.0, 0.75, 0.25), (2.0, 0.75, 1.25)]) == {
        "time": [1.0, 2.0], "wait_fraction": [0.75, 0.0]}
    stats = ReadStats()
    assert list(stats.wrap(iter([[1, 2], [3]]))) == [1, 2, 3]
    snap = stats.snapshot()
    assert snap["wait_per_batch_seconds"]["count"] == 2 and snap["elements"] == 3
