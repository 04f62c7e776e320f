"""Where a journal lives: a local directory, or a directory of objects on an fsspec filesystem.

A ``work_dir`` is either a local path (a plain path, or a ``file://`` / ``local://`` URL), which
keeps the journal's local layout exactly (``O_EXCL`` create, ``write`` + ``fdatasync``,
``rename`` of snapshots and the manifest, ``fsync`` of the directory), or a URL of another
fsspec filesystem (``s3://bucket/dds``, ``gs://...``, ``az://...``, ``memory://...``).

Object stores have no append, no fsync and no atomic rename, but they do write an object
whole or not at all. So on a URL a segment is a *chain of immutable objects*: the object
``journal_<n>`` holds the segment header, and each group commit writes the batch as a new
object ``journal_<n>.<k>`` (``k = 1, 2, ...``, 8+ digits), PUT once and never changed. A group
commit is durable when its PUT returned. The segment's bytes are the concatenation of the
chain, so everything above this module (record framing, CRCs, manifest, snapshots, torn-tail
rules) reads a URL journal exactly as a local one. Only the last object of a chain can be
incomplete (objects are written one after another), and only on a filesystem whose writes
are not atomic, where it reads as a torn tail; a gap in a chain (a part deleted) is
:class:`~dask_dataservice.errors.JournalCorruptedError`. Snapshots and the manifest are
written whole as one object (an object store's PUT, like ``memory://``'s, replaces an object
at once: a reader sees the old one or the new one), so a crash leaves them complete or absent,
as locally.

A URL the journal cannot keep durably is refused when the writer or reader is made, with a
:class:`ValueError` saying why and what to use: an unknown protocol, a filesystem whose package
is not installed (naming it, instead of creating a local directory called ``gs:``), and the
read-only filesystems (HTTP, archives, git repositories).

``memory://`` lives as long as the process: it is for tests and demos, not for surviving a
crash of the scheduler's process.
"""

from __future__ import annotations

import io
import os
import posixpath
import re
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from ...errors import JournalCorruptedError

__all__ = ["JournalPath", "RemotePath", "RemoteSegment", "is_url", "location", "open_read",
           "parts_of"]

_PART_DIGITS = 8
_LOCAL_PROTOCOLS = ("file", "local")
#: fsspec filesystems that cannot hold a journal: nothing can be written to them.
_READ_ONLY = frozenset({"http", "https", "zip", "tar", "github", "git", "libarchive",
                        "reference", "data", "jlab", "cached", "simplecache", "filecache",
                        "blockcache"})
_PROTOCOL_RE = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*")


def is_url(work_dir: object) -> bool:
    """Whether ``work_dir`` is a URL (``protocol://...``) rather than a local path."""
    return isinstance(work_dir, str) and "://" in work_dir


class _Stat(NamedTuple):
    st_size: int


class RemotePath:
    """A file of a URL journal: ``fs`` and the path on it (fsspec's, without protocol).

    The few :class:`pathlib.Path` methods the journal uses, on the fsspec filesystem; its
    ``str`` is the URL, as error messages show it.
    """

    __slots__ = ("fs", "path")

    def __init__(self, fs: Any, path: str) -> None:
        self.fs = fs
        self.path = path.rstrip("/") or "/"

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.fs, posixpath.dirname(self.path))

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(self.fs, posixpath.join(self.path, name))

    def with_name(self, name: str) -> RemotePath:
        return self.parent / name

    def __str__(self) -> str:
        return str(self.fs.unstrip_protocol(self.path))

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, RemotePath) and other.fs is self.fs
                and other.path == self.path)

    def __hash__(self) -> int:
        return hash(self.path)

    # -- the Path methods the journal uses ----------------------------------------------------

    def entries(self) -> list[tuple[str, int]]:
        """``(name, size)`` of the files (objects) in this directory (``[]``: missing)."""
        self.fs.invalidate_cache(self.path)
        try:
            listed = self.fs.ls(self.path, detail=True)
        except FileNotFoundError:
            return []
        return [(posixpath.basename(e["name"].rstrip("/")), int(e.get("size") or 0))
                for e in listed if e.get("type") == "file"]

    def exists(self) -> bool:
        return any(name == self.name for name, _ in self.parent.entries())

    def stat(self) -> _Stat:
        parts = parts_of(self)
        if not parts:
            raise FileNotFoundError(str(self))
        return _Stat(sum(size for _, size in parts))

    def read_bytes(self) -> bytes:
        parts = parts_of(self)
        if not parts:
            raise FileNotFoundError(str(self))
        if len(parts) == 1:
            return bytes(self.fs.cat_file(self.path))
        # every part at once (an async filesystem such as s3fs fetches them concurrently)
        data = self.fs.cat([p.path for p, _ in parts], on_error="raise")
        return b"".join(bytes(data[p.path]) for p, _ in parts)

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def unlink(self) -> None:
        """Delete the object and its chain (the newest part first: a crash leaves a prefix)."""
        parts = parts_of(self)
        if not parts:
            raise FileNotFoundError(str(self))
        for p, _ in reversed(parts):
            self.fs.rm_file(p.path)

    def write_atomic(self, data: bytes) -> None:
        """Write the whole file as one object: an object's PUT is atomic.

        Not ``<name>.tmp`` then ``mv``: on an object store the move is a copy and a delete
        (no more atomic than the PUT), and s3fs looks the ``.tmp`` object up in its listing
        cache, which a listing by another journal thread taken before the PUT can have left
        without it: ``FileNotFoundError`` (a snapshot failed so once, under load).
        """
        self.fs.pipe_file(self.path, data)
        self.fs.invalidate_cache(self.path)

    def truncate(self, length: int) -> None:
        """Cut the chain to ``length`` bytes: later parts deleted (newest first), the part
        holding the cut rewritten whole."""
        parts = parts_of(self)
        start = 0
        keep = 0
        for i, (_, size) in enumerate(parts):
            if start + size >= length:
                keep = i
                break
            start += size
        for p, _ in reversed(parts[keep + 1:]):
            self.fs.rm_file(p.path)
        p, size = parts[keep]
        if start + size != length:
            self.fs.pipe_file(p.path, bytes(self.fs.cat_file(p.path))[:length - start])


