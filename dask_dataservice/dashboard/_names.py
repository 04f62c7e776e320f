"""The dashboard's routes and pages (a leaf: the package and its pages import it)."""

from __future__ import annotations

__all__ = ["PAGES", "STATUS_ROUTE"]

#: Route of the JSON status (under the dashboard's prefix, if any).
STATUS_ROUTE = "dataservice/status.json"
#: The bokeh pages: ``{path: title}``.
PAGES = {"dataservice": "Data service", "parameter-servers": "Parameter servers"}
