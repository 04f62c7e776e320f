"""Journal snapshots: compaction, every crash point, damage found at replay, what is not journaled.

Real files in a temporary directory, the real state codec and, for the crashes, a real
process killed with SIGKILL while it appends and compacts.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import warnings

import dask
import pytest
from _helpers import ft_dispatcher, ok
from distributed.utils_test import gen_test

from dask_dataservice.service.dispatcher._journal_lineage import (
    read_manifest,
    snapshot_crc,
    write_manifest,
)
from dask_dataservice.service.dispatcher._state_codec import (
    compact,
    decode_state,
    encode_state,
    restore,
)
from dask_dataservice.service.dispatcher.journal import (
    JournalCorruptedError,
    JournalWriter,
    list_segments,
    list_snapshots,
    load_journal,
    remove_covered,
    scan_journal,
    segment_path,
    snapshot_path,
    write_snapshot,
)
from dask_dataservice.service.dispatcher.state import (
    AckSplits,
    CreateIteration,
    CreateJob,
    CreateTask,
    DispatcherState,
    ProduceSplits,
    RegisterDataset,
    RegisterWorker,
    RemoveWorker,
    encode_update,
)

pytestmark = [pytest.mark.pure, pytest.mark.timeout(120)]

W = "tcp://10.0.0.1:1"


def setup_updates(num_splits=10):
    """A DYNAMIC iteration with one task on one worker."""
    return [
        RegisterDataset(1000, "fp", b"pipeline", b"splits", num_splits),
        RegisterWorker(W, "10.0.0.1", 1),
        CreateJob(5000, "job", 1000, "DYNAMIC"),
        CreateIteration(2000, 5000, 0),
        CreateTask(4000, 2000, W),
    ]


def split_updates(state, n, num_splits=10):
    """``n`` legal updates handing out splits (and acknowledging them) from ``state`` on."""
    out = []
    for _ in range(n):
        repetition, index, total = state.split_position(2000)
        count = min(3, total - index)
        update = ProduceSplits(2000, repetition, index, count, 4000, count == total - index)
        state.apply(update)
        out.append(update)
        held = state.task_splits(4000)
        if len(held) > 4:
            ack = AckSplits(4000, *held[-3])
            state.apply(ack)
            out.append(ack)
    return out


def write_segments(work_dir, per_segment, crash=False):
    """One segment per list of updates (each writer start is a new segment); the state.
    ``crash``: the last writer dies after its last fsync instead of closing."""
    state = DispatcherState()
    for updates in per_segment:
        with JournalWriter.open(work_dir) as writer:
            for update in updates:
                state.apply(update)
                writer.append_sync(encode_update(update))
    if crash:
        manifest = read_manifest(work_dir)
        del manifest.closed[manifest.segment]
        write_manifest(work_dir, manifest)
    return state


def name_snapshot(work_dir, base):
    """What a writer does once a snapshot is renamed into place: its manifest names it (and
    forgets the segments it covers), before anything it covers is deleted."""
    manifest = read_manifest(work_dir)
    manifest.snapshot = (base, snapshot_crc(snapshot_path(work_dir, base)))
    manifest.closed = {k: v for k, v in manifest.closed.items() if k >= base}
    write_manifest(work_dir, manifest)


def replayed(work_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no torn tail anywhere in these journals
        state, _ = restore(*load_journal(work_dir))
    state.validate_state()
    return state


# -- the codec -----------------------------------------------------------------------------------


def test_a_snapshot_is_small_and_decodes_to_the_same_state():
    state = DispatcherState()
    for update in setup_updates(num_splits=1_000_000):
        state.apply(update)
    split_updates(state, 2000, num_splits=1_000_000)
    data = encode_state(state)
    assert decode_state(data) == state
    assert len(data) < 2_000
    with pytest.raises(ValueError, match="unsupported state snapshot version"):
        decode_state(encode_update(RemoveWorker(W)))


# -- compaction by the writer ------------------------------------------------------------------


@pytest.mark.component
def test_the_writer_folds_old_segments_into_a_snapshot(tmp_path):
    state = DispatcherState()
    updates = setup_updates() + split_updates(
        _applied(DispatcherState(), setup_updates()), 300)

    async def write():
        writer = JournalWriter.open(tmp_path, compact=compact, snapshot_records=40)
        try:
            for update in updates:
                state.apply(update)
                await writer.append(encode_update(update))
            await compactions_done(writer)
            return writer.metrics
        finally:
            await writer.aclose()

    metrics = asyncio.run(write())
    assert metrics.rotations >= len(updates) // 40 - 1
    assert metrics.snapshots_written >= 1 and metrics.compaction_errors == 0
    assert metrics.sync_thread_names.isdisjoint({"MainThread"})
    # bounded: the newest snapshot and the segments from its base on, nothing older
    [(base, _)] = list_snapshots(tmp_path)
    assert [n for n, _ in list_segments(tmp_path)][0] == base
    assert len(list_segments(tmp_path)) <= 3
    assert replayed(tmp_path) == state


async def compactions_done(writer):
    """Wait for the compaction of the last rotation (queued after every earlier one)."""
    if writer._compaction is not None:
        await asyncio.wrap_future(writer._compaction)


def _applied(state, updates):
    for update in updates:
        state.apply(update)
    return state


@pytest.mark.component
def test_journal_bytes_stay_bounded_by_the_state_not_the_history(tmp_path):
    """Ten times the history does not make the journal ten times larger."""

    def journal_bytes(n):
        work_dir = tmp_path / str(n)
        state = _applied(DispatcherState(), setup_updates())
        updates = setup_updates() + split_updates(state, n)

        async def write():
            async with JournalWriter(work_dir, compact=compact, snapshot_records=100) as writer:
                writer.start()
                for update in updates:
                    await writer.append(encode_update(update))
                await compactions_done(writer)

        asyncio.run(write())
        assert replayed(work_dir) == state
        return sum(p.stat().st_size for p in work_dir.iterdir())

    small, large = journal_bytes(300), journal_bytes(3000)
    assert large < 2 * small, (small, large)


def test_a_large_state_still_folds_after_twice_the_records(tmp_path):
    """Issue 22 s5: a state of 2 MB (a big pipeline) was never folded by 1,000 small
    records (a quarter of its size first), so a restart replayed them all; twice
    ``snapshot_records`` fold it whatever its size."""
    big = RegisterDataset(1000, "fp", os.urandom(2_000_000), b"splits", 10_000)
    state = _applied(DispatcherState(), [big, *setup_updates()[1:]])
    updates = [big, *setup_updates()[1:]] + split_updates(state, 700)

    async def write():
        async with JournalWriter(tmp_path, compact=compact, snapshot_records=50) as writer:
            writer.start()
            for update in updates[:1]:
                await writer.append(encode_update(update))
            await asyncio.wrap_future(writer.request_snapshot())  # the big snapshot first
            for update in updates[1:]:
                await writer.append(encode_update(update))
            await compactions_done(writer)
            return writer.metrics

    metrics = asyncio.run(write())
    assert replayed(tmp_path) == state
    assert metrics.snapshots_written > 1
    # the records after the newest snapshot: fewer than twice snapshot_records
    assert len(list(scan_journal(tmp_path))) < 100


@pytest.mark.component
def test_a_long_replayed_tail_can_be_folded_at_once(tmp_path):
    state = write_segments(tmp_path, [setup_updates(), split_updates(
        _applied(DispatcherState(), setup_updates()), 50)])
    writer = JournalWriter.open(tmp_path, compact=compact)
    try:
        writer.request_snapshot().result(timeout=30)
    finally:
        writer.close()
    assert [b for b, _ in list_snapshots(tmp_path)] == [2]
    assert [n for n, _ in list_segments(tmp_path)] == [2]
    assert replayed(tmp_path) == state


@pytest.mark.component
def test_closing_abandons_a_compaction_under_way(tmp_path):
    write_segments(tmp_path, [setup_updates()])
    started, release = threading.Event(), threading.Event()

    def slow_compact(snapshot, records):
        started.set()
        release.wait(10)
        return compact(snapshot, records)

    writer = JournalWriter.open(tmp_path, compact=slow_compact)
    future = writer.request_snapshot()
    assert started.wait(10)
    writer._stop_compaction.set()
    release.set()
    writer.close()
    assert future.done()
    assert list_snapshots(tmp_path) == []  # abandoned: the journal is as it was
    assert writer.metrics.compaction_errors == 0


# -- every crash point of a compaction -----------------------------------------------------------


def _crash_layouts():
    """(base, segments deleted, older snapshot kept, partial .tmp left) a crash can leave."""
    for base in (1, 2, 3):
        for k in range(base + 1):
            for deleted in itertools.combinations(range(base), k):
                for older in (False, True):
                    for tmp in (False, True):
                        if older and base == 1:
                            continue
                        yield base, deleted, older, tmp


@pytest.mark.parametrize("base,deleted,older,tmp", list(_crash_layouts()))
def test_every_crash_point_of_a_compaction_replays_to_the_same_state(
        tmp_path, base, deleted, older, tmp):
    """Four segments; a snapshot of the first ``base``, renamed into place, then a crash that
    left any subset of the covered segments (and maybe an older snapshot, and a partial
    ``.tmp`` of a later one)."""
    seed = _applied(DispatcherState(), setup_updates())
    per_segment = [setup_updates()] + [split_updates(seed, 8) for _ in range(3)]
    state = write_segments(tmp_path, per_segment)
    if older:
        write_snapshot(tmp_path, 1, compact(None, scan_segments(tmp_path, range(1))))
    write_snapshot(tmp_path, base, compact(None, scan_segments(tmp_path, range(base))))
    if deleted:  # else the crash came before the manifest named the snapshot
        name_snapshot(tmp_path, base)
    if tmp:
        partial = snapshot_path(tmp_path, 4).with_suffix(".tmp")
        partial.write_bytes(snapshot_path(tmp_path, base).read_bytes()[:50])
    for number in deleted:
        segment_path(tmp_path, number).unlink()
    assert replayed(tmp_path) == state
    # the next start cleans up, and the journal still replays the same
    JournalWriter.open(tmp_path).close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ([f"journal_{n:08d}" for n in range(base, 5)] + ["manifest"]
                     + [f"snapshot_{base:08d}"])
    assert replayed(tmp_path) == state


def scan_segments(work_dir, numbers):
    from dask_dataservice.service.dispatcher._journal_format import _scan_segment

    for number in numbers:
        yield from _scan_segment(segment_path(work_dir, number), is_last=False, repair=False,
                                 next_path=None)


def test_a_partial_snapshot_alone_is_ignored(tmp_path):
    state = write_segments(tmp_path, [setup_updates()])
    (tmp_path / "snapshot_00000001.tmp").write_bytes(b"DDSSNAP\x00\x01")
    assert replayed(tmp_path) == state
    assert remove_covered(tmp_path) == [tmp_path / "snapshot_00000001.tmp"]


def test_a_damaged_snapshot_is_corruption_naming_it(tmp_path):
    write_segments(tmp_path, [setup_updates(), []])
    path = write_snapshot(tmp_path, 1, compact(None, scan_segments(tmp_path, range(1))))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(JournalCorruptedError, match="snapshot payload checksum mismatch") as e:
        load_journal(tmp_path)
    assert e.value.path == path and e.value.offset == 36


def test_a_snapshot_without_its_base_segment_is_corruption(tmp_path):
    write_segments(tmp_path, [setup_updates(), []])
    write_snapshot(tmp_path, 1, compact(None, scan_segments(tmp_path, range(1))))
    name_snapshot(tmp_path, 1)
    segment_path(tmp_path, 1).unlink()
    with pytest.raises(JournalCorruptedError, match="journal_00000001 is corrupted at byte "
                       "offset 0: the file is missing: the manifest names it as the newest"):
        replayed(tmp_path)


# -- damage found only at replay -----------------------------------------------------------------


def test_a_record_illegal_for_the_state_is_corruption_with_file_and_offset(tmp_path):
    """A record that decodes and passes its CRC but cannot follow the records before it
    (here: a task of a worker that never registered) names its file and byte offset."""
    write_segments(tmp_path, [setup_updates()])
    with JournalWriter.open(tmp_path) as writer:
        writer.append_sync(encode_update(CreateTask(4001, 2000, "tcp://nobody:1")))
    path = segment_path(tmp_path, 1)
    with pytest.raises(JournalCorruptedError) as e:
        replayed(tmp_path)
    assert (e.value.path, e.value.offset) == (path, 16)
    assert str(path) in str(e.value) and "byte offset 16" in str(e.value)
    assert "WorkerNotFoundError" in str(e.value)
    # same through a snapshot: the record after it is checked against the snapshot's state
    write_snapshot(tmp_path, 1, compact(None, scan_segments(tmp_path, range(1))))
    with pytest.raises(JournalCorruptedError, match="snapshot snapshot_00000001") as e:
        replayed(tmp_path)
    assert (e.value.path, e.value.offset) == (path, 16)


def test_an_undecodable_record_is_corruption_with_file_and_offset(tmp_path):
    with JournalWriter.open(tmp_path) as writer:
        writer.append_sync(encode_update(setup_updates()[0]))
        writer.append_sync(b"\x92\xa3Bad\x80")
    with pytest.raises(JournalCorruptedError, match="unknown update type 'Bad'") as e:
        replayed(tmp_path)
    assert e.value.offset > 16


def test_a_journal_cut_at_a_record_boundary_is_a_shorter_journal(tmp_path):
    """After a crash, nothing tells such a cut of the last segment from a writer that
    appended less: no warning, the prefix's state (what is promised: acknowledged records
    are durable; see docs/guarantees.md). After a clean close, the manifest tells."""
    updates = setup_updates()
    write_segments(tmp_path, [updates], crash=True)
    offsets = [r.offset for r in scan_journal(tmp_path)]
    path = segment_path(tmp_path, 0)
    os.truncate(path, offsets[3])
    assert replayed(tmp_path) == _applied(DispatcherState(), updates[:3])


def test_a_cleanly_closed_segment_cut_at_a_record_boundary_is_corruption(tmp_path):
    updates = setup_updates()
    write_segments(tmp_path, [updates])
    offsets = [r.offset for r in scan_journal(tmp_path)]
    size = segment_path(tmp_path, 0).stat().st_size
    os.truncate(segment_path(tmp_path, 0), offsets[3])
    with pytest.raises(JournalCorruptedError) as e:
        replayed(tmp_path)
    assert str(e.value) == (
        f"journal {segment_path(tmp_path, 0)} is corrupted at byte offset {offsets[3]}: the "
        f"segment is {offsets[3]} bytes, but it held {size} bytes when its writer closed it "
        "(truncated, or replaced by an older copy)")


# -- a real process killed while it appends and compacts ---------------------------------------

CHILD = textwrap.dedent("""
    import asyncio, sys
    from dask_dataservice.service.dispatcher._state_codec import compact, restore
    from dask_dataservice.service.dispatcher.journal import JournalWriter, load_journal
    from dask_dataservice.service.dispatcher.state import *

    work_dir = sys.argv[1]
    state, _ = restore(*load_journal(work_dir))

    async def main():
        writer = JournalWriter.open(work_dir, compact=compact, snapshot_records=25)
        if not state.list_datasets():
            for u in [RegisterDataset(1000, "fp", b"p", b"s", 7),
                      RegisterWorker("tcp://w:1", "w", 1),
                      CreateJob(5000, "job", 1000, "DYNAMIC"), CreateIteration(2000, 5000, 0)]:
                state.apply(u)
                await writer.append(encode_update(u))
        else:  # what a restarted dispatcher does: the previous run's worker is gone (unless
            # the previous run was killed between its own RemoveWorker and RegisterWorker)
            live = [w.address for w in state.list_workers()]
            for u in [RemoveWorker("tcp://w:1")] * len(live) + [RegisterWorker("tcp://w:1", "w", 1)]:
                state.apply(u)
                await writer.append(encode_update(u))
        while True:
            task_id = state.next_task_id()
            for u in [CreateTask(task_id, 2000, "tcp://w:1")]:
                state.apply(u)
                await writer.append(encode_update(u))
            for _ in range(20):
                rep, index, total = state.split_position(2000)
                u = ProduceSplits(2000, rep, index, min(2, total - index), task_id,
                                  index + 2 >= total)
                state.apply(u)
                await writer.append(encode_update(u))
                print(rep, index, flush=True)   # acknowledged: durable
            u = RemoveWorker("tcp://w:1")
            state.apply(u)
            await writer.append(encode_update(u))
            u = RegisterWorker("tcp://w:1", "w", 1)
            state.apply(u)
            await writer.append(encode_update(u))

    asyncio.run(main())
