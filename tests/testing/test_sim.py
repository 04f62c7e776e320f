"""The deterministic simulator (dask_dataservice/testing/sim) over the real dispatcher, worker
and reader cores.

Pure: no cluster, no thread. Each seed builds a scenario (workload, sizes, faults) and runs
it on a virtual clock; a failure names its seed, its replay command and a shrunk scenario.
"""

from __future__ import annotations

import pytest

from dask_dataservice.errors import TaskNotFoundError
from dask_dataservice.service.client import reader_core
from dask_dataservice.service.dispatcher import _handout, _split_order
from dask_dataservice.service.dispatcher import core as dispatcher_core
from dask_dataservice.service.dispatcher.core import DispatcherCore
from dask_dataservice.service.worker import core as worker_core
from dask_dataservice.testing.sim import (
    WORKLOADS,
    Params,
    check_seeds,
    generate,
    replay_command,
    run_scenario,
    run_seed,
    shrink,
)

pytestmark = [pytest.mark.pure, pytest.mark.timeout(300)]

#: Seeds per workload in CI: 4,100 scenarios in all (fewer of the slowest, repeat and
#: cross-trainer: about 50 and 40 scenarios/s, the others 100-280).
SEEDS = {"dynamic": 1000, "off": 500, "named": 250, "named-off": 250, "static-data": 250,
         "static-file": 250, "repeat": 200, "coordinated": 250, "cross-trainer": 150,
         "cross-trainer-off": 250, "locality": 250, "retire": 250, "autocache": 250}


def test_the_seeded_workloads_are_every_workload():
    assert set(SEEDS) == set(WORKLOADS)
    assert sum(SEEDS.values()) >= 2000


@pytest.mark.slow
@pytest.mark.parametrize("workload", sorted(SEEDS))
def test_simulator_seeds(workload):
    """Every invariant checked after every step of ``SEEDS[workload]`` seeded scenarios, at
    least 2,000 over the workloads (about 30 s in all on the 2-core machine, quiet; one test
    per workload, so that the suite's two processes share them; the time is not asserted: a
    loaded machine is slower, not wrong)."""
    count, _, failed = check_seeds(range(SEEDS[workload]), [workload])
    assert not failed, "\n".join(failed)
    assert count == SEEDS[workload]


def test_a_seed_replays_bit_for_bit():
    for workload in ("dynamic", "named", "repeat", "coordinated", "cross-trainer",
                     "cross-trainer-off", "locality"):
        seed = next(s for s in range(100) if generate(s, workload).faults)
        a, b = run_seed(seed, workload), run_seed(seed, workload)
        assert a.trace == b.trace and a.steps == b.steps and a.virtual_time == b.virtual_time


def test_faults_are_drawn():
    kinds = {f[1] for s in range(200) for f in generate(s, "dynamic").faults}
    assert kinds == {"kill_dispatcher", "freeze_dispatcher", "kill_worker", "freeze_worker",
                     "join_worker", "leave_worker", "partition"}


def test_a_failure_is_shrunk_and_replayable():
    """A scenario that cannot end in time fails with 'no end'; shrinking keeps that failure
    and drops every fault and every extra worker."""
    params = Params(workload="dynamic", num_splits=12, per_split=3, n_workers=3,
                    faults=[[0.01, "freeze_worker", 0, 0.5], [0.02, "partition", 1, 0.3]],
                    horizon=0.05)
    result = run_scenario(7, params)
    assert result.failure is not None and "no end within 0.05s" in result.failure
    small = shrink(result)
    assert "no end within 0.05s" in (small.failure or "")
    assert small.params.faults == [] and small.params.n_workers == 1
    assert replay_command(7, "dynamic", small.params).startswith(
        "python -m dask_dataservice.testing.sim --seed 7 --workload dynamic --scenario '")


def _running_only(iteration, job):  # the hand-out before OFF workers joining mid-read
    return iteration.status == "running"


def _all_to_one(left, active, repetition=0):  # the hand-out before 533ed4f: as many as asked
    return left


def _no_hand_out_when_revived(self, address, *, had=None):  # before 9b8eb4b
    if had is None:  # a joining worker (a revived one passes what it had)
        _HAND_OUT(self, address)


_HAND_OUT = DispatcherCore._hand_out


def _keep_every_reply(self, key, seq, has_elements):  # before keep_reply: every reply kept
    return True


_ReaderCore = reader_core.ReaderCore
_TURN_REPLY = reader_core.turn_reply


