"""Input positions of data-service jobs (issue 13, section 2): provenance through the
pipeline, positions read and resumed on real clusters, bad positions, journal replay."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

import dask_dataservice as dds
from dask_dataservice.ps.input_position import InputPositionError
from dask_dataservice.service.protocol._positions import (
    PositionTracker,
    add_range,
    check_position,
    merge_positions,
    pipeline_chain,
    tracked_elements,
)
from dask_dataservice.service.protocol._runs import RunBatch, join_runs, merge_tags
from dask_dataservice.service.protocol._sharding import ShardingPolicy
from dask_dataservice.testing import gen_cluster

pytestmark = [pytest.mark.pure, pytest.mark.timeout(90)]

#: Named jobs stopped early are collected soon (the cleanup checks see idle data workers).
GC = {"dataservice.dispatcher.job-gc-timeout": "200ms", "dataservice.dispatcher.gc-interval":
      "50ms", "dataservice.dispatcher.gc-dynamic-sharding-jobs": True}

from _helpers import distribute  # noqa: E402


class _Provider:
    """Serves splits by index, as the dispatcher's provider does (``last_index``)."""

    def __init__(self, splits, order):
        self.splits, self.order = splits, list(order)
        self.last_index = None

    def get_next(self):
        if not self.order:
            return None
        self.last_index = self.order.pop(0)
        return self.splits[self.last_index]

    def reset(self):
        raise AssertionError("no repetitions here")


def _tracked(ds, order=None, start=None, split_size=4):
    """A tracking task's elements and the ledger of their runs (as the data worker has)."""
    import json

    splits = ds.splits(split_size)
    order = range(len(splits)) if order is None else order
    field = json.dumps({"start": start, "nonce": ""})
    return tracked_elements(ds._op, ShardingPolicy.DYNAMIC, _Provider(splits, order), field,
                            "w")


def _tagged(ds, order=None, start=None, split_size=4):
    """``(runs, element)`` per element: the ledger taken one element at a time."""
    it, ledger = _tracked(ds, order, start, split_size)
    out = []
    for x in it:
        runs, counts = ledger.take(1)
        assert counts == [sum(runs[2::4]), 1]
        out.append((tuple(runs), x))
    return out


def _tracker(out, k=None, reply=None):
    """A tracker after the consumer was given the first ``k`` (default: all) of ``out``
    (``_tagged``'s pairs), delivered in replies of ``reply`` elements (default: one reply)
    as the reader hands them out: each batch's list iterator is the cursor."""
    k = len(out) if k is None else k
    reply = reply or max(len(out), 1)
    t = PositionTracker("DYNAMIC", "f", None)
    for i in range(0, k, reply):
        part = out[i:i + reply]
        runs, counts = join_runs(merge_tags([tag]) for tag, _ in part)
        batch = RunBatch([x for _, x in part], runs, counts)
        cursor = iter(batch)
        t.batch(batch, cursor)
        for _ in range(min(reply, k - i)):
            next(cursor)
    return t


def _ids(x):
    return [int(v) for v in np.ravel(x)]


def test_map_keeps_provenance_one_run_per_element():
    out = _tagged(dds.Dataset.range(10).map(lambda x: x * 10), split_size=4)
    assert [x for _, x in out] == [i * 10 for i in range(10)]
    assert out[0][0] == (0, 0, 1, -1)
    assert out[3][0] == (0, 3, 1, 4)  # the last element of split 0 carries its length
    assert out[9][0] == (2, 1, 1, 2)


def test_filter_counts_consumed_inputs_not_outputs():
    out = _tagged(dds.Dataset.range(8).filter(lambda x: x % 3 == 2), split_size=4)
    assert [x for _, x in out] == [2, 5]
    # 2 consumed 0, 1, 2; 5 consumed 3 (ends split 0), 4, 5 of split 1
    assert out[0][0] == (0, 0, 3, -1)
    assert out[1][0] == (0, 3, 1, 4, 1, 0, 2, -1)
    pos = _tracker(out).position()
    assert pos["done"] == [[0, 1]] and pos["partial"] == {"1": [[0, 2]]}


def test_batch_spanning_two_splits_records_runs_of_both():
    out = _tagged(dds.Dataset.range(10).batch(3), split_size=4)
    assert [_ids(x) for _, x in out] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert out[1][0] == (0, 3, 1, 4, 1, 0, 2, -1)  # one of split 0 (its last), two of split 1
    t = _tracker(out, 2)
    assert t.position()["done"] == [[0, 1]] and t.position()["partial"] == {"1": [[0, 2]]}
    # resuming there gives exactly the rest
    rest = _tagged(dds.Dataset.range(10).batch(3), start=t.position(), split_size=4)
    assert sorted(itertools.chain.from_iterable(_ids(x) for _, x in rest)) == [6, 7, 8, 9]


