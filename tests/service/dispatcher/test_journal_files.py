"""Every file of a dispatcher's work_dir deleted, renamed, truncated or put back from an older
copy (issue 22 s3): the dispatcher refuses to start with a JournalCorruptedError naming the
file, or starts with exactly the state it had; never with fewer datasets or jobs, never
handing out an id again.

One real history, made by real fault-tolerant dispatchers (an in-process scheduler with the
plugin, a work_dir on disk): three starts, two snapshot folds, four copies of the work_dir
taken along the way. Each case damages a copy of the final work_dir and starts a dispatcher
on it.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
from _helpers import ft_dispatcher, ok
from distributed.utils_test import gen_test

from dask_dataservice.service.dispatcher._state_codec import restore
from dask_dataservice.service.dispatcher.journal import (
    JournalCorruptedError,
    list_segments,
    load_journal,
    scan_journal,
    segment_path,
    snapshot_path,
)
from dask_dataservice.service.dispatcher.state import CreateTask, RegisterWorker

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

W = "tcp://10.0.0.1:1"


class Reader:
    """A dataset, a DYNAMIC job, an iteration and a task asking for splits, one record each."""

    @classmethod
    async def create(cls, plugin, name):
        self = cls()
        self.plugin = plugin
        self.dataset_id = ok(await plugin.register_dataset(
            fingerprint=name, pipeline=name.encode(), splits=b"s", num_splits=10_000)
        )["dataset_id"]
        self.job_id = ok(await plugin.get_or_create_job(
            dataset_id=self.dataset_id, processing_mode="DYNAMIC"))["job_id"]
        self.token = plugin.state.job(self.job_id).token
        view = ok(await plugin.get_or_create_iteration(job_id=self.job_id, job_token=self.token))
        self.iteration_id = view["iteration_id"]
        if W not in {w.address for w in plugin.state.list_workers()}:
            plugin._apply(RegisterWorker(W, "10.0.0.1", 1))
        self.task_id = plugin.state.next_task_id()
        plugin._apply(CreateTask(self.task_id, self.iteration_id, W))
        await plugin._wait_durable()
        return self

    @classmethod
    def of(cls, plugin, other):
        self = cls()
        self.__dict__.update(other.__dict__)
        self.plugin = plugin
        return self

    async def splits(self, n):
        for _ in range(n):  # one record (and one group commit) each
            ok(await self.plugin.get_split(iteration_id=self.iteration_id, task_id=self.task_id,
                                           repetition=0, count=3, job_token=self.token))


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


async def compacted(plugin):
    future = plugin._journal._compaction
    assert future is not None
    await asyncio.wrap_future(future)


def facts(plugin):
    """What must survive a restart exactly."""
    state = plugin.state
    return {
        "datasets": sorted(d.dataset_id for d in state.list_datasets()),
        "jobs": sorted(j.job_id for j in state.list_jobs()),
        "next_ids": (state.next_dataset_id(), state.next_job_id(), state.next_iteration_id(),
                     state.next_task_id()),
        "split_positions": sorted(
            (it.iteration_id, state.split_position(it.iteration_id))
            for it in state.list_live_iterations()),
    }


async def make_history(root: Path) -> dict:
    """Three dispatcher starts on ``root / "work"``; copies of the work_dir along the way."""
    work = root / "work"
    copies = {}
    # start 1: snapshots folded after every 20 records
    async with ft_dispatcher(work, **{"snapshot-records": 20, "snapshot-bytes": 0}) as p:
        a = await Reader.create(p, "a")  # 5 records in segment 0
        await a.splits(15)  # the 20th record rotates to segment 1 and folds segment 0
        await compacted(p)
        copies["early"] = copy_dir(work, root / "early")  # snapshot_1
        await a.splits(20)  # rotates to segment 2, folds segment 1: snapshot_2
        await compacted(p)
        copies["fold"] = copy_dir(work, root / "fold")  # journal_2 with no record yet
        await a.splits(5)
    # start 2 (segment 3) and start 3 (segment 4): no more folds
    no_folds = {"snapshot-records": 0, "snapshot-bytes": 0}
    async with ft_dispatcher(work, **no_folds) as p:
        a = Reader.of(p, a)
        b = await Reader.create(p, "b")
        await b.splits(4)
        copies["second"] = copy_dir(work, root / "second")  # mid start 2
        await a.splits(3)
        await Reader.create(p, "c")
    async with ft_dispatcher(work, **no_folds) as p:
        await Reader.of(p, b).splits(2)
        copies["third"] = copy_dir(work, root / "third")  # mid start 3
        await Reader.of(p, a).splits(2)
    names = sorted(f.name for f in work.iterdir())
    assert names == ["journal_00000002", "journal_00000003", "journal_00000004", "manifest",
                     "snapshot_00000002"], names
    async with ft_dispatcher(copy_dir(work, root / "reference"), **no_folds) as p:
        reference = facts(p)
    assert reference["datasets"] == [1000, 1001, 1002]
    return {"work": work, "copies": copies, "reference": reference}


@pytest.fixture(scope="module")
def history(tmp_path_factory):
    return asyncio.run(make_history(tmp_path_factory.mktemp("history")))


def boundary_cut(path: Path) -> int:
    """A size of ``path`` that ends at a record boundary, before its last record."""
    offsets = [r.offset for r in scan_journal(path.parent, repair=False) if r.path == path]
    assert len(offsets) >= 2, offsets
    return offsets[-1]


SEG = {"journal_2": 2, "journal_3": 3, "journal_4": 4}
OLDER = {"journal_2": "fold", "journal_3": "second", "journal_4": "third", "manifest": "third"}


def damage(work: Path, history, name: str, how: str):
    """Damage file ``name`` of ``work``; returns (path, expected offset, expected reason) or
    None when the dispatcher must start with the same state."""
    if name in SEG:
        path = segment_path(work, SEG[name])
    elif name == "snapshot":
        path = snapshot_path(work, 2)
    else:
        path = work / "manifest"
    size = path.stat().st_size
    if how == "deleted":
        path.unlink()
    elif how == "renamed":
        path.rename(path.with_name(path.name + ".tmp"))
    elif how == "truncated":
        cut = size // 2
        if name in SEG:
            cut = boundary_cut(path) + 5  # inside the last record
        with open(path, "r+b") as f:
            f.truncate(cut)
    elif how == "cut at a record boundary":
        cut = boundary_cut(path)
        with open(path, "r+b") as f:
            f.truncate(cut)
    elif how == "older":
        if name == "snapshot":  # written once: the older one is snapshot_1, in its place
            src = history["copies"]["early"] / "snapshot_00000001"
        else:
            src = history["copies"][OLDER[name]] / path.name
        assert src.read_bytes() != path.read_bytes()
        shutil.copyfile(src, path)
    elif how == "older by two starts":
        shutil.copyfile(history["copies"]["second"] / path.name, path)
    new_size = path.stat().st_size if path.exists() else None

    missing = "the file is missing: the manifest names"
    closed = (f"the segment is {new_size} bytes, but it held {size} bytes when its writer "
              "closed it (truncated, or replaced by an older copy)")
    if name in ("journal_2", "journal_3"):
        if how in ("deleted", "renamed"):
            return path, 0, f"{missing} segments 2..4"
        if how == "truncated":
            return path, boundary_cut_of(history, name), (
                "truncated record header (5 of 12 bytes); a torn record is only allowed at "
                "the end of the last "
                f"segment, and {segment_path(work, SEG[name] + 1)} follows")
        return path, new_size, closed
    if name == "journal_4":
        if how in ("deleted", "renamed"):
            return path, 0, f"{missing} it as the newest segment"
        return path, new_size, closed
    if name == "snapshot":
        if how in ("deleted", "renamed"):
            return path, 0, (f"{missing} it as the snapshot the segments from journal_2 on "
                             "follow")
        if how == "truncated":
            return path, 24, (f"snapshot payload of {size - 36} bytes, but the file holds "
                              f"{new_size - 36} bytes after the headers")
        return path, 32, "not the snapshot the manifest names: {}"
    # the manifest
    if how in ("deleted", "renamed"):
        return path, 0, ("the manifest is missing, but journal_00000002 was written by a "
                         "journal that keeps one (deleted or renamed?)")
    if how == "truncated":
        return path, 12, "manifest length {}"
    if how == "older":
        return None  # one start behind: it no longer names journal_4 closed, nothing else
    return path, 0, ("the manifest is older than the journal: it names journal_3 as the "
                     "newest segment, but journal_00000004 exists and holds records")


def boundary_cut_of(history, name):
    return boundary_cut(segment_path(history["work"], SEG[name]))


CASES = [(name, how)
         for name in ("journal_2", "journal_3", "journal_4", "snapshot", "manifest")
         for how in ("deleted", "renamed", "truncated", "cut at a record boundary", "older",
                     "older by two starts")
         if not (how == "cut at a record boundary" and name not in SEG)
         and not (how == "older by two starts" and name != "manifest")]


def listing(work: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(work.iterdir())}


@pytest.mark.parametrize("name,how", CASES, ids=[f"{n}-{h}" for n, h in CASES])
@gen_test(timeout=60)
async def test_a_damaged_work_dir_refuses_to_start_naming_the_file_or_starts_whole(
        history, tmp_path, name, how):
    work = copy_dir(history["work"], tmp_path / "work")
    expected = damage(work, history, name, how)
    before = listing(work)
    if expected is None:
        async with ft_dispatcher(work, **{"snapshot-records": 0}) as plugin:
            assert facts(plugin) == history["reference"]
            # and a new registration gets a new id
            new = ok(await plugin.register_dataset(fingerprint="new", pipeline=b"n", splits=b"s",
                                                   num_splits=1))["dataset_id"]
            assert int(new.partition(":")[0]) == max(history["reference"]["datasets"]) + 1
        return
    path, offset, reason = expected
    with pytest.raises(JournalCorruptedError) as e:
        async with ft_dispatcher(work):
            pass
    assert (e.value.path, e.value.offset) == (path, offset), str(e.value)
    prefix, _, suffix = reason.partition("{}")
    assert e.value.reason.startswith(prefix) and e.value.reason.endswith(suffix), str(e.value)
    assert str(e.value).startswith(f"journal {path} is corrupted at byte offset {offset}: ")
    # nothing was created, repaired or deleted (the .tmp name is kept too)
    assert listing(work) == before


def test_the_undamaged_history_replays_whole(history):
    """The reference the cases compare with: the history's own replay."""
    state, _ = restore(*load_journal(history["work"], repair=False))
    assert sorted(d.dataset_id for d in state.list_datasets()) == history["reference"][
        "datasets"]
    assert [n for n, _ in list_segments(history["work"])] == [2, 3, 4]


