"""A data worker that survives scheduler restarts: ``dask-dataservice worker --supervise``.

A Dask worker (with or without its nanny) exits when its scheduler goes away and never
reconnects (see dask/distributed#6361). For a fault-tolerant dispatcher that is restarted in
place, the workers must come back by themselves: :func:`supervise` runs the ``dask worker``
command line (every Dask option passes through: ``--nworkers``, ``--resources``, ``--tls-*``,
...) as a child process, and starts it again each time it ends cleanly (exit code 0: its
scheduler went away). The fresh ``dask worker`` waits until the scheduler is reachable, then
registers. ``dask-dataservice worker --supervise`` runs the child with ``--worker-class
dask_dataservice.service.worker.ReconnectingWorker`` (:mod:`._reconnect`): that worker rides
out a scheduler restart with its data tasks and does not exit, so a restart of the child is
the fallback (a worker that had to close, e.g. one holding Dask tasks).

A child that fails (non-zero exit code) is started again too when it had been up a while, or
until it has failed three times in a row soon after its start: a scheduler
that goes away while a nanny is still registering makes ``dask worker`` fail ("Nanny failed to
start"), and that worker must come back as well. A usage error (exit code 2, e.g. a bad option)
and a child that keeps failing at once end the supervisor with the child's code. A child that
ends soon after its start is restarted with a growing delay (so ``dask worker --version``
cannot turn into a busy loop).

SIGTERM or SIGINT to the supervisor is passed to the child (which runs in its own process
group, so that Ctrl-C on a terminal reaches it once); the supervisor returns the child's exit
code once it has ended. A signal that arrives while a new child is being started (the handler
still sees the old, ended one) is passed to the new child once it is known: exactly once, as
the signals wait while the supervisor records the new child. On Linux the child also gets SIGTERM when the supervisor dies in any
other way (SIGKILL, a crash): a ``dask worker`` never outlives its supervisor, which would leave
it retrying a scheduler forever, or joining whatever scheduler takes that port next. :class:`~.servers.WorkerSupervisor` is the in-process
counterpart, for ``WorkerServer``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

__all__ = ["supervise"]

#: A child that ran this long before it ended counts as "was up": restart it at once.
_STABLE_SECONDS = 10.0
#: Delay before restarting a child that ended sooner: doubles each time, up to the max.
_DELAY_MIN, _DELAY_MAX = 0.1, 10.0
#: A child that failed (non-zero exit) this many times in a row, each soon after its start,
#: ends the supervisor: it is broken, not interrupted.
_QUICK_FAILURES_MAX = 3
#: Exit code of a command-line usage error (click's, argparse's): never retried.
_USAGE_ERROR = 2


def _die_with_parent(parent_pid: int) -> None:
    """In the child, before exec (Linux): SIGTERM when the supervisor dies (PR_SET_PDEATHSIG)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the supervisor died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGTERM and SIGINT wait (and ``forward`` with them) until the block ends."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def supervise(cmd: Sequence[str], env: Mapping[str, str] | None = None, *,
              announce: Callable[[str], None] | None = None) -> int:
    """Run ``cmd`` and run it again each time it ends (module docstring), until SIGTERM/SIGINT.

    ``announce(message)`` (default: print on stderr) hears about each (re)start.
    Must run in the main thread (it installs the signal handlers, and restores them).
    """
    if announce is None:
        def announce(message: str) -> None:
            print(f"dataservice worker supervisor: {message}", file=sys.stderr, flush=True)

    stop = threading.Event()
    child: list[subprocess.Popen[bytes]] = []
    received: list[int] = []

    def forward(signum: int, frame: object) -> None:
        stop.set()
        received[:] = [signum]
        if child and child[0].poll() is None:
            child[0].send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        delay, starts, quick_failures = _DELAY_MIN, 0, 0
        while not stop.is_set():
            started = time.monotonic()
            # its own process group: Ctrl-C on a terminal reaches the supervisor only, which
            # passes it on once (a second signal would cut the worker's graceful close short)
            proc = subprocess.Popen(
                list(cmd), env=None if env is None else dict(env), process_group=0,
                preexec_fn=(functools.partial(_die_with_parent, os.getpid())
                            if sys.platform.startswith("linux") else None))
            with _signals_held():
                child[:] = [proc]
                if stop.is_set():  # it came while the child started: `forward` saw the old one
                    proc.send_signal(received[0])
            starts += 1
            announce(f"started `dask worker` (pid {child[0].pid})" if starts == 1 else
                     f"the worker ended; started a new one (pid {child[0].pid}, restart "
                     f"{starts - 1})")
            rc = child[0].wait()
            if stop.is_set() or rc == _USAGE_ERROR:
                return rc
            stable = time.monotonic() - started >= _STABLE_SECONDS
            quick_failures = 0 if rc == 0 or stable else quick_failures + 1
            if quick_failures >= _QUICK_FAILURES_MAX:
                announce(f"the worker failed {quick_failures} times in a row at its start "
                         f"(exit code {rc}); giving up")
                return rc
            if rc != 0:
                announce(f"the worker failed (exit code {rc}); starting it again")
            if stable:
                delay = _DELAY_MIN
            else:  # ended at once: wait (an event wait: a signal ends it early)
                stop.wait(delay)
                delay = min(2 * delay, _DELAY_MAX)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if child and child[0].poll() is None:  # an error of ours: do not leave it behind
            child[0].terminate()
            child[0].wait()
