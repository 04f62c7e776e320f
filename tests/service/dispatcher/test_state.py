"""Pure tests of :mod:`dask_dataservice.service.dispatcher.state`: no cluster, no I/O, no sleeps.

Small helpers build one update each and apply it (like TensorFlow's dispatcher_state_test);
tests then check the accessors. Illegal updates must raise a typed error and leave
``snapshot()`` unchanged. A hypothesis state machine checks that replaying the encoded
journal always rebuilds an equal state.
"""

from __future__ import annotations

import dataclasses
import pickle

import msgpack
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from dask_dataservice.errors import (
    DataServiceError,
    DatasetNotFoundError,
    IllegalUpdateError,
    IterationClientNotFoundError,
    IterationNotFoundError,
    JobNameInUseError,
    JobNotFoundError,
    StaleEpochError,
    TaskNotFoundError,
    WorkerNotFoundError,
)
from dask_dataservice.service.dispatcher._state_codec import decode_state, encode_state
from dask_dataservice.service.dispatcher.state import (
    DATASET_ACCEPTS,
    ITERATION_ACCEPTS,
    JOB_ACCEPTS,
    TASK_TRANSITIONS,
    UPDATE_TYPES,
    WORKER_ACCEPTS,
    AckSplits,
    AcquireIterationClient,
    ClientHeartbeat,
    CreateIteration,
    CreateJob,
    CreateTask,
    DispatcherState,
    FinishTask,
    GarbageCollectDataset,
    GarbageCollectIteration,
    GarbageCollectJob,
    ProduceSplit,
    ProduceSplits,
    RegisterDataset,
    RegisterWorker,
    ReleaseIterationClient,
    RemoveWorker,
    decode_update,
    encode_update,
    replay,
)

pytestmark = pytest.mark.pure

W1 = "tcp://10.0.0.1:4001"
W2 = "tcp://10.0.0.2:4002"


@pytest.fixture
def state():
    """An empty DispatcherState, validated after the test."""
    state = DispatcherState()
    yield state
    state.validate_state()


# -- helpers: build one update, apply it, return the new id ------------------------------------


def register_dataset(state, fingerprint="fp", num_splits=3, **kwargs):
    dataset_id = state.next_dataset_id()
    state.apply(
        RegisterDataset(
            dataset_id=dataset_id,
            fingerprint=fingerprint,
            pipeline=b"pickled-pipeline",
            splits=b"split-blob",
            num_splits=num_splits,
            **kwargs,
        )
    )
    return dataset_id


def register_worker(state, address=W1, host="10.0.0.1"):
    state.apply(RegisterWorker(address=address, host=host, nthreads=2))
    return address


def create_job(state, dataset_id, job_name=None, processing_mode="OFF", **kwargs):
    job_id = state.next_job_id()
    state.apply(
        CreateJob(
            job_id=job_id,
            job_name=job_name,
            dataset_id=dataset_id,
            processing_mode=processing_mode,
            **kwargs,
        )
    )
    return job_id


def create_iteration(state, job_id, repetition=0):
    iteration_id = state.next_iteration_id()
    state.apply(CreateIteration(iteration_id=iteration_id, job_id=job_id, repetition=repetition))
    return iteration_id


def create_task(state, iteration_id, address=W1):
    task_id = state.next_task_id()
    state.apply(CreateTask(task_id=task_id, iteration_id=iteration_id, worker_address=address))
    return task_id


def produce_split(state, iteration_id, task_id):
    """Apply the one legal ProduceSplit for this task; return ``(repetition, index, finished)``."""
    cursor = state.split_cursor(iteration_id)
    finished = cursor.next_index == cursor.num_splits
    state.apply(
        ProduceSplit(
            iteration_id=iteration_id,
            repetition=cursor.repetition,
            index=cursor.next_index,
            task_id=task_id,
            finished=finished,
        )
    )
    return cursor.repetition, cursor.next_index, finished


def acquire_client(state, iteration_id, time_micros=0):
    client_id = state.next_iteration_client_id()
    state.apply(
        AcquireIterationClient(
            iteration_client_id=client_id, iteration_id=iteration_id, time_micros=time_micros
        )
    )
    return client_id


def dynamic_iteration(state, num_splits=3, workers=(W1,)):
    """A DYNAMIC iteration with one task per worker; returns ``(iteration_id, task_ids)``."""
    for address in workers:
        register_worker(state, address)
    dataset_id = register_dataset(state, num_splits=num_splits)
    job_id = create_job(state, dataset_id, processing_mode="DYNAMIC")
    iteration_id = create_iteration(state, job_id)
    return iteration_id, [create_task(state, iteration_id, address) for address in workers]


def assert_refused(state, update, error, message=None):
    """``update`` raises ``error`` (with exactly ``message``) and changes nothing."""
    before = state.snapshot()
    with pytest.raises(error) as info:
        state.check(update)
    assert state.snapshot() == before
    with pytest.raises(error) as info:
        state.apply(update)
    assert state.snapshot() == before
    if message is not None:
        assert str(info.value) == message
    return info.value


# -- the error vocabulary ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls, builtin",
    [
        (DatasetNotFoundError, KeyError),
        (JobNotFoundError, KeyError),
        (IterationNotFoundError, KeyError),
        (IterationClientNotFoundError, KeyError),
        (TaskNotFoundError, KeyError),
        (WorkerNotFoundError, KeyError),
        (JobNameInUseError, ValueError),
        (IllegalUpdateError, RuntimeError),
        (StaleEpochError, RuntimeError),
    ],
)
def test_errors_match_builtins_and_read_plainly(cls, builtin):
    error = cls("Job 5000 not found")
    assert isinstance(error, DataServiceError)
    assert isinstance(error, builtin)
    assert str(error) == "Job 5000 not found"  # not "'Job 5000 not found'" as KeyError would
    restored = pickle.loads(pickle.dumps(error))
    assert type(restored) is cls and str(restored) == "Job 5000 not found"


# -- ids and empty state ------------------------------------------------------------------------


def test_fresh_state_counters_start_at_distinct_bases(state):
    assert (
        state.next_dataset_id(),
        state.next_iteration_id(),
        state.next_iteration_client_id(),
        state.next_task_id(),
        state.next_job_id(),
    ) == (1000, 2000, 3000, 4000, 5000)
    assert state.list_datasets() == state.list_jobs() == state.list_workers() == []
    assert state == DispatcherState()
    assert repr(state) == (
        "<DispatcherState: 0 datasets, 0 workers, 0 named jobs, 0 iterations, 0 tasks, 0 clients>"
    )


def test_ids_in_records_move_counters_and_are_never_reused(state):
    state.apply(
        RegisterDataset(dataset_id=1007, fingerprint="f", pipeline=b"", splits=b"", num_splits=-1)
    )
    assert state.next_dataset_id() == 1008
    assert_refused(
        state,
        RegisterDataset(dataset_id=1007, fingerprint="g", pipeline=b"", splits=b"", num_splits=-1),
        IllegalUpdateError,
        "RegisterDataset: dataset id 1007 is not fresh (the next dataset id is 1008)",
    )
    assert_refused(
        state,
        CreateJob(job_id=17, job_name=None, dataset_id=1007, processing_mode="OFF"),
        IllegalUpdateError,
        "CreateJob: job id 17 is not fresh (the next job id is 5000)",
    )


# -- datasets ---------------------------------------------------------------------------------


def test_register_dataset(state):
    dataset_id = register_dataset(
        state, "fp1", num_splits=4, element_spec=b"spec", metadata={"k": [1, 2]}, compression="AUTO"
    )
    dataset = state.dataset(dataset_id)
    assert (dataset.dataset_id, dataset.fingerprint, dataset.num_splits) == (1000, "fp1", 4)
    assert (dataset.pipeline, dataset.splits, dataset.element_spec) == (
        b"pickled-pipeline",
        b"split-blob",
        b"spec",
    )
    assert dataset.metadata == {"k": [1, 2]} and dataset.compression == "AUTO"
    assert dataset.splittable
    assert state.dataset_by_fingerprint("fp1") == dataset
    assert state.list_datasets() == [dataset]


def test_accessors_return_detached_copies(state):
    dataset_id = register_dataset(state, metadata={"k": [1]})
    register_worker(state)
    before = state.snapshot()
    dataset = state.dataset(dataset_id)
    dataset.metadata["k"].append(2)
    dataset.num_splits = 99
    worker = state.worker(W1)
    worker.resources["ps"] = 1.0
    worker.registered = False
    assert state.snapshot() == before
    assert state.dataset(dataset_id).metadata == {"k": [1]}


