"""The ``dask-dataservice`` command line: arguments through click's ``CliRunner``, the
commands that start servers as real processes.

The demo runs on an embedded cluster (worker processes by default, threads with
``--no-processes``, which starts in a fraction of the time); ``scheduler`` and ``worker`` are
started as subprocesses on 127.0.0.1 and stopped with SIGTERM. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import psutil
import pytest
from _helpers import Servers, free_port, invoke
from click.testing import CliRunner

from dask_dataservice import cli, demo
from dask_dataservice.demo._cluster import wait_for_data_workers
from dask_dataservice.service.worker.supervise import supervise

pytestmark = [pytest.mark.pure, pytest.mark.timeout(90)]

THROUGHPUT = re.compile(
    r"^demo: (?P<n>\d+) elements in (?P<t>\d+\.\d+) s \((?P<rate>\d+|inf) elements/s\)$"
)
ACCURACY = re.compile(r"demo: accuracy (0\.\d+), log loss (\d+\.\d+), (\d+) steps$")


def _console_script(name: str = "dask-dataservice") -> Path:
    # The script sits next to the interpreter running the tests (``.venv/bin`` in CI).
    path = Path(sys.executable).parent / (f"{name}.exe" if os.name == "nt" else name)
    if not path.exists():
        pytest.fail(f"console script not installed at {path}; run `pip install -e .` first")
    return path


def _last_line(out: str) -> re.Match:
    lines = out.splitlines()
    assert lines, "nothing on stdout"
    m = THROUGHPUT.match(lines[-1])
    assert m, lines[-1]
    return m


def _run(*argv: str, timeout: float = 80) -> subprocess.CompletedProcess:
    """Run a command in its own process group; fail if it leaves a process behind (after
    killing it)."""
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        _, alive = psutil.wait_procs(_process_group(proc.pid), timeout=10)
        assert not alive, f"processes outlived the command: {alive}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.communicate(timeout=10)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# ---------------------------------------------------------------------------------------
# demo
# ---------------------------------------------------------------------------------------


@pytest.mark.process
def test_demo_on_cluster_in_process():
    # The streaming demo: worker processes of an embedded cluster, DYNAMIC sharding.
    rc, out, err = invoke("demo", "--no-train", "--elements", "10000", "--quiet")
    assert rc == 0, err
    assert len(out.splitlines()) == 1, out
    m = _last_line(out)
    assert int(m["n"]) == 10_000  # DYNAMIC: every example exactly once
    assert float(m["t"]) >= 0
    assert err == ""  # --quiet: no progress bar, no status lines


@pytest.mark.slow
@pytest.mark.process
def test_demo_trains_with_parameter_servers(tmp_path):
    # The default, the whole story: data service -> per-worker datasets -> PS training.
    ckpt = tmp_path / "ckpt"
    rc, out, err = invoke("demo", "--elements", "20000", "--quiet", "--checkpoint", str(ckpt))
    assert rc == 0, err
    lines = out.splitlines()
    assert len(lines) == 2, out
    accuracy = ACCURACY.match(lines[0])
    assert accuracy, lines[0]
    assert float(accuracy.group(1)) > 0.7  # above chance, and near the ~0.77 base rate at least
    # steps are those that trained on a batch: each data worker (2) may end its share with a
    # partial batch, and scheduled calls that found the stream over are not steps
    batches = math.ceil(20_000 / 256)
    assert batches <= int(accuracy.group(3)) <= batches + 2, lines[0]
    assert int(_last_line(out)["n"]) == 20_000  # every example trained on exactly once
    import zarr

    group = zarr.open_group(str(ckpt), mode="r")  # zarr's I/O thread: started by conftest
    assert any(True for _ in group.keys()), "the checkpoint holds the variables"


@pytest.mark.cluster
def test_demo_mode_off_every_worker_produces_everything():
    rc, out, err = invoke("demo", "--mode", "OFF", "--no-processes", "--workers", "2",
                          "--elements", "3000")
    assert rc == 0, err
    assert int(_last_line(out)["n"]) == 2 * 3000
    assert "sharding policy OFF" in err
    assert "2 in-process workers" in err
    assert "accuracy" not in out  # --mode off: no training


@pytest.mark.cluster
def test_demo_three_workers_dynamic():
    rc, out, err = invoke("demo", "--no-train", "--no-processes", "--workers", "3",
                          "--elements", "4000", "--batch-size", "333")
    assert rc == 0, err
    assert int(_last_line(out)["n"]) == 4000  # partial batches on each worker counted too
    assert "3 data workers, sharding policy DYNAMIC" in err


@pytest.mark.component
def test_demo_local():
    rc, out, err = invoke("demo", "--local", "--elements", "10_000", "--quiet")
    assert rc == 0
    assert len(out.splitlines()) == 1, out
    assert int(_last_line(out)["n"]) == 10_000
    assert err == ""


@pytest.mark.component
def test_demo_local_batch_size_not_dividing_elements():
    # 1000 = 3 * 333 + 1: the last, partial batch must be counted too.
    rc, out, _ = invoke("demo", "--local", "--elements", "1000", "--batch-size", "333", "--quiet")
    assert rc == 0
    assert int(_last_line(out)["n"]) == 1000


@pytest.mark.component
def test_demo_pipeline_contents():
    ds = demo.make_click_dataset(1000, batch_size=100, shuffle_buffer=50, seed=1)
    batches = list(ds)
    assert len(batches) == 10
    for b in batches:
        assert set(b) == {"dense", "sparse", "label"}
        assert b["dense"].shape == (100, demo.DENSE_FEATURES)
        assert b["sparse"].shape == (100, demo.SPARSE_FEATURES)
        assert b["label"].shape == (100,)
        assert (b["sparse"] >= 0).all() and (b["sparse"] < demo.VOCAB_SIZE).all()
        assert (b["dense"] >= 0).all()  # log1p of positive values


@pytest.mark.component
def test_demo_pipeline_is_small_splittable_and_deterministic():
    import cloudpickle
    import numpy as np

    n = 20_000
    ds = demo.make_click_dataset(n, batch_size=64, seed=3)
    assert ds.splittable  # DYNAMIC sharding hands out blocks of rows
    assert len(ds.splits()) > 1
    # the rows are generated where the pipeline runs: shipping it costs no data
    assert len(cloudpickle.dumps(ds)) < 20_000

    def rows(dataset):
        dense = np.concatenate([b["dense"] for b in dataset])
        return dense[np.lexsort(dense.T[::-1])]

    # the same rows whatever the shuffle, and whichever split is read first
    a = rows(ds)
    b = rows(demo.make_click_dataset(n, batch_size=1000, shuffle_buffer=7, seed=3))
    c = rows(ds.iterate(list(reversed(ds.splits()))))
    assert a.shape == (n, demo.DENSE_FEATURES)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)


def test_demo_modules_do_not_import_the_package_top_level_from_below():
    # ps/ no longer holds the demo (a lower layer importing the package top level)
    import importlib.util

    assert importlib.util.find_spec("dask_dataservice.ps.demo") is None
    assert demo.train_click_model.__module__ == "dask_dataservice.demo._train"


@pytest.mark.process
def test_console_script_demo_in_a_pipe(tmp_path):
    # stderr is a pipe here, not a terminal: status lines (one of them before the wait for
    # the first batch), each once; no progress bar redraws, nothing from Dask
    proc = _run(str(_console_script()), "demo", "--no-train", "--elements", "5000")
    assert proc.returncode == 0, proc.stderr
    assert int(_last_line(proc.stdout)["n"]) == 5000
    assert len(proc.stdout.splitlines()) == 1, proc.stdout
    err = proc.stderr
    assert "\r" not in err and "%|" not in err, err
    assert "Traceback" not in err and " - WARNING - " not in err and " - INFO - " not in err, err
    lines = err.splitlines()
    assert len(lines) == len(set(lines)), err  # no line twice
    assert all(line.startswith("demo: ") for line in lines), err
    assert "2 worker processes x 1 thread" in err
    assert lines.index("demo: waiting for the first batch") < len(lines) - 1


@pytest.mark.slow
@pytest.mark.process
def test_demo_verbose_shuts_down_without_a_traceback():
    # -v shows Dask's logs; a normal shutdown must not show errors among them
    proc = _run(str(_console_script()), "demo", "-v", "--elements", "5000")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "Traceback" not in output, output
    assert "CommClosedError" not in output, output
    assert ACCURACY.match(proc.stdout.splitlines()[0]), proc.stdout
    # the status line names the parameter servers in plain words (was "2's parameter servers")
    assert "demo: training on 2 workers (they also serve the data) with 2 parameter servers" \
        in proc.stderr, proc.stderr
    assert "'s parameter servers" not in proc.stderr


def _process_group(pgid: int) -> list:
    """The live processes of the process group ``pgid``."""
    alive = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except (ProcessLookupError, psutil.Error):
            pass
    return alive


def test_progress_bar_only_where_it_can_redraw(monkeypatch):
    import io

    from dask_dataservice.demo import _run as run

    class TTY(io.StringIO):
        def isatty(self) -> bool:
            return True

    opts = demo.DemoOptions()
    for stream, drawn in ((io.StringIO(), False), (TTY(), True)):
        monkeypatch.setattr(sys, "stderr", stream)
        with run._progress(opts, 1000, "read") as bar:
            bar.update(1000)
        assert ("1.00k/1.00k" in stream.getvalue()) is drawn, stream.getvalue()
    stream = TTY()
    monkeypatch.setattr(sys, "stderr", stream)
    with run._progress(demo.DemoOptions(quiet=True), 10, "read") as bar:
        bar.update(10)
    assert stream.getvalue() == ""


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--local", "--workers", "2"], "--local runs without Dask; it cannot be used with --workers"),
        (["--local", "--mode", "off"], "cannot be used with --mode"),
        (["--local", "--train"], "cannot be used with --train"),
        (["--scheduler", "tcp://127.0.0.1:1", "--workers", "2"], "cannot be used with --scheduler"),
        (["--train", "--mode", "off"], "training reads the data once"),
        (["--scheduler", "tcp://127.0.0.1:port"], "cannot parse the address"),
    ],
)
def test_demo_rejects_conflicting_options(argv, message):
    rc, out, err = invoke("demo", *argv)
    assert rc == 2
    assert message in err


@pytest.mark.component
def test_demo_unreachable_scheduler_is_a_one_line_error():
    # also: no IO loop thread left behind by the client that could not connect (leak check)
    import dask

    with dask.config.set({"dataservice.client.connect-timeout": "0.5s"}):
        rc, out, err = invoke("demo", "--scheduler", "127.0.0.1:1", "--elements", "10")
    assert rc == 1
    assert out == ""
    assert "Error: cannot connect to the scheduler at tcp://127.0.0.1:1" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv", [["--elements", "0"], ["--elements", "-5"], ["--elements", "ten"], ["--mode", "sideways"],
             ["--workers", "0"], ["--bogus"]]
)
def test_demo_rejects_bad_arguments(argv):
    rc, _, err = invoke("demo", *argv)
    assert rc == 2, err
    assert "Error" in err


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


@pytest.mark.pure
def test_the_http_server_listens_on_the_listen_host():
    """Issue 22: ``--host H`` without ``--dashboard-address`` gets ``--dashboard-address
    H:PORT`` (Dask's HTTP server serves /metrics and status.json with --no-dashboard too)."""
    assert cli.http_on_listen_host(["--host", "127.0.0.1", "--no-dashboard"], 8787) == [
        "--host", "127.0.0.1", "--no-dashboard", "--dashboard-address", "127.0.0.1:8787"]
    assert cli.http_on_listen_host(["--host=tcp://10.0.0.5:8786"], 0)[-1] == "10.0.0.5:0"
    assert cli.http_on_listen_host(["--listen-address", "tls://10.0.0.5"], 0)[-1] == "10.0.0.5:0"
    for unchanged in (["--host", "h", "--dashboard-address", ":9"], ["--port", "1"],
                      ["--host", "::1"], ["--host", "[::1]:8786"]):
        assert cli.http_on_listen_host(unchanged, 0) == unchanged
    rc, out, _ = invoke("scheduler", "--dry-run", "--host", "127.0.0.1", "--no-dashboard")
    assert rc == 0 and shlex.split(out)[-2:] == ["--dashboard-address", "127.0.0.1:8787"]
    rc, out, _ = invoke("worker", "--dry-run", "tcp://h:1", "--host", "127.0.0.1")
    assert rc == 0 and shlex.split(out)[-4:-2] == ["--dashboard-address", "127.0.0.1:0"]


def test_dry_run_prints_the_dask_command():
    dask_args = ["tcp://127.0.0.1:8786", "--nthreads", "2", "--no-nanny", "--nworkers", "2",
                 "--resources", "ps=1", "--tls-ca-file", "ca.pem"]
    rc, out, _ = invoke("worker", "--dry-run", *dask_args)
    assert rc == 0
    # with the worker class whose clean stop logs no heartbeat traceback, unless one is given
    assert shlex.split(out) == cli.dask_command(
        "worker", [*dask_args, "--worker-class", cli.QUIET_STOP_WORKER])
    rc, out, _ = invoke("worker", "--dry-run", *dask_args, "--worker-class=my.Worker")
    assert shlex.split(out) == cli.dask_command("worker", [*dask_args, "--worker-class=my.Worker"])
    # supervised: the same `dask worker` command, every option included, run and restarted
    # (with the worker class that rides out a scheduler restart, unless one is given)
    rc, out, _ = invoke("worker", "--supervise", "--dry-run", *dask_args)
    assert rc == 0
    assert shlex.split(out) == cli.dask_command(
        "worker", [*dask_args, "--worker-class", cli.RECONNECTING_WORKER])
    rc, out, _ = invoke("worker", "--supervise", "--dry-run", *dask_args,
                        "--worker-class", "my.Worker")
    assert shlex.split(out) == cli.dask_command("worker", [*dask_args, "--worker-class",
                                                           "my.Worker"])


def test_unknown_options_are_refused_by_commands_without_passthrough():
    rc, _, err = invoke("version", "--port", "0")
    assert rc == 2, err


_SCRIPTED_CHILD = (
    # exits with the codes of argv[2] in turn ("0,1,..."), counting its runs in the file argv[1]
    "import pathlib, sys; p = pathlib.Path(sys.argv[1]); "
    "n = len(p.read_text()) if p.exists() else 0; p.write_text('x' * (n + 1)); "
    "sys.exit(int(sys.argv[2].split(',')[n]))")


@pytest.mark.process
def test_supervisor_restarts_a_worker_that_ended_and_gives_up_on_one_that_keeps_failing(tmp_path):
    # a child that ends with 0 (its scheduler went away) starts again; so does one that failed
    # (e.g. "Nanny failed to start" when its scheduler went away mid-registration), until it
    # fails three times in a row: then the supervisor ends with its code
    runs = tmp_path / "runs"
    messages = []
    codes = "0,1,0,1,1,3"
    assert supervise([sys.executable, "-c", _SCRIPTED_CHILD, str(runs), codes],
                     announce=messages.append) == 3
    assert runs.read_text() == "x" * 6
    assert len([m for m in messages if m.startswith("the worker failed (exit code 1)")]) == 3
    assert messages[-1] == "the worker failed 3 times in a row at its start (exit code 3); giving up"


@pytest.mark.process
def test_supervisor_ends_at_once_on_a_usage_error(tmp_path):
    runs = tmp_path / "runs"
    messages = []
    assert supervise([sys.executable, "-c", _SCRIPTED_CHILD, str(runs), "0,2,0"],
                     announce=messages.append) == 2
    assert runs.read_text() == "xx"
    assert len(messages) == 2 and "restart 1" in messages[-1]


@pytest.mark.process
def test_a_stop_signal_while_the_supervisor_restarts_its_worker_reaches_the_new_one(
        tmp_path, monkeypatch):
    """SIGTERM lands while the supervisor starts the next child: its handler still sees the
    ended one. The new child must get the signal (before, it was passed to nobody: the
    supervisor then waited on a worker that never stopped, and a test's SIGTERM timed out).
    The signal is sent from inside the second start, before the new child exists."""
    import dask_dataservice.service.worker.supervise as supervise_module

    runs = tmp_path / "runs"
    child = (  # run 1 ends at once (its scheduler went away); run 2 waits to be stopped
        "import pathlib, sys, time; p = pathlib.Path(sys.argv[1]); "
        "n = len(p.read_text()) if p.exists() else 0; p.write_text('x' * (n + 1)); "
        "sys.exit(0) if n == 0 else (time.sleep(20), sys.exit(7))")
    real_popen = subprocess.Popen
    starts = []

    def popen(*args, **kwargs):
        starts.append(1)
        if len(starts) == 2:  # the restart: stop now, before the child exists
            os.kill(os.getpid(), signal.SIGTERM)
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(supervise_module.subprocess, "Popen", popen)
    began = time.monotonic()
    rc = supervise([sys.executable, "-c", child, str(runs)], announce=lambda m: None)
    assert rc == -signal.SIGTERM, f"the new child was not stopped (exit code {rc})"
    assert time.monotonic() - began < 15
    assert len(starts) == 2  # (the second child may be stopped before it counts its run)
    assert runs.read_text() in ("x", "xx")


@pytest.mark.process
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_supervisor_takes_its_worker_with_it(tmp_path):
    # SIGKILL leaves no chance to forward a signal: the child must still not outlive it
    pid_file = tmp_path / "child.pid"
    child = ("import os, pathlib, sys, time; "
             f"pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid())); time.sleep(600)")
    code = ("import sys; from dask_dataservice.service.worker.supervise import supervise; "
            f"sys.exit(supervise([sys.executable, '-c', {child!r}]))")
    supervisor = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
    try:
        deadline = psutil.time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert psutil.time.monotonic() < deadline, "the child never started"
            assert supervisor.poll() is None, supervisor.stderr.read()
            psutil.time.sleep(0.05)  # polling a file the child writes (another process)
        worker = psutil.Process(int(pid_file.read_text()))
        supervisor.kill()
        supervisor.wait(10)
        gone, alive = psutil.wait_procs([worker], timeout=10)
        assert not alive, "the worker outlived its SIGKILLed supervisor"
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait(10)
        supervisor.stderr.close()


@pytest.fixture
def servers():
    with Servers() as s:
        yield s


@pytest.mark.slow
@pytest.mark.process
def test_scheduler_and_worker_commands(servers, tmp_path):
    from distributed import Client

    import dask_dataservice as dds

    exe = str(_console_script())
    scheduler_file = tmp_path / "scheduler.json"
    scheduler = servers.start(
        exe, "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
        "--scheduler-file", str(scheduler_file),
    )
    # the client waits for the scheduler file (Dask options reach `dask scheduler`)
    with Client(scheduler_file=str(scheduler_file), timeout="30s", set_as_default=False) as client:
        address = client.scheduler.address
        assert address.startswith("tcp://127.0.0.1:")
        # the dispatcher came with the scheduler: it answers before anyone installed anything
        state = client.sync(client.scheduler.dataservice_state)
        assert state["status"] == "OK"
        # the scheduler address as an argument, the worker in a nanny (dask's default)
        worker = servers.start(exe, "worker", address, "--host", "127.0.0.1", "--nthreads", "1",
                               "--no-dashboard", "--name", "data")
        client.wait_for_workers(1, timeout=30)
        assert wait_for_data_workers(client, 1) == 1
        workers = list(client.sync(client.scheduler.dataservice_state)["workers"])
        assert client.run(lambda dask_worker: "dataservice" in dask_worker.extensions) == {
            w: True for w in workers
        }
        ds = dds.Dataset.range(1000).map(lambda x: 2 * x).apply(
            dds.distribute("distributed_epoch", client)
        )
        assert sorted(ds) == [2 * x for x in range(1000)]
        # the demo against that cluster: no parameter servers, so it streams (no training)
        rc, out, err = invoke("demo", "--scheduler", address, "--elements", "3000", "--quiet")
        assert rc == 0, err
        assert len(out.splitlines()) == 1 and int(_last_line(out)["n"]) == 3000, out
        rc, out, err = invoke("demo", "--scheduler", address, "--train", "--elements", "10")
        assert rc == 1 and "--train needs parameter servers" in err, err

        # a supervised worker: every Dask option reaches `dask worker` (two processes, each
        # a parameter server)
        supervised = servers.start(exe, "worker", "--supervise", address, "--host", "127.0.0.1",
                                   "--nworkers", "2", "--nthreads", "1", "--resources", "ps=1",
                                   "--no-dashboard", "--name", "ps")
        client.wait_for_workers(3, timeout=30)
        info = client.scheduler_info(n_workers=-1)["workers"].values()
        resources = sorted((w["name"], w["resources"]) for w in info)
        assert resources == [("data", {}), ("ps-0", {"ps": 1}), ("ps-1", {"ps": 1})], resources
        # ... and now the demo trains on that cluster, by default
        rc, out, err = invoke("demo", "--scheduler", address, "--elements", "3000", "--quiet")
        assert rc == 0, err
        assert ACCURACY.match(out.splitlines()[0]), out
        assert int(_last_line(out)["n"]) == 3000

    assert "Stopping worker" in servers.stop(worker)
    servers.stop(supervised)
    assert "End scheduler" in servers.stop(scheduler)


@pytest.mark.slow
@pytest.mark.process
def test_supervised_workers_come_back_with_their_options_after_a_scheduler_restart(servers):
    from distributed import Client

    exe = str(_console_script())
    address = f"tcp://127.0.0.1:{free_port()}"
    scheduler_argv = (exe, "scheduler", "--host", "127.0.0.1", "--port", address.rsplit(":", 1)[1],
                      "--no-dashboard")
    scheduler = servers.start(*scheduler_argv)
    supervised = servers.start(exe, "worker", "--supervise", address, "--host", "127.0.0.1",
                               "--nworkers", "2", "--nthreads", "1", "--resources", "ps=1",
                               "--no-dashboard", "--name", "ps")

    def workers(client) -> list:
        client.wait_for_workers(2, timeout=60)
        info = client.scheduler_info(n_workers=-1)["workers"].values()
        return sorted((w["name"], w["nthreads"], w["resources"]) for w in info)

    expected = [("ps-0", 1, {"ps": 1}), ("ps-1", 1, {"ps": 1})]
    with Client(address, timeout="30s", set_as_default=False) as client:
        assert workers(client) == expected
    servers.stop(scheduler)  # the workers lose their scheduler and wait for it
    scheduler = servers.start(*scheduler_argv)
    with Client(address, timeout="30s", set_as_default=False) as client:
        try:
            back = workers(client)
        except Exception as e:  # say what the supervised workers did meanwhile
            raise AssertionError(servers.read_stderr(supervised)[-6000:]) from e
        assert back == expected  # the same workers, with every option
    # clean=False: losing its scheduler, the first worker logged distributed's INFO lines on
    # the closed comms, with their tracebacks (expected here)
    err = servers.stop(supervised, clean=False)
    assert "waits for the scheduler to come back" in err, err
    # they registered again (the same processes); or, when the scheduler stopped while a nanny
    # was still registering (`dask worker` fails then), the supervisor started them again
    assert "restart 1)" not in err or "the worker failed (exit code 1)" in err, err
    # clean=False: the workers stopped first, and the scheduler's batched stream to one of them
    # may log its closed comm with a traceback (distributed's INFO line; seen once in CI)
    servers.stop(scheduler, clean=False)


@pytest.mark.process
def test_worker_command_alone_installs_the_worker_plugin(servers, tmp_path):
    """A plain ``dask scheduler``: the worker gets its data-service half from its own preload."""
    from distributed import Client

    scheduler_file = tmp_path / "scheduler.json"
    scheduler = servers.start(
        sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
        "--port", "0", "--no-dashboard", "--scheduler-file", str(scheduler_file),
    )
    worker = servers.start(
        str(_console_script()), "worker", "--scheduler-file", str(scheduler_file),
        "--host", "127.0.0.1", "--nthreads", "1", "--no-nanny", "--no-dashboard",
    )
    with Client(scheduler_file=str(scheduler_file), timeout="20s", set_as_default=False) as client:
        client.wait_for_workers(1, timeout=30)
        assert list(client.run(lambda dask_worker: "dataservice" in dask_worker.extensions).values()) == [True]
        assert client.run_on_scheduler(lambda dask_scheduler: "dataservice" in dask_scheduler.extensions) is False
        address = client.scheduler.address
    rc, _, err = invoke("ready", address)  # a plain dask scheduler: no dispatcher
    assert rc == 1 and "has no data-service dispatcher" in err, err
    servers.stop(worker)
    # clean=False: until the dispatcher is there, the scheduler logs a warning with a
    # traceback for each heartbeat of a preloaded worker (reported; not the CLI's doing)
    servers.stop(scheduler, clean=False)


@pytest.mark.process
def test_dask_dataservice_is_a_subcommand_of_dask():
    # registered through the `dask_cli` entry points, as Dask's own tools are
    dask = str(_console_script("dask"))
    proc = _run(dask, "dataservice", "--version", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"dask-dataservice {metadata.version('dask-dataservice')}"
    proc = _run(dask, "dataservice", "worker", "--dry-run", "tcp://h:1", "--nthreads", "2",
                timeout=60)
    assert proc.returncode == 0, proc.stderr
    # the same command (run by the interpreter of the `dask` script)
    assert shlex.split(proc.stdout)[1:] == cli.dask_command(
        "worker", ["tcp://h:1", "--nthreads", "2", "--worker-class", cli.QUIET_STOP_WORKER])[1:]
    assert "dataservice" in _run(dask, "--help", timeout=60).stdout


# ---------------------------------------------------------------------------------------
# version, help
# ---------------------------------------------------------------------------------------


def test_version():
    expected = f"dask-dataservice {metadata.version('dask-dataservice')}"
    for argv in (["version"], ["--version"]):
        rc, out, _ = invoke(*argv)
        assert rc == 0
        assert out.strip() == expected
    import dask_dataservice

    assert dask_dataservice.__version__ == metadata.version("dask-dataservice")


def test_version_verbose():
    rc, out, _ = invoke("version", "--verbose")
    assert rc == 0
    assert re.search(r"^distributed \S+$", out, re.M), out
    assert re.search(r"^click \S+$", out, re.M), out


def test_no_subcommand_prints_help():
    rc, out, err = invoke()
    assert rc == 2
    for name in ("demo", "scheduler", "worker", "ready", "version"):
        assert name in out + err


def test_subcommands_and_their_help():
    assert set(cli.dataservice.commands) == {"demo", "scheduler", "worker", "ready", "version"}
    rc, out, _ = invoke("demo", "--help")
    assert rc == 0
    assert "--scheduler ADDRESS" in out and "--train / --no-train" in out
    rc, out, _ = invoke("worker", "--help")
    assert rc == 0
    assert "--supervise" in out and "--nworkers" in out


def test_scheduler_work_dir_and_worker_list_become_config(tmp_path):
    rc, out, _ = invoke("scheduler", "--work-dir", str(tmp_path / "j"), "--worker-addresses",
                        "w0, w1", "--port", "0", "--dry-run")
    assert rc == 0
    words = shlex.split(out)
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


def test_scheduler_work_dir_url_is_passed_as_given():
    """A journal URL (issue 24 s4) is not made a local path (it was ``$PWD/s3:/bucket/dds``)."""
    rc, out, _ = invoke("scheduler", "--work-dir", "s3://bucket/dds", "--dry-run")
    assert rc == 0
    env = dict(w.split("=", 1) for w in shlex.split(out) if w.startswith("DASK_DATASERVICE__"))
    assert env["DASK_DATASERVICE__DISPATCHER__WORK_DIR"] == "s3://bucket/dds"


# ---------------------------------------------------------------------------------------
# the warning for a scheduler open to the network without TLS (issue 11 s6)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dask_args", [
    [],  # dask's default: every interface
    ["--host", "0.0.0.0"],
    ["--host=192.0.2.7", "--port", "8786"],
    ["--host", "tcp://0.0.0.0"],
    ["--interface", "eth0"],
    ["--protocol", "tcp", "--host", "::"],
])
def test_scheduler_warns_when_it_listens_beyond_loopback_without_tls(dask_args):
    rc, out, err = invoke("scheduler", "--dry-run", *dask_args)
    assert rc == 0
    assert "warning: the scheduler listens on" in err and "without TLS" in err, err
    assert "--tls-cert" in err and "--host 127.0.0.1" in err
    # it still starts (its HTTP server on the listen host: issue 22)
    assert shlex.split(out) == cli.dask_command("scheduler", cli.http_on_listen_host(dask_args, 8787))


