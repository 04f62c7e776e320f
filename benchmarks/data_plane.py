"""The data plane at the hardware's edge (issue 16, targets 2, 4, 5, 6, 7).

Prints JSON lines on stdout; every line carries ``load`` (the 1-minute load average when it was
measured: the machine is shared). Each new path is measured against the old one in the same
run, alternating old / new (``--rounds`` times), best read of each:

- ``elements``: ``Dataset.range(n).map(lambda i: np.full(size // 4, i, np.float32))`` read
  through a scheduler and single-threaded data workers in separate processes (the cluster of
  ``service.py``), DYNAMIC, by a consumer in its own process; element sizes ``--sizes`` (4 KiB,
  64 KiB, 1 MiB), 1 and 2 workers. ``old`` sends one frame per numpy buffer
  (``dataservice.worker.pack-bytes: 0``), ``new`` packs buffers under 256 KiB into one frame
  per batch. Figures: GiB/s, µs per element, and the peak RSS of every process (psutil samples
  every 10 ms; the consumer's is its VmHWM).
- ``plane`` (issue 25, target 1): the same read through distributed's comms
  (``dataservice.client.fast-path: false``) and through the workers' element ports, with raw
  loopback TCP between two processes (``sendall`` into ``recv_into`` a preallocated buffer)
  measured in each round: GiB/s, the fraction of raw loopback, and the consumer's peak RSS
  beside the bytes its requests and channel may hold. ``--plane-tls`` adds the same read from a TLS
  cluster (its reads keep distributed's comms, encrypted). ``--plane-source shared``: every
  element is one shared array, so the workers spend nothing making elements (the data plane alone).
- ``malloc``: the same read of 1 MiB and 64 KiB elements from three clusters: workers as
  ``--no-nanny`` starts them, with the environment a nanny gives them
  (``MALLOC_TRIM_THRESHOLD_=65536``), and that plus ``DASK_DATASERVICE__MALLOC_TUNING=True``
  (workers and consumer).
- ``requests``: ``dataservice.client.request-bytes`` 32 MiB (the old default) vs 8 MiB, on the
  untuned cluster: GiB/s and the consumer's peak RSS.
- ``compression``: (a) simulation: a batch of 32 MiB (64 KiB elements, random doubles vs
  compressible int32 tokens) serialized and deserialized as a worker and a reader do, raw and
  with lz4; from the measured CPU seconds and bytes on the wire, the throughput over a link of
  ``--links`` rates, pipelined (``bytes / max(serialize, wire, deserialize)``); (b) the real
  read over loopback with ``dataservice.client.compression`` ``never`` vs ``always``.
- ``first``: time from ``iter(ds)`` to the first element with an in-process ``DispatchServer``
  and ``WorkerServer`` (``Dataset.range(1000)``, warm: registered and read once), median and
  p90 of ``--latency-runs``; with ``--profile``, a cProfile of 20 first elements on stderr.

Run from the repository root: ``.venv/bin/python benchmarks/data_plane.py [--only elements,first]
[--quick]``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from service import Cluster  # noqa: E402

import dask_dataservice as dds  # noqa: E402

BENCHES = ("elements", "plane", "malloc", "requests", "compression", "first")
MiB = 1 << 20
GiB = 1 << 30
TARGETS = {("elements", 65536): 1.5, ("elements", MiB): 2.5}


def emit(rec: dict) -> None:
    rec.setdefault("load", round(os.getloadavg()[0], 2))
    print(json.dumps(rec), flush=True)


def full(floats: int, i: int) -> np.ndarray:
    return np.full(floats, i, np.float32)


_SHARED: dict[int, np.ndarray] = {}


def shared(floats: int, i: int) -> np.ndarray:
    """A view of one array of ones for every element: the worker spends nothing making
    elements (the data plane alone). A view, not the array: pickle would send an object that
    a batch holds many times once."""
    arr = _SHARED.get(floats)
    if arr is None:
        arr = _SHARED[floats] = np.ones(floats, np.float32)
    return arr[:]


def parse_size(text: str) -> int:
    from dask.utils import parse_bytes

    return int(parse_bytes(text))


# The consumer: its own process (its RSS and malloc settings are its own)
##########################################################################


def consume(spec: dict) -> dict:
    from distributed import Client

    security = None
    if spec.get("tls"):
        from distributed.security import Security

        tls = spec["tls"]
        security = Security(tls_ca_file=tls["ca"], tls_client_cert=tls["cert"],
                            tls_client_key=tls["key"], require_encryption=True)
    with Client(spec["address"], set_as_default=False, security=security) as client:
        ds = dds.from_dataset_id("distributed_epoch", client, spec["dataset_id"])
        n = spec["n"]
        expect = (n, n if spec.get("ones") else n * (n - 1) // 2)
        seconds = []
        for _ in range(spec["runs"] + 1):  # the first read warms up
            t0 = time.perf_counter()
            count = total = 0
            for x in ds:
                count += 1
                total += int(x[0])
            seconds.append(time.perf_counter() - t0)
            if (count, total) != expect:
                raise SystemExit(f"read {(count, total)} (elements, checksum), expected {expect}")
    hwm = 0
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
    t = os.times()
    import resource

    return {"seconds": seconds[1:], "rss_peak": hwm, "cpu_s": round(t.user + t.system, 2),
            "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt}


class RssSampler:
    """Peak RSS of some processes, sampled every 10 ms in a thread while running, and the
    CPU seconds each used meanwhile."""

    def __init__(self, pids: dict[str, int]) -> None:
        import psutil

        self.procs = {k: psutil.Process(p) for k, p in pids.items()}
        self.peak = {k: 0 for k in pids}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="rss-sampler")

    def _run(self) -> None:
        while not self.stop.is_set():
            for k, p in self.procs.items():
                with contextlib.suppress(Exception):
                    self.peak[k] = max(self.peak[k], p.memory_info().rss)
            self.stop.wait(0.01)

    def _faults(self) -> dict[str, int]:
        out = {}
        for k, p in self.procs.items():
            with contextlib.suppress(Exception):
                out[k] = int(Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[7])
        return out

    def _cpu(self) -> dict[str, float]:
        out = {}
        for k, p in self.procs.items():
            with contextlib.suppress(Exception):
                t = p.cpu_times()
                out[k] = t.user + t.system
        return out

    def __enter__(self) -> RssSampler:
        self.cpu0 = self._cpu()
        self.faults0 = self._faults()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        cpu1 = self._cpu()
        faults1 = self._faults()
        self.faults = {k: faults1[k] - self.faults0[k] for k in faults1 if k in self.faults0}
        self.cpu_s = {k: round(cpu1[k] - self.cpu0[k], 2) for k in cpu1 if k in self.cpu0}


def read_in_subprocess(cluster: Cluster, dataset_id: object, n: int, runs: int,
                       env: dict[str, str] | None = None, ones: bool = False) -> dict:
    spec = {"address": cluster.client.scheduler.address, "dataset_id": dataset_id, "n": n,
            "runs": runs, "ones": ones, "tls": cluster.tls}
    pids = {k: v for k, v in cluster.pids().items() if k != "client"}
    with RssSampler(pids) as rss:
        proc = subprocess.run(
            [sys.executable, __file__, "--consume", json.dumps(spec)], capture_output=True,
            text=True, env=dict(os.environ, **(env or {})), timeout=600)
    if proc.returncode:
        raise SystemExit(f"consumer failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["rss_peak_mib"] = {"consumer": round(out.pop("rss_peak") / MiB),
                           **{k: round(v / MiB) for k, v in rss.peak.items()}}
    # CPU seconds of the consumer process's whole life (start-up and warm-up read included)
    out["cpu_s"] = {"consumer": out.pop("cpu_s"), **rss.cpu_s}
    out["faults"] = {"consumer": out.pop("minor_faults"), **rss.faults}
    return out


def set_worker_config(cluster: Cluster, settings: dict) -> None:
    import dask

    cluster.client.run(lambda: dask.config.set(settings) and None)


# Benchmarks
############


def elements_bench(args: argparse.Namespace, cluster: Cluster, workers: int,
                   bench: str = "elements", variants: dict | None = None) -> None:
    variants = variants or {"old": {"dataservice.worker.pack-bytes": 0},
                            "new": {"dataservice.worker.pack-bytes": "256 KiB"}}
    for size in args.sizes:
        n = max(64, args.bytes // size)
        ds = dds.Dataset.range(n).map(partial(full, size // 4))
        dataset_id = dds.register_dataset(cluster.client, ds)
        results: dict[str, list[dict]] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for name, settings in variants.items():
                set_worker_config(cluster, settings)
                results[name].append(read_in_subprocess(cluster, dataset_id, n, args.runs))
        report(bench, size, workers, n, results)


def report(bench: str, size: int, workers: int, n: int, results: dict[str, list[dict]],
           extra: dict | None = None) -> None:
    best = {}
    for name, rounds in results.items():
        secs = [s for r in rounds for s in r["seconds"]]
        best[name] = min(secs)
        rss = {k: max(r["rss_peak_mib"][k] for r in rounds) for k in rounds[0]["rss_peak_mib"]}
        rec = {"bench": bench, "variant": name, "element_bytes": size, "workers": workers,
               "mode": "DYNAMIC", "elements": n,
               "GiB_per_s": round(n * size / GiB / best[name], 3),
               "us_per_element": round(best[name] / n * 1e6, 1),
               "runs_GiB_per_s": [round(n * size / GiB / s, 3) for s in secs],
               "rss_peak_mib": rss, "cpu_s_per_consumer_process": rounds[-1]["cpu_s"],
               "minor_faults_per_consumer_process": rounds[-1].get("faults"),
               "reads_per_consumer_process": len(rounds[-1]["seconds"]) + 1,
               **(extra or {})}
        target = TARGETS.get((bench, size))
        if target is not None and bench == "elements":
            rec["target"] = f">= {target} GiB/s"
            rec["target_met"] = rec["GiB_per_s"] >= target
        emit(rec)
    names = list(results)
    for other in names[1:]:
        emit({"bench": bench, "element_bytes": size, "workers": workers,
              "speedup": round(best[names[0]] / best[other], 3), "of": f"{other} over {names[0]}"})


def malloc_bench(args: argparse.Namespace, clusters: dict[str, Cluster], workers: int) -> None:
    """1 MiB and 64 KiB elements from three clusters: workers as ``dask worker --no-nanny``
    starts them (glibc's adaptive mmap threshold), as a nanny starts them
    (``MALLOC_TRIM_THRESHOLD_=65536``, which fixes the thresholds: every block of 128 KiB or
    more is a fresh mmap), and nanny-like with ``dataservice.malloc-tuning``; the consumer is
    tuned with the tuned cluster (and, ``tuned_8MiB_requests``, reads with requests of 8 MiB:
    a reply under glibc's 32 MiB mmap ceiling is received into reused heap memory)."""
    tuned = {"DASK_DATASERVICE__MALLOC_TUNING": "True"}
    variants = {"no_nanny": ("untuned", {}), "nanny_env": ("nanny_env", {}),
                "tuned": ("tuned", tuned),
                "tuned_8MiB_requests": ("tuned", {**tuned,
                                                  "DASK_DATASERVICE__CLIENT__REQUEST_BYTES": "8MiB"})}
    for size in (MiB, 64 << 10):
        n = max(64, args.bytes // size)
        ds = dds.Dataset.range(n).map(partial(full, size // 4))
        ids = {k: dds.register_dataset(c.client, ds) for k, c in clusters.items()}
        results: dict[str, list[dict]] = {k: [] for k in variants}
        for _ in range(args.rounds):
            for name, (cluster, env) in variants.items():
                results[name].append(read_in_subprocess(clusters[cluster], ids[cluster], n,
                                                        args.runs, env))
        report("malloc", size, workers, n, results)


def requests_bench(args: argparse.Namespace, cluster: Cluster, workers: int) -> None:
    """``dataservice.client.request-bytes`` 32 MiB (the old default) vs 8 MiB: throughput and
    the consumer's peak RSS (replies in flight and batches queued are that big)."""
    variants = {"32MiB": {"DASK_DATASERVICE__CLIENT__REQUEST_BYTES": "32MiB"},
                "8MiB": {"DASK_DATASERVICE__CLIENT__REQUEST_BYTES": "8MiB"}}
    for size in args.sizes:
        n = max(64, args.bytes // size)
        dataset_id = dds.register_dataset(cluster.client,
                                          dds.Dataset.range(n).map(partial(full, size // 4)))
        results: dict[str, list[dict]] = {k: [] for k in variants}
        for _ in range(args.rounds):
            for name, env in variants.items():
                results[name].append(read_in_subprocess(cluster, dataset_id, n, args.runs, env))
        report("request-bytes", size, workers, n, results)


RAW_SENDER = """
import socket, sys
host, port, size, total = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
buf = bytearray(size)
with socket.create_connection((host, port)) as s:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(total // size):
        s.sendall(buf)
"""


def raw_loopback(size: int, total: int) -> tuple[float, dict[str, float]]:
    """GiB/s of raw loopback TCP between two processes: another process ``sendall``s
    ``size``-byte messages, this one ``recv_into``s one preallocated buffer (the machine's
    limit for the data plane); and the CPU seconds per GiB of each side."""
    import resource
    import socket

    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)

    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        total = total // size * size
        proc = subprocess.Popen([sys.executable, "-c", RAW_SENDER, "127.0.0.1", str(port),
                                 str(size), str(total)])
        conn, _ = server.accept()
        buf = memoryview(bytearray(size))
        got = 0
        t0 = time.perf_counter()
        cpu0 = time.thread_time()
        with conn:
            while got < total:
                n = conn.recv_into(buf[: min(size, total - got)])
                if not n:
                    break
                got += n
        seconds = time.perf_counter() - t0
        receiver = time.thread_time() - cpu0
        proc.wait(timeout=60)
    if got != total:
        raise SystemExit(f"raw loopback: received {got} of {total} bytes")
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    sender = (children.ru_utime - children0.ru_utime) + (children.ru_stime - children0.ru_stime)
    gib = total / GiB
    return gib / seconds, {"sender": round(sender / gib, 3), "receiver": round(receiver / gib, 3)}


def plane_bench(args: argparse.Namespace, cluster: Cluster, workers: int,
                tls: Cluster | None = None) -> None:
    """Issue 25, target 1: elements through distributed's comms (``client.fast-path`` false)
    against the workers' element ports, and raw loopback TCP in the same run (each round:
    raw, comms, streams). The consumer's peak RSS is set beside the bytes it may hold: its
    requests in flight (``workers x requests-per-task x request-bytes``) and its channel
    (``max-outstanding-batches`` batches of up to ``request-bytes``)."""
    import dask

    from dask_dataservice import config as dds_config

    variants = {"comms": {"DASK_DATASERVICE__CLIENT__FAST_PATH": "False"},
                "streams": {"DASK_DATASERVICE__CLIENT__FAST_PATH": "True"}}
    with dask.config.set({}):
        request_bytes = dds_config.get_bytes("client.request-bytes")
        depth = int(dds_config.get("client.requests-per-task"))
        outstanding = int(dds_config.get("client.max-outstanding-batches"))
    ones = args.plane_source == "shared"
    for size in args.sizes:
        n = max(64, args.bytes // size)
        make = shared if ones else full
        pipeline = dds.Dataset.range(n).map(partial(make, size // 4))
        dataset_id = dds.register_dataset(cluster.client, pipeline)
        tls_id = dds.register_dataset(tls.client, pipeline) if tls is not None else None
        results: dict[str, list[dict]] = {k: [] for k in variants}
        if tls is not None:
            results["tls"] = []
        raws = []
        raw_cpu: dict[str, float] = {}
        for _ in range(args.rounds):
            rate, raw_cpu = raw_loopback(min(size, MiB), args.bytes)
            raws.append(rate)
            for name, env in variants.items():
                results[name].append(read_in_subprocess(cluster, dataset_id, n, args.runs, env,
                                                        ones))
            if tls is not None:  # a TLS cluster's reads keep distributed's (TLS) comms
                results["tls"].append(read_in_subprocess(tls, tls_id, n, args.runs, None, ones))
        raw = max(raws)
        in_flight = min(n * size, (workers * depth + outstanding) * request_bytes)
        report("plane", size, workers, n, results,
               {"source": args.plane_source, "raw_loopback_GiB_per_s": round(raw, 3),
                "raw_runs_GiB_per_s": [round(r, 3) for r in raws],
                "raw_cpu_s_per_GiB": raw_cpu,
                "bytes_held_mib": round(in_flight / MiB)})
        for name, rounds in results.items():
            best = min(s for r in rounds for s in r["seconds"])
            emit({"bench": "plane", "element_bytes": size, "workers": workers, "variant": name,
                  "of_raw_loopback": round(n * size / GiB / best / raw, 3),
                  "target": {MiB: 0.9, 64 << 10: 0.7}.get(size)})


def compression_sim(args: argparse.Namespace) -> None:
    from distributed.protocol.core import dumps, loads

    from dask_dataservice.service.worker._worker_util import serialized_batch

    rng = np.random.default_rng(0)
    size, count = 64 << 10, 512
    kinds = {
        "random_f64": [rng.random(size // 8) for _ in range(count)],
        "tokens_i32": [rng.integers(0, 30_000, size // 4, dtype=np.int32) for _ in range(count)],
        "labels_i64": [rng.integers(0, 100, size // 8) for _ in range(count)],
        "constant_f32": [np.full(size // 4, i, np.float32) for i in range(count)],
    }
    raw_bytes = size * count
    for kind, items in kinds.items():
        for codec in (None, "lz4"):
            ser, de, wire = [], [], 0
            for _ in range(5):
                t0 = time.perf_counter()
                s = serialized_batch(None, items, codec)
                frames = dumps({"elements": s})
                t1 = time.perf_counter()
                wire = sum(memoryview(f).nbytes for f in frames)
                received = [bytearray(memoryview(f).cast("B")) for f in frames]
                t2 = time.perf_counter()
                loads(received)
                t3 = time.perf_counter()
                ser.append(t1 - t0)
                de.append(t3 - t2)
            t_ser, t_de = statistics.median(ser), statistics.median(de)
            links = {}
            for label, rate in args.links:
                t = max(t_ser, wire / rate, t_de)
                links[label] = round(raw_bytes / GiB / t, 3)
            emit({"bench": "compression-sim", "data": kind, "codec": codec,
                  "batch_bytes": raw_bytes, "wire_bytes": wire,
                  "ratio": round(wire / raw_bytes, 3),
                  "serialize_ms": round(t_ser * 1e3, 2), "deserialize_ms": round(t_de * 1e3, 2),
                  "GiB_per_s_by_link": links,
                  "model": "raw bytes / max(serialize, wire bytes / link rate, deserialize)"})


def compression_loopback(args: argparse.Namespace, cluster: Cluster, workers: int) -> None:
    size = 64 << 10
    n = max(64, args.bytes // size)
    ds = dds.Dataset.range(n).map(partial(full, size // 4))  # compressible
    dataset_id = dds.register_dataset(cluster.client, ds, compression="lz4")
    env = {"never": {"DASK_DATASERVICE__CLIENT__COMPRESSION": "never"},
           "always_lz4": {"DASK_DATASERVICE__CLIENT__COMPRESSION": "always"}}
    results: dict[str, list[dict]] = {k: [] for k in env}
    for _ in range(args.rounds):
        for name, e in env.items():
            results[name].append(read_in_subprocess(cluster, dataset_id, n, args.runs, e))
    report("compression-loopback", size, workers, n, results)


def first_bench(args: argparse.Namespace) -> None:
    from dask_dataservice.service.servers import (
        DispatcherConfig,
        DispatchServer,
        WorkerConfig,
        WorkerServer,
    )

    with DispatchServer(DispatcherConfig()) as d, \
            WorkerServer(WorkerConfig(d.target)), WorkerServer(WorkerConfig(d.target)):
        from distributed import Client

        with Client(d.target, set_as_default=False) as client:
            n = 1000
            deadline = time.monotonic() + 30
            while len(client.run_on_scheduler(
                    lambda dask_scheduler: list(dask_scheduler.workers))) < 2:
                if time.monotonic() > deadline:
                    raise SystemExit("the in-process workers did not join")
                time.sleep(0.05)
            for mode in ("off", "distributed_epoch"):
                sds = dds.Dataset.range(n).apply(dds.distribute(mode, client))
                assert sum(sds) == n * (n - 1) // 2 * (2 if mode == "off" else 1)  # warm

                def one() -> float:
                    t0 = time.perf_counter()
                    it = iter(sds)  # noqa: B023 - read at once
                    next(it)
                    t1 = time.perf_counter()
                    for _ in it:
                        pass
                    return (t1 - t0) * 1e3

                vals = sorted(one() for _ in range(args.latency_runs))
                emit({"bench": "first", "mode": mode.upper(), "workers": 2,
                      "dispatcher": "in-process DispatchServer",
                      "ms_median": round(statistics.median(vals), 2),
                      "ms_p90": round(vals[int(0.9 * (len(vals) - 1))], 2),
                      "ms_min": round(vals[0], 2), "runs": len(vals),
                      "target": "<= 3 ms", "target_met": statistics.median(vals) <= 3})
                if args.profile:
                    prof = cProfile.Profile()
                    prof.enable()
                    for _ in range(20):
                        next(iter(sds))
                    prof.disable()
                    st = pstats.Stats(prof, stream=sys.stderr)
                    print(f"===== first element, {mode}, 20 reads =====", file=sys.stderr)
                    st.sort_stats("cumulative").print_stats(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=",".join(BENCHES))
    parser.add_argument("--sizes", default="4KiB,64KiB,1MiB")
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--bytes", default="512MiB", help="bytes per read")
    parser.add_argument("--runs", type=int, default=3, help="timed reads per consumer process")
    parser.add_argument("--rounds", type=int, default=2, help="old/new alternations")
    parser.add_argument("--links", default="1Gb/s,10Gb/s,25Gb/s")
    parser.add_argument("--plane-tls", action="store_true",
                        help="plane: also read from a TLS cluster (distributed's TLS comms)")
    parser.add_argument("--plane-source", choices=("fresh", "shared"), default="fresh",
                        help="plane: each element a new array (np.full), or one shared array "
                             "(the worker makes nothing: the data plane alone)")
    parser.add_argument("--latency-runs", type=int, default=50)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--quick", action="store_true", help="64 MiB per read, 1 round")
    parser.add_argument("--consume", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.consume:
        print(json.dumps(consume(json.loads(args.consume))), flush=True)
        return
    if args.quick:
        args.bytes, args.rounds, args.runs, args.latency_runs = "64MiB", 1, 2, 10
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    args.bytes = parse_size(args.bytes)
    worker_counts = [int(w) for w in args.workers.split(",")]
    args.links = [(label, _link_rate(label)) for label in args.links.split(",")]
    only = set(args.only.split(","))
    emit({"run": "data_plane", "cpus": os.cpu_count(), "sizes": args.sizes,
          "bytes_per_read": args.bytes, "rounds": args.rounds, "runs": args.runs,
          "python": sys.version.split()[0], "numpy": np.__version__,
          "commit": _git("rev-parse", "--short", "HEAD"), "uptime": _uptime()})
    if "compression" in only:
        compression_sim(args)
    if "first" in only:
        first_bench(args)
    if only & {"elements", "plane", "malloc", "requests", "compression"}:
        clusters = {"untuned": Cluster()}
        if "plane" in only and args.plane_tls:
            clusters["tls"] = Cluster(tls=True)
        if "malloc" in only:
            nanny = {"MALLOC_TRIM_THRESHOLD_": "65536"}  # what distributed's nanny sets
            clusters["nanny_env"] = Cluster()
            clusters["tuned"] = Cluster()
            clusters["nanny_env"].env.update(nanny)
            clusters["tuned"].env.update(nanny, DASK_DATASERVICE__MALLOC_TUNING="True")
        try:
            for c in clusters.values():
                c.start()
            for workers in worker_counts:
                for c in clusters.values():
                    while len(c.workers) < workers:
                        c.add_worker()
                if "elements" in only:
                    elements_bench(args, clusters["untuned"], workers)
                if "plane" in only:
                    plane_bench(args, clusters["untuned"], workers, clusters.get("tls"))
                if "malloc" in only:
                    malloc_bench(args, clusters, workers)
                if "requests" in only:
                    requests_bench(args, clusters["untuned"], workers)
                if "compression" in only:
                    compression_loopback(args, clusters["untuned"], workers)
        finally:
            for c in clusters.values():
                c.close()


def _link_rate(label: str) -> float:
    """Bytes per second of "10Gb/s" (decimal bits) or "1GB/s" (decimal bytes)."""
    units = {"K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    num = label.removesuffix("/s")
    bits = num.endswith("b")
    num = num[:-1]
    scale = units.get(num[-1], 1.0)
    value = float(num[:-1] if num[-1] in units else num) * scale
    return value / 8 if bits else value


def _git(*cmd: str) -> str:
    with contextlib.suppress(Exception):
        return subprocess.run(["git", *cmd], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    return ""


def _uptime() -> str:
    with contextlib.suppress(Exception):
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return ""


if __name__ == "__main__":
    main()