def test_same_fingerprint_is_refused(state):
    register_dataset(state, "fp")
    assert_refused(
        state,
        RegisterDataset(
            dataset_id=state.next_dataset_id(),
            fingerprint="fp",
            pipeline=b"",
            splits=b"",
            num_splits=1,
        ),
        IllegalUpdateError,
        "RegisterDataset: fingerprint 'fp' is already registered as dataset 1000",
    )


def test_bad_num_splits_is_refused(state):
    assert_refused(
        state,
        RegisterDataset(dataset_id=1000, fingerprint="f", pipeline=b"", splits=b"", num_splits=-2),
        IllegalUpdateError,
        "RegisterDataset: num_splits must be >= 0, or -1 if not splittable; got -2",
    )


def test_unknown_dataset_errors(state):
    with pytest.raises(DatasetNotFoundError) as info:
        state.dataset(1000)
    assert str(info.value) == "Dataset 1000 not found"
    with pytest.raises(KeyError) as info:
        state.dataset_by_fingerprint("nope")
    assert str(info.value) == "Dataset with fingerprint 'nope' not found"


def test_metadata_is_normalised_to_plain_data():
    update = RegisterDataset(
        dataset_id=1000,
        fingerprint="f",
        pipeline=b"",
        splits=b"",
        num_splits=0,
        metadata={"shape": (2, 3), "nested": {"t": (1,)}},
    )
    assert update.metadata == {"shape": [2, 3], "nested": {"t": [1]}}
    assert decode_update(encode_update(update)) == update
    with pytest.raises(TypeError, match="must be plain data"):
        RegisterDataset(
            dataset_id=1000,
            fingerprint="f",
            pipeline=b"",
            splits=b"",
            num_splits=0,
            metadata={"s": {1, 2}},
        )
    with pytest.raises(TypeError, match="must have str keys"):
        RegisterDataset(
            dataset_id=1000,
            fingerprint="f",
            pipeline=b"",
            splits=b"",
            num_splits=0,
            metadata={1: "x"},
        )


# -- workers ----------------------------------------------------------------------------------


def test_register_remove_and_reregister_worker(state):
    state.apply(RegisterWorker(address=W1, host="h1", nthreads=4, resources={"gpu": 1}, tags=["a"]))
    worker = state.worker(W1)
    assert (worker.host, worker.nthreads, worker.resources, worker.tags) == (
        "h1",
        4,
        {"gpu": 1.0},
        ("a",),
    )
    assert worker.registered and worker.status == "registered"
    task_id = create_task(state, create_iteration(state, create_job(state, register_dataset(state))))
    state.apply(RemoveWorker(address=W1))
    # its lost task still names it: a departed worker stays known
    assert state.worker(W1).registered is False and state.worker(W1).num_tasks == 1
    assert state.list_workers() == []
    assert [w.address for w in state.list_workers(include_departed=True)] == [W1]
    assert state.tasks_for_worker(W1) == []
    state.apply(RegisterWorker(address=W1, host="h1b", nthreads=1))
    assert state.worker(W1).registered and state.worker(W1).host == "h1b"
    assert state.worker(W1).num_tasks == 1 and state.task(task_id).status == "lost"


def test_departed_workers_are_forgotten_once_no_task_names_them(state):
    """Worker churn does not grow the state (issue 10, finding 8)."""
    iteration_id = create_iteration(state, create_job(state, register_dataset(state)))
    for i in range(50):  # 50 short-lived workers, each with a task of the same iteration
        address = register_worker(state, f"tcp://churn:{i}")
        create_task(state, iteration_id, address)
        state.apply(RemoveWorker(address))
    register_worker(state, "tcp://idle:1")
    state.apply(RemoveWorker("tcp://idle:1"))  # no task: forgotten at once
    assert len(state.list_workers(include_departed=True)) == 50
    assert_refused(state, RemoveWorker("tcp://idle:1"), WorkerNotFoundError)
    state.apply(GarbageCollectIteration(iteration_id))
    assert state.list_workers(include_departed=True) == []
    assert state.snapshot()["workers"] == {} and state.snapshot()["tasks_by_worker"] == {}
    # and the worker may come back as a new one
    register_worker(state, "tcp://churn:0")
    assert state.worker("tcp://churn:0").num_tasks == 0


def test_live_iterations_leave_out_the_collected_ones(state):
    job_id = create_job(state, register_dataset(state), job_name="n")
    first = create_iteration(state, job_id, 0)
    second = create_iteration(state, job_id, 1)
    state.apply(GarbageCollectIteration(first))
    assert [i.iteration_id for i in state.list_iterations()] == [first, second]
    assert [i.iteration_id for i in state.list_live_iterations()] == [second]


def test_illegal_worker_updates(state):
    assert_refused(
        state,
        RemoveWorker(address=W1),
        WorkerNotFoundError,
        f"Worker {W1!r} not found",
    )
    register_worker(state)
    assert_refused(
        state,
        RegisterWorker(address=W1, host="h", nthreads=1),
        IllegalUpdateError,
        f"RegisterWorker: worker {W1!r} is registered",
    )
    create_task(state, create_iteration(state, create_job(state, register_dataset(state))))
    state.apply(RemoveWorker(address=W1))
    assert_refused(
        state,
        RemoveWorker(address=W1),
        IllegalUpdateError,
        f"RemoveWorker: worker {W1!r} is departed",
    )


# -- jobs -------------------------------------------------------------------------------------


def test_create_named_and_anonymous_jobs(state):
    dataset_id = register_dataset(state)
    named = create_job(
        state,
        dataset_id,
        job_name="shared",
        processing_mode="DYNAMIC",
        num_consumers=2,
        target_workers="ANY",
        cross_trainer_cache=True,
    )
    anonymous = create_job(state, dataset_id)
    job = state.job_by_name("shared")
    assert job.job_id == named == 5000
    assert (
        job.processing_mode,
        job.num_consumers,
        job.target_workers,
        job.cross_trainer_cache,
    ) == (
        "DYNAMIC",
        2,
        "ANY",
        True,
    )
    assert state.job(anonymous).job_name is None and anonymous == 5001
    assert [j.job_id for j in state.list_jobs()] == [5000, 5001]
    assert state.job(named).status == "live"


def test_job_name_in_use(state):
    dataset_id = register_dataset(state)
    create_job(state, dataset_id, job_name="shared")
    error = assert_refused(
        state,
        CreateJob(job_id=5001, job_name="shared", dataset_id=dataset_id, processing_mode="OFF"),
        JobNameInUseError,
        "Job name 'shared' is in use by job 5000 of dataset 1000",
    )
    assert isinstance(error, ValueError)


def test_named_datasets_are_indexed_by_name_not_fingerprint(state):
    """A user-chosen dataset id (issue 9, 2.2): same pipeline under two names, two datasets."""
    first = register_dataset(state, "fp", dataset_name="train")
    second = register_dataset(state, "fp", dataset_name="eval")
    anonymous = register_dataset(state, "fp")
    assert len({first, second, anonymous}) == 3
    assert state.dataset_by_name("train").dataset_id == first
    assert state.dataset_by_fingerprint("fp").dataset_id == anonymous
    assert state.dataset(second).dataset_name == "eval"
    assert_refused(state, RegisterDataset(state.next_dataset_id(), "other", b"p", b"", -1,
                                          dataset_name="train"),
                   IllegalUpdateError, f"RegisterDataset: dataset name 'train' is already "
                   f"dataset {first}")
    with pytest.raises(DatasetNotFoundError, match="Dataset 'test' not found"):
        state.dataset_by_name("test")


