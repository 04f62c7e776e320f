"""The data-service half of a Dask worker (public names).

The plugin itself lives in :mod:`.plugin` and its buffers in :mod:`._buffers`; this
module keeps the names users and deployments import:

- :class:`DataWorkerPlugin` and ``PLUGIN_NAME``: install by hand with
  ``client.register_plugin(DataWorkerPlugin())`` (``dds.install`` does it for you).
- :func:`current_task`: inside a pipeline function, the task (and under static sharding the
  shard) this thread produces for.
- :class:`QuietStopWorker`: a Dask worker class whose clean stop logs no heartbeat error
  (``dask-dataservice worker`` runs it).
- :class:`ReconnectingWorker`: a Dask worker class that rides out a restart of its scheduler
  with its data tasks (``dask worker --worker-class
  dask_dataservice.service.worker.ReconnectingWorker``; ``dask-dataservice worker
  --supervise`` uses it).
"""

from __future__ import annotations

from ._reconnect import QuietStopWorker, ReconnectingWorker
from .plugin import PLUGIN_NAME, DataWorkerPlugin, current_task

__all__ = ["PLUGIN_NAME", "DataWorkerPlugin", "QuietStopWorker", "ReconnectingWorker", "current_task"]
