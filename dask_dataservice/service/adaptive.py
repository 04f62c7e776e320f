"""Data workers that scale with the consumers' demand, through Dask's ``Adaptive`` (issue 26).

``cluster.adapt(Adaptive=dds.DemandAdaptive, minimum=1, maximum=8)`` on a Dask cluster manager
built on ``Adaptive`` (LocalCluster, SpecCluster-based deployments such as dask-jobqueue) sizes
the cluster from the larger of two targets, both answered by the scheduler's
``adaptive_target``:

- **Dask's own** (queued tasks, memory), so a cluster that also computes still grows for its
  tasks;
- **the data service's**: the data workers the consumers need, decided on the scheduler after
  each dashboard poll by Cachew's rules
  (:class:`~dask_dataservice.service.dispatcher._autoscale.ScalingPolicy`, a pure function
  with its own tests), plus the workers that are no data workers (parameter servers).

This class turns the scheduler's share on with its bounds and thresholds
(``dataservice_scaling_configure``) and picks the workers to retire: data workers only (never
a parameter server), those running no Dask task and the fewest data-service tasks first. Dask
retires them through ``retire_workers``, which the dispatcher wraps: each is drained first
(:mod:`.dispatcher._retire`), so a DYNAMIC epoch still sees every element exactly once.

Autoscalers that ask the scheduler directly (the dask-kubernetes operator, Dask Gateway) get
the same target with ``dataservice.scaling.enabled: true`` in the scheduler's configuration
(docs/elastic.md). The decisions are on the dashboard (``dds.status()['scaling']``).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from distributed.deploy.adaptive import Adaptive

from .dispatcher._autoscale import UNBOUNDED, ScalingPolicy

__all__ = ["DemandAdaptive"]

logger = logging.getLogger(__name__)


class DemandAdaptive(Adaptive):
    """Dask's ``Adaptive``, with the data service's demand as a second target.

    Parameters
    ----------
    cluster, interval, minimum, maximum, wait_count, target_duration, worker_key
        As for :class:`distributed.deploy.Adaptive` (``minimum`` and ``maximum`` bound the
        whole cluster).
    wait_high, wait_low, headroom, step, improvement, settle, cooldown, idle
        The scaling policy's thresholds
        (:class:`~dask_dataservice.service.dispatcher._autoscale.ScalingPolicy`): consumers
        waiting more than ``wait_high`` of their time ask for more workers; after a scale-up
        ``settle`` seconds pass before it is judged (kept only if the consumers' step
        shortened by ``improvement``); workers go only after ``cooldown`` seconds in which
        the consumers waited less than ``wait_low`` and the workers could give more than
        ``headroom`` times what they took.
    """

    def __init__(self, cluster: Any = None, interval: Any = None, minimum: int | None = None,
                 maximum: int | float | None = None, wait_count: int | None = None,
                 target_duration: Any = None, worker_key: Any = None, *,
                 wait_high: float | None = None, wait_low: float | None = None,
                 headroom: float | None = None, step: float | None = None,
                 improvement: float | None = None, settle: float | None = None,
                 cooldown: float | None = None, idle: float | None = None,
                 **kwargs: Any) -> None:
        super().__init__(cluster, interval=interval, minimum=minimum, maximum=maximum,
                         wait_count=wait_count, target_duration=target_duration,
                         worker_key=worker_key, **kwargs)
        given = {"wait_high": wait_high, "wait_low": wait_low, "headroom": headroom,
                 "step": step, "improvement": improvement, "settle": settle,
                 "cooldown": cooldown, "idle": idle}
        #: What the scheduler's policy is configured with (None: dataservice.scaling.*).
        self.policy = {k: v for k, v in given.items() if v is not None}
        # bad values fail here, at once, not on the scheduler at the first interval
        ScalingPolicy(int(self.minimum), int(min(self.maximum, UNBOUNDED)), **self.policy)
        self._configured = False

    async def target(self) -> int:
        """The scheduler's ``adaptive_target``: the larger of Dask's and the data service's
        (turned on, with this object's bounds and thresholds, on the first call)."""
        if not self._configured:
            maximum = None if self.maximum == math.inf else int(self.maximum)
            try:
                await self.scheduler.dataservice_scaling_configure(
                    minimum=int(self.minimum), maximum=maximum, **self.policy)
                self._configured = True
            except Exception as e:  # noqa: BLE001 - no dispatcher there yet: Dask's target
                logger.warning("dataservice: the scheduler has no data service (yet) to scale "
                               "for: %r; Dask's own target meanwhile (dds.install(client))", e)
        return int(await super().target())  # type: ignore[no-untyped-call]

    async def workers_to_close(self, target: int) -> list[Any]:
        """Data workers only (never a parameter server), idle and least loaded first."""
        return list(await self.scheduler.dataservice_workers_to_close(
            target=target, attribute="name"))
