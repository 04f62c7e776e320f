"""deploy/Dockerfile: the image the Kubernetes recipes of docs/deploy.md run.

One test builds the image with a container builder (buildah, which .ci/run installs;
``--isolation chroot``, which needs no user namespaces or overlay mounts) and runs the command
line and a distributed read on a LocalCluster of worker processes in it. On a machine without
a builder another test executes the Dockerfile's own steps (``ARG``, ``ENV``, ``COPY``,
``RUN``) in a fresh venv under a temporary folder instead, the Dockerfile's paths being ``ENV``
values the test points there, so a broken step fails there too (with a builder it skips: the
image test runs the same steps for real, and CI's time goes to that one).

The base image: ``DDS_IMAGE_BASE`` if set (.ci/run sets it), else ``python:3.12-slim`` if the
builder has it or can pull it, else ``localhost/dds-test-base:trixie`` (a Debian rootfs made
with debootstrap, which .ci/run imports when no registry of images is reachable).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml
from _helpers import unavailable
from _venv import SMOKE, base_python, clean_env, run, smoke

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
#: the host's CA bundle: pip in the build trusts what pip on the host trusts (a proxy's CA)
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
FALLBACK_BASE = "localhost/dds-test-base:trixie"


def instructions(text: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of a Dockerfile: comments dropped, continuations joined."""
    out, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, args = full.partition(" ")
        out.append((word.upper(), args.strip()))
    return out


def expand(value: str, env: dict[str, str]) -> str:
    """``$VAR`` and ``${VAR}`` as the Dockerfile's ENV and COPY expand them."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), ""), value)


@pytest.mark.pure
def test_dockerfile_paths_are_env_values():
    """Every path a COPY or RUN uses is an ENV value (so the fresh-venv test can move it), and
    the build context holds what the COPY lines take."""
    steps = instructions(DOCKERFILE.read_text())
    words = [word for word, _ in steps]
    assert words[:2] == ["ARG", "FROM"] and "RUN" in words and "COPY" in words
    for word, args in steps:
        if word in ("COPY", "RUN"):
            assert not re.search(r"(?<![\w$}\-./])/\w", args), f"absolute path in {word} {args}"
        if word == "COPY":
            for source in shlex.split(args)[:-1]:
                assert (ROOT / source).exists(), source
                assert f"!{source}" in (ROOT / ".dockerignore").read_text().split(), source


@pytest.mark.slow
def test_dockerfile_steps_run_in_a_fresh_venv(tmp_path):
    """ENV, COPY and RUN of deploy/Dockerfile in order, ``/`` moved to ``tmp_path``: the steps
    install the package from the source tree and the command line runs. pip's cache is used
    (the image's ``--no-cache-dir`` keeps its layer small; the install is the same)."""
    if shutil.which("buildah") and not os.environ.get("DDS_DOCKERFILE_STEPS"):
        pytest.skip("buildah is installed: test_image_builds_and_runs runs these steps in the "
                    "image (DDS_DOCKERFILE_STEPS=1 runs them here too)")
    steps = instructions(DOCKERFILE.read_text())
    moved = {"DDS_VENV": str(tmp_path / "venv"), "DDS_SRC": str(tmp_path / "src")}
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "python3").symlink_to(base_python())  # the base image's python3
    env = clean_env(PATH=f"{tools}:{os.environ['PATH']}")
    env.pop("VIRTUAL_ENV", None)
    ran = []
    for word, args in steps:
        if word == "ARG" and "=" in args:
            name, _, default = args.partition("=")
            env.setdefault(name, default)
        elif word == "ENV":
            for pair in shlex.split(args):
                name, _, value = pair.partition("=")
                env[name] = moved.get(name) or expand(value, env)
        elif word == "COPY":
            *sources, dest = shlex.split(args)
            dest = expand(dest, env)
            for source in sources:
                src = ROOT / source
                target = Path(dest) / src.name if dest.endswith("/") else Path(dest)
                target.parent.mkdir(parents=True, exist_ok=True)
                if src.is_dir():
                    shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy2(src, target)
        elif word == "RUN":
            command = args.replace("--no-cache-dir", "")
            run("/bin/sh", "-c", command, cwd=tmp_path, env=env, timeout=600)
            ran.append(args)
    assert any("pip install" in r for r in ran) and any("venv" in r for r in ran), ran
    assert not Path(moved["DDS_SRC"]).exists()  # the source tree is removed after the install
    venv_bin = Path(moved["DDS_VENV"]) / "bin"
    assert "Usage: dask-dataservice" in run(venv_bin / "dask-dataservice", "--help", cwd=tmp_path)
    assert run(venv_bin / "python", "-c", "import lz4; print('lz4')").strip() == "lz4"  # EXTRAS
    assert smoke(venv_bin, tmp_path).startswith(f"smoke ok 0.1.0 {moved['DDS_VENV']}")


