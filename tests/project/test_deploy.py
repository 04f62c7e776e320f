"""The deployment recipes of docs/deploy.md, tested as far as this machine allows (issue 15).

The recipes are the page's own ``{code-block} python`` blocks (found by their ``:name:``),
executed here; the docs runner skips them (they need a launcher's package, and the jobqueue
one starts a scheduler). No batch system or Kubernetes cluster is needed:

- dask-jobqueue: the cluster object is built with the recipe's options (its scheduler runs in
  this process, with the dispatcher), and the generated job scripts hold the preload (through
  ``dask_dataservice.cli worker --supervise``), the ``ps`` resource, the work dirs and TLS;
- the dask-kubernetes operator: the generated resources hold what the page says;
- the Helm chart: the values block;
- Gateway-style clusters: ``dds.install(client)`` on a plain ``dask scheduler`` and ``dask
  worker`` started as processes, and the preload given by an environment variable only.
"""

from __future__ import annotations

import copy
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from _helpers import Servers, free_port, needs

pytestmark = [pytest.mark.pure, pytest.mark.timeout(90)]

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "deploy.md"


def recipe(name: str) -> str:
    """The code of the ``{code-block} <language>`` block named ``name`` on the page."""
    text = PAGE.read_text(encoding="utf-8")
    m = re.search(r"^```\{code-block\} \w+\n:name: " + re.escape(name) + r"\n(.*?)^```$", text,
                  re.M | re.S)
    assert m, f"no block named {name} in {PAGE}"
    return m.group(1)


def fenced(language: str) -> list[str]:
    """The plain ```` ```language ```` blocks of the page."""
    return re.findall(r"^```" + language + r"\n(.*?)^```$", PAGE.read_text(encoding="utf-8"),
                      re.M | re.S)


# ---------------------------------------------------------------------------------------
# dask-jobqueue
# ---------------------------------------------------------------------------------------


@pytest.fixture
def jobqueue_recipe(tmp_path):
    """The page's jobqueue recipe run with its shared directory in ``tmp_path`` and a free
    port; its namespace (the cluster is closed afterwards)."""
    needs("dask_jobqueue", "test")
    import dask.config

    code = recipe("recipe-jobqueue")
    assert code.count('Path("/shared/dds")') == 1 and code.count("PORT = 8786") == 1
    shared = tmp_path / "shared"
    code = code.replace('Path("/shared/dds")', f"Path({str(shared)!r})")
    code = code.replace("PORT = 8786", f"PORT = {free_port()}")
    namespace: dict = {"__name__": "recipe"}
    saved = copy.deepcopy(dask.config.config)  # the recipe's dask.config.set stays in this test
    try:
        exec(compile(code, str(PAGE), "exec"), namespace)
        try:
            yield namespace
        finally:
            namespace["cluster"].close()
    finally:
        dask.config.config.clear()
        dask.config.config.update(saved)


def _worker_command(script: str) -> list[str]:
    """The worker command line of a job script (its last non-empty line)."""
    return shlex.split([line for line in script.splitlines() if line.strip()][-1])


