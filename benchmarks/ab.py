"""A/B gate: run one benchmark script against a git ref and the working tree, alternating.

Usage (from the repository root)::

    .venv/bin/python benchmarks/ab.py --ref pre-restructure -- service.py --only W1,W2
    .venv/bin/python benchmarks/ab.py --ref HEAD~5 --rounds 3 --check -- ps.py --only P1,P2

The ref's tree is exported with ``git archive`` into a temporary folder; each round runs the
benchmark once with the ref's package (A) and once with the working tree's (B), in that order
and then the other (A B B A ...), so a trend of the machine's load falls on both sides alike.
Every child process imports the side's package first (``PYTHONPATH``), including the
schedulers and workers a benchmark starts. By default each side runs its own copy of the
script; ``--script head`` runs the working tree's script on both sides (when the ref's
script lacks an option you pass).

The benchmark's JSON lines are matched across runs by their identifying fields (``bench`` /
``benchmark`` and the strings and small integers beside it, such as ``mode``, ``workers``,
``path``); each record's figure is its first field among :data:`FIGURES`. For each figure this
prints one JSON line: the medians of A and B, ``b_over_a``, each side's spread (max/min - 1 over
its runs) and a verdict: ``regression`` when B is worse than A by more than the noise band
(the larger of the two spreads, at least ``--min-band``), ``improvement`` when better by more,
``within noise`` otherwise. Lower is better for figures in milliseconds or seconds. The first
line gives the machine's load at the start; the last, the load at the end and the verdicts'
count. ``--check`` exits 1 if any figure regressed.

The whole run holds ``/tmp/bench.lock`` (``flock``), so benchmarks never overlap.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: The figure of a record: the first of these fields it has.
FIGURES = (
    "value", "elements_per_s", "ids_per_s", "steps_per_s", "gib_per_s", "gb_per_s",
    "mib_per_s", "rows_per_s", "batches_per_s", "rounds_per_s", "requests_per_s",
    "ops_per_s", "us_per_call", "us", "ms", "seconds",
)
#: Fields that never identify a record (figures, timings, free text, run lists).
NOT_KEYS = {"what", "metric", "target", "target_met", "noisy", "baseline", "runs_values",
            "cpu_s", "note", "notes", "local"}
#: Prefixes and suffixes of measured fields beside the figure (a machine's load, CPU time,
#: other rates): they vary from run to run and never identify a record.
NOT_KEY_PREFIXES = ("load", "cpu_")
NOT_KEY_SUFFIXES = ("_per_s", "_s", "_ms", "_us", "_mib", "_seconds")


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def export(ref: str, dest: Path) -> str:
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{ref}^{{commit}}"], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout.strip()
    archive = subprocess.run(["git", "archive", "--format=tar", sha], cwd=ROOT, check=True,
                             capture_output=True).stdout
    tar_path = dest.parent / "ref.tar"
    tar_path.write_bytes(archive)
    with tarfile.open(tar_path) as tar:
        tar.extractall(dest, filter="data")
    tar_path.unlink()
    return sha


def key_of(rec: dict) -> tuple | None:
    name = rec.get("bench", rec.get("benchmark"))
    if name is None or rec.get("summary"):
        return None
    parts = []
    for k, v in sorted(rec.items()):
        if (k in NOT_KEYS or k in FIGURES or k.startswith(NOT_KEY_PREFIXES)
                or k.endswith(NOT_KEY_SUFFIXES)):
            continue
        if isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool) and v < 10_000):
            parts.append((k, v))
    return tuple(parts)


def figure_of(rec: dict) -> tuple[str, float] | None:
    for f in FIGURES:
        v = rec.get(f)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return f, float(v)
    return None


def lower_is_better(rec: dict, figure: str) -> bool:
    metric = str(rec.get("metric", ""))
    return figure in ("us_per_call", "us", "ms", "seconds") or metric.startswith(("ms ", "us "))


def run_once(tree: Path, script: Path, args: list[str], timeout: float) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, str(script), *args], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{script} in {tree} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    records = []
    for line in proc.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return records


def spread(values: list[float]) -> float:
    lo, hi = min(values), max(values)
    return (hi / lo - 1.0) if lo > 0 else 0.0


def compare(runs: dict[str, list[list[dict]]], min_band: float) -> list[dict]:
    figures: dict[tuple, dict] = {}
    for side, side_runs in runs.items():
        for records in side_runs:
            for rec in records:
                key, fig = key_of(rec), figure_of(rec)
                if key is None or fig is None:
                    continue
                entry = figures.setdefault(key, {"figure": fig[0], "A": [], "B": [],
                                                 "lower": lower_is_better(rec, fig[0])})
                if entry["figure"] == fig[0]:
                    entry[side].append(fig[1])
    out = []
    for key, e in figures.items():
        if not e["A"] or not e["B"]:
            out.append({"ab": dict(key), "figure": e["figure"], "verdict": "missing",
                        "a_runs": len(e["A"]), "b_runs": len(e["B"])})
            continue
        a, b = statistics.median(e["A"]), statistics.median(e["B"])
        band = max(spread(e["A"]), spread(e["B"]), min_band)
        ratio = b / a if a else float("inf")
        better = (1 / ratio if ratio else float("inf")) if e["lower"] else ratio
        verdict = ("regression" if better < 1 / (1 + band)
                   else "improvement" if better > 1 + band else "within noise")
        out.append({"ab": dict(key), "figure": e["figure"], "lower_is_better": e["lower"],
                    "a_median": round(a, 4), "b_median": round(b, 4),
                    "b_over_a": round(ratio, 3), "a_spread": round(spread(e["A"]), 3),
                    "b_spread": round(spread(e["B"]), 3), "band": round(band, 3),
                    "verdict": verdict})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", required=True, help="the git ref to compare against (A)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per side (default 3)")
    parser.add_argument("--script", choices=("own", "head"), default="own",
                        help="own: each side runs its own script; head: the working tree's")
    parser.add_argument("--min-band", type=float, default=0.05,
                        help="the smallest noise band (default 0.05: 5%%)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--check", action="store_true", help="exit 1 if a figure regressed")
    parser.add_argument("bench", nargs=argparse.REMAINDER,
                        help="-- SCRIPT [ARGS...]: a script of benchmarks/ and its arguments")
    args = parser.parse_args()
    bench = [a for a in args.bench if a != "--"] if args.bench[:1] == ["--"] else args.bench
    if not bench:
        parser.error("name a benchmark script after --, e.g. -- service.py --only W1")
    name, bench_args = bench[0], bench[1:]
    with open("/tmp/bench.lock", "w") as lock, tempfile.TemporaryDirectory() as tmp:
        fcntl.flock(lock, fcntl.LOCK_EX)
        tree_a = Path(tmp) / "ref"
        sha = export(args.ref, tree_a)
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                    cwd=ROOT, capture_output=True, text=True).stdout.strip())
        print(json.dumps({"ab": "start", "bench": name, "args": bench_args, "a_ref": args.ref,
                          "a_commit": sha, "b_commit": head, "b_uncommitted_changes": dirty,
                          "rounds": args.rounds, "load": load(), "cores": os.cpu_count()}),
              flush=True)
        sides = {"A": tree_a, "B": ROOT}
        for side, tree in sides.items():  # each side really imports its own package
            where = subprocess.run(
                [sys.executable, "-c", "import dask_dataservice; print(dask_dataservice.__file__)"],
                cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True,
                text=True, check=True).stdout.strip()
            if not Path(where).is_relative_to(tree):
                raise SystemExit(f"side {side} imports dask_dataservice from {where}, not {tree}")
        runs: dict[str, list[list[dict]]] = {"A": [], "B": []}
        started = time.perf_counter()
        for i in range(args.rounds):
            for side in (("A", "B") if i % 2 == 0 else ("B", "A")):
                tree = sides[side]
                script = (ROOT if args.script == "head" else tree) / "benchmarks" / name
                runs[side].append(run_once(tree, script, bench_args, args.timeout))
                print(json.dumps({"ab": "run", "side": side, "round": i,
                                  "records": len(runs[side][-1]), "load": load()}),
                      flush=True)
        results = compare(runs, args.min_band)
        for r in results:
            print(json.dumps(r), flush=True)
        verdicts = [r["verdict"] for r in results]
        print(json.dumps({"ab": "end", "seconds": round(time.perf_counter() - started, 1),
                          "load": load(), **{v: verdicts.count(v) for v in sorted(set(verdicts))}}),
              flush=True)
    return 1 if args.check and "regression" in verdicts else 0


if __name__ == "__main__":
    sys.exit(main())
