"""The package as users install it: a built sdist and wheel, not the editable source tree.

``python -m build`` builds the sdist, then the wheel from that sdist (so a file missing from the
sdist breaks the wheel too), from a copy of the project's packaging inputs (the build writes
``*.egg-info`` next to its source; the working tree is left alone). The wheel is installed with
``--no-deps`` into a fresh venv whose dependencies come from the project venv through a ``.pth``
line: the test is about the wheel's files, entry points and import behaviour, and resolving
Dask, zarr and numpy from the registry again would add a minute without testing this project's
code (the dependency list itself is checked from the wheel's metadata). A ``.pth`` path line does
not process the project venv's own ``.pth`` files, so its editable install stays out of the way;
the test asserts the package is imported from the fresh venv.

A user's typed snippet is checked with ``mypy --strict`` in tests/project/test_typing.py, in
the same mypy run as the package (the wheel's ``py.typed``, which makes the installed package
typed for that run's checker, is asserted here, in the wheel and in the fresh venv).
"""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
#: extras that are tooling for this project, not features for users: ``all`` leaves them out
NOT_RUNTIME_EXTRAS = {"test", "docs", "lint", "all"}
#: modules that only optional features import; ``import dask_dataservice`` must not
OPTIONAL_MODULES = [
    "pyarrow",
    "PIL",
    "google.protobuf",
    "cryptography",
    "dask_jobqueue",
    "dask_kubernetes",
    "torch",
    "jax",
    "matplotlib",
]


def _run(*cmd, cwd=None, timeout=180) -> str:
    # A fresh venv sees only what is installed in it: a PYTHONPATH of the caller's (a
    # checkout put first on the path) would shadow the installed package.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout,
        env=env,
    )
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _requirement_name(req: str) -> str:
    for sep in "<>=!~[; ":
        req = req.split(sep, 1)[0]
    return req.strip().lower()


def test_all_extra_covers_every_runtime_extra():
    extras = PYPROJECT["project"]["optional-dependencies"]
    runtime = {name: reqs for name, reqs in extras.items() if name not in NOT_RUNTIME_EXTRAS}
    assert runtime, "no runtime extras found"
    wanted = {_requirement_name(r) for reqs in runtime.values() for r in reqs}
    got = {_requirement_name(r) for r in extras["all"]}
    assert wanted <= got, f"extra 'all' misses {sorted(wanted - got)}"
    tooling = {_requirement_name(r) for name in ("docs", "lint") for r in extras[name]}
    assert not (got & tooling - wanted), "extra 'all' holds tooling-only packages"


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "dask_dataservice",
        src / "dask_dataservice",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )
    out = tmp_path_factory.mktemp("dist")
    _run(sys.executable, "-m", "build", "--outdir", out, src, timeout=240)
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


@pytest.mark.process
@pytest.mark.slow
def test_wheel_and_sdist_contents(dists):
    with zipfile.ZipFile(dists["wheel"]) as zf:
        names = set(zf.namelist())
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
        metadata = email.message_from_bytes(zf.read(f"{dist_info}/METADATA"))
    for required in ("dask_dataservice/py.typed", "dask_dataservice/dataservice.yaml"):
        assert required in names
    assert not any(n.startswith("tests/") for n in names)
    assert "dask-dataservice = dask_dataservice.cli:main" in entry_points
    assert "dataservice = dask_dataservice.cli:dataservice" in entry_points
    assert "all" in metadata.get_all("Provides-Extra")
    requires = {_requirement_name(r) for r in metadata.get_all("Requires-Dist") if "extra" not in r}
    assert requires == {_requirement_name(r) for r in PYPROJECT["project"]["dependencies"]}

    with tarfile.open(dists["sdist"]) as tf:
        members = {m.name.split("/", 1)[1] for m in tf.getmembers() if "/" in m.name}
    for required in (
        "pyproject.toml",
        "README.md",
        "dask_dataservice/py.typed",
        "dask_dataservice/dataservice.yaml",
        "dask_dataservice/__init__.py",
    ):
        assert required in members


