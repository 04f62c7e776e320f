"""Run the Python examples of the documentation, page by page, each page as a script.

Usage (from the repository root)::

    .venv/bin/python docs/run_examples.py                 # every page in docs/, and README.md
    .venv/bin/python docs/run_examples.py docs/data-service.md --show
    .venv/bin/python docs/run_examples.py docs/pipelines.md --write-to /tmp/pages   # keep the .py

The ```` ```python ```` blocks of a page are written, in order, into one ``.py`` file in a
temporary folder, and that file runs with ``python file.py`` in a fresh interpreter: exactly
what a reader gets who saves the page's code as a script. The pages say so ("the examples on
this page run in order"). A script matters: a Dask cluster of worker processes starts them with
multiprocessing's ``spawn``, which imports the script again in every worker process (as
``__mp_main__``), so code that starts such a cluster at the top level, without an
``if __name__ == "__main__":`` guard, fails there ("Nanny failed to start").

Each block keeps its line number: the script is padded with blank lines so that line N of the
script is line N of the page, and a traceback points at the page. A ```` ```python ```` block
that is not meant to run (a sketch, a fragment of a larger program) says so on its first line,
``# not run: <why>``; it is left out of the script, and tests/project/test_docs.py fails a page
whose blocks neither run nor carry the marker with a reason. Shell sessions are ```` ```sh ````,
output is ```` ```text ````.

With ``--show`` the value of each block's last top-level expression is printed next to its line
number, to compare with the results the page states in comments. Exit code 1 if any page fails.

This file is not part of the Sphinx build (only ``.md`` files are sources).
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
#: the first line of a ```python block that is not run, followed by the reason
NOT_RUN = re.compile(r"^# not run:(?P<why>.*)$")
#: the name of the helper ``--show`` defines on the script's first line
SHOW = "__show_block_value__"


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """``(first line number, code)`` of each ```` ```python ```` block of a Markdown file."""
    text = path.read_text(encoding="utf-8")
    return [
        (text.count("\n", 0, m.start("code")) + 1, textwrap.dedent(m.group("code")))
        for m in FENCE.finditer(text)
    ]


def not_run_reason(code: str) -> str | None:
    """The reason a block gives for not running (its ``# not run: <why>`` first line), or None.
    An empty reason is ``""``: the caller refuses it."""
    first = code.lstrip("\n").split("\n", 1)[0].strip()
    m = NOT_RUN.match(first)
    return None if m is None else m.group("why").strip()


def _show_last_expression(code: str, line: int) -> str:
    """``code`` with its last top-level expression wrapped in the ``--show`` helper (same lines)."""
    tree = ast.parse(code)
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return code
    node = tree.body[-1].value
    lines = [s.encode() for s in code.split("\n")]  # ast's column offsets count UTF-8 bytes
    first, last = node.lineno - 1, node.end_lineno - 1  # type: ignore[operator]
    end, start = node.end_col_offset, node.col_offset
    # close first (a single-line expression has first == last): the start's offset stays valid
    lines[last] = lines[last][:end] + b"))" + lines[last][end:]
    lines[first] = (lines[first][:start] + f"{SHOW}({line + node.lineno - 1}, (".encode()
                    + lines[first][start:])
    return "\n".join(s.decode() for s in lines)


def page_script(path: Path, show: bool = False) -> str:
    """The page's runnable blocks as one script, each at its own line number."""
    out: list[str] = []
    if show:
        out.append(f"def {SHOW}(line, value): print(f'{path.name}:{{line}}: {{value!r}}')")
    for line, code in python_blocks(path):
        if not_run_reason(code) is not None:
            continue
        ast.parse(code, filename=f"{path}:{line}")  # a syntax error names the page's block
        if show:
            code = _show_last_expression(code, line)
        if len(out) > line - 1:  # cannot happen: fences take a line each
            raise AssertionError(f"{path}:{line}: blocks overlap")
        out.extend([""] * (line - 1 - len(out)))
        out.extend(code.rstrip("\n").split("\n"))
    return "\n".join(out) + "\n"


def write_script(path: Path, folder: Path, show: bool = False) -> Path:
    """Write :func:`page_script` of ``path`` to ``folder/page_<page>.py``; return the file
    (the prefix keeps a page named after a module, ``keras.md``, from shadowing it)."""
    script = folder / f"page_{path.stem.replace('-', '_')}.py"
    script.write_text(page_script(path, show), encoding="utf-8")
    return script


def run_page(path: Path, folder: Path, show: bool = False, timeout: float | None = None) -> int:
    """Run the page's script with ``python file.py`` from the repository root; its exit code."""
    script = write_script(path, folder, show)
    return subprocess.call([sys.executable, str(script)], cwd=ROOT, timeout=timeout)


def default_pages() -> list[Path]:
    return sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("pages", nargs="*", type=Path, help="Markdown files (default: all)")
    parser.add_argument("--show", action="store_true", help="print each block's last value")
    parser.add_argument("--write-to", type=Path, help="keep the scripts in this folder")
    args = parser.parse_args(argv)
    failed = []
    with tempfile.TemporaryDirectory(prefix="dds-pages-") as tmp:
        folder = args.write_to or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for page in [p.resolve() for p in args.pages] or default_pages():
            if not python_blocks(page):
                continue
            t0 = time.perf_counter()
            rc = run_page(page, folder, args.show)
            status = "ok" if rc == 0 else f"FAILED ({rc})"
            name = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
            print(f"{name}: {status} in {time.perf_counter() - t0:.1f} s", flush=True)
            if rc:
                failed.append(page)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
