"""The package as users install it: a built sdist and wheel, not the editable source tree.

``python -m build`` builds the sdist, then the wheel from that sdist (so a file missing from the
sdist breaks the wheel too), from a copy of the source tree (tests/project/_venv.py: the build
writes ``*.egg-info`` next to its source; the working tree is left alone). The wheel is then
installed into a fresh venv with its dependencies (from pip's cache and the registry, as a
user's ``pip install`` gets them), and the command line, the demo and a distributed read on a
LocalCluster of worker processes run from it; ``pip install 'dask-dataservice[EXTRA]'``, the
form every install hint uses, then adds an extra to that installed wheel.

The extras are checked too: ``all`` is every runtime extra, ``dev`` everything, ``test`` stays
light (no torch, jax, dask-kubernetes, mypy or Sphinx), and every install hint in the code,
the docs and the notebooks names an extra that exists and a command that works.

A user's typed snippet is checked with ``mypy --strict`` in tests/project/test_typing.py, in
the same mypy run as the package (the wheel's ``py.typed``, which makes the installed package
typed for that run's checker, is asserted here, in the wheel and in the fresh venv).
"""

from __future__ import annotations

import email
import json
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import tomllib
import zipfile
from pathlib import Path

import first_hour
import pytest
from _helpers import REQUIRE_ALL_TESTS
from _venv import build_dists, clean_env, fresh_venv, install_wheel, run, source_files

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
#: extras that are tooling for this project, not features for users: ``all`` leaves them out
NOT_RUNTIME_EXTRAS = {"test", "docs", "lint", "all", "dev"}
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
    "keras",
    "matplotlib",
]


def _run(*cmd, cwd=None, timeout=180) -> str:
    return run(*cmd, cwd=cwd, timeout=timeout)


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
    return build_dists(tmp_path_factory.mktemp("dist"))


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
    # what a build from the sdist needs: every module and package data file of the source
    # tree (*.yaml, py.typed), the metadata's README, and a license file if the tree has one
    package = {str(p) for p in source_files() if p.parts[0] == "dask_dataservice"
               and p.suffix in (".py", ".yaml", ".typed")}
    assert {"dask_dataservice/py.typed", "dask_dataservice/dataservice.yaml"} <= package
    licenses = {str(p) for p in source_files() if len(p.parts) == 1
                and p.name.upper().startswith(("LICENSE", "COPYING"))}
    wanted = package | licenses | {"pyproject.toml", "README.md", "PKG-INFO"}
    assert sorted(wanted - members) == []
    wheel_data = {n for n in names if n.startswith("dask_dataservice/")}
    assert sorted(package - wheel_data) == []
    assert licenses == {"LICENSE"}  # the metadata's BSD-3-Clause, shipped in both
    assert f"{dist_info}/licenses/LICENSE" in names


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_newcomers_first_hour_from_the_built_wheel(dists, tmp_path):
    """The wheel in a fresh venv, its dependencies from the registry (or pip's cache): the
    package imports from there without any optional module, ``--version`` and a small demo
    (streaming and training on worker processes) run; ``pip install
    'dask-dataservice[parquet]'`` adds pyarrow to it. Then tests/project/first_hour.py
    replays a newcomer's first hour with that venv's python, each step a script run as a
    file: the README's example, a 100 MB array, a directory of Parquet files, two DDP ranks
    for three epochs, a snapshot read by pyarrow, the dashboard naming the slow op. torch
    (PyPI's is the 5 GB CUDA build) is not installed again: a ``.pth`` line appends the
    project venv's packages after the fresh venv's own, so only what the fresh venv lacks
    (torch) comes from there."""
    bin_dir = fresh_venv(tmp_path / "venv")
    install_wheel(bin_dir, dists["wheel"])
    python = bin_dir / "python"
    site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").strip())
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
    assert run(python, "-c", check, cwd=tmp_path).strip() == "ok"
    out = run(bin_dir / "dask-dataservice", "--version", cwd=tmp_path)
    assert out.strip() == f"dask-dataservice {PYPROJECT['project']['version']}"

    demo = run(bin_dir / "dask-dataservice", "demo", "--elements", "20000", "--quiet",
               cwd=tmp_path, timeout=240).splitlines()
    assert demo[0].startswith("demo: accuracy "), demo
    assert demo[1].startswith("demo: 20000 elements in "), demo
    # the form of every install hint adds an extra to the installed wheel
    assert "pyarrow" not in run(python, "-m", "pip", "list", "--format=freeze").lower()
    run(python, "-m", "pip", "install", "-q", "dask-dataservice[parquet]", timeout=300)
    assert run(python, "-c", "import pyarrow; print('pyarrow')", cwd=tmp_path).strip() == "pyarrow"

    project_site = Path(sysconfig.get_path("purelib"))
    (site / "zz_project_packages.pth").write_text(f"{project_site}\n")
    where = run(python, "-c", "import pyarrow, torch, dask_dataservice as d; "
                "print(pyarrow.__file__, d.__file__, torch.__file__)", cwd=tmp_path).split()
    assert [w.startswith(str(site)) for w in where] == [True, True, False], where
    proc = subprocess.run([python, ROOT / "tests" / "project" / "first_hour.py", python,
                           "--workdir", tmp_path / "first-hour"], capture_output=True,
                          text=True, timeout=420, env=clean_env(), cwd=tmp_path)
    steps = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    failed = [s for s in steps if not s["ok"]]
    for step in failed:  # whole (an assertion's message is cut short)
        print(f"--- step {step['step']} failed after {step['seconds']} s:\n{step['out']}")
    assert not failed and proc.returncode == 0, (failed, proc.stderr[-3000:])
    assert [s["step"] for s in steps] == list(first_hour.STEPS)


