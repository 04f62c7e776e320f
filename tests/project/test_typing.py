"""The package is typed like a Dask library: ``mypy --strict`` on all of it reports nothing.

The configuration is ``[tool.mypy]`` in ``pyproject.toml``: ``strict = true``, and overrides
only for third-party modules that ship neither stubs nor ``py.typed`` (never ``ignore_errors``
on our own modules). A user's typed snippet against the installed wheel is checked in
``tests/project/test_packaging.py``.

Without a cache (a fresh clone, as in CI) the run takes 45 s at load 1 on 2 cores and 3.7 min
at load 8; with ``.mypy_cache`` a few seconds. It is marked slow and has its own timeout.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[2]


def _mypy_config() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["mypy"]


def test_mypy_config_is_strict_and_silences_no_module_of_ours() -> None:
    config = _mypy_config()
    assert config["strict"] is True
    assert config["files"] == ["dask_dataservice"]
    assert "ignore_errors" not in config and "ignore_missing_imports" not in config
    for override in config.get("overrides", []):
        modules = override["module"]
        modules = [modules] if isinstance(modules, str) else modules
        ours = [m for m in modules if m.split(".")[0] == "dask_dataservice"]
        assert not ours, f"an override silences our own modules: {ours}"
        assert set(override) <= {"module", "ignore_missing_imports"}, (
            f"overrides may only skip imports of third-party modules, got {override}")


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_package_passes_mypy_strict() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "dask_dataservice"],
        cwd=ROOT, capture_output=True, text=True, timeout=840,
    )
    report = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 0, f"mypy --strict dask_dataservice failed:\n{report}"
    assert report.startswith("Success: no issues found"), report
