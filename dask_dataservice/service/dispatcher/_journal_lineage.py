"""The journal's manifest: which files a work_dir must hold, so that none goes missing unseen.

Segments and snapshots check themselves (CRCs), but a file that is *missing*, or replaced by
an older copy of itself, leaves a journal that reads back as a valid, shorter one: with the
snapshot deleted (or renamed to a ``.tmp`` name, which a start deletes) the dispatcher used to
start empty and hand out ids again from 1000. The manifest closes that gap (issue 22 s3).

``manifest`` (one per work_dir, written atomically: ``manifest.tmp``, fsync, rename, fsync of
the directory) names:

- ``lineage``: the work_dir's identity, fixed at its first start (the dispatcher's lineage;
  a journal of the first format kept it in a file ``lineage``, read once when upgrading);
- ``segment``: the newest segment created;
- ``snapshot``: ``[base, payload_crc]`` of the snapshot the segments follow (``null``: none,
  the history starts at segment 0);
- ``closed``: ``{segment: [size, crc32]}`` of every segment from that snapshot's base on that
  no writer appends to any more (the current one too once its writer closed cleanly);
- ``high_water``: the highest next-id of each of the dispatcher's id namespaces any writer
  of this work_dir reported (at each segment it starts, and when it closes); replay starts its
  ids at least there, so ids are never handed out twice even across snapshot folds.

File format (integers little-endian): ``b"DDSMANI\\x00"``, u32 version (1), then one journal
record (length, length CRC, payload CRC, payload) whose payload is the manifest as JSON.

When it is written (by :class:`~.journal.JournalWriter`): after a new segment is durable and
before any record is appended to it (start and rotation), after a snapshot is renamed into
place and before anything it covers is deleted, and when the writer closes. So every crash
point leaves a manifest that is either current or one step behind in a way :func:`verify`
accepts: a newest segment one past the manifest's holding no records; a snapshot newer than
the named one (the named one still present).

A work_dir with segments of format 2 (written by a writer that keeps a manifest) and no
manifest is refused; one with only format-1 segments (an older package) is read as before,
with one check added: without a snapshot, the segments must start at 0.
"""

from __future__ import annotations

import json
import os
import secrets
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from ._journal_format import (
    _RECORD_HEADER,
    _SEGMENT_HEADER,
    JournalContents,
    JournalCorruptedError,
    JournalRecord,
    _masked_crc,
    _scan_segments,
    _sync,
    _sync_dir,
    _write_all,
    encode_record,
    list_segments,
    list_snapshots,
    read_snapshot,
    segment_path,
    snapshot_path,
)
from ._journal_fs import JournalPath, RemotePath, location, open_read

__all__ = ["MANIFEST", "Manifest", "check_closed", "file_crc", "load_journal", "read_journal",
           "read_manifest", "scan_journal", "verify", "write_manifest"]

#: The manifest's file name in a work_dir.
MANIFEST = "manifest"
#: Where a journal of the first format kept its lineage.
LEGACY_LINEAGE = "lineage"
_MAGIC = b"DDSMANI\x00"
_VERSION = 1
_HEAD = struct.Struct("<8sI")
_CHUNK = 1 << 20


@dataclass(slots=True)
class Manifest:
    """What a work_dir must hold (module docstring)."""

    lineage: str
    segment: int
    snapshot: tuple[int, int] | None = None
    closed: dict[int, tuple[int, int]] = field(default_factory=dict)
    high_water: list[int] = field(default_factory=list)

    def raise_high_water(self, ids: list[int]) -> None:
        """Keep, for each namespace, the larger of the recorded and the reported next id."""
        hw = self.high_water
        self.high_water = [max(a, b) for a, b in zip(hw, ids, strict=False)] + (
            hw[len(ids):] if len(hw) > len(ids) else list(ids[len(hw):]))


WorkDir = str | os.PathLike[str] | RemotePath


def manifest_path(work_dir: WorkDir) -> JournalPath:
    return location(work_dir) / MANIFEST


def file_crc(path: JournalPath) -> tuple[int, int]:
    """``(size, crc32)`` of a whole file."""
    crc = size = 0
    f, _ = open_read(path, 0)
    with f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


def snapshot_crc(path: JournalPath) -> int:
    """A snapshot's identity: the payload CRC stored in its header (no need to read it all)."""
    if isinstance(path, RemotePath):
        head = path.read_bytes()[:36]
    else:
        with open(path, "rb") as f:
            head = f.read(36)
    if len(head) < 36:
        raise JournalCorruptedError(path, 0, f"snapshot file of {len(head)} bytes is too short")
    return int.from_bytes(head[32:36], "little")


