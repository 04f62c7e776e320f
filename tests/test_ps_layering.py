"""The layering of ``dask_dataservice.ps``: no import cycles, no reach into other areas."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

import dask_dataservice.ps

PS_DIR = pathlib.Path(dask_dataservice.ps.__file__).parent


def _modules() -> dict[str, pathlib.Path]:
    return {p.stem: p for p in sorted(PS_DIR.glob("*.py")) if p.stem != "__init__"}


def _imports(path: pathlib.Path) -> tuple[set[str], set[str]]:
    """``(ps modules imported, other package modules imported)``, lazy imports included."""
    ps, other = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                ps.add(node.module.split(".")[0])
            else:
                ps.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 2:
            other.add(node.module or ",".join(a.name for a in node.names))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dask_dataservice"):
            other.add(node.module)
        elif isinstance(node, ast.Import):
            other.update(a.name for a in node.names if a.name.startswith("dask_dataservice"))
    return ps, other


def _order() -> list[str]:
    """The ps modules in dependency order (each after what it imports); fails on a cycle."""
    graph = {m: _imports(p)[0] & set(_modules()) for m, p in _modules().items()}
    order: list[str] = []
    state: dict[str, str] = {}

    def visit(m: str, path: list[str]) -> None:
        if state.get(m) == "done":
            return
        assert state.get(m) != "visiting", f"import cycle: {' -> '.join(path + [m])}"
        state[m] = "visiting"
        for dep in sorted(graph[m]):
            visit(dep, path + [m])
        state[m] = "done"
        order.append(m)

    for m in sorted(graph):
        visit(m, [])
    return order


def test_no_import_cycles():
    order = _order()
    assert order.index("_types") < order.index("_kernels") < order.index("server")
    assert order.index("variables") < order.index("optimizers")  # not the other way round
    assert order.index("strategy") < order.index("coordinator")


@pytest.mark.parametrize("module", sorted(_modules()))
def test_only_allowed_imports_from_the_rest_of_the_package(module):
    _, other = _imports(_modules()[module])
    allowed = {"config", "_rpc", "_async", "errors"}
    assert other <= allowed, f"ps.{module} imports {sorted(other - allowed)}"


def test_server_does_not_import_client_side_optimizers():
    assert "optimizers" not in _imports(_modules()["server"])[0]


def test_modules_are_small():
    sizes = {m: len(p.read_text().splitlines()) for m, p in _modules().items()}
    assert max(sizes.values()) < 800, sizes


def test_each_module_imports_alone_in_dependency_order():
    code = "; ".join(f"import dask_dataservice.ps.{m}" for m in _order())
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
