"""The dashboard names the slow op: per-op figures in a real headless Chromium, by value.

A DYNAMIC job reads ``range(N).map(_sleepy).batch(4)`` where ``_sleepy`` sleeps a fixed time
per element: it must be the bottleneck. The consumer takes every batch and then holds its
iterator open (so the job stays on the page) while the test reads the page's data sources.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import pytest
from _browser import PAGE_STATE_JS, Browser, chromium
from _helpers import in_thread, poll

import dask_dataservice as dds
from dask_dataservice.dashboard import PLUGIN_NAME
from dask_dataservice.service.client import _install_async
from dask_dataservice.testing import gen_cluster

pytestmark = [pytest.mark.process, pytest.mark.timeout(120), pytest.mark.slow]

needs_chromium = pytest.mark.skipif(chromium() is None, reason="chromium is not installed")

N = 96
HOLD = threading.Event()


def _sleepy(x):
    time.sleep(0.01)  # the deliberately slow op: a fixed cost per element
    return x


def _read_and_hold(client) -> list[int]:
    ds = dds.Dataset.range(N).map(_sleepy).batch(4).apply(
        dds.distribute("DYNAMIC", client, job_name="slow-map"))
    it = iter(ds)
    try:
        got = [int(v) for b in itertools.islice(it, N // 4) for v in b]
        HOLD.wait(60)  # keep the job (and its consumer) on the page while it is checked
        return got
    finally:
        it.close()


def _ops_done(state) -> bool:
    src = state["sources"]
    return (src.get("dds-ops", {}).get("elements_out", []) == [N, N, N // 4]
            and src.get("dds-jobs", {}).get("input_bound", ["n/a"])[:1] not in (["n/a"], []))


@needs_chromium
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=100,
             scheduler_kwargs={"dashboard": True, "dashboard_address": "127.0.0.1:0"},
             config={"dataservice.dashboard.interval": "100ms"})
async def test_the_page_names_a_sleeping_map_the_bottleneck(c, s, a, tmp_path_factory):
    HOLD.clear()
    await _install_async(c)
    plugin = s.plugins[PLUGIN_NAME]
    reading = asyncio.ensure_future(in_thread(s, _read_and_hold))
    try:
        await poll(lambda: any(
            [r["elements_out"] for r in j["ops"]] == [N, N, N // 4]
            for j in plugin.status()["service"]["jobs"]), timeout=60, what="the ops' counts")
        async with Browser(tmp_path_factory.mktemp("bottleneck")) as browser:
            await browser.open(f"http://127.0.0.1:{s.http_server.port}/dataservice")
            state = await browser.until(PAGE_STATE_JS, _ops_done, timeout=60)
        src = state["sources"]
        ops = src["dds-ops"]
        assert ops["op"] == ["range", "map(_sleepy)", "batch"]
        assert ops["elements_in"] == ["", N, N]  # a source has no input
        assert ops["elements_out"] == [N, N, N // 4]  # every element the consumer read
        assert ops["bottleneck"] == ["", "yes", ""]
        # the map's own time per element is its sleep (at least; sampled, so not exact)
        assert ops["seconds_per_element"][1] >= 0.005
        assert ops["share"][1] > 50
        assert src["dds-jobs"]["bottleneck"] == ["map(_sleepy)"]
        assert "map(_sleepy)" in state["cells"]
        # the job's rate over time: one line, a rate per poll, some of them non-zero
        hist = src["dds-job-history"]
        assert hist["job"] == [f"job {src['dds-jobs']['job_id'][0]}"]
        assert len(hist["xs"][0]) == len(hist["ys"][0]) >= 2 and max(hist["ys"][0]) > 0
        # the consumer does nothing but read a slow pipeline: it is input-bound
        bound = src["dds-jobs"]["input_bound"]
        assert len(bound) == 1 and 50 <= float(bound[0]) <= 100
        # a one-thread worker's service threads: a CPU share, never the old 453 %
        cpu = [float(v) for v in src["dds-workers"]["cpu"]]
        assert len(cpu) == 1 and 0 <= cpu[0] <= 100
        # bytes are bytes on the page (KiB, MiB), not numeral's "m"
        assert all(v.endswith(("B", "B/s")) for v in src["dds-workers"]["bytes_served"])
    finally:
        HOLD.set()
        got = await reading
    assert sorted(got) == list(range(N))
