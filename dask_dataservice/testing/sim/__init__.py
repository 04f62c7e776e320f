"""A deterministic simulator of the data service (issue 21), in the manner of FoundationDB's
simulation and TigerBeetle's VOPR.

The REAL cores of one dispatcher
(:class:`~dask_dataservice.service.dispatcher.core.DispatcherCore`), N data workers
(:class:`~dask_dataservice.service.worker.core.WorkerCore` and ``SplitFlow``) and M
consumers (:class:`~dask_dataservice.service.client.reader_core.ReaderCore` and ``TaskRead``)
run on a virtual clock over a simulated
network that delays, reorders, duplicates and drops messages and partitions hosts. Faults come
from a seeded :class:`random.Random`: kill -9 of the dispatcher (volatile state lost, the
journal's bytes kept and replayed through the real record codec and recovery code), freeze
and thaw, kill and restart, join and leave of workers. The actors (:mod:`._worker`,
:mod:`._actors`) only do what the plugins' and the reader's I/O does: deliver messages and
timer events to the cores and carry out their effects.

Run: ``python -m dask_dataservice.testing.sim --seed 1234 --workload dynamic`` (one seed,
with its trace), ``--seeds 2000`` (many; a failure prints its replay command and its shrunk
scenario). See docs/architecture.md, "The simulator".
"""

from __future__ import annotations

from ._runner import check_seeds, replay_command, run_seed, shrink
from ._scenario import WORKLOADS, Params, Result, generate, run_scenario

__all__ = ["WORKLOADS", "Params", "Result", "check_seeds", "generate", "replay_command",
           "run_scenario", "run_seed", "shrink"]
