"""A process's stderr cut into log records, and the records known not to be this package's.

Standard library only: ``tests/project/first_hour.py`` imports it in a venv that has the built
wheel and no test dependencies.
"""

from __future__ import annotations

import re

#: distributed's record when a batched comm closes at shutdown (a traceback may follow).
BATCHED_CLOSED = "distributed.batched - INFO - Batched Comm Closed"
#: distributed's record when a worker's heartbeat meets a closing scheduler at exit
#: (dask/distributed#7105, open upstream; ``Worker.close`` stops its heartbeat last).
HEARTBEAT_AT_EXIT = "Failed to communicate with scheduler during heartbeat."
KNOWN_NOISE = (BATCHED_CLOSED, HEARTBEAT_AT_EXIT)
_RECORD_START = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} - ", re.MULTILINE)


def log_records(text: str) -> list[str]:
    """``text`` (a process's stderr) cut into log records: each from a line that starts with
    logging's timestamp to the next one, with the traceback lines it carries."""
    starts = [m.start() for m in _RECORD_START.finditer(text)]
    if not starts or starts[0] != 0:
        starts.insert(0, 0)
    return [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]


def unexpected_tracebacks(text: str) -> bool:
    """Whether ``text`` holds a traceback outside the records of :data:`KNOWN_NOISE` (a
    traceback printed right after such a record, with no record of its own, reads as its
    continuation: a crashed script still fails by its exit code)."""
    return any("Traceback" in r and not any(n in r.split("\n", 1)[0] for n in KNOWN_NOISE)
               for r in log_records(text))