def test_job_names_are_scoped_per_dataset(state):
    """Two datasets may each have a job named "shared" (TF; issue 9, 2.1)."""
    first, second = register_dataset(state, "a"), register_dataset(state, "b")
    job_a = create_job(state, first, job_name="shared")
    job_b = create_job(state, second, job_name="shared", processing_mode="DYNAMIC")
    assert job_a != job_b
    assert state.job_by_name("shared", first).job_id == job_a
    assert state.job_by_name("shared", second).job_id == job_b
    with pytest.raises(JobNotFoundError, match="Several datasets have a job named 'shared'"):
        state.job_by_name("shared")
    with pytest.raises(JobNotFoundError, match="Job named 'x' for dataset 1000 not found"):
        state.job_by_name("x", first)
    # collecting one frees only its own name
    iteration_id = create_iteration(state, job_a)
    state.apply(GarbageCollectIteration(iteration_id))
    assert state.job_by_name("shared").job_id == job_b


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"processing_mode": "distributed_epoch"}, "processing_mode must be one of"),
        ({"target_workers": "SOME"}, "target_workers must be one of"),
        ({"dataset_id": 1001, "processing_mode": "DYNAMIC"}, "DYNAMIC sharding needs splits"),
        ({"job_name": "j", "num_consumers": 0}, "num_consumers must be >= 1 or None, got 0"),
        ({"num_consumers": 2}, "coordinated reads (num_consumers) need a job_name"),
        ({"cross_trainer_cache": True}, "cross_trainer_cache needs a job_name"),
        ({"job_name": ""}, "job_name must be a non-empty string or None"),
        ({"job_name": "j", "num_consumers": 2, "target_workers": "LOCAL"},
         "coordinated reads (num_consumers) cannot use target_workers LOCAL"),
        ({"processing_mode": "DATA", "worker_addresses": ("w",), "target_workers": "ANY"},
         "static sharding (DATA) cannot use target_workers ANY"),
    ],
)
def test_illegal_create_job(state, changes, message):
    register_dataset(state, "splittable", num_splits=2)
    register_dataset(state, "not-splittable", num_splits=-1)
    fields = dict(job_id=5000, job_name=None, dataset_id=1000, processing_mode="OFF")
    error = assert_refused(state, CreateJob(**(fields | changes)), IllegalUpdateError)
    assert str(error).startswith("CreateJob: ") and message in str(error)


def test_unknown_job_errors(state):
    with pytest.raises(JobNotFoundError) as info:
        state.job(5000)
    assert str(info.value) == "Job 5000 not found"
    with pytest.raises(JobNotFoundError) as info:
        state.job_by_name("j")
    assert str(info.value) == "Job named 'j' not found"
    assert_refused(
        state,
        CreateJob(job_id=5000, job_name=None, dataset_id=1000, processing_mode="OFF"),
        DatasetNotFoundError,
        "Dataset 1000 not found",
    )


# -- iterations -------------------------------------------------------------------------------


def test_named_job_has_an_iteration_per_repetition(state):
    job_id = create_job(state, register_dataset(state), job_name="shared")
    first = create_iteration(state, job_id, repetition=0)
    second = create_iteration(state, job_id, repetition=1)
    assert (first, second) == (2000, 2001)
    assert state.iteration_by_key(job_id, 1).iteration_id == second
    iteration = state.iteration(first)
    assert (iteration.job_id, iteration.repetition, iteration.status) == (job_id, 0, "running")
    assert (iteration.num_clients, iteration.last_client_released_micros) == (0, None)
    assert state.job(job_id).num_iterations == 2
    assert [i.iteration_id for i in state.list_iterations()] == [first, second]
    assert_refused(
        state,
        CreateIteration(iteration_id=2002, job_id=job_id, repetition=1),
        IllegalUpdateError,
        f"CreateIteration: job {job_id} already has iteration {second} for repetition 1",
    )
    assert_refused(
        state,
        CreateIteration(iteration_id=2002, job_id=job_id, repetition=-1),
        IllegalUpdateError,
        "CreateIteration: repetition must be >= 0, got -1",
    )


def test_anonymous_job_has_exactly_one_iteration(state):
    job_id = create_job(state, register_dataset(state))
    message = (
        f"CreateIteration: anonymous job {job_id} has exactly one iteration, with repetition 0"
    )
    assert_refused(state, CreateIteration(2000, job_id, 1), IllegalUpdateError, message)
    create_iteration(state, job_id)
    assert_refused(state, CreateIteration(2001, job_id, 0), IllegalUpdateError, message)


def test_unknown_iteration_errors(state):
    with pytest.raises(IterationNotFoundError) as info:
        state.iteration(2000)
    assert str(info.value) == "Iteration 2000 not found"
    with pytest.raises(IterationNotFoundError) as info:
        state.iteration_by_key(5000, 0)
    assert str(info.value) == "Iteration of job 5000 for repetition 0 not found"
    assert_refused(state, CreateIteration(2000, 5000), JobNotFoundError, "Job 5000 not found")
    for accessor in (state.tasks_for_iteration, state.lost_splits, state.splits_in_flight):
        with pytest.raises(IterationNotFoundError):
            accessor(2000)


# -- tasks ------------------------------------------------------------------------------------


def test_create_tasks(state):
    register_worker(state, W1)
    register_worker(state, W2)
    iteration_id = create_iteration(state, create_job(state, register_dataset(state)))
    t1 = create_task(state, iteration_id, W1)
    t2 = create_task(state, iteration_id, W2)
    assert (t1, t2) == (4000, 4001)
    assert [t.task_id for t in state.tasks_for_iteration(iteration_id)] == [t1, t2]
    assert [t.task_id for t in state.tasks_for_worker(W2)] == [t2]
    task = state.task(t1)
    assert (task.iteration_id, task.worker_address, task.status) == (iteration_id, W1, "active")
    assert state.iteration(iteration_id).num_tasks == 2
    assert_refused(
        state,
        CreateTask(4002, iteration_id, W1),
        IllegalUpdateError,
        f"CreateTask: worker {W1!r} already runs task {t1} of iteration {iteration_id}",
    )


def test_illegal_create_task(state):
    iteration_id = create_iteration(state, create_job(state, register_dataset(state)))
    assert_refused(
        state, CreateTask(4000, 2001, W1), IterationNotFoundError, "Iteration 2001 not found"
    )
    assert_refused(
        state, CreateTask(4000, iteration_id, W1), WorkerNotFoundError, f"Worker {W1!r} not found"
    )
    register_worker(state)
    other = create_iteration(state, create_job(state, 1000))
    task_id = create_task(state, other, W1)  # keeps W1 known once it departed
    state.apply(RemoveWorker(W1))
    assert_refused(
        state,
        CreateTask(task_id + 1, iteration_id, W1),
        IllegalUpdateError,
        f"CreateTask: worker {W1!r} is departed",
    )


def test_finish_task_finishes_iteration_when_all_tasks_finish(state):
    register_worker(state, W1)
    register_worker(state, W2)
    iteration_id = create_iteration(state, create_job(state, register_dataset(state)))
    t1 = create_task(state, iteration_id, W1)
    t2 = create_task(state, iteration_id, W2)
    state.apply(FinishTask(t1))
    assert state.task(t1).finished and state.tasks_for_worker(W1) == []
    assert state.iteration(iteration_id).finished is False
    state.apply(FinishTask(t2))
    assert state.iteration(iteration_id).status == "finished"
    assert_refused(state, FinishTask(t1), IllegalUpdateError, f"FinishTask: task {t1} is finished")
    assert_refused(state, FinishTask(4999), TaskNotFoundError, "Task 4999 not found")
    # Clients may still join a finished iteration, and a new task (a worker that joins while
    # consumers still read an OFF iteration serves a full repetition) reopens it.
    acquire_client(state, iteration_id)
    register_worker(state, "tcp://late:1")
    state.apply(CreateTask(4002, iteration_id, "tcp://late:1"))
    assert state.iteration(iteration_id).status == "running"
    state.apply(FinishTask(4002))
    assert state.iteration(iteration_id).status == "finished"


# -- static sharding: the worker list and the shard indices are journaled ---------------------


def create_static_iteration(state, workers=("w0", "w1"), processing_mode="DATA"):
    job_id = create_job(state, register_dataset(state), processing_mode=processing_mode,
                        worker_addresses=workers)
    return create_iteration(state, job_id)


def create_shard_task(state, iteration_id, address, shard_index):
    task_id = state.next_task_id()
    state.apply(CreateTask(task_id, iteration_id, address, shard_index))
    return task_id


def test_static_iteration_finishes_only_once_every_shard_finished(state):
    register_worker(state, W1)
    iteration_id = create_static_iteration(state)
    assert state.job(state.iteration(iteration_id).job_id).worker_addresses == ("w0", "w1")
    t0 = create_shard_task(state, iteration_id, W1, 0)
    assert state.task(t0).shard_index == 0
    state.apply(FinishTask(t0))
    # every task finished, but shard 1 has not run yet: the iteration waits for its worker
    it = state.iteration(iteration_id)
    assert (it.status, it.finished_shards, it.num_shards) == ("running", {0}, 2)
    register_worker(state, W2)
    t1 = create_shard_task(state, iteration_id, W2, 1)
    state.apply(FinishTask(t1))
    assert state.iteration(iteration_id).status == "finished"


