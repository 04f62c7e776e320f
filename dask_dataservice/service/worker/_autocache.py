"""A data worker's split cache: what ``autocache()`` ops keep and serve (issue 26, part 3).

Theory of operation
-------------------
An ``autocache()`` op (:class:`~dask_dataservice.data.ops_more.AutoCache`) marks where a
pipeline may be cached. On a data worker its iteration comes here (:meth:`SplitCache.iterate`,
on the task's thread). The unit is a **split**: under DYNAMIC and FILE sharding each split the
source reads is made alone (the ops before the marker run over that one split, which is why
only element-wise ops may come before it), and its elements are kept under the split's index;
under OFF, DATA and HINT sharding the whole pass is one unit. So a second epoch, a second job
of the same dataset (the same fingerprint) or another trainer reads a split from the cache
wherever that split was cached before, and the dispatcher hands each worker the splits it
cached first (the worker reports them, ``dataservice_autocached``; see the dispatcher's
``_locality``).

Before each split, :class:`~._autocache_policy.CachePolicy` decides from what this worker
measured of the dataset (Cachew's figures): the seconds the ops before the marker spend per
element (timed around each ``next()`` on them, so what comes after is not counted), the
seconds to write an element into the cache and to read it back, and the bytes per element:

- ``get``: serve the split from the cache (memory, or a file on this worker's disk);
- ``put``: make the split and keep its elements as they pass (in memory while the worker's
  ``dataservice.autocache.memory-limit`` allows, then in a file under its local directory up
  to ``disk-limit``); a split is kept only once it was read to its end;
- ``compute``: make the split (the pipeline is cheaper than its cache, the split fits
  nowhere, or reading back was measured not ``min-speedup`` times faster: then the split's
  cache is dropped).

A change of decision is logged; :meth:`SplitCache.status` is what ``dds.status()`` and the
dashboard show. Everything runs on task threads (one lock guards the books); files are
removed at teardown.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from dask.sizeof import sizeof

from ... import config
from ...data._base import IterContext
from ...data.splits import ListSplitProvider
from ._autocache_policy import CacheDecision, CacheFigures, CachePolicy

__all__ = ["SplitCache", "report"]

logger = logging.getLogger("dask_dataservice.service.worker.autocache")

#: The key of a whole pass (OFF, DATA and HINT sharding: no split provider).
PASS = "pass"


@dataclass
class _Entry:
    """One cached split: its elements in memory, or the file holding them."""

    where: str
    elements: int
    nbytes: int
    items: list[Any] | None = None
    path: str | None = None


@dataclass
class _Dataset:
    """This worker's cache and figures of one dataset (an ``autocache()`` op's input)."""

    fingerprint: str
    force: str
    entries: dict[Hashable, _Entry] = field(default_factory=dict)
    produce_seconds: float = 0.0
    produced: int = 0
    write_seconds: float = 0.0
    written: int = 0
    written_bytes: int = 0
    splits_written: int = 0
    read_seconds: dict[str, float] = field(default_factory=lambda: {"memory": 0.0, "disk": 0.0})
    read: dict[str, int] = field(default_factory=lambda: {"memory": 0, "disk": 0})
    #: A put that outgrew the room left there: later puts skip that place.
    full: set[str] = field(default_factory=set)
    hits: int = 0
    computed: int = 0
    dropped: int = 0
    decision: CacheDecision | None = None

    def figures(self, entry: _Entry | None) -> CacheFigures:
        where = entry.where if entry is not None else None
        return CacheFigures(
            produce_seconds=self.produce_seconds / self.produced if self.produced else 0.0,
            write_seconds=self.write_seconds / self.written if self.written else 0.0,
            read_seconds=(self.read_seconds[where] / self.read[where]
                          if where is not None and self.read[where] else 0.0),
            element_bytes=self.written_bytes / self.written if self.written else 0.0,
            elements=self.written // self.splits_written if self.splits_written else 0,
            passes=self.hits + self.computed, complete=entry is not None,
            cached_in=where)  # type: ignore[arg-type]


class _Writer:
    """Keeps one split's elements as they pass, in memory or in a file; gives up (and
    frees what it kept) once they outgrow ``budget`` bytes."""

    def __init__(self, where: str, budget: int, path: str) -> None:
        self.where, self.budget, self.path = where, budget, path
        self.items: list[Any] = []
        self.count = 0  # elements written to the file
        self.nbytes = 0
        self.seconds = 0.0
        self._file: Any = None
        if where == "disk":
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._file = open(path + ".tmp", "wb")  # noqa: SIM115 - closed in finish/abort

    def add(self, x: Any) -> bool:
        t0 = time.perf_counter()
        self.nbytes += sizeof(x)
        if self.nbytes > self.budget:
            self.abort()
            return False
        if self._file is not None:
            pickle.dump(x, self._file, protocol=5)
            self.count += 1
        else:
            self.items.append(x)
        self.seconds += time.perf_counter() - t0
        return True

    def finish(self) -> _Entry:
        if self._file is None:
            return _Entry("memory", len(self.items), self.nbytes, items=self.items)
        t0 = time.perf_counter()
        self._file.close()
        os.replace(self.path + ".tmp", self.path)
        self.seconds += time.perf_counter() - t0
        return _Entry("disk", self.count, self.nbytes, path=self.path)

    def abort(self) -> None:
        self.items = []
        if self._file is not None:
            self._file.close()
            self._file = None
            with_suppressed_oserror(os.remove, self.path + ".tmp")


def with_suppressed_oserror(fn: Callable[..., Any], *args: Any) -> None:
    try:
        fn(*args)
    except OSError:
        pass


async def report(plugin: Any, task: Any, indices: list[int]) -> None:
    """Tell the dispatcher which splits of the task's dataset this worker cached (only the
    hand-out's order depends on it: a lost report costs cache hits, nothing else)."""
    try:
        await plugin.worker.scheduler.dataservice_autocached(
            task_id=task["task_id"], indices=indices, job_token=task.get("job_token"))
    except Exception as e:  # noqa: BLE001
        logger.debug("dataservice: reporting cached splits failed: %r", e)


