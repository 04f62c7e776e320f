"""The journal's on-disk format and its reader (see :mod:`.journal` for the specification).

Constants, errors, record framing, segment files and the scanning reader that checks every
CRC and cuts a torn tail; :mod:`._journal_lineage` adds the manifest's checks and the
readers (``load_journal``, ...), :mod:`.journal` the group-commit writer on top.
"""

from __future__ import annotations

import os
import re
import struct
import sys
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from ...errors import JournalClosedError, JournalCorruptedError, JournalError
from ._journal_fs import JournalPath, RemotePath, RemoteSegment, location, open_read

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_RECORD_SIZE",
    "JournalClosedError",
    "JournalCorruptedError",
    "JournalContents",
    "JournalError",
    "JournalRecord",
    "JournalTornTailWarning",
    "SNAPSHOT_MAGIC",
    "Snapshot",
    "covered_files",
    "encode_record",
    "list_segments",
    "list_snapshots",
    "read_snapshot",
    "remove_covered",
    "segment_path",
    "snapshot_path",
    "write_snapshot",
]

#: First 8 bytes of every segment.
MAGIC = b"DDSJRNL\x00"
#: Format version written in every segment and snapshot header: 2 since the journal keeps a
#: manifest (:mod:`._journal_lineage`); files of version 1 (no manifest) are read as well.
FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)
#: Largest payload a record can hold (the length field is a u32).
MAX_RECORD_SIZE = 0xFFFF_FFFF

_SEGMENT_HEADER = struct.Struct("<8sII")  # magic, version, header_crc
_RECORD_HEADER = struct.Struct("<III")  # length, length_crc, payload_crc
_LENGTH = struct.Struct("<I")
_SEGMENT_RE = re.compile(r"journal_(\d+)")
#: First 8 bytes of every snapshot file.
SNAPSHOT_MAGIC = b"DDSSNAP\x00"
_SNAPSHOT_HEADER = struct.Struct("<8sIQI")  # magic, version, base segment, header_crc
_SNAPSHOT_RE = re.compile(r"snapshot_(\d+)")
_SNAPSHOT_TMP_RE = re.compile(r"snapshot_(\d+)\.tmp")
_SEGMENT_DIGITS = 8
_MASK_DELTA = 0xA282_EAD8
_SECTOR = 512
_READ_BUFFER = 1 << 20


# --------------------------------------------------------------------------------------------
# Errors


