"""The notebooks under ``notebooks/`` are valid nbformat 4 and run in a real Jupyter kernel.

Each notebook is executed with nbclient in an ipykernel kernel, as Jupyter runs it: every
cell inside the kernel's own running event loop (which ``exec()`` could not show: the data
service's blocking calls used to refuse any running loop). Any cell error fails the test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _helpers import needs

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"

pytestmark = [pytest.mark.process, pytest.mark.timeout(180)]


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


#: What each notebook imports beyond the core dependencies, and the extra that installs it
#: (each notebook's first cell names the same extras).
NEEDS = {
    "quickstart.ipynb": {"matplotlib": "notebooks"},
    "parameter-server.ipynb": {"matplotlib": "notebooks"},
    "ps-torch.ipynb": {"torch": "torch"},
    "data-to-torch.ipynb": {"torch": "torch", "matplotlib": "notebooks", "pandas": "notebooks",
                            "pyarrow": "notebooks"},
}


def _kernel_tools():
    return needs("nbformat", "test"), needs("nbclient", "test"), needs("ipykernel", "test")


def _execute(path: Path, report: str | None = None) -> tuple[object, dict | None]:
    """Run every cell in a fresh ipykernel; optionally run ``report`` (code printing one
    JSON line) before the last cell, and return what it printed."""
    nbformat, nbclient, _ = _kernel_tools()
    for module, extra in NEEDS.get(path.name, {}).items():
        needs(module, extra)
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


@pytest.mark.pure
def test_every_notebook_is_valid_nbformat4():
    notebooks = sorted(NOTEBOOKS.glob("*.ipynb"))
    assert notebooks, "no notebooks found"
    for path in notebooks:
        _check_nbformat4(_load(path))


#: Notebooks with a test of their own (below); every other one runs in the generic test.
CHECKED = {"quickstart.ipynb", "parameter-server.ipynb"}


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(p for p in NOTEBOOKS.glob("*.ipynb")
                                         if p.name not in CHECKED), ids=lambda p: p.name)
def test_notebook_runs_in_a_real_kernel(path):
    """Every other notebook (the quickstart runs in test_quickstart_results)."""
    _execute(path)


def _images(nb) -> int:
    """How many PNG images the executed notebook's outputs hold (matplotlib figures)."""
    return sum(1 for cell in nb.cells if cell.cell_type == "code"
               for o in cell.outputs if "image/png" in o.get("data", {}))


@pytest.mark.slow
def test_quickstart_results():
    report = ("import json; print(json.dumps({'rows': rows, 'features': len(features), "
              "'values': len(values), 'parts': len(part_a) + len(part_b), "
              "'streamed': streamed, 'stats': read_stats['elements'], "
              "'per_worker': sum(w['elements'] for w in read_stats['workers'].values()), "
              "'timeline': max(status['timeline']['elements_per_second'])}))")
    nb, values = _execute(NOTEBOOKS / "quickstart.ipynb", report)
    assert _images(nb) >= 1  # throughput over time and elements per worker (one figure)
    # DYNAMIC: every row once; OFF: every row once per worker
    assert values["rows"] == values["features"] == 10_000
    assert values["values"] == 2 * 1000
    # the named job: two consumers, each element once between them
    assert values["parts"] == 2000
    # the dashboard section: the read's stats count every element, per worker too
    assert values["streamed"] == values["stats"] == values["per_worker"] == 600
    assert values["timeline"] > 0


@pytest.mark.slow
def test_parameter_server_notebook():
    report = ("import json; print(json.dumps({'examples': examples_trained, "
              "'steps': len(history), 'first_loss': float(np.mean([r[2] for r in history[:10]])), "
              "'last_loss': float(np.mean([r[2] for r in history[-10:]])), "
              "'last_acc': float(np.mean([r[1] for r in history[-10:]])), "
              "'restored': bool(restored_ok), 'scrambled': scrambled, "
              "'steps_per_second': max(timeline['steps_per_second'])}))")
    nb, values = _execute(NOTEBOOKS / "parameter-server.ipynb", report)
    assert _images(nb) >= 1  # loss, accuracy and steps/s (one figure)
    assert values["examples"] == 40_000  # every example trained on once (DYNAMIC)
    assert values["last_loss"] < values["first_loss"]  # it learns
    assert values["last_acc"] > 0.75
    assert values["steps_per_second"] > 0
    assert values["scrambled"] == 0.0 and values["restored"] is True


@pytest.mark.pure
def test_every_notebook_names_the_extras_it_needs():
    assert set(NEEDS) == {p.name for p in NOTEBOOKS.glob("*.ipynb")}
    for name, modules in NEEDS.items():
        intro = "".join(_load(NOTEBOOKS / name)["cells"][0]["source"])
        for extra in set(modules.values()):
            assert f"'.[{extra}" in intro or f",{extra}]" in intro, (name, extra, intro)


#: A cell that makes the progress bar of ``dds.fit`` and the demo, with ipywidgets hidden
#: (``HIDE``) or not, and prints which tqdm it is and every warning raised.
BAR_CELL = """
import sys, warnings, json
if HIDE:
    sys.modules["ipywidgets"] = None  # as if not installed
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from dask_dataservice._tqdm import interactive, progress_bar_class
    bar = progress_bar_class()(total=3)
    bar.update(3)
    bar.close()
print(json.dumps({"module": type(bar).__mro__[1].__module__, "interactive": interactive(),
                  "warnings": [str(w.message) for w in caught]}))
"""


@pytest.mark.slow
def test_progress_bar_in_a_kernel_without_ipywidgets_warns_nothing():
    """In a real kernel without ipywidgets: tqdm's text bar, no "IProgress not found" warning
    (tqdm.auto's), no bar for ``verbose="auto"``; with ipywidgets (if installed): the widget."""
    nbformat, nbclient, _ = _kernel_tools()
    import importlib.util

    cases = [True] + ([False] if importlib.util.find_spec("ipywidgets") else [])
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(f"HIDE = {hide}\n" + BAR_CELL) for hide in cases]
    nb.metadata["kernelspec"] = {"name": "python3", "language": "python", "display_name": "py"}
    nbclient.NotebookClient(nb, timeout=60, kernel_name="python3").execute()
    for hide, cell in zip(cases, nb.cells, strict=True):
        stderr = "".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stderr")
        stdout = "".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stdout")
        assert "IProgress" not in stderr, stderr
        values = json.loads(stdout.strip().splitlines()[-1])
        assert values["warnings"] == []
        if hide:
            assert values == {"module": "tqdm.std", "interactive": False, "warnings": []}
        else:
            assert values == {"module": "tqdm.notebook", "interactive": True, "warnings": []}
