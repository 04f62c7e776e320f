"""``Dataset.stats()``: per-op counts, own time, buffers and the bottleneck rule."""

from __future__ import annotations

import time

import pytest

from dask_dataservice.data import Dataset
from dask_dataservice.data._stats import (
    DatasetStats,
    PipelineStats,
    bottleneck,
    finish_rows,
    merge_rows,
)


def _row(index, op, out, seconds, elements_in=None, wait=0.0, buffer=None):
    return {"index": index, "op": op, "elements_in": elements_in, "elements_out": out,
            "seconds": seconds, "wait_seconds": wait, "buffer": buffer}


def _sleepy(x):
    time.sleep(0.004)  # the deliberately slow op
    return x


def _even(x):
    return x % 2 == 0


@pytest.mark.pure
def test_the_bottleneck_is_the_op_with_the_largest_own_time_first_from_the_source():
    rows = finish_rows([_row(0, "range", 10, 0.5), _row(1, "map(f)", 10, 2.0, 10),
                        _row(2, "map(g)", 10, 2.0, 10), _row(3, "prefetch", 10, 0.0, 10, 4.0)])
    assert [r["bottleneck"] for r in rows] == [False, True, False, False]
    assert bottleneck(rows)["op"] == "map(f)"  # a tie goes to the op nearer the source
    assert [r["share"] for r in rows] == [0.5 / 4.5, 2.0 / 4.5, 2.0 / 4.5, 0.0]
    assert rows[1]["seconds_per_element"] == 0.2
    assert bottleneck(finish_rows([_row(0, "range", 3, 0.0)])) is None  # nothing measured


@pytest.mark.pure
def test_merging_the_rows_of_a_jobs_tasks_adds_them_up():
    a = [_row(0, "range", 6, 0.1), _row(1, "map(f)", 6, 1.0, 6, buffer=[1, 4])]
    b = [_row(0, "range", 4, 0.1), _row(1, "map(f)", 4, 0.5, 4, buffer=[3, 4])]
    rows = merge_rows([a, b])
    assert [(r["op"], r["elements_in"], r["elements_out"], r["buffer"]) for r in rows] == [
        ("range", None, 10, None), ("map(f)", 10, 10, [4, 8])]
    assert rows[1]["seconds"] == 1.5 and rows[1]["bottleneck"] and rows[1]["share"] == 1.5 / 1.7
    assert merge_rows([]) == []


@pytest.mark.component  # the sampling thread runs
def test_counts_per_op_are_the_elements_each_op_produced():
    ds = Dataset.range(10).filter(_even).batch(2).map(len)
    assert [len(b) if hasattr(b, "__len__") else b for b in ds] == [2, 2, 1]
    rows = ds.stats()["ops"]
    assert [(r["op"], r["elements_in"], r["elements_out"]) for r in rows] == [
        ("range", None, 10), ("filter(_even)", 10, 5), ("batch", 5, 3), ("map(len)", 3, 3)]


@pytest.mark.component  # the sampling thread runs
def test_stats_of_an_unread_dataset_and_of_an_iteration_without_figures_are_empty():
    ds = Dataset.range(3)
    assert ds.stats() == {"ops": [], "bottleneck": None}
    assert list(ds.iterate(stats=False)) == [0, 1, 2]
    assert ds.stats() == {"ops": [], "bottleneck": None}
    with pytest.raises(TypeError, match="iterate\\(\\): stats must be a bool or a "
                                        "PipelineStats, got str"):
        ds.iterate(stats="yes")


@pytest.mark.component
def test_a_sleeping_map_is_named_the_bottleneck_and_printed_so():
    ds = Dataset.range(40).map(_sleepy).batch(8).prefetch(2)
    assert sum(len(b) for b in ds) == 40
    st = ds.stats()
    assert isinstance(st, DatasetStats) and st["bottleneck"] == "map(_sleepy)"
    ops = {r["op"]: r for r in st["ops"]}
    assert [r["op"] for r in st["ops"]] == ["range", "map(_sleepy)", "batch", "prefetch"]
    assert ops["map(_sleepy)"]["elements_out"] == 40 and ops["batch"]["elements_out"] == 5
    assert ops["map(_sleepy)"]["seconds_per_element"] >= 0.002  # sampled: about its sleep
    assert ops["prefetch"]["seconds"] == 0.0  # a prefetch consumer waits: not own time
    assert ops["prefetch"]["buffer"][1] == 4  # 2 * buffer_size held at most
    text = str(st)
    assert "map(_sleepy)" in text and text.endswith("Bottleneck: map(_sleepy)")
    assert st["wall_seconds"] >= 40 * 0.004


