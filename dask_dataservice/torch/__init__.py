"""PyTorch bridge: ``dds.torch.IterableDataset`` and ``Dataset.to_torch()``.

Importing this package imports torch (``pip install 'dask-dataservice[torch]'``);
``import dask_dataservice`` does not.
"""

from .data import IterableDataset, ddp_split, to_tensors
from .ps import ShardedEmbedding, TorchModuleOnPS, torch_module

__all__ = ["IterableDataset", "ddp_split", "to_tensors", "ShardedEmbedding", "TorchModuleOnPS", "torch_module"]
