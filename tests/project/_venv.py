"""Build the sdist and wheel, and install the wheel into a fresh venv, as a user would.

Used by tests/project/test_packaging.py and tests/project/test_deploy_image.py, and runnable
on its own (a replay of a newcomer's first steps, or a quick check of a built wheel)::

    python tests/project/_venv.py /tmp/dds-venv                     # build, install, smoke
    python tests/project/_venv.py /tmp/dds-venv --extras compression --no-cache
    python tests/project/_venv.py /tmp/dds-venv --wheel dist/dask_dataservice-0.1.0-py3-none-any.whl

It prints one JSON line: the venv, the wheel, and the seconds each step took. The venv is
made with the base interpreter of the running Python (``sys._base_executable``: not a venv's
python, whose packages would leak in), and every command runs without ``PYTHONPATH`` so the
installed package is imported, not a checkout. Dependencies come from pip's cache and the
configured registry (``no_cache=True``: ``--no-cache-dir``, as the README's measurements).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: the smoke test of an installed package: a distributed read on a LocalCluster of worker
#: processes (the script guards its cluster: spawn imports it again in every worker)
SMOKE = '''\
import dask_dataservice as dds
from distributed import Client, LocalCluster

if __name__ == "__main__":
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster, \\
            Client(cluster) as client:
        ds = dds.Dataset.range(200).batch(10).apply(dds.distribute("distributed_epoch", client))
        seen = sorted(int(x) for batch in ds for x in batch)
    assert seen == list(range(200)), seen
    print("smoke ok", dds.__version__, dds.__file__)
'''


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without ``PYTHONPATH`` (a checkout first on the path would shadow the
    installed package), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(extra)
    return env


def run(*cmd: object, cwd: Path | str | None = None, timeout: float = 300,
        env: dict[str, str] | None = None) -> str:
    """Run ``cmd`` without ``PYTHONPATH``; its stdout. AssertionError with both streams if it
    fails."""
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env or clean_env())
    assert proc.returncode == 0, (f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n"
                                  f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout


def base_python() -> str:
    """The interpreter this Python runs on, outside any venv."""
    return getattr(sys, "_base_executable", sys.executable)


def source_files(root: Path = ROOT) -> list[Path]:
    """The files of the source tree (tracked or new, not ignored), relative to ``root``; the
    packaging inputs only if ``root`` is not a git checkout."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=root, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return [p.relative_to(root) for p in [root / "pyproject.toml", root / "README.md",
                                              *(root / "dask_dataservice").rglob("*")]
                if p.is_file() and "__pycache__" not in p.parts]
    return [Path(name) for name in out.decode().split("\0") if name and (root / name).is_file()]


def build_dists(outdir: Path, root: Path = ROOT) -> dict[str, Path]:
    """``python -m build`` (sdist, then the wheel from it) of a copy of the source tree (the
    build writes ``*.egg-info`` next to its source: the checkout is left alone)."""
    with tempfile.TemporaryDirectory(prefix="dds-src-") as tmp:
        src = Path(tmp)
        for rel in source_files(root):
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, src / rel)
        outdir.mkdir(parents=True, exist_ok=True)
        run(sys.executable, "-m", "build", "--outdir", outdir, src, timeout=300)
    (wheel,) = outdir.glob("*.whl")
    (sdist,) = outdir.glob("*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


def fresh_venv(path: Path) -> Path:
    """A new venv at ``path`` (removed first if it exists); its ``bin`` folder."""
    if path.exists():
        shutil.rmtree(path)
    run(base_python(), "-m", "venv", path, timeout=120)
    return path / "bin"


def install_wheel(bin_dir: Path, wheel: Path, extras: str = "", *, no_deps: bool = False,
                  no_cache: bool = False, timeout: float = 600) -> None:
    """``pip install WHEEL[extras]`` into the venv of ``bin_dir``."""
    spec = f"{wheel}[{extras}]" if extras else str(wheel)
    cmd = [bin_dir / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check", spec]
    if no_deps:
        cmd.append("--no-deps")
    if no_cache:
        cmd.append("--no-cache-dir")
    run(*cmd, timeout=timeout)


def smoke(bin_dir: Path, cwd: Path) -> str:
    """Run :data:`SMOKE` as a script with the venv's python in ``cwd``; its output line."""
    script = cwd / "smoke.py"
    script.write_text(SMOKE)
    return run(bin_dir / "python", script, cwd=cwd, timeout=180).strip()


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("venv", type=Path, help="where to make the fresh venv (replaced)")
    parser.add_argument("--wheel", type=Path, help="a built wheel (default: build one)")
    parser.add_argument("--extras", default="", help="extras to install, e.g. compression")
    parser.add_argument("--no-cache", action="store_true", help="pip --no-cache-dir")
    parser.add_argument("--no-smoke", action="store_true", help="skip the LocalCluster read")
    args = parser.parse_args(argv)
    times: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="dds-dist-") as tmp:
        t0 = time.perf_counter()
        wheel = args.wheel or build_dists(Path(tmp))["wheel"]
        times["build_s"] = round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()
        bin_dir = fresh_venv(args.venv)
        install_wheel(bin_dir, wheel.resolve(), args.extras, no_cache=args.no_cache)
        times["install_s"] = round(time.perf_counter() - t0, 1)
        if not args.no_smoke:
            t0 = time.perf_counter()
            smoke(bin_dir, Path(tmp))
            times["smoke_s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps({"venv": str(args.venv), "wheel": wheel.name, **times}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