# -- extras and install hints --------------------------------------------------------------


EXTRAS = PYPROJECT["project"]["optional-dependencies"]


def test_dev_extra_is_everything_and_test_stays_light():
    assert EXTRAS["dev"] == ["dask-dataservice[test,docs,lint,all]"]
    named = set(EXTRAS["dev"][0].split("[", 1)[1].rstrip("]").split(","))
    assert named | {"dev"} | {e for e in EXTRAS if e not in NOT_RUNTIME_EXTRAS} >= set(EXTRAS)
    test = {_requirement_name(r) for r in EXTRAS["test"]}
    heavy = {"torch", "jax", "jaxlib", "keras", "dask-kubernetes", "mypy", "sphinx", "myst-parser"}
    assert not (test & heavy), sorted(test & heavy)
    assert {"pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "build"} <= test


#: a ``pip install`` command in text: the words up to the end of the line or a closing mark
PIP = re.compile(r"pip install ([^`\n)\"#]+)")
#: an extra named in a hint: ``dask-dataservice[a,b]`` or ``.[a,b]``, quoted or not (an
#: upper-case name is a placeholder: ``dask-dataservice[EXTRA]``)
NAMED = re.compile(r"(?:dask-dataservice|(?<![\w/])\.|\.whl)\[([\w,-]+)\]")


def _hint_files() -> list[Path]:
    return [ROOT / p for p in source_files()
            if p.suffix in (".py", ".md", ".ipynb", ".toml", ".yaml", ".txt", "")
            and p.parts[0] in ("dask_dataservice", "docs", "notebooks", "tests", "deploy",
                               "benchmarks", ".ci", "README.md", "pyproject.toml")
            and p.name != "CHANGELOG.md"]


def test_every_install_hint_names_a_real_extra_and_a_command_that_works():
    """Every ``pip install`` in the code, docs, notebooks and scripts: an extra it names exists
    in pyproject.toml, and it never installs ``dask-dataservice`` by name without an extra
    (the package is not on PyPI; with an extra, pip adds it to an installed package)."""
    commands, bad = 0, []
    for path in _hint_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in PIP.finditer(text):
            commands += 1
            args = m.group(1)
            where = f"{path.relative_to(ROOT)}: pip install {args.strip()}"
            for extras in NAMED.findall(args):
                missing = [e for e in extras.split(",") if e not in EXTRAS and not e.isupper()]
                if missing:
                    bad.append(f"{where} (no extra {missing})")
            words = [w.strip("'\"") for w in args.split()]
            if any(w == "dask-dataservice" or w == "dask_dataservice" for w in words):
                bad.append(f"{where} (not on PyPI: from a clone or a wheel)")
    assert commands > 20, commands
    assert bad == []


def test_the_install_hint_of_errors_is_the_documented_one():
    from dask_dataservice.errors import install_hint

    assert install_hint("torch") == ("pip install 'dask-dataservice[torch]' "
                                     "(in a clone: pip install -e '.[torch]')")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "`pip install 'dask-dataservice[torch]'`" in readme
    assert "pip keeps the installed\npackage and adds the extra's packages" in readme


def test_tests_import_optional_dependencies_through_needs():
    """``pytest.importorskip`` would skip silently in CI: tests call ``_helpers.needs``, which
    names the extra and fails under DASK_DATASERVICE_REQUIRE_ALL_TESTS."""
    users = sorted(str(p) for p in source_files() if p.parts[0] == "tests" and p.suffix == ".py"
                   and p.name not in ("_helpers.py", "test_packaging.py")
                   and "importorskip(" in (ROOT / p).read_text(encoding="utf-8"))
    assert users == []


@pytest.mark.process
@pytest.mark.slow
def test_require_all_tests_turns_a_missing_extra_into_a_failure(tmp_path):
    (tmp_path / "test_needs.py").write_text(textwrap.dedent("""
        from _helpers import needs

        def test_it():
            needs("no_such_module_for_this_test", "torch")
    """))
    tests = str(ROOT / "tests")

    def pytest_run(**env: str) -> tuple[int, str]:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-rs",
             "-o", "addopts=", "--rootdir", str(tmp_path), str(tmp_path / "test_needs.py")],
            cwd=tmp_path, capture_output=True, text=True, timeout=120,
            env={**{k: v for k, v in os.environ.items() if k != REQUIRE_ALL_TESTS},
                 "PYTHONPATH": os.pathsep.join([tests, str(ROOT)]), **env})
        return proc.returncode, proc.stdout + proc.stderr

    code, out = pytest_run()
    assert code == 0 and "1 skipped" in out, out
    assert "the [torch] extra, pip install -e '.[torch]'" in out
    code, out = pytest_run(**{REQUIRE_ALL_TESTS: "1"})
    assert code == 1 and "1 failed" in out, out
    assert f"{REQUIRE_ALL_TESTS} is set: every test must run" in out
    code, out = pytest_run(**{REQUIRE_ALL_TESTS: "0"})
    assert code == 0 and "1 skipped" in out, out


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
    public |= (set(dds._LAZY) - {"torch", "keras"}) | {"__version__"}
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
        if info.name.split(".")[1] in ("torch", "jax", "keras"):  # optional dependencies
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