def _unknown_is_nothing(reply):  # before turn_reply: "unknown" was asked again for ever
    kind = _TURN_REPLY(reply)
    return "nothing" if kind == "unknown" else kind


def _bytes_bound_starves_the_lead(self, cached, cached_bytes, max_bytes, chunk):
    # before issue 22 (item 4): a lead that had read the whole window got no production
    # when a chunk's bytes were more than half the window
    ahead = self.base + cached - self.lead()
    if ahead >= self.lookahead:
        return False
    return not cached or (ahead + chunk) * cached_bytes / cached <= max_bytes / 2


_DRAIN = DispatcherCore.drain_worker


def _drain_the_index_only(self, address, held=()):  # issue 26, before the worker's tasks
    return _DRAIN(self, address, ())


@dispatcher_core._stimulus
def _cache_reports_of_anyone(self, task_id, indices, job_token=None):  # issue 26, before
    """``autocached`` before it checked the reporting worker was still registered: a worker
    dropped meanwhile (frozen) had its caches kept, and splits were handed out by them."""
    try:
        self._check_task_token(task_id, job_token, "reporting cached splits")
        task = self.state.task(task_id)
    except TaskNotFoundError:
        return {"status": "OK"}
    dataset = self.state.job(self.state.iteration(task.iteration_id).job_id).dataset_id
    self.hints.cached.add(dataset, task.worker_address, indices)
    return {"status": "OK"}


#: Past fixes (dispatcher, reader and worker cores), reintroduced one at a time: the seeds that catch each one.
PAST_BUGS = [
    # a retried split request whose reply was lost got new splits; the lost reply's stayed
    # in flight on a live task and were never read (the undelivered tail, issue 11 s1)
    ("handout:undelivered", lambda s, i, t, r, n: None, "dynamic", 33, "were lost, but their splits"),
    ("handout:undelivered", lambda s, i, t, r, n: None, "named", 9, "were lost, but their splits"),
    # a worker added or restarted mid-read of an OFF iteration whose tasks had finished got
    # no task: its copy was missing (DispatcherCore._serves)
    ("DispatcherCore._serves", staticmethod(_running_only), "off", 42, "has no task"),
    ("DispatcherCore._serves", staticmethod(_running_only), "named-off", 71, "has no task"),
    # 533ed4f: a task asking for up to 1,024 splits took nearly all of them while others were
    # active (a worker killed then held none)
    ("handout:fair_share", _all_to_one, "dynamic", 9, "splits left while"),
    ("handout:fair_share", _all_to_one, "named", 5, "splits left while"),
    # 9b8eb4b: a worker revived after a dispatcher restart got no task of the iterations
    # created while it was away (a reader that started during the outage waited forever)
    ("DispatcherCore._hand_out", _no_hand_out_when_revived, "dynamic", 84, "no end within"),
    ("DispatcherCore._hand_out", _no_hand_out_when_revived, "off", 267, "no end within"),
    # the reader core (issue 21): a task finished, then its worker restarted before this
    # reader got its end of sequence; the restarted worker says "unknown" for ever and a
    # reader that ends only a LOST task's read on "unknown" polled it for ever
    ("reader_core:ReaderCore.is_gone", _ReaderCore.is_lost, "named", 59, "no end within"),
    ("reader_core:ReaderCore.is_gone", _ReaderCore.is_lost, "static-file", 44,
     "no end within"),
    # the worker core (issue 21): a reply without elements ("unknown": the task had not
    # arrived yet) was kept for a request sent again; replayed after the task finished, the
    # reader took it as the end of a finished task its worker does not know: elements lost
    ("worker_core:WorkerCore.keep_reply", _keep_every_reply, "dynamic", 487,
     "were lost, but their splits"),
    ("worker_core:WorkerCore.keep_reply", _keep_every_reply, "off", 159,
     "finished but its copy"),
    # the cross-trainer turn reader (issue 21): a worker that never got its task (it was
    # partitioned from the dispatcher, which then dropped it) answers "unknown"; the reader
    # asked it again for ever, though the dispatcher had declared the task lost
    ("reader_core:turn_reply", _unknown_is_nothing, "cross-trainer", 7, "no end within"),
    # the cross-trainer window (issue 22, item 4): a window holding at most one producer's
    # chunk was never produced into again once its fastest trainer had read it all: every
    # trainer waited for ever
    ("worker_core:TrainerCursors.has_demand", _bytes_bound_starves_the_lead, "cross-trainer",
     2, "asks the pipeline for nothing"),
    ("worker_core:TrainerCursors.has_demand", _bytes_bound_starves_the_lead,
     "cross-trainer-off", 4, "asks the pipeline for nothing"),
    # the locality hand-out (issue 21): a lost get_split reply that ended a repetition of an
    # explicit split order was asked again once the order was forgotten: its splits were
    # lost on a live worker (the last ended repetition's order is kept now)
    ("split_order:ended_split_at", lambda s, i, r, p: None, "locality", 6,
     "were lost, but their splits"),
    ("split_order:ended_split_at", lambda s, i, r, p: None, "locality", 19,
     "were lost, but their splits"),
    # issue 26: a retiring worker's task that had made all its splits (so gone from the
    # dispatcher's index of its tasks) was not waited for: the elements still in its
    # buffer were lost with the worker
    ("DispatcherCore.drain_worker", _drain_the_index_only, "retire", 35, "never delivered"),
    ("DispatcherCore.drain_worker", _drain_the_index_only, "retire", 159, "never delivered"),
    # issue 26: cached splits reported by a worker the dispatcher had dropped were kept
    ("DispatcherCore.autocached", _cache_reports_of_anyone, "autocache", 129,
     "left but its caches are kept"),
]


