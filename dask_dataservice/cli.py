"""The ``dask-dataservice`` command line.

Subcommands:

``demo``
    A synthetic click-through input pipeline, streamed through the data service of an
    embedded ``LocalCluster`` (or of an existing cluster with ``--scheduler``), or run in this
    process with ``--local``.
``scheduler`` / ``worker``
    ``dask scheduler`` / ``dask worker`` with ``--preload dask_dataservice``: the way to run
    the data service from a shell. Every other option is passed on to Dask.
``version``
    The installed version (``--verbose``: and those of the main dependencies).

Subcommands are registered with :func:`command`: each is a function that receives the
parsed :class:`argparse.Namespace` and returns an exit code, plus an optional function that
adds its arguments to its sub-parser. Adding a subcommand is one decorated function and
nothing else::

    def _hello_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--name", default="world")

    @command("hello", help="say hello", args=_hello_args)
    def _hello(args: argparse.Namespace) -> int:
        print(f"hello {args.name}")
        return 0

A subcommand registered with ``passthrough=True`` also accepts options it does not know;
they arrive, in order, as ``args.passthrough`` (``scheduler`` and ``worker`` hand them to
Dask).

Heavy imports (numpy, the pipeline library, distributed) happen inside the subcommand, so
``dask-dataservice --help`` and ``dask-dataservice version`` stay fast.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

__all__ = ["main", "command", "make_click_dataset", "dask_command"]

PROG = "dask-dataservice"
DIST_NAME = "dask-dataservice"


@dataclass(frozen=True)
class _Command:
    name: str
    help: str
    run: Callable[[argparse.Namespace], int]
    args: Callable[[argparse.ArgumentParser], None] | None
    passthrough: bool = False


#: ``{name: _Command}`` in registration order; this is the order ``--help`` lists them in.
_COMMANDS: dict[str, _Command] = {}


def command(
    name: str,
    *,
    help: str,
    args: Callable[[argparse.ArgumentParser], None] | None = None,
    passthrough: bool = False,
) -> Callable[[Callable[[argparse.Namespace], int]], Callable[[argparse.Namespace], int]]:
    """Register ``fn(args) -> exit code`` as the subcommand ``name``.

    With ``passthrough=True`` the subcommand also accepts arguments it does not define; they
    are collected, in order, in ``args.passthrough`` instead of being an error.
    """

    def register(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        if name in _COMMANDS:
            raise ValueError(f"subcommand {name!r} is registered twice")
        _COMMANDS[name] = _Command(name=name, help=help, run=fn, args=args, passthrough=passthrough)
        return fn

    return register


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="tf.data service and parameter-server training on Dask.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cmd in _COMMANDS.values():
        p = sub.add_parser(
            cmd.name,
            help=cmd.help,
            description=cmd.help,
            # a pass-through command must not take ``--pre`` for one of its own options
            allow_abbrev=not cmd.passthrough,
        )
        if cmd.args is not None:
            cmd.args(p)
        p.set_defaults(_run=cmd.run, _passthrough=cmd.passthrough)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    run = getattr(args, "_run", None)
    if extra and not getattr(args, "_passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if run is None:
        parser.print_help(sys.stderr)
        return 2
    args.passthrough = list(extra)
    try:
        return int(run(args) or 0)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except CommandError as e:
        print(f"{PROG} {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code


class CommandError(Exception):
    """A failure a subcommand explains in one line: no traceback, exit code 1."""

    exit_code = 1


class UsageError(CommandError):
    """Options that parse but do not make sense together (exit code 2)."""

    exit_code = 2


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


def _say(args: argparse.Namespace, message: str) -> None:
    """A status line on stderr, unless ``--quiet``."""
    if not getattr(args, "quiet", False):
        print(f"demo: {message}", file=sys.stderr, flush=True)


# demo
######
#
# The demo is a chain of stages, each a function of the parsed arguments:
#
#   _demo_cluster   a distributed.Client: an embedded LocalCluster, or --scheduler ADDRESS
#   _demo_input     the click-through pipeline, moved onto the data service
#   _consume        the consumer: iterates the input and counts rows (the "trainer")
#
# Parameter-server training slots in as another stage between the input and the report: it
# gets the same client (its workers carry the `ps` resource, which the data service already
# leaves alone) and consumes the dataset `_demo_input` returns instead of `_consume`.

#: Shape of the synthetic click-through data, loosely after the Criteo display-ads layout.
_DENSE_FEATURES = 13
_SPARSE_FEATURES = 26
_VOCAB_SIZE = 100_000
#: Rows are generated in blocks of at most this many; a block is the unit of work.
_MAX_BLOCK_ROWS = 4096
#: ... and of at least this many, unless the dataset is smaller.
_MIN_BLOCK_ROWS = 256
#: Data workers of the embedded cluster when ``--workers`` is not given.
DEFAULT_WORKERS = 2


def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--elements",
        type=_positive_int,
        default=200_000,
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
    p.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="show Dask's and the data service's log messages, and the dispatcher's state",
    )
    where = p.add_argument_group("where the pipeline runs")
    where.add_argument(
        "--local",
        action="store_true",
        help="run the pipeline in this process, without Dask or the data service",
    )
    where.add_argument(
        "--mode",
        choices=("dynamic", "off"),
        type=str.lower,
        default=None,
        help="sharding policy: 'dynamic' hands each worker splits of the source, so every "
        "example is produced once; 'off' has every worker produce the whole dataset "
        "(default: dynamic)",
    )
    where.add_argument(
        "--workers",
        type=_positive_int,
        default=None,
        metavar="N",
        help=f"worker processes of the embedded LocalCluster, one thread each "
        f"(default: {DEFAULT_WORKERS})",
    )
    where.add_argument(
        "--processes",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the embedded cluster's workers as processes (default), or as threads of "
        "this process with --no-processes (starts faster, but shares one GIL)",
    )
    where.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        default=None,
        help="use the Dask cluster at ADDRESS (e.g. tcp://127.0.0.1:8786) instead of starting one",
    )
    train = p.add_argument_group("training (parameter-server strategy)")
    train.add_argument(
        "--train",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="train an embedding + logistic model on the stream with parameter servers and "
        "ClusterCoordinator.schedule/join (default: on for the embedded cluster, off with "
        "--scheduler unless the cluster has workers with the 'ps' resource)",
    )
    train.add_argument(
        "--ps",
        type=_positive_int,
        default=2,
        metavar="N",
        help="parameter-server processes of the embedded cluster when training (default: %(default)s)",
    )
    train.add_argument(
        "--checkpoint",
        metavar="DIR",
        default=None,
        help="write the trained model's checkpoint (a zarr group) to DIR",
    )


def _block_rows(n: int) -> int:
    """Rows per generated block: about 64 blocks, each between 256 and 4096 rows."""
    return max(1, min(n, max(_MIN_BLOCK_ROWS, min(_MAX_BLOCK_ROWS, -(-n // 64)))))


def _click_block(index: int, *, n: int, block_rows: int, seed: int) -> dict:
    """Rows ``[index * block_rows, ...)`` of the synthetic dataset, as a dict of columns.

    Each block has its own generator, seeded by ``(seed, index)``, so a block is the same
    whichever process makes it, and in whatever order.
    """
    import numpy as np

    start = index * block_rows
    rows = min(block_rows, n - start)
    rng = np.random.default_rng([seed, index])
    dense = rng.lognormal(mean=1.0, sigma=1.5, size=(rows, _DENSE_FEATURES)).astype(np.float32)
    sparse = rng.integers(0, 2**31 - 1, size=(rows, _SPARSE_FEATURES), dtype=np.int64)
    # The first categorical feature takes few values (an "advertiser"), so that the model
    # can learn per-id effects; clicks depend on it and on two dense features.
    sparse[:, 0] = rng.integers(0, 1000, size=rows)
    d = np.log1p(dense)
    logit = 1.5 * (d[:, 0] - 1.3) - 1.0 * (d[:, 1] - 1.3) + 3.0 * (sparse[:, 0] % 7 == 0) - 2.5
    label = rng.random(rows) < 1.0 / (1.0 + np.exp(-logit))
    return {"dense": dense, "sparse": sparse, "label": label.astype(np.int8)}


def _preprocess(batch: dict) -> dict:
    import numpy as np

    return {
        "dense": np.log1p(batch["dense"]),
        "sparse": batch["sparse"] % _VOCAB_SIZE,
        "label": batch["label"].astype(np.float32),
    }


def make_click_dataset(
    n: int, *, batch_size: int = 256, shuffle_buffer: int = 10_000, seed: int = 0
):
    """A synthetic click-through pipeline: generate → shuffle → batch → preprocess → prefetch.

    Each example is a dict with ``dense`` (13 float32 features, log-normal like counts),
    ``sparse`` (26 categorical ids) and ``label`` (0/1, about 20% positives, depending on two
    dense features and the first categorical one, so a model can learn it). Batches come out
    with ``dense`` log-transformed and ``sparse`` hashed into ``_VOCAB_SIZE`` buckets.

    The examples are generated where the pipeline runs, a block of rows at a time from a
    ``Dataset.range`` of block indices, so the pipeline is small to ship and splittable: under
    DYNAMIC sharding the dispatcher hands out block indices and each data worker generates,
    shuffles, batches and preprocesses the blocks it is given.
    """
    from dask_dataservice.data import AUTOTUNE, Dataset

    block_rows = _block_rows(n)
    blocks = -(-n // block_rows)
    make_block = functools.partial(_click_block, n=n, block_rows=block_rows, seed=seed)
    return (
        Dataset.range(blocks)
        .map(make_block)
        .flat_map(Dataset.from_tensor_slices)  # one dict per example
        .shuffle(shuffle_buffer, seed=seed)
        .batch(batch_size)
        .map(_preprocess, num_parallel_calls=AUTOTUNE)
        .prefetch(2)
    )


@command(
    "demo",
    help="stream a synthetic click-through input pipeline through the data service",
    args=_demo_args,
)
def _demo(args: argparse.Namespace) -> int:
    if args.local:
        given = [o for o, v in (("--mode", args.mode), ("--workers", args.workers),
                                ("--scheduler", args.scheduler)) if v is not None]
        if given:
            raise UsageError(f"--local runs without Dask; it cannot be used with {', '.join(given)}")
    elif args.scheduler is not None and args.workers is not None:
        raise UsageError("--workers sizes the embedded cluster; it cannot be used with --scheduler")

    n = args.elements
    _say(
        args,
        f"{n} examples -> shuffle({args.shuffle_buffer}) -> batch({args.batch_size})"
        " -> map(preprocess) -> prefetch(2)",
    )
    if args.local:
        if args.train:
            raise UsageError("--train needs a cluster; it cannot be used with --local")
        ds = _demo_dataset(args)
        count, batches, elapsed = _consume(ds, n, quiet=args.quiet)
        copies = 1
    elif _training(args):
        return _demo_train(args)
    else:
        count, batches, elapsed, copies = _demo_service(args)

    if count != n * copies:
        print(f"demo: expected {n * copies} elements, the pipeline produced {count}", file=sys.stderr)
        return 1
    rate = count / elapsed if elapsed > 0 else float("inf")
    _say(args, f"{batches} batches of up to {args.batch_size}")
    print(f"demo: {count} elements in {elapsed:.2f} s ({rate:.0f} elements/s)")
    return 0


def _training(args: argparse.Namespace) -> bool:
    if args.train is not None:
        return args.train
    return args.scheduler is None and (args.mode or "dynamic") == "dynamic"


def _demo_train(args: argparse.Namespace) -> int:
    """The whole story: the data service streams the click-through data (DYNAMIC) into
    per-worker datasets; parameter servers hold an embedding + logistic model trained with
    ClusterCoordinator.schedule/join and a server-side Adagrad; a checkpoint is written."""
    from dask_dataservice.ps.demo import train_click_model

    if args.mode == "off":
        raise UsageError("training reads the data once, with --mode dynamic")
    with _sigterm_exits(), _demo_logging(args.verbose), _demo_cluster(args, n_ps=args.ps) as client:
        workers = _wait_for_data_workers(client, args)
        _say(args, f"{args.ps if args.scheduler is None else 'the cluster'}'s parameter servers, "
                   f"{workers} training/data worker{'s' if workers != 1 else ''}")
        bar = None if args.quiet else Progress(args.elements, label="train", unit="ex")
        done = [0]

        def progress(examples_done: int, total: int) -> None:
            if bar is not None:
                bar.update(examples_done - done[0])
            done[0] = examples_done

        try:
            result = train_click_model(
                client, _demo_dataset(args), examples=args.elements, batch_size=args.batch_size,
                vocab_size=_VOCAB_SIZE, checkpoint_dir=args.checkpoint, progress=progress,
            )
        finally:
            if bar is not None:
                bar.close()
        _say(args, "shutting down" if args.scheduler is None else "disconnecting")
    if result.examples != args.elements:
        print(f"demo: expected {args.elements} examples, trained on {result.examples}",
              file=sys.stderr)
        return 1
    if args.checkpoint:
        _say(args, f"checkpoint written to {args.checkpoint}")
    print(f"demo: accuracy {result.accuracy:.3f}, log loss {result.logloss:.3f}, "
          f"{result.steps} steps")
    rate = result.examples / result.seconds if result.seconds > 0 else float("inf")
    print(f"demo: {result.examples} elements in {result.seconds:.2f} s ({rate:.0f} elements/s)")
    return 0


def _demo_dataset(args: argparse.Namespace):
    return make_click_dataset(
        args.elements, batch_size=args.batch_size, shuffle_buffer=args.shuffle_buffer, seed=args.seed
    )


def _demo_service(args: argparse.Namespace) -> tuple[int, int, float, int]:
    """The demo on a cluster; returns ``(rows, batches, seconds, copies)``.

    ``copies`` is how many times the dataset was produced: 1 under DYNAMIC sharding, the
    number of data workers under OFF.
    """
    import dask_dataservice as dds

    mode = dds.ShardingPolicy[(args.mode or "dynamic").upper()]
    with _sigterm_exits(), _demo_logging(args.verbose), _demo_cluster(args) as client:
        workers = _wait_for_data_workers(client, args)
        _say(args, f"{workers} data worker{'s' if workers != 1 else ''}, sharding policy {mode.name}")
        copies = 1 if mode == dds.ShardingPolicy.DYNAMIC else workers
        start = time.perf_counter()
        ds = _demo_input(args, client, mode)
        count, batches, _ = _consume(ds, args.elements * copies, quiet=args.quiet)
        elapsed = time.perf_counter() - start
        if mode == dds.ShardingPolicy.OFF and count % args.elements == 0:
            # workers may have joined or left an external cluster meanwhile
            copies = count // args.elements
        if args.verbose:
            _print_dispatcher_state(client)
        _say(args, "shutting down" if args.scheduler is None else "disconnecting")
    return count, batches, elapsed, copies


def _demo_input(args: argparse.Namespace, client: Any, mode: Any):
    """The click-through pipeline, registered with the data service and read from it."""
    import dask_dataservice as dds

    processing_mode = "distributed_epoch" if mode == dds.ShardingPolicy.DYNAMIC else "parallel_epochs"
    return _demo_dataset(args).apply(dds.distribute(processing_mode, client))


@contextlib.contextmanager
def _demo_cluster(args: argparse.Namespace, n_ps: int = 0) -> Iterator[Any]:
    """A connected ``distributed.Client``, closed (with its embedded cluster) on exit."""
    from distributed import Client

    if args.scheduler is not None:
        from dask_dataservice import config

        address = args.scheduler if "://" in args.scheduler else f"tcp://{args.scheduler}"
        timeout = config.get_seconds("client.connect-timeout")
        try:
            client = Client(address, timeout=timeout, set_as_default=False)
        except OSError as e:
            raise CommandError(f"cannot connect to the scheduler at {address}: {e}") from None
        with client:
            _say(args, f"connected to {address}")
            yield client
        return

    nworkers = args.workers or DEFAULT_WORKERS
    t0 = time.perf_counter()
    with _children_ignore_sigint():
        cluster = _local_cluster(args, nworkers, n_ps)
    with cluster, Client(cluster, set_as_default=False) as client:
        plural = "" if nworkers == 1 else "es"
        kind = f"worker process{plural}" if args.processes else f"in-process worker{plural[1:]}"
        _say(
            args,
            f"LocalCluster at {cluster.scheduler_address}: {nworkers} {kind} x 1 thread, "
            f"up in {time.perf_counter() - t0:.2f} s",
        )
        yield client


def _local_cluster(args: argparse.Namespace, nworkers: int, n_ps: int = 0):
    from distributed import LocalCluster

    if n_ps:
        return _ps_cluster(args, nworkers, n_ps)
    return LocalCluster(
        n_workers=nworkers,
        threads_per_worker=1,
        processes=args.processes,
        host="127.0.0.1",
        protocol="tcp://",  # also for --no-processes, which would pick inproc://
        dashboard_address=None,
        # the scheduler serves HTTP (health, metrics) even without a dashboard: keep it on
        # loopback and off the default port, which another cluster may hold
        scheduler_kwargs={"dashboard_address": "127.0.0.1:0"},
        worker_dashboard_address=None,
        silence_logs=False if args.verbose else logging.WARNING,
    )


def _ps_cluster(args: argparse.Namespace, nworkers: int, n_ps: int):
    """An embedded cluster with ``n_ps`` parameter servers (resource ``ps``) and workers."""
    from distributed import Nanny, Scheduler, SpecCluster, Worker

    cls = Nanny if args.processes else Worker
    common = {"nthreads": 1, "host": "127.0.0.1", "dashboard_address": None}
    if cls is Worker:
        common.pop("dashboard_address")
        common["dashboard"] = False
    if cls is Nanny and not args.verbose:
        common["silence_logs"] = logging.WARNING
    workers = {f"ps{i}": {"cls": cls, "options": {**common, "resources": {"ps": 1}}}
               for i in range(n_ps)}
    workers.update({f"w{i}": {"cls": cls, "options": dict(common)} for i in range(nworkers)})
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0",
                                               "protocol": "tcp://"}}
    return SpecCluster(workers=workers, scheduler=scheduler,
                       silence_logs=False if args.verbose else logging.WARNING)


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """Turn SIGTERM into ``SystemExit(143)``, so the cluster is closed on the way out."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        print(f"{PROG}: terminated", file=sys.stderr)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _children_ignore_sigint() -> Iterator[None]:
    """Start worker processes with SIGINT ignored (it survives their exec).

    Ctrl-C on a terminal signals the whole process group: without this, each worker process
    would raise KeyboardInterrupt wherever it is and print a traceback, while this process
    closes the cluster anyway. Ctrl-C during the start itself is ignored.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _wait_for_data_workers(client: Any, args: argparse.Namespace, timeout: float = 30.0) -> int:
    """Install the data service and wait until the data workers registered; return how many.

    For the embedded cluster: all ``--workers``. For an external one: every worker without an
    excluded resource (parameter servers are not data workers). After ``timeout`` seconds it
    goes on with the workers registered by then, and fails if there are none.
    """
    import dask_dataservice as dds
    from dask_dataservice import config

    dds.install(client)
    deadline = time.monotonic() + timeout
    if args.scheduler is None:
        want = args.workers or DEFAULT_WORKERS
    else:
        excluded = tuple(config.get("dispatcher.worker-resource-excluded") or ())
        workers = client.scheduler_info(n_workers=-1)["workers"].values()
        want = max(1, sum(1 for w in workers
                          if not any((w.get("resources") or {}).get(r) for r in excluded)))
    registered: list = []
    while True:
        registered = client.sync(client.scheduler.dataservice_state)["workers"]
        if len(registered) >= want:
            return len(registered)
        if time.monotonic() > deadline:
            if registered:
                return len(registered)
            raise CommandError(f"no data worker registered with the data service in {timeout:.0f} s")
        time.sleep(0.02)


def _print_dispatcher_state(client: Any) -> None:
    state = client.sync(client.scheduler.dataservice_state)
    its = state["iterations"].values()
    print(
        f"demo: dispatcher: {len(state['datasets'])} dataset(s), {len(state['jobs'])} job(s), "
        f"{len(its)} iteration(s), data workers {', '.join(state['workers'])}",
        file=sys.stderr,
    )


@contextlib.contextmanager
def _demo_logging(verbose: bool) -> Iterator[None]:
    """Quiet Dask in this process (WARNING and up) unless verbose; then show ours too."""
    dist = logging.getLogger("distributed")
    ours = logging.getLogger("dask_dataservice")
    saved = dist.level, ours.level
    handler = None
    if verbose:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s - %(name)s - %(levelname)s - %(message)s"))
        ours.addHandler(handler)
        ours.setLevel(logging.INFO)
    else:
        dist.setLevel(logging.WARNING)
    try:
        yield
    finally:
        dist.setLevel(saved[0])
        ours.setLevel(saved[1])
        if handler is not None:
            ours.removeHandler(handler)


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


# scheduler, worker
###################

#: The module each Dask command runs as (``python -m ...``), so no ``dask`` on PATH is needed.
_DASK_MODULES = {
    "scheduler": "distributed.cli.dask_scheduler",
    "worker": "distributed.cli.dask_worker",
}
PRELOAD = "dask_dataservice"
#: ``worker --supervise`` runs this module instead of ``dask worker``.
_SUPERVISE_MODULE = "dask_dataservice.service.supervise"


def dask_command(kind: str, dask_args: Sequence[str] = ()) -> list[str]:
    """The command line that starts a Dask ``kind`` (``"scheduler"`` or ``"worker"``) with
    the data service preloaded: ``python -m distributed.cli.dask_<kind> --preload
    dask_dataservice *dask_args`` (the preload is not repeated if ``dask_args`` has it).
    """
    module = _DASK_MODULES[kind]
    args = list(dask_args)
    preloads = {v for k, v in zip(args, args[1:], strict=False) if k == "--preload"}
    preloads |= {a.split("=", 1)[1] for a in args if a.startswith("--preload=")}
    preload = [] if PRELOAD in preloads else ["--preload", PRELOAD]
    return [sys.executable, "-m", module, *preload, *args]


def _dask_args(kind: str) -> Callable[[argparse.ArgumentParser], None]:
    def add(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--dry-run",
            action="store_true",
            help="print the command line instead of running it",
        )
        if kind == "scheduler":
            p.add_argument(
                "--work-dir",
                default=None,
                help="make the dispatcher fault tolerant: journal its state in this directory "
                "and recover from it on start (sets dataservice.dispatcher.fault-tolerant-mode "
                "and work-dir)",
            )
            p.add_argument(
                "--worker-addresses",
                default=None,
                help="comma-separated fixed worker list (addresses or worker names) for the "
                "static sharding policies",
            )
        if kind == "worker":
            p.add_argument(
                "--supervise",
                action="store_true",
                help="run a supervised data worker instead (python -m "
                f"{_SUPERVISE_MODULE} SCHEDULER [--nthreads N] [--host H] [--name N] "
                "[--resources R] [--memory-limit M]): when its scheduler goes away it starts a "
                "new worker, which registers again once the scheduler is back (for a "
                "fault-tolerant dispatcher restarted in place)",
            )
        p.epilog = (
            f"Every other argument is passed on to `dask {kind}` (see `python -m "
            f"{_DASK_MODULES[kind]} --help`), e.g. "
            + (
                "--host 127.0.0.1 --port 8786 --scheduler-file FILE."
                if kind == "scheduler"
                else "tcp://HOST:8786 --nthreads 4, or --scheduler-file FILE; with --supervise, "
                "to the supervisor."
            )
        )

    return add


def _run_dask(kind: str, args: argparse.Namespace) -> int:
    if getattr(args, "supervise", False):
        cmd = [sys.executable, "-m", _SUPERVISE_MODULE, *args.passthrough]
    else:
        cmd = dask_command(kind, args.passthrough)
    env = dict(os.environ)
    if getattr(args, "work_dir", None):
        env["DASK_DATASERVICE__DISPATCHER__FAULT_TOLERANT_MODE"] = "True"
        env["DASK_DATASERVICE__DISPATCHER__WORK_DIR"] = os.path.abspath(args.work_dir)
    if getattr(args, "worker_addresses", None):
        names = [a.strip() for a in args.worker_addresses.split(",") if a.strip()]
        env["DASK_DATASERVICE__DISPATCHER__WORKER_ADDRESSES"] = json.dumps(names)
    if args.dry_run:
        extra = {k: v for k, v in env.items() if os.environ.get(k) != v}
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(extra.items())) + (" " if extra else "")
              + shlex.join(cmd))
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name == "nt":  # pragma: no cover - no exec on Windows: run it as a child
        return subprocess.call(cmd, env=env)
    os.execve(cmd[0], cmd, env)  # the new program takes over this process: same pid, signals
    return 1  # pragma: no cover


@command(
    "scheduler",
    help="start a Dask scheduler with the data service's dispatcher "
    "(dask scheduler --preload dask_dataservice)",
    args=_dask_args("scheduler"),
    passthrough=True,
)
def _scheduler(args: argparse.Namespace) -> int:
    return _run_dask("scheduler", args)


@command(
    "worker",
    help="start a Dask worker with the data service's worker plugin "
    "(dask worker SCHEDULER --preload dask_dataservice)",
    args=_dask_args("worker"),
    passthrough=True,
)
def _worker(args: argparse.Namespace) -> int:
    return _run_dask("worker", args)


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
