"""Progress bars where someone sees them: a tqdm widget in a Jupyter kernel with ipywidgets,
a text bar on a terminal, nothing in a pipe or a log (``dds.fit``, the demo, reads of a
distributed dataset)."""

from __future__ import annotations

from typing import Any

__all__ = ["interactive", "progress_bar_class"]


def _in_jupyter_kernel() -> bool:
    """Whether this process is a Jupyter kernel (IPython imported and running an IPKernelApp)."""
    import sys

    ipython = sys.modules.get("IPython")
    try:
        shell = ipython.get_ipython() if ipython is not None else None
    except Exception:  # an IPython too old or half imported: not a kernel we can draw in
        return False
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def _widgets() -> bool:
    """Whether a Jupyter widget can be drawn: in a kernel, with ipywidgets installed. Decided
    here, not by ``tqdm.auto``, which warns "IProgress not found" in a kernel without
    ipywidgets and then falls back to the text bar anyway."""
    import importlib.util

    try:
        return _in_jupyter_kernel() and importlib.util.find_spec("ipywidgets") is not None
    except (ImportError, ValueError):
        return False


def interactive() -> bool:
    """Whether a progress bar would be seen: in a Jupyter kernel with ipywidgets (a widget) or
    on a terminal; not in a pipe or a log, where each refresh would be a line."""
    import sys

    return _widgets() or bool(getattr(sys.stderr, "isatty", lambda: False)())


def progress_bar_class(name: str = "FitProgressBar") -> Any:
    """A tqdm bar class: ``tqdm.notebook``'s widget in a Jupyter kernel with ipywidgets, else
    ``tqdm.std``'s text bar; without tqdm's monitor thread (a daemon no one would own or join;
    it only adjusts the refresh interval of stalled bars)."""
    if _widgets():
        from tqdm.notebook import tqdm  # type: ignore[import-untyped, unused-ignore]
    else:
        from tqdm.std import tqdm  # type: ignore[import-untyped, unused-ignore]
    return type(name, (tqdm,), {"monitor_interval": 0})
