"""The ``dask-dataservice`` command line: in-process through ``main`` and as real processes.

The demo runs on an embedded ``LocalCluster`` (worker processes by default, threads with
``--no-processes``, which starts in a fraction of the time); ``scheduler`` and ``worker`` are
started as subprocesses on 127.0.0.1 and stopped with SIGTERM. Every wait is bounded.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest

from dask_dataservice import cli
from dask_dataservice.cli import Progress, main

pytestmark = pytest.mark.timeout(90)

THROUGHPUT = re.compile(
    r"^demo: (?P<n>\d+) elements in (?P<t>\d+\.\d+) s \((?P<rate>\d+|inf) elements/s\)$"
)


def _console_script() -> Path:
    # The script sits next to the interpreter running the tests (``.venv/bin`` in CI).
    name = "dask-dataservice.exe" if os.name == "nt" else "dask-dataservice"
    path = Path(sys.executable).parent / name
    if not path.exists():
        pytest.fail(f"console script not installed at {path}; run `pip install -e .` first")
    return path


def _last_line(out: str) -> re.Match:
    lines = out.splitlines()
    assert lines, "nothing on stdout"
    m = THROUGHPUT.match(lines[-1])
    assert m, lines[-1]
    return m


def _wait_until(cond, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


# ---------------------------------------------------------------------------------------
# demo
# ---------------------------------------------------------------------------------------


def test_demo_on_cluster_in_process(capsys):
    # The streaming demo: worker processes of an embedded LocalCluster, DYNAMIC sharding.
    rc = main(["demo", "--no-train", "--elements", "10000", "--quiet"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert len(out.splitlines()) == 1, out
    m = _last_line(out)
    assert int(m["n"]) == 10_000  # DYNAMIC: every example exactly once
    assert float(m["t"]) >= 0
    assert err == ""  # --quiet: no progress bar, no status lines


def test_demo_trains_with_parameter_servers(capsys, tmp_path):
    # The default, the whole story: data service -> per-worker datasets -> PS training.
    ckpt = tmp_path / "ckpt"
    rc = main(["demo", "--elements", "20000", "--quiet", "--checkpoint", str(ckpt)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    lines = out.splitlines()
    assert len(lines) == 2, out
    accuracy = re.match(r"demo: accuracy (0\.\d+), log loss (\d+\.\d+), (\d+) steps$", lines[0])
    assert accuracy, lines[0]
    assert float(accuracy.group(1)) > 0.7  # above chance, and near the ~0.77 base rate at least
    assert int(_last_line(out)["n"]) == 20_000  # every example trained on exactly once
    import zarr

    group = zarr.open_group(str(ckpt), mode="r")
    assert any(True for _ in group.keys()), "the checkpoint holds the variables"


def test_demo_mode_off_every_worker_produces_everything(capsys):
    rc = main(["demo", "--mode", "off", "--no-processes", "--workers", "2", "--elements", "3000"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert int(_last_line(out)["n"]) == 2 * 3000
    assert "sharding policy OFF" in err
    assert "2 in-process workers" in err


def test_demo_three_workers_dynamic(capsys):
    rc = main(["demo", "--no-train", "--no-processes", "--workers", "3", "--elements", "4000",
               "--batch-size", "333"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert int(_last_line(out)["n"]) == 4000  # partial batches on each worker counted too
    assert "3 data workers, sharding policy DYNAMIC" in err


def test_demo_local(capsys):
    rc = main(["demo", "--local", "--elements", "10000", "--quiet"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert len(out.splitlines()) == 1, out
    assert int(_last_line(out)["n"]) == 10_000
    assert err == ""


def test_demo_local_batch_size_not_dividing_elements(capsys):
    # 1000 = 3 * 333 + 1: the last, partial batch must be counted too.
    rc = main(["demo", "--local", "--elements", "1000", "--batch-size", "333", "--quiet"])
    out, _ = capsys.readouterr()
    assert rc == 0
    assert int(_last_line(out)["n"]) == 1000


def test_demo_pipeline_contents():
    ds = cli.make_click_dataset(1000, batch_size=100, shuffle_buffer=50, seed=1)
    batches = list(ds)
    assert len(batches) == 10
    for b in batches:
        assert set(b) == {"dense", "sparse", "label"}
        assert b["dense"].shape == (100, cli._DENSE_FEATURES)
        assert b["sparse"].shape == (100, cli._SPARSE_FEATURES)
        assert b["label"].shape == (100,)
        assert (b["sparse"] >= 0).all() and (b["sparse"] < cli._VOCAB_SIZE).all()
        assert (b["dense"] >= 0).all()  # log1p of positive values


def test_demo_pipeline_is_small_splittable_and_deterministic():
    import cloudpickle
    import numpy as np

    n = 20_000
    ds = cli.make_click_dataset(n, batch_size=64, seed=3)
    assert ds.splittable  # DYNAMIC sharding hands out blocks of rows
    assert len(ds.splits()) > 1
    # the rows are generated where the pipeline runs: shipping it costs no data
    assert len(cloudpickle.dumps(ds)) < 20_000

    def rows(dataset):
        dense = np.concatenate([b["dense"] for b in dataset])
        return dense[np.lexsort(dense.T[::-1])]

    # the same rows whatever the shuffle, and whichever split is read first
    a = rows(ds)
    b = rows(cli.make_click_dataset(n, batch_size=1000, shuffle_buffer=7, seed=3))
    c = rows(ds.iterate(list(reversed(ds.splits()))))
    assert a.shape == (n, cli._DENSE_FEATURES)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)


def test_console_script_demo_exits_cleanly():
    proc = subprocess.Popen(
        [str(_console_script()), "demo", "--no-train", "--elements", "5000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: what it leaves behind is findable
    )
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 0, err
    assert int(_last_line(out)["n"]) == 5000
    assert len(out.splitlines()) == 1, out
    # stderr is a pipe here, not a terminal: a few progress lines, no carriage returns,
    # and nothing from Dask (no log lines, no tracebacks)
    assert "\r" not in err
    assert "Traceback" not in err and " - WARNING - " not in err and " - INFO - " not in err, err
    assert 1 <= len(err.splitlines()) <= 10, err
    assert "2 worker processes x 1 thread" in err
    # no worker process outlives the command
    _wait_until(lambda: not _process_group(proc.pid), 10, "the worker processes to exit")


def _process_group(pgid: int) -> list[int]:
    import psutil

    alive = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return alive


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--local", "--workers", "2"], "--local runs without Dask; it cannot be used with --workers"),
        (["--local", "--mode", "off"], "cannot be used with --mode"),
        (["--scheduler", "tcp://127.0.0.1:1", "--workers", "2"], "cannot be used with --scheduler"),
    ],
)
def test_demo_rejects_conflicting_options(argv, message, capsys):
    assert main(["demo", *argv]) == 2
    _, err = capsys.readouterr()
    assert message in err


def test_demo_unreachable_scheduler_is_a_one_line_error(capsys):
    import dask

    with dask.config.set({"dataservice.client.connect-timeout": "0.5s"}):
        rc = main(["demo", "--scheduler", "127.0.0.1:1", "--elements", "10"])
    out, err = capsys.readouterr()
    assert rc == 1
    assert out == ""
    assert "error: cannot connect to the scheduler at tcp://127.0.0.1:1" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv", [["--elements", "0"], ["--elements", "-5"], ["--elements", "ten"], ["--mode", "sideways"],
             ["--workers", "0"], ["--bogus"]]
)
def test_demo_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", *argv])
    assert exc.value.code == 2


# ---------------------------------------------------------------------------------------
# scheduler and worker
# ---------------------------------------------------------------------------------------


def test_dask_command_adds_the_preload_once():
    cmd = cli.dask_command("scheduler", ["--port", "0"])
    assert cmd[:3] == [sys.executable, "-m", "distributed.cli.dask_scheduler"]
    assert cmd[3:] == ["--preload", "dask_dataservice", "--port", "0"]
    for given in (["--preload", "dask_dataservice"], ["--preload=dask_dataservice"]):
        cmd = cli.dask_command("worker", ["tcp://h:1", *given])
        assert cmd[3:] == ["tcp://h:1", *given]
    cmd = cli.dask_command("worker", ["tcp://h:1", "--preload", "other"])
    assert cmd.count("--preload") == 2 and "dask_dataservice" in cmd


def test_dry_run_prints_the_dask_command(capsys):
    assert main(["worker", "--dry-run", "tcp://127.0.0.1:8786", "--nthreads", "2", "--no-nanny"]) == 0
    out, _ = capsys.readouterr()
    assert shlex.split(out) == cli.dask_command(
        "worker", ["tcp://127.0.0.1:8786", "--nthreads", "2", "--no-nanny"]
    )
    assert main(["worker", "--supervise", "--dry-run", "tcp://127.0.0.1:8786", "--nthreads", "2"]) == 0
    out, _ = capsys.readouterr()
    assert shlex.split(out) == [
        sys.executable, "-m", "dask_dataservice.service.supervise", "tcp://127.0.0.1:8786",
        "--nthreads", "2",
    ]


def test_unknown_options_are_refused_by_commands_without_passthrough():
    with pytest.raises(SystemExit) as exc:
        main(["version", "--port", "0"])
    assert exc.value.code == 2


class _Servers:
    """Processes started by a test, stopped (SIGTERM, then SIGKILL) at the end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, *argv: str) -> subprocess.Popen:
        proc = subprocess.Popen(
            list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen, timeout: float = 20, clean: bool = True) -> str:
        """SIGTERM; wait for an exit with code 0 (and no traceback if ``clean``); return stderr."""
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, err
        if clean:
            assert "Traceback" not in err, err
        return err

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.communicate(timeout=10)