@pytest.mark.cluster
def test_jobqueue_recipe_job_scripts(jobqueue_recipe):
    ns = jobqueue_recipe
    shared, port = ns["SHARED"], ns["PORT"]
    cluster = ns["cluster"]
    # the scheduler runs here, on the fixed port, over TLS, with the dispatcher journaling
    # to the shared directory
    assert cluster.scheduler_address.startswith("tls://")
    assert cluster.scheduler_address.endswith(f":{port}")
    dispatcher = cluster.scheduler.plugins["dataservice-dispatcher"]
    assert dispatcher.fault_tolerant_mode and dispatcher.work_dir == str(shared / "journal")
    assert (shared / "journal").is_dir()
    # the certificates are on the shared filesystem, readable by their owner only
    for name in ("ca.pem", "cert.pem", "key.pem"):
        assert (shared / "certs" / name).stat().st_mode & 0o777 == 0o600

    script = cluster.job_script()
    assert "#SBATCH -J dds-worker" in script
    assert f"export DASK_DATASERVICE__PS__WORK_DIR={shared / 'ps'}" in script
    argv = _worker_command(script)
    # `python -m dask_dataservice.cli worker --supervise`: the CLI adds the preload
    assert argv[:5] == [sys.executable, "-m", "dask_dataservice.cli", "worker", "--supervise"]
    assert argv[5] == cluster.scheduler_address
    assert "--resources" not in argv
    assert argv[argv.index("--death-timeout") + 1] == "600"
    tls = {argv[i]: argv[i + 1] for i, a in enumerate(argv) if a.startswith("--tls-")}
    assert tls == {"--tls-ca-file": str(shared / "certs" / "ca.pem"),
                   "--tls-cert": str(shared / "certs" / "cert.pem"),
                   "--tls-key": str(shared / "certs" / "key.pem")}

    # the parameter servers: their own job scripts, with the `ps` resource and unique names
    from dask_dataservice import cli

    for i, path in enumerate(ns["ps_scripts"]):
        ps_script = path.read_text()
        assert "#SBATCH -J dds-ps" in ps_script
        assert f"export DASK_DATASERVICE__PS__WORK_DIR={shared / 'ps'}" in ps_script
        ps_argv = _worker_command(ps_script)
        assert ps_argv[2:6] == ["dask_dataservice.cli", "worker", "--supervise",
                                cluster.scheduler_address]
        assert ps_argv[ps_argv.index("--name") + 1] == f"dds-ps-{i}"
        assert ps_argv[ps_argv.index("--resources") + 1] == "ps=1"
        # what the supervisor runs: `dask worker` with the preload and every option
        dask_argv = cli.dask_command("worker", ps_argv[5:])
        assert dask_argv[3:5] == ["--preload", "dask_dataservice"]
        assert "--tls-cert" in dask_argv and "ps=1" in dask_argv


@pytest.mark.cluster
def test_jobqueue_recipe_options_build_a_pbs_cluster(jobqueue_recipe):
    from dask_jobqueue import PBSCluster

    ns = jobqueue_recipe
    with PBSCluster(cores=4, memory="16GB", job_name="dds-pbs",
                    scheduler_options={"dashboard_address": ":0"}, **ns["JOB"]) as cluster:
        script = cluster.job_script()
    assert "#PBS -N dds-pbs" in script
    assert "-m dask_dataservice.cli worker --supervise tls://" in script
    assert f"DASK_DATASERVICE__PS__WORK_DIR={ns['SHARED'] / 'ps'}" in script


def test_jobqueue_recipe_config_does_not_leak():
    from dask_dataservice import config

    assert config.get("dispatcher.work-dir") is None
    assert config.get("dispatcher.fault-tolerant-mode") is False


