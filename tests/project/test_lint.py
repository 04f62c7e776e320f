"""``ruff check`` passes on the package, the tests, the benchmarks and the docs' scripts, with the
rules of ``[tool.ruff]`` in pyproject.toml (no test ran it before: 16 findings had drifted in)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import needs

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(60)
def test_ruff_finds_nothing():
    needs("ruff", "lint")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "dask_dataservice",
                           "tests", "benchmarks", "docs"], cwd=ROOT, capture_output=True, text=True,
                          timeout=50)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