@pytest.fixture
def servers():
    s = _Servers()
    try:
        yield s
    finally:
        s.close()


def _scheduler_address(path: Path, proc: subprocess.Popen, timeout: float = 30) -> str:
    def ready():
        if proc.poll() is not None:
            raise AssertionError(f"the scheduler exited ({proc.returncode}): {proc.stderr.read()}")
        try:
            return json.loads(path.read_text())["address"]
        except (OSError, ValueError, KeyError):
            return None

    return _wait_until(ready, timeout, "the scheduler file")


def _data_workers(client, n: int, timeout: float = 30) -> list[str]:
    return _wait_until(
        lambda: (w := client.sync(client.scheduler.dataservice_state)["workers"]) and len(w) >= n
        and list(w),
        timeout,
        f"{n} data worker(s) to register with the dispatcher",
    )


def test_scheduler_and_worker_commands(servers, tmp_path, capsys):
    from distributed import Client

    import dask_dataservice as dds

    exe = str(_console_script())
    scheduler_file = tmp_path / "scheduler.json"
    scheduler = servers.start(
        exe, "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
        "--scheduler-file", str(scheduler_file),
    )
    address = _scheduler_address(scheduler_file, scheduler)
    assert address.startswith("tcp://127.0.0.1:")
    # the scheduler address as an argument, the worker in a nanny (dask's default) ...
    worker = servers.start(exe, "worker", address, "--host", "127.0.0.1", "--nthreads", "1",
                           "--no-dashboard")
    # ... and a supervised one
    supervised = servers.start(exe, "worker", "--supervise", address, "--host", "127.0.0.1")
    with Client(address, timeout="20s", set_as_default=False) as client:
        client.wait_for_workers(2, timeout=30)
        # the dispatcher came with the scheduler: it answers before anyone installed anything
        state = client.sync(client.scheduler.dataservice_state)
        assert state["status"] == "OK"
        workers = _data_workers(client, 2)
        assert client.run(lambda dask_worker: "dataservice" in dask_worker.extensions) == {
            w: True for w in workers
        }
        ds = dds.Dataset.range(1000).map(lambda x: 2 * x).apply(
            dds.distribute("distributed_epoch", client)
        )
        assert sorted(ds) == [2 * x for x in range(1000)]
        # the demo against that cluster: --scheduler (while `client` is open: the service
        # module caches one client per address and would open a stray one after a close)
        assert main(["demo", "--scheduler", address, "--elements", "3000", "--quiet"]) == 0
        out, err = capsys.readouterr()
        assert int(_last_line(out)["n"]) == 3000, err

    assert "Stopping worker" in servers.stop(worker)
    servers.stop(supervised)
    assert "End scheduler" in servers.stop(scheduler)


