"""The reader's pure decisions, without a cluster."""

from __future__ import annotations

import re

import pytest

import dask_dataservice as dds
from dask_dataservice.service.client._fixed_readers import CoordinatedReader, CrossTrainerReader
from dask_dataservice.service.client._reader import IterationReader, reader_class
from dask_dataservice.service.client._service_source import ReadSpec
from dask_dataservice.service.protocol._sharding import ShardingPolicy

pytestmark = pytest.mark.pure


def spec(mode=ShardingPolicy.DYNAMIC, cache=None, num_consumers=None, job_name="job"):
    return ReadSpec(address="tcp://127.0.0.1:1", dataset_id=1, processing_mode=int(mode),
                    job_name=job_name, consumer_index=0 if num_consumers else None,
                    num_consumers=num_consumers, max_outstanding_requests=None,
                    target_workers="AUTO", cross_trainer_cache=cache)


@pytest.mark.parametrize(("read", "expected"), [
    (spec(cache=dds.CrossTrainerCache("t1")), CrossTrainerReader),
    (spec(ShardingPolicy.OFF, cache=dds.CrossTrainerCache("t1")), IterationReader),
    (spec(num_consumers=2), CoordinatedReader),
    (spec(), IterationReader),
    (spec(ShardingPolicy.OFF, job_name=None), IterationReader),
])
def test_reader_class_depends_on_the_read_only(read, expected):
    """The reader's kind is a function of what is read: a cross-trainer read under DYNAMIC
    takes turns whatever the number of tasks when it starts (it used to be the plain reader
    when the view listed one task, a race with the second worker's registration)."""
    assert reader_class(read) is expected


# -- the iteration: which tasks, when the pass is over -------------------------------------
from dask_dataservice.errors import DataServiceError  # noqa: E402
from dask_dataservice.service.client.reader_core import (  # noqa: E402
    ReaderCore,
    RequestSize,
    TaskRead,
    Tracker,
    ViewChanges,
    address_host,
    select_tasks,
)


def view(*tasks, finished=False, mode="DYNAMIC", **kw):
    return {"tasks": [{"task_id": t, "worker_address": a, "status": st} for t, a, st in tasks],
            "finished": finished, "processing_mode": mode, **kw}


A, B = "tcp://10.0.0.1:1000", "tcp://10.0.0.2:1000"


def core(target="AUTO", host="10.0.0.1"):
    return ReaderCore(7, target, host, Tracker(warning=1.0, timeout=3.0))


def test_new_tasks_start_once_and_lost_ones_stop():
    c = core()
    assert c.on_view(view((1, A, "active"))) == ViewChanges(start=((1, A),))
    assert c.on_view(view((1, A, "active"), (2, B, "active"))) == ViewChanges(start=((2, B),))
    assert c.on_view(view((1, A, "active"), (2, B, "active"))) == ViewChanges()
    assert c.on_view(view((1, A, "active"), (2, B, "lost"))) == ViewChanges(cancel=(2,))
    assert c.is_lost(2) and not c.all_ended
    # a task lost before this reader saw it has nothing to read
    assert c.on_view(view((1, A, "active"), (2, B, "lost"), (3, B, "lost"))) == ViewChanges()
    assert c.reading == {1: False, 2: False, 3: True}


def test_an_off_pass_ends_at_the_consumers_next_call():
    """fault_tolerance_test.testAddWorkerMidJob / testRestartWorker: at the end of an OFF pass
    the reader waits for its consumer's next call and asks again (a worker added or restarted
    meanwhile serves its copy); other modes, and a local reader of a static job, end at once."""
    c = core(target="ANY")
    v = view((1, A, "active"), finished=True, mode="OFF")
    c.on_view(v)
    c.task_ended(1)
    assert c.pass_over(v) and c.ends_at_demand(v)
    # a task added meanwhile (the new worker's copy): the pass goes on
    assert c.on_view(view((1, A, "finished"), (2, B, "active"), mode="OFF")) == ViewChanges(
        start=((2, B),))
    assert not c.all_ended
    for mode in ("DYNAMIC", "FILE", "DATA"):
        assert not core(target="ANY").ends_at_demand(view(finished=True, mode=mode))
    local = core()
    local.on_view(view((1, A, "active"), finished=True, mode="FILE"))
    assert local.local_only and not local.ends_at_demand(view(finished=True, mode="OFF"))


