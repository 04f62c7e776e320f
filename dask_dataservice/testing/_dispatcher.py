"""Cleanup asserts for one plugin (see :mod:`dask_dataservice.testing`)."""

from __future__ import annotations


async def assert_dispatcher_cleanup(scheduler, timeout: float = 10.0) -> None:
    """Placeholder: filled in by the restructuring pass (issue 10)."""
