"""Hosts made of Linux network namespaces, for the multi-host test tier.

A :class:`Network` is one private layer-2 segment: a bridge in a namespace of its own
(``dds<pid>n<k>-br``) and, per host, a namespace (``dds<pid>n<k>-<host>``) holding the other
end of a veth pair (``eth0``) with an address in a private /24 (``10.213.<x>.<i>``), and
``lo`` up. Every link is created inside the bridge's namespace and its peer moved straight into
the host's: nothing is added to, or changed in, the network of the namespace the tests run
in, and several runs at once (another pid, another segment) never meet.

What a test does to the network, all with ``ip`` and ``tc`` inside those namespaces:

- :meth:`Network.link` takes a host's link down or brings it up (a partition: packets are
  lost, no connection is reset);
- :meth:`Network.rate` shapes a host's link both ways with ``tbf`` (e.g. ``"1gbit"``);
- :meth:`Network.block` drops every TCP packet to one port of a host (an ``htb`` class whose
  queue is a ``pfifo`` of length 0, chosen by a ``u32`` filter: this kernel has no ``tc``
  drop action, ``netem`` nor netfilter tools), as a firewall that drops does: connects time
  out, nothing is refused.

Processes are started with ``ip netns exec``, each in a session of its own, their output in
files (a full pipe would block them). :meth:`Network.close` kills every process group it
started and every process still in one of its namespaces, then deletes the namespaces (which
deletes their links): nothing is left behind, whatever the test did.

:func:`unavailable` says why namespaces cannot be used here (not root, no ``ip``, a failing
``ip netns add``), or None.
"""

from __future__ import annotations

import itertools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

#: The tree under test: child processes import the package from it.
ROOT = str(Path(__file__).resolve().parents[2])
#: The agent script a client host runs (tests/multihost/_agent.py).
AGENT = str(Path(__file__).resolve().parent / "_agent.py")

_COUNTER = itertools.count()


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    if check and done.returncode:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({done.returncode}): "
                           f"{done.stderr.strip()}")
    return done


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run(["ip", *args], check)


def _tc(ns: str, *args: str) -> None:
    _run(["tc", "-n", ns, *args])


def unavailable() -> str | None:
    """Why this machine cannot run the tier (None: it can)."""
    if sys.platform != "linux":
        return f"network namespaces are Linux only (this is {sys.platform})"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (run the tests as root, or in CI)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install -y iproute2)"
    probe = f"dds{os.getpid()}probe"
    try:
        made = _ip("netns", "add", probe, check=False)
        if made.returncode:
            return f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
        veth = _ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1",
                   check=False)
        if veth.returncode:
            return f"cannot create a veth pair in a namespace: {veth.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    """One host: a namespace, its address, and its link's end on the bridge."""

    name: str
    ns: str
    addr: str
    #: The link's end in the bridge's namespace (traffic *to* the host leaves through it).
    port: str
    blocked: dict[int, int] = field(default_factory=dict)  # port -> filter priority
    #: The dropping ``htb`` class exists on :attr:`port` (not with :meth:`Network.rate`).
    drops: bool = False


class Proc:
    """A process on a host: its ``Popen``, its stderr in a file, JSON lines on stdout
    (:meth:`expect`) and stdin (:meth:`send`) for the agent."""

    def __init__(self, popen: subprocess.Popen[str], stderr: IO[str], name: str) -> None:
        self.popen = popen
        self._stderr = stderr
        self.name = name
        self._buffer = ""

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stderr(self) -> str:
        self._stderr.flush()
        self._stderr.seek(0)
        return self._stderr.read()

    def send(self, message: dict[str, Any]) -> None:
        assert self.popen.stdin is not None, f"{self.name} has no stdin"
        self.popen.stdin.write(json.dumps(message) + "\n")
        self.popen.stdin.flush()

    def expect(self, timeout: float) -> dict[str, Any]:
        """The next JSON line this process prints, within ``timeout`` seconds (an
        ``AssertionError`` with its stderr if it exits or stays silent)."""
        assert self.popen.stdout is not None, f"{self.name} has no stdout pipe"
        deadline = time.monotonic() + timeout
        fd = self.popen.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while "\n" not in self._buffer:
                left = deadline - time.monotonic()
                assert left > 0, (f"{self.name} printed no result within {timeout:g} s; "
                                  f"stderr:\n{self.stderr()[-6000:]}")
                if not sel.select(left):
                    continue
                chunk = os.read(fd, 1 << 20).decode()
                assert chunk, (f"{self.name} exited (code {self.popen.poll()}) before its "
                               f"result; stderr:\n{self.stderr()[-6000:]}")
                self._buffer += chunk
        line, self._buffer = self._buffer.split("\n", 1)
        reply: dict[str, Any] = json.loads(line)
        reply.pop("seconds", None)  # how long the agent took: for a reader of its stderr log
        if "error" in reply:
            raise AssertionError(f"{self.name}: {reply['error']}\nstderr:\n"
                                 f"{self.stderr()[-4000:]}")
        return reply

    def call(self, op: str, timeout: float = 60, **kwargs: Any) -> dict[str, Any]:
        """Send the agent a command and return its reply."""
        self.send({"op": op, **kwargs})
        return self.expect(timeout)