def test_the_pass_is_over_when_every_task_ended_and_the_dispatcher_says_so():
    c = core()
    v = view((1, A, "active"), (2, B, "active"))
    c.on_view(v)
    c.task_ended(1)
    assert not c.pass_over({**v, "finished": True})  # task 2 still reads
    c.task_ended(2)
    assert c.all_ended
    assert not c.pass_over(v)  # the dispatcher has not recorded every task yet
    assert c.pass_over({**v, "finished": True})


def test_no_task_is_not_the_end():
    c = core()
    c.on_view(view())
    assert not c.all_ended and not c.pass_over(view(finished=True))
    assert c.no_workers(0.5) is None and c.no_workers(1.0) == "warn"
    assert c.no_workers(3.0) == "fail"


def test_a_garbage_collected_iteration_fails_the_read():
    with pytest.raises(DataServiceError, match="iteration 7 was garbage collected"):
        core().on_view(view(garbage_collected=True))


def test_local_reads_of_static_sharding():
    v = view((1, A, "active"), (2, B, "active"), mode="FILE", pending_shards=1)
    c = core()
    assert c.on_view(v) == ViewChanges(start=((1, A),))  # AUTO + static: this host's tasks
    c.task_ended(1)
    assert not c.pass_over(v)  # a listed worker is still to join (maybe on this host)
    assert c.pass_over({**v, "pending_shards": 0})
    with pytest.raises(DataServiceError, match=r"no data worker of this job runs on this host"):
        core("LOCAL", host="10.9.9.9").on_view(v)
    assert select_tasks(v, "ANY", "10.0.0.1") == (v["tasks"], False)
    assert select_tasks(view((1, A, "active"), (2, B, "active")), "AUTO", "10.0.0.1")[1] is False


def test_local_reads_in_process_meaning():
    """``dataservice.client.local-workers: process``: only the workers of the consumer's own
    process are local (TensorFlow's meaning), whatever their host."""
    v = view((1, A, "active"), (2, B, "active"), mode="DATA")
    assert select_tasks(v, "AUTO", "10.0.0.1", frozenset({B})) == ([v["tasks"][1]], True)
    assert select_tasks(v, "LOCAL", "10.0.0.1", frozenset({A, B})) == (v["tasks"], True)
    assert select_tasks(v, "AUTO", "10.0.0.1", frozenset()) == (v["tasks"], False)
    c = ReaderCore(7, "LOCAL", "10.0.0.1", Tracker(warning=1.0, timeout=3.0), frozenset)
    with pytest.raises(DataServiceError, match=re.escape(
            "target_workers='LOCAL' with dataservice.client.local-workers='process', but no "
            "data worker of this job runs in this process; its workers are "
            "['tcp://10.0.0.1:1000', 'tcp://10.0.0.2:1000']")):
        c.on_view(v)


def test_local_workers_mode_is_checked():
    import dask

    from dask_dataservice.service.client._locality import local_workers_mode

    assert local_workers_mode() == "host"
    with dask.config.set({"dataservice.client.local-workers": "Process"}):
        assert local_workers_mode() == "process"
    with dask.config.set({"dataservice.client.local-workers": "rack"}), pytest.raises(
            ValueError, match=r"^dataservice.client.local-workers must be 'host' or 'process', "
                              r"got 'rack'$"):
        local_workers_mode()


@pytest.mark.parametrize("address", ["tcp://10.0.0.1:8786", "tls://[::1]:80",
                                     "tcp://host-a:1", "tls://10.0.0.2:443"])
def test_address_host_is_distributed_s(address):
    from distributed.comm.addressing import get_address_host

    assert address_host(address) == get_address_host(address)


# -- one task: requests, replies, retries ----------------------------------------------------
def read(depth=2, now=0.0):
    return TaskRead(1, A, depth, retry_timeout=30.0, stalls=Tracker(10.0, 60.0), now=now)


