"""Write-ahead journal of opaque byte records, with group commit and torn-tail repair.

The dispatcher keeps its state in a pure state machine and, in fault-tolerant mode, appends
every update to this journal *before* applying it; on restart it replays the journal. The
journal does not know what a record means: a record is a ``bytes`` payload (the encoding of
state updates lives elsewhere). This is TensorFlow's ``FileJournalWriter`` /
``FileJournalReader`` (``tensorflow/core/data/service/journal.cc``) with two changes: many
concurrent appends share one fsync (group commit), and a record torn by a crash at the end of
the journal is cut off with a warning instead of failing the restart.

Usage::

    for payload in read_journal(work_dir):          # replay first (repairs a torn tail)
        state.apply(decode(payload))
    writer = JournalWriter.open(work_dir)           # then start a new segment
    ...
    await writer.append(encode(update))             # durable when this returns
    state.apply(update)
    ...
    await writer.aclose()

Directory layout
----------------
``work_dir`` holds one file per writer start (and per rotation, see Snapshots), ``journal_<n>``, where ``<n>`` is a decimal
number. This module writes ``<n>`` zero-padded to 8 digits (``journal_00000003``) so that
``ls`` sorts them, but it parses any number of digits (``journal_3`` is the same segment
number), matching the whole name against ``journal_(\\d+)``; other files are ignored. Two names
with the same number are an error, and so is a gap in the numbering (a deleted segment).

Every :meth:`JournalWriter.start` lists the directory and creates segment ``max(n) + 1`` (``0``
in an empty directory) with ``O_EXCL``: a writer never appends to an older segment, so a crashed
run's file is never written again. After creating the file it writes the segment header,
fsyncs the file and fsyncs the directory, so the new name itself is durable.

``work_dir`` may also be an fsspec URL (``s3://bucket/dds``): the same files, each segment a
chain of immutable objects, one per group commit, and snapshots and the manifest written
whole; ``file://`` is the local directory; a URL that cannot be kept durably is refused
(:mod:`._journal_fs`).

Segment format (all integers little-endian)
-------------------------------------------
A segment is a 16-byte header followed by zero or more records::

    offset  size  field
    0       8     magic            b"DDSJRNL\\x00"
    8       4     version          u32, currently 2 (1: written before the manifest)
    12      4     header_crc       u32, masked CRC-32 of bytes 0..11

Each record is a 12-byte header followed by the payload::

    offset  size  field
    0       4     length           u32, payload length in bytes (0 .. 2**32 - 1)
    4       4     length_crc       u32, masked CRC-32 of the 4 bytes of ``length``
    8       4     payload_crc      u32, masked CRC-32 of the payload
    12      length payload         opaque bytes

so the first record starts at byte 16 and record ``k + 1`` starts ``12 + length_k`` bytes after
record ``k``. There is no padding and no footer.

The checksum is the CRC-32 of :func:`zlib.crc32` (the IEEE/zlib polynomial, *not* CRC-32C;
zlib is in the standard library and fast enough here). Like TFRecord and LevelDB, each stored
CRC is *masked*, ``((crc >> 15) | (crc << 17)) + 0xA282EAD8 mod 2**32``, so that a payload that
itself contains CRCs does not produce degenerate checksums, and so that all-zero bytes never
form a valid header (the masked CRC of an empty payload is ``0xA282EAD8``, of a zero length
``0x60BB2D61``). ``length_crc`` lets the reader reject a garbage length before trusting it to
find the next record.

Reading and damage
------------------
:func:`read_journal` replays all segments in number order. A segment of zero bytes (created,
then the process died before the header was written) and a segment with only a header (a
start that wrote nothing) are both fine anywhere.

Damage at the **end of the last segment** that a crash can cause is a *torn tail*: the file
ends inside a segment header or a record header, a record's length runs past the end of the
file, the rest of the file from a record (or segment) header on is zero bytes (the file size
was persisted before its data), or the final record fails its payload checksum and its
bytes within some 512-byte sector are all zero (a sector that was never written). A torn tail
was never acknowledged (appends return only after fsync, and fsync covers everything written
before it), so it is safe to drop: the reader warns with :class:`JournalTornTailWarning`, naming the file and byte offset, and
truncates the file to the end of the last good record (and fsyncs it), so that every later
reader and writer sees the same journal. :meth:`JournalWriter.start` does the same check of
the last segment before creating a new one, because once a newer segment exists the old tail
would no longer be last.

Anything else is :class:`JournalCorruptedError` (``.path``, ``.offset``, message naming both):
a checksum mismatch on a record that is not the final one, any damage in a segment that is not
the last, a bad segment magic or header checksum, an unknown version.

.. warning::
   The torn-tail rules assume that a crash leaves the unsynced end of the last segment as a
   prefix of what was written, possibly followed by zeros. If a crash leaves a hole in the
   *middle* of the last, never-acknowledged batch while later bytes of the same batch survive,
   the reader reports corruption rather than guess; truncate the last segment by hand at the
   reported offset after checking that the records after it were not acknowledged.

Snapshots
---------
A journal that only grows would make every restart replay the whole history. A writer given
a ``compact`` callback therefore folds old segments into a *snapshot*: when the current
segment holds ``snapshot_records`` records or ``snapshot_bytes`` bytes (at least the size of
the last snapshot; and never less than a quarter of it, so a large state is not rewritten more
often than the journal grows by a good part of its size), the I/O thread starts segment ``n + 1`` after the batch's fsync, and a
compaction thread of the writer's builds ``compact(newest snapshot, records of the segments
it does not cover and before n + 1)`` and writes it as ``snapshot_<n + 1>``. The snapshot
stands for every record of the segments before its *base* ``n + 1``; replay is the newest
snapshot plus the segments from its base on (:func:`load_journal`). The event loop does no
part of it.

A snapshot file (all integers little-endian)::

    offset  size  field
    0       8     magic            b"DDSSNAP\x00"
    8       4     version          u32, currently 2 (the journal's FORMAT_VERSION)
    12      8     base             u64, the first segment it does not cover (as in its name)
    20      4     header_crc       u32, masked CRC-32 of bytes 0..19
    24      12    record header    as a journal record's: length, length_crc, payload_crc
    36      length payload         opaque bytes (the dispatcher's: see ``_state_codec``)

and nothing after the payload. It is written as ``snapshot_<base>.tmp``, fsync'd, renamed to
``snapshot_<base>`` and the directory fsync'd; only then are the covered segments, older
snapshots and ``.tmp`` files deleted (:func:`remove_covered`), oldest first. Every crash
point leaves a journal that replays to the same state:

- during the write: a ``.tmp`` file, ignored by readers and deleted by the next start (once
  the manifest shows the journal whole: a snapshot renamed to ``.tmp`` by hand is missing);
- after the rename, before or during the deletions: the new snapshot and some or all of
  the segments and snapshots it covers, which replay ignores (and the next start deletes).

A snapshot is complete before it has its name, so any damage in one (checksum, length,
version, a base that disagrees with its name) is :class:`JournalCorruptedError`, as is a
missing segment ``base`` (it is created durably before the snapshot is requested). A
compaction that fails (an I/O error, a record its callback refuses) is logged and counted
(``metrics.compaction_errors``); the journal keeps its segments and stays correct, only
larger. Closing the writer abandons a compaction under way at its next record.

Boundaries. The journal promises that every record whose ``append`` returned (every reply
the dispatcher sent after it) is replayed after a crash, and that a record torn by the crash
is dropped with a warning. A segment cut *exactly* at a record boundary is a valid, shorter
journal: nothing in the format tells it from one whose writer simply appended less (there is
no footer or record count), so the journal cannot tell that acknowledged records went
missing through damage after the fact, e.g. a file truncated by hand or a disk that lost
synced data. See ``docs/guarantees.md``.

Manifest
--------
``work_dir/manifest`` names the files the directory must hold (the newest segment, the
snapshot the segments follow, each closed segment's size and CRC-32) and the work_dir's
lineage and id high-water mark, so that a file deleted, renamed, truncated at a record
boundary or replaced by an older copy is :class:`JournalCorruptedError` naming it rather than
a shorter journal; see :mod:`._journal_lineage`. :meth:`JournalWriter.start` checks it before
it creates, repairs or deletes anything.

Group commit
------------
:meth:`JournalWriter.append` frames the record and queues it at once (its position in the file
is fixed when ``append`` is *called*), then returns a future that resolves after the record is
fsync'd. A single flush task drains the queue: it takes everything queued, writes it with one
``write`` and one ``fdatasync`` on the writer's own one-thread executor (never on the event
loop), resolves those futures in record order, and repeats while appends keep arriving. So
all appends made in one event-loop tick, and all appends made while an fsync is in progress,
share one fsync. :class:`JournalWriterMetrics` counts records, fsyncs and bytes.

Futures are resolved in record order, so tasks waiting on ``await writer.append(u)`` wake up
in journal order; a caller that applies ``u`` right after the ``await`` (with no other
``await`` in between) applies updates in the order they were journaled, which is the order
replay will apply them.

An I/O error while writing or syncing fails that batch's appends with the error and makes the
writer unusable (:class:`JournalClosedError` on every later append): after a failed fsync the
kernel may have dropped the dirty pages, so retrying could report success for data that is
gone. Restart the writer; the next start repairs the torn tail.

The writer is not thread-safe: call :meth:`~JournalWriter.append` from one event loop. A
single process should own a journal directory at a time (``O_EXCL`` stops two writers from
sharing a segment, but nothing else coordinates them), and :func:`read_journal` must not run
while any writer is appending to that directory: it would take the batch being written for a
torn tail and cut it off.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ._journal_compaction import Compactor, _Compacting
from ._journal_format import (
    FORMAT_VERSION,
    MAGIC,
    MAX_RECORD_SIZE,
    SNAPSHOT_MAGIC,
    JournalClosedError,
    JournalContents,
    JournalCorruptedError,
    JournalError,
    JournalRecord,
    JournalTornTailWarning,
    Snapshot,
    _frame,
    _make_dirs,
    _scan_segment,
    _segment_header,
    _segments_after,
    _sync,
    _write_all,
    covered_files,
    create_segment,
    encode_record,
    list_segments,
    list_snapshots,
    read_snapshot,
    remove_covered,
    segment_path,
    snapshot_path,
    write_snapshot,
)
from ._journal_fs import JournalPath, RemotePath, RemoteSegment, location
from ._journal_lineage import (
    Manifest,
    check_closed,
    file_crc,
    fresh_lineage,
    legacy_lineage,
    load_journal,
    read_journal,
    scan_journal,
    snapshot_crc,
    verify,
    write_manifest,
)

logger = logging.getLogger(__name__)


__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_RECORD_SIZE",
    "SNAPSHOT_MAGIC",
    "Compactor",
    "JournalClosedError",
    "JournalContents",
    "JournalCorruptedError",
    "JournalError",
    "JournalRecord",
    "JournalTornTailWarning",
    "JournalWriter",
    "JournalWriterMetrics",
    "Snapshot",
    "covered_files",
    "encode_record",
    "list_segments",
    "list_snapshots",
    "load_journal",
    "read_journal",
    "read_snapshot",
    "remove_covered",
    "scan_journal",
    "segment_path",
    "snapshot_path",
    "write_snapshot",
]

# --------------------------------------------------------------------------------------------
# Writing


@dataclass(slots=True)
class JournalWriterMetrics:
    """Counters of one :class:`JournalWriter` (its segment header is not counted).

    ``records_per_fsync`` is the group-commit factor: 1.0 means one fsync per record.
    """

    #: Records written and fsync'd.
    records_written: int = 0
    #: fsyncs (``fdatasync``) of the segment after writing records.
    fsyncs: int = 0
    #: Bytes of records (12-byte headers plus payloads) written.
    bytes_written: int = 0
    #: The most records written by one write + fsync.
    max_batch_records: int = 0
    #: Seconds spent in write + fsync, summed over batches.
    sync_seconds: float = 0.0
    #: Names of the threads that ran the fsyncs (the event loop thread must not be one).
    sync_thread_names: set[str] = field(default_factory=set)
    #: Segments this writer started after its first (rotations that make room for a snapshot).
    rotations: int = 0
    #: Snapshots written, and the size in bytes of the last one.
    snapshots_written: int = 0
    last_snapshot_bytes: int = 0
    #: Files deleted because a snapshot covers them.
    files_deleted: int = 0
    #: Seconds spent compacting (replaying, encoding, writing snapshots), summed.
    compaction_seconds: float = 0.0
    #: Compactions that failed (the journal then stays as it was, only larger).
    compaction_errors: int = 0

    @property
    def records_per_fsync(self) -> float:
        """Mean records per fsync (0.0 before the first fsync)."""
        return self.records_written / self.fsyncs if self.fsyncs else 0.0


class JournalWriter(_Compacting):
    """Appends records to a new segment of a journal directory, durably, with group commit.

    Use :meth:`open` (or the constructor, then :meth:`start`). Each start creates a new
    segment ``journal_<max + 1>``; see the module docstring for the format.

    Parameters
    ----------
    work_dir : str or os.PathLike
        The journal directory, created (with its parents) if missing.
    repair_tail : bool, default True
        Before creating the new segment, check the current last segment and truncate a torn
        tail off it (warning :class:`JournalTornTailWarning`). Without this, a torn tail would
        become corruption once the new segment exists. Raises :class:`JournalCorruptedError`
        if that segment is corrupted, so a broken journal fails at start.

    Examples
    --------
    >>> writer = JournalWriter.open(work_dir)            # doctest: +SKIP
    >>> await writer.append(b"update 1")                 # doctest: +SKIP
    >>> writer.metrics.records_per_fsync                 # doctest: +SKIP
    """

    def __init__(self, work_dir: str | os.PathLike[str] | RemotePath, *, repair_tail: bool = True,
                 compact: Compactor | None = None, snapshot_records: int | None = None,
                 snapshot_bytes: int | None = None, lineage: str | None = None,
                 counters: Callable[[], list[int]] | None = None) -> None:
        #: The journal directory: a local :class:`~pathlib.Path`, or a
        #: :class:`~._journal_fs.RemotePath` on a URL's filesystem (:mod:`._journal_fs`).
        self.work_dir: JournalPath = location(work_dir)
        #: The work_dir's identity: its manifest's, else ``lineage`` (else a fresh one) on
        #: the first start (set by :meth:`start`).
        self.lineage = lineage
        # The manifest (:mod:`._journal_lineage`), written under its lock by the I/O thread
        # (rotation), the compaction thread and close; ``counters()`` reports the ids in use.
        self._counters = counters
        self._manifest: Manifest | None = None
        self._manifest_lock = threading.Lock()
        self._size = 0  # of the current segment, and its running CRC-32 (I/O thread)
        self._crc = 0
        self._named_closed = False  # the manifest names the segment closed (aclose)
        #: This writer's segment file (``None`` until started).
        self.path: JournalPath | None = None
        #: This writer's segment number (``None`` until started).
        self.segment: int | None = None
        #: Counters; safe to read at any time.
        self.metrics = JournalWriterMetrics()
        self._repair_tail = repair_tail
        # The segment: a file descriptor, or a URL's chain of objects; -1 once closed.
        self._fd: int | RemoteSegment = -1
        self._io: ThreadPoolExecutor | None = None
        # Held while writing + syncing, so append_sync from another thread and the executor
        # never interleave bytes.
        self._file_lock = threading.Lock()
        self._started = False
        self._closed = False
        self._failure: BaseException | None = None
        # The queue of the flush task: record pieces (header, payload, header, ...) and one
        # future per record, both in call order. Touched only on the event loop thread.
        self._pending: list[bytes] = []
        self._waiters: list[asyncio.Future[None]] = []
        self._flush_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        # Snapshots (see "Snapshots" in the module docstring). The counters are of the current
        # segment and touched only by the I/O thread; the compaction runs on its own thread.
        self._compact = compact
        self._snapshot_records = snapshot_records
        self._snapshot_bytes = snapshot_bytes
        self._segment_records = 0
        self._segment_bytes = 0
        self._compactor: ThreadPoolExecutor | None = None
        self._compaction: concurrent.futures.Future[None] | None = None
        self._compaction_lock = threading.Lock()
        self._stop_compaction = threading.Event()

    # -- lifecycle --------------------------------------------------------------------------

    @classmethod
    def open(cls, work_dir: str | os.PathLike[str] | RemotePath, *, repair_tail: bool = True,
             **snapshots: Any) -> JournalWriter:
        """Create a writer and :meth:`start` it.

        Parameters
        ----------
        work_dir : str or os.PathLike
            The journal directory, created if missing.
        repair_tail : bool, default True
            See :class:`JournalWriter`.
        **snapshots
            ``compact``, ``snapshot_records``, ``snapshot_bytes``: see :class:`JournalWriter`.

        Returns
        -------
        JournalWriter
        """
        writer = cls(work_dir, repair_tail=repair_tail, **snapshots)
        writer.start()
        return writer

    def start(self) -> None:
        """Create the directory if needed and a new, durable, empty segment.

        This does blocking I/O (a few fsyncs, and reading the previous last segment when
        ``repair_tail``); from a coroutine, run it in a thread.

        Raises
        ------
        JournalError
            If the writer was already started.
        JournalCorruptedError
            If ``repair_tail`` and the current last segment is corrupted.
        FileExistsError
            If another writer created the same segment at the same time.
        """
        if self._started:
            raise JournalError(f"journal writer for {self.work_dir} was already started")
        self._started = True
        _make_dirs(self.work_dir)
        # Nothing is created or deleted before the work_dir holds what its manifest names.
        manifest = verify(self.work_dir)
        # Leftovers of a crash during a compaction: a partial snapshot, covered segments. The
        # covered ones are deleted only once the newest snapshot, which replaces them, has
        # been checked whole (read only then: a clean restart does not read it twice).
        snapshots = list_snapshots(self.work_dir)
        _, replaced = covered_files(self.work_dir)
        if replaced:
            read_snapshot(snapshots[-1][1])
        segments = _segments_after(self.work_dir, snapshots[-1] if snapshots else None)
        if segments:
            check_closed(manifest, *segments[-1])  # before a repair could cut it
        if segments and self._repair_tail:
            for _ in _scan_segment(segments[-1][1], is_last=True, repair=True, next_path=None):
                pass
        number = segments[-1][0] + 1 if segments else 0
        if manifest is None:
            manifest = Manifest(lineage=legacy_lineage(self.work_dir) or self.lineage
                                or fresh_lineage(), segment=number)
        if segments:
            manifest.closed[segments[-1][0]] = file_crc(segments[-1][1])
        if snapshots:
            base = snapshots[-1][0]
            manifest.snapshot = (base, snapshot_crc(snapshots[-1][1]))
            manifest.closed = {k: v for k, v in manifest.closed.items() if k >= base}
        self.lineage = manifest.lineage
        self._manifest = manifest
        self._fd, self.path = self._new_segment(number)
        self.segment = number
        self.metrics.files_deleted += len(remove_covered(self.work_dir))
        self._io = ThreadPoolExecutor(1, thread_name_prefix="dds-journal")
        if self._compact is not None:
            self._compactor = ThreadPoolExecutor(1, thread_name_prefix="dds-journal-compact")
            if snapshots:
                self.metrics.last_snapshot_bytes = snapshots[-1][1].stat().st_size
        if isinstance(self.work_dir, RemotePath):
            logger.info("journal %s: each group commit is written as one object", self.work_dir)

    def _write_manifest(self, change: Callable[[Manifest], None]) -> None:
        """Change the manifest and write it, atomically (any thread)."""
        with self._manifest_lock:
            manifest = self._manifest
            assert manifest is not None  # started
            change(manifest)
            if self._counters is not None:
                manifest.raise_high_water(list(self._counters()))
            write_manifest(self.work_dir, manifest)

    def _new_segment(self, number: int, closing: tuple[int, int, int] | None = None,
                     ) -> tuple[int | RemoteSegment, JournalPath]:
        """Create segment ``number`` with its header, durably (file and directory entry; on
        a URL, the header object)."""
        path = segment_path(self.work_dir, number)
        header = _segment_header()
        fd = create_segment(path, header)
        try:
            self._size, self._crc = len(header), zlib.crc32(header)

            def newest(m: Manifest) -> None:
                m.segment = number
                if closing is not None:  # the segment rotated away from: (number, size, crc)
                    m.closed[closing[0]] = closing[1:]

            self._write_manifest(newest)  # before any record goes into the segment
        except BaseException:
            if isinstance(fd, int):
                os.close(fd)
            raise
        return fd, path

    @property
    def closed(self) -> bool:
        """Whether the writer no longer accepts records (closed, closing or failed)."""
        return self._closed or self._failure is not None

    def close(self) -> None:
        """Close the segment file and shut down the I/O thread. Idempotent.

        Records whose ``append`` already returned are durable. Records queued but not yet
        being written fail with :class:`JournalClosedError`; a batch being written when
        ``close`` is called is finished first (this blocks for at most one write + fsync).
        Prefer :meth:`aclose` from a coroutine, which lets every queued record be written.

        Raises
        ------
        JournalError
            If called from a thread other than the event loop's while appends are queued.
        """
        self._check_loop_alive()
        if self._waiters and threading.get_ident() != self._loop_thread:
            raise JournalError(
                "JournalWriter.close() was called from another thread while appends are queued "
                "on the event loop; call `await writer.aclose()` on the loop instead"
            )
        self._closed = True
        self._fail_waiters(
            JournalClosedError(
                f"journal writer for {self.path} was closed before this record was written"
            )
        )
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None
        if self._compactor is not None:
            # A compaction under way gives up at its next record (its snapshot is not
            # written; the journal stays as it was).
            self._stop_compaction.set()
            self._compactor.shutdown(wait=True, cancel_futures=True)
            self._compactor = None
        with self._file_lock:
            if self._fd != -1:
                if isinstance(self._fd, int):
                    os.close(self._fd)
                self._fd = -1
                if self._failure is None and self.segment is not None and not self._named_closed:
                    self._close_manifest(self.segment)

    def _close_manifest(self, segment: int) -> None:
        """Name the closed segment's size and checksum: a later cut or older copy shows."""
        closed = (self._size, self._crc & 0xFFFF_FFFF)

        def close(m: Manifest) -> None:
            m.closed[segment] = closed

        try:
            self._write_manifest(close)
            self._named_closed = True
        except OSError as e:  # the journal is whole; only the check of this segment is lost
            logger.warning("journal %s: writing the manifest at close failed: %r",
                           self.work_dir, e)

    async def aclose(self) -> None:
        """Stop accepting records, wait until every queued record is durable, then :meth:`close`."""
        self._closed = True
        task = self._flush_task
        if task is not None:
            await asyncio.wait([task])
        compaction = self._compaction
        if compaction is not None and not compaction.done():
            self._stop_compaction.set()
            await asyncio.wait([asyncio.wrap_future(compaction)])
        if self._io is not None and self._failure is None and self.segment is not None:
            # the manifest's fsyncs on the I/O thread, not the loop (close() then skips them)
            await asyncio.get_running_loop().run_in_executor(
                self._io, self._close_manifest, self.segment)
        self.close()

    def __enter__(self) -> JournalWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> JournalWriter:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        state = (
            "failed"
            if self._failure is not None
            else "closed"
            if self._closed
            else "open"
            if self._started
            else "not started"
        )
        m = self.metrics
        return (
            f"<JournalWriter {self.path or self.work_dir} {state}: "
            f"{m.records_written} records, {m.fsyncs} fsyncs>"
        )

    # -- appending --------------------------------------------------------------------------

    def _busy(self) -> bool:
        task = self._flush_task
        return bool(self._waiters) or (task is not None and not task.done())

    def _check_loop_alive(self) -> None:
        # Records queued on an event loop that was closed before the flush task ran (e.g.
        # ``asyncio.run`` returned without awaiting them) may or may not have been written.
        if self._waiters and self._loop is not None and self._loop.is_closed():
            self._failure = JournalClosedError(
                f"the event loop closed while {len(self._waiters)} record(s) were queued; "
                "they may or may not have been written"
            )
            self._fail_waiters(self._failure)
            task, self._flush_task = self._flush_task, None
            if task is not None and not task.done():
                coro = task.get_coro()
                if coro is not None:
                    coro.close()  # it can never run; avoid "never awaited" at GC

    def _check_writable(self) -> None:
        self._check_loop_alive()
        if self._failure is not None:
            raise JournalClosedError(
                f"journal writer for {self.path} has failed and accepts no more records "
                f"({self._failure!r}); restart it"
            ) from self._failure
        if self._closed:
            raise JournalClosedError(f"journal writer for {self.path} is closed")
        if self._fd == -1:
            raise JournalError(f"journal writer for {self.work_dir} was not started; call start()")

    def append(self, payload: bytes | bytearray | memoryview) -> asyncio.Future[None]:
        """Queue a record and return a future that resolves once it is durable.

        Must be called on the event loop's thread. The record's place in the file is fixed
        now, by this call, not when the future is awaited. Cancelling the wait does not
        withdraw the record.

        Parameters
        ----------
        payload : bytes-like
            The record (copied if mutable), at most :data:`MAX_RECORD_SIZE` bytes.

        Returns
        -------
        asyncio.Future
            Resolves to ``None`` after the record is written and fsync'd; fails with the
            ``OSError`` if writing or syncing its batch failed, or :class:`JournalClosedError`
            if the writer was closed (or failed) before the record was written.

        Raises
        ------
        JournalClosedError
            If the writer is closed or has failed.
        TypeError, ValueError
            If ``payload`` is not bytes-like or is too large.
        RuntimeError
            If there is no running event loop, or the writer has queued records on another one.
        """
        self._check_writable()
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            if self._busy():
                raise RuntimeError("JournalWriter.append() called from a second event loop")
            self._loop = loop
            self._loop_thread = threading.get_ident()
        header, body = _frame(payload)
        future: asyncio.Future[None] = loop.create_future()
        self._pending.append(header)
        self._pending.append(body)
        self._waiters.append(future)
        if self._flush_task is None or self._flush_task.done():
            # Started on the next tick, so every append of this tick joins the first batch.
            self._flush_task = loop.create_task(self._flush(), name=f"journal-flush-{self.path}")
        return future

    def append_sync(self, payload: bytes | bytearray | memoryview) -> None:
        """Write one record and fsync it, on the calling thread (for tests and tools).

        Parameters
        ----------
        payload : bytes-like
            The record, at most :data:`MAX_RECORD_SIZE` bytes.

        Raises
        ------
        JournalClosedError
            If the writer is closed or has failed.
        JournalError
            If asynchronous appends are still in flight (writing now would reorder records).
        OSError
            If the write or fsync fails; the writer is then unusable.
        """
        self._check_writable()
        if self._busy():
            raise JournalError(
                "append_sync() while asynchronous appends are in flight would reorder records; "
                "await them first"
            )
        header, body = _frame(payload)
        try:
            self._write_batch([header, body], 1)
        except BaseException as exc:
            self._failure = exc
            raise

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._waiters and self._io is not None:
                pieces, waiters = self._pending, self._waiters
                self._pending, self._waiters = [], []
                try:
                    await loop.run_in_executor(self._io, self._write_batch, pieces, len(waiters))
                except (Exception, asyncio.CancelledError) as exc:
                    cancelled = isinstance(exc, asyncio.CancelledError)
                    error: BaseException = exc
                    if cancelled:
                        error = JournalClosedError(
                            f"journal writer for {self.path}: the flush task was cancelled "
                            "while writing; these records may or may not be durable"
                        )
                    # After a failed write or fsync the file's contents are unknown: stop here.
                    self._failure = error
                    for future in waiters:
                        if not future.done():
                            future.set_exception(error)
                    self._fail_waiters(
                        JournalClosedError(
                            f"journal writer for {self.path} failed before this record was "
                            f"written ({error!r})"
                        )
                    )
                    if cancelled:
                        raise
                    return  # reported through the futures
                # In record order, so that waiting tasks wake up in journal order.
                for future in waiters:
                    if not future.done():
                        future.set_result(None)
        finally:
            self._flush_task = None

    def _fail_waiters(self, exc: BaseException) -> None:
        waiters, self._waiters, self._pending = self._waiters, [], []
        for future in waiters:
            if not future.done():
                try:
                    future.set_exception(exc)
                except RuntimeError:  # its event loop is closed; nobody can be waiting
                    pass

    def _write_batch(self, pieces: list[bytes], count: int) -> None:
        """Write and fsync one batch (on the I/O thread, or the caller's for append_sync)."""
        data = pieces[0] + pieces[1] if len(pieces) == 2 else b"".join(pieces)
        with self._file_lock:
            fd = self._fd
            if fd == -1:
                raise JournalClosedError(f"journal writer for {self.path} is closed")
            start = time.perf_counter()
            if isinstance(fd, int):
                _write_all(fd, data)
                _sync(fd)
            else:  # a URL: the batch is the segment's next object
                fd.append(data)
            elapsed = time.perf_counter() - start
            m = self.metrics
            m.records_written += count
            m.fsyncs += 1
            m.bytes_written += len(data)
            m.sync_seconds += elapsed
            if count > m.max_batch_records:
                m.max_batch_records = count
            m.sync_thread_names.add(threading.current_thread().name)
            self._size += len(data)
            self._crc = zlib.crc32(data, self._crc)
            self._segment_records += count
            self._segment_bytes += len(data)
            if self._compactor is not None and self._segment_full():
                self._rotate()
