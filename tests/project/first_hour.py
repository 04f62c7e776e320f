"""A newcomer's first hour, replayed: each step is a script a user would save and run.

Usage::

    python tests/project/first_hour.py VENV_PYTHON [--workdir DIR] [--only STEP ...]

``VENV_PYTHON`` is the interpreter of a venv where the built wheel is installed
(tests/project/test_packaging.py makes one from the wheel, then runs this). Every step writes
its script to a file in its own folder and runs it with ``python step.py``, as a user would
(a cluster of worker processes re-imports ``__main__``: the scripts guard it), without
``PYTHONPATH``, so the installed package is the one imported. Each step prints one JSON line,
``{"step": ..., "ok": ..., "seconds": ..., "out": ...}``; the exit code is 1 if any failed.

The steps, in the order a user meets them:

- ``readme``: the README's quick example, as a file;
- ``big-array``: a 100 MB numpy array through ``from_tensor_slices`` and ``distribute``, each
  row read exactly once;
- ``parquet-dir``: a directory of Parquet files written by pyarrow (with a ``_SUCCESS`` marker),
  read by ``Dataset.from_parquet("data/")`` through the service;
- ``ddp``: two ``torch.distributed`` ranks (gloo, two processes), one shared DYNAMIC job with
  equal splits, three epochs: no hang, equal batch counts, no element twice;
- ``snapshot``: a snapshot of array elements, read back by pyarrow without this package;
- ``dashboard``: the dashboard's pipeline figures name a known-slow op as the bottleneck.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_example() -> str:
    """The README's first Python block (its quick example)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"^```python\n(.*?)^```", text, re.M | re.S)
    assert m is not None, "README.md has no ```python block"
    return m.group(1) + '\nprint("readme ok")\n'


BIG_ARRAY = '''\
import numpy as np
from distributed import Client, LocalCluster

import dask_dataservice as dds

if __name__ == "__main__":
    rows = np.arange(12_500 * 1_000, dtype="float64").reshape(12_500, 1_000)  # 100 MB
    assert rows.nbytes == 100_000_000
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster, \\
            Client(cluster) as client:
        ds = (dds.Dataset.from_tensor_slices(rows).batch(250)
              .apply(dds.distribute("distributed_epoch", client)))
        seen = np.sort(np.concatenate([batch[:, 0] for batch in ds]))
    assert np.array_equal(seen, rows[:, 0]), "every row exactly once"
    print("big-array ok", len(seen))
'''

PARQUET_DIR = '''\
import pyarrow as pa
import pyarrow.parquet as pq
from pathlib import Path
from distributed import Client, LocalCluster

import dask_dataservice as dds

if __name__ == "__main__":
    data = Path("data")
    data.mkdir()
    for part in range(4):
        ids = list(range(part * 250, (part + 1) * 250))
        pq.write_table(pa.table({"id": ids, "x": [float(i) / 2 for i in ids]}),
                       data / f"part-{part}.parquet")
    (data / "_SUCCESS").write_text("")  # what Spark and Dask leave behind: skipped
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster, \\
            Client(cluster) as client:
        ds = dds.Dataset.from_parquet("data/").apply(
            dds.distribute("distributed_epoch", client))
        ids = sorted(int(row["id"]) for row in ds)
    assert ids == list(range(1000)), ids[:10]
    print("parquet-dir ok", len(ids))
'''

DDP = """\
import json
import socket

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from distributed import Client, LocalCluster

import dask_dataservice as dds
import dask_dataservice.torch  # noqa: F401

ROWS, EPOCHS, WORLD = 3_001, 3, 2


def rank_main(rank, scheduler, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ids = np.arange(ROWS)
    x = np.random.default_rng(0).normal(size=(ROWS, 4)).astype("float32")
    with Client(scheduler) as client:
        share = (dds.Dataset.from_tensor_slices({"id": ids, "x": x}).batch(16)
                 .apply(dds.distribute("distributed_epoch", client, job_name="ddp",
                                       **dds.torch.ddp_split())))
        epochs = []
        for epoch in range(EPOCHS):
            seen = []
            for batch in share.to_torch():
                opt.zero_grad()
                model(batch["x"]).pow(2).mean().backward()  # DDP all-reduces here
                opt.step()
                seen.append([int(i) for i in batch["id"]])
            epochs.append(seen)
            with open(f"{out}.{rank}", "w") as f:  # each epoch: a crash still tells its steps
                json.dump(epochs, f)
    dist.barrier()  # both ranks are done with their collectives before either tears down
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster:
        try:
            mp.spawn(rank_main, args=(cluster.scheduler_address, port, "seen"), nprocs=WORLD)
        except Exception:
            for r in range(WORLD):  # the steps each rank took per finished epoch
                try:
                    print(f"rank {r}: batches per epoch",
                          [len(e) for e in json.load(open(f"seen.{r}"))])
                except OSError:
                    print(f"rank {r}: no epoch finished")
            raise
    ranks = [json.load(open(f"seen.{r}")) for r in range(WORLD)]
    for epoch in range(EPOCHS):
        steps = [len(r[epoch]) for r in ranks]  # what DDP needs equal: steps (batches)
        assert steps[0] == steps[1], f"epoch {epoch}: batches per rank {steps}"
        rows = [i for r in ranks for batch in r[epoch] for i in batch]
        assert len(rows) == len(set(rows)), f"epoch {epoch}: a row twice"
        # equal='drop' drops at most what one rank holds beyond the other: 2 held requests
        # and 2 in flight per data worker (2 here), of 8 batches of 16 rows (data-service.md)
        assert set(rows) <= set(range(ROWS)), sorted(set(rows) - set(range(ROWS)))
        assert len(rows) >= ROWS - (WORLD - 1) * (2 + 2 * 2) * 8 * 16, len(rows)
    print("ddp ok: batches per rank and epoch", [[len(r[e]) for r in ranks] for e in range(EPOCHS)])
"""

