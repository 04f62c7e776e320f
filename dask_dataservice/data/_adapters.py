"""The adapters a :class:`~dask_dataservice.data.Dataset` hands itself to, installed from above.

``Dataset.to_torch()`` and ``Dataset.to_jax()`` wrap the dataset in the PyTorch and JAX
adapters (``dask_dataservice.torch``, ``dask_dataservice.jax``), which import the pipeline
library and never the reverse: the package root registers a loader for each
(:func:`register`), which imports its adapter on first use only, so ``import
dask_dataservice`` imports neither torch nor jax.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["adapter", "register"]

_LOADERS: dict[str, Callable[[], Callable[..., Any]]] = {}


def register(name: str, loader: Callable[[], Callable[..., Any]]) -> None:
    """``loader()`` returns the adapter ``name`` (imported when first asked for)."""
    _LOADERS[name] = loader


def adapter(name: str) -> Callable[..., Any]:
    """The adapter ``name`` (``"torch"``, ``"jax"``): what its loader returns."""
    loader = _LOADERS.get(name)
    if loader is None:  # pragma: no cover - the package root registers every adapter
        raise RuntimeError(f"no {name} adapter is registered: import dask_dataservice")
    return loader()