""")


@pytest.mark.slow
@pytest.mark.process
def test_sigkill_while_appending_and_compacting_keeps_every_acknowledged_record(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    work_dir = tmp_path / "journal"
    for round_ in range(6):
        proc = subprocess.Popen([sys.executable, str(script), str(work_dir)],
                                stdout=subprocess.PIPE, text=True)
        acknowledged = None
        try:
            for i, line in enumerate(proc.stdout):
                acknowledged = tuple(map(int, line.split()))
                if i >= 150 + 37 * round_:  # a different point each round
                    break
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc.stdout.close()
        assert acknowledged is not None, f"round {round_}: the child acknowledged nothing"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a torn tail is allowed after a SIGKILL
            state, _ = restore(*load_journal(work_dir))
        state.validate_state()
        repetition, index, _ = state.split_position(2000)
        assert (repetition, index) > acknowledged, (round_, acknowledged)
    assert list_snapshots(work_dir), "compactions ran"


# -- the dispatcher: what it journals, what it replays ------------------------------------------


@pytest.mark.cluster
@gen_test(timeout=60)
async def test_heartbeats_are_not_journaled_and_a_get_split_call_is_one_record(tmp_path):
    async with ft_dispatcher(tmp_path) as plugin:
        dataset_id = ok(await plugin.register_dataset(
            fingerprint="fp", pipeline=b"p", splits=b"s", num_splits=100))["dataset_id"]
        job_id = ok(await plugin.get_or_create_job(
            dataset_id=dataset_id, processing_mode="DYNAMIC"))["job_id"]
        token = plugin.state.job(job_id).token  # the job's capability (issue 11 s6)
        view = ok(await plugin.get_or_create_iteration(job_id=job_id, job_token=token))
        records = plugin._journal.metrics.records_written
        for _ in range(50):
            ok(plugin.client_heartbeat(iteration_client_id=view["iteration_client_id"],
                                       job_token=token))
        assert plugin._journal.metrics.records_written == records
        # the dispatcher still knows the client is alive (in memory)
        assert view["iteration_client_id"] in plugin._client_seen
        # a task to ask for splits, journaled as the dispatcher would for a worker
        plugin._apply(RegisterWorker(W, "10.0.0.1", 1))
        plugin._apply(CreateTask(plugin.state.next_task_id(), view["iteration_id"], W))
        await plugin._wait_durable()
        records = plugin._journal.metrics.records_written
        [task] = plugin.state.tasks_for_iteration(view["iteration_id"])
        reply = ok(await plugin.get_split(iteration_id=view["iteration_id"],
                                          task_id=task.task_id, repetition=0, count=64,
                                          job_token=token))
        assert reply["split_indices"] == list(range(64))
        assert not reply["end_of_splits"]
        assert plugin._journal.metrics.records_written == records + 1
        reply = ok(await plugin.get_split(iteration_id=view["iteration_id"],
                                          task_id=task.task_id, repetition=0, count=64,
                                          job_token=token))
        assert reply["split_indices"] == list(range(64, 100))
        assert reply["end_of_splits"]  # said with the last splits, no extra round trip
        assert plugin._journal.metrics.records_written == records + 2
        ok(await plugin.release_iteration_client(
            iteration_client_id=view["iteration_client_id"], job_token=token))
        assert plugin._client_seen == {}


@pytest.mark.cluster
@gen_test(timeout=60)
async def test_a_dispatcher_refuses_to_start_on_a_journal_damaged_for_replay(tmp_path):
    """Issue 11 s4: not WorkerNotFoundError/IllegalUpdateError without a place, but
    JournalCorruptedError naming the file and the byte offset."""
    write_segments(tmp_path, [setup_updates()])
    with JournalWriter.open(tmp_path) as writer:
        writer.append_sync(encode_update(RemoveWorker("tcp://nobody:1")))
    with pytest.raises(JournalCorruptedError) as e:
        async with ft_dispatcher(tmp_path):
            pass
    assert (e.value.path, e.value.offset) == (segment_path(tmp_path, 1), 16)
    assert "journal_00000001 is corrupted at byte offset 16" in str(e.value)


def test_the_journal_is_readable_by_its_owner_only(tmp_path):
    """It holds pickled pipelines (issue 11 s6): directory 0700, segments and snapshots 0600."""
    work_dir = tmp_path / "a" / "journal"
    write_segments(work_dir, [setup_updates(), []])
    write_snapshot(work_dir, 1, compact(None, scan_segments(work_dir, range(1))))
    assert (work_dir.stat().st_mode & 0o777, work_dir.parent.stat().st_mode & 0o777) == (
        0o700, 0o700)
    assert {p.stat().st_mode & 0o777 for p in work_dir.iterdir()} == {0o600}


@pytest.mark.cluster
@gen_test(timeout=60)
async def test_a_restart_that_replayed_a_long_tail_folds_it_into_a_snapshot(tmp_path):
    """So that the next restart does not replay it again."""
    seed = _applied(DispatcherState(), setup_updates(num_splits=1000))
    state = write_segments(tmp_path, [setup_updates(num_splits=1000),
                                      split_updates(seed, 300, num_splits=1000)])
    with dask.config.set({"dataservice.dispatcher.snapshot-records": 500}):
        async with ft_dispatcher(tmp_path) as plugin:
            assert plugin.recovered_updates > 250
            await asyncio.wrap_future(plugin._journal._compaction)
            assert [base for base, _ in list_snapshots(tmp_path)] == [2]
            assert plugin.state.split_position(2000) == state.split_position(2000)
        async with ft_dispatcher(tmp_path) as plugin:
            # the snapshot alone: the first restart journaled nothing (its worker was pending,
            # waiting to come back, not removed)
            assert plugin.recovered_updates == 0


@pytest.mark.component
def test_a_failed_compaction_leaves_the_journal_whole(tmp_path, caplog):
    state = write_segments(tmp_path, [setup_updates(), []])

    def broken(snapshot, records):
        raise OSError(28, "No space left on device")

    writer = JournalWriter.open(tmp_path, compact=broken)
    try:
        writer.request_snapshot().result(timeout=30)
    finally:
        writer.close()
    assert writer.metrics.compaction_errors == 1
    assert "No space left on device" in caplog.text
    assert list_snapshots(tmp_path) == []
    assert [n for n, _ in list_segments(tmp_path)] == [0, 1, 2]
    assert replayed(tmp_path) == state


def test_a_writer_deletes_nothing_behind_a_damaged_snapshot(tmp_path):
    write_segments(tmp_path, [setup_updates(), []])
    path = write_snapshot(tmp_path, 1, compact(None, scan_segments(tmp_path, range(1))))
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(JournalCorruptedError):
        JournalWriter.open(tmp_path)
    assert [n for n, _ in list_segments(tmp_path)] == [0, 1]  # the fallback is still there


@pytest.mark.parametrize("damage,message,offset", [
    (lambda d: b"XXSSNAP\x00" + d[8:], "bad magic", 0),
    (lambda d: d[:12] + (7).to_bytes(8, "little") + d[20:], "header checksum mismatch", 0),
    (lambda d: d + b"\x00", "the file holds", 24),
    (lambda d: d[:30], "too short", 0),
])
def test_every_kind_of_snapshot_damage_names_the_file_and_offset(tmp_path, damage, message,
                                                                 offset):
    write_segments(tmp_path, [setup_updates(), []])
    path = write_snapshot(tmp_path, 1, compact(None, scan_segments(tmp_path, range(1))))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(JournalCorruptedError, match=message) as e:
        load_journal(tmp_path)
    assert (e.value.path, e.value.offset) == (path, offset)


def test_a_snapshot_renamed_to_another_base_is_corruption(tmp_path):
    write_segments(tmp_path, [setup_updates(), [], []])
    path = write_snapshot(tmp_path, 1, compact(None, scan_segments(tmp_path, range(1))))
    path.rename(snapshot_path(tmp_path, 2))
    with pytest.raises(JournalCorruptedError, match="snapshot base 1 disagrees with its name"):
        load_journal(tmp_path)
