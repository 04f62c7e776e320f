"""The journal writer's snapshots: rotation and compaction (see "Snapshots" in
:mod:`.journal`), a mixin of :class:`~.journal.JournalWriter` kept in its own module."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from ._journal_format import (
    JournalRecord,
    Snapshot,
    _scan_segment,
    _segments_after,
    list_snapshots,
    read_snapshot,
    remove_covered,
    segment_path,
    snapshot_path,
    write_snapshot,
)
from ._journal_fs import JournalPath, RemoteSegment
from ._journal_lineage import Manifest, snapshot_crc

if TYPE_CHECKING:
    from .journal import JournalWriterMetrics

logger = logging.getLogger("dask_dataservice.service.dispatcher.journal")

#: ``compact(snapshot, records) -> payload``: the new snapshot's payload from the newest
#: snapshot (or None) and the records of the segments it folds in (run on a thread of the
#: writer's; raising leaves the journal as it was).
Compactor = Callable[[Snapshot | None, Iterator[JournalRecord]], bytes]


class _Compacting:
    """Rotation and compaction; the attributes are :class:`~.journal.JournalWriter`'s."""

    work_dir: JournalPath
    path: JournalPath | None
    segment: int | None
    metrics: JournalWriterMetrics
    _fd: int | RemoteSegment
    _size: int
    _crc: int
    _compact: Compactor | None
    _snapshot_records: int | None
    _snapshot_bytes: int | None
    _segment_records: int
    _segment_bytes: int
    _compactor: ThreadPoolExecutor | None
    _compaction: concurrent.futures.Future[None] | None
    _compaction_lock: threading.Lock
    _stop_compaction: threading.Event

    def _new_segment(self, number: int, closing: tuple[int, int, int] | None = None,
                     ) -> tuple[int | RemoteSegment, JournalPath]:
        raise NotImplementedError

    def _write_manifest(self, change: Callable[[Manifest], None]) -> None:
        raise NotImplementedError


    def _segment_full(self) -> bool:
        """Whether the current segment holds enough to be folded into a snapshot.

        By records or bytes, but not before the segment holds a quarter of the last
        snapshot's size (the byte threshold is at least that size): a large state is not
        rewritten more often than the journal grows by a good part of it (write
        amplification at most about 4 by records, 2 by bytes). Except that twice
        ``snapshot_records`` records fold whatever the state's size: a restart replays at
        most that many (a state holding a million file paths, 31 MB, let 47,000 records of
        3 M splits pile up unfolded, and a restart replay all of them; issue 22 s5).
        """
        records = self._snapshot_records
        if records and self._segment_records >= 2 * records:
            return True
        if self._segment_bytes < self.metrics.last_snapshot_bytes // 4:
            return False
        if records and self._segment_records >= records:
            return True
        if self._snapshot_bytes:
            bound = max(self._snapshot_bytes, self.metrics.last_snapshot_bytes)
            return self._segment_bytes >= bound
        return False

    def _rotate(self) -> None:
        """Switch to a new segment (on the I/O thread, under the file lock) and compact."""
        assert self.segment is not None  # started
        fd, path = self._new_segment(self.segment + 1,
                                     closing=(self.segment, self._size, self._crc))
        if isinstance(self._fd, int):
            os.close(self._fd)
        self._fd, self.path, self.segment = fd, path, self.segment + 1
        self._segment_records = self._segment_bytes = 0
        self.metrics.rotations += 1
        self._request_compaction(self.segment)

    def request_snapshot(self) -> concurrent.futures.Future[None] | None:
        """Fold every segment before the current one into a snapshot, in the background.

        The dispatcher calls this after a recovery that replayed a long tail, so that the
        next restart does not replay it again. Returns the compaction's future (None without
        a ``compact`` callback, or when one is already queued, which covers the same).
        """
        if self._compactor is None or self.segment is None:
            return None
        return self._request_compaction(self.segment)

    def _request_compaction(self, base: int) -> concurrent.futures.Future[None] | None:
        with self._compaction_lock:
            pending = self._compaction
            if pending is not None and not pending.running() and not pending.done():
                return None  # the queued one will read the directory when it runs
            if self._compactor is None:  # shut down meanwhile
                return None
            try:
                self._compaction = self._compactor.submit(self._compact_before, base)
            except RuntimeError:  # shut down meanwhile
                return None
            return self._compaction

    def _compact_before(self, base: int) -> None:
        """Write a snapshot covering every segment before ``base``; delete what it covers.

        Runs on the compaction thread. The snapshot is the old one plus the records of the
        closed segments ``old base .. base - 1``, folded by the ``compact`` callback; it is
        written atomically (:func:`write_snapshot`) before anything is deleted, so a crash
        at any point leaves a journal that replays to the same state.
        """
        start = time.perf_counter()
        try:
            snapshots = list_snapshots(self.work_dir)
            previous = read_snapshot(snapshots[-1][1]) if snapshots else None
            if previous is not None and previous.base >= base:
                return
            covered = [(n, p) for n, p in _segments_after(
                self.work_dir, snapshots[-1] if snapshots else None) if n < base]
            assert self._compact is not None  # a compactor runs only with the callback
            payload = self._compact(previous, self._closed_records(covered))
            if self._stop_compaction.is_set():
                return
            path = write_snapshot(self.work_dir, base, payload)
            crc = snapshot_crc(path)

            def follow(m: Manifest) -> None:  # named before what it covers is deleted
                m.snapshot = (base, crc)
                m.closed = {k: v for k, v in m.closed.items() if k >= base}

            self._write_manifest(follow)
            deleted = remove_covered(self.work_dir)
            m = self.metrics
            m.snapshots_written += 1
            m.last_snapshot_bytes = snapshot_path(self.work_dir, base).stat().st_size
            m.files_deleted += len(deleted)
        except _CompactionStopped:
            pass
        except Exception:  # noqa: BLE001 - the journal is still whole, only larger
            self.metrics.compaction_errors += 1
            logger.exception("journal %s: writing a snapshot before segment %d failed; the "
                             "journal keeps its segments", self.work_dir, base)
        finally:
            self.metrics.compaction_seconds += time.perf_counter() - start

    def _closed_records(self, segments: list[tuple[int, JournalPath]]
                        ) -> Iterator[JournalRecord]:
        for i, (_, path) in enumerate(segments):
            next_path = (segments[i + 1][1] if i + 1 < len(segments)
                         else segment_path(self.work_dir, segments[-1][0] + 1))
            for record in _scan_segment(path, is_last=False, repair=False,
                                        next_path=next_path):
                if self._stop_compaction.is_set():
                    raise _CompactionStopped
                yield record


class _CompactionStopped(Exception):
    """The writer is closing: abandon the snapshot being made."""