@pytest.mark.component
def test_an_ongoing_iteration_shows_its_figures_so_far():
    ds = Dataset.range(100).map(_sleepy)
    it = iter(ds)
    try:
        assert [next(it) for _ in range(5)] == [0, 1, 2, 3, 4]
        rows = ds.stats()["ops"]
        assert rows[1]["op"] == "map(_sleepy)" and rows[1]["elements_out"] == 5
    finally:
        it.close()


@pytest.mark.component
def test_parallel_map_shows_its_calls_in_flight_as_its_buffer():
    ds = Dataset.range(30).map(_sleepy, num_parallel_calls=3)
    it = iter(ds)
    try:
        next(it)
        row = ds.stats()["ops"][1]
        assert row["op"] == "map(_sleepy)" and row["buffer"][1] == 6  # 2 * num_parallel_calls
        assert 0 <= row["buffer"][0] <= 6
    finally:
        it.close()
    assert ds.stats()["ops"][1]["elements_out"] >= 1


@pytest.mark.component  # the sampling thread runs
def test_an_explicit_pipeline_stats_is_filled_and_ended_by_its_caller():
    st = PipelineStats()
    ds = Dataset.range(5).filter(_even)
    assert list(ds.iterate(stats=st)) == [0, 2, 4]
    st.end()
    assert [r["elements_out"] for r in st.rows()] == [5, 3] and st.ended is not None


@pytest.mark.pure
@pytest.mark.parametrize("kind", ["range", "text_lines"])
def test_a_source_read_through_a_split_provider_is_counted_per_split_not_per_element(
        kind, tmp_path):
    # the DYNAMIC hot path: a worker's source reads the splits the dispatcher serves; with
    # figures on, range()'s splits are counted by their length hint and nothing wraps the
    # elements (a per-element wrapper cost W1 DYNAMIC about 10%)
    from dask_dataservice.data._base import IterContext
    from dask_dataservice.data.splits import ListSplitProvider

    if kind == "range":
        ds, want = Dataset.range(1000), list(range(1000))
    else:
        for f in range(3):
            (tmp_path / f"{f}.txt").write_text("".join(f"{f}-{i}\n" for i in range(40)))
        ds = Dataset.from_text_lines(str(tmp_path / "*.txt"))
        want = [f"{f}-{i}" for f in range(3) for i in range(40)]
    op = ds._op
    splits = list(op.splits(7) if kind == "range" else op.splits())
    st = PipelineStats(op)
    it = op.iterate(IterContext(split_provider=ListSplitProvider(splits), stats=st))
    assert it.gi_code is type(op)._iterate_provider.__code__  # no wrapper around it
    got = [next(it) for _ in range(50)]
    assert st.rows()[0]["elements_out"] == 50
    got += list(it)
    st.end()
    assert [x.decode() if isinstance(x, bytes) else x for x in got] == want
    assert [r["elements_out"] for r in st.rows()] == [len(want)]
    rec = st.record(op)
    assert len(rec.hinted) + len(rec.counters) <= 9  # ended splits folded, not kept


@pytest.mark.component
def test_a_pipeline_stats_reused_after_a_self_ending_read_still_samples_the_next_one():
    # a root that ends its own figures (a service read) takes the ends once: a later iteration
    # into the same explicit PipelineStats gets the usual wrapper (else it would go unsampled)
    from dask_dataservice.data._stats import ended_iterator

    st = PipelineStats()
    st.self_ending = True  # as ServiceSource.iterate leaves it (take_ends) for its own read
    raw = iter([1, 2])
    assert ended_iterator(raw, st, end=False) is raw
    wrapped = ended_iterator(iter([3]), st, end=False)
    assert wrapped is not raw and list(wrapped) == [3]
