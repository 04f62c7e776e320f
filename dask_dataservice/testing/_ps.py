"""Cleanup asserts for one plugin (see :mod:`dask_dataservice.testing`)."""

from __future__ import annotations


async def assert_ps_cleanup(*workers, timeout: float = 10.0) -> None:
    """Placeholder: filled in by the restructuring pass (issue 10)."""