class JournalTornTailWarning(UserWarning):
    """The last segment ended in a torn record, which was dropped (and, by default, cut off).

    Parameters
    ----------
    path : str or os.PathLike
        The segment file.
    offset : int
        Byte offset of the torn record: the journal now ends here.
    size : int
        Size of the file before the repair.
    reason : str
        How the record was torn.
    repaired : bool
        Whether the file was truncated to ``offset``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | RemotePath,
        offset: int,
        size: int,
        reason: str,
        repaired: bool,
    ) -> None:
        text = str(path)
        self.path: Path | str = text if "://" in text else Path(text)  # str: a URL
        self.offset = offset
        self.size = size
        self.reason = reason
        self.repaired = repaired
        action = "truncated the file to" if repaired else "ignoring everything from"
        super().__init__(
            f"journal {self.path} ends in a torn record at byte offset {offset} "
            f"(file size {size}): {reason}; {action} byte offset {offset} "
            f"({size - offset} bytes dropped)"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.path, self.offset, self.size, self.reason, self.repaired)


# --------------------------------------------------------------------------------------------
# Framing


def _masked_crc(data: bytes | memoryview) -> int:
    crc = zlib.crc32(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFF_FFFF) + _MASK_DELTA) & 0xFFFF_FFFF


def _as_bytes(payload: bytes | bytearray | memoryview) -> bytes:
    if type(payload) is bytes:
        return payload
    if isinstance(payload, str):
        raise TypeError("journal payloads are bytes; encode the str first")
    # Copy mutable buffers now, so that a later change by the caller cannot alter the record.
    return bytes(memoryview(payload))


def _frame(payload: bytes | bytearray | memoryview) -> tuple[bytes, bytes]:
    body = _as_bytes(payload)
    length = len(body)
    if length > MAX_RECORD_SIZE:
        raise ValueError(f"journal record of {length} bytes exceeds {MAX_RECORD_SIZE} bytes")
    header = _RECORD_HEADER.pack(length, _masked_crc(_LENGTH.pack(length)), _masked_crc(body))
    return header, body


def encode_record(payload: bytes | bytearray | memoryview) -> bytes:
    """Return the on-disk bytes of one record: the 12-byte header followed by ``payload``.

    Parameters
    ----------
    payload : bytes-like
        The record's contents, at most :data:`MAX_RECORD_SIZE` bytes.

    Returns
    -------
    bytes
        ``length | length_crc | payload_crc | payload`` (see the module docstring).
    """
    header, body = _frame(payload)
    return header + body


def _segment_header() -> bytes:
    head = _SEGMENT_HEADER.pack(MAGIC, FORMAT_VERSION, 0)[:12]
    return head + _LENGTH.pack(_masked_crc(head))


# --------------------------------------------------------------------------------------------
# File system helpers


def _sync(fd: int) -> None:
    """Make everything written to ``fd`` durable (data and the size needed to read it)."""
    if sys.platform == "darwin":  # pragma: no cover - fsync does not flush the drive on macOS
        import fcntl

        fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
    elif hasattr(os, "fdatasync"):
        os.fdatasync(fd)
    else:  # pragma: no cover
        os.fsync(fd)


def _sync_dir(path: Path) -> None:
    """fsync a directory so that entries created in it survive a crash (POSIX only)."""
    if os.name == "nt":  # pragma: no cover - directories cannot be opened on Windows
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_dirs(path: JournalPath) -> None:
    """Create ``path`` and missing parents (mode 0700), fsyncing each parent that gained an
    entry."""
    if isinstance(path, RemotePath):
        path.fs.makedirs(path.path, exist_ok=True)
        return
    missing = []
    p = path.absolute()
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)  # the journal holds pickled pipelines: its owner's only
        except FileExistsError:
            pass
        _sync_dir(d.parent)
    if not path.is_dir():
        raise NotADirectoryError(f"journal work_dir {path} is not a directory")


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def create_segment(path: JournalPath, header: bytes) -> int | RemoteSegment:
    """Create a segment holding ``header``, durably and exclusively (``O_EXCL``; fsync of
    the file and of its directory): its file descriptor, or a URL's chain of objects."""
    if isinstance(path, RemotePath):
        return RemoteSegment(path, header)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o600)
    try:
        _write_all(fd, header)
        _sync(fd)
        _sync_dir(path.parent)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _truncate(path: JournalPath, length: int) -> None:
    if isinstance(path, RemotePath):
        path.truncate(length)
        return
    fd = os.open(path, os.O_WRONLY | getattr(os, "O_BINARY", 0))
    try:
        os.ftruncate(fd, length)
        _sync(fd)
    finally:
        os.close(fd)


def segment_path(work_dir: str | os.PathLike[str] | RemotePath, number: int) -> JournalPath:
    """Return the path this module gives segment ``number`` (``journal_`` + 8+ digits).

    Parameters
    ----------
    work_dir : str or os.PathLike
        The journal directory.
    number : int
        The segment number.

    Returns
    -------
    pathlib.Path
    """
    return location(work_dir) / f"journal_{number:0{_SEGMENT_DIGITS}d}"


def _file_names(work_dir: str | os.PathLike[str] | RemotePath) -> list[str]:
    """The names of the files in ``work_dir`` (``[]``: missing)."""
    where = location(work_dir)
    if isinstance(where, RemotePath):
        return [name for name, _ in where.entries()]
    try:
        return [e.name for e in os.scandir(where) if e.is_file()]
    except FileNotFoundError:
        return []


def _numbered_files(work_dir: str | os.PathLike[str] | RemotePath, pattern: re.Pattern[str],
                    what: str) -> list[tuple[int, JournalPath]]:
    """``(number, path)`` of the files whose whole name matches ``pattern``, by number."""
    found: dict[int, JournalPath] = {}
    where = location(work_dir)
    for name in _file_names(where):
        m = pattern.fullmatch(name)
        if m is None:
            continue
        number = int(m.group(1))
        if number in found:
            raise JournalCorruptedError(
                where / name, 0,
                f"{what} {number} is used by both {found[number].name} and {name}")
        found[number] = where / name
    return sorted(found.items(), key=lambda item: item[0])


def list_segments(work_dir: str | os.PathLike[str] | RemotePath) -> list[tuple[int, JournalPath]]:
    """List the segments in ``work_dir`` as ``(number, path)`` pairs, in number order.

    Parameters
    ----------
    work_dir : str or os.PathLike
        The journal directory. A missing directory has no segments.

    Returns
    -------
    list of (int, pathlib.Path)

    Raises
    ------
    JournalCorruptedError
        If two files name the same segment number (``journal_7`` and ``journal_007``).
    """
    return _numbered_files(work_dir, _SEGMENT_RE, "segment number")


