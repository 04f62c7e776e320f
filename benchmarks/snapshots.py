"""Snapshot chunk formats: write and read throughput of each, against pickle (the old format).

The chunk writer that ``distributed_save`` runs on each data worker (``WriteChunks``) and the
reader of ``Dataset.load`` are timed in this process, on a local directory, for four
workloads:

``small``   100,000 elements ``{"id": int, "x": float32[8]}`` (features)
``big``     128 elements of 1 MiB (``float32[262144]``, random)
``image``   4,000 ``uint8[64, 64, 3]`` random images with an ``int64`` label (a tuple)
``ragged``  50,000 ``int32`` token sequences of 1-64 tokens

and each format: ``pickle`` (the previous version's only format, uncompressed as its default,
and zlib as its ``GZIP``), ``arrow`` (Arrow IPC, this version's default, uncompressed and lz4),
``parquet`` (uncompressed and zstd). Runs alternate format by format, best of ``--runs``;
every read is checked (count and a sum over the elements). Chunks are the default 64 MiB /
100,000 elements, as ``distributed_save`` cuts them. Each record gives the load average.

    .venv/bin/python benchmarks/snapshots.py                  # ~1 min on 2 cores
    .venv/bin/python benchmarks/snapshots.py --only small,big --runs 5

Against an older package (``ab.py --script head``) only the pickle formats run.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fs_type  # noqa: E402


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def load1() -> float:
    return round(os.getloadavg()[0], 2)


def workloads(only: set[str]) -> dict[str, tuple[list[Any], Any]]:
    rng = np.random.default_rng(0)
    out: dict[str, tuple[list[Any], Any]] = {}
    if "small" in only:
        out["small"] = ([{"id": i, "x": np.full(8, i % 97, np.float32)} for i in range(100_000)],
                        lambda e: e["id"])
    if "big" in only:
        out["big"] = ([rng.random(262144, dtype=np.float32) for _ in range(128)],
                      lambda e: int(e[0] * 1000))
    if "image" in only:
        out["image"] = ([(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8), np.int64(i))
                         for i in range(4_000)], lambda e: int(e[1]))
    if "ragged" in only:
        out["ragged"] = ([rng.integers(0, 30_000, int(rng.integers(1, 65)), dtype=np.int32)
                          for _ in range(50_000)], lambda e: len(e))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="small,big,image,ragged")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = p.parse_args()

    from dask_dataservice.data import Dataset
    from dask_dataservice.data.snapshot import WriteChunks

    new = "format" in inspect.signature(WriteChunks).parameters
    formats: list[tuple[str, str | None, dict[str, Any]]] = [
        ("pickle", None, {"format": "pickle"} if new else {}),
        ("pickle", "GZIP", {"format": "pickle", "compression": "GZIP"} if new else {"compress": True}),
    ]
    if new:
        formats += [("arrow", None, {"format": "arrow"}),
                    ("arrow", "LZ4", {"format": "arrow", "compression": "LZ4"}),
                    ("parquet", None, {"format": "parquet"}),
                    ("parquet", "ZSTD", {"format": "parquet", "compression": "ZSTD"})]
    root = Path(args.dir or tempfile.mkdtemp(prefix="dds-snapbench-"))
    emit(bench="snapshots_run", python=platform.python_version(), numpy=np.__version__,
         cores=os.cpu_count(), fs=fs_type(root), runs=args.runs, new_formats=new, load_1min=load1())
    for name, (elements, key) in workloads(set(args.only.split(","))).items():
        nbytes = sum(sum(getattr(leaf, "nbytes", 8) for leaf in (e.values() if isinstance(e, dict)
                     else e if isinstance(e, tuple) else [e])) for e in elements)
        expect = (len(elements), sum(key(e) for e in elements))
        best: dict[tuple[str, str | None], dict[str, float]] = {}
        for run in range(args.runs):
            for fmt, codec, kwargs in formats:
                path = root / f"{name}-{fmt}-{codec}-{run}"
                source = Dataset.from_generator(lambda elements=elements: iter(elements))
                writer = Dataset(WriteChunks(source._op, str(path), 100_000, 64 << 20, 3600.0,
                                             **kwargs))
                t0 = time.perf_counter()
                descriptors = list(writer)
                write_s = time.perf_counter() - t0
                # the manifest distributed_save writes (not timed: one small file per save)
                names = sorted(d["chunk"] for d in descriptors)
                (path / "snapshot.json").write_text(json.dumps({
                    "format": "dask-dataservice-snapshot", "version": 2 if new else 1,
                    "state": "done", "chunks": names, "num_elements": len(elements)}))
                load_kwargs = {"allow_pickle": True} if new else {}
                t0 = time.perf_counter()
                count = total = 0
                for e in Dataset.load(str(path), **load_kwargs):
                    count += 1
                    total += key(e)
                read_s = time.perf_counter() - t0
                if (count, total) != expect:
                    raise SystemExit(f"{name} {fmt} {codec}: read {(count, total)}, wrote {expect}")
                disk = sum(f.stat().st_size for f in (path / "chunks").iterdir())
                shutil.rmtree(path)
                b = best.setdefault((fmt, codec), {"write_s": 1e9, "read_s": 1e9})
                b["write_s"] = min(b["write_s"], write_s)
                b["read_s"] = min(b["read_s"], read_s)
                b["disk"] = disk
        base = best[("pickle", None)]
        for (fmt, codec), b in best.items():
            for op in ("write", "read"):
                s = b[f"{op}_s"]
                emit(bench=f"snapshot_{op}", workload=name, format=fmt, compression=codec,
                     mib_per_s=round(nbytes / s / 2**20, 1),
                     elements_per_s=round(len(elements) / s),
                     seconds=round(s, 4), data_mib=round(nbytes / 2**20, 1),
                     disk_mib=round(b["disk"] / 2**20, 2),
                     vs_pickle=round(base[f"{op}_s"] / s, 2),
                     baseline="pickle, uncompressed (the previous version's default)",
                     load_1min=load1())
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
