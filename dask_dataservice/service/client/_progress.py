"""The console progress bar of a distributed dataset's reads (``dataservice.client.progress-bar``).

As Ray Data prints one by default, iterating a distributed dataset with ``for`` shows a tqdm
bar where someone would see it (:mod:`dask_dataservice._tqdm`, as ``dds.fit``'s): on a
terminal (stderr is a tty) or in a Jupyter kernel (a widget, when ``ipywidgets`` imports). In a pipe, a log or CI it stays silent, so
that each refresh is not a line of log. The key forces it on (``true``) or off (``false``).
The bar is updated once per batch the reader receives, never per element.
"""

from __future__ import annotations

import sys
from typing import Any

from ... import config
from ..._tqdm import interactive, progress_bar_class

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


def progress_bar(total: int, desc: str) -> Any:
    """A tqdm bar for a pass of ``total`` elements (unknown when negative), or None."""
    setting = progress_setting()
    if setting is False or (setting == "auto" and not interactive()):
        return None
    return progress_bar_class("ReadProgressBar")(
        total=total if total >= 0 else None, desc=f"dataset {desc}", unit=" elements",
        file=sys.stderr, dynamic_ncols=True)
