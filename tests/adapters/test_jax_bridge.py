"""JAX bridge (Dataset.to_jax, dask_dataservice.jax) on CPU jaxlib, and the error a missing
extra (torch, jax) gives: a subprocess where the package cannot be imported."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from _helpers import distribute, needs

from dask_dataservice.data import Dataset
from dask_dataservice.testing import gen_cluster

pytestmark = pytest.mark.pure


@pytest.mark.process
@pytest.mark.parametrize("extra, call", [
    ("torch", "Dataset.range(3).to_torch()"),
    ("torch", "__import__('dask_dataservice.torch')"),
    ("jax", "Dataset.range(3).to_jax()"),
])
def test_a_missing_extra_is_named(extra, call):
    code = textwrap.dedent(f"""
        import sys
        sys.modules[{extra!r}] = None  # as if not installed: import raises ImportError
        from dask_dataservice import Dataset
        try:
            {call}
        except ImportError as e:
            print(e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"pip install 'dask-dataservice[{extra}]'" in out.stdout
    assert f"optional dependency {extra!r}" in out.stdout


jax = needs("jax", "jax")


def test_leaves_become_jax_arrays_on_the_device():
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    ds = Dataset.from_tensor_slices({"x": x, "y": np.arange(6), "s": np.array(list("abcdef"))})
    out = list(ds.batch(3).to_jax())
    assert len(out) == 2 and isinstance(out[0]["x"], jax.Array)
    np.testing.assert_array_equal(np.asarray(out[1]["x"]), x[3:])
    assert out[0]["x"].devices() == {jax.devices()[0]}
    assert out[1]["s"].tolist() == ["d", "e", "f"]  # strings stay numpy
    dev = jax.devices("cpu")[0]
    (first,) = Dataset.range(1).map(lambda i: (i, 2.5)).to_jax(device=dev)
    assert int(first[0]) == 0 and float(first[1]) == 2.5 and first[1].devices() == {dev}
    with pytest.raises(TypeError, match="to_jax\\(\\) takes a dask_dataservice Dataset"):
        from dask_dataservice.jax import JaxIterable

        JaxIterable([1])


@pytest.mark.cluster
@gen_cluster(client=True, nthreads=[("", 1)] * 2)
async def test_jax_step_on_a_distributed_dataset(c, s, a, b):
    """A jitted gradient step per batch served by the data service: each row once per epoch."""
    import jax.numpy as jnp

    x = np.random.default_rng(1).normal(size=(512, 2)).astype(np.float32)
    y = x @ np.array([1.5, -0.5], np.float32)
    ds = await distribute(Dataset.from_tensor_slices({"id": np.arange(512), "x": x, "y": y})
                          .batch(32), "distributed_epoch", c)

    @jax.jit
    def step(w, xb, yb):
        grad = jax.grad(lambda w: jnp.mean((xb @ w - yb) ** 2))(w)
        return w - 0.2 * grad

    def train():
        w = jnp.zeros(2)
        seen = []
        for _ in range(5):
            ids = []
            for batch in ds.to_jax():
                w = step(w, batch["x"], batch["y"])
                ids.extend(np.asarray(batch["id"]).tolist())
            seen.append(sorted(ids))
        return np.asarray(w), seen

    w, seen = await asyncio.to_thread(train)
    assert all(ids == list(range(512)) for ids in seen)
    np.testing.assert_allclose(w, [1.5, -0.5], atol=0.02)