@pytest.fixture(scope="module")
def venv(dists, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed (``--no-deps``; dependencies from the project venv)."""
    venv = tmp_path_factory.mktemp("venv")
    _run(sys.executable, "-m", "venv", venv)
    python = venv / "bin" / "python"
    _run(python, "-m", "pip", "install", "-q", "--no-deps", dists["wheel"], timeout=120)
    site = Path(
        _run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").strip()
    )
    deps = Path(
        _run(sys.executable, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").strip()
    )
    (site / "_project_deps.pth").write_text(f"{deps}\n")
    return venv


@pytest.mark.process
@pytest.mark.slow
def test_wheel_installed_in_fresh_venv(venv, tmp_path):
    python = venv / "bin" / "python"
    site = Path(
        _run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").strip()
    )

    check = textwrap.dedent(
        f"""
        import sys
        from importlib import resources
        import dask_dataservice as dds
        assert dds.__file__.startswith({str(site)!r}), dds.__file__
        assert dds.__version__ == {PYPROJECT["project"]["version"]!r}, dds.__version__
        loaded = sorted(m for m in {OPTIONAL_MODULES!r} if m in sys.modules)
        assert not loaded, f"import dask_dataservice imported optional modules {{loaded}}"
        assert resources.files("dask_dataservice").joinpath("py.typed").is_file()
        assert list(dds.Dataset.range(3).map(lambda x: x * 2)) == [0, 2, 4]
        print("ok")
        """
    )
    assert _run(python, "-c", check, cwd=tmp_path).strip() == "ok"
    out = _run(venv / "bin" / "dask-dataservice", "--version", cwd=tmp_path)
    assert out.strip() == f"dask-dataservice {PYPROJECT['project']['version']}"


def test_type_checking_imports_match_lazy_names():
    """Every lazily loaded public name is re-exported for type checkers, and nothing else."""
    import ast

    import dask_dataservice

    tree = ast.parse(Path(dask_dataservice.__file__).read_text())
    (block,) = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
    ]
    exported = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom)
        for alias in node.names:
            assert alias.asname == alias.name, (
                f"{alias.name} needs 'as {alias.name}' to be exported"
            )
            exported[alias.name] = f"dask_dataservice.{node.module}"
    lazy = dask_dataservice._LAZY
    assert set(exported) == set(lazy) - dask_dataservice._UNTYPED_LAZY
    for name, module in exported.items():
        expected = lazy[name] if name != "partitioners" else lazy[name].rsplit(".", 1)[0]
        assert module == expected, name


def test_all_lists_every_public_name_and_each_exists():
    """``dask_dataservice.__all__``: every eager and lazy public name (the torch bridge is a
    module whose import needs torch: ``dds.torch`` loads it, a star import does not), each
    one importable, and every public error type of :mod:`dask_dataservice.errors`."""
    import types

    import dask_dataservice as dds
    from dask_dataservice import errors

    assert len(dds.__all__) == len(set(dds.__all__))
    assert [name for name in dds.__all__ if not hasattr(dds, name)] == []  # loads the lazy ones
    public = {name for name, value in vars(dds).items()
              if not name.startswith("_") and not isinstance(value, types.ModuleType)}
    public -= {"annotations", "TYPE_CHECKING"}  # the module's own imports
    public |= (set(dds._LAZY) - {"torch"}) | {"__version__"}
    assert sorted(public - set(dds.__all__)) == []
    assert sorted(set(dds.__all__) - public) == []
    assert sorted(set(errors.__all__) - set(dds.__all__)) == []
    assert all(getattr(dds, name) is getattr(errors, name) for name in errors.__all__)


def test_every_public_error_type_is_defined_in_errors():
    """Every exception class a public module exports (its ``__all__``, else its names without
    ``_``; no ``_`` in the module's path) is defined in :mod:`dask_dataservice.errors` and
    listed in its ``__all__``."""
    import importlib
    import inspect
    import pkgutil

    import dask_dataservice as dds
    from dask_dataservice import errors

    found = {}
    for info in pkgutil.walk_packages(dds.__path__, "dask_dataservice."):
        if any(part.startswith("_") for part in info.name.split(".")):
            continue
        if info.name.split(".")[1] in ("torch", "jax"):  # optional dependencies
            continue
        module = importlib.import_module(info.name)
        names = getattr(module, "__all__", [n for n in vars(module) if not n.startswith("_")])
        for name in names:
            value = getattr(module, name)
            if (inspect.isclass(value) and issubclass(value, Exception)
                    and not issubclass(value, Warning)
                    and value.__module__.startswith("dask_dataservice")):
                found[f"{info.name}.{name}"] = value
    elsewhere = sorted(k for k, v in found.items() if v.__module__ != "dask_dataservice.errors")
    assert elsewhere == []
    assert {v.__name__ for v in found.values()} <= set(errors.__all__) | {"PlainMessage"}
