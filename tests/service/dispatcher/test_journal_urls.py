"""The dispatcher's journal on any filesystem (issue 24 s4): a ``work_dir`` URL of fsspec.

``file://`` is the local directory; ``memory://`` and ``s3://`` (an S3 emulator, moto's server,
in a process of its own on 127.0.0.1, read through s3fs) keep each group commit as one
immutable object. Unknown, uninstalled and read-only filesystems are refused.
"""

from __future__ import annotations

import asyncio
import collections
import uuid
import warnings

import fsspec
import pytest
from _helpers import free_port, s3_emulator, wait
from distributed import Client

import dask_dataservice as dds
from dask_dataservice.service.dispatcher._journal_fs import RemotePath, location
from dask_dataservice.service.dispatcher._journal_lineage import read_manifest, write_manifest
from dask_dataservice.service.dispatcher.journal import (
    JournalCorruptedError,
    JournalTornTailWarning,
    JournalWriter,
    load_journal,
    read_journal,
)

pytestmark = [pytest.mark.component, pytest.mark.timeout(90)]


@pytest.fixture(scope="module")
def s3():
    """An S3 emulator and a bucket: ``s3://dds-journal``."""
    with s3_emulator("dds-journal") as url:
        yield url


#: The S3 cases talk to the emulator's process; s3fs runs their requests on fsspec's
#: process-wide I/O thread (and that loop's executor), started by the first s3:// call and
#: shared with every later one: the S3 tests leave them.
S3 = pytest.param("s3", marks=[pytest.mark.process, pytest.mark.no_leak_check])


def _memory_url() -> str:
    return f"memory://dds-test/{uuid.uuid4().hex}"


@pytest.fixture(params=["file", "memory", S3])
def url(request, tmp_path):
    """A fresh journal directory on each kind of filesystem."""
    if request.param == "file":
        yield f"file://{tmp_path}/journal"
    elif request.param == "memory":
        url = _memory_url()
        yield url
        fsspec.filesystem("memory").rm(location(url).path, recursive=True)
    else:
        yield f"{request.getfixturevalue('s3')}/{uuid.uuid4().hex}"


async def _write(url: str, batches: list[list[bytes]], **kwargs) -> JournalWriter:
    writer = JournalWriter.open(url, **kwargs)
    for batch in batches:
        await asyncio.gather(*[writer.append(r) for r in batch])
    await writer.aclose()
    return writer


def test_round_trip_and_append_on_every_filesystem(url):
    """TF's journal_test.cc ``Journal.RoundTripMultiple`` and ``Journal.AppendExistingJournal``
    on file://, memory:// and s3://: records written by three writers (one group commit of
    three records, then one record each) read back in order; on a URL each group commit is
    one object."""
    first = [b"create-iteration", b"register-dataset", b"finish-task"]
    writer = asyncio.run(_write(url, [first]))
    assert writer.metrics.fsyncs == 1 and writer.metrics.records_written == 3
    asyncio.run(_write(url, [[b"fourth"]]))
    asyncio.run(_write(url, [[b"fifth"]]))
    assert list(read_journal(url)) == [*first, b"fourth", b"fifth"]
    where = location(url)
    if url.startswith("file://"):
        assert not isinstance(where, RemotePath)
        assert sorted(p.name for p in where.iterdir()) == [
            "journal_00000000", "journal_00000001", "journal_00000002", "manifest"]
    else:
        assert isinstance(where, RemotePath)
        assert sorted(name for name, _ in where.entries()) == [
            "journal_00000000", "journal_00000000.00000001", "journal_00000001",
            "journal_00000001.00000001", "journal_00000002", "journal_00000002.00000001",
            "manifest"]


def test_snapshots_on_a_url(url):
    """Compaction on a URL: the snapshot is written whole and moved into place, the segments
    it covers deleted with their objects; replay = snapshot + the records after it."""
    def compact(snapshot, records):
        return (snapshot.payload if snapshot else b"") + b"".join(r.payload for r in records)

    writer = asyncio.run(_write(url, [[b"a%d" % i] for i in range(7)], compact=compact,
                                snapshot_records=3))
    assert writer.metrics.snapshots_written >= 1, writer.metrics
    contents = load_journal(url)
    assert contents.snapshot is not None
    assert contents.snapshot.payload + b"".join(r.payload for r in contents.records) == (
        b"a0a1a2a3a4a5a6")


def test_a_missing_object_in_a_segment_is_corruption():
    """TF's ``Journal.NonRecordData`` / ``InvalidRecordData`` for the chain of objects: a part
    deleted from the middle of a segment is a JournalCorruptedError naming the segment's URL
    and the part, never a shorter journal."""
    url = _memory_url()
    asyncio.run(_write(url, [[b"1"], [b"2"], [b"3"]]))
    fs = fsspec.filesystem("memory")
    where = location(url)
    assert isinstance(where, RemotePath)
    fs.rm_file(f"{where.path}/journal_00000000.00000002")
    with pytest.raises(JournalCorruptedError) as info:
        list(read_journal(url))
    assert str(info.value) == (
        f"journal memory://{where.path}/journal_00000000 is corrupted at byte offset 29: "
        "part 2 of its chain of objects is missing (journal_00000000.00000003 follows part 1: "
        "deleted?)")
    assert info.value.path == f"memory://{where.path}/journal_00000000"
    fs.rm(where.path, recursive=True)


