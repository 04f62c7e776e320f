"""A deterministic simulator of the data service (issue 21), in the manner of FoundationDB's
simulation and TigerBeetle's VOPR.

The REAL dispatcher core (:class:`~dask_dataservice.service.dispatcher.core.DispatcherCore`)
of one dispatcher, N data workers and M consumers run on a virtual clock over a simulated
network that delays, reorders, duplicates and drops messages and partitions hosts. Faults come
from a seeded :class:`random.Random`: kill -9 of the dispatcher (volatile state lost, the
journal's bytes kept and replayed through the real record codec and recovery code), freeze
and thaw, kill and restart, join and leave of workers. The data workers and consumers are
protocol-following STAND-INS (:mod:`._actors`) until the real worker and reader cores exist.

Run: ``python -m dask_dataservice.testing.sim --seed 1234 --workload dynamic`` (one seed,
with its trace), ``--seeds 2000`` (many; a failure prints its replay command and its shrunk
scenario). See docs/architecture.md, "The simulator".
"""

from __future__ import annotations

from ._runner import check_seeds, replay_command, run_seed, shrink
from ._scenario import WORKLOADS, Params, Result, generate, run_scenario

__all__ = ["WORKLOADS", "Params", "Result", "check_seeds", "generate", "replay_command",
           "run_scenario", "run_seed", "shrink"]
