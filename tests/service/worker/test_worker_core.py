"""The data worker's sans-I/O core (service/worker/core.py), driven without a cluster."""

from __future__ import annotations

import pytest

from dask_dataservice.service.worker.core import (
    CancelTask,
    ForgetDatasets,
    SendFinishTask,
    ShowEnd,
    StartTask,
    TaskPhase,
    WorkerCore,
    empty_reply,
    may_linger,
    unknown_task_reply,
)

pytestmark = pytest.mark.pure



def task(tid, **kw):
    return {"task_id": tid, "iteration_id": 1, "job_id": 1, "dataset_id": 1,
            "processing_mode": 1, "job_token": f"token-{tid}", **kw}


def test_a_pushed_task_starts_once():
    core = WorkerCore()
    effects = core.tasks_changed([task(1), task(2)])
    assert [type(e) for e in effects] == [StartTask, StartTask]
    assert [e.task["task_id"] for e in effects] == [1, 2]
    assert core.phase(1) == TaskPhase.LOADING
    # the heartbeat reply names it again (a push and a reply crossed): nothing new starts
    assert core.heartbeat_reply({"status": "OK", "new_tasks": [task(1)]}) == []
    assert core.heartbeat_message() == {"active_tasks": [1, 2], "finished_tasks": [],
                                        "resumed": True}


def test_the_started_task_is_a_copy_of_the_message():
    core = WorkerCore()
    message = task(1)
    (start,) = core.tasks_changed([message])
    message["job_id"] = 99
    assert start.task["job_id"] == 1


def test_a_cancelled_task_is_remembered_and_never_restarted():
    core = WorkerCore()
    core.tasks_changed([task(1)])
    assert core.tasks_changed((), [1, 7]) == [CancelTask(1), CancelTask(7)]
    assert not core.knows(1) and 1 in core.finished and 7 in core.finished
    # a late push of a cancelled task (or of one that never ran here) starts nothing
    assert core.tasks_changed([task(1), task(7)]) == []


def test_a_task_cancelled_while_its_dataset_loads_does_not_start():
    core = WorkerCore()
    core.tasks_changed([task(1)])
    core.tasks_changed((), [1])
    assert core.task_started(1) is False
    assert core.task_failed_to_start(1) == []


def test_end_of_sequence_only_after_the_dispatcher_was_told():
    core = WorkerCore()
    core.tasks_changed([task(1)])
    assert core.task_started(1)
    assert core.phase(1) == TaskPhase.RUNNING
    assert core.input_ended(1, error=False) == [SendFinishTask(1, False, "token-1")]
    assert core.phase(1) == TaskPhase.ENDED
    # the report is in flight: the task is still active for the dispatcher, and ending twice
    # sends one report
    assert core.heartbeat_message()["active_tasks"] == [1]
    assert core.input_ended(1, error=False) == []
    assert core.finish_sent(1) == [ShowEnd(1)]
    assert core.phase(1) == TaskPhase.FINISHED
    assert core.heartbeat_message() == {"active_tasks": [], "finished_tasks": [1],
                                        "resumed": False}
    assert core.finish_sent(1) == []


def test_a_task_that_cannot_start_reports_an_error():
    core = WorkerCore()
    core.tasks_changed([task(3)])
    assert core.task_failed_to_start(3) == [SendFinishTask(3, True, "token-3")]
    assert core.finish_sent(3) == [ShowEnd(3)]


def test_a_task_cancelled_after_its_input_ended_shows_no_end():
    core = WorkerCore()
    core.tasks_changed([task(1)])
    core.task_started(1)
    core.input_ended(1, error=True)
    core.tasks_changed((), [1])
    assert core.finish_sent(1) == []


def test_another_lineage_drops_every_task_and_forgets_finished_ids():
    core = WorkerCore()
    assert core.heartbeat_reply({"status": "OK", "lineage": "A",
                                 "new_tasks": [task(1), task(2)]})[:2] == [
        StartTask(task(1)), StartTask(task(2))]
    core.tasks_changed((), [2])
    assert 2 in core.finished
    effects = core.heartbeat_reply({"status": "OK", "lineage": "B", "new_tasks": [task(2)]})
    # every task of lineage A is cancelled, ids are forgotten, the new dispatcher's task 2
    # (a new task with a reused id) starts
    assert effects == [CancelTask(1), ForgetDatasets(), StartTask(task(2))]
    assert core.lineage == "B" and 1 not in core.finished


def test_a_reply_without_lineage_keeps_the_tasks():
    core = WorkerCore()
    core.heartbeat_reply({"status": "OK", "lineage": "A", "new_tasks": [task(1)]})
    assert core.heartbeat_reply({"status": "OK"}) == []
    assert core.knows(1) and core.lineage == "A"


