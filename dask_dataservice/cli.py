"""The ``dask-dataservice`` command line, also ``dask dataservice`` (a ``dask_cli`` entry point).

Subcommands:

``demo``
    A synthetic click-through input pipeline, streamed through the data service of an
    embedded cluster (or of an existing one with ``--scheduler``), or run in this process with
    ``--local``; on a cluster with parameter servers, a model is trained on it. The demo
    itself is :mod:`dask_dataservice.demo`; this module only turns options into a
    :class:`~dask_dataservice.demo.DemoOptions`.
``scheduler`` / ``worker``
    ``dask scheduler`` / ``dask worker`` with ``--preload dask_dataservice``: the way to run
    the data service from a shell. Every other option is passed on to Dask. ``worker
    --supervise`` restarts the worker whenever its scheduler went away
    (:func:`dask_dataservice.service.worker.supervise.supervise`). ``scheduler`` and ``worker`` warn
    on stderr when the server would listen beyond this machine without TLS
    (:func:`insecure_listen_warning`; docs/security.md).
``ready``
    Exit 0 when the dispatcher answers: a readiness probe for deployments (docs/deploy.md).
``version``
    The installed version (``--verbose``: and those of the main dependencies).

The command line is a ``click`` group, :data:`dataservice`. It is registered twice in
``pyproject.toml``: as the ``dask-dataservice`` console script (:func:`main`) and, under the
``dask_cli`` entry-point group, as the ``dataservice`` subcommand of Dask's own ``dask``
command, as Dask's tools register theirs. A new subcommand is one ``@dataservice.command()``
function. Heavy imports (numpy, distributed, the demo) happen inside the subcommands, so
``--help`` and ``--version`` stay fast.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import click

__all__ = ["dataservice", "dask_command", "insecure_listen_warning", "main", "package_version"]

PROG = "dask-dataservice"
DIST_NAME = "dask-dataservice"
CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
#: Options of ``scheduler`` and ``worker`` they do not know go to Dask, in order.
_PASSTHROUGH = {**CONTEXT_SETTINGS, "ignore_unknown_options": True, "allow_extra_args": True}


def package_version() -> str:
    """The installed version of the ``dask-dataservice`` distribution."""
    from importlib import metadata

    try:
        return metadata.version(DIST_NAME)
    except metadata.PackageNotFoundError:  # running from a source tree that is not installed
        import dask_dataservice

        return getattr(dask_dataservice, "__version__", "unknown")


@click.group(name="dataservice", context_settings=CONTEXT_SETTINGS)
@click.version_option(package_name=DIST_NAME, prog_name=DIST_NAME, message="%(prog)s %(version)s")
def dataservice() -> None:
    """tf.data service and parameter-server training on Dask."""


def main(argv: Sequence[str] | None = None) -> None:
    """The ``dask-dataservice`` console script: run the command line with ``argv`` (default:
    ``sys.argv[1:]``) and exit with its code."""
    dataservice.main(args=None if argv is None else list(argv), prog_name=PROG)


# demo
######


def _client_tls_config(scheduler: str, ca_file: str | None, cert: str | None,
                       key: str | None) -> dict[str, Any]:
    """Dask configuration for a client of ``scheduler`` from the ``--tls-*`` options (and
    ``"scheduler"``: the address, or None); a usage error when a ``tls://`` scheduler has no
    certificates here or in Dask's configuration (Dask would fail with a TypeError)."""
    import dask.config

    given = {"distributed.comm.tls.ca-file": ca_file, "distributed.comm.tls.client.cert": cert,
             "distributed.comm.tls.client.key": key}
    given = {k: v for k, v in given.items() if v}
    if given and not scheduler:
        raise click.UsageError("--tls-ca-file, --tls-cert and --tls-key are for --scheduler "
                               "tls://... (the embedded cluster needs none)")
    if scheduler.lower().startswith("tls://"):
        missing = [option for option, k in [("--tls-ca-file", "distributed.comm.tls.ca-file"),
                                            ("--tls-cert", "distributed.comm.tls.client.cert"),
                                            ("--tls-key", "distributed.comm.tls.client.key")]
                   if k not in given and not dask.config.get(k, None)]
        if missing:
            raise click.UsageError(
                f"the scheduler at {scheduler} speaks TLS: give this client certificates with "
                f"{', '.join(missing)} (or set Dask's distributed.comm.tls.ca-file, "
                "distributed.comm.tls.client.cert and .key)")
    return {**given, "scheduler": scheduler or None}


