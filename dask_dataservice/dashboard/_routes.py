"""``/dataservice/status.json`` on the scheduler's HTTP server (added to a running server)."""

from __future__ import annotations

import json
import math
from typing import Any

from distributed.http.utils import RequestHandler

__all__ = ["StatusJSON", "add_routes", "http_prefix"]


def _finite(x: Any) -> Any:
    """JSON has no NaN or infinity: they become null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


class StatusJSON(RequestHandler):
    """The figures of ``dds.status(client)``, as JSON."""

    def get(self) -> None:
        from ._collect import PLUGIN_NAME

        plugin = self.server.plugins.get(PLUGIN_NAME)
        if plugin is None:
            self.set_status(404)
            self.write({"error": "the dataservice dashboard is not installed"})
            return
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps(_finite(plugin.status())))


def http_prefix(scheduler: Any) -> str:
    """The dashboard's URL prefix (``--dashboard-prefix``), read off Dask's own routes."""
    for rule in scheduler.http_application.wildcard_router.rules:
        pattern = getattr(rule.matcher, "regex", None)
        if pattern is not None and pattern.pattern.endswith("json/counts.json$"):
            return pattern.pattern[: -len("json/counts.json$")] or "/"
    return "/"


def add_routes(scheduler: Any) -> None:
    route = http_prefix(scheduler) + "dataservice/status.json"
    scheduler.http_application.add_handlers(
        r".*", [(route, StatusJSON, {"dask_server": scheduler})])