def test_requests_run_in_seq_order():
    core = WorkerCore()
    key = (1, 10)
    first = core.turn(key, 0, None)
    assert not first.wait and not first.keep
    second = core.turn(key, 2, None)  # seq 1 not run yet: 2 waits
    assert second.wait
    assert core.turn(key, 1, None).wait  # 0 runs: 1 waits too
    assert core.turn_done(key, 0) == 1  # 1's turn: wake it (not 2)
    assert core.turn_done(key, 1) == 2
    assert core.turn_done(key, 2) is None
    assert not core.turn(key, 3, None).wait  # next in line: runs at once


def test_a_request_that_gave_up_waiting_is_not_woken():
    core = WorkerCore()
    key = (1, None)
    assert core.turn(key, 1, None).wait
    core.turn_abandoned(key, 1, waiting=True)
    assert core.turn_done(key, 0) is None


def test_kept_replies_replay_until_acknowledged():
    core = WorkerCore()
    key = (1, 10)
    assert core.turn(key, 0, -1).keep
    assert core.turn(key, 1, -1).keep
    assert core.turn(key, 0, -1).replay  # sent again: the kept reply answers it
    core.turn_done(key, 0)
    core.turn_done(key, 1)
    turn = core.turn(key, 2, 0)  # acknowledges 0: forget it
    assert turn.forget == (0,) and turn.keep and not turn.replay
    assert core.replies_kept(key) == 2
    assert not core.turn(key, 0, 0).replay  # forgotten: computed afresh
    core.turn_abandoned(key, 2, kept=True)  # request 2 was cancelled
    assert not core.turn(key, 2, 1).replay


def test_only_replies_with_elements_are_kept():
    """A reply without elements ("unknown" before the task arrived, "nothing yet") is not
    kept: sent again, the request is computed afresh. Kept, an "unknown" replayed after the
    task finished made the reader end a task whose worker holds its elements (found by the
    simulator: dynamic seed 487, drops only)."""
    core = WorkerCore()
    key = (1, 10)
    assert core.turn(key, 0, -1).keep
    assert not core.keep_reply(key, 0, has_elements=False)
    core.turn_done(key, 0)
    assert not core.turn(key, 0, -1).replay  # computed afresh
    assert core.keep_reply(key, 0, has_elements=True)
    core.turn_done(key, 0)
    assert core.turn(key, 0, -1).replay and core.replies_kept(key) == 1


def test_cancelling_a_task_drops_its_turns():
    core = WorkerCore()
    core.tasks_changed([task(1), task(2)])
    core.turn((1, 10), 0, -1)
    core.turn((2, 10), 0, -1)
    core.tasks_changed((), [1])
    assert core.turn_keys() == [(2, 10)]
    assert core.turn_done((1, 10), 0) is None


def test_consumers_counts_who_reads_a_task_until_it_is_dropped():
    """Each consumer sending ordered requests for a task counts once (a shared job's readers
    learn from the replies that they are not alone); cancelling the task forgets them."""
    core = WorkerCore()
    core.tasks_changed([task(1), task(2)])
    assert core.consumers(1) == 0
    core.turn((1, 10), 0, -1)
    core.turn((1, 10), 1, 0)  # the same consumer again
    assert core.consumers(1) == 1
    core.turn((1, 11), 0, -1)
    core.turn((2, 11), 0, -1)
    assert (core.consumers(1), core.consumers(2)) == (2, 1)
    core.tasks_changed((), [1])
    assert (core.consumers(1), core.consumers(2)) == (0, 1)


def test_finished_memory_is_bounded():
    core = WorkerCore(finished_memory=3)
    core.tasks_changed((), [1, 2, 3, 4])
    assert sorted(core.finished) == [2, 3, 4]


@pytest.mark.parametrize(("taken", "max_elements", "linger", "lingers", "expected"), [
    (0, 10, 0.1, True, False),   # nothing taken: the request waited already
    (5, 10, 0.1, True, True),
    (10, 10, 0.1, True, False),  # full
    (5, 10, 0.0, True, False),   # the head request answers at once
    (5, 10, 0.1, False, False),  # the cross-trainer window follows production
])
def test_may_linger(taken, max_elements, linger, lingers, expected):
    assert may_linger(taken, max_elements, linger, lingers) is expected


def test_empty_replies():
    err = ValueError("boom")
    assert empty_reply(True, err, False) is err
    assert empty_reply(True, None, False)["end_of_sequence"] is True
    assert empty_reply(False, None, False)["end_of_sequence"] is False
    assert empty_reply(False, None, True)["end_of_sequence"] is True
    assert unknown_task_reply(1, True, False)["end_of_sequence"] is True
    assert unknown_task_reply(1, False, False)["unknown"] is True
    assert unknown_task_reply(1, False, True)["unknown"] is False


# -- splits of a DYNAMIC task ----------------------------------------------------------------
from dask_dataservice.service.worker.core import Rounds, SplitFlow, SplitRequest  # noqa: E402


