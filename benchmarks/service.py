"""The data service end to end: a scheduler and data workers in separate processes.

Prints one JSON object per line on stdout. The first line describes the run (machine,
versions, sizes, targets); then one line per measurement, and a last ``summary`` line::

    {"bench": "W1", "mode": "DYNAMIC", "workers": 2, "metric": "elements_per_s",
     "value": ..., "local": ..., "ratio": ..., "target": ">= 150000 elements/s",
     "target_met": true, "tf_data_service": 2300, "cpu_s": {...}, ...}

- ``value``: the figure through the service: best of ``runs`` reads for rates (after one
  untimed, checked warm-up read, except W3; every run is in ``runs_values``, with the CPU
  other processes used meanwhile in ``runs_other_processes_cpu_s``), median for latencies.
- ``local``: the same figure for the same pipeline iterated locally in this process, in the
  same run (best of as many runs; one for W3).
- ``ratio = value / local``. For rates, > 1 means the service is faster than iterating the
  pipeline locally; for latencies, how many times longer the service takes.
- ``cpu_s``: CPU seconds of the client (this process), the scheduler and each worker during
  the best read (its wall time is ``seconds``); ``other_processes``: CPU seconds the rest of
  the machine used meanwhile (noise on a shared machine); ``page_faults_k``: minor page
  faults, in thousands, per process; ``noisy``: other processes used more than 10% of a
  core during the best read, so the figure understates the service. With 2 cores shared by the client, the scheduler and
  two workers, CPU is often what bounds a figure: compare the sum with ``cores * seconds``.
- ``tf_data_service``: tf.data service 2.21 on the same machine, for comparison.

Every read is checked: element count and sum (each element exactly once under DYNAMIC).

Workloads:

- W1: ``Dataset.range(200_000)``, scalar elements: 1 worker OFF, 2 workers DYNAMIC (and 1
  worker DYNAMIC, no target) — elements/s.
- W1b: the same ``.batch(256)`` — batches/s (``elements / 256`` per second: under DYNAMIC
  each worker may end with a short batch), 1 worker OFF and 2 workers DYNAMIC.
- W2: ``Dataset.range(2000).map(lambda i: np.full(262144, i, np.float32))`` (1 MiB elements)
  — GiB/s: 1 worker OFF, 1 and 2 workers DYNAMIC.
- W3: ``Dataset.range(2000).map(work)``, ``work`` ~5 ms of single-threaded numpy (calibrated
  at start, see the ``W3-calibration`` line) — elements/s with 1 and 2 workers DYNAMIC (best
  of 3 reads), and ``W3-scaling``, the 2-worker / 1-worker ratio.
- W4: on a warm cluster (dataset registered and read once), ``Dataset.range(1000)``: time
  from ``iter(ds)`` to the first element, and from the last element to ``StopIteration``:
  median, p90, min and max of ``--latency-runs`` reads (1 worker OFF, 2 workers DYNAMIC).

The cluster: ``dask scheduler`` and ``dask worker --nthreads 1 --no-nanny`` processes
started with ``--preload dask_dataservice`` on 127.0.0.1 (and a watchdog preload that ends
them if this script dies). The 1-worker measurements run first; a second worker then joins
for the 2-worker ones. Every process is stopped at the end, also on Ctrl-C, SIGTERM and
errors. A full run takes about 1-2 minutes on 2 cores.

Options: ``--quick`` (small sizes: a smoke run, whose figures are not comparable with the
targets), ``--only W1,W2``, ``--runs N``, ``--latency-runs N``, ``--settle S`` (before each
timed read, wait up to S seconds, default 2, for other processes to leave the CPU alone),
``--malloc-tuning`` (glibc keeps freed buffers in every process: what page faults cost W2),
``--profile`` (one more read of W1 OFF/DYNAMIC, W2 and W3 DYNAMIC under cProfile in this
process and a stack sampler in the workers and the scheduler; reports go to stderr),
``--check`` (exit status 1 if a target is missed; 0 otherwise, even when one is missed).
"""

from __future__ import annotations

import os

# One thread per process for numpy's BLAS: the machine has few cores and W3 must measure
# worker parallelism, not BLAS threads. Set before numpy is imported (workers inherit it).
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import cProfile  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import pstats  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterable  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

import dask_dataservice as dds  # noqa: E402
from dask_dataservice.data import Dataset  # noqa: E402

GiB = 1 << 30
ELEMENT_FLOATS = 262_144  # 1 MiB of float32
W3_TARGET_MS = 5.0
WORKLOADS = ("W1", "W1b", "W2", "W3", "W4")
#: What --profile profiles (one extra read each, after the measured ones).
PROFILED = {("W1", "OFF"), ("W1", "DYNAMIC"), ("W2", "DYNAMIC"), ("W3", "DYNAMIC")}

