"""The console progress bar of a distributed dataset's reads (``dataservice.client.progress-bar``)."""

from __future__ import annotations

import dask
import pytest
from distributed import Client, LocalCluster

import dask_dataservice as dds
from dask_dataservice.service.client._progress import progress_bar, progress_setting
from dask_dataservice.service.protocol._metrics import ReadStats


@pytest.mark.pure
def test_the_bar_is_updated_per_batch_and_closed_when_forced_on_a_non_tty(capsys):
    with dask.config.set({"dataservice.client.progress-bar": True}):
        bar = progress_bar(5, "7")
        assert list(ReadStats().wrap(iter([[1, 2], [3, 4, 5]]), bar)) == [1, 2, 3, 4, 5]
    err = capsys.readouterr().err
    assert "dataset 7" in err and "5/5" in err


@pytest.mark.pure
def test_the_bar_is_off_by_default_on_a_non_tty_and_when_turned_off(capsys):
    assert progress_setting() == "auto"
    assert progress_bar(5, "7") is None  # pytest's stderr is not a terminal
    with dask.config.set({"dataservice.client.progress-bar": False}):
        assert progress_bar(5, "7") is None
    assert capsys.readouterr().err == ""


@pytest.mark.pure
def test_a_bad_setting_is_a_clear_error():
    with dask.config.set({"dataservice.client.progress-bar": "sometimes"}), \
            pytest.raises(ValueError, match="dataservice.client.progress-bar must be 'auto', "
                                            "true or false, got 'sometimes'"):
        progress_setting()


@pytest.mark.cluster
def test_reading_a_distributed_dataset_prints_a_bar_only_when_on(capsys):
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        ds = dds.Dataset.range(100).apply(dds.distribute("parallel_epochs", client))
        assert sum(1 for _ in ds) == 100
        assert "elements" not in capsys.readouterr().err  # off: not a terminal
        with dask.config.set({"dataservice.client.progress-bar": True}):
            assert sum(1 for _ in ds) == 100
        err = capsys.readouterr().err
        assert "100 elements" in err or "100/" in err
        assert ds.stats()["elements"] == 200


@pytest.mark.cluster
def test_a_read_counts_and_ends_its_figures_itself_with_no_generator_on_its_elements():
    # the scalar hot path: the consumer's iterator is the read itself (ReadStats.wrap), which
    # counts per batch and starts/ends the per-op figures; below another op it is counted
    # the same way and the root's figures still end when the read does
    from dask_dataservice.data import _stats

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        ds = dds.Dataset.range(300).apply(dds.distribute("parallel_epochs", client))
        it = iter(ds)
        assert it.gi_code is ReadStats.wrap.__code__
        figures = _stats.LATEST[ds._op]
        assert [next(it) for _ in range(3)] == [0, 1, 2] and figures.ended is None
        assert sorted([0, 1, 2, *it]) == list(range(300))
        assert figures.ended is not None
        assert [r["elements_out"] for r in figures.rows()] == [300]

        it = iter(ds)  # closed early: its figures end too
        next(it)
        it.close()
        assert _stats.LATEST[ds._op].ended is not None

        mapped = ds.map(lambda x: x + 1).filter(lambda x: x % 2 == 0)
        assert sorted(mapped) == list(range(2, 301, 2))
        figures = _stats.LATEST[mapped._op]
        assert figures.ended is not None
        assert [(r["elements_in"], r["elements_out"]) for r in figures.rows()] == [
            (None, 300), (300, 300), (300, 150)]
