"""Journal write throughput and latency: fsync per record against group commit.

Prints one JSON object per line on stdout. The first line describes the run (directory, file
system, payload size, record count); then one line per measurement::

    {"bench": "group_commit", "concurrency": 256, "records_per_s": ..., "latency_us_median": ...,
     "latency_us_p99": ..., "fsyncs": ..., "records_per_fsync": ..., "vs_unsynced": ...}

Measurements, each on a fresh segment in the same directory and process:

* ``unsynced_write``: baseline, ``os.write`` of each framed record, never fsync'd (what the
  disk path costs without durability).
* ``fsync_each_raw``: baseline, ``os.write`` + ``fdatasync`` per record, no journal code (the
  floor for TensorFlow's one-fsync-per-update journal).
* ``append_sync``: :meth:`JournalWriter.append_sync`, one write + fsync per record.
* ``group_commit``: ``concurrency`` coroutines, each awaiting ``writer.append`` in a loop, so
  up to ``concurrency`` records share a write + fsync on the writer's I/O thread.

And, with ``--splits N`` (default 1,000,000; 0 skips them), the dispatcher's journal as a
whole, through its real handlers on an in-process scheduler, once with snapshots (the default
config) and once without (the local baseline, ``snapshot-records`` and ``snapshot-bytes`` 0):

* ``register``: ``register_dataset`` of ``Dataset.range(2**40)`` from an asynchronous client
  (lazy index ranges: the record does not grow with the number of splits), milliseconds.
* ``restart``: ``--epochs`` repetitions (default 3) of ``N`` splits handed out to 8 tasks
  asking concurrently with ``get_split(count=64)`` and acknowledging two repetitions back (as
  data workers do), the journal's bytes on disk, then the time from a new scheduler's
  ``start`` with the plugin to the first ``get_split`` answered.

Latency is per record (per ``append`` for the async path), from the call to durable.
``vs_unsynced`` is ``records_per_s / unsynced records_per_s``. After each journal run the
records are read back and checked, outside the timing.

And, with ``--files N`` (default 1,000,000; 0 skips it), ``register_files``: seconds to
register ``Dataset.from_files`` of ``N`` paths (one split each) from an asynchronous client.
``--only-dispatcher`` skips the raw journal measurements and the no-snapshot baseline.
``--first-element``: with two real data workers, ``--files`` paths read ``--epochs`` times
under DYNAMIC, then a new ``DispatchServer`` on the same work_dir, timed to the first element
of a new read (``restart_to_first_element``).

Run from the repository root: ``.venv/bin/python benchmarks/journal.py [-n 5000]
[--payload 100] [--concurrency 1 16 256] [--splits 1000000] [--files 1000000]
[--only-dispatcher] [--dir DIR]``. Point ``--dir`` at the disk the
dispatcher will use: on tmpfs fsync is free and the numbers mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import fs_type

from dask_dataservice.service.dispatcher.journal import JournalWriter, encode_record, read_journal


def _summary(bench: str, latencies: list[float], seconds: float, **extra) -> dict:
    lat = sorted(latencies)
    n = len(lat)
    return {
        "bench": bench,
        **extra,
        "records": n,
        "seconds": round(seconds, 4),
        "records_per_s": round(n / seconds),
        "latency_us_median": round(lat[n // 2] * 1e6, 1),
        "latency_us_p99": round(lat[min(n - 1, int(n * 0.99))] * 1e6, 1),
    }


def bench_raw(work_dir: Path, payloads: list[bytes], *, sync: bool) -> dict:
    frames = [encode_record(p) for p in payloads]
    path = work_dir / ("raw_fsync" if sync else "raw_unsynced")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    latencies = []
    try:
        start = time.perf_counter()
        for frame in frames:
            t = time.perf_counter()
            os.write(fd, frame)
            if sync:
                os.fdatasync(fd)
            latencies.append(time.perf_counter() - t)
        seconds = time.perf_counter() - start
    finally:
        os.close(fd)
        path.unlink()
    bench = "fsync_each_raw" if sync else "unsynced_write"
    return _summary(bench, latencies, seconds, fsyncs=len(frames) if sync else 0)


def _check(work_dir: Path, payloads: list[bytes]) -> None:
    got = list(read_journal(work_dir))
    if sorted(got) != sorted(payloads):
        raise SystemExit(f"read back {len(got)} records, expected {len(payloads)}")


def bench_append_sync(work_dir: Path, payloads: list[bytes]) -> dict:
    latencies = []
    with JournalWriter.open(work_dir) as writer:
        start = time.perf_counter()
        for p in payloads:
            t = time.perf_counter()
            writer.append_sync(p)
            latencies.append(time.perf_counter() - t)
        seconds = time.perf_counter() - start
    _check(work_dir, payloads)
    m = writer.metrics
    return _summary(
        "append_sync",
        latencies,
        seconds,
        fsyncs=m.fsyncs,
        records_per_fsync=round(m.records_per_fsync, 2),
    )


def bench_group_commit(work_dir: Path, payloads: list[bytes], concurrency: int) -> dict:
    async def run() -> tuple[list[float], float, JournalWriter]:
        writer = JournalWriter.open(work_dir)
        latencies: list[float] = []
        per_task = [payloads[i::concurrency] for i in range(concurrency)]

        async def appender(mine: list[bytes]) -> None:
            for p in mine:
                t = time.perf_counter()
                await writer.append(p)
                latencies.append(time.perf_counter() - t)

        start = time.perf_counter()
        await asyncio.gather(*(appender(mine) for mine in per_task))
        seconds = time.perf_counter() - start
        await writer.aclose()
        return latencies, seconds, writer

    latencies, seconds, writer = asyncio.run(run())
    _check(work_dir, payloads)
    m = writer.metrics
    return _summary(
        "group_commit",
        latencies,
        seconds,
        concurrency=concurrency,
        fsyncs=m.fsyncs,
        records_per_fsync=round(m.records_per_fsync, 2),
        max_batch_records=m.max_batch_records,
        fsync_threads=sorted(m.sync_thread_names),
    )


@contextlib.asynccontextmanager
async def _ft_dispatcher(work_dir: Path):
    """A fault-tolerant dispatcher on a fresh in-process scheduler: yields (scheduler, plugin)."""
    from distributed import Scheduler

    from dask_dataservice.service.dispatcher.plugin import DispatcherPlugin

    plugin = DispatcherPlugin(fault_tolerant_mode=True, work_dir=str(work_dir))
    async with Scheduler(dashboard_address=":0", port=0) as s:
        s.add_plugin(plugin)
        await plugin.start(s)
        try:
            yield s, plugin
        finally:
            await plugin.close()


async def _register(work_dir: Path) -> float:
    """Milliseconds to register a dataset of 2**40 elements (2**24 splits) from a client."""
    from distributed import Client

    import dask_dataservice as dds

    async with _ft_dispatcher(work_dir) as (s, _), Client(s.address, asynchronous=True) as c:
        await dds.register_dataset(c, dds.Dataset.range(1000))  # warm up the path
        start = time.perf_counter()
        await dds.register_dataset(c, dds.Dataset.range(2**40))
        return (time.perf_counter() - start) * 1000


def _read_file(path: str) -> list[str]:
    return [path]


async def _register_files(work_dir: Path, files: int) -> dict:
    """Seconds to register ``Dataset.from_files`` of ``files`` paths (one split each) from an
    asynchronous client: enumerating and pickling the splits, the dispatcher's ingest and its
    journal record (issue 22 s5: 15 s for a million, 6-7 s in the package of 13df877)."""
    import dask
    from distributed import Client

    import dask_dataservice as dds

    paths = [f"/data/train/part-{i:07d}.tfrecord" for i in range(files)]
    # a million 35-character paths took more than the default 64 MiB before their splits
    # pickled compactly: raised so that both sides of a comparison can run
    dask.config.set({"dataservice.dispatcher.max-pipeline-bytes": 2**28})
    async with _ft_dispatcher(work_dir) as (s, plugin), \
            Client(s.address, asynchronous=True) as c:
        await dds.register_dataset(c, dds.Dataset.range(1000))  # warm up the path
        start = time.perf_counter()
        await dds.register_dataset(c, dds.Dataset.from_files(paths, _read_file))
        seconds = time.perf_counter() - start
        return {"bench": "register_files", "files": files, "seconds": round(seconds, 3),
                "journal_bytes": plugin._journal.metrics.bytes_written,
                "load_average": os.getloadavg()[0]}


async def _hand_out(work_dir: Path, num_splits: int, epochs: int,
                    tasks: int, pipeline_bytes: int = 1000) -> tuple[int, int, str, Any]:
    """A named DYNAMIC job over ``num_splits`` splits read for ``epochs`` repetitions by
    ``tasks`` tasks asking concurrently (``get_split(count=64)``, acknowledging two
    repetitions back, as data workers do).

    Returns ``(iteration_id, a task_id, the job's token, the journal writer's metrics)``.
    """
    from distributed import Scheduler

    from dask_dataservice.service.dispatcher.plugin import DispatcherPlugin
    from dask_dataservice.service.dispatcher.state import CreateTask, RegisterWorker

    plugin = DispatcherPlugin(fault_tolerant_mode=True, work_dir=str(work_dir))
    async with Scheduler(dashboard_address=":0", port=0) as s:
        s.add_plugin(plugin)
        await plugin.start(s)
        try:
            dataset_id = (await plugin.register_dataset(
                fingerprint="bench", pipeline=os.urandom(pipeline_bytes), splits=b"s",
                num_splits=num_splits,
            ))["dataset_id"]
            job = await plugin.get_or_create_job(
                dataset_id=dataset_id, processing_mode="DYNAMIC", job_name="bench")
            token = job["job_token"]  # the job's capability: needed for its splits
            iteration_id = (await plugin.get_or_create_iteration(
                job_id=job["job_id"], job_token=token))["iteration_id"]
            task_ids = []
            for i in range(tasks):
                address = f"tcp://bench:{i + 1}"
                plugin._apply(RegisterWorker(address=address, host="bench", nthreads=1))
                task_ids.append(plugin.state.next_task_id())
                plugin._apply(CreateTask(task_id=task_ids[-1], iteration_id=iteration_id,
                                         worker_address=address))

            async def read(task_id: int) -> None:
                for repetition in range(epochs):
                    while True:
                        reply = await plugin.get_split(iteration_id=iteration_id,
                                                       task_id=task_id,
                                                       repetition=repetition, count=64,
                                                       job_token=token)
                        if reply["end_of_splits"]:
                            break
                    if repetition >= 2:
                        await plugin.ack_splits(task_id=task_id, repetition=repetition - 2,
                                                job_token=token)

            await asyncio.gather(*(read(t) for t in task_ids))
            compaction = plugin._journal._compaction
            if compaction is not None:  # let the last snapshot land, as a running one would
                await asyncio.wrap_future(compaction)
            return iteration_id, task_ids[0], token, plugin._journal.metrics
        finally:
            await plugin.close()


async def _restart(work_dir: Path, iteration_id: int, task_id: int,
                   token: str) -> tuple[float, int, float]:
    """Seconds from a new scheduler + dispatcher start to the first get_split answered;
    records replayed; seconds of those spent reading and replaying the journal."""
    from distributed import Scheduler

    from dask_dataservice.service.dispatcher.plugin import DispatcherPlugin

    start = time.perf_counter()
    plugin = DispatcherPlugin(fault_tolerant_mode=True, work_dir=str(work_dir))
    async with Scheduler(dashboard_address=":0", port=0) as s:
        s.add_plugin(plugin)
        await plugin.start(s)
        try:
            reply = await plugin.get_split(iteration_id=iteration_id, task_id=task_id,
                                           repetition=0, count=1, job_token=token)
            assert reply["status"] == "OK", reply
            return time.perf_counter() - start, plugin.recovered_updates, plugin.recovery_seconds
        finally:
            await plugin.close()


def bench_restart(work_dir: Path, num_splits: int, epochs: int, snapshots: bool,
                  pipeline_bytes: int = 1000) -> list[dict]:
    """The dispatcher's journal with or without snapshots (see the module docstring)."""
    import dask

    settings = {} if snapshots else {"dataservice.dispatcher.snapshot-records": 0,
                                     "dataservice.dispatcher.snapshot-bytes": 0}
    with dask.config.set(settings):
        register_ms = asyncio.run(_register(work_dir / "register"))
        start = time.perf_counter()
        iteration_id, task_id, token, metrics = asyncio.run(
            _hand_out(work_dir / "restart", num_splits, epochs, tasks=8,
                      pipeline_bytes=pipeline_bytes))
        hand_out_s = time.perf_counter() - start
        journal_bytes = sum(p.stat().st_size for p in (work_dir / "restart").iterdir())
        restart_s, replayed, replay_s = asyncio.run(
            _restart(work_dir / "restart", iteration_id, task_id, token))
    label = "snapshots" if snapshots else "no_snapshots (baseline)"
    return [
        {"bench": "register", "journal": label, "splits": 2**24,
         "milliseconds": round(register_ms, 1)},
        {"bench": "restart", "journal": label, "splits_handed_out": num_splits * epochs,
         "epochs": epochs, "tasks": 8, "records": metrics.records_written,
         "records_per_fsync": round(metrics.records_per_fsync, 1),
         "hand_out_seconds": round(hand_out_s, 2), "snapshots": metrics.snapshots_written,
         "journal_bytes": journal_bytes, "records_replayed_after_snapshot": replayed,
         "replay_seconds": round(replay_s, 3),
         "restart_to_serving_seconds": round(restart_s, 3), "pipeline_bytes": pipeline_bytes,
         "load_average": os.getloadavg()[0]},
    ]


