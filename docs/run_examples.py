"""Run the Python examples of the documentation, page by page.

Usage (from the repository root)::

    .venv/bin/python docs/run_examples.py                 # every page in docs/, and README.md
    .venv/bin/python docs/run_examples.py docs/data-service.md --show

Each page runs in a fresh interpreter: its ```` ```python ```` blocks are executed in order in
one namespace, as the pages say ("the examples on this page run in order"). With ``--show`` the
value of each block's last expression is printed next to its line number, to compare with the
results the page states in comments. Exit code 1 if any page fails.

This file is not part of the Sphinx build (only ``.md`` files are sources).
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """``(first line number, code)`` of each ```` ```python ```` block of a Markdown file."""
    text = path.read_text(encoding="utf-8")
    return [
        (text.count("\n", 0, m.start("code")) + 1, textwrap.dedent(m.group("code")))
        for m in FENCE.finditer(text)
    ]


def run_page(path: Path, show: bool) -> None:
    """Execute the blocks of one page (in this process)."""
    namespace: dict = {"__name__": "__main__"}
    for line, code in python_blocks(path):
        tree = ast.parse(code, filename=f"{path}:{line}")
        ast.increment_lineno(tree, line - 1)
        last = None
        if show and tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, str(path), "exec"), namespace)
        if last is not None:
            print(f"{path.name}:{line}: {eval(compile(last, str(path), 'eval'), namespace)!r}")


def default_pages() -> list[Path]:
    return sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("pages", nargs="*", type=Path, help="Markdown files (default: all)")
    parser.add_argument("--show", action="store_true", help="print each block's last value")
    parser.add_argument("--page", type=Path, help=argparse.SUPPRESS)  # internal: run one page
    args = parser.parse_args(argv)
    if args.page is not None:
        run_page(args.page, args.show)
        return 0
    failed = []
    for page in [p.resolve() for p in args.pages] or default_pages():
        if not python_blocks(page):
            continue
        t0 = time.perf_counter()
        cmd = [sys.executable, __file__, "--page", str(page)] + (["--show"] if args.show else [])
        rc = subprocess.call(cmd, cwd=ROOT)
        status = "ok" if rc == 0 else f"FAILED ({rc})"
        print(f"{page.relative_to(ROOT)}: {status} in {time.perf_counter() - t0:.1f} s", flush=True)
        if rc:
            failed.append(page)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
