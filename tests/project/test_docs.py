"""Every Python example in the docs and the README runs (docs/run_examples.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]
PAGES = [
    page for page in [*sorted(p.relative_to(ROOT) for p in (ROOT / "docs").glob("*.md")),
                      Path("README.md")]
    if "```python" in (ROOT / page).read_text(encoding="utf-8")
]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("page", PAGES, ids=str)
def test_examples_run(page):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "run_examples.py"), str(page)],
        cwd=ROOT, capture_output=True, text=True, timeout=110,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"{page}: ok" in proc.stdout + proc.stderr