def test_shuffle_moves_tags_with_elements_so_resuming_is_exact():
    ds = dds.Dataset.range(40).map(lambda x: x + 100).shuffle(16, seed=3)
    out = _tagged(ds, split_size=8)
    assert sorted(x for _, x in out) == list(range(100, 140))
    t = _tracker(out, 13, reply=5)
    given = {x for _, x in out[:13]}
    rest = _tagged(ds, start=t.position(), split_size=8)
    assert sorted(given | {x for _, x in rest}) == list(range(100, 140))
    assert not given & {x for _, x in rest}


def test_done_splits_are_skipped_and_partial_splits_resume():
    start = {"format": 1, "policy": "DYNAMIC", "dataset": "f", "done": [[0, 2]],
             "partial": {"2": [[0, 3]]}}
    out = _tagged(dds.Dataset.range(16), start=start, split_size=4)
    assert [x for _, x in out] == [11, 12, 13, 14, 15]


@pytest.mark.component
@pytest.mark.parametrize("make", [
    lambda d: d.map(lambda x: x + 1000, num_parallel_calls=3).prefetch(4).batch(7),
    lambda d: d.map(lambda x: x + 1000, num_parallel_calls=3, deterministic=False).batch(7),
    lambda d: d.map(lambda x: x + 1000).filter(lambda x: x % 5 != 0).batch(7),
    lambda d: d.map(lambda x: x + 1000).batch(7).prefetch(2),
], ids=["parallel-map-prefetch-batch", "unordered-map", "filter", "batch-then-prefetch"])
def test_any_prefix_resumes_to_exactly_the_rest(make):
    """Every prefix of the output, as a position, resumes to exactly the other elements
    (split size 8 and batches of 7: batches span splits)."""
    ds = make(dds.Dataset.range(50))
    out = _tagged(ds, split_size=8)
    every = sorted(itertools.chain.from_iterable(_ids(x) for _, x in out))
    for k in range(len(out) + 1):
        t = _tracker(out, k, reply=3)
        given = list(itertools.chain.from_iterable(_ids(x) for _, x in out[:k]))
        rest = _tagged(ds, start=t.position(), split_size=8)
        got = given + list(itertools.chain.from_iterable(_ids(x) for _, x in rest))
        assert sorted(got) == every, k
    assert t.position()["done"] == [[0, 7]] and not t.position()["partial"]  # all of it


def _replies(ds, sizes, split_size=4, start=None):
    """The task's elements as a data worker serves them: a take of ``sizes[i]`` elements
    (cycling) once they were produced, each take's runs from the ledger, one RunBatch each."""
    it, ledger = _tracked(ds, start=start, split_size=split_size)
    out = []
    for n in itertools.cycle(sizes):
        items = list(itertools.islice(it, n))
        if not items:
            return out
        out.append(RunBatch(items, *ledger.take(len(items))))


def _given(replies, k):
    """A tracker after the consumer took ``k`` elements of ``replies``, as the reader hands
    them out (``ReadStats.wrap``: the batch's list iterator is the cursor)."""
    t = PositionTracker("DYNAMIC", "f", None)
    for batch in replies:
        cursor = iter(batch)
        t.batch(batch, cursor)
        for _ in itertools.islice(cursor, k):
            k -= 1
        if k == 0:
            break
    return t


@pytest.mark.parametrize("make, ledger", [
    (lambda d: d, "FifoLedger"),
    (lambda d: dds.Dataset.from_tensor_slices(np.arange(30)), "FifoLedger"),
    (lambda d: d.map(lambda x: x + 1000).prefetch(3), "FifoLedger"),
    (lambda d: d.filter(lambda x: x % 3 != 1), "TagLedger"),
    (lambda d: d.batch(3), "TagLedger"),
    (lambda d: d.shuffle(6, seed=1), "TagLedger"),
], ids=["range", "tensor-slices", "map-prefetch", "filter", "batch", "shuffle"])
def test_a_position_read_between_two_elements_of_one_reply_is_exact(make, ledger):
    """Replies of 7 and 5 elements spanning splits of 4: after every element, the
    position is exactly the source elements of what the consumer was given (the element
    it holds included), and resuming from it gives exactly the rest. (A range's splits
    are counted by their length; tensor slices' by the look-ahead counter.)"""
    ds = make(dds.Dataset.range(30))
    assert type(_tracked(ds)[1]).__name__ == ledger
    replies = _replies(ds, [7, 5])
    elements = [x for r in replies for x in r]
    every = sorted(itertools.chain.from_iterable(_ids(x) for x in elements))
    for k in range(len(elements) + 1):
        given = list(itertools.chain.from_iterable(_ids(x) for x in elements[:k]))
        position = _given(replies, k).position()
        rest = [v for r in _replies(ds, [4], start=position) for x in r for v in _ids(x)]
        assert sorted(given + rest) == every, k
        assert not set(given) & set(rest), k
    assert position["done"] == [[0, 8]] and not position["partial"]