def bench_first_element(files: int, epochs: int) -> dict:
    """Real data workers (two ``WorkerServer``): read ``Dataset.from_files`` of ``files``
    paths ``epochs`` times under DYNAMIC (``files * epochs`` splits handed out), stop the
    fault-tolerant ``DispatchServer``, start a new one on the same port and work_dir, and
    time it to the first element of a new read (issue 22 s5)."""
    import socket

    import dask

    import dask_dataservice as dds

    dask.config.set({"dataservice.dispatcher.max-pipeline-bytes": 2**28})
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    work_dir = tempfile.mkdtemp(prefix="dds-journal-first-")
    cfg = dds.DispatcherConfig(fault_tolerant_mode=True, work_dir=work_dir, port=port)
    dispatcher = dds.DispatchServer(cfg)
    workers = [dds.WorkerServer(dds.WorkerConfig(dispatcher_address=dispatcher.target))
               for _ in range(2)]
    try:
        paths = [f"/data/train/part-{i:07d}.tfrecord" for i in range(files)]
        ds = dds.Dataset.from_files(paths, _read_file).repeat(epochs).batch(4096)
        start = time.perf_counter()
        n = sum(len(b) for b in ds.apply(dds.distribute("distributed_epoch", dispatcher.target)))
        read_s = time.perf_counter() - start
        assert n == files * epochs, n
        dispatcher.stop()
        start = time.perf_counter()
        dispatcher = dds.DispatchServer(cfg)
        it = iter(dds.Dataset.range(10).apply(dds.distribute("distributed_epoch",
                                                              dispatcher.target)))
        first = next(it)
        restart_s = time.perf_counter() - start
        assert sorted([first, *it]) == list(range(10))
    finally:
        for w in workers:
            w.stop()
        dispatcher.stop()
        shutil.rmtree(work_dir, ignore_errors=True)
    return {"bench": "restart_to_first_element", "files": files, "epochs": epochs,
            "register_and_read_seconds": round(read_s, 2),
            "restart_to_first_element_seconds": round(restart_s, 3),
            "load_average": os.getloadavg()[0]}


