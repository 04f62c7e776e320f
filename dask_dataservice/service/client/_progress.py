"""The console progress bar of a distributed dataset's reads (``dataservice.client.progress-bar``).

As Ray Data prints one by default, iterating a distributed dataset with ``for`` shows a tqdm
bar where someone would see it: on a terminal (stderr is a tty) or in Jupyter (a widget, with
``tqdm.auto``, when ``ipywidgets`` is importable). In a pipe, a log or CI it stays silent, so
that each refresh is not a line of log. The key forces it on (``true``) or off (``false``).
The bar is updated once per batch the reader receives, never per element.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from ... import config

__all__ = ["progress_bar", "progress_setting", "KEY"]

KEY = "client.progress-bar"
_ON = {True, "true", "on", "yes", "always"}
_OFF = {False, None, "false", "off", "no", "never"}


def progress_setting() -> bool | str:
    """``"auto"``, True or False, from ``dataservice.client.progress-bar``."""
    value = config.get(KEY)
    if isinstance(value, str):
        value = value.strip().lower()
    if value == "auto":
        return "auto"
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"dataservice.{KEY} must be 'auto', true or false, got {value!r}")


def _in_notebook() -> bool:
    shell = sys.modules.get("IPython")
    get = getattr(shell, "get_ipython", None)
    ip = get() if get is not None else None
    return ip is not None and "IPKernelApp" in getattr(ip, "config", {})


def _widgets() -> bool:
    return importlib.util.find_spec("ipywidgets") is not None


def progress_bar(total: int, desc: str) -> Any:
    """A tqdm bar for a pass of ``total`` elements (unknown when negative), or None."""
    setting = progress_setting()
    notebook = _in_notebook() and _widgets()
    if setting == "auto" and not (notebook or getattr(sys.stderr, "isatty", lambda: False)()):
        return None
    if setting is False:
        return None
    if notebook:
        from tqdm.auto import tqdm  # type: ignore[import-untyped, unused-ignore]
    else:
        from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]
    # no monitor thread: a daemon nobody would own or join (it only tunes stalled bars)
    cls = type("ReadProgressBar", (tqdm,), {"monitor_interval": 0})
    return cls(total=total if total >= 0 else None, desc=f"dataset {desc}", unit=" elements",
               file=sys.stderr, dynamic_ncols=True)
