"""``python -m dask_dataservice.testing.sim``: replay one seed, or run many (see __init__)."""

from __future__ import annotations

import argparse
import json
import sys

from ._runner import check_seeds, replay_command, shrink
from ._scenario import WORKLOADS, Params, generate, run_scenario


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dask_dataservice.testing.sim")
    parser.add_argument("--seed", type=int, help="replay this seed (prints its trace)")
    parser.add_argument("--seeds", type=int, help="run seeds 0 .. N-1 (benchmark mode)")
    parser.add_argument("--first", type=int, default=0, help="first seed of --seeds")
    parser.add_argument("--workload", default="dynamic",
                        help=f"one of {', '.join(WORKLOADS)}, or 'all'")
    parser.add_argument("--scenario", help="a scenario as JSON (a shrunk one), for --seed")
    parser.add_argument("--shrink", action="store_true", help="shrink a failing --seed")
    args = parser.parse_args(argv)
    workloads = list(WORKLOADS) if args.workload == "all" else [args.workload]
    if args.seed is not None:
        workload = workloads[0]
        params = Params(**json.loads(args.scenario)) if args.scenario else \
            generate(args.seed, workload)
        result = run_scenario(args.seed, params, verbose=True)
        print("\n".join(result.trace))
        print(f"scenario: {json.dumps(params.__dict__)}")
        print(f"{result.steps} steps, {result.virtual_time:.3f} s of virtual time")
        if result.failure is None:
            print("OK")
            return 0
        print(f"FAILED: {result.failure}")
        if args.shrink:
            small = shrink(result)
            print(f"shrunk: {small.failure}\n{replay_command(args.seed, workload, small.params)}")
        return 1
    n, seconds, reports = check_seeds(range(args.first, args.first + (args.seeds or 100)),
                                      workloads)
    for report in reports:
        print(report)
    print(f"{n} scenarios in {seconds:.2f} s: {n / seconds:.0f} scenarios/s; "
          f"{len(reports)} failed")
    return 1 if reports else 0


if __name__ == "__main__":
    sys.exit(main())