def test_a_torn_last_object_is_cut_off():
    """On a filesystem whose writes are not atomic, only the segment's last object can be
    incomplete: it reads as a torn tail, is dropped with a warning and cut off (the object
    rewritten), and the next writer goes on."""
    url = _memory_url()
    asyncio.run(_write(url, [[b"one"], [b"two"]]))
    fs = fsspec.filesystem("memory")
    where = location(url)
    assert isinstance(where, RemotePath)
    manifest = read_manifest(where)  # as a process killed after its last commit left it
    del manifest.closed[manifest.segment]
    write_manifest(where, manifest)
    last = f"{where.path}/journal_00000000.00000002"
    fs.pipe_file(last, fs.cat_file(last)[:-1])  # the last record's last byte never written
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert list(read_journal(url)) == [b"one"]
    [torn] = [w.message for w in caught if isinstance(w.message, JournalTornTailWarning)]
    assert torn.path == f"memory://{where.path}/journal_00000000"
    assert (torn.offset, torn.size) == (31, 45)
    assert not fs.exists(last)  # the torn object deleted: the segment ends at byte 31
    asyncio.run(_write(url, [[b"three"]]))
    assert list(read_journal(url)) == [b"one", b"three"]
    fs.rm(where.path, recursive=True)


@pytest.mark.pure
@pytest.mark.parametrize(("work_dir", "message"), [
    ("https://example.com/dds",
     "the journal cannot be kept at https://example.com/dds: https:// is read-only to this "
     "package; use a local directory, a file:// URL or an object store (s3://, gs://, az://)"),
    ("nosuchfs://bucket/dds",
     "the journal cannot be kept at nosuchfs://bucket/dds: fsspec knows no filesystem "
     "nosuchfs://; use a local directory, a file:// URL or an object store (s3://, gs://, "
     "az://)"),
    ("simplecache::s3://bucket/dds",
     "the journal cannot be kept at simplecache::s3://bucket/dds: not a URL of one filesystem "
     "(chained URLs cache or wrap another filesystem); use a local directory, a file:// URL or "
     "an object store (s3://, gs://, az://)"),
])
def test_a_url_that_cannot_hold_a_journal_is_refused(work_dir, message):
    """A URL the journal cannot keep durably is refused with a ValueError saying why and what
    to use, never turned into a local directory named after the protocol (``gs:``)."""
    with pytest.raises(ValueError) as info:
        JournalWriter(work_dir)
    assert str(info.value) == message


@pytest.mark.pure
def test_a_filesystem_not_installed_is_named():
    """``oci://`` (a filesystem fsspec knows whose package, ocifs, is not installed here):
    the error names the missing package's import error and where to install it."""
    with pytest.raises(ValueError) as info:
        location("oci://bucket/dds")
    assert str(info.value).startswith("the journal cannot be kept at oci://bucket/dds: the "
                                      "filesystem of oci:// is not installed (")
    assert str(info.value).endswith("); install it on the scheduler's machine")


@pytest.mark.parametrize("kind", [pytest.param("memory", marks=pytest.mark.cluster), S3])
def test_dispatcher_restart_during_reading_from_a_url_journal(kind, request):
    """TF's fault_tolerance_test.py ``testDispatcherRestartDuringReading`` with the journal on
    a URL: the dispatcher stops mid-epoch and starts again on the same ``work_dir`` URL; the
    reader reads every element exactly once."""
    work_dir = _memory_url() if kind == "memory" else (
        f"{request.getfixturevalue('s3')}/{uuid.uuid4().hex}")
    port = free_port()
    cfg = dds.DispatcherConfig(port=port, fault_tolerant_mode=True, work_dir=work_dir)
    dispatcher = dds.DispatchServer(cfg)
    worker = dds.WorkerServer(dds.WorkerConfig(dispatcher._address))
    try:
        with Client(dispatcher.target, timeout="20s") as c:
            c.wait_for_workers(1)
            dataset_id = dds.register_dataset(c, dds.Dataset.range(300))
            ds = dds.from_dataset_id("distributed_epoch", c, dataset_id, job_name="url",
                                     max_outstanding_requests=1)
            it = iter(ds)
            seen = [next(it) for _ in range(50)]
            dispatcher.stop()
            dispatcher = dds.DispatchServer(cfg)
            plugin = dispatcher.server.plugins["dataservice-dispatcher"]
            assert plugin.recovered_updates > 0
            assert plugin._journal is not None
            assert str(plugin._journal.work_dir) == (
                work_dir if kind == "s3" else work_dir.replace("memory://", "memory:///"))
            assert len(plugin.state.list_datasets()) == 1  # the dataset came back
            wait(lambda: worker.reconnects >= 1, what="the worker to register again")
            seen += list(it)
        assert collections.Counter(seen) == collections.Counter(range(300))
    finally:
        worker.stop()
        dispatcher.stop()
        if kind == "memory":
            fsspec.filesystem("memory").rm(location(work_dir).path, recursive=True)


@pytest.mark.pure
def test_dispatch_server_refuses_the_url_before_it_starts():
    """``DispatchServer(DispatcherConfig(fault_tolerant_mode=True, work_dir=URL))`` refuses a URL
    the journal cannot keep with the ValueError itself, before a scheduler starts."""
    cfg = dds.DispatcherConfig(fault_tolerant_mode=True, work_dir="https://example.com/dds")
    with pytest.raises(ValueError, match=r"^the journal cannot be kept at "
                                         r"https://example.com/dds: https:// is read-only"):
        dds.DispatchServer(cfg)