JournalPath = Path | RemotePath


def location(work_dir: str | os.PathLike[str] | RemotePath) -> JournalPath:
    """The journal directory ``work_dir`` names: a local :class:`~pathlib.Path`, or a
    :class:`RemotePath` on the fsspec filesystem of its URL.

    Raises
    ------
    ValueError
        If the URL's protocol is unknown, its filesystem's package is not installed, or the
        filesystem is read-only (see the module docstring).
    """
    if isinstance(work_dir, RemotePath | Path):
        return work_dir
    if not is_url(work_dir):
        return Path(work_dir)
    url = str(work_dir)
    protocol = url.split("://", 1)[0].lower()
    if not _PROTOCOL_RE.fullmatch(protocol):  # a chain (simplecache::s3://...) or garbage
        raise ValueError(
            f"the journal cannot be kept at {url}: not a URL of one filesystem (chained URLs "
            "cache or wrap another filesystem); use a local directory, a file:// URL or an "
            "object store (s3://, gs://, az://)")
    if protocol in _LOCAL_PROTOCOLS:
        return Path(url.split("://", 1)[1])
    if protocol in _READ_ONLY:
        raise ValueError(
            f"the journal cannot be kept at {url}: {protocol}:// is read-only to this package; "
            "use a local directory, a file:// URL or an object store (s3://, gs://, az://)")
    import fsspec

    try:
        fsspec.get_filesystem_class(protocol)  # known, and its package installed
    except ValueError as e:
        raise ValueError(
            f"the journal cannot be kept at {url}: fsspec knows no filesystem {protocol}://; "
            "use a local directory, a file:// URL or an object store (s3://, gs://, az://)"
        ) from e
    except ImportError as e:
        raise ValueError(
            f"the journal cannot be kept at {url}: the filesystem of {protocol}:// is not "
            f"installed ({e}); install it on the scheduler's machine") from e
    fs, path = fsspec.core.url_to_fs(url)
    return RemotePath(fs, path)


def parts_of(path: RemotePath) -> list[tuple[RemotePath, int]]:
    """The chain of objects ``path`` is made of, in order, with their sizes (``[]``: no such
    file): the object itself, then ``<name>.1``, ``<name>.2``, ...

    Raises
    ------
    JournalCorruptedError
        If a part is missing from the chain.
    """
    name = path.name
    pattern = re.compile(re.escape(name) + r"\.(\d+)")
    head: int | None = None
    found: dict[int, tuple[str, int]] = {}
    for entry, size in path.parent.entries():
        if entry == name:
            head = size
        elif (m := pattern.fullmatch(entry)) is not None:
            found[int(m.group(1))] = (entry, size)
    if head is None:
        return []
    chain = [(path, head)]
    offset = head
    for k, number in enumerate(sorted(found), start=1):
        if number != k:
            raise JournalCorruptedError(
                str(path), offset, f"part {k} of its chain of objects is missing "
                f"({found[number][0]} follows part {k - 1}: deleted?)")
        entry, size = found[number]
        chain.append((path.with_name(entry), size))
        offset += size
    return chain


def part_path(path: RemotePath, k: int) -> RemotePath:
    """The ``k``-th part (``k >= 1``) of the chain of ``path``."""
    return path.with_name(f"{path.name}.{k:0{_PART_DIGITS}d}")


class RemoteSegment:
    """A URL journal's open segment: each :meth:`append` is one new, immutable object."""

    __slots__ = ("path", "parts")

    def __init__(self, path: RemotePath, header: bytes) -> None:
        if path.exists():  # O_EXCL: a writer never appends to an older segment
            raise FileExistsError(f"journal segment {path} exists")
        path.fs.pipe_file(path.path, header)
        self.path = path
        self.parts = 0

    def append(self, data: bytes) -> None:
        """Write ``data`` as the chain's next object; durable when this returns."""
        part = part_path(self.path, self.parts + 1)
        part.fs.pipe_file(part.path, data)
        self.parts += 1


def open_read(path: JournalPath, buffering: int = -1) -> tuple[BinaryIO, int]:
    """A binary file of ``path``'s bytes (a local file, or a URL file's chain read whole),
    and its size."""
    if isinstance(path, RemotePath):
        data = path.read_bytes()
        return io.BytesIO(data), len(data)
    f = open(path, "rb", buffering=buffering)  # noqa: SIM115 - the caller closes it
    return f, os.fstat(f.fileno()).st_size