def _builder() -> str:
    path = shutil.which("buildah")
    if path is None:
        unavailable("no container builder: buildah is not installed (.ci/run installs it: "
                    "apt-get install -y buildah)")
    return path


def _ok(*cmd: str, timeout: float = 120) -> bool:
    return subprocess.run(cmd, capture_output=True, timeout=timeout).returncode == 0


def _base(buildah: str) -> str:
    wanted = os.environ.get("DDS_IMAGE_BASE")
    if wanted:
        return wanted
    for image in ("python:3.12-slim", "docker.io/library/python:3.12-slim"):
        if _ok(buildah, "inspect", "--type", "image", image):
            return image
    if _ok(buildah, "pull", "-q", "docker.io/library/python:3.12-slim", timeout=300):
        return "docker.io/library/python:3.12-slim"
    if _ok(buildah, "inspect", "--type", "image", FALLBACK_BASE):
        return FALLBACK_BASE
    unavailable("no base image: python:3.12-slim cannot be pulled here and there is no "
                f"{FALLBACK_BASE} (.ci/run makes one with debootstrap); or set DDS_IMAGE_BASE")


@pytest.mark.slow
def test_image_builds_and_runs(tmp_path):
    """``buildah bud`` of deploy/Dockerfile, then in the image: ``dask-dataservice --help`` and
    a distributed read of 200 elements on a LocalCluster of two worker processes."""
    buildah = _builder()
    base = _base(buildah)
    tag = f"localhost/dask-dataservice:test-{uuid.uuid4().hex[:8]}"
    cmd = [buildah, "bud", "--isolation", "chroot", "-f", str(DOCKERFILE), "-t", tag,
           "--build-arg", f"BASE={base}"]
    if HOST_CA.is_file():
        cmd += ["--build-arg", "PIP_CERT=/etc/pip-ca.crt", "-v", f"{HOST_CA}:/etc/pip-ca.crt:ro"]
    run(*cmd, str(ROOT), timeout=900)
    container = None
    try:
        container = run(buildah, "from", tag).strip()
        in_image = [buildah, "run", "--isolation", "chroot", container, "--"]
        assert "Usage: dask-dataservice" in run(*in_image, "dask-dataservice", "--help")
        (tmp_path / "smoke.py").write_text(SMOKE)
        run(buildah, "copy", container, str(tmp_path / "smoke.py"), "/tmp/smoke.py")
        out = run(*in_image, "python", "/tmp/smoke.py", timeout=300).strip()
        assert out.startswith("smoke ok 0.1.0 /opt/dask-dataservice/"), out
    finally:
        if container:
            subprocess.run([buildah, "rm", container], capture_output=True, timeout=120)
        subprocess.run([buildah, "rmi", "-f", tag], capture_output=True, timeout=120)


@pytest.mark.pure
def test_helm_values_file_is_the_pages_and_uses_the_image():
    """deploy/helm-values.yaml is the values block of docs/deploy.md, and its scheduler and
    workers run the image the operator recipe names (built from deploy/Dockerfile)."""
    page = (ROOT / "docs" / "deploy.md").read_text(encoding="utf-8")
    text = (ROOT / "deploy" / "helm-values.yaml").read_text(encoding="utf-8")
    (block,) = re.findall(r"^```yaml\n(.*?)^```$", page, re.M | re.S)
    assert block == text
    values = yaml.safe_load(text)
    (image,) = re.findall(r'^IMAGE = "([^"]+)"', page, re.M)
    for role in ("scheduler", "worker"):
        spec = values[role]["image"]
        assert f"{spec['repository']}:{spec['tag']}" == image
        assert values[role]["extraArgs"] == ["--preload", "dask_dataservice"]
    assert "deploy/Dockerfile" in page