def test_scalar_replies_carry_one_run_per_split_and_one_count():
    replies = _replies(dds.Dataset.range(10), [6, 4])
    assert replies[0].runs == [0, 0, 4, 4, 1, 0, 2, -1] and replies[0].counts == [1, 6]
    assert replies[1].runs == [1, 2, 2, 4, 2, 0, 2, 2] and replies[1].counts == [1, 4]
    batched = _replies(dds.Dataset.range(10).batch(3), [4])
    assert batched[0].counts == [3, 3, 1, 1]  # three batches of 3, then one of 1


def test_run_lists_travel_in_the_header_and_come_back_as_run_batches():
    from distributed.protocol import dumps, loads, to_serialize

    from dask_dataservice.service.protocol._messages import ElementBatch

    runs = (["w", 0, 5, -1, "w", 7, 2, 9], [1, 3, 2, 2])
    frames = dumps({"elements": to_serialize(ElementBatch([np.arange(3)] * 5, runs))})
    got = loads(frames)["elements"].items
    assert isinstance(got, RunBatch) and len(got) == 5
    assert (got.runs, got.counts) == tuple(runs)
    plain = loads(dumps({"elements": to_serialize(ElementBatch([1, 2]))}))["elements"].items
    assert type(plain) is list
    with pytest.raises(InputPositionError, match="older version"):
        PositionTracker("OFF", "f", None).batch(plain, iter(plain))


@pytest.mark.parametrize("make, op", [
    (lambda d: d.repeat(2), "repeat"),
    (lambda d: d.take(3), "take"),
    (lambda d: d.batch(2).unbatch(), "unbatch"),
    (lambda d: d.enumerate(), "enumerate"),
])
def test_ops_without_provenance_are_refused_by_name(make, op):
    with pytest.raises(InputPositionError, match=rf"Dataset\.{op}\(\)"):
        _tagged(make(dds.Dataset.range(8)))


def test_a_chain_of_one_source_is_required():
    ds = dds.Dataset.zip((dds.Dataset.range(4), dds.Dataset.range(4)))
    with pytest.raises(InputPositionError, match="combines 2 inputs"):
        pipeline_chain(ds._op)


def test_ranges_merge():
    r = []
    for s, e in [(5, 7), (0, 2), (2, 3), (10, 11), (3, 5), (8, 9)]:
        add_range(r, s, e)
    assert r == [[0, 7], [8, 9], [10, 11]]
    add_range(r, 6, 10)
    assert r == [[0, 11]]


def test_merged_positions_of_two_consumers_are_their_union():
    a = {"format": 1, "policy": "DYNAMIC", "dataset": "f", "done": [[0, 1]],
         "partial": {"1": [[0, 3]], "2": [[5, 6]]}}
    b = {"format": 1, "policy": "DYNAMIC", "dataset": "f", "done": [[3, 4]],
         "partial": {"1": [[3, 5]], "2": [[0, 5]]}}
    m = merge_positions([a, b])
    assert m["done"] == [[0, 1], [3, 4]]
    assert m["partial"] == {"1": [[0, 5]], "2": [[0, 6]]}
    with pytest.raises(InputPositionError, match="another dataset"):
        merge_positions([a, dict(b, dataset="g")])


@pytest.mark.parametrize("bad, message", [
    (7, "is a dict"),
    ({"policy": "DYNAMIC"}, "not an input position"),
    ({"format": 2, "policy": "DYNAMIC", "dataset": "f", "done": [], "partial": {}}, "format 2"),
    ({"format": 1, "policy": "DATA", "dataset": "f", "done": [], "partial": {}}, "policy"),
    ({"format": 1, "policy": "DYNAMIC", "dataset": "f", "done": [[3, 1]], "partial": {}},
     "start < stop"),
    ({"format": 1, "policy": "DYNAMIC", "dataset": "f", "done": [], "partial": {"a": [[0, 1]]}},
     "split indices"),
    ({"format": 1, "policy": "OFF", "dataset": "f", "done": [1], "partial": {}},
     "data-worker names"),
])
def test_nonsense_positions_are_refused(bad, message):
    with pytest.raises(InputPositionError, match=message):
        check_position(bad)


