"""The data service's share of the scheduler's ``adaptive_target`` (issue 26).

Every Dask autoscaler asks the scheduler how many workers it wants: ``Adaptive`` (LocalCluster,
SpecCluster-based deployments such as dask-jobqueue) through the ``adaptive_target`` handler,
the dask-kubernetes operator's autoscaler and Dask Gateway through the same method (the
``/api/v1/adaptive_target`` route). :class:`DemandScaler` wraps that method: the answer is the
larger of Dask's own target (queued tasks, memory) and the data workers the consumers need,
plus the workers that are no data workers (parameter servers, excluded by their resources).

The data workers needed are decided once per dashboard poll (``dataservice.dashboard.interval``)
by :class:`~dask_dataservice.service.dispatcher._autoscale.ScalingPolicy` (Cachew's rules, a
pure function) from :meth:`.DashboardPlugin.demand`: the consumers' rate and wait share, the
elements per second the data workers served. ``adaptive_target`` itself only reads the latest
decision (O(1)).

It is off until ``dataservice.scaling.enabled`` is set or a
:class:`~dask_dataservice.service.adaptive.DemandAdaptive` configures it
(``dataservice_scaling_configure``, with its minimum and maximum): a plain ``cluster.adapt()``
keeps Dask's behaviour unless asked.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import TYPE_CHECKING, Any

from .. import config
from ..service.dispatcher._autoscale import (
    UNBOUNDED,
    Decision,
    Demand,
    ScalingPolicy,
    WorkerRate,
)

if TYPE_CHECKING:
    from ._collect import DashboardPlugin

__all__ = ["DemandScaler"]

logger = logging.getLogger("dask_dataservice.scaling")

#: The policy's thresholds (``dataservice.scaling.*``, and what ``configure`` accepts).
_RATIOS = ("wait_high", "wait_low", "headroom", "step", "improvement")
_DURATIONS = ("settle", "cooldown", "idle")


class DemandScaler:
    """Runs the scaling policy on the scheduler and answers its share of ``adaptive_target``."""

    def __init__(self, plugin: DashboardPlugin, history: int) -> None:
        self.plugin = plugin
        self.enabled = bool(config.get("scaling.enabled"))
        self.params: dict[str, float] = {
            **{k: float(config.get(f"scaling.{k.replace('_', '-')}")) for k in _RATIOS},
            **{k: config.get_seconds(f"scaling.{k}") for k in _DURATIONS}}
        self.policy = ScalingPolicy(0, UNBOUNDED, **self.params)
        self._rate = WorkerRate(self.policy.wait_high)
        #: The latest decision and the workers that are no data workers then.
        self.decision: Decision | None = None
        self._other = 0
        #: One row per decision (the dashboard's ``status()['scaling']``).
        self.rows: collections.deque[dict[str, Any]] = collections.deque(maxlen=history)
        self._scheduler: Any = None
        self._original: Any = None

    # the scheduler ---------------------------------------------------------------------
    def install(self, scheduler: Any) -> None:
        self._scheduler = scheduler
        self._original = scheduler.adaptive_target  # the bound method
        scheduler.adaptive_target = self.adaptive_target
        scheduler.handlers["adaptive_target"] = self.adaptive_target
        scheduler.handlers["dataservice_scaling_configure"] = self.configure

    def uninstall(self) -> None:
        s = self._scheduler
        if s is None or self._original is None:
            return
        if s.__dict__.get("adaptive_target") == self.adaptive_target:
            del s.adaptive_target  # the class's method again
        if s.handlers.get("adaptive_target") == self.adaptive_target:
            s.handlers["adaptive_target"] = s.adaptive_target

    def adaptive_target(self, target_duration: Any = None) -> int:
        """Dask's target, or the data workers the consumers need (plus the other workers)
        if that is more."""
        base = int(self._original(target_duration=target_duration))
        if not self.enabled or self.decision is None:
            return base
        return max(base, self.decision.workers + self._other)

    def configure(self, minimum: int = 0, maximum: int | None = None,
                  **params: float) -> dict[str, Any]:
        """Turn the scaling on, with the data workers' bounds and thresholds
        (``DemandAdaptive`` sends its own); the policy starts afresh if they changed."""
        unknown = set(params) - set(_RATIOS) - set(_DURATIONS)
        if unknown:
            raise TypeError(f"unknown scaling parameters: {sorted(unknown)}")
        merged = {**self.params, **{k: float(v) for k, v in params.items()}}
        bounds = (int(minimum), UNBOUNDED if maximum is None else int(min(maximum, UNBOUNDED)))
        policy = ScalingPolicy(*bounds, **merged)  # type: ignore[arg-type]  # checks them
        if not self.enabled or merged != self.params \
                or bounds != (self.policy.minimum, self.policy.maximum):
            self.params, self.policy = merged, policy
            self._rate = WorkerRate(policy.wait_high)
            self.decision = None
        self.enabled = True
        return {"status": "OK"}

    # one decision per poll -------------------------------------------------------------
    def tick(self) -> None:
        """Decide from the demand of the last window (after each dashboard poll)."""
        if not self.enabled:
            return
        d = self.plugin.demand()
        demand = Demand(time=time.monotonic(), workers=d["data_workers"],
                        consumers=d["consumers"], rate=d["rate"], wait=d["wait"],
                        worker_rate=self._rate.observe(d["wait"], d["served_rate"],
                                                       d["data_workers"]))
        decision = self.policy.decide(demand)
        if self.decision is None or decision.workers != self.decision.workers:
            logger.info("dataservice: %d data workers wanted (now %d): %s", decision.workers,
                        demand.workers, decision.why)
        self.decision, self._other = decision, d["other_workers"]
        self.rows.append({"time": d["time"], "data_workers": demand.workers,
                          "wanted": decision.workers, "consumers": demand.consumers,
                          "rate": demand.rate, "wait": demand.wait,
                          "worker_rate": demand.worker_rate, "why": decision.why})

    def status(self) -> dict[str, Any]:
        rows = list(self.rows)
        return {"enabled": self.enabled, "latest": rows[-1] if rows else None,
                "knee": None if self.policy.knee is None else self.policy.knee[0],
                "timeline": {k: [r[k] for r in rows]
                             for k in ("time", "data_workers", "wanted", "rate", "wait")}}
