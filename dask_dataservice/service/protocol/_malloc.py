"""glibc malloc tuning for the data plane (issue 16, target 6): ``dataservice.malloc-tuning``.

By default glibc serves every allocation of 128 KiB or more (the threshold adapts up to 32 MiB)
with its own ``mmap`` and gives it back with ``munmap`` when freed; distributed's nanny also sets
``MALLOC_TRIM_THRESHOLD_=64 KiB``, which fixes the thresholds and so keeps that behaviour. Every
1 MiB element a worker produces and every frame a reader receives is then fresh memory: 256
page faults per MiB, each a trip into the kernel that zeroes a page. With the tuning, large blocks
come from the heap and freed memory stays there for the next element:

- ``M_MMAP_THRESHOLD`` 32 MiB: blocks below that come from the heap (no mmap/munmap each);
- ``M_TRIM_THRESHOLD`` 1 GiB: free memory at the top of the heap is kept, up to that;
- ``M_TOP_PAD`` 64 MiB: the heap grows by at least that much at a time.

The cost is resident memory: a process keeps what it freed (up to ~1 GiB at the top of the
heap, in practice about its peak working set: the buffers of the elements in flight), where
untuned it would return it. docs/performance.md has the measurements. The setting applies to
the whole process (the Dask worker too), at the data plugin's setup on workers and at the first
read in a consumer; it cannot be undone in a running process.
"""

from __future__ import annotations

import ctypes
import logging
import sys

from ... import config

__all__ = ["MALLOC_SETTINGS", "tune_malloc_from_config"]

logger = logging.getLogger(__name__)

#: ``{mallopt parameter: (name, value)}`` (glibc's malloc.h numbers).
MALLOC_SETTINGS = {-3: ("M_MMAP_THRESHOLD", 32 << 20), -1: ("M_TRIM_THRESHOLD", 1 << 30),
                   -2: ("M_TOP_PAD", 64 << 20)}

_applied = False


def tune_malloc_from_config() -> bool:
    """Apply :data:`MALLOC_SETTINGS` once in this process if ``dataservice.malloc-tuning``
    is true (and the C library is glibc). Whether the process is tuned."""
    global _applied
    if _applied:
        return True
    if not config.get("malloc-tuning"):
        return False
    if not sys.platform.startswith("linux"):
        logger.debug("dataservice.malloc-tuning: only glibc (Linux) is tuned")
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl (Alpine) has no mallopt
        logger.debug("dataservice.malloc-tuning: no glibc mallopt here")
        return False
    for param, (name, value) in MALLOC_SETTINGS.items():
        if not mallopt(param, value):
            logger.warning("dataservice.malloc-tuning: mallopt(%s, %d) failed", name, value)
            return False
    _applied = True
    return True
