"""Run the ``pycon`` blocks of a documentation page as one doctest, in this process.

Usage: ``python docs/run_doctests.py docs/tf-examples.md``. The blocks are joined in page
order and parsed by :mod:`doctest`, with each example's line number kept, so a failure names
the line of the page. Exit status 0 when every example printed what the page shows.
"""

from __future__ import annotations

import doctest
import re
import sys
from pathlib import Path

FENCE = re.compile(r"^```pycon[ \t]*\n(?P<code>.*?)^```[ \t]*$", re.M | re.S)
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def page_doctest(path: Path) -> doctest.DocTest:
    """One :class:`doctest.DocTest` of every ``pycon`` block of ``path``."""
    text = path.read_text()
    examples: list[doctest.Example] = []
    parser = doctest.DocTestParser()
    for m in FENCE.finditer(text):
        first = text.count("\n", 0, m.start("code"))
        for ex in parser.get_examples(m.group("code"), name=str(path)):
            ex.lineno += first
            examples.append(ex)
    if not examples:
        raise SystemExit(f"{path}: no ```pycon block")
    return doctest.DocTest(examples, {"__name__": "__main__"}, path.stem, str(path), 0, text)


def main(argv: list[str]) -> int:
    failed = 0
    for name in argv or ["docs/tf-examples.md"]:
        runner = doctest.DocTestRunner(optionflags=FLAGS)
        result = runner.run(page_doctest(Path(name)))
        print(f"{name}: {result.attempted} examples, {result.failed} failed")
        failed += result.failed
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