def write_manifest(work_dir: JournalPath, manifest: Manifest) -> None:
    """Write the manifest atomically (blocking I/O)."""
    body = json.dumps({
        "lineage": manifest.lineage, "segment": manifest.segment,
        "snapshot": list(manifest.snapshot) if manifest.snapshot is not None else None,
        "closed": {str(k): list(v) for k, v in sorted(manifest.closed.items())},
        "high_water": manifest.high_water,
    }, separators=(",", ":")).encode()
    path = manifest_path(work_dir)
    if isinstance(path, RemotePath):  # written whole to .tmp, then moved
        path.write_atomic(_HEAD.pack(_MAGIC, _VERSION) + encode_record(body))
        return
    assert isinstance(work_dir, Path)
    tmp = path.with_name(MANIFEST + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0), 0o600)
    try:
        _write_all(fd, _HEAD.pack(_MAGIC, _VERSION) + encode_record(body))
        _sync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _sync_dir(work_dir)


def read_manifest(work_dir: WorkDir) -> Manifest | None:
    """The manifest of ``work_dir`` (None if it has none), checked whole."""
    path = manifest_path(work_dir)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    start = _HEAD.size + _RECORD_HEADER.size
    if len(data) < start:
        raise JournalCorruptedError(path, 0, f"manifest of {len(data)} bytes is too short")
    magic, version = _HEAD.unpack_from(data)
    if magic != _MAGIC:
        raise JournalCorruptedError(path, 0, f"bad magic {magic!r} (expected {_MAGIC!r})")
    if version != _VERSION:
        raise JournalCorruptedError(
            path, 8, f"unsupported manifest version {version} (this is {_VERSION})")
    length, length_crc, payload_crc = _RECORD_HEADER.unpack_from(data, _HEAD.size)
    if length_crc != _masked_crc(data[_HEAD.size:_HEAD.size + 4]) or start + length != len(data):
        raise JournalCorruptedError(
            path, _HEAD.size, f"manifest length {length} does not match the file "
            f"({len(data) - start} bytes after the headers), or its checksum does not")
    if _masked_crc(data[start:]) != payload_crc:
        raise JournalCorruptedError(path, start, "manifest checksum mismatch")
    try:
        raw = json.loads(data[start:])
        return Manifest(
            lineage=str(raw["lineage"]), segment=int(raw["segment"]),
            snapshot=tuple(raw["snapshot"]) if raw["snapshot"] is not None else None,
            closed={int(k): (int(v[0]), int(v[1])) for k, v in raw["closed"].items()},
            high_water=[int(x) for x in raw["high_water"]])
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise JournalCorruptedError(path, start, f"malformed manifest: {e!r}") from e


def _segment_version(path: JournalPath) -> int:
    f, _ = open_read(path)
    with f:
        head = f.read(_SEGMENT_HEADER.size)
    return int.from_bytes(head[8:12], "little") if len(head) >= 12 else 0


def legacy_lineage(work_dir: JournalPath) -> str | None:
    try:
        return (work_dir / LEGACY_LINEAGE).read_text().strip() or None
    except FileNotFoundError:
        return None


def fresh_lineage() -> str:
    return secrets.token_urlsafe(24)


def verify(work_dir: WorkDir) -> Manifest | None:
    """Check that ``work_dir`` holds the files its manifest names, as they were.

    Returns the manifest (None for an empty work_dir or a journal of the first format).

    The sizes and checksums of closed segments are checked as they are read
    (:func:`check_closed`): a damaged record is reported at its offset first.

    Raises
    ------
    JournalCorruptedError
        Naming the missing or replaced file (module docstring): a missing manifest where
        segments need one, a missing snapshot or segment, a manifest older than the segments.
    """
    work_dir = location(work_dir)
    segments = dict(list_segments(work_dir))
    snapshots = dict(list_snapshots(work_dir))
    manifest = read_manifest(work_dir)
    if manifest is None:
        newer = [p for p in segments.values() if _segment_version(p) >= 2]
        if newer:
            raise JournalCorruptedError(
                manifest_path(work_dir), 0,
                f"the manifest is missing, but {newer[0].name} was written by a journal that "
                "keeps one (deleted or renamed?)")
        if not snapshots and segments and min(segments) != 0:
            raise JournalCorruptedError(
                snapshot_path(work_dir, min(segments)), 0,
                f"the snapshot is missing: the first segment is journal_{min(segments)}, "
                "so the records before it exist only in a snapshot, and there is none")
        if not segments and (work_dir / LEGACY_LINEAGE).exists():
            raise JournalCorruptedError(
                segment_path(work_dir, 0), 0,
                "the work_dir has a lineage file but no journal segment: its segments are gone")
        return None
    newest = manifest.segment
    if newest not in segments:
        raise JournalCorruptedError(
            segment_path(work_dir, newest), 0,
            "the file is missing: the manifest names it as the newest segment")
    for number in (n for n in segments if n > newest):
        # a crash between creating a segment and writing the manifest leaves one, empty
        if number != newest + 1 or segments[number].stat().st_size > _SEGMENT_HEADER.size:
            raise JournalCorruptedError(
                manifest_path(work_dir), 0,
                f"the manifest is older than the journal: it names journal_{newest} as the "
                f"newest segment, but {segments[number].name} exists and holds records")
    base = 0
    if manifest.snapshot is not None:
        base, crc = manifest.snapshot
        path = snapshot_path(work_dir, base)
        if base not in snapshots:
            raise JournalCorruptedError(
                path, 0, "the file is missing: the manifest names it as the snapshot the "
                f"segments from journal_{base} on follow")
        found = snapshot_crc(snapshots[base])
        if found != crc:
            raise JournalCorruptedError(
                snapshots[base], 32, f"not the snapshot the manifest names: its payload checksum "
                f"is 0x{found:08x}, the manifest's 0x{crc:08x} (replaced by another copy?)")
    for number in range(base, newest + 1):
        if number not in segments:
            raise JournalCorruptedError(
                segment_path(work_dir, number), 0,
                f"the file is missing: the manifest names segments {base}..{newest}")
    return manifest