def test_depth_requests_in_flight_the_head_answers_at_once():
    r = read()
    sent = r.to_send(64, linger=0.05)
    assert [(q.seq, q.ack, q.linger, q.max_elements) for q in sent] == [
        (0, -1, 0.0, 64), (1, -1, 0.05, 64)]
    assert r.to_send(64, 0.05) == []  # full
    assert r.on_reply(0, {"status": "OK", "elements": object()}, 1.0, False).kind == "elements"
    (nxt,) = r.to_send(64, 0.05)
    assert (nxt.seq, nxt.ack, nxt.linger) == (2, 0, 0.05)  # acknowledges 0; 1 is ahead of it


def test_replies_end_a_task_or_report_a_stall():
    r = read(depth=1)
    r.to_send(8, 0.0)
    assert r.on_reply(0, {"status": "OK", "elements": None, "end_of_sequence": False},
                      5.0, False).stall is None
    r.to_send(8, 0.0)
    out = r.on_reply(1, {"status": "OK", "elements": None}, 10.0, False)
    assert (out.kind, out.stall, out.waited) == ("nothing", "warn", 10.0)
    r.to_send(8, 0.0)
    assert r.on_reply(2, {"status": "OK", "elements": None}, 60.0, False).stall == "fail"
    for reply, lost, why in [({"status": "OK", "end_of_sequence": True}, False, "end"),
                             (None, False, "closing"),
                             ({"status": "OK", "closing": True}, False, "closing"),
                             ({"status": "OK", "unknown": True}, True, "lost")]:
        r.to_send(8, 0.0)
        out = r.on_reply(r.head, reply, 61.0, lost)
        assert (out.kind, out.why) == ("done", why)
    r.to_send(8, 0.0)
    assert r.on_reply(r.head, {"status": "OK", "unknown": True}, 61.0, False).kind == "nothing"
    r.to_send(8, 0.0)
    assert r.on_reply(r.head, {"status": "error", "exception": "x"}, 61.0, False).kind == "error"


def test_a_finished_task_its_worker_does_not_know_is_over():
    """The hang the simulator points at: a task's input ended (the dispatcher says
    "finished"), then its worker restarted (or another took its address) before this reader
    got the end of sequence. The worker says it does not know the task; it never will, so
    the read of that task is over (what it held is gone: at most once), rather than polling
    "unknown" for ever (``client.stall-timeout`` is null by default)."""
    c = core()
    c.on_view(view((1, A, "active"), (2, B, "active")))
    assert not c.is_gone(1) and not c.is_gone(2)
    c.on_view(view((1, A, "finished"), (2, B, "active")))
    assert c.is_gone(1) and not c.is_lost(1) and not c.is_gone(2)
    r = read()
    r.to_send(8, 0.0)
    out = r.on_reply(r.head, {"status": "OK", "elements": None, "unknown": True}, 1.0,
                     c.is_gone(1))
    assert (out.kind, out.why) == ("done", "lost")
    r.to_send(8, 0.0)  # a task not finished yet: not started there yet, poll again
    assert r.on_reply(r.head, {"status": "OK", "unknown": True}, 1.0, c.is_gone(2)).kind \
        == "nothing"


def test_a_failed_request_is_sent_again_from_its_seq_with_backoff():
    r = read(depth=3)
    r.to_send(8, 0.0)  # 0, 1, 2
    r.on_reply(0, {"status": "OK", "elements": object()}, 0.0, False)
    r.to_send(8, 0.0)  # 3
    first = r.on_failure(1.0, lost=False)  # 1 failed
    assert (first.give_up, first.delay, first.report) == (False, 0.02, True)
    r.resend(1)
    assert [q.seq for q in r.to_send(8, 0.0)] == [1, 2, 3]  # again, acknowledging 0
    assert r.on_failure(2.0, lost=False) == type(first)(False, 0.04, False)
    r.resend(1)
    r.to_send(8, 0.0)
    assert r.on_failure(40.0, lost=False).why == "timeout"  # 30 s of failures in a row
    r.resend(1)
    r.to_send(8, 0.0)
    assert r.on_failure(40.0, lost=True).why == "lost"


def test_an_answer_resets_the_retries():
    r = read(depth=1)
    r.to_send(8, 0.0)
    r.on_failure(0.0, False)
    r.resend(0)
    r.to_send(8, 0.0)
    r.on_reply(0, {"status": "OK", "elements": object()}, 100.0, False)
    r.to_send(8, 0.0)
    assert r.on_failure(200.0, False).report  # a new run of failures: report again