@pytest.mark.parametrize("dask_args", [
    ["--host", "127.0.0.1"],
    ["--host", "localhost", "--port", "0"],
    ["--host", "::1"],
    ["--host", "tcp://127.0.0.2"],
    ["--interface", "lo"],
    ["--protocol", "tls"],
    ["--host", "tls://0.0.0.0"],
    ["--tls-ca-file", "ca.pem", "--tls-cert", "s.pem", "--tls-key", "s.key"],
    ["--protocol", "inproc"],
])
def test_scheduler_does_not_warn_on_loopback_or_with_tls(dask_args):
    rc, _, err = invoke("scheduler", "--dry-run", *dask_args)
    assert rc == 0
    assert "warning" not in err, err


def test_scheduler_does_not_warn_when_dask_config_asks_for_tls():
    import dask.config

    for key, value in [("distributed.comm.require-encryption", True),
                       ("distributed.comm.default-scheme", "tls"),
                       ("distributed.comm.tls.scheduler.cert", "s.pem")]:
        with dask.config.set({key: value}):
            assert cli.insecure_listen_warning(["--host", "0.0.0.0"]) is None, key
    assert cli.insecure_listen_warning(["--host", "0.0.0.0"]) is not None


@pytest.mark.process
def test_scheduler_process_on_every_interface_warns(servers, tmp_path):
    # the real command: the warning is on stderr before Dask's own lines, and the scheduler runs
    from distributed import Client

    scheduler_file = tmp_path / "scheduler.json"
    proc = servers.start(str(_console_script()), "scheduler", "--port", "0", "--no-dashboard",
                         "--scheduler-file", str(scheduler_file))
    with Client(scheduler_file=str(scheduler_file), timeout="30s", set_as_default=False) as client:
        assert client.sync(client.scheduler.dataservice_state)["status"] == "OK"
        address = client.scheduler.address
    # the readiness probe: the dispatcher answers; with --min-workers it waits for workers
    rc, out, err = invoke("ready", address)
    assert (rc, out.strip()) == (0, f"dask-dataservice ready: the dispatcher at {address} answers"), err
    rc, _, err = invoke("ready", address, "--min-workers", "1")
    assert rc == 1 and "0 data workers registered" in err, err
    err = servers.stop(proc)
    assert err.splitlines()[0].startswith("dask-dataservice: warning: the scheduler listens on "
                                          "every network interface without TLS"), err


