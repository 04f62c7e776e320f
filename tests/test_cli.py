"""The ``dask-dataservice`` command line: in-process through ``main`` and once as a real process."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from dask_dataservice import cli
from dask_dataservice.cli import Progress, main

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


def test_demo_in_process(capsys):
    rc = main(["demo", "--elements", "10000", "--quiet"])
    out, err = capsys.readouterr()
    assert rc == 0
    lines = out.splitlines()
    assert len(lines) == 1, out
    m = THROUGHPUT.match(lines[0])
    assert m, lines[0]
    assert int(m["n"]) == 10_000
    assert float(m["t"]) >= 0
    assert err == ""  # --quiet: no progress bar


def test_demo_batch_size_not_dividing_elements(capsys):
    # 1000 = 3 * 333 + 1: the last, partial batch must be counted too.
    rc = main(["demo", "--elements", "1000", "--batch-size", "333", "--quiet"])
    out, _ = capsys.readouterr()
    assert rc == 0
    m = THROUGHPUT.match(out.strip())
    assert m and int(m["n"]) == 1000


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


def test_console_script_demo():
    proc = subprocess.run(
        [str(_console_script()), "demo", "--elements", "5000"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    m = THROUGHPUT.match(proc.stdout.strip())
    assert m, proc.stdout
    assert int(m["n"]) == 5000
    # stderr is a pipe here, not a terminal: a few progress lines, no carriage returns.
    assert "\r" not in proc.stderr
    assert 1 <= len(proc.stderr.splitlines()) <= 8, proc.stderr


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
    assert "demo" in err and "version" in err


@pytest.mark.parametrize("bad", ["0", "-5", "ten"])
def test_demo_rejects_bad_counts(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--elements", bad])
    assert exc.value.code == 2


def test_subcommands_are_registered_once():
    parser = cli.build_parser()
    help_text = parser.format_help()
    for name in ("demo", "version"):
        assert name in cli._COMMANDS
        assert name in help_text


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
