"""Parameter-server training on Dask (TensorFlow's ParameterServerStrategy V2 + ClusterCoordinator).

The public names are exported from :mod:`dask_dataservice`: ``ParameterServerStrategy``,
``ClusterCoordinator``, ``Variable``, ``ShardedVariable``, ``Checkpoint``,
``partitioners``, ``ClusterSpec``, ``TFConfigClusterResolver`` and ``SimpleClusterResolver``. Server-side optimizers are in :mod:`dask_dataservice.ps.optimizers`.

Layout (each module imports only those above it; ``tests/project/test_layering.py`` checks it):

- ``_types`` (wire types, ``wire``/``unwire``), ``partitioners`` (errors: ``dask_dataservice.errors``);
- ``_kernels`` (numpy updates, optimizers' math, initializer conventions);
- ``_shard`` (a shard and its serial lane), ``_store`` (zarr I/O);
- ``_channel`` (the ordered channel to a PS), ``_routing`` (how a handle reaches its PS);
- ``variables``, ``optimizers``, ``server`` (the PS plugin), ``_runner_plugin`` (the
  training-worker plugin), ``per_worker`` (per-worker variables), ``cluster_resolver``
  (TensorFlow's cluster specs and ``TF_CONFIG`` on Dask), ``strategy``, ``coordinator``,
  ``coordinator_context``, ``checkpoint``.
"""