#: name -> (target text, predicate on the value, tf.data service 2.21 on this machine)
TARGETS: dict[tuple, tuple[str, Callable[[float], bool], object]] = {
    ("W1", "OFF", 1): (">= 150000 elements/s", lambda v: v >= 150_000, 3100),
    ("W1", "DYNAMIC", 2): (">= 150000 elements/s", lambda v: v >= 150_000, 2300),
    ("W1b", "DYNAMIC", 2): (">= 3000 batches/s", lambda v: v >= 3000, 28),
    ("W2", "DYNAMIC", 1): (">= 1.5 GiB/s", lambda v: v >= 1.5, "1.0-1.2"),
    ("W2", "DYNAMIC", 2): (">= 1.5 GiB/s", lambda v: v >= 1.5, "1.0-1.2"),
    ("W2", "OFF", 1): (">= 1.5 GiB/s", lambda v: v >= 1.5, "1.0-1.2"),
    ("W3-scaling", "DYNAMIC", 2): (">= 1.6x", lambda v: v >= 1.6, 1.4),
    ("W4-first", "OFF", 1): ("<= 20 ms", lambda v: v <= 20, 36),
    ("W4-first", "DYNAMIC", 2): ("<= 20 ms", lambda v: v <= 20, 36),
    ("W4-end", "OFF", 1): ("<= 20 ms", lambda v: v <= 20, "~1000"),
    ("W4-end", "DYNAMIC", 2): ("<= 20 ms", lambda v: v <= 20, "~1000"),
}

SIZES = {
    "full": {"w1": 200_000, "w2": 2000, "w3": 2000, "w4": 1000, "runs": 3, "w3_runs": 3,
             "latency_runs": 20},
    "quick": {"w1": 50_000, "w2": 300, "w3": 200, "w4": 1000, "runs": 1, "w3_runs": 1,
              "latency_runs": 5},
}


MISSED: list[str] = []
NOISY: list[str] = []


#: glibc settings of ``--malloc-tuning``: no mmap per large block, no eager trimming.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
              "MALLOC_TOP_PAD_": str(64 << 20)}


def tune_malloc() -> None:
    """Apply MALLOC_ENV here (mallopt) and in the servers started later (environment)."""
    import ctypes

    os.environ.update(MALLOC_ENV)
    libc = ctypes.CDLL("libc.so.6")
    for param, key in ((-3, "MALLOC_MMAP_THRESHOLD_"), (-1, "MALLOC_TRIM_THRESHOLD_"),
                       (-2, "MALLOC_TOP_PAD_")):
        if not libc.mallopt(param, int(MALLOC_ENV[key])):
            raise RuntimeError(f"mallopt({key}) failed")


def emit(record: dict) -> None:
    if record.get("target_met") is False:
        MISSED.append(f"{record['bench']} {record.get('mode')} {record.get('workers')}w")
    print(json.dumps(record), flush=True)


def note(msg: str) -> None:
    print(f"[service.py] {msg}", file=sys.stderr, flush=True)


# Pipelines (module-level so cloudpickle ships them by value from __main__)
###########################################################################


def make_1mib(i):
    return np.full(ELEMENT_FLOATS, i, np.float32)


def make_work(reps: int) -> Callable[[int], float]:
    """~``reps`` x 2 elementwise numpy passes over 32k float64 (single-threaded numpy)."""

    def work(i):
        a = np.full(32_768, 1.0 + (i % 7) * 1e-3)
        for _ in range(reps):
            a = np.sqrt(a * 1.000001 + 0.25)
        return i, float(a[0])

    return work


def _ms_per_call(fn: Callable[[int], object], batches: int = 5, calls: int = 8) -> float:
    """The fastest of ``batches`` batches, per call: robust to other processes' bursts."""
    best = float("inf")
    for _ in range(batches):
        t0 = time.perf_counter()
        for i in range(calls):
            fn(i)
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1000


def calibrate_work(target_ms: float) -> tuple[int, float]:
    reps = 20
    for _ in range(3):
        fn = make_work(reps)
        fn(0)
        reps = max(1, round(reps * target_ms / _ms_per_call(fn)))
    return reps, _ms_per_call(make_work(reps))


# Consumers: the same loop reads the local pipeline and the service
####################################################################


def consume_scalars(it: Iterable) -> tuple[int, int]:
    n = s = 0
    for x in it:
        n += 1
        s += x
    return n, s


def consume_batches(it: Iterable) -> tuple[int, int]:
    """(elements, their sum): under DYNAMIC each worker may end with a short batch."""
    n = s = 0
    for x in it:
        n += len(x)
        s += int(x.sum())
    return n, s


def consume_arrays(it: Iterable) -> tuple[int, int]:
    """(elements, sum of the first value of each): enough to check exactly-once."""
    n = s = 0
    for x in it:
        n += 1
        s += int(x[0])
    return n, s