@pytest.mark.parametrize(("target", "old", "workload", "seed", "message"), PAST_BUGS)
def test_the_simulator_finds_past_bugs(monkeypatch, target, old, workload, seed, message):
    """Each past fix, reverted in the real core, makes its seed fail (and only then).
    ``target``: ``[module:]Owner.name`` (module: the dispatcher core unless named)."""
    assert run_seed(seed, workload).failure is None
    module_name, _, path = target.rpartition(":")
    module = {"": dispatcher_core, "reader_core": reader_core, "handout": _handout,
              "worker_core": worker_core, "split_order": _split_order}[module_name]
    owner, _, name = path.rpartition(".")
    monkeypatch.setattr(getattr(module, owner) if owner else module, name, old)
    failure = run_seed(seed, workload).failure
    assert failure is not None and message in failure, failure


def _copies(run):
    """OFF: how many elements of each task's copy reached the consumers."""
    out: dict[int, set[int]] = {}
    for task_id, i in run.seen:
        out.setdefault(task_id, set()).add(i)
    return {task_id: len(got) for task_id, got in sorted(out.items())}


def _scenario(params, seed=1):
    from dask_dataservice.testing.sim._scenario import Run

    run = Run(seed, params)
    result = run.run()
    assert result.failure is None, result.failure
    return run


def test_add_worker_mid_job_off():
    """fault_tolerance_test.testAddWorkerMidJob at the dispatcher level: a worker added after
    part of an OFF read produces its own full copy (two full copies of range(100) in all)."""
    run = _scenario(Params(workload="off", num_splits=50, per_split=2, n_workers=1, fetch=1,
                           buffer=2, faults=[[0.3, "join_worker", 0, 0.0]]))
    assert _copies(run) == {4000: 100, 4001: 100}


def test_restart_worker_off():
    """fault_tolerance_test.testRestartWorker at the dispatcher level: the only worker
    restarts mid-read; the read goes on with the restarted worker's elements from 0 (its new
    task's full copy), after the part of the first copy read before the restart."""
    run = _scenario(Params(workload="off", num_splits=50, per_split=2, n_workers=1, fetch=1,
                           buffer=2, faults=[[0.3, "kill_worker", 0, 0.2]]))
    copies = _copies(run)
    assert list(copies) == [4000, 4001] and copies[4001] == 100 and 0 < copies[4000] < 100


def test_shared_job_name():
    """data_service_ops_test.testSharedJobName at the dispatcher level: two consumers of one
    named DYNAMIC job both make progress and together read range(100) exactly once."""
    run = _scenario(Params(workload="named", num_splits=50, per_split=2, n_workers=2,
                           n_consumers=2, fetch=1, buffer=2))
    assert sorted(run.seen) == list(range(100))
    assert all(c.received for c in run.consumers)
    assert sorted(e for c in run.consumers for e in c.received) == list(range(100))