def test_demo_tls_scheduler_without_certificates_is_a_usage_error(tmp_path):
    rc, _, err = invoke("demo", "--scheduler", "tls://127.0.0.1:1", "--elements", "10")
    assert rc == 2
    assert "speaks TLS" in err and "--tls-ca-file, --tls-cert, --tls-key" in err, err
    pem = tmp_path / "ca.pem"
    pem.write_text("not used")
    rc, _, err = invoke("demo", "--tls-ca-file", str(pem), "--elements", "10")
    assert rc == 2 and "are for --scheduler tls://" in err, err


@pytest.mark.component
def test_ready_without_a_scheduler():
    rc, _, err = invoke("ready", f"tcp://127.0.0.1:{free_port()}", "--timeout", "1s")
    assert rc == 1 and "cannot reach the scheduler at tcp://127.0.0.1:" in err, err
    rc, _, err = invoke("ready", "tls://127.0.0.1:1")
    assert rc == 2 and "speaks TLS" in err, err
    result = CliRunner(env={"DASK_SCHEDULER_ADDRESS": None}).invoke(cli.dataservice, ["ready"])
    assert result.exit_code == 2 and "give the scheduler's ADDRESS" in result.stderr


@pytest.mark.parametrize("dask_args, warns", [
    (["tcp://10.0.0.1:8786"], True),  # dask's default: every interface
    (["tcp://10.0.0.1:8786", "--listen-address", "tcp://0.0.0.0:9000"], True),
    (["tcp://127.0.0.1:8786", "--host", "127.0.0.1"], False),
    (["tcp://127.0.0.1:8786", "--listen-address", "tcp://127.0.0.1:9000"], False),
    (["tcp://127.0.0.1:8786", "--listen-address", "tcp://[::1]:9000"], False),
    (["tls://10.0.0.1:8786"], False),  # a TLS scheduler: the worker speaks TLS too
    (["--scheduler-file", "s.json", "--tls-ca-file", "ca.pem"], False),
])
def test_worker_warns_when_it_listens_beyond_loopback_without_tls(dask_args, warns):
    rc, out, err = invoke("worker", "--dry-run", *dask_args)
    assert rc == 0
    assert ("warning: the worker listens on" in err) is warns, err
    assert shlex.split(out) == cli.dask_command(
        "worker", [*cli.http_on_listen_host(dask_args, 0), "--worker-class", cli.QUIET_STOP_WORKER])