def _client_tls_options[C: Callable[..., Any]](command: C) -> C:
    """The ``--tls-ca-file``/``--tls-cert``/``--tls-key`` options of a command that connects
    to a ``tls://`` scheduler as a client (see :func:`_client_tls_config`)."""
    for option, what in reversed([("--tls-ca-file", "CA certificate(s) file"),
                                  ("--tls-cert", "this client's certificate file"),
                                  ("--tls-key", "this client's private key file")]):
        command = click.option(option, type=click.Path(exists=True, dir_okay=False),
                               default=None, help=f"for a tls:// scheduler: {what} (PEM)")(command)
    return command


if TYPE_CHECKING:  # generic in click >= 8.2 only: no subscript at run time
    _IntParamType = click.ParamType[int, Any]
else:
    _IntParamType = click.ParamType


class _PositiveInt(_IntParamType):
    name = "integer"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> int:
        if isinstance(value, int):
            number = value
        else:
            try:
                number = int(str(value).replace("_", ""))
            except ValueError:
                self.fail(f"expected an integer, got {value!r}", param, ctx)
        if number <= 0:
            self.fail(f"expected a positive integer, got {number}", param, ctx)
        return number


POSITIVE = _PositiveInt()


@dataservice.command(context_settings=CONTEXT_SETTINGS,
                     short_help="stream synthetic click-through data through the data service")
@click.option("--elements", type=POSITIVE, default=200_000, show_default=True, metavar="N",
              help="number of synthetic examples (rows) to generate")
@click.option("--batch-size", type=POSITIVE, default=256, show_default=True, metavar="B",
              help="examples per batch")
@click.option("--shuffle-buffer", type=POSITIVE, default=10_000, show_default=True, metavar="S",
              help="shuffle buffer size, in examples")
@click.option("--seed", type=int, default=0, show_default=True, help="random seed")
@click.option("--quiet", "-q", is_flag=True, help="no progress bar, no status lines")
@click.option("--verbose", "-v", is_flag=True,
              help="show Dask's and the data service's log messages, and the dispatcher's state")
@click.option("--local", is_flag=True,
              help="run the pipeline in this process, without Dask or the data service")
@click.option("--mode", type=click.Choice(["dynamic", "off"], case_sensitive=False), default=None,
              help="sharding policy: 'dynamic' hands each worker splits of the source, so every "
              "example is produced once; 'off' has every worker produce the whole dataset "
              "[default: dynamic]")
@click.option("--workers", type=POSITIVE, default=None, metavar="N",
              help="data workers of the embedded cluster, one thread each [default: 2]")
@click.option("--processes/--no-processes", default=True, show_default=True,
              help="run the embedded cluster's workers as processes, or as threads of this "
              "process (starts faster, but shares one GIL)")
@click.option("--scheduler", metavar="ADDRESS", default=None,
              help="use the Dask cluster at ADDRESS (e.g. tcp://127.0.0.1:8786) instead of "
              "starting one")
@click.option("--train/--no-train", default=None,
              help="train an embedding + logistic model on the stream with parameter servers "
              "and ClusterCoordinator.schedule/join [default: on for the embedded cluster; with "
              "--scheduler, on when the cluster has workers with the 'ps' resource and others]")
@click.option("--ps", type=POSITIVE, default=2, show_default=True, metavar="N",
              help="parameter servers of the embedded cluster when training")
@click.option("--checkpoint", metavar="DIR", default=None,
              help="write the trained model's checkpoint (a zarr group) to DIR")
@_client_tls_options
def demo(**options: Any) -> None:
    """Stream a synthetic click-through input pipeline through the data service (and train
    a model on it with parameter servers)."""
    import dask.config

    from dask_dataservice.demo import DemoError, DemoOptions, DemoUsageError, run_demo

    if options["mode"] is not None:
        options["mode"] = options["mode"].lower()
    tls = _client_tls_config(options.pop("scheduler", None) or "", options.pop("tls_ca_file"),
                             options.pop("tls_cert"), options.pop("tls_key"))
    options["scheduler"] = tls.pop("scheduler")
    try:
        with dask.config.set(tls):
            rc = run_demo(DemoOptions(**options))
    except DemoUsageError as e:
        raise click.UsageError(str(e)) from None
    except DemoError as e:
        error = click.ClickException(str(e))
        error.exit_code = e.exit_code  # type: ignore[misc]  # click declares a ClassVar
        raise error from None
    except KeyboardInterrupt:
        click.echo(f"{PROG}: interrupted", err=True)
        sys.exit(130)
    sys.exit(rc)


