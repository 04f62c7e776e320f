"""A consumer's heartbeat answers "unchanged" while its iteration's view is (service/dispatcher/_views.py).

The view (every task of the iteration, with its worker and status) costs O(tasks) to build
and send; with 1,000 workers that was 4.3 ms per heartbeat (docs/scaling.md). A consumer now
sends the version it has, and gets the tasks again only after something that can change
them: here a task is lost and a worker joins, while split hand-out and consumers joining
change nothing.
"""

from __future__ import annotations

import pytest
from _helpers import poll
from distributed import Worker
from test_dispatcher_plugin import ok

import dask_dataservice as dds
from dask_dataservice.service.dispatcher.plugin import PLUGIN_NAME
from dask_dataservice.testing import gen_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]


def _statuses(view: dict) -> dict[int, str]:
    return {t["task_id"]: t["status"] for t in view["tasks"]}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_heartbeat_sends_the_view_only_when_it_changed(c, s, a, b):
    await dds.install(c)
    plugin = s.plugins[PLUGIN_NAME]
    await poll(lambda: len(plugin.state.list_workers()) == 2, what="both workers to register")
    dataset_id = await dds.register_dataset(c, dds.Dataset.range(10**6))
    job = ok(await plugin.get_or_create_job(dataset_id=dataset_id, processing_mode="DYNAMIC"))
    token = job["job_token"]
    first = ok(await plugin.get_or_create_iteration(job_id=job["job_id"], job_token=token))
    client_id = first["iteration_client_id"]

    def heartbeat(version: str | None) -> dict:
        return ok(plugin.client_heartbeat(iteration_client_id=client_id, job_token=token,
                                          view_version=version))

    full = heartbeat(None)
    assert sorted(t["worker_address"] for t in full["tasks"]) == sorted([a.address, b.address])
    assert set(_statuses(full).values()) == {"active"}
    version = full["view_version"]
    # Nothing changed: only "unchanged", no task list.
    assert heartbeat(version) == {"status": "OK", "unchanged": True, "view_version": version,
                                  "consumers": 1}
    # Split hand-out and another consumer joining change no view.
    task_a = next(t["task_id"] for t in full["tasks"] if t["worker_address"] == a.address)
    ok(await plugin.get_split(iteration_id=first["iteration_id"], task_id=task_a, repetition=0,
                              count=4, job_token=token))
    second = ok(await plugin.get_or_create_iteration(job_id=job["job_id"], job_token=token))
    assert heartbeat(version)["unchanged"] is True
    # A version from elsewhere (another dispatcher start) is never taken for the current one.
    assert "tasks" in heartbeat(version.split("-")[0] + "-x")

    # A worker leaves: its task is lost, and the next heartbeat says so.
    await b.close()
    await poll(lambda: "unchanged" not in heartbeat(version), what="the view to change")
    after = heartbeat(version)
    assert after["view_version"] != version
    task_b = next(t["task_id"] for t in full["tasks"] if t["worker_address"] == b.address)
    assert _statuses(after)[task_b] == "lost" and _statuses(after)[task_a] == "active"
    version = after["view_version"]
    assert heartbeat(version)["unchanged"] is True

    # A worker joins: it gets a task of the running iteration, and consumers see it.
    async with Worker(s.address, nthreads=1) as w:
        await poll(lambda: any(t["worker_address"] == w.address
                               for t in heartbeat(None)["tasks"]), what="the new task")
        joined = heartbeat(version)
        assert joined["view_version"] != version
        assert {t["worker_address"] for t in joined["tasks"]} >= {a.address, w.address}
    for consumer in (client_id, second["iteration_client_id"]):
        ok(await plugin.release_iteration_client(iteration_client_id=consumer, job_token=token))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_reader_sees_every_element_once_with_unchanged_heartbeats(c, s, a, b):
    """End to end: a DYNAMIC read across heartbeats that answer "unchanged" (a slow consumer,
    many heartbeats) gets every element exactly once, and most heartbeats were "unchanged"."""
    await dds.install(c)
    plugin = s.plugins[PLUGIN_NAME]
    replies: list[bool] = []
    handler = s.handlers["dataservice_client_heartbeat"]

    def counting(*args, **kwargs):
        reply = handler(*args, **kwargs)
        replies.append(bool(reply.get("unchanged")))
        return reply

    s.handlers["dataservice_client_heartbeat"] = counting
    try:
        ds = await dds.distribute("distributed_epoch", c)(dds.Dataset.range(2_000).map(_slow))
        seen = [int(x) async for x in ds]
    finally:
        s.handlers["dataservice_client_heartbeat"] = handler
    assert sorted(seen) == list(range(2_000))
    assert plugin is s.plugins[PLUGIN_NAME]
    assert len(replies) >= 3 and sum(replies) >= len(replies) // 2, replies


def _slow(x: int) -> int:
    import time

    time.sleep(0.002)  # the pipeline's work (a worker thread), so that reads take a while
    return x
