"""The demo as a chain of stages, each a function of :class:`DemoOptions`:

- where it runs: an embedded cluster (``_cluster.local_cluster``), ``--scheduler ADDRESS``
  (``_cluster.connect``), or this process (``--local``);
- the input: :func:`~._data.make_click_dataset`, moved onto the data service;
- the consumer: a loop that counts rows (streaming) or parameter-server training
  (:func:`~._train.train_click_model`), which gets the same client: its parameter servers
  carry the ``ps`` resource, which the data service already leaves alone.

Status lines go to stderr (``say``), results to stdout, the progress bar to stderr through
tqdm: on a terminal or in Jupyter only; in a pipe or a log the status lines say what
happens instead.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import _cluster
from ._cluster import DEFAULT_WORKERS, DemoError, DemoUsageError
from ._data import VOCAB_SIZE, make_click_dataset

if TYPE_CHECKING:
    from ..data.dataset import Dataset

__all__ = ["DemoError", "DemoOptions", "DemoUsageError", "run_demo"]

PROG = "dask-dataservice"


@dataclass(frozen=True)
class DemoOptions:
    """What ``dask-dataservice demo`` was asked to do (one field per option)."""

    elements: int = 200_000
    batch_size: int = 256
    shuffle_buffer: int = 10_000
    seed: int = 0
    quiet: bool = False
    verbose: bool = False
    #: Run in this process, without Dask.
    local: bool = False
    #: "dynamic" or "off" (None: dynamic).
    mode: str | None = None
    #: Data workers of the embedded cluster (None: DEFAULT_WORKERS).
    workers: int | None = None
    processes: bool = True
    #: Address of an existing cluster (None: embed one).
    scheduler: str | None = None
    #: None: train on the embedded cluster, and on an existing one that has parameter servers.
    train: bool | None = None
    ps: int = 2
    checkpoint: str | None = None

    def say(self, message: str) -> None:
        """A status line on stderr, unless ``quiet``."""
        if not self.quiet:
            print(f"demo: {message}", file=sys.stderr, flush=True)

    def dataset(self) -> Dataset:
        return make_click_dataset(self.elements, batch_size=self.batch_size,
                                  shuffle_buffer=self.shuffle_buffer, seed=self.seed)


def run_demo(opts: DemoOptions) -> int:
    """Run the demo; return the exit code (1: fewer or more rows than expected).

    Raises :class:`DemoError` for failures explained in one line (``exit_code`` says which).
    """
    _check(opts)
    opts.say(f"{opts.elements} examples -> shuffle({opts.shuffle_buffer}) -> "
             f"batch({opts.batch_size}) -> map(preprocess) -> prefetch(2)")
    if opts.local:
        start = time.perf_counter()
        count, batches = _consume(opts.dataset(), opts.elements, opts)
        return _report(opts, count, batches, time.perf_counter() - start, copies=1)
    with _cluster.sigterm_exits(PROG), _cluster.demo_logging(opts.verbose), \
            _client(opts) as client:
        opts.say(_dashboard_pages(client))
        if _training(opts, client):
            return _train(opts, client)
        return _stream(opts, client)


def _dashboard_pages(client: Any) -> str:
    """Where to watch the demo: the service's pages on the scheduler's dashboard."""
    try:
        base = client.dashboard_link.rsplit("/", 1)[0]
    except (AttributeError, KeyError, TypeError):  # the scheduler serves no dashboard
        return "dashboard: none (start the scheduler with a dashboard to watch the service)"
    return f"dashboard: {base}/dataservice (data service), {base}/parameter-servers"


def _check(opts: DemoOptions) -> None:
    if opts.local:
        given = [o for o, v in (("--mode", opts.mode), ("--workers", opts.workers),
                                ("--scheduler", opts.scheduler)) if v is not None]
        if opts.train:
            given.append("--train")
        if given:
            raise DemoUsageError(f"--local runs without Dask; it cannot be used with {', '.join(given)}")
    elif opts.scheduler is not None and opts.workers is not None:
        raise DemoUsageError("--workers sizes the embedded cluster; it cannot be used with --scheduler")
    if opts.train and opts.mode == "off":
        raise DemoUsageError("training reads the data once, with --mode dynamic")


@contextlib.contextmanager
def _client(opts: DemoOptions) -> Iterator[Any]:
    """A connected client: of the cluster at ``opts.scheduler``, or of an embedded one with
    parameter servers when the demo trains."""
    if opts.scheduler is not None:
        from distributed.comm.addressing import get_address_host_port

        from dask_dataservice._rpc import normalize_address

        try:
            get_address_host_port(normalize_address(opts.scheduler))
        except ValueError as e:
            raise DemoUsageError(f"cannot parse the address {opts.scheduler!r}: {e}") from None
        with _cluster.connect(opts.scheduler, opts.say) as client:
            yield client
        opts.say("disconnected")
        return
    nworkers = opts.workers or DEFAULT_WORKERS
    n_ps = opts.ps if _training(opts, None) else 0
    t0 = time.perf_counter()
    with _cluster.local_cluster(nworkers=nworkers, n_ps=n_ps, processes=opts.processes,
                                verbose=opts.verbose) as client:
        plural = "" if nworkers == 1 else "es"
        kind = f"worker process{plural}" if opts.processes else f"in-process worker{plural[1:]}"
        ps = f" and {n_ps} parameter server{'s' if n_ps != 1 else ''}" if n_ps else ""
        opts.say(f"cluster at {client.scheduler.address}: {nworkers} {kind}{ps} x 1 thread, "
                 f"up in {time.perf_counter() - t0:.2f} s")
        yield client
        opts.say("shutting down")


def _training(opts: DemoOptions, client: Any) -> bool:
    """Whether the demo trains: ``--train``/``--no-train``; else on the embedded cluster
    (DYNAMIC only), and on an existing cluster when it has parameter servers (workers with
    the ``ps`` resource) and other workers to train on."""
    if opts.local:
        return False
    if opts.scheduler is None:
        return opts.train if opts.train is not None else (opts.mode or "dynamic") == "dynamic"
    if opts.train is False or client is None:
        return bool(opts.train)
    n_ps, n_workers = _cluster.parameter_servers(client)
    if opts.train is None:
        return n_ps > 0 and n_workers > 0 and (opts.mode or "dynamic") == "dynamic"
    if not n_ps or not n_workers:
        raise DemoError(f"--train needs parameter servers (workers with the 'ps' resource) and "
                        f"other workers; the cluster at {opts.scheduler} has {n_ps} and {n_workers}")
    return True


def _stream(opts: DemoOptions, client: Any) -> int:
    """Stream the pipeline through the data service; every row is counted on arrival."""
    import dask_dataservice as dds

    mode = dds.ShardingPolicy[(opts.mode or "dynamic").upper()]
    workers = _cluster.wait_for_data_workers(client, None if opts.scheduler else
                                             opts.workers or DEFAULT_WORKERS)
    opts.say(f"{workers} data worker{'s' if workers != 1 else ''}, sharding policy {mode.name}")
    copies = 1 if mode == dds.ShardingPolicy.DYNAMIC else workers
    processing_mode = "distributed_epoch" if mode == dds.ShardingPolicy.DYNAMIC else "parallel_epochs"
    start = time.perf_counter()
    ds = opts.dataset().apply(dds.distribute(processing_mode, client))
    count, batches = _consume(ds, opts.elements * copies, opts)
    elapsed = time.perf_counter() - start
    if mode == dds.ShardingPolicy.OFF and count % opts.elements == 0:
        copies = count // opts.elements  # workers may have joined or left an external cluster
    if opts.verbose:
        state = client.sync(client.scheduler.dataservice_state)
        opts.say(f"dispatcher: {state['num_datasets']} dataset(s), {state['num_jobs']} job(s), "
                 f"{state['num_iterations']} iteration(s), data workers {', '.join(state['workers'])}")
    return _report(opts, count, batches, elapsed, copies)


def _report(opts: DemoOptions, count: int, batches: int, elapsed: float, copies: int) -> int:
    if count != opts.elements * copies:
        print(f"demo: expected {opts.elements * copies} elements, the pipeline produced {count}",
              file=sys.stderr)
        return 1
    opts.say(f"{batches} batches of up to {opts.batch_size}")
    rate = count / elapsed if elapsed > 0 else float("inf")
    print(f"demo: {count} elements in {elapsed:.2f} s ({rate:.0f} elements/s)", flush=True)
    return 0


def _train(opts: DemoOptions, client: Any) -> int:
    """The whole story: the data service streams the click-through data (DYNAMIC) into
    per-worker datasets; parameter servers hold an embedding + logistic model trained with
    ClusterCoordinator.schedule/join and a server-side Adagrad; a checkpoint is written."""
    from ._train import train_click_model

    workers = _cluster.wait_for_data_workers(client, None if opts.scheduler else
                                             opts.workers or DEFAULT_WORKERS)
    n_ps, _ = _cluster.parameter_servers(client)
    opts.say(f"training on {workers} worker{'s' if workers != 1 else ''} (they also serve the "
             f"data) with {n_ps} parameter server{'s' if n_ps != 1 else ''}")
    opts.say("placing the model on the parameter servers, then waiting for the first batches")
    with _progress(opts, opts.elements, "train") as bar:
        done = [0]

        def progress(examples_done: int, total: int) -> None:
            bar.update(examples_done - done[0])
            done[0] = examples_done

        result = train_click_model(
            client, opts.dataset(), examples=opts.elements, batch_size=opts.batch_size,
            vocab_size=VOCAB_SIZE, checkpoint_dir=opts.checkpoint, progress=progress,
        )
    if result.examples != opts.elements:
        print(f"demo: expected {opts.elements} examples, trained on {result.examples}",
              file=sys.stderr)
        return 1
    if opts.checkpoint:
        opts.say(f"checkpoint written to {opts.checkpoint}")
    print(f"demo: accuracy {result.accuracy:.3f}, log loss {result.logloss:.3f}, "
          f"{result.steps} steps", flush=True)
    rate = result.examples / result.seconds if result.seconds > 0 else float("inf")
    print(f"demo: {result.examples} elements in {result.seconds:.2f} s ({rate:.0f} elements/s)",
          flush=True)
    return 0


def _progress(opts: DemoOptions, total: int, label: str) -> Any:
    """A tqdm bar on stderr: drawn on a terminal and in Jupyter (a widget with ipywidgets),
    off in a pipe or a log (where it would repeat itself) and with ``quiet``."""
    from .._tqdm import interactive, progress_bar_class

    bar = progress_bar_class("DemoProgress")
    return bar(total=total, desc=f"demo {label}", unit="ex", unit_scale=True, file=sys.stderr,
               disable=opts.quiet or not interactive(), dynamic_ncols=True)


def _consume(ds: Iterable[Any], total: int, opts: DemoOptions) -> tuple[int, int]:
    """Iterate ``ds`` (batches of dicts); return ``(rows, batches)``."""
    count = batches = 0
    opts.say("waiting for the first batch")
    with _progress(opts, total, "read") as bar:
        for batch in ds:
            rows = len(batch["label"])
            count += rows
            batches += 1
            bar.update(rows)
    return count, batches

