"""The dashboard pages in a real headless Chromium, while a job streams and a model trains.

Each page is loaded over the DevTools protocol (``_browser.py``); the test reads what the page
rendered: bokeh's data sources named ``dds-*`` (they must hold non-zero figures), the canvases
and table cells in the shadow DOM, and the navigation bar (Dask's pages link ours). A
screenshot of each page is saved under the test's tmp dir (and, with
``DDS_DASHBOARD_SCREENSHOTS=<dir>``, there too: that is how docs/_static/ gets its images).
The pages are also checked on ``dask-dataservice scheduler`` processes (the preload).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import sys
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from _browser import PAGE_STATE_JS, Browser, chromium
from _helpers import PS, WK, Servers, free_port, in_thread, poll

import dask_dataservice as dds
from dask_dataservice.dashboard import PLUGIN_NAME
from dask_dataservice.service.client import _install_async
from dask_dataservice.testing import gen_cluster
from dask_dataservice.testing._ps import warm_up_zarr

pytestmark = [pytest.mark.process, pytest.mark.timeout(300), pytest.mark.slow]

warm_up_zarr()  # zarr's process-wide threads start before the thread-leak snapshot

needs_chromium = pytest.mark.skipif(
    chromium() is None and not os.environ.get("CI"),
    reason="chromium is not installed (.ci/run installs it; apt-get install -y chromium)")

#: Ends the streaming consumer (module level: read by the consumer thread).
STOP = threading.Event()


def _stream(client) -> int:
    """A consumer of a named DYNAMIC job that reads until STOP (paced by STOP.wait)."""
    ds = dds.Dataset.range(10**9).batch(256).apply(
        dds.distribute("DYNAMIC", client, job_name="dashboard-stream"))
    n = 0
    it = iter(ds)
    try:
        for batch in it:
            n += int(np.asarray(batch).size)
            if STOP.wait(0.002):
                break
    finally:
        it.close()
    return n


def _train(client):
    from dask_dataservice.demo import VOCAB_SIZE, make_click_dataset, train_click_model

    return train_click_model(client, make_click_dataset(40_000, batch_size=128),
                             examples=40_000, batch_size=128, vocab_size=VOCAB_SIZE)


def _save(shot: Path) -> None:
    out = os.environ.get("DDS_DASHBOARD_SCREENSHOTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(out) / shot.name)


def _nonzero(values) -> bool:
    return any(isinstance(v, (int, float)) and v > 0 for v in values)


def _data_page_ok(state) -> bool:
    src = state["sources"]
    return (_nonzero(src.get("dds-throughput", {}).get("elements_per_second", []))
            and _nonzero(src.get("dds-bytes", {}).get("bytes_per_second", []))
            and _nonzero(src.get("dds-workers", {}).get("elements_served", []))
            and _nonzero(src.get("dds-workers-rate", {}).get("elements_per_second", []))
            and "DYNAMIC" in src.get("dds-jobs", {}).get("mode", [])  # no job names (issue 22)
            and len(src.get("dds-consumers", {}).get("consumer", [])) >= 1
            and state["canvases"] >= 3 and "DYNAMIC" in state["cells"])


def _ps_page_ok(state) -> bool:
    src = state["sources"]
    return (_nonzero(src.get("dds-steps", {}).get("steps_per_second", []))
            and _nonzero(src.get("dds-ps-ops", {}).get("updates_per_second", []))
            and _nonzero(src.get("dds-ps-ops", {}).get("gathers_per_second", []))
            and _nonzero(src.get("dds-shards", {}).get("bytes", []))
            and _nonzero(src.get("dds-ps", {}).get("updates", []))
            and _nonzero(src.get("dds-trainers", {}).get("steps", []))
            and state["canvases"] >= 3
            and any(c.startswith("embedding") or "/embedding" in c for c in state["cells"]))


@needs_chromium
@gen_cluster(client=True, nthreads=[PS, WK, WK], timeout=280,
             scheduler_kwargs={"dashboard": True, "dashboard_address": "127.0.0.1:0"},
             config={"dataservice.dashboard.interval": "250ms",
                     # the named job goes once its consumer left (for the cleanup check)
                     "dataservice.dispatcher.job-gc-timeout": "500ms",
                     "dataservice.dispatcher.gc-dynamic-sharding-jobs": True})
async def test_pages_in_a_browser_while_a_job_streams_and_a_model_trains(c, s, ps, a, b,
                                                                          tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("dashboard")
    STOP.clear()
    await _install_async(c)  # after the fact: the scheduler's dashboard was already serving
    plugin = s.plugins[PLUGIN_NAME]
    base = f"http://127.0.0.1:{s.http_server.port}"
    stream = asyncio.ensure_future(in_thread(s, _stream))
    training = asyncio.ensure_future(in_thread(s, _train))
    try:
        await poll(lambda: plugin.status()["totals"].get("steps_per_second", 0) > 0,
                   timeout=120, what="training steps")  # the model trains, the job streams
        async with Browser(tmp_path) as browser:
            await browser.open(f"{base}/parameter-servers")
            state = await browser.until(PAGE_STATE_JS, _ps_page_ok, timeout=150)
            assert state["title"] == "Dask: Parameter servers"
            assert ps.address in state["sources"]["dds-ps"]["ps"]
            _save(await browser.screenshot(tmp_path / "dashboard-parameter-servers.png"))

            await browser.open(f"{base}/dataservice")
            state = await browser.until(PAGE_STATE_JS, _data_page_ok, timeout=90)
            assert state["title"] == "Dask: Data service"
            assert {"dataservice", "parameter-servers", "status"} <= set(state["nav"])
            _save(await browser.screenshot(tmp_path / "dashboard-dataservice.png"))

            # Dask's own pages link ours from their navigation bar
            await browser.open(f"{base}/status")
            state = await browser.until(PAGE_STATE_JS, lambda st: bool(st["nav"]), timeout=60)
            assert {"dataservice", "parameter-servers"} <= set(state["nav"])
        for name in ("dashboard-dataservice.png", "dashboard-parameter-servers.png"):
            png = (tmp_path / name).read_bytes()
            assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
        result = await training
        assert result.examples == 40_000
    finally:
        STOP.set()
        n = await stream
        if not training.done():
            await asyncio.wait([training])
    assert n > 0 and n % 256 == 0


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read()


def test_pages_and_route_on_the_dask_dataservice_scheduler_command(tmp_path):
    """``dask-dataservice scheduler`` (the preload): the pages and the JSON route are there."""
    from distributed import Client

    cli = [sys.executable, "-m", "dask_dataservice.cli"]
    port = free_port()
    scheduler_file = tmp_path / "scheduler.json"
    with Servers() as servers:
        scheduler = servers.start(*cli, "scheduler", "--host", "127.0.0.1", "--port", "0",
                                  "--dashboard-address", f"127.0.0.1:{port}",
                                  "--scheduler-file", str(scheduler_file))
        worker = servers.start(*cli, "worker", "--scheduler-file", str(scheduler_file),
                               "--nthreads", "1", "--host", "127.0.0.1", "--no-dashboard")
        with Client(scheduler_file=str(scheduler_file), timeout="30s",
                    set_as_default=False) as client:
            client.wait_for_workers(1, timeout=30)
            ds = dds.Dataset.range(777).apply(dds.distribute("DYNAMIC", client))
            assert sorted(ds) == list(range(777))
            base = f"http://127.0.0.1:{port}"
            for page in ("dataservice", "parameter-servers"):
                status, body = _get(f"{base}/{page}")
                assert status == 200 and b"Bokeh" in body and b'href="dataservice"' in body

            def served() -> int:
                st = json.loads(_get(f"{base}/dataservice/status.json")[1])
                return sum(w["elements_served"] for w in st["workers"].values())

            from _helpers import wait

            wait(lambda: served() == 777, what="the JSON route's count")
            assert dds.status(client)["service"]["installed"] is True
        servers.stop(worker)
        servers.stop(scheduler)


@pytest.mark.cluster
def test_demo_prints_the_dashboard_pages():
    from _helpers import invoke

    rc, out, err = invoke("demo", "--no-train", "--no-processes", "--workers", "2",
                          "--elements", "2000")
    assert rc == 0, err
    [line] = [ln for ln in err.splitlines() if ln.startswith("demo: dashboard: ")]
    assert re.fullmatch(r"demo: dashboard: http://127\.0\.0\.1:\d+/dataservice \(data service\), "
                        r"http://127\.0\.0\.1:\d+/parameter-servers", line), line
