"""Local pipeline overhead: ``Dataset`` iteration against a plain Python generator.

Prints one JSON object per line on stdout, one per measurement::

    {"bench": "range", "elements_per_s": ..., "baseline_elements_per_s": ..., "ratio": ..., ...}

``ratio`` is ``baseline_elements_per_s / elements_per_s``: how many times the per-element
cost of the pipeline exceeds the bare generator's (1.0 = as fast, 3.0 = three times slower).
Each figure is the best of ``--runs`` runs; the pipeline and its baseline run alternately in
the same process, so they see the same machine.

Targets (``target`` / ``target_met`` fields):

* ``range``: iterating ``Dataset.range(n)`` costs at most 3x a bare generator per element.
* ``batch``: ``Dataset.range(n).batch(256)`` delivers at least 5M elements/s.

Run ``.venv/bin/python benchmarks/pipeline.py --help`` for the options. The exit status is 0
even when a target is missed (this is a measurement, not a test) unless ``--check`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable

import numpy as np

from dask_dataservice.data import Dataset

RANGE_MAX_RATIO = 3.0
BATCH_MIN_ELEMENTS_PER_S = 5_000_000
BATCH = 256


# Baselines: plain generators doing the same work as the pipeline
##################################################################


def gen_range(n: int):
    # A hand-written generator: one Python-level step per element. ``yield from range(n)``
    # would delegate to C and measure range's iterator instead.
    for i in range(n):  # noqa: UP028
        yield i


def gen_map(n: int, fn: Callable[[int], int]):
    for i in range(n):
        yield fn(i)


def gen_batch(n: int, size: int):
    """Collect ``size`` elements from a generator, emit them as one numpy array."""
    buf: list[int] = []
    for i in gen_range(n):
        buf.append(i)
        if len(buf) == size:
            yield np.asarray(buf)
            buf = []
    if buf:
        yield np.asarray(buf)


# Timing
########


def _drain(it: Iterable) -> None:
    for _ in it:
        pass


def _best_seconds(make_iter: Callable[[], Iterable], runs: int) -> float:
    best = float("inf")
    for _ in range(runs):
        it = make_iter()
        start = time.perf_counter()
        _drain(it)
        best = min(best, time.perf_counter() - start)
    return best


def _interleaved_best(
    make_ds: Callable[[], Iterable], make_base: Callable[[], Iterable], runs: int
) -> tuple[float, float]:
    """Best-of-``runs`` seconds for both, alternating so drift affects both alike."""
    ds_best = base_best = float("inf")
    for _ in range(runs):
        ds_best = min(ds_best, _best_seconds(make_ds, 1))
        base_best = min(base_best, _best_seconds(make_base, 1))
    return ds_best, base_best


def _count(it: Iterable, batched: bool) -> tuple[int, object]:
    n = 0
    last = None
    for x in it:
        n += len(x) if batched else 1
        last = x
    return n, last


# Benchmarks
############


def _benchmarks(n: int):
    """``(name, pipeline factory, baseline factory, baseline description, batched, last)``."""

    def inc(x):
        return x + 1

    gen = "for i in range(n): yield i"
    return [
        ("range", lambda: Dataset.range(n), lambda: gen_range(n), gen, False, n - 1),
        (
            # The path a data worker takes under dynamic sharding: the source reads the
            # splits a provider serves (here all of them, from a list).
            "range_splits",
            lambda: _range_with_splits(n),
            lambda: gen_range(n),
            gen,
            False,
            n - 1,
        ),
        (
            "map",
            lambda: Dataset.range(n).map(inc),
            lambda: gen_map(n, inc),
            "for i in range(n): yield inc(i)",
            False,
            n,
        ),
        (
            "batch",
            lambda: Dataset.range(n).batch(BATCH),
            lambda: gen_batch(n, BATCH),
            f"collect {BATCH} items of the range generator in a list, yield np.asarray(list)",
            True,
            None,
        ),
    ]


def _range_with_splits(n: int):
    ds = Dataset.range(n)
    return ds.iterate(split_provider=ds.splits())


def _target(bench: str, eps: float, ratio: float) -> tuple[str | None, bool | None]:
    if bench == "range":
        return f"ratio <= {RANGE_MAX_RATIO:g}", ratio <= RANGE_MAX_RATIO
    if bench == "batch":
        return (
            f"elements_per_s >= {BATCH_MIN_ELEMENTS_PER_S:.0e}",
            eps >= BATCH_MIN_ELEMENTS_PER_S,
        )
    return None, None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", "-n", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=3, help="best of this many (default: 3)")
    parser.add_argument(
        "--only",
        action="append",
        choices=["range", "range_splits", "map", "batch"],
        help="run only these",
    )
    parser.add_argument(
        "--check", action="store_true", help="exit with status 1 if a target is missed"
    )
    args = parser.parse_args(argv)
    n = args.elements

    print(
        json.dumps(
            {
                "targets": {
                    "range": f"per-element cost <= {RANGE_MAX_RATIO:g}x a bare generator",
                    "batch": f">= {BATCH_MIN_ELEMENTS_PER_S:,} elements/s with batch({BATCH})",
                },
                "elements": n,
                "runs": args.runs,
                "python": platform.python_version(),
                "numpy": np.__version__,
                "cpus": os.cpu_count(),
            }
        ),
        flush=True,
    )

    missed = []
    for bench, make_ds, make_base, baseline, batched, last in _benchmarks(n):
        if args.only and bench not in args.only:
            continue
        # Correctness first, untimed: the pipeline must produce what the baseline does.
        got_n, got_last = _count(make_ds(), batched)
        want_n, want_last = _count(make_base(), batched)
        if got_n != want_n or (last is not None and int(got_last) != last):
            raise SystemExit(
                f"{bench}: pipeline produced {got_n} elements (last {got_last!r}), "
                f"baseline {want_n} (last {want_last!r})"
            )
        ds_s, base_s = _interleaved_best(make_ds, make_base, args.runs)
        eps, base_eps = n / ds_s, n / base_s
        ratio = base_eps / eps
        target, met = _target(bench, eps, ratio)
        record = {
            "bench": bench,
            "elements_per_s": round(eps),
            "baseline_elements_per_s": round(base_eps),
            "ratio": round(ratio, 3),
            "ns_per_element": round(1e9 / eps, 1),
            "baseline_ns_per_element": round(1e9 / base_eps, 1),
            "baseline": baseline,
        }
        if target is not None:
            record["target"] = target
            record["target_met"] = met
            if not met:
                missed.append(bench)
        print(json.dumps(record), flush=True)

    if missed and args.check:
        print(f"targets missed: {', '.join(missed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