def test_static_shard_of_a_lost_worker_is_taken_over_by_its_successor(state):
    register_worker(state, W1)
    register_worker(state, W2)
    iteration_id = create_static_iteration(state)
    state.apply(FinishTask(create_shard_task(state, iteration_id, W1, 0)))
    create_shard_task(state, iteration_id, W2, 1)
    state.apply(RemoveWorker(W2))
    assert state.iteration(iteration_id).status == "running"  # shard 1 never finished
    register_worker(state, "tcp://w1-again:1")
    state.apply(FinishTask(create_shard_task(state, iteration_id, "tcp://w1-again:1", 1)))
    it = state.iteration(iteration_id)
    assert it.status == "finished" and it.finished_shards == {0, 1}


def test_shard_indices_are_checked_against_the_journaled_list(state):
    register_worker(state, W1)
    iteration_id = create_static_iteration(state, workers=("w0", "w1", "w2"))
    for bad in (None, 3, -1):
        assert_refused(state, CreateTask(4000, iteration_id, W1, bad), IllegalUpdateError,
                       f"CreateTask: iteration {iteration_id} shards over 3 workers; "
                       f"shard_index must be in [0, 3), got {bad}")
    off = create_iteration(state, create_job(state, 1000))
    assert_refused(state, CreateTask(4000, off, W1, 0), IllegalUpdateError,
                   f"CreateTask: iteration {off} is not statically sharded (no shard_index)")


@pytest.mark.parametrize(
    "mode, workers, message",
    [
        ("DATA", (), "static sharding (DATA) needs a worker list"),
        ("HINT", ("a", "a"), "worker_addresses must be distinct and non-empty"),
        ("FILE", ("a", ""), "worker_addresses must be distinct and non-empty"),
        ("OFF", ("a",), "worker_addresses is only for static sharding, not OFF"),
    ],
)
def test_illegal_static_job(state, mode, workers, message):
    register_dataset(state)
    error = assert_refused(
        state, CreateJob(5000, None, 1000, mode, worker_addresses=workers), IllegalUpdateError)
    assert message in str(error)


def test_validate_state_catches_drifted_shards():
    state = DispatcherState()
    register_worker(state, W1)
    iteration_id = create_static_iteration(state)
    state.apply(FinishTask(create_shard_task(state, iteration_id, W1, 1)))
    state.validate_state()
    state._iterations[iteration_id].finished_shards = frozenset({0})
    with pytest.raises(AssertionError, match="finished shards \\[0\\] disagree"):
        state.validate_state()


def _count_a_task_too_many(state, task_id):
    state._workers[W1].num_tasks += 1


def _drop_from_the_worker_index(state, task_id):
    del state._tasks_by_worker[W1][state._tasks[task_id].iteration_id]


def _reuse_a_task_id(state, task_id):
    state._next_task_id = task_id


@pytest.mark.parametrize(("corrupt", "message"), [
    (_count_a_task_too_many, "worker 'tcp://10.0.0.1:4001' counts 2 tasks, 1 name it"),
    (_drop_from_the_worker_index, "active task {task} missing from its worker's index"),
    (_reuse_a_task_id, "task id {task} outside \\[{task}, {task}\\)"),
])
def test_validate_state_names_the_broken_invariant(corrupt, message):
    """Each invariant's message is built only once it failed; it still names what broke."""
    state = DispatcherState()
    register_worker(state, W1)
    task_id = create_task(state, create_iteration(state, create_job(state, register_dataset(state))),
                          W1)
    state.validate_state()
    corrupt(state, task_id)
    with pytest.raises(AssertionError, match="^DispatcherState invariant broken: "
                       + message.format(task=task_id)):
        state.validate_state()


def test_lost_tasks_count_as_done_only_once_a_task_finished(state):
    register_worker(state, W1)
    register_worker(state, W2)
    iteration_id = create_iteration(state, create_job(state, register_dataset(state)))
    t1 = create_task(state, iteration_id, W1)
    t2 = create_task(state, iteration_id, W2)
    state.apply(RemoveWorker(W1))
    assert state.task(t1).status == "lost"
    assert_refused(state, FinishTask(t1), IllegalUpdateError, f"FinishTask: task {t1} is lost")
    state.apply(RemoveWorker(W2))
    # Every task is lost and none finished: keep running, so a new worker can take over.
    assert state.iteration(iteration_id).status == "running"
    register_worker(state, W1)
    t3 = create_task(state, iteration_id, W1)
    state.apply(FinishTask(t3))
    iteration = state.iteration(iteration_id)
    assert (iteration.num_tasks, iteration.num_finished_tasks, iteration.num_lost_tasks) == (
        3,
        1,
        2,
    )
    assert iteration.finished
    assert state.task(t2).lost


# -- split cursor -------------------------------------------------------------------------------


def test_split_cursor_walks_splits_then_repetitions(state):
    iteration_id, [task_id] = dynamic_iteration(state, num_splits=3)
    produced = [produce_split(state, iteration_id, task_id) for _ in range(9)]
    assert produced == [
        (0, 0, False), (0, 1, False), (0, 2, False), (0, 3, True),
        (1, 0, False), (1, 1, False), (1, 2, False), (1, 3, True),
        (2, 0, False),
    ]  # fmt: skip
    cursor = state.split_cursor(iteration_id)
    assert (cursor.repetition, cursor.next_index, cursor.num_splits) == (2, 1, 3)


def test_one_record_hands_out_a_batch_of_splits(state):
    """``ProduceSplits`` is what one ``get_split(count)`` journals: the same cursor moves and
    the same splits in flight as that many ``ProduceSplit`` records."""
    iteration_id, [task_id] = dynamic_iteration(state, num_splits=5)
    state.apply(ProduceSplits(iteration_id, 0, 0, 3, task_id))
    assert state.split_position(iteration_id) == (0, 3, 5)
    assert state.task_splits(task_id) == ((0, 0), (0, 1), (0, 2))
    state.apply(ProduceSplits(iteration_id, 0, 3, 2, task_id, end_of_splits=True))
    assert state.split_position(iteration_id) == (1, 0, 5)
    assert state.task_splits(task_id) == tuple((0, i) for i in range(5))
    state.apply(ProduceSplits(iteration_id, 1, 0, 5, task_id, end_of_splits=False))
    state.apply(ProduceSplits(iteration_id, 1, 5, 0, task_id, end_of_splits=True))
    assert state.split_position(iteration_id) == (2, 0, 5)


def test_a_batch_of_splits_is_checked_as_a_whole(state):
    iteration_id, [task_id] = dynamic_iteration(state, num_splits=4)
    assert_refused(state, ProduceSplits(iteration_id, 0, 0, 5, task_id), IllegalUpdateError,
                   "ProduceSplits: 5 splits asked, only 4 of 4 remain")
    assert_refused(state, ProduceSplits(iteration_id, 0, 0, 0, task_id), IllegalUpdateError,
                   "ProduceSplits: count must be >= 1, or 0 with end_of_splits; got 0")
    assert_refused(state, ProduceSplits(iteration_id, 0, 0, 3, task_id, True),
                   IllegalUpdateError,
                   "ProduceSplits: finished=True but 1 of 4 splits of repetition 0 remain")
    assert_refused(state, ProduceSplits(iteration_id, 0, 1, 1, task_id), IllegalUpdateError,
                   "ProduceSplits: split index 1 is not the next index 0")
    state.apply(ProduceSplits(iteration_id, 0, 0, 4, task_id, True))
    assert_refused(state, ProduceSplits(iteration_id, 0, 0, 1, task_id), StaleEpochError)


def test_empty_splittable_dataset_ends_at_once(state):
    iteration_id, [task_id] = dynamic_iteration(state, num_splits=0)
    assert produce_split(state, iteration_id, task_id) == (0, 0, True)
    assert_refused(
        state,
        ProduceSplit(iteration_id, 1, 0, task_id, finished=False),
        IllegalUpdateError,
        "ProduceSplit: all 0 splits were handed out; finished must be True",
    )


def test_produce_split_preconditions(state):
    iteration_id, [t1, t2] = dynamic_iteration(state, num_splits=2, workers=(W1, W2))
    produce_split(state, iteration_id, t1)
    produce_split(state, iteration_id, t1)
    produce_split(state, iteration_id, t2)  # end of repetition 0
    error = assert_refused(
        state,
        ProduceSplit(iteration_id, 0, 2, t2, finished=True),
        StaleEpochError,
        f"ProduceSplit: repetition 0 of iteration {iteration_id} is stale; "
        "the split cursor is at repetition 1",
    )
    assert not isinstance(error, IllegalUpdateError)
    assert_refused(
        state,
        ProduceSplit(iteration_id, 2, 0, t2),
        IllegalUpdateError,
        f"ProduceSplit: repetition 2 is ahead of the split cursor of iteration {iteration_id} "
        "(repetition 1)",
    )
    assert_refused(
        state,
        ProduceSplit(iteration_id, 1, 1, t2),
        IllegalUpdateError,
        "ProduceSplit: split index 1 is not the next index 0",
    )
    assert_refused(
        state,
        ProduceSplit(iteration_id, 1, 0, t2, finished=True),
        IllegalUpdateError,
        "ProduceSplit: finished=True but 2 of 2 splits of repetition 1 remain",
    )
    assert_refused(
        state, ProduceSplit(iteration_id, 1, 0, 4999), TaskNotFoundError, "Task 4999 not found"
    )
    state.apply(FinishTask(t1))
    assert_refused(
        state,
        ProduceSplit(iteration_id, 1, 0, t1),
        IllegalUpdateError,
        f"ProduceSplit: task {t1} is finished",
    )