# scheduler, worker
###################

#: The module each Dask command runs as (``python -m ...``), so no ``dask`` on PATH is needed.
_DASK_MODULES = {
    "scheduler": "distributed.cli.dask_scheduler",
    "worker": "distributed.cli.dask_worker",
}
PRELOAD = "dask_dataservice"
#: The worker class of a supervised worker (``--supervise``): it rides out a scheduler restart.
RECONNECTING_WORKER = "dask_dataservice.service.worker.ReconnectingWorker"
#: The worker class otherwise: Dask's, whose clean stop logs no heartbeat error.
QUIET_STOP_WORKER = "dask_dataservice.service.worker.QuietStopWorker"


def dask_command(kind: str, dask_args: Sequence[str] = ()) -> list[str]:
    """The command line that starts a Dask ``kind`` (``"scheduler"`` or ``"worker"``) with
    the data service preloaded: ``python -m distributed.cli.dask_<kind> --preload
    dask_dataservice *dask_args`` (the preload is not repeated if ``dask_args`` has it).
    """
    module = _DASK_MODULES[kind]
    args = list(dask_args)
    preloads = {v for k, v in zip(args, args[1:], strict=False) if k == "--preload"}
    preloads |= {a.split("=", 1)[1] for a in args if a.startswith("--preload=")}
    preload = [] if PRELOAD in preloads else ["--preload", PRELOAD]
    return [sys.executable, "-m", module, *preload, *args]


def _run(cmd: list[str], env: dict[str, str], *, dry_run: bool, supervise: bool = False) -> None:
    """Run ``cmd`` in place of this process (or under the supervisor); never returns."""
    if dry_run:
        extra = {k: v for k, v in env.items() if os.environ.get(k) != v}
        click.echo(" ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(extra.items()))
                   + (" " if extra else "") + shlex.join(cmd))
        sys.exit(0)
    if supervise:
        from dask_dataservice.service.worker.supervise import supervise as run_supervised

        sys.exit(run_supervised(cmd, env))
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name == "nt":  # pragma: no cover - no exec on Windows: run it as a child
        sys.exit(subprocess.call(cmd, env=env))
    os.execve(cmd[0], cmd, env)  # the new program takes over this process: same pid, signals


def _option_values(args: Sequence[str], name: str) -> list[str]:
    """The values of ``name`` (``--name VALUE`` or ``--name=VALUE``) in a Dask command line."""
    values = [v for k, v in zip(args, args[1:], strict=False) if k == name]
    return values + [a.split("=", 1)[1] for a in args if a.startswith(name + "=")]


def _is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an IP address) is this machine's loopback only."""
    import ipaddress
    import socket

    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:  # a host name: loopback if every address it has is
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def insecure_listen_warning(dask_args: Sequence[str], role: str = "scheduler") -> str | None:
    """The warning for a ``dask scheduler`` (``role="scheduler"``) or ``dask worker``
    (``"worker"``) command line that listens beyond this machine without TLS (``None`` when
    it listens on loopback only, or with TLS).

    TLS counts when the command asks for it (``--protocol tls``, a ``tls://`` address among
    the arguments, e.g. the scheduler's for a worker, any ``--tls-*`` option) or Dask's
    configuration does (``distributed.comm.default-scheme``, ``require-encryption`` or a
    certificate for the role). The listening address is ``--host`` or ``--listen-address``
    (default: every interface), or ``--interface`` (loopback for ``lo``).
    """
    import dask.config

    args = list(dask_args)
    hosts = _option_values(args, "--host") + _option_values(args, "--listen-address")
    interfaces = _option_values(args, "--interface")
    schemes = {p.split("://", 1)[0].lower() for p in _option_values(args, "--protocol") if p}
    schemes |= {a.split("://", 1)[0].lower() for a in args if "://" in a}
    if any(a.startswith("--tls-") for a in args) or "tls" in schemes:
        return None
    if schemes & {"inproc", "ucx"}:
        return None  # not a TCP listener (UCX has its own transport security)
    config = dask.config.get("distributed.comm", {})
    if (str(config.get("default-scheme", "tcp")).lower() == "tls"
            or config.get("require-encryption")
            or (config.get("tls", {}).get(role) or {}).get("cert")):
        return None
    host = hosts[-1].split("://", 1)[-1] if hosts else ""
    if host.startswith("["):  # [IPv6]:port
        host = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:  # host:port
        host = host.rsplit(":", 1)[0]
    if host and _is_loopback(host):
        return None
    if not host and interfaces and interfaces[-1] in ("lo", "lo0"):
        return None
    where = f"host {host}" if host else (f"interface {interfaces[-1]}" if interfaces
                                          else "every network interface")
    return (f"{PROG}: warning: the {role} listens on {where} without TLS: anyone who can "
            "reach its port can run code on the cluster, read every registered pipeline and "
            "take other users' data (see the security page of the docs). Give it "
            "certificates (--tls-ca-file, --tls-cert, --tls-key), or --host 127.0.0.1 for a "
            "single machine.")