def test_shared_jobs_grow_requests_while_the_consumer_keeps_up():
    size = RequestSize(4096, shared=True, shared_start=256)
    assert size.next(queued=0, taken=0, capacity=8) == 256
    assert size.next(queued=1, taken=1, capacity=8) == 512  # took one: grow
    assert size.next(queued=1, taken=1, capacity=8) == 512  # took none since
    assert size.next(queued=4, taken=2, capacity=8) == 256  # half full: halve
    assert size.next(queued=8, taken=2, capacity=8) == 256  # never below the start
    assert RequestSize(4096, shared=False, shared_start=256).next(8, 0, 8) == 4096


def test_shared_jobs_ask_for_the_smallest_size_once_not_alone():
    """The interleaving of testSharedJobName's failure: the consumer takes each batch while
    the next is queued (queued 1, one more taken per request). Alone it grows as before;
    once another consumer reads the job (a worker's reply or a heartbeat says 2), it drops
    to the smallest size and stays there, so a pause leaves it holding little."""
    size = RequestSize(4096, shared=True, shared_start=16)
    assert [size.next(queued=1, taken=k, capacity=8) for k in range(1, 5)] == [32, 64, 128, 256]
    size.shared_with(1)  # alone: no change
    assert size.next(queued=1, taken=5, capacity=8) == 512
    size.shared_with(2)
    assert size.current == 16
    assert [size.next(queued=1, taken=k, capacity=8) for k in range(6, 10)] == [16] * 4
    assert size.next(queued=0, taken=20, capacity=8) == 16
    private = RequestSize(4096, shared=False, shared_start=16)
    private.shared_with(2)  # a private job's size is not the consumers' business
    assert private.next(1, 1, 8) == 4096


# -- readers over a fixed task list ------------------------------------------------------------
from dask_dataservice.service.client.reader_core import (  # noqa: E402
    fixed_tasks,
    join_rounds,
    join_turns,
    task_lost,
    turn_reply,
)


def test_fixed_readers_walk_the_active_tasks_by_id():
    v = view((5, B, "active"), (2, A, "active"), (3, A, "lost"))
    assert fixed_tasks(v) == [(2, A), (5, B)]
    assert fixed_tasks(view()) == []
    assert task_lost(v, 3) and not task_lost(v, 2) and not task_lost(v, 9)


def test_parts_are_joined_round_by_round_or_turn_by_turn():
    assert join_rounds([[0, 2], [1, 3]]) == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        join_rounds([[0, 2], [1]])  # every task answers every round
    assert join_turns([[0, 1], [10, 11]]) == [0, 1, 10, 11]


def test_a_cross_trainer_turn_asks_the_dispatcher_about_an_unknown_task():
    """A reply to a cross-trainer turn's request: an "unknown" task is told apart from
    "nothing yet" (the reader then asks the dispatcher, and ends once the task is lost: its
    worker never got it, or restarted without it, and would answer so for ever; found by the
    simulator, cross-trainer seed 7)."""
    unknown = {"status": "OK", "elements": None, "end_of_sequence": False, "unknown": True}
    assert turn_reply(unknown) == "unknown"
    assert turn_reply({**unknown, "unknown": False}) == "nothing"
    assert turn_reply({"status": "OK", "elements": None, "end_of_sequence": True}) == "end"
    assert turn_reply({"status": "OK", "elements": [1], "end_of_sequence": False}) == "elements"
    assert turn_reply({"status": "error", "error": "x"}) == "error"
    assert turn_reply(None) == "closing"
    assert turn_reply({"status": "OK", "closing": True}) == "closing"


def test_the_core_imports_no_dask_no_asyncio_no_threads():
    """Sans-I/O: the module (at any level) imports nothing that does I/O or schedules."""
    import ast
    import inspect

    from dask_dataservice.service.client import reader_core as _reader_core

    tree = ast.parse(inspect.getsource(_reader_core))
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert names <= {"__future__", "dataclasses", "collections", "collections.abc", "typing",
                     "errors"}, names


def test_ask_again_soon_unless_listed_workers_are_still_to_join():
    from dask_dataservice.service.client.reader_core import ask_again_after

    assert ask_again_after(view(), 1.0) == 0.01
    assert ask_again_after(view(pending_shards=2), 1.0) == 1.0
    assert ask_again_after(view(), 0.005) == 0.005