def test_produce_split_needs_a_dynamic_iteration_and_its_own_task(state):
    register_worker(state)
    dataset_id = register_dataset(state)
    off_iteration = create_iteration(state, create_job(state, dataset_id))
    off_task = create_task(state, off_iteration)
    dyn_iteration = create_iteration(
        state, create_job(state, dataset_id, processing_mode="DYNAMIC")
    )
    assert_refused(
        state,
        ProduceSplit(off_iteration, 0, 0, off_task),
        IllegalUpdateError,
        f"ProduceSplit: iteration {off_iteration} is not DYNAMIC and has no split cursor",
    )
    assert_refused(
        state,
        ProduceSplit(dyn_iteration, 0, 0, off_task),
        IllegalUpdateError,
        f"ProduceSplit: task {off_task} belongs to iteration {off_iteration}, not {dyn_iteration}",
    )
    with pytest.raises(DataServiceError) as info:
        state.split_cursor(off_iteration)
    assert str(info.value) == (
        f"Iteration {off_iteration} has no split cursor: its processing mode is 'OFF'"
    )
    assert state.lost_splits(off_iteration) == () and state.splits_in_flight(off_iteration) == {}


# -- splits in flight, acknowledgements and lost splits ------------------------------------------


def test_splits_in_flight_and_acks(state):
    iteration_id, [t1, t2] = dynamic_iteration(state, num_splits=5, workers=(W1, W2))
    for task_id in (t1, t1, t2, t1):
        produce_split(state, iteration_id, task_id)
    assert state.splits_in_flight(iteration_id) == {(0, 0): t1, (0, 1): t1, (0, 3): t1, (0, 2): t2}
    assert state.task_splits(t1) == ((0, 0), (0, 1), (0, 3))
    state.apply(AckSplits(t1, 0, 1))
    assert state.task_splits(t1) == ((0, 3),)
    assert_refused(
        state,
        AckSplits(t1, 0, 1),
        IllegalUpdateError,
        f"AckSplits: task {t1} holds no split at or before (0, 1)",
    )
    state.apply(AckSplits(t1, 0, 4))  # a bound past the last split held acks everything held
    assert state.task_splits(t1) == ()
    state.apply(FinishTask(t2))  # a finished pipeline is done with its splits
    assert state.splits_in_flight(iteration_id) == {}
    assert_refused(
        state, AckSplits(t2, 0, 2), IllegalUpdateError, f"AckSplits: task {t2} is finished"
    )


def test_remove_worker_loses_its_splits_in_flight_at_most_once(state):
    iteration_id, [t1, t2] = dynamic_iteration(state, num_splits=6, workers=(W1, W2))
    for task_id in (t1, t2, t1, t2, t1):
        produce_split(state, iteration_id, task_id)
    state.apply(AckSplits(t1, 0, 0))  # t1 finished split 0; it still holds 2 and 4
    state.apply(RemoveWorker(W1))
    assert state.lost_splits(iteration_id) == ((0, 2), (0, 4))
    assert state.task(t1).status == "lost"
    assert state.splits_in_flight(iteration_id) == {(0, 1): t2, (0, 3): t2}
    # The cursor never moves back: the lost splits are not handed out again.
    handed_out = [produce_split(state, iteration_id, t2) for _ in range(2)]
    assert handed_out == [(0, 5, False), (0, 6, True)]
    assert state.lost_splits(iteration_id) == ((0, 2), (0, 4))
    assert_refused(state, AckSplits(t1, 0, 4), IllegalUpdateError, f"AckSplits: task {t1} is lost")


# -- iteration clients ---------------------------------------------------------------------------


def test_iteration_clients(state):
    iteration_id = create_iteration(state, create_job(state, register_dataset(state), "shared"))
    c1 = acquire_client(state, iteration_id, time_micros=10)
    c2 = acquire_client(state, iteration_id, time_micros=11)
    assert (c1, c2) == (3000, 3001)
    assert state.iteration(iteration_id).num_clients == 2
    state.apply(ClientHeartbeat(c1, time_micros=50))
    client = state.iteration_client(c1)
    assert (client.iteration_id, client.acquired_micros, client.last_seen_micros) == (
        iteration_id,
        10,
        50,
    )
    state.apply(ReleaseIterationClient(c1, time_micros=60))
    iteration = state.iteration(iteration_id)
    assert (iteration.num_clients, iteration.last_client_released_micros) == (1, 60)
    assert [c.iteration_client_id for c in state.list_iteration_clients()] == [c2]
    message = f"Iteration client {c1} not found"
    assert_refused(state, ReleaseIterationClient(c1, 70), IterationClientNotFoundError, message)
    assert_refused(state, ClientHeartbeat(c1, 70), IterationClientNotFoundError, message)
    with pytest.raises(KeyError):
        state.iteration_client(c1)
    assert_refused(
        state,
        ClientHeartbeat(c2, -1),
        IllegalUpdateError,
        "ClientHeartbeat: time_micros must be >= 0, got -1",
    )


# -- garbage collection --------------------------------------------------------------------------


def test_garbage_collect_iteration_frees_the_job_name(state):
    register_worker(state)
    dataset_id = register_dataset(state)
    job_id = create_job(state, dataset_id, job_name="shared")
    rep0 = create_iteration(state, job_id, 0)
    rep1 = create_iteration(state, job_id, 1)
    task_id = create_task(state, rep0)
    client_id = acquire_client(state, rep0)
    assert_refused(
        state,
        GarbageCollectIteration(rep0),
        IllegalUpdateError,
        f"GarbageCollectIteration: iteration {rep0} still has 1 client(s)",
    )
    state.apply(ReleaseIterationClient(client_id, 5))
    state.apply(GarbageCollectIteration(rep0))
    iteration = state.iteration(rep0)
    assert iteration.garbage_collected and iteration.finished
    with pytest.raises(TaskNotFoundError):
        state.task(task_id)
    assert state.tasks_for_iteration(rep0) == [] and state.tasks_for_worker(W1) == []
    assert state.job_by_name("shared").job_id == job_id  # rep1 is still live
    assert_refused(
        state,
        AcquireIterationClient(3001, rep0, 6),
        IllegalUpdateError,
        f"AcquireIterationClient: iteration {rep0} is garbage_collected",
    )
    assert_refused(
        state,
        GarbageCollectIteration(rep0),
        IllegalUpdateError,
        f"GarbageCollectIteration: iteration {rep0} is garbage_collected",
    )
    state.apply(GarbageCollectIteration(rep1))
    assert state.job(job_id).status == "garbage_collected"
    with pytest.raises(JobNotFoundError):
        state.job_by_name("shared")
    assert_refused(
        state,
        CreateIteration(state.next_iteration_id(), job_id, 2),
        IllegalUpdateError,
        f"CreateIteration: job {job_id} is garbage_collected",
    )
    new_job = create_job(state, dataset_id, job_name="shared")
    assert state.job_by_name("shared").job_id == new_job != job_id


def test_a_job_without_iterations_is_collected_by_garbage_collect_job(state):
    """``GarbageCollectJob``: only a live job that never got an iteration; it frees the
    name as the collection of a job's last iteration does."""
    dataset_id = register_dataset(state)
    job_id = create_job(state, dataset_id, job_name="shared")
    read = create_job(state, dataset_id)
    create_iteration(state, read)
    assert_refused(state, GarbageCollectJob(read), IllegalUpdateError,
                   f"GarbageCollectJob: job {read} has 1 iteration(s); it is collected with "
                   "its last one")
    assert_refused(state, GarbageCollectJob(5999), JobNotFoundError, "Job 5999 not found")
    assert state.num_live_jobs(dataset_id) == 2
    state.apply(GarbageCollectJob(job_id))
    job = state.job(job_id)
    assert (job.status, job.num_iterations, state.num_live_jobs(dataset_id)) == \
        ("garbage_collected", 0, 1)
    with pytest.raises(JobNotFoundError):
        state.job_by_name("shared")
    assert_refused(state, GarbageCollectJob(job_id), IllegalUpdateError,
                   f"GarbageCollectJob: job {job_id} is garbage_collected")
    assert_refused(state, CreateIteration(state.next_iteration_id(), job_id), IllegalUpdateError,
                   f"CreateIteration: job {job_id} is garbage_collected")
    assert create_job(state, dataset_id, job_name="shared") == job_id + 2  # the name is free


