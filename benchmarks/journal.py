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

Latency is per record (per ``append`` for the async path), from the call to durable.
``vs_unsynced`` is ``records_per_s / unsynced records_per_s``. After each journal run the
records are read back and checked, outside the timing.

Run from the repository root: ``.venv/bin/python benchmarks/journal.py [-n 5000]
[--payload 100] [--concurrency 1 16 256] [--dir DIR]``. Point ``--dir`` at the disk the
dispatcher will use: on tmpfs fsync is free and the numbers mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

from _common import fs_type

from dask_dataservice.service.journal import JournalWriter, encode_record, read_journal


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=5000, help="records per measurement")
    parser.add_argument("--payload", type=int, default=100, help="payload bytes per record")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 256])
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
        baseline = bench_raw(scratch, payloads, sync=False)
        print(json.dumps(baseline), flush=True)
        unsynced = baseline["records_per_s"]
        benches = [lambda: bench_raw(scratch, payloads, sync=True)]
        benches.append(lambda: bench_append_sync(scratch / "journal-sync", payloads))
        for c in args.concurrency:
            benches.append(lambda c=c: bench_group_commit(scratch / f"journal-{c}", payloads, c))
        for bench in benches:
            result = bench()
            result["vs_unsynced"] = round(result["records_per_s"] / unsynced, 4)
            print(json.dumps(result), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
