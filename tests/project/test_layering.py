"""The package's layers: every import runs downward, and no package imports itself in a circle.

The rules (docs/architecture.md, "The house"), checked on the source with no exemptions:

- Ranks of the package's top-level names: the private foundations (``_async``, ``_rpc``,
  ``config``, ``errors``, any ``_x``) 0, ``data`` 1, ``service`` and ``ps`` 2 (siblings),
  ``dashboard``, ``torch``, ``jax``, ``keras`` and ``testing`` 3, the package root 4, ``demo``
  5, ``cli`` 6. A module imports only from a lower rank or from its own top-level name; two
  different names of one rank (siblings, the foundations included) do not import each other.
- ``data`` imports no ``distributed``.
- Inside ``service``: ``protocol`` < ``dispatcher`` | ``worker`` | ``client`` (siblings) < the
  wiring (``service/__init__.py``, ``servers``, ``preload``: every module directly in
  ``service/``).
- No import cycle among the modules of any one package (directory). A module that needs one
  that imports it gets it installed from there instead (``data/dataset.py`` gives
  ``ops_more`` the Dataset class, ``client/_fixed_readers.py`` installs itself into
  ``_reader``).

Imports at module level and inside functions count; ``if TYPE_CHECKING:`` blocks do not
(annotations only). The parameter-server checks that are stricter than the ranks (what ``ps``
takes from the rest of the package, the order its modules import in) are at the end.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

import dask_dataservice

pytestmark = pytest.mark.pure

PKG = "dask_dataservice"
ROOT = Path(dask_dataservice.__file__).parent.parent

#: Rank of each top-level name of the package (``__init__``: the package root).
RANKS = {"data": 1, "service": 2, "ps": 2, "dashboard": 3, "torch": 3, "jax": 3, "keras": 3,
         "testing": 3, "__init__": 4, "demo": 5, "cli": 6}
#: Rank of each part of ``service`` (a module directly in ``service/``: the wiring).
SERVICE_RANKS = {"protocol": 0, "dispatcher": 1, "worker": 1, "client": 1, "(wiring)": 2}


@dataclass(frozen=True)
class Module:
    name: str  # dotted: dask_dataservice.service.worker.plugin
    path: Path
    is_package: bool  # an __init__.py

    @property
    def package(self) -> str:
        """The package whose directory holds this module (a package's __init__: itself)."""
        return self.name if self.is_package else self.name.rpartition(".")[0]


@dataclass(frozen=True)
class Import:
    target: str  # dotted name of the module imported (or of the package a name comes from)
    line: int
    where: str  # "module" or "function"


def find_modules(root: Path) -> dict[str, Module]:
    """Every module of the package under ``root`` (the directory that holds the package)."""
    out = {}
    for path in sorted((root / PKG).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        name = ".".join(parts)
        out[name] = Module(name, path, is_package)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(module: Module, node: ast.Import | ast.ImportFrom, modules: dict[str, Module]
             ) -> list[str]:
    """The modules an import statement loads: ``from pkg import sub`` names ``pkg.sub`` when
    ``sub`` is a module, else ``pkg`` (where the names come from)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.package.split(".")
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    out = set()
    for alias in node.names:
        sub = f"{source}.{alias.name}"
        out.add(sub if sub in modules else source)
    return sorted(out)


def imports_of(module: Module, modules: dict[str, Module]) -> list[Import]:
    """Every import of ``module`` (module level and in functions; not under TYPE_CHECKING)."""
    found: list[Import] = []

    def walk(nodes: list[ast.stmt] | list[ast.AST], depth: int) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                walk(node.orelse, depth)
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                where = "function" if depth else "module"
                found.extend(Import(t, node.lineno, where) for t in _targets(module, node, modules))
                continue
            inner = depth + isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            walk(list(ast.iter_child_nodes(node)), inner)

    walk(ast.parse(module.path.read_text()).body, 0)
    return found


def _top(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _rank(top: str) -> int | None:
    if top in RANKS:
        return RANKS[top]
    return 0 if top.startswith("_") or top in ("config", "errors") else None


def _service_part(name: str, modules: dict[str, Module]) -> str | None:
    """``protocol``, ``dispatcher``, ``worker``, ``client`` or ``(wiring)`` for a module of
    ``service``; None outside it."""
    parts = name.split(".")
    if len(parts) < 2 or parts[1] != "service":
        return None
    if len(parts) == 2 or not modules.get(".".join(parts[:3]), Module("", Path(), False)).is_package:
        return "(wiring)"
    return parts[2]


def violations(root: Path) -> list[str]:
    """Every import under ``root`` that breaks a rule, as ``path:line (where) what``."""
    modules = find_modules(root)
    bad = []
    for module in modules.values():
        src, src_part = _top(module.name), _service_part(module.name, modules)
        rel = module.path.relative_to(root)
        for imp in imports_of(module, modules):
            t = imp.target
            at = f"{rel}:{imp.line} ({imp.where})"
            if src == "data" and (t == "distributed" or t.startswith("distributed.")):
                bad.append(f"{at} data imports {t}")
                continue
            if t != PKG and not t.startswith(PKG + "."):
                continue
            dst = _top(t)
            if dst == src:
                dst_part = _service_part(t, modules)
                if src_part is None or dst_part is None or dst_part == src_part:
                    continue
                rs, rd = SERVICE_RANKS.get(src_part), SERVICE_RANKS.get(dst_part)
                if rs is None or rd is None:
                    bad.append(f"{at} {module.name} -> {t}: unranked part of service")
                elif rd >= rs:
                    bad.append(f"{at} {module.name} -> {t}: service.{src_part} (rank {rs}) "
                               f"may not import service.{dst_part} (rank {rd})")
                continue
            rs, rd = _rank(src), _rank(dst)
            if rs is None or rd is None:
                bad.append(f"{at} {module.name} -> {t}: unranked package")
            elif rd >= rs:
                bad.append(f"{at} {module.name} -> {t}: {src} (rank {rs}) may not import "
                           f"{dst} (rank {rd})")
    return sorted(bad)


def cycles(root: Path) -> list[list[str]]:
    """Import cycles among the modules of one package (each cycle once, as a path)."""
    modules = find_modules(root)
    graph: dict[str, set[str]] = {}
    for module in modules.values():
        graph[module.name] = {
            imp.target for imp in imports_of(module, modules)
            if imp.target in modules and imp.target != module.name
            and modules[imp.target].package == module.package
        }
    found: list[list[str]] = []
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            found.append(path[path.index(name):] + [name])
            return
        state[name] = "visiting"
        for dep in sorted(graph[name]):
            visit(dep, path + [name])
        state[name] = "done"

    for name in sorted(graph):
        visit(name, [])
    return found


# -- the package --------------------------------------------------------------------------


def test_every_import_runs_downward():
    assert violations(ROOT) == []


def test_no_import_cycle_inside_any_package():
    assert cycles(ROOT) == []


def test_every_top_level_name_and_service_part_has_a_rank():
    modules = find_modules(ROOT)
    assert {_top(m) for m in modules if _rank(_top(m)) is None} == set()
    parts = {_service_part(m, modules) for m in modules} - {None}
    assert parts == set(SERVICE_RANKS), parts


def test_the_rules_see_the_kinds_of_import_the_package_uses():
    """The walk finds function-level imports and leaves TYPE_CHECKING ones out (the dispatcher
    plugin awaits hooks instead of importing the dashboard: no import of it at all)."""
    modules = find_modules(ROOT)
    plugin = imports_of(modules[f"{PKG}.service.dispatcher.plugin"], modules)
    assert not [i for i in plugin if i.target.startswith(f"{PKG}.dashboard")]
    assert not [i for i in plugin if i.target.startswith(f"{PKG}.service.worker")]
    root = imports_of(modules[PKG], modules)
    assert Import(f"{PKG}.dashboard", _line_of(modules[PKG], "from .dashboard import attach"),
                  "function") in root


def _line_of(module: Module, text: str) -> int:
    (line,) = [i for i, t in enumerate(module.path.read_text().splitlines(), 1) if text in t]
    return line


# -- the rules catch what they should (a synthetic package in tmp_path) -------------------


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / PKG / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for d in [p for p in (root / PKG).rglob("*") if p.is_dir()] + [root / PKG]:
        (d / "__init__.py").touch()
    return root


def test_violations_are_reported(tmp_path):
    root = _tree(tmp_path, {
        "errors.py": "",
        "config.py": "from . import errors\n",  # foundations are siblings
        "data/ops.py": """\
            from typing import TYPE_CHECKING

            from ..errors import X  # down: fine

            if TYPE_CHECKING:
                from ..service.client import Client  # annotations only: fine

            def run():
                import distributed
                from ..service import client
            """,
        "ps/strategy.py": "from ..service.client import distribute\n",  # sideways
        "service/servers.py": "from .dispatcher import plugin\n",  # wiring: fine
        "service/client/__init__.py": "from ..protocol.messages import Reply\n",  # fine
        "service/protocol/messages.py": "from ..dispatcher import state\n",  # upward
        "service/dispatcher/state.py": "from ..protocol import messages\n",  # fine
        "service/dispatcher/plugin.py": """\
            async def start(scheduler):
                from ..worker.plugin import DataWorkerPlugin
                from ...dashboard import attach
            """,
        "service/worker/plugin.py": "from .. import servers\n",  # into the wiring
        "dashboard/__init__.py": "from ..service.client import status\n",  # down: fine
    })
    assert violations(root) == sorted([
        "dask_dataservice/config.py:1 (module) dask_dataservice.config -> "
        "dask_dataservice.errors: config (rank 0) may not import errors (rank 0)",
        "dask_dataservice/data/ops.py:9 (function) data imports distributed",
        "dask_dataservice/data/ops.py:10 (function) dask_dataservice.data.ops -> "
        "dask_dataservice.service.client: data (rank 1) may not import service (rank 2)",
        "dask_dataservice/ps/strategy.py:1 (module) dask_dataservice.ps.strategy -> "
        "dask_dataservice.service.client: ps (rank 2) may not import service (rank 2)",
        "dask_dataservice/service/protocol/messages.py:1 (module) "
        "dask_dataservice.service.protocol.messages -> dask_dataservice.service.dispatcher.state"
        ": service.protocol (rank 0) may not import service.dispatcher (rank 1)",
        "dask_dataservice/service/dispatcher/plugin.py:2 (function) "
        "dask_dataservice.service.dispatcher.plugin -> dask_dataservice.service.worker.plugin"
        ": service.dispatcher (rank 1) may not import service.worker (rank 1)",
        "dask_dataservice/service/dispatcher/plugin.py:3 (function) "
        "dask_dataservice.service.dispatcher.plugin -> dask_dataservice.dashboard: "
        "service (rank 2) may not import dashboard (rank 3)",
        "dask_dataservice/service/worker/plugin.py:1 (module) "
        "dask_dataservice.service.worker.plugin -> dask_dataservice.service.servers"
        ": service.worker (rank 1) may not import service.(wiring) (rank 2)",
    ])


def test_a_downward_tree_passes_and_an_unranked_package_does_not(tmp_path):
    root = _tree(tmp_path, {"errors.py": "", "data/ops.py": "from ..errors import X\n",
                            "cli.py": "from .data import ops\nfrom . import errors\n"})
    assert violations(root) == []
    (root / PKG / "extra.py").write_text("from .cli import main\n")
    (root / PKG / "data" / "io.py").write_text("def f():\n    from ..extra import y\n")
    assert violations(root) == [
        "dask_dataservice/data/io.py:2 (function) dask_dataservice.data.io -> "
        "dask_dataservice.extra: unranked package",
        "dask_dataservice/extra.py:1 (module) dask_dataservice.extra -> dask_dataservice.cli: "
        "unranked package",
    ]


def test_cycles_are_reported(tmp_path):
    root = _tree(tmp_path, {
        "ps/a.py": "from . import b\n",
        "ps/b.py": "def f():\n    from .c import g\n",  # a function-level import counts
        "ps/c.py": "from .a import x\n",
        "ps/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import e\n",
        "ps/e.py": "from . import d\n",  # d -> e only for annotations: no cycle
        "data/x.py": "from ..ps import a\n",  # across packages: the ranks' business
    })
    assert cycles(root) == [["dask_dataservice.ps.a", "dask_dataservice.ps.b",
                             "dask_dataservice.ps.c", "dask_dataservice.ps.a"]]


# -- parameter-server training: stricter than its rank -----------------------------------


def _ps_modules() -> dict[str, Module]:
    prefix = f"{PKG}.ps."
    return {name[len(prefix):]: m for name, m in find_modules(ROOT).items()
            if name.startswith(prefix) and "." not in name[len(prefix):]}


def _ps_order() -> list[str]:
    """The ps modules in dependency order (each after what it imports)."""
    modules, ps = find_modules(ROOT), _ps_modules()
    prefix = f"{PKG}.ps."
    graph = {short: {i.target[len(prefix):] for i in imports_of(m, modules)
                     if i.target.startswith(prefix)} & set(ps) for short, m in ps.items()}
    order: list[str] = []

    def visit(name: str) -> None:
        if name not in order:
            for dep in sorted(graph[name] - {name}):
                visit(dep)
            order.append(name)

    for name in sorted(graph):
        visit(name)
    return order


def test_ps_import_order():
    order = _ps_order()
    assert order.index("_types") < order.index("_kernels") < order.index("server")
    assert order.index("variables") < order.index("optimizers")  # not the other way round
    assert order.index("strategy") < order.index("coordinator")


@pytest.mark.parametrize("module", sorted(_ps_modules()))
def test_ps_takes_only_the_foundations_from_the_rest_of_the_package(module):
    modules = find_modules(ROOT)
    other = {_top(i.target) for i in imports_of(_ps_modules()[module], modules)
             if i.target.startswith(PKG + ".") and _top(i.target) != "ps"}
    allowed = {"config", "_rpc", "_async", "_tqdm", "_wire", "errors"}
    assert other <= allowed, f"ps.{module} imports {sorted(other - allowed)}"


def test_ps_server_does_not_import_client_side_optimizers():
    modules = find_modules(ROOT)
    targets = {i.target for i in imports_of(_ps_modules()["server"], modules)}
    assert f"{PKG}.ps.optimizers" not in targets


def test_modules_are_small():
    sizes = {name: len(m.path.read_text().splitlines()) for name, m in find_modules(ROOT).items()}
    assert {name: n for name, n in sizes.items() if n >= 800} == {}


@pytest.mark.process
def test_each_ps_module_imports_alone_in_dependency_order():
    code = "; ".join(f"import {PKG}.ps.{m}" for m in _ps_order())
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
