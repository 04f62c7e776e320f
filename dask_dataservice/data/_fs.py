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

__all__ = ["EXTENSIONS", "expand", "expand_one", "open_file", "is_url"]


def is_url(path: str) -> bool:
    return "://" in path


def _fs(path: str) -> Any:
    import fsspec

    fs, _, _ = fsspec.get_fs_token_paths(path)
    return fs


#: File extensions each reader takes from a directory (lower case; None: every file).
EXTENSIONS: dict[str, tuple[str, ...] | None] = {
    "from_csv": (".csv", ".tsv"),
    "from_json_lines": (".jsonl", ".ndjson", ".json"),
    "from_tfrecord": (".tfrecord", ".tfrecords", ".tfrec"),
    "from_parquet": (".parquet", ".parq", ".pq"),
    "from_images": (".png", ".jpg", ".jpeg", ".gif", ".bmp", ".tif", ".tiff", ".webp"),
    "from_text_lines": (".txt",),
    "list_files": None,
}

_GLOB_CHARS = frozenset("*?[")


def _hidden(name: str) -> bool:
    """Names pyarrow and Dask skip in a dataset directory: ``.hidden``, ``_SUCCESS``,
    ``_metadata``, ``_temporary``..."""
    return name.startswith((".", "_"))


def _wanted(path: str, extensions: tuple[str, ...] | None) -> bool:
    base = path.rstrip("/").rsplit("/", 1)[-1]
    if os.sep != "/":
        base = base.rsplit(os.sep, 1)[-1]
    return not _hidden(base) and (extensions is None or base.lower().endswith(extensions))


def _matched_hidden(pattern: str, path: str) -> bool:
    """Whether a name that a wildcard part of ``pattern`` matched in ``path`` is hidden
    (``data/**/*.csv`` skips ``data/_temporary/x.csv``; ``data/_x/*.csv`` names ``_x``)."""
    fixed = 0
    for part in pattern.replace(os.sep, "/").split("/"):
        if _GLOB_CHARS & set(part):
            break
        fixed += 1
    parts = path.replace(os.sep, "/").split("/")
    return any(_hidden(x) for x in parts[fixed:] if x)


def _local_dir(root: str, extensions: tuple[str, ...] | None) -> list[str]:
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not _hidden(d)]  # nor what is under them
        found.extend(os.path.join(dirpath, f) for f in filenames if _wanted(f, extensions))
    return found


def _url(protocol: str, path: str) -> str:
    if is_url(path):
        return path
    return f"{protocol}://{path.lstrip('/') if protocol == 'memory' else path}"


def _url_dir(fs: Any, protocol: str, root: str, extensions: tuple[str, ...] | None) -> list[str]:
    base = str(fs._strip_protocol(root)).rstrip("/")
    found: list[str] = []
    for p in fs.find(root):
        rel = p[len(base):] if p.startswith(base) else p
        parts = [x for x in rel.split("/") if x]
        if any(_hidden(x) for x in parts[:-1]) or not _wanted(p, extensions):
            continue
        found.append(_url(protocol, p))
    return found


def expand_one(pattern: str, extensions: tuple[str, ...] | None = None) -> list[str]:
    """The files ``pattern`` names (see :func:`expand`), unsorted."""
    has_glob = bool(_GLOB_CHARS & set(pattern))
    if not is_url(pattern):
        import glob

        if not has_glob:
            if os.path.isdir(pattern):
                return _local_dir(pattern, extensions)
            return [pattern] if os.path.exists(pattern) else []
        found: list[str] = []
        for p in glob.glob(pattern, recursive=True):
            if _matched_hidden(pattern, p):
                continue
            if os.path.isdir(p):
                found.extend(_local_dir(p, extensions))
            else:
                found.append(p)
        return found
    fs = _fs(pattern)
    protocol = pattern.split("://", 1)[0]
    if not has_glob:
        if fs.isdir(pattern):
            return _url_dir(fs, protocol, pattern, extensions)
        return [pattern] if fs.exists(pattern) else []
    found = []
    for p in fs.glob(pattern):
        if _matched_hidden(str(fs._strip_protocol(pattern)), str(p)):
            continue
        if fs.isdir(p):
            found.extend(_url_dir(fs, protocol, _url(protocol, p), extensions))
        else:
            found.append(_url(protocol, p))
    return found


def expand(patterns: list[str], what: str | None = None) -> list[str]:
    """The sorted paths matching ``patterns``, as the user would open them again.

    Each pattern is a file, a directory, or a glob (``*``, ``?``, ``[...]``; ``**`` matches
    any number of directories), local or an fsspec URL. A directory stands for every file
    under it, recursively, whose name ends in one of the reader's extensions
    (:data:`EXTENSIONS` of ``what``; every file for ``from_files`` and ``list_files``); a glob
    matching a directory does the same. Names starting with ``.`` or ``_`` (``.hidden``,
    ``_SUCCESS``, ``_metadata``: what pyarrow and Dask skip) are skipped in directories and
    glob matches, and nothing under such a directory is taken; a file named explicitly is
    always taken. With ``what``, a pattern that matches no file is a ``FileNotFoundError``
    naming it. Local patterns give local paths; URLs give URLs with their protocol.
    """
    extensions = EXTENSIONS.get(what) if what is not None else None
    found: set[str] = set()
    for pattern in patterns:
        pattern = os.fspath(pattern)
        matched = expand_one(pattern, extensions)
        if not matched and what is not None:
            raise FileNotFoundError(_nothing(what, pattern, extensions))
        found.update(matched)
    return sorted(found)


def _nothing(what: str, pattern: str, extensions: tuple[str, ...] | None) -> str:
    kinds = ("files" if extensions is None
             else "files ending in " + ", ".join(extensions))
    return (f"{what}(): no files match {pattern!r} (a directory stands for the {kinds} under "
            "it, recursively; names starting with '.' or '_' are skipped)")


def open_file(path: str, mode: str = "rb", **kwargs: Any) -> IO[Any]:
    """Open a local path or an fsspec URL (the caller closes it)."""
    if not is_url(path):
        return open(path, mode, **kwargs)
    import fsspec

    f: IO[Any] = fsspec.open(path, mode, **kwargs).open()
    return f