# ---------------------------------------------------------------------------------------
# on a cluster
# ---------------------------------------------------------------------------------------


def _take(ds, n):
    it = iter(ds)
    out = [_ids(next(it)) for _ in range(n)]
    return out, it


@pytest.mark.cluster
@gen_cluster(client=True, nthreads=[("", 1), ("", 1)], config=GC)
async def test_dynamic_read_part_resume_rest_exactly_once(c, s, a, b):
    source = dds.Dataset.range(100).map(lambda x: x * 1).batch(3)
    ds = await distribute(source, "distributed_epoch", c, job_name="train",
                          track_position=True, split_size=8)

    def first_life():
        got, it = _take(ds, 10)
        position = ds.input_position()
        it.close()
        return got, position

    got, position = await asyncio.to_thread(first_life)
    assert position["policy"] == "DYNAMIC" and position["format"] == 1
    resumed = ds.start_from(position)
    rest = await asyncio.to_thread(lambda: [_ids(x) for x in resumed])
    seen = sorted(itertools.chain.from_iterable(got + rest))
    assert seen == list(range(100))  # no element twice, none lost
    # ignoring the position would repeat elements: the test can fail
    again = await asyncio.to_thread(lambda: [_ids(x) for x in ds])
    assert len(set(itertools.chain.from_iterable(got)) & set(
        itertools.chain.from_iterable(again))) > 0


@pytest.mark.cluster
@gen_cluster(client=True, nthreads=[("", 1), ("", 1)])
async def test_off_positions_are_per_data_worker_name(c, s, a, b):
    ds = await distribute(dds.Dataset.range(30), "parallel_epochs", c, track_position=True)

    def first_life():
        got, it = _take(ds, 25)
        position = ds.input_position()
        it.close()
        return got, position

    got, position = await asyncio.to_thread(first_life)
    assert position["policy"] == "OFF"
    assert set(position["partial"]) | set(position["done"]) <= {str(a.name), str(b.name)}
    rest = await asyncio.to_thread(lambda: [_ids(x) for x in ds.start_from(position)])
    counts = np.bincount(list(itertools.chain.from_iterable(got + rest)), minlength=30)
    np.testing.assert_array_equal(counts, np.full(30, 2))  # two workers, one epoch each


@pytest.mark.cluster
@gen_cluster(client=True, nthreads=[("", 1)])
async def test_a_position_of_another_dataset_is_refused_naming_both(c, s, a):
    ds = await distribute(dds.Dataset.range(20), "distributed_epoch", c, track_position=True)
    other = await distribute(dds.Dataset.range(21), "distributed_epoch", c,
                             track_position=True)
    await asyncio.to_thread(lambda: list(ds))
    position = ds.input_position()
    assert position["done"] and not position["partial"]
    with pytest.raises(InputPositionError, match="another dataset.*fingerprint"):
        await asyncio.to_thread(lambda: list(other.start_from(position)))


@pytest.mark.cluster
@gen_cluster(client=True, nthreads=[("", 1)])
async def test_a_pipeline_that_loses_provenance_fails_naming_the_op(c, s, a):
    ds = await distribute(dds.Dataset.range(20).repeat(2), "distributed_epoch", c,
                          track_position=True)
    with pytest.raises(InputPositionError, match=r"Dataset\.repeat\(\)"):
        await asyncio.to_thread(lambda: list(ds))


@pytest.mark.cluster
@gen_cluster(client=True, nthreads=[("", 1)])
async def test_untracked_and_read_ahead_datasets_have_no_position(c, s, a):
    plain = await distribute(dds.Dataset.range(20), "distributed_epoch", c)
    with pytest.raises(InputPositionError, match="track_position=True"):
        plain.input_position()
    tracked = await distribute(dds.Dataset.range(20), "distributed_epoch", c,
                               track_position=True)
    with pytest.raises(InputPositionError, match="not been read yet"):
        tracked.input_position()
    from dask_dataservice.service.client._position_reader import dataset_position

    with pytest.raises(InputPositionError, match=r"Dataset\.prefetch\(\) applied on the "):
        dataset_position(tracked.prefetch(4))
    with pytest.raises(InputPositionError, match="coordinated reads"):
        dds.from_dataset_id("distributed_epoch", c, tracked.dataset_id, job_name="j",
                            consumer_index=0, num_consumers=2, track_position=True)


