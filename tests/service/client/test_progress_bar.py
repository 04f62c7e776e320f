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
