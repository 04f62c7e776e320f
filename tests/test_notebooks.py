"""The notebooks under ``notebooks/`` are valid nbformat 4 and run in a real Jupyter kernel.

Each notebook is executed with nbclient in an ipykernel kernel, as Jupyter runs it: every
cell inside the kernel's own running event loop (which ``exec()`` could not show: the data
service's blocking calls used to refuse any running loop). Any cell error fails the test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"

pytestmark = pytest.mark.timeout(180)


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


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


def _execute(path: Path, report: str | None = None) -> tuple[object, dict | None]:
    """Run every cell in a fresh ipykernel; optionally run ``report`` (code printing one
    JSON line) before the last cell, and return what it printed."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.reads(path.read_text(encoding="utf-8"), as_version=4)
    if report is not None:
        nb.cells.insert(len(nb.cells) - 1, nbformat.v4.new_code_cell(report))
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    values = None
    if report is not None:
        cell = nb.cells[len(nb.cells) - 2]
        text = "".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stdout")
        values = json.loads(text.strip().splitlines()[-1])
    return nb, values


def test_every_notebook_is_valid_nbformat4():
    notebooks = sorted(NOTEBOOKS.glob("*.ipynb"))
    assert notebooks, "no notebooks found"
    for path in notebooks:
        _check_nbformat4(_load(path))


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(p for p in NOTEBOOKS.glob("*.ipynb")
                                         if p.name != "quickstart.ipynb"), ids=lambda p: p.name)
def test_notebook_runs_in_a_real_kernel(path):
    """Every other notebook (the quickstart runs in test_quickstart_results)."""
    _execute(path)


@pytest.mark.slow
def test_quickstart_results():
    report = ("import json; print(json.dumps({'rows': rows, 'features': len(features), "
              "'values': len(values), 'parts': len(part_a) + len(part_b)}))")
    _, values = _execute(NOTEBOOKS / "quickstart.ipynb", report)
    # DYNAMIC: every row once; OFF: every row once per worker
    assert values["rows"] == values["features"] == 10_000
    assert values["values"] == 2 * 1000
    # the named job: two consumers, each element once between them
    assert values["parts"] == 2000
