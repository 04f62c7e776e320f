"""Cache or recompute: the autocache decision, with no I/O (issue 26, part 3).

Cachew (USENIX ATC'22) caches a pipeline's output when reading it back is cheaper than making
it again, and decides per job from what it measured, not from a user's guess. This module is
that decision, made per dataset (a fingerprint: the same pipeline read by several jobs, epochs
or trainers) from figures the service measures:

- the seconds the pipeline spends per element it makes (the per-op own times of
  ``DistributedDataset.stats()``, summed);
- the seconds one element costs to write into the cache, and to read back from it (measured
  while the cache is written, and read);
- the bytes per element, the elements of one pass, and how many passes were read.

:meth:`CachePolicy.decide` answers a :class:`CacheDecision`: ``compute`` (read the
pipeline), ``put`` (read the pipeline and write its output to the cache as it goes), or
``get`` (serve from the cache), with where (``memory`` up to a limit, else ``disk``) and why.
The rules, in order:

1. **Forced.** ``force="never"``: compute. ``force="always"``: put, then get, wherever it fits
   (memory first), whatever it costs.
2. **It must fit.** A pass larger than the memory limit goes to disk; larger than the disk
   limit (or no disk allowed), compute.
3. **The first pass** of a dataset is put only when the pipeline is expensive: making an
   element costs more than ``min_speedup`` times writing it (a cheap pipeline is not worth
   the cache's writes and memory).
4. **Once the cache is complete**, a later pass is served from it if reading an element back
   is at least ``min_speedup`` times cheaper than making it; otherwise the cache is dropped
   and the pipeline computes (measured, not assumed: a cache on a slow disk can lose to a
   fast pipeline).
5. A cache still being written (another pass read it meanwhile) is not read: compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["CacheDecision", "CacheFigures", "CachePolicy"]

Mode = Literal["compute", "put", "get"]
Where = Literal["memory", "disk"]


@dataclass(frozen=True)
class CacheFigures:
    """What the service measured of one dataset."""

    #: Seconds the pipeline spends per element it makes (its ops' own times).
    produce_seconds: float
    #: Seconds one element costs to write into the cache (0: not measured yet).
    write_seconds: float
    #: Seconds one element costs to read back from the cache (0: not measured yet).
    read_seconds: float
    #: Bytes per element (as served).
    element_bytes: float
    #: Elements in one pass (its cardinality; -1: infinite or unknown).
    elements: int
    #: Passes read so far (epochs, jobs, trainers), this one not counted.
    passes: int
    #: The cache holds one whole pass.
    complete: bool = False
    #: Where the cache is, if any.
    cached_in: Where | None = None


@dataclass(frozen=True)
class CacheDecision:
    """What a read of the dataset does (``where``: the cache's place for put and get)."""

    mode: Mode
    where: Where | None
    why: str


class CachePolicy:
    """The autocache rules (see the module docstring)."""

    def __init__(self, memory_bytes: int, disk_bytes: int | None = None, *,
                 force: Literal["auto", "always", "never"] = "auto",
                 min_speedup: float = 1.5) -> None:
        if memory_bytes < 0 or (disk_bytes is not None and disk_bytes < 0):
            raise ValueError(f"cache limits must not be negative, got {memory_bytes} and "
                             f"{disk_bytes}")
        if force not in ("auto", "always", "never"):
            raise ValueError(f"force must be 'auto', 'always' or 'never', got {force!r}")
        if min_speedup < 1:
            raise ValueError(f"min_speedup must be at least 1, got {min_speedup}")
        self.memory_bytes, self.disk_bytes = memory_bytes, disk_bytes
        self.force, self.min_speedup = force, min_speedup

    def _where(self, f: CacheFigures) -> Where | None:
        """Where one pass fits (memory first), or None."""
        if f.elements < 0:
            return None
        size = f.elements * f.element_bytes
        if self.memory_bytes > 0 and size <= self.memory_bytes:
            return "memory"
        if self.disk_bytes is None or 0 < self.disk_bytes and size <= self.disk_bytes:
            return "disk"
        return None

    def decide(self, f: CacheFigures) -> CacheDecision:
        """What the next read of the dataset does."""
        if self.force == "never":
            return CacheDecision("compute", None, "autocache forced off")
        if f.complete and f.cached_in is not None:
            return self._complete(f)
        where = self._where(f)
        if where is None:
            size = "an endless or unknown pass" if f.elements < 0 else \
                f"a pass of {f.elements * f.element_bytes:,.0f} bytes"
            return CacheDecision("compute", None, f"{size} fits no cache")
        if f.cached_in is not None:
            return CacheDecision("compute", None, "the cache is still being written")
        if self.force == "always":
            return CacheDecision("put", where, f"autocache forced on: caching in {where}")
        if f.write_seconds > 0 and f.produce_seconds <= self.min_speedup * f.write_seconds:
            return CacheDecision("compute", None, (
                f"making an element ({_us(f.produce_seconds)}) costs less than "
                f"{self.min_speedup:g}x writing it ({_us(f.write_seconds)}): not cached"))
        return CacheDecision("put", where, (
            f"making an element costs {_us(f.produce_seconds)}: caching the pass in {where}"))

    def _complete(self, f: CacheFigures) -> CacheDecision:
        assert f.cached_in is not None
        if self.force == "always" or f.read_seconds <= 0:
            return CacheDecision("get", f.cached_in, f"served from the {f.cached_in} cache")
        if f.produce_seconds >= self.min_speedup * f.read_seconds:
            return CacheDecision("get", f.cached_in, (
                f"reading an element back ({_us(f.read_seconds)}) is "
                f"{f.produce_seconds / f.read_seconds:.1f}x cheaper than making it "
                f"({_us(f.produce_seconds)}): served from the {f.cached_in} cache"))
        return CacheDecision("compute", None, (
            f"reading an element back ({_us(f.read_seconds)}) is not {self.min_speedup:g}x "
            f"cheaper than making it ({_us(f.produce_seconds)}): the cache is dropped"))


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} us"