def test_split_batches_double_while_the_source_waits_and_requests_go_ahead():
    flow = SplitFlow(max_batch=4)
    assert flow.request() == SplitRequest(0, 1, 0, first=True)  # says it received 0
    flow.waiting(reply_ready=False)  # the source waited on the dispatcher: ask for more
    assert flow.on_reply([0], end_of_splits=False) is True  # ask for the next batch now
    assert flow.request() == SplitRequest(0, 2, 1)  # a retry would say 1 was received
    assert flow.next_index() == 0 and not flow.has_local()
    flow.waiting(reply_ready=True)  # the prefetched reply was there: no growth
    assert flow.request().count == 2
    for _ in range(3):
        flow.waiting(reply_ready=False)
    assert flow.batch == 4  # capped
    assert flow.on_reply([1, 2], end_of_splits=True) is False  # no more: nothing to ask
    assert [flow.next_index(), flow.next_index()] == [1, 2] and flow.ended


def test_a_tasks_first_split_comes_with_it():
    """issue 25: a DYNAMIC task pushed as its iteration starts carries its first split; the
    task asks ahead for the next at once, and that first request says it received one."""
    flow = SplitFlow(max_batch=4)
    assert flow.start({"task_id": 1}) is False and not flow.has_local()  # none came
    flow = SplitFlow(max_batch=4)
    assert flow.start({"first_splits": [[5], False]}) is True  # ask ahead now
    assert flow.request() == SplitRequest(0, 1, 1, first=True)
    assert flow.next_index() == 5
    flow = SplitFlow(max_batch=4)
    assert flow.start({"first_splits": [[0], True]}) is False  # the only split
    assert flow.next_index() == 0 and flow.ended


def test_a_repetition_two_back_is_acknowledged():
    flow = SplitFlow(max_batch=8)
    flow.on_reply([0, 1], end_of_splits=True)
    assert flow.reset() is None  # repetition 1 starts: 0 may still be in the pipeline
    assert (flow.repetition, flow.received, flow.ended) == (1, 0, False)
    assert flow.reset() == 0  # repetition 2: repetition 0 has left the pipeline
    assert flow.reset() == 1


# -- coordinated reads -------------------------------------------------------------------------
def test_rounds_go_to_their_consumers_and_are_dropped_once_read():
    rounds = Rounds(num_consumers=2, max_ahead=2)
    assert rounds.must_form(0)
    rounds.formed(["a0", "a1"])
    assert not rounds.must_form(0) and rounds.must_form(1)
    assert rounds.take(0, 1) == ("a1", False)
    assert rounds.laggards() == [0]
    rounds.formed(["b0", "b1"])
    assert rounds.too_far_ahead(2)  # consumer 1 may not run 2 rounds ahead of round 0
    assert rounds.take(0, 0) == ("a0", True)  # round 0 fully read: the oldest moves on
    assert rounds.oldest == 1 and not rounds.too_far_ahead(2)
    assert "already served to every consumer" in rounds.out_of_step(0, 1)
    assert rounds.out_of_step(1, 1) is None


# -- the cross-trainer cache -------------------------------------------------------------------
from dask_dataservice.service.worker.core import TrainerCursors  # noqa: E402


def test_trainer_positions_follow_the_fastest_and_a_slow_one_skips_ahead():
    pos = TrainerCursors(lookahead=4)
    assert pos.has_demand(cached=0, cached_bytes=0, max_bytes=800, chunk=1)
    assert pos.start("fast") == 0 and pos.start("slow") == 0
    pos.took("fast", 0, 3)
    pos.took("slow", 0, 1)
    # 5 cached: the fastest trainer (at 3) has 2 ahead of it: produce
    assert pos.has_demand(cached=5, cached_bytes=40, max_bytes=800, chunk=1)
    assert not pos.has_demand(cached=7, cached_bytes=56, max_bytes=800, chunk=1)  # 4 ahead
    # ... nor past half the window's bytes
    assert not pos.has_demand(cached=5, cached_bytes=1000, max_bytes=800, chunk=1)
    pos.evicted(2)  # elements 0 and 1 left the window
    assert pos.start("slow") == 0 and pos.skipped == 1  # it was at 1: skips to 2
    assert pos.start("fast") == 1  # element 3 is at offset 1
    assert pos.start("new") == 0  # a new trainer starts at the oldest element cached


def test_the_core_imports_no_dask_no_asyncio_no_threads():
    """Sans-I/O: the module (at any level) imports nothing that does I/O or schedules."""
    import ast
    import inspect

    from dask_dataservice.service.worker import core as _worker_core

    tree = ast.parse(inspect.getsource(_worker_core))
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    forbidden = {"asyncio", "threading", "concurrent", "distributed", "dask", "tornado"}
    assert not {n for n in names if n.split(".")[0] in forbidden}, names
    assert names <= {"__future__", "dataclasses", "collections", "collections.abc", "typing",
                     "protocol._messages"}, names


def test_heartbeats_back_off_while_no_dispatcher_answers():
    from dask_dataservice.service.worker.core import heartbeat_delay

    assert heartbeat_delay(True, 8.0, 1.0) == 1.0
    assert [heartbeat_delay(False, d, 1.0) for d in (1.0, 2.0, 16.0, 30.0)] == [
        2.0, 4.0, 30.0, 30.0]