@gen_test(timeout=60)
async def test_a_whole_work_dir_restored_from_an_older_copy_is_not_detected(history, tmp_path):
    """What cannot be told: every file put back from one older copy (a consistent earlier
    journal). The dispatcher starts with that copy's state (docs/guarantees.md, Damage)."""
    work = copy_dir(history["copies"]["second"], tmp_path / "work")
    async with ft_dispatcher(work, **{"snapshot-records": 0}) as plugin:
        got = facts(plugin)
    assert got["datasets"] == [1000, 1001] != history["reference"]["datasets"]


async def folded_then_restarted(work: Path) -> list[int]:
    """The issue's journal: a fold, then a clean restart that journaled nothing, so that the
    segments after the snapshot hold no record at all."""
    async with ft_dispatcher(work, **{"snapshot-records": 8, "snapshot-bytes": 0}) as p:
        a = await Reader.create(p, "a")
        await a.splits(10)
        await compacted(p)
        datasets = sorted(d.dataset_id for d in p.state.list_datasets())
    async with ft_dispatcher(work, **{"snapshot-records": 0}):
        pass
    return datasets


@pytest.mark.parametrize("how", ["deleted", "renamed to .tmp"])
@gen_test(timeout=60)
async def test_a_missing_snapshot_never_starts_an_empty_dispatcher(tmp_path, how):
    """Issue 22 s3: with the snapshot deleted, or renamed to the name of a crash's leftover
    (which a start deletes), the dispatcher started with 0 datasets and ids from 1000 again."""
    work = tmp_path / "work"
    assert await folded_then_restarted(work) == [1000]
    [(base, path)] = [(int(p.name[9:]), p) for p in work.glob("snapshot_*")]
    assert list(scan_journal(work)) == []  # the segments after it hold no record
    if how == "deleted":
        path.unlink()
    else:
        path.rename(path.with_name(path.name + ".tmp"))
    with pytest.raises(JournalCorruptedError) as e:
        async with ft_dispatcher(work):
            pass
    assert str(e.value) == (
        f"journal {path} is corrupted at byte offset 0: the file is missing: the manifest "
        f"names it as the snapshot the segments from journal_{base} on follow")
    if how != "deleted":
        assert path.with_name(path.name + ".tmp").exists()  # not deleted as a leftover