def test_worker_command_alone_installs_the_worker_plugin(servers, tmp_path):
    """A plain ``dask scheduler``: the worker gets its data-service half from its own preload."""
    from distributed import Client

    scheduler_file = tmp_path / "scheduler.json"
    scheduler = servers.start(
        sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
        "--port", "0", "--no-dashboard", "--scheduler-file", str(scheduler_file),
    )
    _scheduler_address(scheduler_file, scheduler)
    worker = servers.start(
        str(_console_script()), "worker", "--scheduler-file", str(scheduler_file),
        "--host", "127.0.0.1", "--nthreads", "1", "--no-nanny", "--no-dashboard",
    )
    with Client(scheduler_file=str(scheduler_file), timeout="20s", set_as_default=False) as client:
        client.wait_for_workers(1, timeout=30)
        assert list(client.run(lambda dask_worker: "dataservice" in dask_worker.extensions).values()) == [True]
        assert client.run_on_scheduler(lambda dask_scheduler: "dataservice" in dask_scheduler.extensions) is False
    servers.stop(worker)
    # clean=False: until the dispatcher is there, the scheduler logs a warning with a
    # traceback for each heartbeat of a preloaded worker (reported; not the CLI's doing)
    servers.stop(scheduler, clean=False)


# ---------------------------------------------------------------------------------------
# version, help, progress
# ---------------------------------------------------------------------------------------


