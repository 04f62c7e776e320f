"""TensorFlow's own examples, ported (docs/tf-examples.md), run as a doctest.

The page holds every code example of the two TensorFlow documents this project re-creates,
with only the imports and the cluster set-up changed; ``docs/run_doctests.py`` runs its
``pycon`` blocks in one process, and every output on the page must be what the code prints.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "tf-examples.md"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tensorflows_examples_run_with_only_imports_and_set_up_changed():
    proc = subprocess.run([sys.executable, "docs/run_doctests.py", str(PAGE.relative_to(ROOT))],
                          cwd=ROOT, capture_output=True, text=True, timeout=110)
    summary = re.search(r"(\d+) examples, (\d+) failed", proc.stdout)
    assert proc.returncode == 0 and summary, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert int(summary[2]) == 0
    assert int(summary[1]) >= 70, summary[0]  # every block was found and run


@pytest.mark.pure
def test_the_page_ports_every_example_of_both_tensorflow_documents():
    """Each example of the seeds is on the page under its own heading, in TensorFlow's order."""
    text = PAGE.read_text()
    headings = [m[1] for m in re.finditer(r"^#+ (.+)$", text, re.M)]
    wanted = ["The module's first example", "`distribute`",
              "`register_dataset` and `from_dataset_id`", "Dynamic sharding",
              "Sharing the service between concurrent trainers",
              "`strategy.experimental_distribute_dataset`",
              "`strategy.distribute_datasets_from_function`",
              "`coordinator.create_per_worker_dataset`"]
    positions = [headings.index(h) for h in wanted]
    assert positions == sorted(positions)
