"""How many data workers the consumers need: the scaling policy, with no I/O (issue 26).

TensorFlow's tf.data service leaves the number of workers to the user. Cachew (USENIX ATC'22)
sizes them from what the trainers measure: add workers while the trainers' step time improves
by more than a threshold, stop at the knee, and give workers back when the trainers no longer
wait. This module is that decision, made from figures the service already has:

- **The consumers' wait fraction**: the share of their time spent waiting for elements
  (``DistributedDataset.stats()``'s ``wait_fraction``, reported to the scheduler).
- **Elements per second** taken by the consumers, and produced per data worker.

Each :meth:`ScalingPolicy.decide` call takes one :class:`Demand` sample and returns a
:class:`Decision`: the number of data workers wanted and why. The rules, in order:

1. **Bounds.** Never below ``minimum`` nor above ``maximum``.
2. **Scaling up.** Consumers that wait more than ``wait_high`` of their time are input-bound.
   Without waiting they would take ``rate / (1 - wait)`` elements per second, so the
   workers wanted are that rate divided by one worker's rate, with ``headroom``. At least
   one more worker is asked for, and at most ``step`` times as many as now (a wrong estimate
   costs one step, not the whole cluster).
3. **The knee.** After a scale-up has settled (``settle`` seconds), the consumers' step time
   (``1 / rate`` per consumer) is compared with the one before. If it improved by less than
   ``improvement``, the added workers did not pay: the policy goes back to the count before
   and remembers it as the knee. (Not when the rate before was more than the workers could
   make: the consumers were draining buffers filled earlier, a burst that says nothing.) It does not scale up past a knee until the consumers' rate
   changes by more than ``improvement`` (new trainers, another pipeline).
4. **Scaling down.** Consumers that wait less than ``wait_low`` of their time while the
   workers could produce more than the consumers take with ``headroom``, both for
   ``cooldown`` seconds in a row (a consumer pausing to save a checkpoint is no signal):
   the workers wanted are what the consumers take divided by one
   worker's rate, with ``headroom``, at least one fewer.
5. Otherwise the count stays.

A sample with no consumers reading keeps the count (nothing measured) unless there has been
no read for ``idle`` seconds, in which case the policy returns ``minimum``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["UNBOUNDED", "Decision", "Demand", "ScalingPolicy", "WorkerRate"]

#: A maximum that bounds nothing (the autoscaler bounds its target itself).
UNBOUNDED = 1 << 20


@dataclass(frozen=True)
class Demand:
    """One sample of what the consumers and the data workers did recently."""

    #: When the sample was taken (seconds, any monotonic clock).
    time: float
    #: Data workers serving now.
    workers: int
    #: Consumers reading now (0: nothing measured).
    consumers: int
    #: Elements per second all consumers took.
    rate: float
    #: Share of the consumers' time spent waiting for elements (0 to 1).
    wait: float
    #: Elements per second one data worker produced while busy (0: unknown).
    worker_rate: float


@dataclass(frozen=True)
class Decision:
    """The data workers wanted, and why (a log line and the dashboard say it)."""

    workers: int
    why: str


class ScalingPolicy:
    """Cachew's scaling rules on the service's figures (see the module docstring)."""

    def __init__(self, minimum: int = 1, maximum: int = 8, *, wait_high: float = 0.05,
                 wait_low: float = 0.01, headroom: float = 1.2, step: float = 2.0,
                 improvement: float = 0.1, settle: float = 10.0, cooldown: float = 30.0,
                 idle: float = 300.0) -> None:
        if not 0 <= minimum <= maximum:
            raise ValueError(f"need 0 <= minimum <= maximum, got {minimum} and {maximum}")
        if not 0 <= wait_low < wait_high < 1:
            raise ValueError(f"need 0 <= wait_low < wait_high < 1, got {wait_low} and "
                             f"{wait_high}")
        if headroom < 1 or step <= 1 or not 0 < improvement < 1:
            raise ValueError(f"need headroom >= 1, step > 1 and 0 < improvement < 1, got "
                             f"{headroom}, {step} and {improvement}")
        if min(settle, cooldown, idle) < 0:
            raise ValueError("settle, cooldown and idle must not be negative")
        self.minimum, self.maximum = minimum, maximum
        self.wait_high, self.wait_low = wait_high, wait_low
        self.headroom, self.step, self.improvement = headroom, step, improvement
        self.settle, self.cooldown, self.idle = settle, cooldown, idle
        #: The scale-up being judged: (when it was decided, workers before, step time
        #: before, consumers then).
        self._trial: tuple[float, int, float, int] | None = None
        #: The worker count past which adding did not pay, and the rate it was found at.
        self.knee: tuple[int, float] | None = None
        self._calm_since: float | None = None
        self._last_read: float | None = None
        #: The count decided last (None before the first decision): kept until the next one.
        self.wanted: int | None = None

    def _bounded(self, n: int) -> int:
        return max(self.minimum, min(self.maximum, n))

    def decide(self, d: Demand) -> Decision:
        """The data workers wanted after sample ``d``."""
        if d.consumers <= 0 or d.rate <= 0:
            # no signal either way: a calm spell goes on (the consumers' reports are bursty,
            # and a consumer that pauses needs no more workers)
            if self._last_read is not None and d.time - self._last_read >= self.idle:
                self.wanted = self.minimum
                return Decision(self.minimum, f"no read for {self.idle:g}s")
            return self._keep(d, "nothing read: no change")
        self._last_read = d.time
        step_time = d.consumers / d.rate  # seconds per element, per consumer
        if self._trial is not None:
            decided, before, before_step, consumers = self._trial
            if d.time - decided < self.settle:
                return self._keep(d, "a scale-up is settling")
            self._trial = None
            if consumers == d.consumers and before_step > 0 \
                    and step_time > before_step * (1 - self.improvement):
                self.knee = (before, d.rate)
                self.wanted = self._bounded(before)
                return Decision(self.wanted, (
                    f"{d.workers} workers did not shorten the consumers' step by "
                    f"{self.improvement:.0%} (from {before} workers): back to {before}"))
        if self.knee is not None and abs(d.rate - self.knee[1]) > self.improvement * self.knee[1]:
            self.knee = None  # the demand changed: the knee may have moved
        per_worker = d.worker_rate if d.worker_rate > 0 else d.rate / max(d.workers, 1)
        if d.wait > self.wait_high:
            self._calm_since = None
            wanted = d.rate / (1 - min(d.wait, 0.99)) * self.headroom / per_worker
            n = max(d.workers + 1, min(math.ceil(wanted), math.floor(d.workers * self.step)))
            if self.knee is not None:
                n = min(n, self.knee[0])
            n = self._bounded(n)
            if n <= d.workers:
                why = ("at the knee" if self.knee is not None else "at the maximum")
                return self._keep(d, f"consumers wait {d.wait:.0%}: {why}")
            # a rate beyond what the workers can make came from buffers filled earlier (a
            # consumer speeding up drains its prefetch first): no step time to judge by
            burst = d.worker_rate > 0 and d.rate > d.workers * d.worker_rate * self.headroom
            self._trial = (d.time, d.workers, 0.0 if burst else step_time, d.consumers)
            self.wanted = n
            return Decision(n, f"consumers wait {d.wait:.0%} of their time: {d.workers} -> {n}")
        capacity = per_worker * d.workers
        if d.wait < self.wait_low and d.workers > self.minimum \
                and capacity > d.rate * self.headroom:
            # calm: the consumers do not wait and the workers could give more; only after
            # `cooldown` of it in a row (a consumer that pauses to checkpoint is no signal)
            if self._calm_since is None:
                self._calm_since = d.time
            if d.time - self._calm_since >= self.cooldown:
                n = self._bounded(min(d.workers - 1,
                                      math.ceil(d.rate * self.headroom / per_worker)))
                self._calm_since = None
                self.wanted = n
                return Decision(n, (f"consumers wait {d.wait:.1%} and {d.workers} workers "
                                    f"could give {capacity:,.0f} elements/s for "
                                    f"{d.rate:,.0f}: {d.workers} -> {n}"))
            return self._keep(d, "consumers keep up: no change yet")
        self._calm_since = None
        return self._keep(d, f"consumers wait {d.wait:.0%}: no change")

    def _keep(self, d: Demand, why: str) -> Decision:
        """No new decision: the count decided last, which the cluster may still be reaching
        (workers starting, or being drained). Answering the count seen now instead would
        call off a scale-up under way, and Dask's ``Adaptive`` (which retires a worker only
        once it was proposed ``wait_count`` times in a row) would never scale down."""
        return Decision(self._bounded(d.workers if self.wanted is None else self.wanted), why)


class WorkerRate:
    """One data worker's rate while busy, learnt when the consumers were input-bound.

    A worker whose consumers wait is the bottleneck, so it serves as fast as it can: the
    elements per second the data workers served, divided by their number, is then one
    worker's rate (averaged with the previous estimate, as workers that just joined serve
    less for a moment). A worker whose consumers do not wait serves only what they take,
    which says nothing of its rate: the estimate is kept. 0 until first learnt (the policy
    then counts the consumers' rate over the workers, and never scales down on it).
    """

    def __init__(self, wait_high: float) -> None:
        self.wait_high = wait_high
        self.value = 0.0

    def observe(self, wait: float, served_rate: float, workers: int) -> float:
        """The estimate after one sample (the consumers' wait share, elements per second
        the ``workers`` data workers served)."""
        if workers > 0 and served_rate > 0 and wait > self.wait_high:
            rate = served_rate / workers
            self.value = rate if self.value <= 0 else (self.value + rate) / 2
        return self.value