# --------------------------------------------------------------------------------------------
# Reading


class JournalRecord(NamedTuple):
    """One record read back from the journal, with where it was found."""

    #: The segment file.
    path: JournalPath
    #: Byte offset of the record's header in ``path``.
    offset: int
    #: The payload.
    payload: bytes


def _rest_is_zero(f: BinaryIO) -> bool:
    while chunk := f.read(_READ_BUFFER):
        if chunk.count(0) != len(chunk):
            return False
    return True


def _has_zero_sector(offset: int, data: bytes) -> bool:
    """Whether ``data`` (at file ``offset``) has a piece between sector boundaries that is all zero.

    A write torn by a crash leaves whole sectors unwritten, which read back as zeros
    (etcd's WAL decoder uses the same test, ``isTornEntry``).
    """
    view = memoryview(data)
    start = 0
    while start < len(view):
        end = min(len(view), (offset + start) // _SECTOR * _SECTOR + _SECTOR - offset)
        piece = view[start:end]
        if piece.tobytes().count(0) == len(piece):
            return True
        start = end
    return False


class _Torn(NamedTuple):
    offset: int
    size: int
    reason: str


def _scan_segment(
    path: JournalPath, *, is_last: bool, repair: bool, next_path: JournalPath | None
) -> Iterator[JournalRecord]:
    """Yield the records of one segment, handling damage as the module docstring describes."""
    torn: _Torn | None = None

    def damaged(offset: int, reason: str, tearable: bool) -> _Torn:
        if tearable and is_last:
            return _Torn(offset, size, reason)
        if tearable:
            reason += (
                "; a torn record is only allowed at the end of the last segment, "
                f"and {next_path} follows"
            )
        raise JournalCorruptedError(path, offset, reason)

    f, size = open_read(path, _READ_BUFFER)
    with f:
        if size == 0:
            return
        head = f.read(_SEGMENT_HEADER.size)
        if len(head) < _SEGMENT_HEADER.size:
            torn = damaged(0, f"truncated segment header ({len(head)} of 16 bytes)", True)
        else:
            magic, version, header_crc = _SEGMENT_HEADER.unpack(head)
            if magic != MAGIC or header_crc != _masked_crc(head[:12]):
                what = (
                    f"bad magic {magic!r} (expected {MAGIC!r})"
                    if magic != MAGIC
                    else "segment header checksum mismatch"
                )
                zero = head.count(0) == len(head) and _rest_is_zero(f)
                if zero:
                    what = "segment header and everything after it are zero bytes"
                torn = damaged(0, what, zero)
            elif version not in _READABLE_VERSIONS:
                raise JournalCorruptedError(
                    path,
                    8,
                    f"unsupported journal format version {version} (this reads versions "
                    f"{_READABLE_VERSIONS[0]} to {_READABLE_VERSIONS[-1]})",
                )
        offset = _SEGMENT_HEADER.size
        while torn is None and offset < size:
            remaining = size - offset
            header = f.read(_RECORD_HEADER.size)
            if len(header) < _RECORD_HEADER.size:
                torn = damaged(offset, f"truncated record header ({len(header)} of 12 bytes)", True)
                break
            length, length_crc, payload_crc = _RECORD_HEADER.unpack(header)
            if length_crc != _masked_crc(header[:4]):
                zero = header.count(0) == len(header) and _rest_is_zero(f)
                what = (
                    "record header and everything after it are zero bytes"
                    if zero
                    else f"record header checksum mismatch (garbage length {length})"
                )
                torn = damaged(offset, what, zero)
                break
            end = offset + _RECORD_HEADER.size + length
            if end > size:
                torn = damaged(
                    offset,
                    f"truncated record: {length}-byte payload needs {end - offset} bytes, "
                    f"{remaining} left in the file",
                    True,
                )
                break
            payload = f.read(length)
            if len(payload) < length:  # the file shrank while we read it
                torn = damaged(
                    offset, f"truncated payload ({len(payload)} of {length} bytes)", True
                )
                break
            actual = _masked_crc(payload)
            if actual != payload_crc:
                final = end == size
                tearable = final and _has_zero_sector(offset, header + payload)
                what = (
                    f"payload checksum mismatch in the {length}-byte payload at bytes "
                    f"{offset + _RECORD_HEADER.size}..{end - 1} "
                    f"(stored 0x{payload_crc:08x}, computed 0x{actual:08x})"
                )
                if tearable:
                    what += ", with an all-zero sector (unwritten when the process crashed)"
                torn = damaged(offset, what, tearable)
                break
            yield JournalRecord(path, offset, payload)
            offset = end

    if torn is not None:
        if repair:
            _truncate(path, torn.offset)
        warnings.warn(
            JournalTornTailWarning(path, torn.offset, torn.size, torn.reason, repair),
            stacklevel=4,
        )


def _segments_after(work_dir: str | os.PathLike[str] | RemotePath,
                    snapshot: tuple[int, JournalPath] | None) -> list[tuple[int, JournalPath]]:
    """The segments a replay reads after ``snapshot`` (``(base, path)``): numbers ``base``,
    ``base + 1``, ... without a gap (segments before ``base`` are covered by it)."""
    segments = list_segments(work_dir)
    if snapshot is not None:
        base, snapshot_file = snapshot
        segments = [(n, p) for n, p in segments if n >= base]
        if not segments or segments[0][0] != base:
            raise JournalCorruptedError(
                snapshot_file, 0,
                f"the snapshot covers segments before {base}, but segment {base} "
                + ("is missing" if not segments else
                   f"is missing (the next one is {segments[0][1].name})"),
            )
    for (prev, _), (number, path) in zip(segments, segments[1:], strict=False):
        if number != prev + 1:
            raise JournalCorruptedError(
                path,
                0,
                f"segment {number} follows segment {prev}: segment(s) "
                f"{prev + 1}..{number - 1} are missing",
            )
    return segments


def _scan_segments(work_dir: str | os.PathLike[str] | RemotePath,
                   snapshot: tuple[int, JournalPath] | None,
                   repair: bool, check: Callable[[int, JournalPath], None] | None = None,
                   ) -> Iterator[JournalRecord]:
    """The records of the segments after ``snapshot``; ``check(number, path)`` (the
    manifest's size and CRC of a closed segment) runs before the last segment is read (a
    cleanly closed one has no torn tail to cut) and after each other one (damage in its
    records is reported at its offset first)."""
    segments = _segments_after(work_dir, snapshot)
    for i, (number, path) in enumerate(segments):
        is_last = i == len(segments) - 1
        next_path = None if is_last else segments[i + 1][1]
        if is_last and check is not None:
            check(number, path)
        yield from _scan_segment(path, is_last=is_last, repair=repair, next_path=next_path)
        if not is_last and check is not None:
            check(number, path)


# --------------------------------------------------------------------------------------------
# Snapshots


class Snapshot(NamedTuple):
    """A snapshot read back from the journal directory."""

    #: The snapshot file.
    path: JournalPath
    #: The first segment it does not cover: it stands for every record of segments ``< base``.
    base: int
    #: Its payload (opaque to the journal).
    payload: bytes


class JournalContents(NamedTuple):
    """What :func:`load_journal` found: the newest snapshot and the records after it."""

    #: The newest snapshot, or None.
    snapshot: Snapshot | None
    #: The records of the segments it does not cover, in journal order (lazily read).
    records: Iterator[JournalRecord]
    #: The manifest's id high-water mark (``()`` without a manifest): replay's next ids
    #: start at least there.
    high_water: tuple[int, ...] = ()


def snapshot_path(work_dir: str | os.PathLike[str] | RemotePath, base: int) -> JournalPath:
    """The path of the snapshot covering the segments before ``base`` (8+ digits).

    Parameters
    ----------
    work_dir : str or os.PathLike
    base : int

    Returns
    -------
    pathlib.Path
    """
    return location(work_dir) / f"snapshot_{base:0{_SEGMENT_DIGITS}d}"


def list_snapshots(work_dir: str | os.PathLike[str] | RemotePath
                   ) -> list[tuple[int, JournalPath]]:
    """The complete snapshots in ``work_dir`` as ``(base, path)``, oldest first.

    Temporary files (``snapshot_<n>.tmp``, left by a crash while one was written) are not
    snapshots and are not listed.

    Raises
    ------
    JournalCorruptedError
        If two files name the same base.
    """
    return _numbered_files(work_dir, _SNAPSHOT_RE, "snapshot base")


def _snapshot_bytes(base: int, payload: bytes) -> bytes:
    head = _SNAPSHOT_HEADER.pack(SNAPSHOT_MAGIC, FORMAT_VERSION, base, 0)[:20]
    return head + _LENGTH.pack(_masked_crc(head)) + encode_record(payload)


def read_snapshot(path: str | os.PathLike[str] | RemotePath) -> Snapshot:
    """Read and check one snapshot file.

    A snapshot is renamed into place only after it was written and fsync'd, so any damage
    is corruption, never a torn write.

    Raises
    ------
    JournalCorruptedError
        Bad magic, version or checksum, a base that disagrees with the file name, a length
        that does not match the file.
    """
    path = location(path)
    data = path.read_bytes()
    hsize = _SNAPSHOT_HEADER.size
    if len(data) < hsize + _RECORD_HEADER.size:
        raise JournalCorruptedError(path, 0, f"snapshot file of {len(data)} bytes is too short")
    magic, version, base, header_crc = _SNAPSHOT_HEADER.unpack_from(data)
    if magic != SNAPSHOT_MAGIC:
        raise JournalCorruptedError(path, 0, f"bad magic {magic!r} (expected {SNAPSHOT_MAGIC!r})")
    if header_crc != _masked_crc(data[:20]):
        raise JournalCorruptedError(path, 0, "snapshot header checksum mismatch")
    if version not in _READABLE_VERSIONS:
        raise JournalCorruptedError(
            path, 8, f"unsupported snapshot format version {version} (this reads versions "
            f"{_READABLE_VERSIONS[0]} to {_READABLE_VERSIONS[-1]})")
    m = _SNAPSHOT_RE.fullmatch(path.name)
    if m is not None and int(m.group(1)) != base:
        raise JournalCorruptedError(path, 12, f"snapshot base {base} disagrees with its name")
    length, length_crc, payload_crc = _RECORD_HEADER.unpack_from(data, hsize)
    if length_crc != _masked_crc(data[hsize:hsize + 4]):
        raise JournalCorruptedError(path, hsize, "snapshot length checksum mismatch")
    start = hsize + _RECORD_HEADER.size
    if start + length != len(data):
        raise JournalCorruptedError(
            path, hsize, f"snapshot payload of {length} bytes, but the file holds "
            f"{len(data) - start} bytes after the headers")
    payload = data[start:]
    if _masked_crc(payload) != payload_crc:
        raise JournalCorruptedError(path, start, "snapshot payload checksum mismatch")
    return Snapshot(path, base, payload)


def write_snapshot(work_dir: str | os.PathLike[str] | RemotePath, base: int,
                   payload: bytes) -> JournalPath:
    """Write a snapshot covering the segments before ``base``, atomically.

    Written to ``snapshot_<base>.tmp``, fsync'd, renamed to ``snapshot_<base>``, and the
    directory fsync'd: after a crash the snapshot is either complete or absent (a leftover
    ``.tmp`` is ignored by readers and removed by the next writer start). Nothing is deleted
    here; see :func:`remove_covered`.

    Returns
    -------
    pathlib.Path
        The snapshot file.
    """
    where = location(work_dir)
    final = snapshot_path(where, base)
    if isinstance(final, RemotePath):  # written whole to .tmp, then moved
        final.write_atomic(_snapshot_bytes(base, payload))
        return final
    assert isinstance(where, Path)
    tmp = final.with_name(final.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0), 0o600)
    try:
        _write_all(fd, _snapshot_bytes(base, payload))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    _sync_dir(where)
    return final


