"""The notebooks under ``notebooks/`` are valid nbformat 4 and their code cells run.

No Jupyter here: each notebook's code cells are executed in order with ``exec``, in one
namespace that stands for the kernel's ``__main__`` (so functions defined in cells are
pickled by value, as in a notebook). The quickstart starts its own small ``LocalCluster``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"

pytestmark = pytest.mark.timeout(60)


def _load(name: str) -> dict:
    return json.loads((NOTEBOOKS / name).read_text(encoding="utf-8"))


def _source(cell: dict) -> str:
    src = cell["source"]
    return src if isinstance(src, str) else "".join(src)


def _check_nbformat4(nb: dict) -> None:
    """The parts of the nbformat 4 schema that Jupyter refuses to open a notebook without."""
    assert nb["nbformat"] == 4 and isinstance(nb["nbformat_minor"], int)
    assert nb["metadata"]["kernelspec"]["language"] == "python"
    ids = set()
    for cell in nb["cells"]:
        assert cell["cell_type"] in {"markdown", "code", "raw"}, cell
        assert isinstance(cell["metadata"], dict)
        assert isinstance(cell["source"], (str, list))
        if nb["nbformat_minor"] >= 5:
            assert cell["id"] not in ids, f"duplicate cell id {cell['id']}"
            ids.add(cell["id"])
        if cell["cell_type"] == "code":
            # stored without outputs: the notebook is a source file
            assert cell["outputs"] == [] and cell["execution_count"] is None, cell


def _run_code_cells(nb: dict) -> dict:
    namespace: dict = {"__name__": "__main__"}
    try:
        for i, cell in enumerate(nb["cells"]):
            if cell["cell_type"] != "code":
                continue
            code = compile(_source(cell), f"<cell {i}>", "exec")
            exec(code, namespace)
    finally:
        # a failing cell must not leave the cluster running
        for name in ("client", "cluster"):
            obj = namespace.get(name)
            if obj is not None and getattr(obj, "status", None) not in (None, "closed"):
                obj.close()
    return namespace


def test_every_notebook_is_valid_nbformat4():
    notebooks = sorted(NOTEBOOKS.glob("*.ipynb"))
    assert notebooks, "no notebooks found"
    for path in notebooks:
        _check_nbformat4(json.loads(path.read_text(encoding="utf-8")))


def test_quickstart_runs():
    nb = _load("quickstart.ipynb")
    ns = _run_code_cells(nb)
    # DYNAMIC: every row once; OFF: every row once per worker
    assert ns["rows"] == len(ns["features"]) == 10_000
    assert len(ns["values"]) == 2 * 1000
    # the named job: two consumers, each element once between them
    assert len(ns["part_a"]) + len(ns["part_b"]) == 2000
    assert ns["client"].status == "closed"