def test_locality_a_lost_reply_that_ended_a_repetition_is_answered_again():
    """A dataset with a locality hint (a persisted Dask collection), no fault but 5 % of
    messages lost: task 4000's ``get_split`` reply handing out split 3 and the end of the
    repetition is lost; its retry (``received=1``) reaches a dispatcher whose cursor has
    moved to the next repetition. ``dispatcher._handout.undelivered`` maps the positions back to
    splits with the last ended repetition's explicit order (``_split_order.ended_split_at``);
    before, it answered none and split 3's elements were lost on a live worker."""
    params = Params(workload="locality", num_splits=4, per_split=4, n_workers=4,
                    n_consumers=2, drop=0.05, buffer=2, fetch=16, split_batch=1)
    result = run_scenario(259, params)
    assert result.failure is None, result.failure
def _kill_dispatcher_mid_read(params, at):
    """Run ``params`` with the dispatcher killed at virtual time ``at`` (its journal kept,
    folded into a snapshot every 8 records) and restarted 0.5 s later; check the kill landed
    mid-read and the restart replayed the journal."""
    from dask_dataservice.testing.sim._scenario import Run

    params.faults = [[at, "kill_dispatcher", 0, 0.5]]
    params.snapshot_every = 8
    run = Run(1, params)
    seen_at_kill: list[int] = []
    run.world.at(at, lambda: seen_at_kill.append(len(run.seen)))
    result = run.run()
    assert result.failure is None, result.failure
    assert run.dispatcher.restarts == 1 and run.dispatcher.snapshot is not None
    assert 0 < seen_at_kill[0] < params.num_elements, seen_at_kill
    return run


def test_kill_dispatcher_mid_epoch_dynamic():
    """The scheduler killed (kill -9) mid-epoch of a DYNAMIC read and restarted from its
    journal: the one reader (one request in flight) gets every element of range(200) exactly
    once, as without the kill (real-process test: tests/service/test_invisible_restart.py's
    test_sigkill_scheduler_readers_lose_nothing)."""
    run = _kill_dispatcher_mid_read(Params(workload="dynamic", num_splits=40, per_split=5,
                                           n_workers=2, fetch=1, buffer=8), 0.3)
    assert sorted(run.consumers[0].received) == list(range(200))


def test_kill_dispatcher_named_job_two_consumers():
    """Two consumers of one named DYNAMIC job, the scheduler killed mid-epoch and restarted
    from its journal: between them every element of range(200) exactly once, both read on,
    and the job is still one job (real-process test: test_invisible_restart.py's
    test_sigkill_scheduler_named_job_two_consumers_lose_nothing)."""
    run = _kill_dispatcher_mid_read(Params(workload="named", num_splits=40, per_split=5,
                                           n_workers=2, n_consumers=2, fetch=1, buffer=8), 0.3)
    got = [e for c in run.consumers for e in c.received]
    assert sorted(got) == list(range(200))
    assert all(c.received for c in run.consumers)
    assert len(run.dispatcher.core.state.list_jobs()) == 1


def test_frozen_worker_dropped_by_heartbeat_deadline():
    """A data worker frozen (SIGSTOP) mid-read for longer than the dispatcher's heartbeat
    deadline (3 s > ``worker_timeout`` 2 s) of a DYNAMIC read of range(1000) over two workers:
    the dispatcher drops it, the read ends on the other worker with no element twice, and
    every missing element is of a split recorded lost; thawed, the victim has its old task
    cancelled, not served (the real-process test of a frozen worker, detected through the
    consumer's request timeout and the dispatcher's probe, which this simulator does not
    model, is tests/service/test_frozen_workers.py)."""
    from dask_dataservice.testing.sim._scenario import Run, worker_address

    params = Params(workload="dynamic", num_splits=100, per_split=10, n_workers=2, fetch=1,
                    buffer=8, faults=[[0.3, "freeze_worker", 0, 3.0]])
    run = Run(1, params)
    victim = worker_address(0)
    held: list[int] = []
    run.world.at(0.3, lambda: held.extend(
        t.task_id for t in run.dispatcher.core.state.tasks_for_worker(victim)))
    result = run.run()
    assert result.failure is None, result.failure
    assert result.virtual_time > 0.3 + 3.0, "the read went on after the thaw"
    (old_task,) = held
    state = run.dispatcher_state()
    (iteration,) = state.list_iterations()
    lost = {i for _, i in state.lost_splits(iteration.iteration_id)}
    missing = set(range(1000)) - run.seen
    assert missing and {e // 10 for e in missing} <= lost
    assert old_task not in run.workers[victim].runners
