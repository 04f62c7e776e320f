"""PyTorch bridge (dask_dataservice.torch): tensors, zero-copy, DataLoader sharding, training.

CPU torch; a real Dask cluster for the data-service cases; exact elements, no duplicates."""

from __future__ import annotations

import asyncio
import warnings

import numpy as np
import pytest
from _helpers import distribute, needs

from dask_dataservice.data import Dataset
from dask_dataservice.testing import gen_cluster

torch = needs("torch", "torch")
import dask_dataservice.torch as ddt  # noqa: E402 - needs torch

pytestmark = pytest.mark.pure


def test_leaves_become_tensors_and_the_structure_stays():
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    ds = Dataset.from_tensor_slices({"x": x, "y": np.arange(6), "name": np.array(list("abcdef"))})
    out = list(ds.batch(3).to_torch())
    assert len(out) == 2
    assert isinstance(out[0]["x"], torch.Tensor) and out[0]["x"].dtype == torch.float32
    assert torch.equal(out[1]["x"], torch.from_numpy(x[3:]))
    assert out[0]["y"].tolist() == [0, 1, 2] and out[0]["y"].dtype == torch.int64
    assert out[1]["name"].tolist() == ["d", "e", "f"]  # strings stay numpy (no torch dtype)
    assert list(Dataset.range(3).map(lambda i: (i, float(i), "s")).to_torch())[2] == (
        torch.tensor(2), torch.tensor(2.0, dtype=torch.float64), "s")


def test_zero_copy_for_writable_arrays_and_a_copy_for_read_only_ones():
    a = np.arange(10, dtype=np.float64)
    t = ddt.to_tensors(a)
    assert t.data_ptr() == a.ctypes.data  # shares memory
    t[0] = 99.0
    assert a[0] == 99.0
    ro = np.arange(4, dtype=np.int32)
    ro.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "not writable" warning would be an error
        t = ddt.to_tensors(ro)
    assert t.data_ptr() != ro.ctypes.data and t.tolist() == [0, 1, 2, 3]
    rev = np.arange(5)[::-1]  # negative strides: torch.from_numpy cannot take them
    assert ddt.to_tensors(rev).tolist() == [4, 3, 2, 1, 0]


def test_bad_input_and_pin_memory_without_accelerator():
    with pytest.raises(TypeError, match="takes a dask_dataservice Dataset"):
        ddt.IterableDataset([1, 2, 3])
    with pytest.raises(TypeError, match="pin_memory must be a bool"):
        Dataset.range(3).to_torch(pin_memory="yes")
    assert not torch.cuda.is_available()
    with pytest.warns(UserWarning, match="no accelerator is available"):
        it = Dataset.range(3).to_torch(pin_memory=True)
    assert [int(t) for t in it] == [0, 1, 2]


@pytest.mark.process
@pytest.mark.parametrize("splittable", [True, False])
def test_dataloader_workers_share_the_data_exactly_once(splittable):
    if splittable:
        ds = Dataset.range(103)
        assert ds.splittable
    else:
        ds = Dataset.from_generator(lambda: iter(range(103)))
        assert not ds.splittable
    loader = torch.utils.data.DataLoader(ds.to_torch(), batch_size=None, num_workers=2)
    got = [int(t) for t in loader]
    assert sorted(got) == list(range(103))
    batched = torch.utils.data.DataLoader(ds.to_torch(), batch_size=10, num_workers=2)
    assert sorted(int(v) for b in batched for v in b) == list(range(103))


@pytest.mark.slow
@pytest.mark.process
@gen_cluster(client=True, nthreads=[("", 1)] * 2)
async def test_service_dataset_in_loader_workers_is_refused(c, s, a, b):
    ds = await distribute(Dataset.range(10), "distributed_epoch", c)
    # spawn, not fork: a forked child would copy this process's in-process cluster (its event
    # loop and sockets)
    loader = torch.utils.data.DataLoader(ds.to_torch(), batch_size=None, num_workers=2,
                                         multiprocessing_context="spawn")

    def refused_pass() -> None:
        it = iter(loader)
        try:
            next(it)
        finally:  # torch's own teardown of its workers, now rather than at garbage collection
            it._shutdown_workers()

    with pytest.raises(RuntimeError, match=r"use DataLoader\(\.\.\., num_workers=0\)"):
        await asyncio.to_thread(refused_pass)
    # The same distributed dataset reads everything in the main process. (Here torch's SIGCHLD
    # handler raises "DataLoader worker exited unexpectedly" into whatever the main thread
    # runs, which is this in-process cluster's event loop: it broke a request of the next
    # read, whose elements were lost silently until failed requests were sent again.)
    loader = torch.utils.data.DataLoader(ds.to_torch(), batch_size=None, num_workers=0)
    assert sorted(int(t) for t in await asyncio.to_thread(list, loader)) == list(range(10))


@pytest.mark.cluster
@gen_cluster(client=True, nthreads=[("", 1)] * 2)
async def test_train_a_torch_model_on_a_distributed_dataset(c, s, a, b):
    """Linear regression on 2,048 rows served by two data workers (DYNAMIC sharding): every
    epoch sees every row once, and the fitted weights are the true ones."""
    rng = np.random.default_rng(0)
    w_true = np.array([2.0, -3.0, 0.5], np.float32)
    x = rng.normal(size=(2048, 3)).astype(np.float32)
    y = x @ w_true + 1.0
    ids = np.arange(2048)
    ds = await distribute(Dataset.from_tensor_slices({"id": ids, "x": x, "y": y}).batch(64),
                          "distributed_epoch", c)

    def train() -> tuple[list[float], list[list[int]]]:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, seen = [], []
        for _ in range(4):
            epoch_ids, total = [], 0.0
            for batch in torch.utils.data.DataLoader(ds.to_torch(), batch_size=None):
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(batch["x"]).squeeze(1), batch["y"])
                loss.backward()
                opt.step()
                total += loss.item() * len(batch["id"])
                epoch_ids.extend(batch["id"].tolist())
            losses.append(total / 2048)
            seen.append(epoch_ids)
        return losses, seen, model.weight.detach().numpy()[0], float(model.bias)

    losses, seen, w, bias = await asyncio.to_thread(train)
    for epoch_ids in seen:
        assert sorted(epoch_ids) == list(range(2048))  # each row exactly once per epoch
    assert losses[-1] < losses[0] / 100 and losses[-1] < 1e-3
    np.testing.assert_allclose(w, w_true, atol=0.02)
    assert abs(bias - 1.0) < 0.02
