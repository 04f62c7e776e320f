"""Every Python example in the docs and the README runs, each page as a script
(docs/run_examples.py: the page's ```python blocks in one ``.py`` file, run with
``python file.py``, as a reader who saves them would run them)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _helpers import needs

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs"))
import run_examples  # noqa: E402

PAGES = [
    page for page in [*sorted(p.relative_to(ROOT) for p in (ROOT / "docs").glob("*.md")),
                      Path("README.md")]
    if "```python" in (ROOT / page).read_text(encoding="utf-8")
]

#: optional dependencies a page's code may use, found in its script, and the extra of each
OPTIONAL = {
    "torch": (re.compile(r"\bimport torch\b|\.to_torch\(|\bdds\.torch\b|dask_dataservice\.torch"),
              "torch"),
    "jax": (re.compile(r"\bimport jax\b|\.to_jax\("), "jax"),
    "dask_dataservice.keras": (re.compile(r"\bimport keras\b|\bdds\.keras\b|dask_dataservice\.keras"), "keras"),
}


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("page", PAGES, ids=str)
def test_examples_run_as_a_script(page, tmp_path):
    script = run_examples.write_script(ROOT / page, tmp_path)
    code = script.read_text()
    for module, (pattern, extra) in OPTIONAL.items():
        if pattern.search(code):
            needs(module, extra)
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True,
                          text=True, timeout=140)
    assert proc.returncode == 0, f"{page} as {script.name}:\n" + proc.stdout[-3000:] + \
        proc.stderr[-3000:]


@pytest.mark.pure
@pytest.mark.parametrize("page", PAGES, ids=str)
def test_every_python_block_runs_or_says_why_not(page):
    """A ```python block runs, or its first line is ``# not run: <reason>``; the script keeps
    each block at its page line (a traceback points at the page)."""
    path = ROOT / page
    script = run_examples.page_script(path).split("\n")
    for line, code in run_examples.python_blocks(path):
        why = run_examples.not_run_reason(code)
        if why is not None:
            assert why, f"{page}:{line}: '# not run:' needs a reason"
            continue
        ast.parse(code, filename=f"{page}:{line}")
        first = code.split("\n", 1)[0]
        assert script[line - 1] == first, (page, line)


def _page(tmp_path: Path, body: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text(textwrap.dedent(body))
    return page


@pytest.mark.pure
def test_script_skips_marked_blocks_and_shows_values(tmp_path):
    page = _page(tmp_path, """\
        # A page

        ```python
        x = 2
        x * 3
        ```

        ```python
        # not run: a sketch
        undefined_name()
        ```

        ```python
        x + 1, "é"
        ```
        """)
    script = run_examples.page_script(page)
    assert "undefined_name" not in script
    assert script.split("\n")[3] == "x = 2" and script.split("\n")[13] == 'x + 1, "é"'
    shown = run_examples.page_script(page, show=True)
    proc = subprocess.run([sys.executable, "-c", shown], capture_output=True, text=True,
                          timeout=30)
    assert proc.stdout.splitlines() == ["page.md:5: 6", "page.md:14: (3, 'é')"], proc.stderr


@pytest.mark.pure
def test_a_marker_without_reason_is_refused(tmp_path):
    page = _page(tmp_path, """\
        ```python
        # not run:
        pass
        ```
        """)
    ((line, code),) = run_examples.python_blocks(page)
    assert run_examples.not_run_reason(code) == ""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_page_starting_worker_processes_without_a_guard_fails_as_a_script(tmp_path):
    """What a reader gets who saves such a page: spawn imports the script again in each worker
    process, which starts a cluster of its own there. The runner reports the page failed."""
    page = _page(tmp_path, """\
        ```python
        from distributed import Client, LocalCluster
        cluster = LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0")
        client = Client(cluster)
        ```
        """)
    proc = subprocess.run([sys.executable, str(ROOT / "docs" / "run_examples.py"), str(page)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 1
    assert "page.md: FAILED" in proc.stdout
    assert "Nanny failed to start" in proc.stderr or "freeze_support" in proc.stderr, proc.stderr