@pytest.mark.process
def test_jobqueue_worker_command_runs_the_cli():
    # jobqueue runs `python -m <worker_command>`: the module runs the command line
    proc = subprocess.run([sys.executable, "-m", "dask_dataservice.cli", "worker", "--dry-run",
                           "tls://h:1", "--tls-cert", "c.pem"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert shlex.split(proc.stdout)[1:] == [
        "-m", "distributed.cli.dask_worker", "--preload", "dask_dataservice", "tls://h:1",
        "--tls-cert", "c.pem", "--worker-class", "dask_dataservice.service.worker.QuietStopWorker"]


# ---------------------------------------------------------------------------------------
# Kubernetes: operator and Helm chart
# ---------------------------------------------------------------------------------------


@pytest.fixture
def kubernetes_recipe():
    needs("dask_kubernetes", "kubernetes")
    namespace: dict = {"__name__": "recipe"}
    exec(compile(recipe("recipe-kubernetes"), str(PAGE), "exec"), namespace)
    return namespace


def test_kubernetes_operator_specs(kubernetes_recipe):
    ns = kubernetes_recipe
    tls = ["--tls-ca-file", "/certs/ca.crt", "--tls-cert", "/certs/tls.crt",
           "--tls-key", "/certs/tls.key"]
    spec, ps_group, claim = ns["spec"], ns["ps_group"], ns["journal_claim"]
    assert spec["kind"] == "DaskCluster" and spec["metadata"]["name"] == "dds"

    # the scheduler: the dispatcher (the CLI adds the preload), the journal on the claim
    pod = spec["spec"]["scheduler"]["spec"]
    scheduler = pod["containers"][0]
    args = scheduler["args"]
    assert args[:2] == ["dask-dataservice", "scheduler"]
    assert args[args.index("--work-dir") + 1] == "/journal"
    assert args[args.index("--protocol") + 1] == "tls" and all(a in args for a in tls)
    mounts = {m["name"]: m["mountPath"] for m in scheduler["volumeMounts"]}
    assert mounts == {"journal": "/journal", "certs": "/certs"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["journal"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert volumes["certs"]["secret"]["secretName"] == "dds-tls"
    assert claim["kind"] == "PersistentVolumeClaim"
    # readiness on the dispatcher, not on the HTTP server
    probe = scheduler["readinessProbe"]["exec"]["command"]
    assert probe[:3] == ["dask-dataservice", "ready", "tls://127.0.0.1:8786"]
    assert all(a in probe for a in tls)
    assert "httpGet" not in scheduler["readinessProbe"]
    # liveness without HTTP: a TLS cluster's HTTP server asks for a client certificate
    # (issue 22), which the operator's httpGet probe of /health does not have
    assert scheduler["livenessProbe"]["tcpSocket"] == {"port": 8786}
    assert not any("httpGet" in c.get(k, {}) for c in pod["containers"]
                   for k in ("readinessProbe", "livenessProbe"))

    # the workers and the parameter servers: `dask-dataservice worker` with TLS
    workers = spec["spec"]["worker"]
    assert workers["replicas"] == 4
    ps = ps_group["spec"]["worker"]
    assert ps_group["kind"] == "DaskWorkerGroup" and ps_group["spec"]["cluster"] == "dds"
    assert ps["replicas"] == 2
    for group, resources in ((workers, None), (ps, "ps=1")):
        container = group["spec"]["containers"][0]
        wargs = container["args"]
        assert wargs[:2] == ["dask-dataservice", "worker"]
        assert wargs[wargs.index("--name") + 1] == "$(DASK_WORKER_NAME)"
        assert all(a in wargs for a in tls)
        assert (wargs[wargs.index("--resources") + 1] if "--resources" in wargs else None) == resources
        # the operator writes a tcp:// address unless one is there: the recipe's is tls://
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["DASK_SCHEDULER_ADDRESS"] == "tls://dds-scheduler:8786"
        assert container["volumeMounts"] == [ns["CERTS_MOUNT"]]
        assert group["spec"]["volumes"] == [ns["CERTS"]]
    # the operator's own code turns a worker spec into a Deployment: our address and
    # arguments survive it
    from dask_kubernetes.operator.controller.controller import build_worker_deployment_spec

    deployment = build_worker_deployment_spec(
        worker_group_name="dds-ps", namespace="ml", cluster_name="dds", uuid="0",
        pod_spec=ps["spec"], annotations={}, labels={})
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["DASK_SCHEDULER_ADDRESS"] == "tls://dds-scheduler:8786"
    assert env["DASK_WORKER_NAME"] == "dds-ps-worker-0"
    assert container["args"] == ps["spec"]["containers"][0]["args"]
    # `kubectl apply -f` input, as the page says
    docs = list(yaml.safe_load_all(yaml.safe_dump_all([claim, spec, ps_group])))
    assert [d["kind"] for d in docs] == ["PersistentVolumeClaim", "DaskCluster", "DaskWorkerGroup"]


def test_kubernetes_worker_args_are_accepted_by_the_cli():
    # what the operator's worker container runs: our worker command with Dask's options
    from click.testing import CliRunner

    from dask_dataservice import cli

    argv = ["worker", "--dry-run", "--name", "w-1", "--dashboard", "--dashboard-address", "8788",
            "--tls-ca-file", "/certs/ca.crt", "--resources", "ps=1"]
    result = CliRunner(env={"DASK_SCHEDULER_ADDRESS": "tls://dds-scheduler:8786"}).invoke(
        cli.dataservice, argv)
    assert result.exit_code == 0, result.output
    assert shlex.split(result.stdout) == cli.dask_command(
        "worker", [*argv[2:], "--worker-class", cli.QUIET_STOP_WORKER])


def test_helm_values_preload_scheduler_and_workers():
    (values_text,) = fenced("yaml")
    values = yaml.safe_load(values_text)
    assert values["scheduler"]["extraArgs"] == ["--preload", "dask_dataservice"]
    assert values["worker"]["extraArgs"] == ["--preload", "dask_dataservice"]


# ---------------------------------------------------------------------------------------
# Gateway / managed clusters: install from the client; the preload from the environment
# ---------------------------------------------------------------------------------------


def _plain_dask(kind: str) -> list[str]:
    return [sys.executable, "-m", f"distributed.cli.dask_{kind}", "--host", "127.0.0.1",
            "--no-dashboard"]



@pytest.fixture
def servers():
    """Processes started by a test, stopped at its end (test_cli's helper)."""
    with Servers() as s:
        yield s

@pytest.mark.process
@pytest.mark.slow
def test_gateway_recipe_install_from_the_client(servers, tmp_path):
    """A scheduler and a worker started by 'someone else' (no preload): the page's recipe."""
    from distributed import Client

    scheduler_file = tmp_path / "scheduler.json"
    scheduler = servers.start(*_plain_dask("scheduler"), "--port", "0", "--scheduler-file",
                              str(scheduler_file))
    first = servers.start(*_plain_dask("worker"), "--scheduler-file", str(scheduler_file),
                          "--nthreads", "1")
    with Client(scheduler_file=str(scheduler_file), timeout="30s",
                set_as_default=False) as client:
        client.wait_for_workers(1, timeout=30)
        assert client.run_on_scheduler(
            lambda dask_scheduler: "dataservice-dispatcher" in dask_scheduler.plugins) is False
        namespace: dict = {"__name__": "recipe", "client": client}
        exec(compile(recipe("recipe-gateway"), str(PAGE), "exec"), namespace)
        assert sorted(namespace["ds"]) == list(range(1000))
        # a worker that joins later gets the data worker from the dispatcher
        late = servers.start(*_plain_dask("worker"), "--scheduler-file", str(scheduler_file),
                             "--nthreads", "1", "--name", "late")
        client.wait_for_workers(2, timeout=30)
        from dask_dataservice.demo._cluster import wait_for_data_workers

        assert wait_for_data_workers(client, 2) == 2
    for proc in (late, first, scheduler):
        servers.stop(proc)  # exit code 0, no traceback


@pytest.mark.process
@pytest.mark.slow
def test_preload_from_the_environment_only(servers, tmp_path):
    """``DASK_DISTRIBUTED__SCHEDULER__PRELOAD`` (the route for launchers that take only
    environment variables) gives the dispatcher, with its config from the environment too."""
    from distributed import Client

    scheduler_file = tmp_path / "scheduler.json"
    env = {"DASK_DISTRIBUTED__SCHEDULER__PRELOAD": '["dask_dataservice"]',
           "DASK_DATASERVICE__DISPATCHER__FAULT_TOLERANT_MODE": "True",
           "DASK_DATASERVICE__DISPATCHER__WORK_DIR": str(tmp_path / "journal")}
    scheduler = servers.start(*_plain_dask("scheduler"), "--port", "0", "--scheduler-file",
                              str(scheduler_file), env=env)
    with Client(scheduler_file=str(scheduler_file), timeout="30s",
                set_as_default=False) as client:
        assert client.sync(client.scheduler.dataservice_state)["status"] == "OK"
        assert client.run_on_scheduler(lambda dask_scheduler: (
            dask_scheduler.plugins["dataservice-dispatcher"].work_dir)) == str(tmp_path / "journal")
    servers.stop(scheduler)
