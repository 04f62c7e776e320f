"""The ``dask-dataservice`` command line.

Subcommands are registered with :func:`command`: each is a function that receives the
parsed :class:`argparse.Namespace` and returns an exit code, plus an optional function that
adds its arguments to its sub-parser. Adding a subcommand (``scheduler``, ``worker``, a
cluster ``demo``) is one decorated function and nothing else::

    def _scheduler_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--port", type=int, default=8786)

    @command("scheduler", help="start a Dask scheduler with the dispatcher", args=_scheduler_args)
    def _scheduler(args: argparse.Namespace) -> int:
        ...
        return 0

Heavy imports (numpy, the pipeline library, distributed) happen inside the subcommand, so
``dask-dataservice --help`` and ``dask-dataservice version`` stay fast.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TextIO

__all__ = ["main", "command"]

PROG = "dask-dataservice"
DIST_NAME = "dask-dataservice"


@dataclass(frozen=True)
class _Command:
    name: str
    help: str
    run: Callable[[argparse.Namespace], int]
    args: Callable[[argparse.ArgumentParser], None] | None


#: ``{name: _Command}`` in registration order; this is the order ``--help`` lists them in.
_COMMANDS: dict[str, _Command] = {}


def command(
    name: str,
    *,
    help: str,
    args: Callable[[argparse.ArgumentParser], None] | None = None,
) -> Callable[[Callable[[argparse.Namespace], int]], Callable[[argparse.Namespace], int]]:
    """Register ``fn(args) -> exit code`` as the subcommand ``name``."""

    def register(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        if name in _COMMANDS:
            raise ValueError(f"subcommand {name!r} is registered twice")
        _COMMANDS[name] = _Command(name=name, help=help, run=fn, args=args)
        return fn

    return register


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="tf.data service and parameter-server training on Dask.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cmd in _COMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        if cmd.args is not None:
            cmd.args(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(run(args) or 0)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


# Helpers
#########


def package_version() -> str:
    """The installed version of the ``dask-dataservice`` distribution."""
    from importlib import metadata

    try:
        return metadata.version(DIST_NAME)
    except metadata.PackageNotFoundError:  # running from a source tree that is not installed
        import dask_dataservice

        return getattr(dask_dataservice, "__version__", "unknown")


def _positive_int(text: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _si(x: float) -> str:
    """``1234567`` -> ``'1.23M'``."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


class Progress:
    """A minimal progress bar on a text stream.

    On a terminal it redraws one line in place, at most ``max_hz`` times a second. On anything
    else (a pipe, a CI log, a file) it prints one line at each quarter of the way and nothing
    in between, so logs do not fill up with carriage returns.
    """

    def __init__(
        self,
        total: int,
        *,
        stream: TextIO | None = None,
        label: str = "",
        unit: str = "el",
        max_hz: float = 10.0,
        width: int = 30,
    ) -> None:
        self.total = max(int(total), 1)
        self.stream = stream if stream is not None else sys.stderr
        self.label = label
        self.unit = unit
        self.width = width
        self.count = 0
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self._min_interval = 1.0 / max_hz
        self._start = time.perf_counter()
        self._last_draw = float("-inf")
        self._next_milestone = 1  # in quarters, for non-terminal output
        self._last_len = 0

    def update(self, n: int = 1) -> None:
        self.count += n
        if self.tty:
            now = time.perf_counter()
            if now - self._last_draw >= self._min_interval:
                self._last_draw = now
                self._draw(now, end="\r")
        else:
            while self._next_milestone <= 4 and self.count * 4 >= self._next_milestone * self.total:
                self._next_milestone += 1
                self._draw(time.perf_counter(), end="\n")

    def close(self) -> None:
        if self.tty:
            self._draw(time.perf_counter(), end="\n")
        elif self._next_milestone <= 4:  # stopped early: say where
            self._draw(time.perf_counter(), end="\n")

    def _draw(self, now: float, end: str) -> None:
        frac = min(self.count / self.total, 1.0)
        filled = int(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = now - self._start
        rate = self.count / elapsed if elapsed > 0 else 0.0
        prefix = f"{self.label} " if self.label else ""
        line = (
            f"{prefix}[{bar}] {frac:4.0%} {self.count}/{self.total} "
            f"{_si(rate)} {self.unit}/s {elapsed:.1f}s"
        )
        if self.tty:  # blank out what is left of a longer previous line
            line, self._last_len = line.ljust(self._last_len), len(line)
        self.stream.write(line + end)
        self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# demo
######

#: Shape of the synthetic click-through data, loosely after the Criteo display-ads layout.
_DENSE_FEATURES = 13
_SPARSE_FEATURES = 26
_VOCAB_SIZE = 100_000


def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--elements",
        type=_positive_int,
        default=500_000,
        metavar="N",
        help="number of synthetic examples (rows) to generate (default: %(default)s)",
    )
    p.add_argument(
        "--batch-size",
        type=_positive_int,
        default=256,
        metavar="B",
        help="examples per batch (default: %(default)s)",
    )
    p.add_argument(
        "--shuffle-buffer",
        type=_positive_int,
        default=10_000,
        metavar="S",
        help="shuffle buffer size, in examples (default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")