@pytest.mark.cluster
@gen_cluster(client=True, nthreads=[("", 1), ("", 1)], config=GC)
async def test_two_consumers_of_a_shared_job_resume_from_their_union(c, s, a, b):
    """Each consumer reads ahead (its channel holds elements it was not given yet): their
    union is not a prefix of any split, and resuming from it gives exactly the rest."""
    # big enough that neither consumer's read-ahead takes the whole job (a consumer of a
    # shared job takes elements first come, first served)
    n = 20_000
    ds = await distribute(dds.Dataset.range(n), "distributed_epoch", c, job_name="shared",
                          track_position=True, split_size=512)
    import dask_dataservice.service.client as client_module

    def consumer(n):
        reader = client_module.from_dataset_id("distributed_epoch", c, ds.dataset_id,
                                               job_name="shared", track_position=True)
        got, it = _take(reader, n)
        return got, reader.input_position(), it

    (got_a, pos_a, it_a), (got_b, pos_b, it_b) = await asyncio.gather(
        asyncio.to_thread(consumer, 300), asyncio.to_thread(consumer, 450))
    await asyncio.to_thread(it_a.close)
    await asyncio.to_thread(it_b.close)
    given = list(itertools.chain.from_iterable(got_a + got_b))
    assert len(given) == len(set(given)) == 750
    rest = await asyncio.to_thread(lambda: [int(x) for x in ds.start_from([pos_a, pos_b])])
    assert sorted(given + rest) == list(range(n))


# ---------------------------------------------------------------------------------------
# the job's start position in the journal
# ---------------------------------------------------------------------------------------


def test_create_job_position_round_trips_and_old_records_have_none():
    import msgpack

    from dask_dataservice.service.dispatcher._updates import CreateJob, decode_update, encode_update

    job = CreateJob(job_id=3, job_name="j", dataset_id=1, processing_mode="DYNAMIC",
                    position='{"nonce":"","start":null}')
    assert decode_update(encode_update(job)) == job
    old = msgpack.packb(["CreateJob", {"job_id": 3, "job_name": "j", "dataset_id": 1,
                                       "processing_mode": "DYNAMIC"}])
    assert decode_update(old).position == ""  # written before the field existed: plain job
    with pytest.raises(TypeError, match="position must be str"):
        CreateJob(job_id=3, job_name="j", dataset_id=1, processing_mode="DYNAMIC", position=1)


@pytest.mark.cluster
def test_the_journal_replays_a_job_started_from_a_position(tmp_path):
    import json

    from distributed import Client

    from dask_dataservice.service.dispatcher._state_codec import restore
    from dask_dataservice.service.dispatcher.journal import load_journal

    cfg = dds.DispatcherConfig(fault_tolerant_mode=True, work_dir=str(tmp_path))
    with dds.DispatchServer(cfg) as dispatcher, \
            dds.WorkerServer(dds.WorkerConfig(dispatcher._address)):
        with Client(dispatcher.target) as c:
            ds = dds.Dataset.range(64).apply(dds.distribute(
                "distributed_epoch", c, job_name="train", track_position=True, split_size=8))
            it = iter(ds)
            first = [int(next(it)) for _ in range(20)]
            position = ds.input_position()
            it.close()
            rest = [int(x) for x in ds.start_from(position, nonce="r1")]
            assert sorted(first + rest) == list(range(64))
            plugin = dispatcher.server.plugins["dataservice-dispatcher"]
            live = {j.job_id: j.position for j in plugin.state._jobs.values()}
    restored, _ = restore(*load_journal(tmp_path))
    assert {j.job_id: j.position for j in restored._jobs.values()} == live
    started = [json.loads(p) for p in live.values() if p and json.loads(p)["start"]]
    assert len(started) == 1 and started[0]["nonce"] == "r1"
    assert check_position(started[0]["start"]) == check_position(position)


@pytest.mark.cluster
@gen_cluster(client=True, nthreads=[("", 1)], config=GC)
async def test_async_for_records_the_position_too(c, s, a):
    ds = await distribute(dds.Dataset.range(40).batch(4), "distributed_epoch", c,
                          job_name="aio", track_position=True, split_size=8)
    got = []
    async for x in ds:
        got.append(_ids(x))
        if len(got) == 3:
            break
    position = ds.input_position()
    rest = await asyncio.to_thread(lambda: [_ids(x) for x in ds.start_from(position)])
    assert sorted(itertools.chain.from_iterable(got + rest)) == list(range(40))
