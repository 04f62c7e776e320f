"""What the layers above the service's roles install into them.

The dispatcher, the data workers and the readers are siblings: none imports another, and
none imports the wiring (:mod:`dask_dataservice.service`) or the dashboard. Two things they
do need from above arrive here, installed when the package is imported (so before any of
their code runs, wherever it runs: the package root and ``dask_dataservice.service`` are
imported first by any import of a module beneath them, unpickling a plugin included):

- **dispatcher start hooks** (:func:`on_dispatcher_start`), awaited by the dispatcher plugin
  at the end of its ``start``, in the order they were added: the wiring's hook gives every
  worker that joins the data-worker plugin, the package root's adds the dashboard.
- **the plugins' factory** (:func:`set_plugins`): ``dds.install`` on a running cluster
  installs ``(DispatcherPlugin(), DataWorkerPlugin())``, made by the wiring.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["new_plugins", "on_dispatcher_start", "run_dispatcher_start", "set_plugins"]

#: ``name -> hook(scheduler)``, in the order added (re-adding a name replaces its hook).
_START_HOOKS: dict[str, Callable[[Any], Awaitable[None]]] = {}
_PLUGINS: list[Callable[[], tuple[Any, ...]]] = []


def on_dispatcher_start(name: str, hook: Callable[[Any], Awaitable[None]]) -> None:
    """Await ``hook(scheduler)`` whenever a dispatcher plugin starts on a scheduler."""
    _START_HOOKS[name] = hook


async def run_dispatcher_start(scheduler: Any) -> None:
    """Await every dispatcher start hook, in the order they were added (the plugin's call)."""
    for hook in list(_START_HOOKS.values()):
        await hook(scheduler)


def set_plugins(factory: Callable[[], tuple[Any, ...]]) -> None:
    """``factory()`` makes the plugins ``dds.install`` installs (the wiring's call)."""
    _PLUGINS[:] = [factory]


def new_plugins() -> tuple[Any, ...]:
    """``(dispatcher plugin, data-worker plugin)``, new instances."""
    if not _PLUGINS:  # pragma: no cover - dask_dataservice.service sets it when imported
        raise RuntimeError("dask_dataservice.service is not imported: no plugins to install")
    return _PLUGINS[0]()