def http_on_listen_host(dask_args: Sequence[str], default_port: int) -> list[str]:
    """``dask_args`` with ``--dashboard-address HOST:PORT`` added when it names a ``--host`` (or
    ``--listen-address``) but no dashboard address: Dask's HTTP server (dashboard, /metrics,
    /dataservice/status.json; started with ``--no-dashboard`` too) then listens where the
    process does, not on every interface (issue 22)."""
    args = list(dask_args)
    if _option_values(args, "--dashboard-address"):
        return args
    hosts = _option_values(args, "--host") + _option_values(args, "--listen-address")
    if not hosts:
        return args
    host = hosts[-1].split("://", 1)[-1]
    if host.count(":") == 1:  # host:port
        host = host.rsplit(":", 1)[0]
    if not host or host.startswith("[") or ":" in host:  # IPv6: Dask's option takes none
        return args
    return [*args, "--dashboard-address", f"{host}:{default_port}"]


_DASK_ARGS = click.argument("dask_args", nargs=-1, type=click.UNPROCESSED)
_DRY_RUN = click.option("--dry-run", is_flag=True, help="print the command line instead of running it")


@dataservice.command(context_settings=_PASSTHROUGH, short_help="dask scheduler with the dispatcher", epilog=(
    "Every other argument is passed on to `dask scheduler` (see `python -m "
    "distributed.cli.dask_scheduler --help`), e.g. --host 127.0.0.1 --port 8786 "
    "--scheduler-file FILE."))
@_DRY_RUN
@click.option("--work-dir", default=None, type=click.Path(file_okay=False),
              help="make the dispatcher fault tolerant: journal its state in this directory (or "
              "fsspec URL: s3://bucket/dds) and "
              "recover from it on start (sets dataservice.dispatcher.fault-tolerant-mode and "
              "work-dir)")
@click.option("--worker-addresses", default=None,
              help="comma-separated fixed worker list (addresses or worker names) for the "
              "static sharding policies")
@_DASK_ARGS
def scheduler(dry_run: bool, work_dir: str | None, worker_addresses: str | None,
              dask_args: tuple[str, ...]) -> None:
    """Start a Dask scheduler with the data service's dispatcher (dask scheduler --preload
    dask_dataservice)."""
    env = dict(os.environ)
    if work_dir:
        env["DASK_DATASERVICE__DISPATCHER__FAULT_TOLERANT_MODE"] = "True"
        # a URL (s3://bucket/dds) as given; a local path made absolute
        env["DASK_DATASERVICE__DISPATCHER__WORK_DIR"] = (
            work_dir if "://" in work_dir else os.path.abspath(work_dir))
    if worker_addresses:
        names = [a.strip() for a in worker_addresses.split(",") if a.strip()]
        env["DASK_DATASERVICE__DISPATCHER__WORKER_ADDRESSES"] = json.dumps(names)
    warning = insecure_listen_warning(dask_args)
    if warning:
        click.echo(warning, err=True)
    _run(dask_command("scheduler", http_on_listen_host(dask_args, 8787)), env, dry_run=dry_run)


@dataservice.command(context_settings=_PASSTHROUGH, short_help="dask worker with the data worker", epilog=(
    "Every other argument is passed on to `dask worker` (see `python -m "
    "distributed.cli.dask_worker --help`), e.g. tcp://HOST:8786 --nthreads 4 --nworkers 2 "
    "--resources ps=1, or --scheduler-file FILE; with --supervise too."))
@_DRY_RUN
@click.option("--supervise", is_flag=True,
              help="run `dask worker` under a supervisor: when its scheduler goes away (the "
              "worker then exits), start it again; the new worker registers once the scheduler "
              "is back (for a fault-tolerant dispatcher restarted in place)")
