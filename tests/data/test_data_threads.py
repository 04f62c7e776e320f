"""Threads of prefetch, parallel map and parallel interleave: they really run ahead / in
parallel, and they stop (no leak, no deadlock) when an iterator is abandoned early."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from dask_dataservice.data import AUTOTUNE, Dataset

pytestmark = pytest.mark.component

DEADLINE = 10.0


def wait_until(predicate, timeout=DEADLINE, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


def library_threads():
    return [t for t in threading.enumerate() if t.name.startswith("dds-")]


@pytest.fixture
def baseline():
    """The threads alive before the test (after earlier tests' threads have ended, or 2 s:
    a thread leaked by an earlier failure is that test's failure, not this one's)."""
    try:
        wait_until(lambda: not library_threads(), timeout=2.0)
    except AssertionError:
        pass
    return set(threading.enumerate())


def wait_for_baseline(baseline):
    def back():
        extra = [t for t in threading.enumerate() if t not in baseline]
        return not extra and threading.active_count() <= len(baseline)

    wait_until(back, what="the pipeline's threads to end: "
               + repr([t.name for t in threading.enumerate() if t not in baseline]))


def new_threads(baseline):
    return [t for t in threading.enumerate() if t not in baseline]


class Gate:
    """A map function that returns at once for the first ``free`` elements and then blocks
    until released (or 10 s), counting the calls that started."""

    def __init__(self, free):
        self.free = free
        self.release = threading.Event()
        self.started = 0
        self.lock = threading.Lock()

    def __call__(self, x):
        with self.lock:
            self.started += 1
        if x >= self.free:
            self.release.wait(DEADLINE)
        return x


def counting_source(counter):
    def gen():
        i = 0
        while True:
            counter[0] += 1
            yield i
            i += 1

    return Dataset.from_generator(gen)


# ------------------------------------------------------------------------------------------
# the threads do their job
# ------------------------------------------------------------------------------------------


def test_prefetch_runs_ahead_of_the_consumer(baseline):
    counter = [0]
    it = iter(counting_source(counter).prefetch(5))
    assert next(it) == 0
    wait_until(lambda: counter[0] >= 6, what="the prefetch thread to fill its buffer")
    # the prefetch thread, and the sampling thread of the iteration's figures (Dataset.stats())
    assert sorted(t.name for t in new_threads(baseline)) == ["dds-op-sampler", "dds-prefetch"]
    it.close()
    wait_for_baseline(baseline)


def test_prefetch_buffer_is_bounded():
    counter = [0]
    it = iter(counting_source(counter).prefetch(3))
    next(it)
    # the producer blocks on a full buffer: the count reaches its bound and stays there
    wait_until(lambda: counter[0] >= 4, what="the buffer to fill")
    bound = 1 + 2 * 3 + 1  # consumed + both sides' buffers + one in the producer's hand
    for _ in range(50):
        assert counter[0] <= bound
        time.sleep(0.001)
    it.close()


def test_parallel_map_runs_calls_concurrently(baseline):
    barrier = threading.Barrier(2, timeout=DEADLINE)

    def meet(x):
        barrier.wait()  # only returns when two calls are running at once
        return x

    assert list(Dataset.range(6).map(meet, num_parallel_calls=2)) == list(range(6))
    assert list(Dataset.range(6).map(meet, num_parallel_calls=2, deterministic=False)) != []
    wait_for_baseline(baseline)


def test_parallel_interleave_reads_cycle_elements_concurrently(baseline):
    barrier = threading.Barrier(3, timeout=DEADLINE)

    def meet(x):
        barrier.wait()
        return x

    ds = Dataset.range(3).interleave(lambda x: Dataset.from_tensor_slices([x]).map(meet),
                                     cycle_length=3, num_parallel_calls=3)
    assert list(ds) == [0, 1, 2]
    wait_for_baseline(baseline)


# ------------------------------------------------------------------------------------------
# abandoned iterators: no leaked thread
# ------------------------------------------------------------------------------------------


def abandoned_pipelines():
    """(name, make_iterator, gate): pipelines with threads, and the gate their map waits on."""
    slow = Gate(free=3)
    yield "prefetch", lambda: iter(Dataset.range(10**9).prefetch(4)), None
    yield "parallel map", lambda: iter(Dataset.range(10**9).map(slow, num_parallel_calls=4)), slow
    slow2 = Gate(free=3)
    yield ("parallel map, deterministic=False",
           lambda: iter(Dataset.range(10**9).map(slow2, num_parallel_calls=AUTOTUNE,
                                                 deterministic=False)), slow2)
    yield ("parallel interleave",
           lambda: iter(Dataset.range(10**9).interleave(lambda x: Dataset.range(10**9),
                                                        cycle_length=3, num_parallel_calls=3)),
           None)
    slow3 = Gate(free=10)
    yield ("nested",
           lambda: (Dataset.range(10**9).prefetch(2).map(slow3, num_parallel_calls=2).prefetch(3)
                    .interleave(lambda x: Dataset.range(5).prefetch(1), cycle_length=2,
                                num_parallel_calls=2)
                    .enumerate().batch(2).as_numpy_iterator()), slow3)


PIPELINES = [name for name, _, _ in abandoned_pipelines()]


@pytest.mark.parametrize("name", PIPELINES)
def test_abandoned_iterator_stops_its_threads(baseline, name):
    _, make_iter, gate = next(p for p in abandoned_pipelines() if p[0] == name)
    it = make_iter()
    for _ in range(3):
        next(it)
    assert new_threads(baseline), f"{name}: expected background threads"
    del it
    gc.collect()
    if gate is not None:  # calls blocked in the user function may finish now
        gate.release.set()
    wait_for_baseline(baseline)


@pytest.mark.parametrize("name", PIPELINES)
def test_break_out_of_a_for_loop_stops_threads(baseline, name):
    _, make_iter, gate = next(p for p in abandoned_pipelines() if p[0] == name)
    if gate is not None:
        gate.release.set()
    for i, _ in enumerate(make_iter()):
        if i == 2:
            break
    wait_for_baseline(baseline)


def test_take_stops_threads_without_garbage_collection(baseline):
    gc.disable()
    try:
        assert list(Dataset.range(10**9).prefetch(8).map(str, num_parallel_calls=2).take(5)) == [
            "0", "1", "2", "3", "4"
        ]
        wait_for_baseline(baseline)
    finally:
        gc.enable()


def test_blocked_map_calls_do_not_block_closing(baseline):
    gate = Gate(free=2)
    it = iter(Dataset.range(100).map(gate, num_parallel_calls=3))
    assert [next(it), next(it)] == [0, 1]
    wait_until(lambda: gate.started >= 5, what="three calls to block")  # 0, 1 done; 2-4 wait
    t0 = time.monotonic()
    it.close()  # must not wait for the blocked calls
    assert time.monotonic() - t0 < DEADLINE / 2
    gate.release.set()
    wait_for_baseline(baseline)
    assert gate.started == 5  # the queued calls were cancelled, never started


def test_no_deadlock_when_consumer_stops_while_producer_is_blocked_on_a_full_buffer(baseline):
    for close in ("close", "del"):
        counter = [0]
        it = iter(counting_source(counter).prefetch(1))
        assert next(it) == 0
        # infinite input, buffer of one: the producer ends up blocked on the full buffer
        wait_until(lambda c=counter: c[0] >= 3, what="the producer to fill the buffer")
        if close == "close":
            it.close()
        else:
            del it
            gc.collect()
        wait_for_baseline(baseline)


def test_no_deadlock_with_nested_full_buffers(baseline):
    counter = [0]
    ds = counting_source(counter).prefetch(1).map(lambda x: x).prefetch(1).interleave(
        lambda x: Dataset.range(3).prefetch(1), cycle_length=2, num_parallel_calls=2).prefetch(1)
    it = iter(ds)
    next(it)
    wait_until(lambda: counter[0] >= 3, what="the buffers to fill")
    del it
    gc.collect()
    wait_for_baseline(baseline)


def test_errors_in_threads_leave_no_thread(baseline):
    def boom(x):
        if x == 5:
            raise KeyError(x)
        return x

    for ds in (Dataset.range(100).map(boom).prefetch(2),
               Dataset.range(100).map(boom, num_parallel_calls=3),
               Dataset.range(100).interleave(lambda x: Dataset.range(10).map(boom), cycle_length=2,
                                             num_parallel_calls=2)):
        with pytest.raises(KeyError):
            list(ds)
        gc.collect()
        wait_for_baseline(baseline)


def test_many_iterations_do_not_accumulate_threads(baseline):
    ds = Dataset.range(50).map(lambda x: x + 1, num_parallel_calls=2).prefetch(4)
    for _ in range(30):
        assert sum(ds) == sum(range(1, 51))
    wait_for_baseline(baseline)


def test_concurrent_iterations_from_several_threads(baseline):
    ds = Dataset.range(200).shuffle(50, seed=1).map(lambda x: x * 2, num_parallel_calls=2).prefetch(3)
    want = list(ds)
    results = [None] * 4

    def run(i):
        results[i] = list(ds)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(DEADLINE)
    assert results == [want] * 4
    wait_for_baseline(baseline)