def downgrade_to_format_1(work: Path, lineage: str) -> None:
    """The work_dir as the package before the manifest wrote it: version-1 headers, a
    ``lineage`` file, no manifest."""
    import struct
    import zlib

    def masked(data):
        crc = zlib.crc32(data)
        return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF

    for path in work.iterdir():
        data = bytearray(path.read_bytes())
        if path.name.startswith("journal_"):
            data[8:12] = struct.pack("<I", 1)
            data[12:16] = struct.pack("<I", masked(bytes(data[:12])))
        elif path.name.startswith("snapshot_"):
            data[8:12] = struct.pack("<I", 1)
            data[20:24] = struct.pack("<I", masked(bytes(data[:20])))
        else:
            continue
        path.write_bytes(bytes(data))
    (work / "manifest").unlink()
    (work / "lineage").write_text(lineage)


@gen_test(timeout=60)
async def test_a_journal_of_the_first_format_reads_and_gains_a_manifest(tmp_path):
    work = tmp_path / "work"
    await folded_then_restarted(work)
    async with ft_dispatcher(work, **{"snapshot-records": 0}) as p:
        before = facts(p)
    downgrade_to_format_1(work, "old-lineage")
    async with ft_dispatcher(work, **{"snapshot-records": 0}) as p:
        assert facts(p) == before
        assert p.lineage == "old-lineage"  # the data workers' tasks stay theirs
    assert (work / "manifest").exists()
    # ... and without its snapshot it is refused, as in the new format
    downgrade_to_format_1(work, "old-lineage")
    [path] = work.glob("snapshot_*")
    path.unlink()
    first = min(n for n, _ in list_segments(work))
    with pytest.raises(JournalCorruptedError) as e:
        async with ft_dispatcher(work):
            pass
    assert str(e.value) == (
        f"journal {snapshot_path(work, first)} is corrupted at byte offset 0: the snapshot is "
        f"missing: the first segment is journal_{first}, so the records before it exist only "
        "in a snapshot, and there is none")


@pytest.mark.pure
def test_replay_never_starts_ids_below_the_manifests_high_water_mark():
    """The manifest's high-water mark raises every namespace's next id (pure)."""
    state, _ = restore(None, [], (1005, 2007, 3000, 4009, 5001))
    assert (state.next_dataset_id(), state.next_iteration_id(), state.next_task_id(),
            state.next_job_id()) == (1005, 2007, 4009, 5001)
    state, _ = restore(None, [], ())
    assert state.next_dataset_id() == 1000
