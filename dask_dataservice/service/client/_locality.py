"""Which data workers are *local* to a consumer (``target_workers="LOCAL"`` / ``"AUTO"``).

TensorFlow's local workers are those in the consumer's own process (a trainer that starts a
``WorkerServer`` beside itself). On Dask a data worker is usually a process of its own on the
trainer's machine (``dask worker``, a ``Nanny``), so by default a worker is local when it runs
on the consumer's host: its address's host is the address this machine has on the route to
the scheduler (a worker of the consumer's own process, ``LocalCluster(processes=False)``'s
``inproc://`` workers included, is on that host). ``dataservice.client.local-workers:
process`` takes TensorFlow's meaning instead: only the workers running in the consumer's
process are local, so that several trainers on one host, each with its own worker, read
only their own worker's shard under static sharding.
"""

from __future__ import annotations

from ... import config

__all__ = ["KEY", "local_workers_mode", "process_workers"]

KEY = "client.local-workers"
_MODES = ("host", "process")


def local_workers_mode() -> str:
    """``"host"`` or ``"process"``, from ``dataservice.client.local-workers``."""
    mode = config.get(KEY, "host")
    if not isinstance(mode, str) or mode.lower() not in _MODES:
        raise ValueError(f"dataservice.{KEY} must be 'host' or 'process', got {mode!r}")
    return mode.lower()


def process_workers() -> frozenset[str]:
    """The addresses of the Dask workers running in this process now."""
    from distributed import Worker

    return frozenset(w.address for w in list(Worker._instances)
                     if w.status.name == "running" and w.address)