SNAPSHOT = """\
import numpy as np
import pyarrow.dataset as pds
from distributed import Client, LocalCluster

import dask_dataservice as dds

if __name__ == "__main__":
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster, \\
            Client(cluster) as client:
        features = dds.Dataset.range(5_000).map(
            lambda i: {"id": i, "x": np.full(4, i % 7, np.float32)})
        manifest = dds.distributed_save(features, "snap", client, wait=True,
                                        max_chunk_elements=1_000)
    assert manifest["state"] == "done" and manifest["num_elements"] == 5_000, manifest
    table = pds.dataset("snap/chunks", format="ipc").to_table()  # pyarrow alone
    assert table.num_rows == 5_000 and table.column_names == ["id", "x"], table.schema
    ids = table.column("id").to_pylist()
    assert sorted(ids) == list(range(5_000))
    x = table.column("x").to_pylist()[ids.index(12)]
    assert x == [12 % 7] * 4, x
    back = sorted(int(e["id"]) for e in dds.Dataset.load("snap"))  # and the package again
    assert back == list(range(5_000))
    print("snapshot ok: pyarrow read", table.num_rows, "rows of", table.column_names)
"""

DASHBOARD = """\
import json
import time
import urllib.request

from distributed import Client, LocalCluster

import dask_dataservice as dds


def decode(x):
    time.sleep(0.004)  # the slow op of this pipeline
    return x


def status(base):
    with urllib.request.urlopen(f"{base}/dataservice/status.json", timeout=10) as r:
        return json.load(r)


if __name__ == "__main__":
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address="127.0.0.1:0") \\
            as cluster, Client(cluster) as client:
        base = client.dashboard_link.rsplit("/", 1)[0]
        ds = (dds.Dataset.range(100_000).map(decode).batch(8)
              .apply(dds.distribute("distributed_epoch", client)))
        it = iter(ds)
        deadline, named = time.monotonic() + 60, None
        while named is None and time.monotonic() < deadline:
            next(it)  # the job is running while we look at the dashboard
            jobs = status(base)["service"]["jobs"]
            named = next((j["bottleneck"] for j in jobs if j.get("bottleneck")), None)
        it.close()
    assert named == "map(decode)", named
    print("dashboard ok: the bottleneck is", named)
"""

STEPS: dict[str, str | None] = {
    "readme": None,  # built from the README at run time
    "big-array": BIG_ARRAY,
    "parquet-dir": PARQUET_DIR,
    "ddp": DDP,
    "snapshot": SNAPSHOT,
    "dashboard": DASHBOARD,
}


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: stdlib-only helpers
from _logs import unexpected_tracebacks  # noqa: E402


def run_step(python: str, name: str, source: str, workdir: Path, timeout: float) -> dict:
    folder = workdir / name
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "step.py"
    script.write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([python, str(script)], cwd=folder, capture_output=True, text=True,
                              timeout=timeout, env=env)
        ok = proc.returncode == 0 and not unexpected_tracebacks(proc.stderr)
        out = proc.stdout.strip().splitlines()[-1:] if ok else [
            f"exit {proc.returncode}", proc.stdout[-3000:], proc.stderr[-6000:]]
    except subprocess.TimeoutExpired as e:
        ok, out = False, [f"no result after {timeout} s (a hang)", str(e.stdout)[-2000:],
                          str(e.stderr)[-4000:]]
    return {"step": name, "ok": ok, "seconds": round(time.perf_counter() - t0, 1),
            "out": "\n".join(out)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("python", help="the interpreter of a venv with the wheel installed")
    parser.add_argument("--workdir", type=Path, default=Path.cwd() / "first-hour")
    parser.add_argument("--only", nargs="*", choices=sorted(STEPS), help="run these steps only")
    parser.add_argument("--timeout", type=float, default=180, help="seconds per step")
    args = parser.parse_args(argv)
    python = os.path.abspath(args.python)  # the steps run in their own folders
    failed = 0
    for name, source in STEPS.items():
        if args.only and name not in args.only:
            continue
        result = run_step(python, name, readme_example() if source is None else source,
                          args.workdir, args.timeout)
        failed += not result["ok"]
        print(json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