class SplitCache:
    """One data worker's ``autocache()`` caches, all datasets together (see the module doc).

    ``report(indices)`` hooks come from the split provider (DYNAMIC): the dispatcher learns
    which splits this worker holds."""

    def __init__(self, directory: str, *, memory_bytes: int | None = None,
                 disk_bytes: int | None = None, force: str | None = None,
                 min_speedup: float | None = None) -> None:
        self.directory = os.path.join(directory, "dds-autocache")
        self.memory_bytes = config.get_bytes("autocache.memory-limit") \
            if memory_bytes is None else memory_bytes
        self.disk_bytes = config.get_bytes("autocache.disk-limit") \
            if disk_bytes is None else disk_bytes
        self.force = str(config.get("autocache.force") if force is None else force)
        self.min_speedup = float(config.get("autocache.min-speedup")
                                 if min_speedup is None else min_speedup)
        CachePolicy(self.memory_bytes, self.disk_bytes, force=self.force,  # type: ignore[arg-type]
                    min_speedup=self.min_speedup)  # bad settings fail here, at the start
        self._lock = threading.Lock()
        self._datasets: dict[str, _Dataset] = {}
        self.memory_used = 0
        self.disk_used = 0
        self._files = 0

    # -- the task thread -----------------------------------------------------------------
    def iterate(self, op: Any, ctx: IterContext) -> Iterator[Any]:
        """The elements of ``op`` (an ``AutoCache``), split by split (task thread)."""
        ds = self._dataset(op)
        provider = ctx.split_provider
        if provider is None:
            yield from self._unit(ds, op, ctx, PASS, None)
            return
        note = getattr(provider, "cached", None)
        while (split := provider.get_next()) is not None:
            index = getattr(provider, "last_index", None)
            key: Hashable | None = index if index is not None else split
            try:
                hash(key)
            except TypeError:
                key = None
            sub = replace(ctx, split_provider=ListSplitProvider([split]))
            yield from self._unit(ds, op, sub, key, note if index is not None else None)

    def _dataset(self, op: Any) -> _Dataset:
        fp = op.fingerprint
        with self._lock:
            ds = self._datasets.get(fp)
            if ds is None:
                ds = self._datasets[fp] = _Dataset(fp, op.force or self.force)
            ds.force = op.force or self.force  # the latest read's (one cache, any marker)
            return ds

    def _decide(self, ds: _Dataset, entry: _Entry | None) -> CacheDecision:
        with self._lock:
            policy = CachePolicy(
                0 if "memory" in ds.full else max(0, self.memory_bytes - self.memory_used),
                0 if "disk" in ds.full else max(0, self.disk_bytes - self.disk_used),
                                 force=ds.force,  # type: ignore[arg-type]
                                 min_speedup=self.min_speedup)
            decision = policy.decide(ds.figures(entry))
            before, ds.decision = ds.decision, decision
        if before is None or (before.mode, before.where) != (decision.mode, decision.where):
            logger.info("autocache: dataset %s: %s", ds.fingerprint[:12], decision.why)
        return decision

    def _unit(self, ds: _Dataset, op: Any, ctx: IterContext, key: Hashable | None,
              note: Callable[[int], None] | None) -> Iterator[Any]:
        """One split (or the whole pass): served from the cache, or made (and kept)."""
        entry = ds.entries.get(key) if key is not None else None
        decision = self._decide(ds, entry)
        if decision.mode == "get" and entry is not None:
            yield from self._serve(ds, entry)
            return
        if entry is not None:
            self._drop(ds, key)
        writer = None
        if decision.mode == "put" and key is not None and decision.where is not None:
            with self._lock:
                if decision.where == "memory":
                    budget = self.memory_bytes - self.memory_used
                else:
                    budget = self.disk_bytes - self.disk_used
                self._files += 1
                path = os.path.join(self.directory, ds.fingerprint, f"{self._files}.pkl")
            writer = _Writer(decision.where, budget, path)
        it = op.input.iterate(ctx)
        made, spent, done = 0, 0.0, False
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    x = next(it)
                except StopIteration:
                    break
                finally:
                    spent += time.perf_counter() - t0
                made += 1
                if writer is not None and not writer.add(x):
                    # outgrew the room left there: made, not kept; the next split goes on
                    ds.full.add(writer.where)  # to the next place (disk), or is not kept
                    writer = None
                yield x
            done = True
        finally:
            if not done:
                close = getattr(it, "close", None)
                if close is not None:
                    close()
                if writer is not None:
                    writer.abort()
            with self._lock:
                ds.produce_seconds += spent
                ds.produced += made
                ds.computed += 1
        if writer is not None:
            self._keep(ds, key, writer, note)

    def _keep(self, ds: _Dataset, key: Hashable, writer: _Writer,
              note: Callable[[int], None] | None) -> None:
        entry = writer.finish()
        with self._lock:
            old = ds.entries.get(key)
            if old is not None:  # two tasks made the same split: keep one
                self._forget(old)
            ds.entries[key] = entry
            if entry.where == "memory":
                self.memory_used += entry.nbytes
            else:
                self.disk_used += entry.nbytes
            ds.write_seconds += writer.seconds
            ds.written += entry.elements
            ds.written_bytes += entry.nbytes
            ds.splits_written += 1
        if note is not None and isinstance(key, int):
            note(key)

    def _serve(self, ds: _Dataset, entry: _Entry) -> Iterator[Any]:
        spent, n = 0.0, 0
        try:
            if entry.items is not None:
                t0 = time.perf_counter()
                items = list(entry.items)  # what reading back costs: a copy of the list
                spent += time.perf_counter() - t0
                for x in items:
                    n += 1
                    yield x
            else:
                assert entry.path is not None
                with open(entry.path, "rb") as f:
                    while True:
                        t0 = time.perf_counter()
                        try:
                            x = pickle.load(f)
                        except EOFError:
                            break
                        finally:
                            spent += time.perf_counter() - t0
                        n += 1
                        yield x
        finally:
            with self._lock:
                ds.read_seconds[entry.where] += spent
                ds.read[entry.where] += n
                ds.hits += 1

    def _drop(self, ds: _Dataset, key: Hashable) -> None:
        with self._lock:
            entry = ds.entries.pop(key, None)
            if entry is None:
                return
            ds.dropped += 1
            self._forget(entry)

    def _forget(self, entry: _Entry) -> None:
        """Free one entry's memory or file (under the lock)."""
        if entry.where == "memory":
            self.memory_used -= entry.nbytes
        else:
            self.disk_used -= entry.nbytes
            if entry.path is not None:
                with_suppressed_oserror(os.remove, entry.path)

    # -- any thread ----------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """Per dataset: what is cached where, hits, the last decision and why."""
        with self._lock:
            out = {}
            for fp, ds in self._datasets.items():
                f = ds.figures(None)
                out[fp] = {
                    "splits": len(ds.entries), "hits": ds.hits, "computed": ds.computed,
                    "dropped": ds.dropped, "force": ds.force,
                    "memory_bytes": sum(e.nbytes for e in ds.entries.values()
                                        if e.where == "memory"),
                    "disk_bytes": sum(e.nbytes for e in ds.entries.values()
                                      if e.where == "disk"),
                    "produce_us": f.produce_seconds * 1e6, "write_us": f.write_seconds * 1e6,
                    "decision": None if ds.decision is None else ds.decision.mode,
                    "why": None if ds.decision is None else ds.decision.why}
            return {"memory_bytes": self.memory_used, "disk_bytes": self.disk_used,
                    "datasets": out}

    def close(self) -> None:
        """Drop everything (teardown; files included)."""
        with self._lock:
            self._datasets.clear()
            self.memory_used = self.disk_used = 0
        shutil.rmtree(self.directory, ignore_errors=True)
