"""A data worker that survives scheduler restarts: ``python -m dask_dataservice.service.supervise``.

A Dask worker (or nanny) exits when its scheduler goes away and never reconnects (see
dask/distributed#6361). For a fault-tolerant dispatcher that is restarted in place, the
workers must come back by themselves: this runs :class:`~.servers.WorkerSupervisor`, which
starts a fresh Dask worker (with the data-worker plugin) each time the previous one closed,
and the fresh worker waits until the scheduler is reachable, then registers.

Usage::

    python -m dask_dataservice.service.supervise tcp://scheduler:8786 --nthreads 2

It runs until SIGINT or SIGTERM. ``dask-dataservice worker --supervise`` does the same.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dask_dataservice.service.supervise",
                                description=__doc__.splitlines()[0])
    p.add_argument("scheduler", help="scheduler address, e.g. tcp://127.0.0.1:8786")
    p.add_argument("--nthreads", type=int, default=1)
    p.add_argument("--host", default=None, help="interface to listen on")
    p.add_argument("--name", default=None)
    p.add_argument("--resources", default=None, help='e.g. "ps=1"')
    p.add_argument("--memory-limit", default="auto")
    return p.parse_args(argv)


def _resources(text: str | None) -> dict[str, float] | None:
    if not text:
        return None
    out = {}
    for item in text.replace(",", " ").split():
        key, _, value = item.partition("=")
        out[key] = float(value or 1)
    return out


async def run(args: argparse.Namespace, stop: asyncio.Event) -> int:
    from .servers import WorkerSupervisor

    address = args.scheduler if "://" in args.scheduler else f"tcp://{args.scheduler}"
    supervisor = WorkerSupervisor(
        address, nthreads=args.nthreads, host=args.host, name=args.name,
        resources=_resources(args.resources), memory_limit=args.memory_limit,
        dashboard=False,
    )
    await supervisor.start()
    print(f"dataservice worker supervisor: worker at {supervisor.address}", flush=True)
    await stop.wait()
    await supervisor.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    async def amain() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await run(args, stop)

    return asyncio.run(amain())


if __name__ == "__main__":
    sys.exit(main())