def test_version(capsys):
    assert main(["version"]) == 0
    out, _ = capsys.readouterr()
    expected = metadata.version("dask-dataservice")
    assert out.strip() == f"dask-dataservice {expected}"
    import dask_dataservice

    if hasattr(dask_dataservice, "__version__"):
        assert dask_dataservice.__version__ == expected


def test_version_verbose(capsys):
    assert main(["version", "--verbose"]) == 0
    out, _ = capsys.readouterr()
    assert re.search(r"^distributed \S+$", out, re.M), out


def test_no_subcommand_prints_help(capsys):
    assert main([]) == 2
    _, err = capsys.readouterr()
    for name in ("demo", "scheduler", "worker", "version"):
        assert name in err


def test_subcommands_are_registered_once():
    parser = cli.build_parser()
    help_text = parser.format_help()
    for name in ("demo", "scheduler", "worker", "version"):
        assert name in cli._COMMANDS
        assert name in help_text
    with pytest.raises(ValueError, match="registered twice"):
        cli.command("demo", help="again")(lambda args: 0)


class _FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_not_a_tty_prints_quarters():
    stream = io.StringIO()
    with Progress(1000, stream=stream, label="t") as bar:
        for _ in range(1000):
            bar.update()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 4
    assert "\r" not in stream.getvalue()
    assert "1000/1000" in lines[-1]


def test_progress_not_a_tty_stopped_early_reports_where():
    stream = io.StringIO()
    with Progress(1000, stream=stream) as bar:
        bar.update(600)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3  # 25%, 50%, and the final "600/1000"
    assert "600/1000" in lines[-1]


def test_progress_tty_redraws_in_place_and_is_rate_limited():
    stream = _FakeTTY()
    with Progress(100_000, stream=stream, max_hz=1e-6) as bar:  # one draw, then throttled
        for _ in range(100_000):
            bar.update()
    text = stream.getvalue()
    assert text.count("\r") == 1  # the first draw only
    assert text.endswith("\n")
    assert "100000/100000" in text.rsplit("\r", 1)[-1]  # the closing draw is complete


def test_scheduler_work_dir_and_worker_list_become_config(capsys, tmp_path):
    assert main(["scheduler", "--work-dir", str(tmp_path / "j"), "--worker-addresses", "w0, w1",
                 "--port", "0", "--dry-run"]) == 0
    import shlex

    words = shlex.split(capsys.readouterr().out)
    env = dict(w.split("=", 1) for w in words if w.startswith("DASK_DATASERVICE__"))
    assert env["DASK_DATASERVICE__DISPATCHER__FAULT_TOLERANT_MODE"] == "True"
    assert env["DASK_DATASERVICE__DISPATCHER__WORK_DIR"] == str(tmp_path / "j")
    # what dask's config does with the variable: a list of two names
    import dask.config

    parsed = dask.config.collect_env({"DASK_DATASERVICE__DISPATCHER__WORKER_ADDRESSES":
                                      env["DASK_DATASERVICE__DISPATCHER__WORKER_ADDRESSES"]})
    from dask_dataservice import config

    with dask.config.set(parsed):
        assert config.get("dispatcher.worker-addresses") == ["w0", "w1"]
    assert words[-4:] == ["--preload", "dask_dataservice", "--port", "0"]
