"""Helpers shared by the benchmark scripts (each runs as ``python benchmarks/NAME.py``, so
this module is importable as ``_common`` from the script's own folder)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["fs_type"]


def fs_type(path: Path) -> str:
    """The file system type of the mount holding ``path`` (from /proc/mounts), or "unknown"."""
    best, fstype = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mount, kind, *_ = line.split()
                if str(path).startswith(mount) and len(mount) > len(best):
                    best, fstype = mount, kind
    except OSError:
        pass
    return fstype
