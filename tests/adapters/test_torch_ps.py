"""PyTorch on parameter servers: ShardedEmbedding's gradients equal a dense embedding's,
dense parameters pulled and pushed with a server-side optimizer."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import needs

import dask_dataservice as dds
from dask_dataservice.ps import optimizers
from dask_dataservice.testing import gen_cluster
from dask_dataservice.testing._ps import warm_up_zarr

torch = needs("torch", "torch")

from dask_dataservice.torch import ShardedEmbedding, torch_module  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]

warm_up_zarr()

from _helpers import PS, WK, in_thread  # noqa: E402

ROWS, DIM = 50, 4


def _init():
    return np.random.default_rng(0).standard_normal((ROWS, DIM)).astype("f4")


def _loss(vectors, target):
    # a loss whose gradient differs per row and per position (duplicates must add up)
    weights = torch.arange(1, vectors.shape[1] + 1, dtype=torch.float32)[None, :, None]
    return ((vectors * weights).sum(1) - target).pow(2).mean()


IDS = np.array([[3, 7, 3], [49, 0, 7], [3, 3, 3]])
TARGET = np.arange(3 * DIM, dtype="f4").reshape(3, DIM)


def _dense_step(init):
    emb = torch.nn.Embedding(ROWS, DIM)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(init))
    loss = _loss(emb(torch.from_numpy(IDS)), torch.from_numpy(TARGET))
    loss.backward()
    return loss.item(), emb.weight.grad.numpy().copy()


@gen_cluster(client=False, nthreads=[PS, PS, WK])
async def test_sharded_embedding_gradients_equal_a_dense_embedding(s, p0, p1, w0):
    def body(c):
        strategy = dds.ParameterServerStrategy(
            c, variable_partitioner=dds.partitioners.FixedShardsPartitioner(2))
        coordinator = dds.ClusterCoordinator(strategy)
        init = _init()
        with strategy.scope():
            table = dds.Variable(init, name="emb")
        assert isinstance(table, dds.ShardedVariable)
        sgd = optimizers.SGD(learning_rate=1.0)
        emb = ShardedEmbedding(table, sgd)

        def step():
            loss = _loss(emb(torch.from_numpy(IDS)), torch.from_numpy(TARGET))
            loss.backward()
            return loss.item(), emb.last_gradient

        loss, (ids, rows) = coordinator.schedule(step).fetch()
        dense_loss, dense_grad = _dense_step(init)
        assert loss == pytest.approx(dense_loss, rel=1e-6)
        # only the unique ids travelled, once each, with the summed gradient
        assert ids.tolist() == [0, 3, 7, 49]
        np.testing.assert_allclose(rows, dense_grad[ids], rtol=1e-5, atol=1e-6)
        # SGD(1.0) on the PS: the table moved by exactly the dense gradient
        np.testing.assert_allclose(table.numpy(), init - dense_grad, rtol=1e-5, atol=1e-6)
        # no gradient in inference
        with torch.no_grad():
            out = emb(torch.tensor([1, 2]))
        assert out.shape == (2, DIM) and not out.requires_grad
        with pytest.raises(IndexError, match=r"ids must be in \[0, 50\), got min 0, max 50"):
            emb(torch.tensor([0, 50]))
        with pytest.raises(TypeError, match="ids must be int32 or int64"):
            emb(torch.tensor([0.5]))
        with pytest.raises(ValueError, match="2-d"):
            with strategy.scope():
                ShardedEmbedding(dds.Variable(np.zeros(3, "f4"), name="v"))

    await in_thread(s, body)


@gen_cluster(client=False, nthreads=[PS, WK])
async def test_torch_module_on_ps_matches_a_local_sgd_step(s, p0, w0):
    def body(c):
        strategy = dds.ParameterServerStrategy(c)
        coordinator = dds.ClusterCoordinator(strategy)
        torch.manual_seed(0)
        local = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        remote = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        remote.load_state_dict(local.state_dict())
        model = torch_module(strategy, remote, optimizers.SGD(learning_rate=0.1), name="mlp")
        assert sorted(model.variables) == ["0.bias", "0.weight", "2.bias", "2.weight"]
        x = torch.arange(6, dtype=torch.float32).reshape(2, 3)

        def step():
            model.pull()
            loss = model(x).pow(2).mean()
            loss.backward()
            model.push()
            return loss.item()

        for _ in range(3):
            coordinator.schedule(step)
        coordinator.join()
        opt = torch.optim.SGD(local.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            local(x).pow(2).mean().backward()
            opt.step()
        for name, param in local.named_parameters():
            np.testing.assert_allclose(model.variables[name].numpy(), param.detach().numpy(),
                                       rtol=1e-5, atol=1e-6)
        with pytest.raises(TypeError, match="needs a torch.nn.Module"):
            torch_module(strategy, object(), None)

    await in_thread(s, body)
