"""The package is typed like a Dask library: ``mypy --strict`` on all of it reports nothing.

The configuration is ``[tool.mypy]`` in ``pyproject.toml``: ``strict = true``, and overrides
only for third-party modules: those that ship neither stubs nor ``py.typed``, and big optional
ones that are not analysed (torch, bokeh, IPython, matplotlib: their types are ``Any``). Never
``ignore_errors`` on our own modules. The same mypy process checks a user's typed snippets against the public
API (tests/_mypy.py): one clean, one misusing it, whose errors show the checker sees real
types, not ``Any``.

Without a cache (a fresh clone, as in CI) the run takes about 12 s at load 1 on 2 cores (45 s
while it analysed torch's 1,400 modules); with ``.mypy_cache`` a few seconds. tests/project/conftest.py starts it in the
background when the collection ends; the test waits for it. It is marked slow and has its own
timeout.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from _helpers import needs
from _mypy import session_run

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
        assert set(override) <= {"module", "ignore_missing_imports", "follow_imports"}, (
            f"overrides may only skip imports of third-party modules, got {override}")
        assert override.get("follow_imports", "skip") == "skip", override


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_package_and_a_users_snippets_pass_mypy_strict() -> None:
    """``mypy --strict dask_dataservice snippet.py mistyped.py``: errors in the misused
    snippet only, exactly the expected ones; none in the package or the typed snippet."""
    needs("mypy", "lint")
    run = session_run()
    code, report = run.result()
    errors = [line for line in report.splitlines() if ": error: " in line]
    assert code == 1 and errors, f"{' '.join(run.command)}:\n{report}"
    # by file name: a cached module's errors come back with the path of the run that cached it
    elsewhere = [line for line in errors if Path(line.split(":", 1)[0]).name != "mistyped.py"]
    assert not elsewhere, "mypy --strict reports errors outside the misused snippet:\n" + \
        "\n".join(elsewhere)
    assert 'Argument 2 to "register_dataset" has incompatible type "int"' in report
    assert 'Argument 1 to "ClusterCoordinator" has incompatible type "int"' in report
    # RemoteValue carries the scheduled function's result type
    assert 'Incompatible return value type (got "int", expected "str")' in report
    assert report.strip().splitlines()[-1].startswith(
        f"Found {len(errors)} errors in 1 file "), report
