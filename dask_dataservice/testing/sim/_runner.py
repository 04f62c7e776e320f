"""Running many seeds, shrinking a failure, and the replay command."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable
from typing import Any

from ._scenario import Params, Result, generate, run_scenario

__all__ = ["check_seeds", "replay_command", "run_seed", "shrink"]


def run_seed(seed: int, workload: str) -> Result:
    return run_scenario(seed, generate(seed, workload))


def replay_command(seed: int, workload: str, params: Params | None = None) -> str:
    """The one line that replays a scenario bit for bit."""
    cmd = f"python -m dask_dataservice.testing.sim --seed {seed} --workload {workload}"
    if params is not None:
        cmd += f" --scenario '{json.dumps(dataclasses.asdict(params), separators=(',', ':'))}'"
    return cmd


def _kind(failure: str | None) -> str:
    """What a failure is about, without its time and numbers (shrinking keeps it)."""
    if failure is None:
        return ""
    text = failure.split(": ", 1)[-1]
    return "".join(ch for ch in text.split("(")[0] if not ch.isdigit())[:60]


def shrink(result: Result, budget: int = 200) -> Result:
    """A smaller scenario of the same seed that fails the same way: drop faults, then the
    message losses, then workers, consumers and splits, while the failure stays."""
    assert result.failure is not None
    kind = _kind(result.failure)
    best = result
    tries = 0

    def attempt(params: Params) -> bool:
        nonlocal best, tries
        tries += 1
        r = run_scenario(best.seed, params)
        if r.failure is not None and _kind(r.failure) == kind:
            best = r
            return True
        return False

    changed = True
    while changed and tries < budget:
        changed = False
        p = best.params
        for i in range(len(p.faults)):
            if attempt(dataclasses.replace(p, faults=p.faults[:i] + p.faults[i + 1:])):
                changed = True
                break
        if changed:
            continue
        candidates: list[dict[str, Any]] = []
        if p.drop or p.dup:
            candidates.append({"drop": 0.0, "dup": 0.0})
        if p.n_consumers > 1 and not p.workload.startswith("named"):
            candidates.append({"n_consumers": p.n_consumers - 1})
        if p.n_workers > 1:
            candidates.append({"n_workers": p.n_workers - 1})
        if p.num_splits > 1:
            candidates.append({"num_splits": max(1, p.num_splits // 2)})
            candidates.append({"num_splits": p.num_splits - 1})
        if p.per_split > 1:
            candidates.append({"per_split": 1})
        if p.snapshot_every:
            candidates.append({"snapshot_every": 0})
        for change in candidates:
            if attempt(dataclasses.replace(p, **change)):
                changed = True
                break
    return best


def check_seeds(seeds: Iterable[int], workloads: Iterable[str]) -> tuple[int, float, list[str]]:
    """Run every seed of every workload: ``(scenarios, seconds, failure reports)``; each
    report has the seed, the failure, the replay command and the shrunk scenario."""
    started = time.perf_counter()
    n = 0
    reports = []
    workloads = list(workloads)
    for seed in seeds:
        for workload in workloads:
            n += 1
            r = run_seed(seed, workload)
            if r.failure is not None:
                small = shrink(r)
                reports.append(
                    f"seed {seed} workload {workload}: {r.failure}\n"
                    f"  replay: {replay_command(seed, workload)}\n"
                    f"  shrunk ({small.failure}):\n"
                    f"  {replay_command(seed, workload, small.params)}")
    return n, time.perf_counter() - started, reports
