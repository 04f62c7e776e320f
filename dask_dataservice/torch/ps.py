"""PyTorch models on parameter servers: sharded embeddings and dense parameters on the PS.

::

    with strategy.scope():
        table = dds.Variable(init, shape=(1_000_000, 16), dtype="float32", name="emb")
    opt = dds.ps.optimizers.Adagrad(0.05)
    emb = dds.torch.ShardedEmbedding(table, opt)          # a torch.nn.Module
    mlp = strategy.torch_module(torch.nn.Sequential(...), opt)

    def step(iterator):                                   # on a training worker
        batch = next(iterator)
        mlp.pull()                                        # dense parameters, once a step
        loss = loss_fn(mlp(emb(torch.as_tensor(batch["ids"])).sum(1)), batch["y"])
        loss.backward()                                   # embedding rows go to the PS here
        mlp.push()                                        # dense gradients to the PS
        return float(loss)

Theory of operation
-------------------
- :class:`ShardedEmbedding` holds no torch parameter. Its forward de-duplicates the batch's
  ids, gathers those rows from the shards (one request per shard holding any of them, in
  parallel) into a leaf tensor that requires a gradient, and indexes it back to the batch's
  shape. Autograd sums the gradient of duplicate ids into their row; a hook on the leaf
  sends the rows' gradient to the parameter servers' optimizer as ``IndexedSlices`` during
  ``backward``: no dense gradient, no pull of the whole table.
- :class:`TorchModuleOnPS` (``strategy.torch_module(module, optimizer)``) puts each
  parameter of ``module`` in a variable on the PS (created in the strategy's scope, named
  after the parameter). ``pull()`` reads them all in parallel into the module's
  parameters, ``push()`` sends the gradients to the optimizer and clears them.
- Updates sent from a scheduled function carry its id, so a function that runs again after
  a worker loss does not apply its gradients twice (the PS's exactly-once rule).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ..ps._types import IndexedSlices
from ..ps.variables import ShardedVariable, Variable, read_values

__all__ = ["ShardedEmbedding", "TorchModuleOnPS", "torch_module"]


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return np.asarray(t.detach().cpu().numpy())


# torch is typed as Any here (pyproject.toml: mypy skips its 1,400 modules)
class ShardedEmbedding(torch.nn.Module):  # type: ignore[misc]
    """An embedding whose table is a (sharded) variable on the parameter servers.

    Parameters
    ----------
    variable : Variable or ShardedVariable
        The table, of shape ``(rows, dim)``.
    optimizer : dds.ps.optimizers.Optimizer, optional
        Applies the rows' gradients on the PS during ``backward``. Without one, gradients
        are kept in :attr:`last_gradient` (for tests and custom updates) and not sent.
    """

    def __init__(self, variable: Variable | ShardedVariable, optimizer: Any = None) -> None:
        super().__init__()
        if not isinstance(variable, Variable | ShardedVariable):
            raise TypeError(f"ShardedEmbedding needs a dds.Variable or ShardedVariable, got "
                            f"{type(variable).__name__}")
        if len(variable.shape) != 2:
            raise ValueError(f"an embedding table is 2-d (rows, dim), got shape {variable.shape}")
        self.variable = variable
        self.optimizer = optimizer
        self.num_embeddings, self.embedding_dim = (int(d) for d in variable.shape)
        #: ``(unique ids, their rows' gradient)`` of the last backward.
        self.last_gradient: tuple[np.ndarray, np.ndarray] | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if flat.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"embedding ids must be int32 or int64, got {flat.dtype}")
        unique, inverse = torch.unique(flat, return_inverse=True)
        uids = _to_numpy(unique).astype(np.int64)
        if len(uids) and (uids[0] < 0 or uids[-1] >= self.num_embeddings):
            raise IndexError(f"embedding ids must be in [0, {self.num_embeddings}), got "
                             f"min {uids[0]}, max {uids[-1]}")
        rows = torch.from_numpy(np.ascontiguousarray(self.variable.gather(uids)))
        if torch.is_grad_enabled():
            rows.requires_grad_(True)
            rows.register_hook(  # type: ignore[no-untyped-call, unused-ignore]
                lambda grad: self._send(uids, grad))
        return rows[inverse].reshape(*ids.shape, self.embedding_dim)

    def _send(self, ids: np.ndarray, grad: torch.Tensor) -> None:
        g = np.ascontiguousarray(_to_numpy(grad), dtype=np.dtype(self.variable.dtype))
        self.last_gradient = (ids, g)
        if self.optimizer is not None:
            self.optimizer.apply_gradients([(IndexedSlices(g, ids), self.variable)])

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, variable={self.variable.name!r}"


class TorchModuleOnPS:
    """A torch module whose parameters live on the parameter servers (see module doc)."""

    def __init__(self, module: torch.nn.Module, variables: dict[str, Variable | ShardedVariable],
                 optimizer: Any) -> None:
        self.module = module
        self.variables = variables
        self.optimizer = optimizer

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _params(self) -> Iterator[tuple[torch.nn.Parameter, Variable | ShardedVariable]]:
        params = dict(self.module.named_parameters())
        for name, var in self.variables.items():
            yield params[name], var

    def pull(self) -> None:
        """Copy the variables' values into the module's parameters (one parallel read)."""
        pairs = list(self._params())
        values = read_values(*(v for _, v in pairs))
        with torch.no_grad():
            for (param, _), value in zip(pairs, values, strict=True):
                param.copy_(torch.from_numpy(np.asarray(value)))

    def push(self) -> None:
        """Send the parameters' gradients to the PS's optimizer, then clear them."""
        grads = []
        for param, var in self._params():
            if param.grad is not None:
                grads.append((np.ascontiguousarray(_to_numpy(param.grad)), var))
                param.grad = None
        if grads:
            self.optimizer.apply_gradients(grads)

    def __repr__(self) -> str:
        return f"<dds.torch.TorchModuleOnPS {sorted(self.variables)} {self.optimizer!r}>"


def torch_module(strategy: Any, module: torch.nn.Module, optimizer: Any,
                 name: str | None = None) -> TorchModuleOnPS:
    """Put the parameters of ``module`` on ``strategy``'s parameter servers (its variable
    partitioner applies); ``optimizer`` (server-side) applies their gradients."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"torch_module needs a torch.nn.Module, got {type(module).__name__}")
    prefix = f"{name or type(module).__name__}/"
    variables: dict[str, Variable | ShardedVariable] = {}
    with strategy.scope():
        for pname, param in module.named_parameters():
            value = np.ascontiguousarray(_to_numpy(param))
            variables[pname] = Variable(value, name=prefix + pname)
    return TorchModuleOnPS(module, variables, optimizer)