def test_garbage_collect_dataset_leaves_a_tombstone_and_frees_its_fingerprint(state):
    """``GarbageCollectDataset``: only without live jobs; the dataset's bytes and index
    entries go, its id stays collected and is never used again."""
    dataset_id = register_dataset(state, "fp")
    named = register_dataset(state, "fp", dataset_name="train")
    job_id = create_job(state, dataset_id)
    iteration_id = create_iteration(state, job_id)
    assert_refused(state, GarbageCollectDataset(dataset_id), IllegalUpdateError,
                   f"GarbageCollectDataset: dataset {dataset_id} still has 1 live job(s)")
    state.apply(GarbageCollectIteration(iteration_id))  # its job goes with it
    assert state.num_live_jobs(dataset_id) == 0
    state.apply(GarbageCollectDataset(dataset_id))
    state.apply(GarbageCollectDataset(named))
    assert state.list_datasets() == []
    assert state.dataset_collected(dataset_id) and state.dataset_collected(named)
    assert state.num_collected_datasets() == 2
    snap = state.snapshot()
    assert (snap["datasets"], snap["dataset_by_fingerprint"], snap["dataset_by_name"],
            snap["collected_datasets"]) == ({}, {}, {}, [dataset_id, named])
    assert state.job(job_id).dataset_id == dataset_id  # collected jobs stay, for the record
    for error, update in [
        (f"Dataset {dataset_id} was garbage collected (it had no job for the dispatcher's "
         "dataset-gc-timeout)", GarbageCollectDataset(dataset_id)),
        (f"Dataset {dataset_id} was garbage collected (it had no job for the dispatcher's "
         "dataset-gc-timeout)", CreateJob(state.next_job_id(), None, dataset_id, "OFF")),
        ("Dataset 1002 not found", GarbageCollectDataset(1002)),
    ]:
        assert_refused(state, update, DatasetNotFoundError, error)
    with pytest.raises(DatasetNotFoundError) as info:
        state.dataset_by_fingerprint("fp")
    assert str(info.value) == "Dataset with fingerprint 'fp' not found"
    # the same pipeline again: a new dataset, under a new id; the old ids are never reused
    assert_refused(state, RegisterDataset(named, "fp", b"p", b"s", 1), IllegalUpdateError,
                   f"RegisterDataset: dataset id {named} is not fresh (the next dataset id is "
                   f"{named + 1})")
    again = register_dataset(state, "fp")
    assert again == named + 1 and state.dataset_by_fingerprint("fp").dataset_id == again
    assert register_dataset(state, "fp", dataset_name="train") == named + 2
    restored = decode_state(encode_state(state))
    restored.validate_state()
    assert restored == state and restored.dataset_collected(dataset_id)


def test_garbage_collect_drops_splits_in_flight(state):
    iteration_id, [task_id] = dynamic_iteration(state)
    produce_split(state, iteration_id, task_id)
    state.apply(GarbageCollectIteration(iteration_id))
    assert state.splits_in_flight(iteration_id) == {}
    assert state.snapshot()["splits_in_flight"] == {}
    assert state.tasks_for_worker(W1) == []


# -- apply/check contract, lifecycle tables, validation --------------------------------------------


def test_unknown_update_type_is_refused(state):
    assert_refused(state, object(), IllegalUpdateError, "Unknown update type 'object'")


def test_records_check_field_types():
    with pytest.raises(TypeError, match=r"FinishTask.task_id must be int, got '4000'"):
        FinishTask("4000")
    with pytest.raises(TypeError, match=r"ProduceSplit.index must be int"):
        ProduceSplit(2000, 0, True, 4000)
    with pytest.raises(TypeError, match=r"CreateJob.job_name must be str or NoneType, got 3"):
        CreateJob(5000, 3, 1000, "OFF")
    with pytest.raises(dataclasses.FrozenInstanceError):
        FinishTask(4000).task_id = 4001


def test_lifecycle_tables_cover_the_statuses_and_updates():
    assert set(TASK_TRANSITIONS) == {"active", "finished", "lost"}
    assert set(ITERATION_ACCEPTS) == {"running", "finished", "garbage_collected"}
    assert set(JOB_ACCEPTS) == {"live", "garbage_collected"}
    assert set(DATASET_ACCEPTS) == {"registered", "collected"}
    assert set(WORKER_ACCEPTS) == {"unknown", "registered", "departed"}
    for after in TASK_TRANSITIONS.values():
        assert set(after.values()) <= set(TASK_TRANSITIONS) | {"removed"}
    tables = [*TASK_TRANSITIONS.values(), *ITERATION_ACCEPTS.values(), *JOB_ACCEPTS.values(),
              *DATASET_ACCEPTS.values()]
    assert set().union(*tables, *WORKER_ACCEPTS.values()) <= set(UPDATE_TYPES)


def test_validate_state_catches_a_drifted_index():
    state = DispatcherState()
    job_id = create_job(state, register_dataset(state), job_name="shared")
    state.validate_state()
    state._jobs_by_name[(1000, "other")] = job_id  # what the Rules forbid
    with pytest.raises(AssertionError,
                       match="job name 'other' of dataset 1000 indexes job 5000 wrongly"):
        state.validate_state()


# -- encoding ---------------------------------------------------------------------------------------

EXAMPLES = [
    RegisterDataset(
        1000, "fp", b"\x80pickle", b"\x00splits", 7, b"spec", {"a": [1, 2.5, None]}, "AUTO"
    ),
    RegisterWorker(W1, "10.0.0.1", 4, {"ps": 1.0}, ("x", "y")),
    RemoveWorker(W1),
    CreateJob(5000, "shared", 1000, "DATA", 2, "LOCAL", True, ("w0", "tcp://h:1")),
    CreateIteration(2000, 5000, 3),
    CreateTask(4000, 2000, W1, 1),
    FinishTask(4000),
    ProduceSplit(2000, 1, 6, 4000, True),
    AckSplits(4000, 1, 5),
    AcquireIterationClient(3000, 2000, 1_700_000_000_000_000),
    ReleaseIterationClient(3000, 1_700_000_000_000_001, True),
    ClientHeartbeat(3000, 1_700_000_000_000_002),
    GarbageCollectIteration(2000),
    ProduceSplits(2000, 1, 2, 4, 4000, True),
    GarbageCollectJob(5000),
    GarbageCollectDataset(1000),
]


def test_examples_cover_every_update_type():
    assert [type(u) for u in EXAMPLES] == list(UPDATE_TYPES)


@pytest.mark.parametrize("update", EXAMPLES, ids=lambda u: type(u).__name__)
def test_encode_decode_round_trip(update):
    data = encode_update(update)
    name, fields = msgpack.unpackb(data, raw=False)  # plain data, readable without our classes
    assert name == type(update).__name__
    assert set(fields) == {f.name for f in dataclasses.fields(update)}
    decoded = decode_update(data)
    assert type(decoded) is type(update) and decoded == update


def test_read_to_end_is_kept_by_the_iteration_and_its_snapshot():
    """``ReleaseIterationClient.read_to_end`` marks the iteration (the GC of idle DYNAMIC
    iterations waits for it); a later release without it does not clear it."""
    state = DispatcherState()
    iteration_id, _ = dynamic_iteration(state)
    first, second = acquire_client(state, iteration_id), acquire_client(state, iteration_id)
    state.apply(ReleaseIterationClient(first, 1))
    assert not state.iteration(iteration_id).read_to_end
    state.apply(ReleaseIterationClient(second, 2, read_to_end=True))
    assert state.iteration(iteration_id).read_to_end
    again = acquire_client(state, iteration_id, 3)
    state.apply(ReleaseIterationClient(again, 4))
    assert state.iteration(iteration_id).read_to_end
    assert decode_state(encode_state(state)).iteration(iteration_id).read_to_end


