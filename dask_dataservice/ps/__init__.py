"""Parameter-server training on Dask (TensorFlow's ParameterServerStrategy V2 + ClusterCoordinator).

The public names are exported from :mod:`dask_dataservice`: ``ParameterServerStrategy``,
``ClusterCoordinator``, ``Variable``, ``ShardedVariable``, ``Checkpoint`` and
``partitioners``. Server-side optimizers are in :mod:`dask_dataservice.ps.optimizers`.
"""