@pytest.mark.pure
def test_any_traceback_fails_but_distributeds_known_shutdown_records():
    """``first_hour.py``'s steps and the stopped servers of ``_helpers.Servers`` fail on a
    traceback in stderr, except in distributed's known shutdown records: a worker's heartbeat
    meeting a closing scheduler (dask/distributed#7105, not this package's; two fresh-clone
    runs of eleven hit it) and a batched comm closing."""
    from _logs import unexpected_tracebacks

    noise = ("2026-12-07 01:10:00,123 - distributed.worker - ERROR - Failed to communicate "
             "with scheduler during heartbeat.\nTraceback (most recent call last):\n"
             "  File \"tcp.py\", line 225, in read\n"
             "tornado.iostream.StreamClosedError: Stream is closed\n")
    other = ("2026-12-07 01:10:00,200 - distributed.core - ERROR - boom\n"
             "Traceback (most recent call last):\nValueError: boom\n")
    bare = "Traceback (most recent call last):\n  File \"step.py\"\nKeyError: 1\n"
    info = "2026-12-07 01:10:00,300 - distributed.worker - INFO - closing\n"
    assert not unexpected_tracebacks("")
    assert not unexpected_tracebacks(info + noise + info)
    for stderr in (other, bare, noise + other, other + noise, bare + noise):
        assert unexpected_tracebacks(stderr), stderr
    # a bare traceback right after that record reads as its continuation: a crash of the
    # step's script still fails the step, by its exit code