def test_decode_fills_defaults_for_fields_older_records_lack():
    data = msgpack.packb(
        [
            "CreateJob",
            {"job_id": 5000, "job_name": None, "dataset_id": 1000, "processing_mode": "OFF"},
        ]
    )
    assert decode_update(data) == CreateJob(5000, None, 1000, "OFF", None, "AUTO", False, ())
    data = msgpack.packb(["CreateTask", {"task_id": 4000, "iteration_id": 2000,
                                         "worker_address": W1}])
    assert decode_update(data) == CreateTask(4000, 2000, W1, None)
    data = msgpack.packb(["ReleaseIterationClient",
                          {"iteration_client_id": 3000, "time_micros": 7}])
    assert decode_update(data) == ReleaseIterationClient(3000, 7, read_to_end=False)


@pytest.mark.parametrize(
    "data, message",
    [
        (b"\xc1", "Cannot decode update: "),
        (msgpack.packb({"a": 1}), "Cannot decode update: expected [type_name, fields]"),
        (msgpack.packb(["Pickle", {}]), "Cannot decode update: unknown update type 'Pickle'"),
        (
            msgpack.packb(["FinishTask", {"task_id": 1, "x": 2}]),
            "Cannot decode FinishTask: unknown fields ['x']",
        ),
        (msgpack.packb(["FinishTask", {}]), "Cannot decode FinishTask: "),
        (
            msgpack.packb(["FinishTask", {"task_id": "1"}]),
            "Cannot decode FinishTask: FinishTask.task_id must be int",
        ),
    ],
)
def test_decode_refuses_malformed_records(data, message):
    with pytest.raises(IllegalUpdateError) as info:
        decode_update(data)
    assert str(info.value).startswith(message)


def test_encode_refuses_non_records():
    with pytest.raises(TypeError, match="Not an update record"):
        encode_update({"task_id": 1})


def test_replay_of_a_scenario_equals_the_state(state):
    journal = []
    original_apply = state.apply

    def apply_and_journal(update):
        original_apply(update)
        journal.append(encode_update(update))

    state.apply = apply_and_journal
    iteration_id, [t1, t2] = dynamic_iteration(state, num_splits=2, workers=(W1, W2))
    client_id = acquire_client(state, iteration_id, 1)
    produce_split(state, iteration_id, t1)
    produce_split(state, iteration_id, t2)
    state.apply(RemoveWorker(W1))
    produce_split(state, iteration_id, t2)
    state.apply(FinishTask(t2))
    state.apply(ReleaseIterationClient(client_id, 9))
    state.apply(GarbageCollectIteration(iteration_id))
    del state.apply
    restored = replay(decode_update(record) for record in journal)
    assert len(journal) == 15
    assert restored == state
    assert restored.snapshot()["lost_splits"] == {iteration_id: [(0, 0, 1)]}  # runs
    assert restored.next_task_id() == state.next_task_id() == 4002
    restored.apply(RegisterDataset(1001, "other", b"", b"", -1))
    assert restored != state


# -- stateful property test: replay(journal) == state ------------------------------------------------

ADDRESSES = ["tcp://w0:1", "tcp://w1:1", "tcp://w2:1"]
SHARDS = ("w0", "w1")