def covered_files(work_dir: str | os.PathLike[str] | RemotePath
                  ) -> tuple[list[JournalPath], list[JournalPath]]:
    """What the newest snapshot makes unnecessary, without deleting it.

    Returns
    -------
    (list of pathlib.Path, list of pathlib.Path)
        Temporary snapshot files (never needed), and the segments before the newest
        snapshot's base plus older snapshots (needed only if the newest one is damaged).
    """
    where = location(work_dir)
    temporary = [where / name for name in _file_names(where) if _SNAPSHOT_TMP_RE.fullmatch(name)]
    snapshots = list_snapshots(where)
    replaced: list[JournalPath] = []
    if snapshots:
        base = snapshots[-1][0]
        replaced += [path for number, path in list_segments(where) if number < base]
        replaced += [path for _, path in snapshots[:-1]]
    return temporary, replaced


def remove_covered(work_dir: str | os.PathLike[str] | RemotePath) -> list[JournalPath]:
    """Delete what the newest snapshot makes unnecessary (:func:`covered_files`): the
    segments before its base, older snapshots, and temporary snapshot files; then fsync the
    directory.

    Safe to interrupt at any point (a crash leaves the newest snapshot and every segment
    from its base on, plus some of the files this would delete, which replay ignores).

    Returns
    -------
    list of pathlib.Path
        The files deleted.
    """
    temporary, replaced = covered_files(work_dir)
    doomed = temporary + replaced
    for path in doomed:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
    where = location(work_dir)
    if doomed and isinstance(where, Path):
        _sync_dir(where)
    return doomed