def make_click_dataset(
    n: int, *, batch_size: int = 256, shuffle_buffer: int = 10_000, seed: int = 0
):
    """A synthetic click-through pipeline: slices → shuffle → batch → preprocess → prefetch.

    Each example is a dict with ``dense`` (13 float32 features, log-normal like counts),
    ``sparse`` (26 categorical ids) and ``label`` (0/1, about 3% positives). Batches come out
    with ``dense`` log-transformed and ``sparse`` hashed into ``_VOCAB_SIZE`` buckets.
    """
    import numpy as np

    from dask_dataservice.data import AUTOTUNE, Dataset

    rng = np.random.default_rng(seed)
    columns = {
        "dense": rng.lognormal(mean=1.0, sigma=1.5, size=(n, _DENSE_FEATURES)).astype(np.float32),
        "sparse": rng.integers(0, 2**31 - 1, size=(n, _SPARSE_FEATURES), dtype=np.int64),
        "label": (rng.random(n) < 0.03).astype(np.int8),
    }

    def preprocess(batch):
        return {
            "dense": np.log1p(batch["dense"]),
            "sparse": batch["sparse"] % _VOCAB_SIZE,
            "label": batch["label"].astype(np.float32),
        }

    return (
        Dataset.from_tensor_slices(columns)
        .shuffle(shuffle_buffer, seed=seed)
        .batch(batch_size)
        .map(preprocess, num_parallel_calls=AUTOTUNE)
        .prefetch(2)
    )


@command("demo", help="run a synthetic click-through input pipeline locally", args=_demo_args)
def _demo(args: argparse.Namespace) -> int:
    n = args.elements
    ds = make_click_dataset(
        n, batch_size=args.batch_size, shuffle_buffer=args.shuffle_buffer, seed=args.seed
    )
    if not args.quiet:
        print(
            f"demo: {n} examples -> shuffle({args.shuffle_buffer}) -> batch({args.batch_size})"
            " -> map(preprocess) -> prefetch(2)",
            file=sys.stderr,
        )

    count, batches, elapsed = _consume(ds, n, quiet=args.quiet)
    if count != n:
        print(f"demo: expected {n} elements, the pipeline produced {count}", file=sys.stderr)
        return 1
    rate = count / elapsed if elapsed > 0 else float("inf")
    print(f"demo: {count} elements in {elapsed:.2f} s ({rate:.0f} elements/s)")
    if not args.quiet:
        print(f"demo: {batches} batches of up to {args.batch_size}", file=sys.stderr)
    return 0


def _consume(ds, total: int, *, quiet: bool) -> tuple[int, int, float]:
    """Iterate ``ds`` (batches of dicts); return ``(rows, batches, seconds)``."""
    count = batches = 0
    start = time.perf_counter()
    it: Iterator = iter(ds)
    if quiet:
        for batch in it:
            count += len(batch["label"])
            batches += 1
    else:
        with Progress(total, label="demo") as bar:
            for batch in it:
                rows = len(batch["label"])
                count += rows
                batches += 1
                bar.update(rows)
    return count, batches, time.perf_counter() - start


# version
#########


def _version_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="also print Python and the versions of the main dependencies",
    )


@command("version", help="print the installed version", args=_version_args)
def _version(args: argparse.Namespace) -> int:
    print(f"{DIST_NAME} {package_version()}")
    if args.verbose:
        import platform
        from importlib import metadata

        print(f"python {platform.python_version()}")
        for dist in ("dask", "distributed", "numpy", "zarr", "cloudpickle", "msgpack"):
            try:
                print(f"{dist} {metadata.version(dist)}")
            except metadata.PackageNotFoundError:
                print(f"{dist} (not installed)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
