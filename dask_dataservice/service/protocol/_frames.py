"""How a batch of elements becomes frames on the wire, and back (issue 16, targets 2 and 5).

An :class:`~._messages.ElementBatch` is one pickle (protocol 5) of its list of elements, with
every numpy buffer out of band. A batch of many small arrays used to travel as one frame per
array: each frame costs the worker a ``send`` and both sides some bookkeeping, which dominated
at 4-64 KiB elements. Now buffers smaller than ``dataservice.worker.pack-bytes`` are copied into
frames of up to 4 MiB (each at a 64-byte aligned offset, listed in the header), and the reader
hands the pickle zero-copy views of those frames; bigger buffers keep a frame of their own (a copy
of a big buffer costs more than its frame).

Compression (``register_dataset(..., compression=...)``): the worker compresses each frame with
the codec the reader asked for, through distributed's
:func:`~distributed.protocol.compression.maybe_compress`, which samples a frame first and sends
it raw if it does not compress to 70% or less. The codec of each frame goes into the header's
``"compression"`` entry, so distributed's own ``loads`` decompresses it before the reader sees it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from distributed.comm.addressing import get_address_host
from distributed.protocol.compression import compressions, maybe_compress

from ... import config
from ...errors import install_hint

__all__ = [
    "ALIGN",
    "CODECS",
    "PACK_FRAME_BYTES",
    "available_codecs",
    "check_compression",
    "choose_codec",
    "compress_frames",
    "pack_buffers",
    "pack_threshold",
    "reader_codecs",
    "unpack_buffers",
    "writable_frames",
]

#: Offsets of packed buffers are multiples of this (numpy views of them stay aligned).
ALIGN = 64
#: Codecs a dataset may name (besides ``"AUTO"`` and None), best first for ``"AUTO"``.
CODECS = ("lz4", "zstd", "snappy", "zlib")
#: ``"AUTO"`` picks among these only: cheap enough to pay on a fast link (zlib is not).
AUTO_CODECS = ("lz4", "zstd", "snappy")
#: What each codec needs installed (for the error that names it).
_PACKAGES = {"lz4": "lz4", "zstd": "zstandard", "snappy": "python-snappy", "zlib": "(stdlib)"}


def pack_threshold() -> int:
    """``dataservice.worker.pack-bytes``: buffers smaller than this travel packed (0: never)."""
    return config.get_bytes("worker.pack-bytes")


#: A packed frame holds at most this many bytes (then the next one starts): glibc serves
#: blocks this small from its heap and reuses them, where a 32 MiB frame would be a fresh
#: ``mmap`` (a page fault per 4 KiB) for every batch.
PACK_FRAME_BYTES = 4 << 20


def pack_buffers(raws: list[memoryview], limit: int) -> tuple[dict[str, Any], list[Any]]:
    """The header entries and frames of ``raws``: those under ``limit`` bytes packed.

    Packed buffers fill frames of about :data:`PACK_FRAME_BYTES`, each buffer at an
    :data:`ALIGN`-aligned offset. The header lists, for each packed buffer, its index among
    ``raws``, its packed frame, its offset there and its size; the packed frames come first,
    then the other buffers in order.
    """
    small = [i for i, r in enumerate(raws) if r.nbytes < limit] if limit > 0 else []
    if len(small) < 2:
        return {}, list(raws)
    offsets: list[int] = []
    sizes: list[int] = []
    packs: list[int] = []
    ends: list[int] = []  # the size of each packed frame
    pos = 0
    for i in small:
        n = raws[i].nbytes
        pos = (pos + ALIGN - 1) & ~(ALIGN - 1)
        if pos and pos + n > PACK_FRAME_BYTES:
            ends.append(pos)
            pos = 0
        offsets.append(pos)
        sizes.append(n)
        packs.append(len(ends))
        pos += n
    ends.append(pos)
    # not zeroed: every byte but the padding is written
    dsts = [memoryview(np.empty(end, np.uint8)) for end in ends]
    for i, pack, off, n in zip(small, packs, offsets, sizes, strict=True):
        dsts[pack][off:off + n] = raws[i]
    packed_set = set(small)
    frames: list[Any] = [*dsts, *(r for i, r in enumerate(raws) if i not in packed_set)]
    header = {"packed": small, "packs": packs, "offsets": offsets, "sizes": sizes,
              "pack_frames": len(dsts)}
    return header, frames


def unpack_buffers(header: dict[str, Any], frames: list[Any]) -> list[Any]:
    """The out-of-band buffers of a batch, in pickle order (views of the packed frames)."""
    n = int(header["buffers"])
    packed = header.get("packed")
    if not packed:
        return frames
    npacks = int(header["pack_frames"])
    wholes = [memoryview(f) for f in frames[:npacks]]
    out: list[Any] = [None] * n
    for i, pack, off, size in zip(packed, header["packs"], header["offsets"], header["sizes"],
                                  strict=True):
        out[i] = wholes[pack][off:off + size]
    rest = iter(frames[npacks:])
    for i in range(n):
        if out[i] is None:
            out[i] = next(rest)
    return out


def available_codecs() -> list[str]:
    """The codecs this process can decompress (installed packages), best first."""
    return [c for c in CODECS if c in compressions]


def check_compression(compression: object) -> str | None:
    """``compression`` as a dataset stores it: ``"AUTO"``, None or an installed codec name.

    Raises ``ValueError`` for anything else, and for a codec whose package is missing.
    """
    if compression is None or compression == "AUTO":
        return compression
    if not isinstance(compression, str) or compression.lower() not in CODECS:
        raise ValueError(f"compression must be 'AUTO', None or one of {', '.join(CODECS)}; "
                         f"got {compression!r:.60}")
    codec = compression.lower()
    if codec not in compressions:
        raise ValueError(f"compression {codec!r} needs the package {_PACKAGES[codec]!r}, which "
                         f"is not installed here: {install_hint('compression')}")
    return codec


def choose_codec(dataset_compression: str | None, accepted: list[str] | None) -> str | None:
    """The codec a worker uses for a reader that accepts ``accepted`` (None: send raw).

    The reader decides whether compression pays (it sends no codec on the same host, see
    :mod:`._reader`); the dataset decides whether and which: None never, a codec name that one
    if the reader has it, ``"AUTO"`` the first of the reader's codecs that is cheap enough.
    """
    if not accepted or dataset_compression is None:
        return None
    if dataset_compression == "AUTO":
        for codec in accepted:
            if codec in AUTO_CODECS and codec in compressions:
                return codec
        return None
    if dataset_compression in accepted and dataset_compression in compressions:
        return dataset_compression
    return None


def compress_frames(header: dict[str, Any], frames: list[Any], codec: str) -> list[Any]:
    """``frames`` compressed with ``codec`` where it pays (sampled), codecs in the header."""
    names: list[str | None] = []
    out: list[Any] = []
    for frame in frames:
        name, data = maybe_compress(frame, compression=codec)
        names.append(name)
        out.append(data)
    if any(names):
        header["compression"] = tuple(names)
    return out


def writable_frames(frames: list[Any]) -> list[Any]:
    """``frames`` as writable buffers, as uncompressed frames arrive from a comm: frames that
    zlib or zstd decompressed are ``bytes``, which numpy would wrap as read-only arrays."""
    return [bytearray(f) if isinstance(f, bytes) else f for f in frames]


_LOOPBACK = ("127.", "::1", "localhost", "0:0:0:0:0:0:0:1")


def reader_codecs(worker_address: str, local_host: str) -> list[str] | None:
    """The codecs a reader on ``local_host`` offers the worker at ``worker_address``.

    ``dataservice.client.compression``: ``auto`` (the default) offers codecs to workers on other
    hosts only: on loopback or the same host, frames move at memory speed and compressing
    costs more than it saves (see docs/performance.md); ``always`` offers them to every worker
    (to test, or for a slow virtual network between containers of one host); ``never`` to none.
    """
    policy = str(config.get("client.compression")).lower()
    if policy in ("never", "false", "none"):
        return None
    if policy not in ("auto", "always", "true"):
        raise ValueError("dataservice.client.compression must be 'auto', 'always' or 'never', "
                         f"got {policy!r:.40}")
    if policy == "auto":
        if worker_address.startswith("inproc://"):
            return None
        host = get_address_host(worker_address)
        if host == local_host or host.startswith(_LOOPBACK):
            return None
    return available_codecs() or None