class Network:
    """A bridge and hosts on it; every process started here is killed by :meth:`close`."""

    def __init__(self) -> None:
        k = next(_COUNTER)
        self.prefix = f"dds{os.getpid()}n{k}"
        #: A /24 per network: the same pid on another run, or another segment, another subnet.
        self.subnet = f"10.213.{(os.getpid() * 7 + k) % 250 + 1}"
        self.bridge_ns = f"{self.prefix}-br"
        self.hosts: dict[str, Host] = {}
        self.procs: list[Proc] = []
        self._namespaces: list[str] = []
        self._tmp = tempfile.TemporaryDirectory(prefix=f"{self.prefix}-")
        self.tmp = Path(self._tmp.name)
        try:
            self._add_ns(self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        except BaseException:
            self.close()  # nothing half-made stays behind
            raise

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._namespaces.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    # -- hosts --------------------------------------------------------------------------------

    def host(self, name: str) -> Host:
        """A new host ``name`` on the bridge, with the next address of the subnet."""
        assert name not in self.hosts, name
        index = len(self.hosts) + 1
        ns, port = f"{self.prefix}-{name}", f"v{index}"
        self._add_ns(ns)
        _ip("-n", self.bridge_ns, "link", "add", port, "type", "veth", "peer", "name", "eth0",
            "netns", ns)
        _ip("-n", self.bridge_ns, "link", "set", port, "master", "br0", "up")
        addr = f"{self.subnet}.{index}"
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        host = self.hosts[name] = Host(name, ns, addr, port)
        return host

    def link(self, host: Host, up: bool) -> None:
        """Take ``host``'s link down (packets to and from it are lost) or bring it up."""
        _ip("-n", self.bridge_ns, "link", "set", host.port, "up" if up else "down")

    def rate(self, host: Host, rate: str) -> None:
        """Shape ``host``'s link to ``rate`` (``tc`` ``tbf``) in both directions."""
        for ns, dev in ((host.ns, "eth0"), (self.bridge_ns, host.port)):
            _tc(ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                "burst", "256kb", "latency", "100ms")

    def _drop(self, host: Host, addr: tuple[str, str], port: tuple[str, int], key: int) -> None:
        """A ``u32`` filter sending the matching TCP packets *to* ``host`` to the class that
        drops them."""
        dev = host.port
        if not host.drops:
            host.drops = True
            _tc(self.bridge_ns, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb",
                "default", "1", "r2q", "1000")
            _tc(self.bridge_ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1",
                "htb", "rate", "10gbit")
            _tc(self.bridge_ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:2",
                "htb", "rate", "1mbit")
            _tc(self.bridge_ns, "qdisc", "add", "dev", dev, "parent", "1:2", "handle", "20:",
                "pfifo", "limit", "0")
        prio = host.blocked[key] = 10 + max(host.blocked.values(), default=0)
        _tc(self.bridge_ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip",
            "prio", str(prio), "u32", "match", "ip", *addr, "match", "ip", "protocol", "6",
            "0xff", "match", "ip", port[0], str(port[1]), "0xffff", "flowid", "1:2")

    def block_replies(self, host: Host, source: Host, port: int) -> None:
        """Drop every TCP packet that ``source`` sends ``host`` from its ``port`` (the
        replies of a server there: connections to it time out, requests still arrive)."""
        self._drop(host, ("src", f"{source.addr}/32"), ("sport", port), key=-port)

    def block(self, host: Host, port: int) -> None:
        """Drop every TCP packet sent to ``port`` of ``host`` (see the module docstring)."""
        self._drop(host, ("dst", f"{host.addr}/32"), ("dport", port), key=port)

    def unblock(self, host: Host, port: int) -> None:
        """Undo :meth:`block` (``port``) or :meth:`block_replies` (``-port``)."""
        prio = host.blocked.pop(port)
        _tc(self.bridge_ns, "filter", "del", "dev", host.port, "parent", "1:", "prio",
            str(prio))

    # -- processes ----------------------------------------------------------------------------

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("DASK_", "PYTEST_", "COV_"))}
        env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"]
                                    if env.get("PYTHONPATH") else "")
        env["PYTHONUNBUFFERED"] = "1"
        env["DASK_DISTRIBUTED__WORKER__DAEMON"] = "False"
        env.update(extra or {})
        return env

    def start(self, host: Host, *argv: str, name: str, env: dict[str, str] | None = None,
              pipes: bool = False) -> Proc:
        """Run ``argv`` on ``host`` (its own session; stderr to a file; stdin/stdout pipes
        for JSON lines with ``pipes``)."""
        err = open(self.tmp / f"{name}.stderr", "w+")  # noqa: SIM115 - closed by close()
        popen = subprocess.Popen(
            ["ip", "netns", "exec", host.ns, *argv], stderr=err, text=True,
            stdout=subprocess.PIPE if pipes else subprocess.DEVNULL,
            stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
            start_new_session=True, env=self.env(env), cwd=str(self.tmp))
        proc = Proc(popen, err, f"{name} on {host.name} ({host.addr})")
        self.procs.append(proc)
        return proc

    def python(self, host: Host, *args: str, name: str, env: dict[str, str] | None = None,
               pipes: bool = False) -> Proc:
        return self.start(host, sys.executable, *args, name=name, env=env, pipes=pipes)

    def scheduler(self, host: Host, *args: str, env: dict[str, str] | None = None,
                  port: int = 8786, tls: dict[str, str] | None = None) -> str:
        """``dask-dataservice scheduler`` on ``host``; its address."""
        scheme = "tls" if tls else "tcp"
        self.python(host, "-m", "dask_dataservice.cli", "scheduler", "--host", host.addr,
                    "--port", str(port), "--no-dashboard", *_tls_args(tls), *args,
                    name="scheduler", env=env)
        return f"{scheme}://{host.addr}:{port}"

    def worker(self, host: Host, scheduler: str, name: str, *args: str,
               env: dict[str, str] | None = None, port: int = 9000,
               tls: dict[str, str] | None = None) -> Proc:
        """``dask-dataservice worker`` on ``host`` (no nanny, one thread, port ``port``)."""
        return self.python(host, "-m", "dask_dataservice.cli", "worker", scheduler,
                           "--host", host.addr, "--worker-port", str(port), "--nthreads", "1",
                           "--no-nanny", "--no-dashboard", "--name", name, *_tls_args(tls),
                           *args, name=name, env=env)

    def agent(self, host: Host, scheduler: str, name: str, env: dict[str, str] | None = None,
              tls: dict[str, str] | None = None) -> Proc:
        """The client agent (tests/multihost/_agent.py) on ``host``, connected."""
        extra = dict(env or {})
        if tls:
            extra["DDS_AGENT_TLS"] = json.dumps(tls)
        proc = self.python(host, AGENT, scheduler, name=name, env=extra, pipes=True)
        proc.expect(90)  # {"ready": ...}: connected to the scheduler
        return proc

    # -- teardown -----------------------------------------------------------------------------

    def close(self) -> None:
        for proc in self.procs:
            if proc.popen.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for ns in self._namespaces:  # anything that escaped its process group
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for proc in self.procs:
            try:
                proc.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
            for pipe in (proc.popen.stdin, proc.popen.stdout):
                if pipe is not None:
                    pipe.close()
            proc._stderr.close()
        failed = []
        for ns in reversed(self._namespaces):
            done = _ip("netns", "del", ns, check=False)
            if done.returncode:
                failed.append(f"{ns}: {done.stderr.strip()}")
        self._namespaces.clear()
        self._tmp.cleanup()
        assert not failed, f"namespaces left behind: {failed}"


def _tls_args(tls: dict[str, str] | None) -> list[str]:
    if not tls:
        return []
    return ["--tls-ca-file", tls["ca"], "--tls-cert", tls["cert"], "--tls-key", tls["key"]]


def poll(predicate: Any, timeout: float, what: str) -> Any:
    """Wait for ``predicate()`` to return something true (returned), or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(0.1)
