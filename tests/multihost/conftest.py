"""Fixtures of the multi-host tier (docs/architecture.md, "Tests"): hosts in network
namespaces (``_netns``), skipped with the reason where they cannot be made."""

from __future__ import annotations

import pytest
from _netns import Network, unavailable

_WHY_NOT = unavailable()


@pytest.fixture
def net():
    """A fresh network; every process and namespace of it is gone after the test."""
    if _WHY_NOT:
        pytest.skip(f"multi-host tier: {_WHY_NOT}")
    network = Network()
    try:
        yield network
    finally:
        network.close()