def consume_pairs(it: Iterable) -> tuple[int, int]:
    n = s = 0
    for i, _ in it:
        n += 1
        s += i
    return n, s


# The cluster: scheduler and workers as subprocesses
####################################################


WATCHDOG_PRELOAD = """\
import os, threading, time

_PARENT = int(os.environ["DDS_BENCH_PARENT"])


def _watch():
    while True:
        time.sleep(1)
        if os.getppid() != _PARENT:
            os._exit(1)


def dask_setup(server):
    threading.Thread(target=_watch, name="bench-watchdog", daemon=True).start()
"""


class Cluster:
    """A scheduler and single-threaded workers, each its own process group on 127.0.0.1."""

    def __init__(self, tls: bool = False) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="dds-bench-"))
        self.scheduler_file = self.dir / "scheduler.json"
        #: ``{"ca", "cert", "key"}`` files of a TLS cluster (every connection mutual TLS).
        self.tls: dict[str, str] | None = self._certs() if tls else None
        self.procs: list[subprocess.Popen] = []
        self.workers: list[subprocess.Popen] = []
        self.scheduler: subprocess.Popen | None = None
        self.client = None
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", DDS_BENCH_PARENT=str(os.getpid()))

    def _certs(self) -> dict[str, str]:
        from distributed.security import Security

        sec = Security.temporary()
        paths = {}
        for name, text in (("ca", sec.tls_ca_file), ("cert", sec.tls_scheduler_cert),
                           ("key", sec.tls_scheduler_key)):
            path = self.dir / f"{name}.pem"
            path.write_text(text)
            path.chmod(0o600)
            paths[name] = str(path)
        return paths

    def tls_args(self) -> list[str]:
        if self.tls is None:
            return []
        return ["--tls-ca-file", self.tls["ca"], "--tls-cert", self.tls["cert"],
                "--tls-key", self.tls["key"]]

    def security(self):  # noqa: ANN201 - distributed.Security or None
        if self.tls is None:
            return None
        from distributed.security import Security

        return Security(tls_ca_file=self.tls["ca"], tls_client_cert=self.tls["cert"],
                        tls_client_key=self.tls["key"], require_encryption=True)

    def _watchdog(self) -> str:
        """A preload that ends a server whose parent (this script) went away, even by SIGKILL."""
        path = self.dir / "bench_watchdog.py"
        if not path.exists():
            path.write_text(WATCHDOG_PRELOAD)
        return str(path)

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.dir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            [sys.executable, "-m", "dask", *args], stdout=log, stderr=subprocess.STDOUT,
            env=self.env, start_new_session=True, cwd=self.dir,
        )
        proc.log = log  # type: ignore[attr-defined]
        proc.name = name  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def log_tail(self, n: int = 30) -> str:
        out = []
        for p in self.procs:
            text = (self.dir / f"{p.name}.log").read_text(errors="replace").splitlines()
            out.append(f"--- {p.name} (exit {p.poll()}) ---\n" + "\n".join(text[-n:]))
        return "\n".join(out)

    def start(self, timeout: float = 60) -> str:
        self.scheduler = self._spawn("scheduler", [
            "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
            "--scheduler-file", str(self.scheduler_file), "--preload", "dask_dataservice",
            "--preload", self._watchdog(), *self.tls_args(),
            *(["--protocol", "tls"] if self.tls else []),
        ])
        deadline = time.monotonic() + timeout
        while True:
            if self.scheduler.poll() is not None:
                raise RuntimeError("the scheduler exited:\n" + self.log_tail())
            try:
                address = json.loads(self.scheduler_file.read_text())["address"]
                break
            except (FileNotFoundError, json.JSONDecodeError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the scheduler did not start:\n" + self.log_tail())
            time.sleep(0.05)
        from distributed import Client

        self.client = Client(address, set_as_default=False, timeout="30s",
                             security=self.security())
        return address

    def add_worker(self, timeout: float = 60) -> None:
        i = len(self.workers)
        self.workers.append(self._spawn(f"worker-{i}", [
            "worker", "--scheduler-file", str(self.scheduler_file), "--host", "127.0.0.1",
            "--nthreads", "1", "--nworkers", "1", "--no-nanny", "--no-dashboard",
            "--name", f"data-{i}", "--preload", "dask_dataservice", "--preload", self._watchdog(),
            *self.tls_args(),
        ]))
        n = len(self.workers)
        deadline = time.monotonic() + timeout
        # Wait until the dispatcher has registered every worker (its first heartbeat):
        # only registered workers get tasks of new iterations.
        while True:
            for p in self.workers:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.name} exited:\n" + self.log_tail())
            state = self.dispatcher_state()
            if state is not None and len(state.get("workers", ())) >= n:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{n} workers did not register:\n" + self.log_tail())
            time.sleep(0.05)

    def dispatcher_state(self) -> dict | None:
        async def get():
            return await self.client.scheduler.dataservice_state()

        return self.client.sync(get)

    def worker_states(self) -> dict:
        async def get():
            out = {}
            for addr in self.client.scheduler_info(n_workers=-1)["workers"]:
                out[addr] = await self.client.rpc(addr).dataservice_worker_state()
            return out

        return self.client.sync(get)

    def wait_idle(self, timeout: float = 10) -> None:
        """Until the dispatcher has no iteration with clients and workers run no task."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.dispatcher_state() or {}
            busy = any(it["num_clients"] for it in state.get("iterations", {}).values())
            if not busy and not any(s["tasks"] for s in self.worker_states().values()):
                return
            time.sleep(0.02)
        note("cluster still busy after the previous read; measuring anyway")

    def pids(self) -> dict[str, int]:
        out = {"client": os.getpid()}
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.pid
        for i, p in enumerate(self.workers):
            out[f"worker-{i}"] = p.pid
        return out

    def close(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close(timeout=5)
            self.client = None
        for p in reversed(self.procs):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in reversed(self.procs):
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
            p.log.close()
        self.procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


class CpuMeter:
    """CPU seconds used by each process of the run between start() and stop()."""

    def __init__(self, pids: dict[str, int]):
        import psutil

        self.procs = {}
        for name, pid in pids.items():
            with contextlib.suppress(Exception):
                self.procs[name] = psutil.Process(pid)
        self.t0: dict[str, float] = {}
        self.faults: dict[str, int] = {}

    def _read(self) -> dict[str, float]:
        out = {}
        for name, p in self.procs.items():
            with contextlib.suppress(Exception):
                t = p.cpu_times()
                out[name] = t.user + t.system
        return out

    @staticmethod
    def _machine() -> tuple[float, float]:
        """(busy, steal) CPU seconds of the whole machine so far."""
        import psutil

        t = psutil.cpu_times()
        idle = t.idle + getattr(t, "iowait", 0.0)
        return sum(t) - idle, getattr(t, "steal", 0.0)

    def _faults(self) -> dict[str, int]:
        """Minor page faults so far per process (Linux; empty elsewhere)."""
        out = {}
        for name, p in self.procs.items():
            with contextlib.suppress(Exception):
                stat = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
                out[name] = int(stat[7])
        return out

    def start(self) -> None:
        self.m0 = self._machine()
        self.f0 = self._faults()
        self.t0 = self._read()

    def stop(self) -> dict[str, float]:
        t1 = self._read()
        f1 = self._faults()
        m1 = self._machine()
        out = {k: round(t1[k] - self.t0[k], 3) for k in t1 if k in self.t0}
        self.faults = {k: f1[k] - self.f0[k] for k in f1 if k in self.f0}
        # CPU that other processes of the machine used meanwhile (noise on a shared box)
        ours = sum(out.values())
        out["other_processes"] = round(max(0.0, m1[0] - self.m0[0] - ours), 3)
        if m1[1] - self.m0[1] > 0:
            out["steal"] = round(m1[1] - self.m0[1], 3)
        return out


# Measuring
###########


def timed_read(make_iter: Callable[[], Iterable], consume, meter: CpuMeter | None = None):
    if meter is not None:
        meter.start()
    t0 = time.perf_counter()
    result = consume(make_iter())
    seconds = time.perf_counter() - t0
    cpu = meter.stop() if meter is not None else None
    if meter is not None:
        cpu = dict(cpu, page_faults_k={k: round(v / 1000, 1) for k, v in meter.faults.items()})
    return seconds, result, cpu


def best_of(make_iter, consume, runs: int, expect, meter=None, what="") -> dict:
    out = []
    for _ in range(runs):
        seconds, result, cpu = timed_read(make_iter, consume, meter)
        if expect is not None and result != expect:
            raise SystemExit(f"{what}: read {result} (elements, checksum), expected {expect}")
        out.append((seconds, cpu))
    best = min(out, key=lambda x: x[0])
    return {"seconds": best[0], "cpu_s": best[1], "all_seconds": [s for s, _ in out]}


class Bench:
    def __init__(self, args, sizes: dict):
        self.args = args
        self.sizes = sizes
        self.runs = args.runs or sizes["runs"]
        self.w3_runs = args.runs or sizes["w3_runs"]
        self.cluster: Cluster | None = None
        self.local_cache: dict[str, dict] = {}
        self.w3_reps = None
        self.w3_rates: dict[int, float] = {}
        self.w3_noisy: dict[int, bool] = {}
        self.profiles: list[tuple[str, str]] = []
        self.settle_s = 0.0
        self.unsettled = 0

    # -- pipelines -----------------------------------------------------------------------
    def pipeline(self, name: str) -> tuple[Dataset, Callable, tuple, Callable[[float], float], str]:
        """(dataset, consumer, expected result, seconds -> figure, metric) of a workload."""
        s = self.sizes
        if name == "W1":
            n = s["w1"]
            return (Dataset.range(n), consume_scalars, (n, n * (n - 1) // 2),
                    lambda sec: n / sec, "elements_per_s")
        if name == "W1b":
            n = s["w1"]
            nb = n / 256  # batches of 256 elements (a worker's last batch may be short)
            return (Dataset.range(n).batch(256), consume_batches, (n, n * (n - 1) // 2),
                    lambda sec: nb / sec, "batches_per_s")
        if name == "W2":
            n = s["w2"]
            return (Dataset.range(n).map(make_1mib), consume_arrays, (n, n * (n - 1) // 2),
                    lambda sec: n * ELEMENT_FLOATS * 4 / GiB / sec, "GiB_per_s")
        if name == "W3":
            n = s["w3"]
            return (Dataset.range(n).map(make_work(self.w3_reps)), consume_pairs,
                    (n, n * (n - 1) // 2), lambda sec: n / sec, "elements_per_s")
        raise KeyError(name)

    def local(self, name: str) -> dict:
        if name not in self.local_cache:
            ds, consume, expect, figure, _ = self.pipeline(name)
            runs = 1 if name == "W3" else self.runs  # W3: one local read is 10 s
            r = best_of(lambda: iter(ds), consume, runs, expect, what=f"{name} local")
            r["value"] = figure(r["seconds"])
            self.local_cache[name] = r
        return self.local_cache[name]

    def settle(self) -> None:
        """Wait (at most ``--settle`` s) until other processes leave the cores alone.

        The machine may be shared (tests of other sessions...): a timed read starts once
        processes outside this run used < 25% of one core over 0.25 s, or at the deadline.
        """
        if self.args.settle <= 0:
            return
        meter = CpuMeter(self.cluster.pids())
        t0 = time.perf_counter()
        while True:
            meter.start()
            time.sleep(0.25)
            if meter.stop().get("other_processes", 0.0) < 0.25 * 0.25:
                break
            if time.perf_counter() - t0 > self.args.settle:
                self.unsettled += 1
                break
        self.settle_s += time.perf_counter() - t0

    # -- throughput ----------------------------------------------------------------------
    def throughput(self, name: str, mode: str, workers: int, target: bool = True) -> None:
        c = self.cluster
        ds, consume, expect, figure, metric = self.pipeline(name)
        local = self.local(name)
        sds = ds.apply(dds.distribute(mode, c.client))
        runs = self.w3_runs if name == "W3" else self.runs
        if name != "W3":  # warm-up: the workers load the dataset once (untimed, checked)
            c.wait_idle()
            best_of(lambda: iter(sds), consume, 1, expect, what=f"{name} {mode} warm-up")
        meter = CpuMeter(c.pids())
        results = []
        for _ in range(runs):
            c.wait_idle()
            self.settle()
            results.append(best_of(lambda: iter(sds), consume, 1, expect, meter,
                                   what=f"{name} {mode} {workers}w"))
        best = min(results, key=lambda r: r["seconds"])
        value = figure(best["seconds"])
        rec = {
            "bench": name, "mode": mode, "workers": workers, "metric": metric,
            "value": _round(value), "local": _round(local["value"]),
            "ratio": round(value / local["value"], 4),
            "seconds": round(best["seconds"], 4),
            "runs_values": [_round(figure(r["seconds"])) for r in results],
            "runs_other_processes_cpu_s": [r["cpu_s"].get("other_processes") for r in results],
            "cpu_s": best["cpu_s"],
        }
        # Other processes used > 10% of a core during the best read: the figure is suspect.
        rec["noisy"] = bool((best["cpu_s"] or {}).get("other_processes", 0) > 0.1 * best["seconds"])
        if rec["noisy"]:
            NOISY.append(f"{name} {mode} {workers}w")
        if name == "W3":
            self.w3_noisy[workers] = rec["noisy"]
            self.w3_rates[workers] = value
            rec["ms_per_element_local"] = round(1000 / local["value"], 2)
        self._target(rec, (name, mode, workers) if target else None)
        emit(rec)
        if self.args.profile and (name, mode) in PROFILED:
            self.profile(f"{name} {mode} {workers}w", sds, consume)

    def w3_scaling(self) -> None:
        if 1 in self.w3_rates and 2 in self.w3_rates:
            v = self.w3_rates[2] / self.w3_rates[1]
            rec = {"bench": "W3-scaling", "mode": "DYNAMIC", "workers": 2,
                   "metric": "2-worker / 1-worker elements_per_s", "value": round(v, 3),
                   "local": 1.0, "ratio": round(v, 3),
                   "ideal_on_this_machine": "2.0 minus what the client and scheduler take from 2 cores",
                   "noisy": any(self.w3_noisy.values())}
            self._target(rec, ("W3-scaling", "DYNAMIC", 2))
            emit(rec)

    # -- latency -------------------------------------------------------------------------
    def latency(self, mode: str, workers: int) -> None:
        c = self.cluster
        n = self.sizes["w4"]
        ds = Dataset.range(n)
        sds = ds.apply(dds.distribute(mode, c.client))
        c.wait_idle()
        assert consume_scalars(sds) == (n, n * (n - 1) // 2)  # warm: registered and read once

        def one(d, pause: bool) -> tuple[float, float]:
            if pause:
                c.wait_idle()
                time.sleep(0.02)
            t0 = time.perf_counter()
            it = iter(d)
            first = next(it)
            t1 = time.perf_counter()
            count, total, last_t = 1, first, t1
            for x in it:
                last_t = time.perf_counter()
                count += 1
                total += x
            t_end = time.perf_counter()
            if (count, total) != (n, n * (n - 1) // 2):
                raise SystemExit(f"W4 {mode}: read {count} elements (sum {total})")
            return (t1 - t0) * 1000, (t_end - last_t) * 1000

        local = [one(ds, False) for _ in range(self.sizes["latency_runs"])]
        self.settle()
        svc = [one(sds, True) for _ in range(self.sizes["latency_runs"])]
        for k, what in ((0, "W4-first"), (1, "W4-end")):
            vals = [r[k] for r in svc]
            lvals = [r[k] for r in local]
            med, lmed = statistics.median(vals), statistics.median(lvals)
            rec = {
                "bench": what, "mode": mode, "workers": workers,
                "metric": "ms from iter(ds) to the first element" if k == 0
                else "ms from the last element to StopIteration",
                "value": round(med, 3), "p90": round(_p90(vals), 3),
                "min": round(min(vals), 3), "max": round(max(vals), 3),
                "local": round(lmed, 4), "ratio": round(med / lmed, 1) if lmed else None,
                "elements": n, "runs": len(vals),
            }
            self._target(rec, (what, mode, workers))
            emit(rec)

    # -- helpers -------------------------------------------------------------------------
    @staticmethod
    def _target(rec: dict, key) -> None:
        spec = TARGETS.get(key) if key else None
        if spec is None:
            rec["target"] = None
            return
        text, ok, tf = spec
        rec["target"] = text
        rec["target_met"] = bool(ok(rec["value"]))
        rec["tf_data_service"] = tf

    def profile(self, label: str, sds, consume) -> None:
        """One more read with cProfile here and a stack sampler in every server process."""
        c = self.cluster
        c.wait_idle()
        c.client.run(_sampler_start)
        c.client.run_on_scheduler(_sampler_start)
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        consume(iter(sds))
        prof.disable()
        seconds = time.perf_counter() - t0
        workers = c.client.run(_sampler_stop)
        sched = c.client.run_on_scheduler(_sampler_stop)
        buf = io.StringIO()
        buf.write(f"\n===== profile: {label}: one read took {seconds:.3f} s =====\n")
        buf.write("--- client process, cProfile (main thread), by own time ---\n")
        st = pstats.Stats(prof, stream=buf)
        st.sort_stats("tottime").print_stats(12)
        buf.write("--- client process, by cumulative time ---\n")
        st.sort_stats("cumulative").print_stats(12)
        buf.write(_format_samples("scheduler", sched))
        for addr, rep in sorted(workers.items()):
            buf.write(_format_samples(f"worker {addr}", rep))
        buf.write("--- worker states ---\n" + json.dumps(c.worker_states(), default=str) + "\n")
        text = buf.getvalue()
        print(text, file=sys.stderr, flush=True)
        self.profiles.append((label, text))


def _round(v: float) -> float:
    return round(v, 3) if v < 100 else round(v)


def _p90(vals: list[float]) -> float:
    s = sorted(vals)
    return s[min(len(s) - 1, int(round(0.9 * (len(s) - 1))))]


# Stack sampler, run in the server processes with client.run (a py-spy stand-in)
################################################################################


def _package_path() -> str:
    import dask_dataservice

    return dask_dataservice.__file__


def _sampler_start(interval: float = 0.002, dask_worker=None, dask_scheduler=None):
    import collections
    import sys as _sys
    import threading
    import time as _time

    server = dask_worker or dask_scheduler
    state = {"stop": False, "samples": 0, "threads": collections.Counter(),
             "self": collections.Counter(), "incl": collections.Counter(),
             "cpu0": _time.process_time(), "t0": _time.perf_counter()}

    def loop():
        me = threading.get_ident()
        while not state["stop"]:
            names = {t.ident: t.name for t in threading.enumerate()}
            for tid, frame in _sys._current_frames().items():
                if tid == me:
                    continue
                name = names.get(tid, str(tid))
                name = "dds-task" if name.startswith("dds-task") else name
                state["threads"][name] += 1
                f, seen, depth = frame, set(), 0
                leaf = f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno}:{f.f_code.co_name}"
                state["self"][(name, leaf)] += 1
                while f is not None and depth < 60:
                    key = f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_code.co_name}"
                    if key not in seen:
                        seen.add(key)
                        state["incl"][(name, key)] += 1
                    f, depth = f.f_back, depth + 1
            state["samples"] += 1
            _time.sleep(interval)

    th = threading.Thread(target=loop, name="bench-sampler", daemon=True)
    server._bench_sampler = (state, th)
    th.start()
    return True


def _sampler_stop(dask_worker=None, dask_scheduler=None):
    import time as _time

    server = dask_worker or dask_scheduler
    state, th = server._bench_sampler
    state["stop"] = True
    th.join()
    del server._bench_sampler
    return {
        "samples": state["samples"],
        "wall_s": _time.perf_counter() - state["t0"],
        "cpu_s": _time.process_time() - state["cpu0"],  # includes the sampler's own cost
        "threads": dict(state["threads"]),
        "self": [(k[0], k[1], v) for k, v in state["self"].most_common(40)],
        "incl": [(k[0], k[1], v) for k, v in state["incl"].most_common(80)],
    }


def _format_samples(label: str, rep: dict) -> str:
    """Per busy thread: where its samples were (leaf frame, and functions on the stack)."""
    n = max(1, rep["samples"])
    lines = [f"--- {label}: {rep['samples']} samples over {rep['wall_s']:.2f} s, "
             f"process CPU {rep['cpu_s']:.2f} s (sampler included) ---"]
    for thread, count in sorted(rep["threads"].items(), key=lambda x: -x[1]):
        own = [(leaf, v) for t, leaf, v in rep["self"] if t == thread]
        if count < n * 0.5 or (own and own[0][1] >= 0.98 * count):
            continue  # a thread that did one thing all along (idle pools, dask's profiler)
        lines.append(f"  thread {thread}: own (leaf frame), % of samples")
        lines.extend(f"      {100 * v / count:5.1f}%  {leaf}" for leaf, v in own[:8])
        lines.append(f"  thread {thread}: on the stack, % of samples")
        incl = [(fn, v) for t, fn, v in rep["incl"] if t == thread and v < count]
        lines.extend(f"      {100 * v / count:5.1f}%  {fn}" for fn, v in incl[:14])
    return "\n".join(lines) + "\n"


# Main
######


def describe(args, sizes: dict, runs: int) -> dict:
    import dask
    import distributed

    from dask_dataservice import config as dds_config  # noqa: F401 - loads the defaults

    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = None
    with contextlib.suppress(Exception):
        import psutil

        mem = round(psutil.virtual_memory().total / GiB, 1)
    repo = Path(__file__).resolve().parent.parent
    commit = dirty = None
    with contextlib.suppress(Exception):
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, text=True,
                                capture_output=True, timeout=5).stdout.strip() or None
        dirty = subprocess.run(["git", "--no-optional-locks", "status", "--porcelain",
                                "dask_dataservice"], cwd=repo, text=True, capture_output=True,
                               timeout=5).stdout.split("\n")
        dirty = [line[3:] for line in dirty if line.strip()]
    import hashlib

    pkg = Path(dds.__file__).parent
    digest = hashlib.sha1()
    for f in sorted((pkg / "service").glob("*.py")) + [pkg / "dataservice.yaml"]:
        digest.update(f.read_bytes())
    return {
        "run": "benchmarks/service.py",
        "quick": args.quick,
        "machine": {"cpu": cpu, "cores": os.cpu_count(), "memory_GiB": mem,
                    "os": platform.platform()},
        "cores": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "contention": (f"{os.cpu_count()} cores shared by the client (this process), the "
                       "scheduler and 1-2 single-threaded worker processes"),
        "versions": {"python": platform.python_version(), "numpy": np.__version__,
                     "dask": dask.__version__, "distributed": distributed.__version__,
                     "dask_dataservice": dds.__version__, "package_path": dds.__file__,
                     "git_commit": commit, "modified_package_files": dirty,
                     "service_sources_sha1": digest.hexdigest()[:12]},
        "config": dict(dask.config.get("dataservice.client"), **{
            f"worker.{k}": v for k, v in dask.config.get("dataservice.worker").items()}),
        "malloc_tuning": MALLOC_ENV if args.malloc_tuning else None,
        "cluster": "dask scheduler + dask worker --nthreads 1 --no-nanny processes, "
                   "--preload dask_dataservice, tcp on 127.0.0.1",
        "sizes": {"W1_elements": sizes["w1"], "W2_elements": sizes["w2"],
                  "W3_elements": sizes["w3"], "W4_elements": sizes["w4"]},
        "runs": runs, "w3_runs": args.runs or sizes["w3_runs"],
        "latency_runs": sizes["latency_runs"],
        "value": "best of `runs` reads (rates; after one untimed warm-up read) or median "
                 "(latencies); ratio = value / local (same pipeline iterated in this process)",
        "targets": {f"{k[0]} {k[1]} {k[2]}w": v[0] for k, v in TARGETS.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--only", default=",".join(WORKLOADS),
                        help=f"comma-separated subset of {','.join(WORKLOADS)}")
    parser.add_argument("--runs", type=int, default=None, help="reads per figure (best of)")
    parser.add_argument("--latency-runs", type=int, default=None, help="W4 reads (default 20)")
    parser.add_argument("--settle", type=float, default=2.0,
                        help="before each timed read, wait up to this many seconds for other "
                             "processes to leave the CPU alone (0: do not wait; default 2)")
    parser.add_argument("--profile", action="store_true",
                        help="profile W1 DYNAMIC and W2 reads (reports on stderr)")
    parser.add_argument("--malloc-tuning", action="store_true",
                        help="keep freed buffers in every process (glibc mallopt / MALLOC_* "
                             "variables): shows what page faults on fresh memory cost W2")
    parser.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    args = parser.parse_args(argv)
    only = [w.strip() for w in args.only.split(",") if w.strip()]
    unknown = set(only) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads {sorted(unknown)}; choose from {','.join(WORKLOADS)}")
    if args.malloc_tuning:
        tune_malloc()
    sizes = dict(SIZES["quick" if args.quick else "full"])
    if args.latency_runs:
        sizes["latency_runs"] = args.latency_runs
    bench = Bench(args, sizes)
    emit(describe(args, sizes, bench.runs))

    if "W3" in only:
        reps, ms = calibrate_work(W3_TARGET_MS)
        bench.w3_reps = reps
        emit({"bench": "W3-calibration", "reps": reps, "ms_per_element": round(ms, 3),
              "target_ms": W3_TARGET_MS,
              "work": "reps x a = np.sqrt(a * 1.000001 + 0.25) on 32768 float64; ms_per_element: "
                      "fastest of 5 batches of 8 calls in this process"})

    # SIGTERM (e.g. from a CI timeout) unwinds like Ctrl-C, through the finally below.
    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    t_start = time.perf_counter()
    cluster = Cluster()
    bench.cluster = cluster
    try:
        cluster.start()
        cluster.add_worker()
        paths = set(cluster.client.run(_package_path).values())
        if paths != {dds.__file__}:
            note(f"the workers import dask_dataservice from {paths}, this process from {dds.__file__}")
        note(f"1 worker up after {time.perf_counter() - t_start:.1f} s")
        # 1 worker
        if "W1" in only:
            bench.throughput("W1", "OFF", 1)
            bench.throughput("W1", "DYNAMIC", 1, target=False)
        if "W1b" in only:
            bench.throughput("W1b", "OFF", 1)
        if "W2" in only:
            bench.throughput("W2", "OFF", 1)
            bench.throughput("W2", "DYNAMIC", 1)
        if "W3" in only:
            bench.throughput("W3", "DYNAMIC", 1)
        if "W4" in only:
            bench.latency("OFF", 1)
        # 2 workers
        cluster.add_worker()
        note(f"2 workers up after {time.perf_counter() - t_start:.1f} s")
        if "W1" in only:
            bench.throughput("W1", "DYNAMIC", 2)
        if "W1b" in only:
            bench.throughput("W1b", "DYNAMIC", 2)
        if "W2" in only:
            bench.throughput("W2", "DYNAMIC", 2)
        if "W3" in only:
            bench.throughput("W3", "DYNAMIC", 2)
            bench.w3_scaling()
        if "W4" in only:
            bench.latency("DYNAMIC", 2)
    except KeyboardInterrupt:
        note("interrupted: stopping the cluster")
        return 130
    except BaseException:
        if cluster.procs:
            note("failed; server logs:\n" + cluster.log_tail())
        raise
    finally:
        cluster.close()
        note(f"done in {time.perf_counter() - t_start:.1f} s")
    emit({"summary": True, "seconds": round(time.perf_counter() - t_start, 1),
          "targets_missed": MISSED, "noisy_figures": NOISY, "settle_s": round(bench.settle_s, 1),
          "reads_started_on_a_busy_machine": bench.unsettled,
          "load_average_at_end": [round(x, 2) for x in os.getloadavg()]})
    if MISSED:
        note(f"targets missed: {'; '.join(MISSED)}")
        if args.check:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
