"""``Dataset.from_tensor_slices`` refuses Dask collections instead of computing them on the
client (issue 9, section 4); ``dask_dataservice.data`` still does not import Dask."""

from __future__ import annotations

import subprocess
import sys

import dask
import dask.array as da
import numpy as np
import pytest
from _helpers import needs

from dask_dataservice import Dataset

pytestmark = pytest.mark.pure


def _watched_array(calls: list) -> da.Array:
    """A Dask array whose only chunk records being computed."""

    def make():
        calls.append(1)
        return np.arange(10.0)

    return da.from_delayed(dask.delayed(make)(), shape=(10,), dtype=float)


@pytest.mark.parametrize("wrap", [lambda x: x, lambda x: (np.arange(10), x),
                                  lambda x: {"x": x, "y": np.arange(10)}])
def test_dask_array_is_refused_and_not_computed(wrap):
    calls: list = []
    with pytest.raises(TypeError, match=r"Dask collection \(dask\.array\.core\.Array\).*"
                                        r"Dataset\.from_dask"):
        Dataset.from_tensor_slices(wrap(_watched_array(calls)))
    assert calls == [], "the array was computed"


def test_delayed_is_refused():
    with pytest.raises(TypeError, match="Dask collection"):
        Dataset.from_tensor_slices(dask.delayed(np.arange)(3))


def test_dask_dataframe_is_refused():
    dd = needs("dask.dataframe", "test")
    import pandas as pd

    frame = dd.from_pandas(pd.DataFrame({"a": range(4)}), npartitions=2)
    with pytest.raises(TypeError, match="Dask collection"):
        Dataset.from_tensor_slices(frame)


def test_computed_values_still_work():
    calls: list = []
    x = _watched_array(calls)
    assert [float(v) for v in Dataset.from_tensor_slices(x.compute(scheduler="synchronous"))] == list(range(10))
    assert calls == [1]


@pytest.mark.process
def test_data_package_does_not_import_dask():
    code = ("import sys, dask_dataservice.data, numpy as np; "
            "list(dask_dataservice.data.Dataset.from_tensor_slices(np.arange(3))); "
            "print('dask' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
