"""Paths and globs on any filesystem, through fsspec URLs.

Every path a source or reader takes may be a local path or an fsspec URL (``file://``,
``memory://``, ``s3://``, ``gs://``, ...). Globs are expanded where the dataset is defined, so
every data worker reads the same list; a URL keeps its protocol, so a worker on another machine
opens the same object. Credentials and options for object stores come from fsspec's own
configuration (environment variables, ``~/.config/fsspec``), which each worker reads itself.
"""

from __future__ import annotations

import os
from typing import IO, Any

__all__ = ["expand", "open_file", "is_url"]


def is_url(path: str) -> bool:
    return "://" in path


def _fs(path: str) -> Any:
    import fsspec

    fs, _, _ = fsspec.get_fs_token_paths(path)
    return fs


def expand(patterns: list[str]) -> list[str]:
    """The sorted paths matching ``patterns`` (globs), as the user would open them again.

    Local patterns give local paths; URLs give URLs with their protocol.
    """
    found: set[str] = set()
    for pattern in patterns:
        pattern = os.fspath(pattern)
        if not is_url(pattern):
            import glob

            found.update(glob.glob(pattern, recursive=True))
            continue
        fs = _fs(pattern)
        protocol = pattern.split("://", 1)[0]
        for p in fs.glob(pattern):
            found.add(p if is_url(p) else f"{protocol}://{p.lstrip('/') if protocol == 'memory' else p}")
    return sorted(found)


def open_file(path: str, mode: str = "rb", **kwargs: Any) -> IO[Any]:
    """Open a local path or an fsspec URL (the caller closes it)."""
    if not is_url(path):
        return open(path, mode, **kwargs)
    import fsspec

    f: IO[Any] = fsspec.open(path, mode, **kwargs).open()
    return f