def _raw_benches(scratch: Path, payloads: list[bytes], concurrency: list[int]) -> None:
    baseline = bench_raw(scratch, payloads, sync=False)
    print(json.dumps(baseline), flush=True)
    unsynced = baseline["records_per_s"]
    benches = [lambda: bench_raw(scratch, payloads, sync=True)]
    benches.append(lambda: bench_append_sync(scratch / "journal-sync", payloads))
    for c in concurrency:
        benches.append(lambda c=c: bench_group_commit(scratch / f"journal-{c}", payloads, c))
    for bench in benches:
        result = bench()
        result["vs_unsynced"] = round(result["records_per_s"] / unsynced, 4)
        print(json.dumps(result), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=5000, help="records per measurement")
    parser.add_argument("--payload", type=int, default=100, help="payload bytes per record")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--splits", type=int, default=1_000_000,
                        help="splits handed out before the restart measurement (0: skip it)")
    parser.add_argument("--files", type=int, default=1_000_000,
                        help="file splits to register (0: skip)")
    parser.add_argument("--pipeline-bytes", type=int, default=1000,
                        help="size of the --splits dataset's pipeline (a million file paths "
                             "pickle to about 31 MB): the state every snapshot holds")
    parser.add_argument("--first-element", action="store_true",
                        help="also: restart to the first element of a new read, with real "
                             "data workers, after --files x --epochs splits")
    parser.add_argument("--only-dispatcher", action="store_true",
                        help="skip the raw journal measurements")
    parser.add_argument("--epochs", type=int, default=3,
                        help="repetitions of the --splits dataset read before the restart")
    parser.add_argument("--dir", type=Path, default=None, help="parent of the scratch directory")
    args = parser.parse_args(argv)

    scratch = Path(tempfile.mkdtemp(prefix="dds-journal-bench-", dir=args.dir))
    try:
        payloads = [i.to_bytes(8, "little") + os.urandom(args.payload - 8) for i in range(args.n)]
        print(
            json.dumps(
                {
                    "bench": "run",
                    "dir": str(scratch),
                    "filesystem": fs_type(scratch.resolve()),
                    "records": args.n,
                    "payload_bytes": args.payload,
                    "python": platform.python_version(),
                    "platform": sys.platform,
                    "cpus": os.cpu_count(),
                }
            ),
            flush=True,
        )
        if not args.only_dispatcher:
            _raw_benches(scratch, payloads, args.concurrency)
        if args.files:
            line = asyncio.run(_register_files(scratch / "files", args.files))
            print(json.dumps(line), flush=True)
        if args.first_element:
            print(json.dumps(bench_first_element(args.files, args.epochs)), flush=True)
        if args.splits:
            # --only-dispatcher: the default configuration (snapshots) only
            for snapshots in (True,) if args.only_dispatcher else (False, True):
                for line in bench_restart(scratch / f"dispatcher-{snapshots}", args.splits,
                                          args.epochs, snapshots, args.pipeline_bytes):
                    print(json.dumps(line), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