class DispatcherStateMachine(RuleBasedStateMachine):
    """Random updates against one state and its journal.

    Rules mostly build legal updates from what the state holds (so that runs reach split
    cursors, lost splits and garbage collection) and sometimes name a bogus id or a wrong
    cursor position; ``offer`` then checks the update is refused and changes nothing.
    """

    def __init__(self):
        super().__init__()
        self.state = DispatcherState()
        self.snapshot: bytes | None = None
        self.journal: list[bytes] = []  # the records after the snapshot
        self.clock = 0

    # -- helpers

    def offer(self, update):
        """Apply ``update`` if legal (and journal it); else check it raises and changes nothing."""
        before = self.state.snapshot()
        try:
            self.state.check(update)
        except DataServiceError as e:
            with pytest.raises(type(e)):
                self.state.apply(update)
            assert self.state.snapshot() == before
            return False
        self.state.apply(update)
        self.journal.append(encode_update(update))
        return True

    def tick(self, data):
        self.clock += data.draw(st.integers(0, 1000))
        return self.clock

    def pick(self, data, candidates, bogus):
        """Usually one of ``candidates``; sometimes (or when there are none) ``bogus``."""
        if candidates and data.draw(st.integers(0, 9)) < 8:
            return data.draw(st.sampled_from(candidates))
        return bogus

    def iterations(self, *statuses):
        return [i for i in self.state.list_iterations() if i.status in statuses]

    def active_tasks(self, dynamic_only=False):
        return [
            task
            for iteration in self.iterations("running")
            if not dynamic_only or self.state.job(iteration.job_id).processing_mode == "DYNAMIC"
            for task in self.state.tasks_for_iteration(iteration.iteration_id)
            if task.status == "active"
        ]

    def shard(self, iteration_id, address):
        """The shard a worker gets in a static iteration (None otherwise), as a fixed list would."""
        if iteration_id not in self.state.snapshot()["iterations"]:
            return None
        num_shards = self.state.iteration(iteration_id).num_shards
        return ADDRESSES.index(address) % num_shards if num_shards else None

    def holding_tasks(self):
        return [
            t for t in self.active_tasks(dynamic_only=True) if self.state.task_splits(t.task_id)
        ]

    # -- rules

    @initialize()
    def start(self):
        for address in ADDRESSES[:2]:
            assert self.offer(RegisterWorker(address, "host", 2))
        assert self.offer(RegisterDataset(1000, "splits", b"p", b"s", 3))
        assert self.offer(RegisterDataset(1001, "no-splits", b"p", b"", -1))

    @rule(data=st.data())
    def start_iteration(self, data):
        """What the dispatcher does for a client: get or create the job, an iteration, tasks."""
        state = self.state
        job_name = data.draw(st.sampled_from([None, "x", "y"]))
        live = {job.job_name: job for job in state.list_jobs() if job.status == "live"}
        if job_name is not None and job_name in live:
            job_id = live[job_name].job_id
        else:
            if not state.list_datasets():  # all collected
                return
            dataset = data.draw(st.sampled_from(state.list_datasets()))
            modes = ["DYNAMIC", "DYNAMIC", "OFF"] if dataset.splittable else ["OFF", "HINT"]
            mode = data.draw(st.sampled_from(modes))
            workers = SHARDS if mode == "HINT" else ()
            job_id = state.next_job_id()
            job = CreateJob(job_id, job_name, dataset.dataset_id, mode, worker_addresses=workers)
            assert self.offer(job)
        repetitions = [i.repetition for i in state.list_iterations() if i.job_id == job_id]
        iteration_id = state.next_iteration_id()
        assert self.offer(CreateIteration(iteration_id, job_id, max(repetitions, default=-1) + 1))
        for worker in state.list_workers():
            shard = self.shard(iteration_id, worker.address)
            assert self.offer(
                CreateTask(state.next_task_id(), iteration_id, worker.address, shard))

    @rule(fingerprint=st.sampled_from("abc"), num_splits=st.integers(-1, 3), fresh=st.booleans(),
          name=st.sampled_from([None, None, "named", ""]))
    def register_dataset(self, fingerprint, num_splits, fresh, name):
        dataset_id = self.state.next_dataset_id() - (not fresh)
        self.offer(
            RegisterDataset(dataset_id, fingerprint, b"p", b"s", num_splits, None, {"n": [1]},
                            None, name)
        )

    @rule(address=st.sampled_from(ADDRESSES), nthreads=st.integers(1, 4))
    def register_worker(self, address, nthreads):
        self.offer(RegisterWorker(address, "host", nthreads, {"cpu": nthreads}, ("t",)))

    @rule(address=st.sampled_from(ADDRESSES))
    def remove_worker(self, address):
        self.offer(RemoveWorker(address))

    @rule(data=st.data())
    def create_job(self, data):
        state = self.state
        job_name = data.draw(st.sampled_from([None, None, "x", "y"]))
        self.offer(
            CreateJob(
                job_id=state.next_job_id(),
                job_name=job_name,
                dataset_id=self.pick(
                    data, [d.dataset_id for d in state.list_datasets()],
                    data.draw(st.sampled_from([state.next_dataset_id(), *self.collected()])),
                ),
                processing_mode=data.draw(st.sampled_from(["DYNAMIC", "DYNAMIC", "OFF", "FILE"])),
                worker_addresses=data.draw(st.sampled_from([(), SHARDS, SHARDS])),
                num_consumers=data.draw(st.sampled_from([None, None, 2])) if job_name else None,
                target_workers=data.draw(st.sampled_from(["AUTO", "ANY"])),
                cross_trainer_cache=job_name is not None and data.draw(st.booleans()),
            )
        )

    @rule(data=st.data())
    def create_iteration(self, data):
        live = [job for job in self.state.list_jobs() if job.status == "live"]
        job_id = self.pick(data, [job.job_id for job in live], self.state.next_job_id())
        repetition = data.draw(st.integers(0, 2))
        if job_id in self.state.snapshot()["jobs"] and data.draw(st.booleans()):
            repetition = self.state.job(job_id).num_iterations  # the usual next repetition
        self.offer(CreateIteration(self.state.next_iteration_id(), job_id, repetition))

    @rule(data=st.data())
    def create_task(self, data):
        running = [i.iteration_id for i in self.iterations("running")]
        iteration_id = self.pick(data, running, self.state.next_iteration_id())
        address = data.draw(st.sampled_from(ADDRESSES))
        shard = self.pick(data, [self.shard(iteration_id, address)], 2)
        self.offer(CreateTask(self.state.next_task_id(), iteration_id, address, shard))

    @rule(data=st.data())
    def finish_task(self, data):
        tasks = [t.task_id for t in self.active_tasks()]
        self.offer(FinishTask(self.pick(data, tasks, data.draw(st.sampled_from([4000, 1])))))

    @precondition(lambda self: self.active_tasks(dynamic_only=True))
    @rule(data=st.data(), times=st.integers(1, 4))
    def produce_splits(self, data, times):
        task = data.draw(st.sampled_from(self.active_tasks(dynamic_only=True)))
        for _ in range(times):
            cursor = self.state.split_cursor(task.iteration_id)
            finished = cursor.next_index == cursor.num_splits
            update = ProduceSplit(
                task.iteration_id, cursor.repetition, cursor.next_index, task.task_id, finished
            )
            assert self.offer(update)
        # And one that is usually wrong: stale or future repetition, wrong index or flag.
        cursor = self.state.split_cursor(task.iteration_id)
        self.offer(
            ProduceSplit(
                task.iteration_id,
                cursor.repetition + data.draw(st.integers(-1, 1)),
                cursor.next_index + data.draw(st.integers(-1, 1)),
                task.task_id,
                data.draw(st.booleans()),
            )
        )

    @precondition(lambda self: self.active_tasks(dynamic_only=True))
    @rule(data=st.data())
    def produce_split_batch(self, data):
        """What ``get_split(count)`` journals: one record for several splits, maybe the end."""
        task = data.draw(st.sampled_from(self.active_tasks(dynamic_only=True)))
        cursor = self.state.split_cursor(task.iteration_id)
        remaining = cursor.num_splits - cursor.next_index
        count = data.draw(st.integers(min(1, remaining), remaining))
        end = count == remaining and (count == 0 or data.draw(st.booleans()))
        assert self.offer(ProduceSplits(task.iteration_id, cursor.repetition, cursor.next_index,
                                        count, task.task_id, end))
        # And one that is usually wrong: too many, an end that is not, a wrong index.
        cursor = self.state.split_cursor(task.iteration_id)
        self.offer(ProduceSplits(
            task.iteration_id, cursor.repetition + data.draw(st.integers(-1, 1)),
            cursor.next_index + data.draw(st.integers(-1, 1)),
            data.draw(st.integers(-1, cursor.num_splits + 1)), task.task_id,
            data.draw(st.booleans())))

    @precondition(holding_tasks)
    @rule(data=st.data())
    def ack_splits(self, data):
        task_id = data.draw(st.sampled_from(self.holding_tasks())).task_id
        repetition, index = data.draw(st.sampled_from(self.state.task_splits(task_id)))
        self.offer(AckSplits(task_id, repetition, index + data.draw(st.integers(-1, 1))))

    @precondition(holding_tasks)
    @rule(data=st.data())
    def worker_dies_holding_splits(self, data):
        task = data.draw(st.sampled_from(self.holding_tasks()))
        held = self.state.task_splits(task.task_id)
        assert self.offer(RemoveWorker(task.worker_address))
        assert set(held) <= set(self.state.lost_splits(task.iteration_id))
        assert self.state.task(task.task_id).status == "lost"
        assert self.state.task_splits(task.task_id) == ()

    @rule(data=st.data())
    def acquire_client(self, data):
        iterations = [i.iteration_id for i in self.iterations("running", "finished")]
        iteration_id = self.pick(data, iterations, self.state.next_iteration_id())
        client_id = self.state.next_iteration_client_id() - data.draw(st.sampled_from([0, 0, 1]))
        self.offer(AcquireIterationClient(client_id, iteration_id, self.tick(data)))

    @rule(data=st.data(), release=st.booleans())
    def release_or_heartbeat(self, data, release):
        clients = [c.iteration_client_id for c in self.state.list_iteration_clients()]
        client_id = self.pick(data, clients, self.state.next_iteration_client_id())
        kind = ReleaseIterationClient if release else ClientHeartbeat
        self.offer(kind(client_id, self.tick(data)))

    @rule(data=st.data(), release_first=st.booleans())
    def garbage_collect(self, data, release_first):
        iterations = [i.iteration_id for i in self.state.list_iterations()]
        iteration_id = self.pick(data, iterations, self.state.next_iteration_id())
        if release_first:
            for client in self.state.list_iteration_clients():
                if client.iteration_id == iteration_id:
                    assert self.offer(
                        ReleaseIterationClient(client.iteration_client_id, self.tick(data))
                    )
        self.offer(GarbageCollectIteration(iteration_id))

    def collected(self):
        return sorted(self.state.snapshot()["collected_datasets"])

    @rule(data=st.data())
    def garbage_collect_job(self, data):
        """Usually a live job without iterations (one a client never read)."""
        jobs = self.state.list_jobs()
        idle = [j.job_id for j in jobs if j.status == "live" and not j.num_iterations]
        others = [j.job_id for j in jobs] or [self.state.next_job_id()]
        job_id = self.pick(data, idle, data.draw(st.sampled_from(others)))
        self.offer(GarbageCollectJob(job_id))

    @rule(data=st.data(), collect_jobs_first=st.booleans())
    def garbage_collect_dataset(self, data, collect_jobs_first):
        """Usually a dataset without live jobs (after collecting its jobs, if asked)."""
        state = self.state
        datasets = [d.dataset_id for d in state.list_datasets()]
        bogus = data.draw(st.sampled_from([state.next_dataset_id(), *self.collected()]))
        dataset_id = self.pick(data, datasets, bogus)
        if collect_jobs_first:
            for job in state.list_jobs():
                if job.dataset_id != dataset_id or job.status != "live":
                    continue
                if not job.num_iterations:
                    assert self.offer(GarbageCollectJob(job.job_id))
                    continue
                for it in state.list_live_iterations():
                    if it.job_id != job.job_id:
                        continue
                    for client in state.list_iteration_clients():
                        if client.iteration_id == it.iteration_id:
                            assert self.offer(ReleaseIterationClient(
                                client.iteration_client_id, self.tick(data)))
                    assert self.offer(GarbageCollectIteration(it.iteration_id))
        legal = dataset_id in datasets and not state.num_live_jobs(dataset_id)
        collected = self.offer(GarbageCollectDataset(dataset_id))
        assert collected == legal
        if collected:
            assert state.dataset_collected(dataset_id)
            assert dataset_id not in [d.dataset_id for d in state.list_datasets()]

    @rule()
    def take_a_snapshot(self):
        """What the journal's compaction does: the records so far become one snapshot."""
        restored = self.restore()
        self.snapshot = encode_state(restored)
        self.journal = []
        decoded = decode_state(self.snapshot)
        decoded.validate_state()
        assert decoded == self.state

    def restore(self):
        state = DispatcherState() if self.snapshot is None else decode_state(self.snapshot)
        for record in self.journal:
            state.apply(decode_update(record))
        return state

    @invariant()
    def replay_of_the_journal_equals_the_state(self):
        """Replay = the last snapshot (if any) + the records after it."""
        self.state.validate_state()
        assert self.restore() == self.state


DispatcherStateMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestDispatcherStateMachine = DispatcherStateMachine.TestCase


def test_hot_path_accessors_match_the_copies(state):
    register_worker(state, W1)
    iteration_id = create_iteration(
        state, create_job(state, register_dataset(state), processing_mode="DYNAMIC"))
    task_id = create_task(state, iteration_id, W1)
    cursor = state.split_cursor(iteration_id)
    assert state.split_position(iteration_id) == (cursor.repetition, cursor.next_index,
                                                   cursor.num_splits)
    assert state.task_status(task_id) == state.task(task_id).status == "active"
    with pytest.raises(IterationNotFoundError):
        state.split_position(9999)
    with pytest.raises(TaskNotFoundError):
        state.task_status(9999)