@_DASK_ARGS
def worker(dry_run: bool, supervise: bool, dask_args: tuple[str, ...]) -> None:
    """Start a Dask worker with the data service's worker plugin (dask worker SCHEDULER
    --preload dask_dataservice)."""
    warning = insecure_listen_warning(dask_args, role="worker")
    if warning:
        click.echo(warning, err=True)
    args = http_on_listen_host(dask_args, 0)
    if not any(a == "--worker-class" or a.startswith("--worker-class=") for a in args):
        # supervised, it rides out a scheduler restart with its data tasks (the supervisor
        # restarts it only when it closed anyway); either way a SIGTERM or Ctrl-C stops it
        # without Dask's heartbeat traceback
        args += ["--worker-class", RECONNECTING_WORKER if supervise else QUIET_STOP_WORKER]
    _run(dask_command("worker", args), dict(os.environ), dry_run=dry_run, supervise=supervise)


# ready
#######


@dataservice.command(context_settings=CONTEXT_SETTINGS,
                     short_help="exit 0 when the dispatcher answers (a readiness probe)")
@click.argument("address", required=False, envvar="DASK_SCHEDULER_ADDRESS")
@click.option("--timeout", default="5s", show_default=True,
              help="give up connecting and waiting for the reply after this long")
@click.option("--min-workers", type=int, default=0, show_default=True, metavar="N",
              help="ready only once N data workers are registered with the dispatcher")
@_client_tls_options
def ready(address: str | None, timeout: str, min_workers: int, tls_ca_file: str | None,
          tls_cert: str | None, tls_key: str | None) -> None:
    """Exit 0 when the data service's dispatcher at ADDRESS (default: $DASK_SCHEDULER_ADDRESS)
    answers, having replayed its journal (and has --min-workers data workers); exit 1 with a
    one-line reason otherwise. Meant for readiness probes (Kubernetes, scripts)."""
    import dask.config
    from dask.utils import parse_timedelta

    if not address:
        raise click.UsageError("give the scheduler's ADDRESS (or set DASK_SCHEDULER_ADDRESS)")
    tls = _client_tls_config(address, tls_ca_file, tls_cert, tls_key)
    tls.pop("scheduler")
    with dask.config.set(tls):
        import asyncio

        reason = asyncio.run(_not_ready(address, parse_timedelta(timeout), min_workers))
    if reason:
        click.echo(f"{PROG} ready: {reason}", err=True)
        sys.exit(1)
    click.echo(f"{PROG} ready: the dispatcher at {address} answers")


async def _not_ready(address: str, timeout: float, min_workers: int) -> str | None:
    """Why the dispatcher at ``address`` is not ready (None: it is)."""
    import asyncio

    from distributed.core import rpc
    from distributed.security import Security

    from dask_dataservice._rpc import normalize_address

    address = normalize_address(address)
    server = rpc(address, timeout=timeout,
                 connection_args=Security().get_connection_args("client"))
    try:
        reply = await asyncio.wait_for(server.dataservice_state(), timeout)
    except (OSError, TimeoutError) as e:
        return f"cannot reach the scheduler at {address}: {e or type(e).__name__}"
    finally:
        await server.close_rpc()
    if not isinstance(reply, dict) or reply.get("status") != "OK":
        return (f"the scheduler at {address} has no data-service dispatcher (started "
                "without --preload dask_dataservice?)")
    if len(reply.get("workers", ())) < min_workers:
        return (f"{len(reply['workers'])} data workers registered with the dispatcher at "
                f"{address}, waiting for {min_workers}")
    return None


# version
#########


@dataservice.command(context_settings=CONTEXT_SETTINGS)
@click.option("--verbose", "-v", is_flag=True,
              help="also print Python and the versions of the main dependencies")
def version(verbose: bool) -> None:
    """Print the installed version."""
    click.echo(f"{DIST_NAME} {package_version()}")
    if verbose:
        import platform
        from importlib import metadata

        click.echo(f"python {platform.python_version()}")
        for dist in ("dask", "distributed", "numpy", "zarr", "cloudpickle", "msgpack", "click",
                     "tqdm"):
            try:
                click.echo(f"{dist} {metadata.version(dist)}")
            except metadata.PackageNotFoundError:
                click.echo(f"{dist} (not installed)")


if __name__ == "__main__":  # pragma: no cover
    main()