def check_closed(manifest: Manifest | None, number: int, path: JournalPath) -> None:
    """Check a segment against the size and checksum its writer closed it with (if any)."""
    if manifest is None or number not in manifest.closed:
        return
    size, crc = manifest.closed[number]
    found_size, found_crc = file_crc(path)
    if found_size != size:
        raise JournalCorruptedError(
            path, min(size, found_size),
            f"the segment is {found_size} bytes, but it held {size} bytes when its writer "
            "closed it (truncated, or replaced by an older copy)")
    if found_crc != crc:
        raise JournalCorruptedError(
            path, 0, f"the segment's checksum is 0x{found_crc:08x}, but it was 0x{crc:08x} "
            "when its writer closed it (replaced by another copy)")


# ------------------------------------------------------------------------------------------
# Reading, checked against the manifest


def scan_journal(
    work_dir: WorkDir, *, repair: bool = True
) -> Iterator[JournalRecord]:
    """Yield every record after the newest snapshot, in order, with its file and offset.

    Without a snapshot that is every record of every segment. :func:`load_journal` gives
    the snapshot as well; replaying records without it is only right for a journal that
    has none.

    Parameters
    ----------
    work_dir : str or os.PathLike
        The journal directory. A missing or empty directory is an empty journal.
    repair : bool, default True
        Truncate a torn tail off the last segment (and fsync it). With ``False`` the torn
        record is skipped and warned about but the file is left as it is (for read-only tools).

    Yields
    ------
    JournalRecord
        ``(path, offset, payload)``.

    Raises
    ------
    JournalCorruptedError
        On damage a crash cannot explain (see the module docstring). Records before the
        damage have already been yielded.

    Warns
    -----
    JournalTornTailWarning
        When the last segment ends in a torn record; the file name and offset are in the message.

    Notes
    -----
    The directory is listed when iteration starts. The repair happens when the iteration
    reaches the torn record; stopping early leaves the file as it is.
    """
    work_dir = location(work_dir)
    manifest = verify(work_dir)
    snapshots = list_snapshots(work_dir)
    return _scan_segments(work_dir, snapshots[-1] if snapshots else None, repair,
                          partial(check_closed, manifest))


def read_journal(work_dir: WorkDir, *, repair: bool = True) -> Iterator[bytes]:
    """Yield the payload of every record after the newest snapshot (of every record, in a
    journal without one), in the order they were appended.

    Parameters
    ----------
    work_dir : str or os.PathLike
        The journal directory. A missing or empty directory is an empty journal.
    repair : bool, default True
        Truncate a torn tail off the last segment; see :func:`scan_journal`.

    Yields
    ------
    bytes

    Raises
    ------
    JournalCorruptedError
        On damage a crash cannot explain; the message names the file and byte offset.

    Warns
    -----
    JournalTornTailWarning
        When the last segment ends in a torn record.
    """
    for record in scan_journal(work_dir, repair=repair):
        yield record.payload


def load_journal(work_dir: WorkDir, *, repair: bool = True) -> JournalContents:
    """The journal as a replay needs it: the newest snapshot and the records after it.

    Replaying ``records`` on top of the state ``snapshot.payload`` stands for gives the
    journal's state. Segments and snapshots older than the newest snapshot (left by a crash
    during a compaction) are ignored.

    Parameters
    ----------
    work_dir : str or os.PathLike
        The journal directory.
    repair : bool, default True
        See :func:`scan_journal`.

    Returns
    -------
    JournalContents
        ``(snapshot or None, records)``; ``records`` is read lazily.

    Raises
    ------
    JournalCorruptedError
        A damaged snapshot, a file missing, truncated or replaced by an older copy (see
        :mod:`._journal_lineage`); while iterating ``records``, damaged records.
    """
    work_dir = location(work_dir)
    manifest = verify(work_dir)  # no file missing, truncated or replaced unseen
    snapshots = list_snapshots(work_dir)
    snapshot = read_snapshot(snapshots[-1][1]) if snapshots else None
    return JournalContents(
        snapshot, _scan_segments(work_dir, snapshots[-1] if snapshots else None, repair,
                                 partial(check_closed, manifest)),
        tuple(manifest.high_water) if manifest is not None else ())
