"""Tests of the write-ahead journal: format, replay, torn tails, corruption, group commit.

Everything runs against real files under ``tmp_path``; crashes are simulated by cutting,
zeroing or flipping bytes of the files a real writer produced.
"""

from __future__ import annotations

import asyncio
import errno
import os
import pickle
import struct
import threading
import warnings
import zlib
from pathlib import Path

import pytest

from dask_dataservice.errors import DataServiceError
from dask_dataservice.service.dispatcher._journal_lineage import read_manifest, write_manifest
from dask_dataservice.service.dispatcher.journal import (
    FORMAT_VERSION,
    MAGIC,
    JournalClosedError,
    JournalCorruptedError,
    JournalError,
    JournalTornTailWarning,
    JournalWriter,
    encode_record,
    list_segments,
    read_journal,
    scan_journal,
    segment_path,
)

pytestmark = pytest.mark.component

SEGMENT_HEADER = 16
RECORD_HEADER = 12


# -- helpers ----------------------------------------------------------------------------------


def masked_crc(data: bytes) -> int:
    """The checksum the module docstring specifies, computed independently."""
    crc = zlib.crc32(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def payloads_for(n: int, prefix: str = "r", vary: bool = True) -> list[bytes]:
    """Distinct payloads of varied sizes (including empty ones) so offsets are not regular."""
    out = []
    for i in range(n):
        body = f"{prefix}{i}:".encode()
        if vary:
            body += bytes([i % 251]) * (i * 7 % 97)
        out.append(body)
    return out


def write_segment(work_dir: Path, payloads: list[bytes], crash: bool = True) -> JournalWriter:
    """One writer start that appends ``payloads`` with one group commit, then dies after its
    last fsync (``crash``: its manifest never names the segment closed, so a torn tail at its
    end is a crash's to cut) or closes cleanly."""

    async def run() -> JournalWriter:
        writer = JournalWriter.open(work_dir)
        await asyncio.gather(*(writer.append(p) for p in payloads))
        await writer.aclose()
        return writer

    writer = asyncio.run(run())
    if crash:
        forget_close(work_dir)
    return writer


def forget_close(work_dir: Path) -> None:
    """The manifest as a process killed after its last fsync left it (before its close)."""
    manifest = read_manifest(work_dir)
    del manifest.closed[manifest.segment]
    write_manifest(work_dir, manifest)


def record_offsets(payloads: list[bytes]) -> list[int]:
    """Offset of each record in a segment holding exactly ``payloads``, plus the end offset."""
    offsets = [SEGMENT_HEADER]
    for p in payloads:
        offsets.append(offsets[-1] + RECORD_HEADER + len(p))
    return offsets


def flip_byte(path: Path, pos: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0xFF]))


def read_quietly(work_dir: Path) -> list[bytes]:
    """Read the journal, failing on any warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return list(read_journal(work_dir))


def read_until_error(work_dir: Path) -> tuple[list[bytes], JournalCorruptedError]:
    got = []
    with pytest.raises(JournalCorruptedError) as info:
        for payload in read_journal(work_dir):
            got.append(payload)
    return got, info.value


# -- format -----------------------------------------------------------------------------------


@pytest.mark.pure
def test_on_disk_format_byte_by_byte(tmp_path):
    writer = JournalWriter.open(tmp_path)
    writer.append_sync(b"abc")
    writer.append_sync(b"")
    writer.close()
    assert writer.path == tmp_path / "journal_00000000"

    head = MAGIC + struct.pack("<I", FORMAT_VERSION)
    expected = head + struct.pack("<I", masked_crc(head))
    for payload in (b"abc", b""):
        length = struct.pack("<I", len(payload))
        expected += length + struct.pack("<II", masked_crc(length), masked_crc(payload)) + payload
    assert writer.path.read_bytes() == expected
    assert encode_record(b"abc") == expected[16 : 16 + 15]
    # All-zero bytes are never a valid header: the masked CRCs of zeros are not zero.
    assert masked_crc(b"\0" * 4) != 0 and masked_crc(b"") != 0


def test_round_trip_many_records(tmp_path):
    payloads = payloads_for(3000) + [b"", os.urandom(1 << 20), b"last"]
    writer = write_segment(tmp_path, payloads)

    assert read_quietly(tmp_path) == payloads
    offsets = record_offsets(payloads)
    assert writer.path.stat().st_size == offsets[-1]
    records = list(scan_journal(tmp_path))
    assert [r.offset for r in records] == offsets[:-1]
    assert {r.path for r in records} == {writer.path}
    assert writer.metrics.records_written == len(payloads)
    assert writer.metrics.bytes_written == offsets[-1] - SEGMENT_HEADER


def test_mutable_payloads_are_copied_and_str_is_rejected(tmp_path):
    async def run():
        writer = JournalWriter.open(tmp_path)
        buf = bytearray(b"before")
        future = writer.append(buf)
        buf[:] = b"AFTER!"  # before the flush task runs
        await future
        await writer.append(memoryview(b"view"))
        with pytest.raises(TypeError):
            writer.append("text")
        await writer.aclose()

    asyncio.run(run())
    assert read_quietly(tmp_path) == [b"before", b"view"]


@pytest.mark.pure
def test_missing_directory_is_an_empty_journal_and_is_created(tmp_path):
    work_dir = tmp_path / "a" / "b" / "journal"
    assert read_quietly(work_dir) == []
    with JournalWriter.open(work_dir) as writer:
        writer.append_sync(b"x")
    assert work_dir.is_dir()
    assert read_quietly(work_dir) == [b"x"]


# -- segments ---------------------------------------------------------------------------------


def test_each_start_opens_a_new_segment(tmp_path):
    first = payloads_for(5, "a")
    second = payloads_for(300, "b")
    third = payloads_for(7, "c")
    write_segment(tmp_path, first)
    seg0 = (tmp_path / "journal_00000000").read_bytes()
    write_segment(tmp_path, second)
    with JournalWriter.open(tmp_path) as writer:
        for p in third:
            writer.append_sync(p)
    assert writer.segment == 2

    assert [(n, p.name) for n, p in list_segments(tmp_path)] == [
        (0, "journal_00000000"),
        (1, "journal_00000001"),
        (2, "journal_00000002"),
    ]
    # Later starts never touch an older segment.
    assert (tmp_path / "journal_00000000").read_bytes() == seg0
    assert read_quietly(tmp_path) == first + second + third


def test_segment_names_are_parsed_with_a_regex(tmp_path):
    write_segment(tmp_path, [b"zero"])
    (tmp_path / "journal_00000000").rename(tmp_path / "journal_0")
    for name in ("journal_8.tmp", "journal_x", "notes.txt", "journal_"):
        (tmp_path / name).write_bytes(b"not a segment")
    (tmp_path / "journal_9").mkdir()  # not a file: ignored

    writer = write_segment(tmp_path, [b"one"])
    assert writer.path == segment_path(tmp_path, 1) == tmp_path / "journal_00000001"
    assert read_quietly(tmp_path) == [b"zero", b"one"]


def test_duplicate_segment_numbers_and_gaps_are_errors(tmp_path):
    write_segment(tmp_path, [b"a"])
    write_segment(tmp_path, [b"b"])
    (tmp_path / "journal_00000001").rename(tmp_path / "journal_3")
    with pytest.raises(JournalCorruptedError, match="the file is missing: the manifest names "
                       "it as the newest segment") as info:
        list(read_journal(tmp_path))
    assert info.value.path == tmp_path / "journal_00000001"
    (tmp_path / "journal_3").rename(tmp_path / "journal_00000001")
    write_segment(tmp_path, [b"c"])
    (tmp_path / "journal_00000001").rename(tmp_path / "journal_1.tmp")  # a gap
    with pytest.raises(JournalCorruptedError, match="the file is missing: the manifest names "
                       r"segments 0..2") as info:
        list(read_journal(tmp_path))
    assert info.value.path == tmp_path / "journal_00000001"

    (tmp_path / "journal_0002").write_bytes(b"")
    with pytest.raises(JournalCorruptedError, match="journal_0002") as info:
        list_segments(tmp_path)


def test_empty_segments_in_the_middle_and_at_the_end(tmp_path):
    a = payloads_for(10, "a")
    b = payloads_for(10, "b")
    write_segment(tmp_path, a)  # 0
    JournalWriter.open(tmp_path).close()  # 1: header only (started, wrote nothing)
    segment_path(tmp_path, 2).touch()  # 2: zero bytes (crashed before the header)
    write_segment(tmp_path, b)  # 3
    JournalWriter.open(tmp_path).close()  # 4: header only
    assert segment_path(tmp_path, 4).stat().st_size == SEGMENT_HEADER
    assert read_quietly(tmp_path) == a + b

    segment_path(tmp_path, 5).touch()  # 5: zero bytes, last
    assert read_quietly(tmp_path) == a + b
    writer = write_segment(tmp_path, [b"after"])
    assert writer.segment == 6
    assert read_quietly(tmp_path) == a + b + [b"after"]


# -- torn tails -------------------------------------------------------------------------------


def test_torn_final_record_is_cut_at_every_offset(tmp_path):
    earlier = payloads_for(3, "old")
    payloads = payloads_for(20)
    write_segment(tmp_path, earlier)
    path = write_segment(tmp_path, payloads).path
    original = path.read_bytes()
    last_start = record_offsets(payloads)[-2]
    assert len(original) - last_start > RECORD_HEADER + 20

    for cut in range(last_start + 1, len(original)):
        path.write_bytes(original[:cut])
        with pytest.warns(JournalTornTailWarning) as record:
            got = list(read_journal(tmp_path))
        assert got == earlier + payloads[:-1], cut
        [warning] = record
        message = warning.message
        assert message.path == path and message.offset == last_start and message.size == cut
        assert str(path) in str(message) and f"byte offset {last_start}" in str(message)
        assert path.stat().st_size == last_start  # repaired
        assert read_quietly(tmp_path) == earlier + payloads[:-1]


def test_torn_tail_without_repair_leaves_the_file(tmp_path):
    path = write_segment(tmp_path, [b"one", b"two"]).path
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 1)
    with pytest.warns(JournalTornTailWarning, match="ignoring everything from byte offset"):
        assert list(read_journal(tmp_path, repair=False)) == [b"one"]
    assert path.stat().st_size == size - 1


@pytest.mark.parametrize("keep", range(1, SEGMENT_HEADER))
def test_partial_segment_header_is_torn_only_in_the_last_segment(tmp_path, keep):
    write_segment(tmp_path, [b"a"])
    header = write_segment(tmp_path, []).path.read_bytes()
    last = segment_path(tmp_path, 1)
    last.write_bytes(header[:keep])
    with pytest.warns(JournalTornTailWarning, match="truncated segment header"):
        assert list(read_journal(tmp_path)) == [b"a"]
    assert last.stat().st_size == 0

    last.write_bytes(header[:keep])
    with pytest.warns(JournalTornTailWarning):
        write_segment(tmp_path, [b"b"])  # segment 2; this start repairs segment 1 again
    assert last.stat().st_size == 0
    last.write_bytes(header[:keep])  # now torn in a segment that is not the last
    _, error = read_until_error(tmp_path)
    assert error.path == last and error.offset == 0
    assert "only allowed at the end of the last segment" in str(error)


def test_zero_filled_tail_is_torn(tmp_path):
    payloads = payloads_for(10)
    path = write_segment(tmp_path, payloads).path
    size = path.stat().st_size
    with open(path, "ab") as f:  # the size was persisted, the data was not
        f.write(bytes(5000))
    with pytest.warns(JournalTornTailWarning, match="zero bytes") as record:
        assert list(read_journal(tmp_path)) == payloads
    assert record[0].message.offset == size
    assert path.stat().st_size == size


def test_final_record_with_an_unwritten_sector_is_torn_but_a_flipped_byte_is_not(tmp_path):
    payloads = [b"first", os.urandom(3000)]
    path = write_segment(tmp_path, payloads).path
    original = path.read_bytes()
    last_start = record_offsets(payloads)[-2]

    path.write_bytes(original[:-1024] + bytes(1024))  # last sectors never reached the disk
    with pytest.warns(JournalTornTailWarning, match="all-zero sector"):
        assert list(read_journal(tmp_path)) == [b"first"]
    assert path.stat().st_size == last_start

    path.write_bytes(original)
    flip_byte(path, len(original) - 10)  # media corruption, not a crash
    got, error = read_until_error(tmp_path)
    assert got == [b"first"] and error.offset == last_start
    assert "payload checksum mismatch" in str(error)


def test_writer_start_repairs_a_torn_tail_before_opening_a_new_segment(tmp_path):
    payloads = payloads_for(10)
    path = write_segment(tmp_path, payloads).path
    last_start = record_offsets(payloads)[-2]
    with open(path, "r+b") as f:
        f.truncate(last_start + 5)
    with pytest.warns(JournalTornTailWarning, match=f"byte offset {last_start}"):
        writer = JournalWriter.open(tmp_path)
    with writer:
        writer.append_sync(b"new")
    assert path.stat().st_size == last_start
    assert read_quietly(tmp_path) == payloads[:-1] + [b"new"]


# -- corruption -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "delta", "reason"),
    [
        ("length", 1, "record header checksum mismatch"),
        ("length_crc", 5, "record header checksum mismatch"),
        ("payload_crc", 9, "payload checksum mismatch"),
        ("payload", RECORD_HEADER + 3, "payload checksum mismatch"),
    ],
)
def test_flipped_byte_in_a_non_final_record(tmp_path, field, delta, reason):
    payloads = payloads_for(10)
    path = write_segment(tmp_path, payloads).path
    offset = record_offsets(payloads)[5]
    flip_byte(path, offset + delta)

    got, error = read_until_error(tmp_path)
    assert got == payloads[:5]
    assert isinstance(error, RuntimeError) and isinstance(error, DataServiceError)
    assert error.path == path and error.offset == offset
    assert f"journal {path} is corrupted at byte offset {offset}: {reason}" in str(error)
    # A writer refuses to start on a corrupted journal rather than burying it.
    with pytest.raises(JournalCorruptedError):
        JournalWriter.open(tmp_path)
    assert len(list_segments(tmp_path)) == 1


def test_damage_in_a_non_last_segment_is_an_error(tmp_path):
    payloads = payloads_for(6)
    seg0 = write_segment(tmp_path, payloads).path
    write_segment(tmp_path, [b"next"])
    original = seg0.read_bytes()
    last_start = record_offsets(payloads)[-2]

    flip_byte(seg0, len(original) - 1)  # final record of segment 0, but not of the journal
    got, error = read_until_error(tmp_path)
    assert got == payloads[:-1]
    assert (error.path, error.offset) == (seg0, last_start)
    assert f"{seg0} is corrupted at byte offset {last_start}" in str(error)

    seg0.write_bytes(original[:-3])  # a torn record, followed by another segment
    _, error = read_until_error(tmp_path)
    assert (error.path, error.offset) == (seg0, last_start)
    assert "truncated record" in str(error) and str(segment_path(tmp_path, 1)) in str(error)
    assert seg0.stat().st_size == len(original) - 3  # errors never modify files

    seg0.write_bytes(original + bytes(100))  # zero-filled tail in a non-last segment
    _, error = read_until_error(tmp_path)
    assert (error.path, error.offset) == (seg0, len(original))

    seg0.write_bytes(b"X" + original[1:])
    got, error = read_until_error(tmp_path)
    assert got == [] and (error.path, error.offset) == (seg0, 0)
    assert "bad magic" in str(error)


def test_bad_segment_header_in_the_last_segment_is_an_error(tmp_path):
    path = write_segment(tmp_path, [b"a"]).path
    original = path.read_bytes()

    flip_byte(path, 2)
    _, error = read_until_error(tmp_path)
    assert error.offset == 0 and "bad magic" in str(error)

    path.write_bytes(original)
    flip_byte(path, 13)
    _, error = read_until_error(tmp_path)
    assert error.offset == 0 and "segment header checksum mismatch" in str(error)

    head = MAGIC + struct.pack("<I", FORMAT_VERSION + 1)
    path.write_bytes(head + struct.pack("<I", masked_crc(head)) + original[16:])
    _, error = read_until_error(tmp_path)
    assert error.offset == 8 and "unsupported journal format version 3" in str(error)


@pytest.mark.pure
def test_errors_pickle():
    error = pickle.loads(pickle.dumps(JournalCorruptedError("/j/journal_1", 42, "bad")))
    assert (error.path, error.offset, str(error)) == (
        Path("/j/journal_1"),
        42,
        "journal /j/journal_1 is corrupted at byte offset 42: bad",
    )
    warning = pickle.loads(pickle.dumps(JournalTornTailWarning("/j/x", 16, 20, "cut", True)))
    assert isinstance(warning, UserWarning) and warning.offset == 16


# -- group commit -----------------------------------------------------------------------------


def test_concurrent_appends_share_fsyncs_and_keep_call_order(tmp_path):
    payloads = payloads_for(1000)

    async def run():
        loop_thread = threading.current_thread().name
        writer = JournalWriter.open(tmp_path)
        results = await asyncio.gather(*(writer.append(p) for p in payloads))
        await writer.aclose()
        return writer, loop_thread, results

    writer, loop_thread, results = asyncio.run(run())
    assert results == [None] * 1000
    assert read_quietly(tmp_path) == payloads
    m = writer.metrics
    assert m.records_written == 1000
    assert m.fsyncs < 100  # in practice 1: all appends were made in one tick
    assert m.records_per_fsync > 10
    # fsync never runs on the event loop thread, only on the writer's own I/O thread.
    assert loop_thread not in m.sync_thread_names
    assert m.sync_thread_names == {"dds-journal_0"}


def test_appends_made_while_an_fsync_is_in_progress_form_the_next_batch(tmp_path):
    gate = threading.Event()

    async def run():
        writer = JournalWriter.open(tmp_path)
        # Hold the I/O thread, so the first batch is "in progress" while we append more.
        writer._io.submit(gate.wait)
        first = writer.append(b"0")
        await asyncio.sleep(0)  # one tick: the flush task takes the first batch
        assert not writer._waiters
        rest = [writer.append(str(i).encode()) for i in range(1, 1000)]
        gate.set()
        await asyncio.gather(first, *rest)
        await writer.aclose()
        return writer

    writer = asyncio.run(run())
    assert writer.metrics.fsyncs == 2
    assert writer.metrics.max_batch_records == 999
    assert read_quietly(tmp_path) == [str(i).encode() for i in range(1000)]


def test_waiters_wake_up_in_journal_order(tmp_path):
    woke = []

    async def appender(writer, i):
        await writer.append(b"%d" % i)
        woke.append(i)

    async def run():
        async with JournalWriter.open(tmp_path) as writer:
            await asyncio.gather(*(appender(writer, i) for i in range(200)))

    asyncio.run(run())
    assert woke == list(range(200))


@pytest.mark.pure
def test_append_sync_fsyncs_every_record_on_the_calling_thread(tmp_path):
    with JournalWriter.open(tmp_path) as writer:
        for i in range(5):
            writer.append_sync(b"%d" % i)
    m = writer.metrics
    assert (m.records_written, m.fsyncs, m.records_per_fsync) == (5, 5, 1.0)
    assert m.sync_thread_names == {threading.current_thread().name}


def test_append_sync_is_refused_while_async_appends_are_in_flight(tmp_path):
    async def run():
        writer = JournalWriter.open(tmp_path)
        future = writer.append(b"async")
        with pytest.raises(JournalError, match="reorder"):
            writer.append_sync(b"sync")
        await future
        writer.append_sync(b"sync")
        await writer.aclose()

    asyncio.run(run())
    assert read_quietly(tmp_path) == [b"async", b"sync"]


# -- closing and failure ----------------------------------------------------------------------


@pytest.mark.pure
def test_appends_after_close_raise(tmp_path):
    writer = JournalWriter.open(tmp_path)
    writer.append_sync(b"a")
    writer.close()
    writer.close()  # idempotent
    assert writer.closed
    with pytest.raises(JournalClosedError, match=f"journal writer for {writer.path} is closed"):
        writer.append_sync(b"b")

    async def run():
        with pytest.raises(JournalClosedError, match="is closed"):
            await writer.append(b"c")
        await writer.aclose()  # idempotent

    asyncio.run(run())
    assert read_quietly(tmp_path) == [b"a"]
    with pytest.raises(JournalError, match="already started"):
        writer.start()


def test_aclose_waits_for_queued_appends(tmp_path):
    async def run():
        writer = JournalWriter.open(tmp_path)
        futures = [writer.append(b"%d" % i) for i in range(100)]
        await writer.aclose()
        assert all(f.done() and f.exception() is None for f in futures)
        with pytest.raises(JournalClosedError):
            writer.append(b"late")

    asyncio.run(run())
    assert read_quietly(tmp_path) == [b"%d" % i for i in range(100)]


def test_close_fails_appends_that_were_not_written(tmp_path):
    async def run():
        writer = JournalWriter.open(tmp_path)
        await writer.append(b"durable")
        futures = [writer.append(b"%d" % i) for i in range(10)]
        writer.close()  # same tick: the flush task has not taken them yet
        results = await asyncio.gather(*futures, return_exceptions=True)
        assert all(isinstance(r, JournalClosedError) for r in results)
        assert "closed before this record was written" in str(results[0])

    asyncio.run(run())
    assert read_quietly(tmp_path) == [b"durable"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_an_io_error_fails_the_batch_and_the_writer(tmp_path):
    async def run():
        writer = JournalWriter.open(tmp_path)
        await writer.append(b"durable")
        # Make the segment's descriptor point at /dev/full: every write fails with ENOSPC.
        full = os.open("/dev/full", os.O_WRONLY)
        os.dup2(full, writer._fd)
        os.close(full)
        results = await asyncio.gather(
            *(writer.append(b"%d" % i) for i in range(10)), return_exceptions=True
        )
        assert all(isinstance(r, OSError) and r.errno == errno.ENOSPC for r in results)
        assert writer.closed and "failed" in repr(writer)
        with pytest.raises(
            JournalClosedError, match="has failed and accepts no more records"
        ) as info:
            writer.append(b"more")
        assert isinstance(info.value.__cause__, OSError)
        with pytest.raises(JournalClosedError):
            writer.append_sync(b"more")
        await writer.aclose()

    asyncio.run(run())
    assert read_quietly(tmp_path) == [b"durable"]


def test_append_needs_a_running_loop_and_a_started_writer(tmp_path):
    writer = JournalWriter(tmp_path)
    with pytest.raises(JournalError, match="not started"):
        writer.append_sync(b"x")
    writer.start()
    with pytest.raises(RuntimeError, match="no running event loop"):
        writer.append(b"x")
    writer.close()
    # The writer can move to a new event loop when nothing is queued (each asyncio.run is one).
    writer2 = JournalWriter.open(tmp_path)

    async def one(i):
        await writer2.append(b"%d" % i)

    asyncio.run(one(1))
    asyncio.run(one(2))
    writer2.close()
    assert read_quietly(tmp_path) == [b"1", b"2"]


def test_records_queued_on_a_loop_that_closed_fail_the_writer(tmp_path):
    # asyncio.run returns while an append is still being written: the flush task is cancelled.
    writer = JournalWriter.open(tmp_path)
    futures = []

    async def queue_and_return():
        futures.append(writer.append(b"unawaited"))

    asyncio.run(queue_and_return())
    # the append's future failed with the cancelled flush (retrieved: none is dropped)
    assert isinstance(futures[0].exception(), JournalClosedError)

    async def append_again():
        with pytest.raises(JournalClosedError, match="has failed.*may or may not be durable"):
            writer.append(b"next")

    asyncio.run(append_again())
    writer.close()
    assert read_quietly(tmp_path) in ([], [b"unawaited"])  # never acknowledged: either is fine

    # The loop stops before the flush task even starts.
    writer = JournalWriter.open(tmp_path)
    loop = asyncio.new_event_loop()

    def queue_and_stop():
        writer.append(b"unwritten")
        loop.stop()

    loop.call_soon(queue_and_stop)
    loop.run_forever()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        loop.close()
    with pytest.raises(JournalClosedError, match="event loop closed while 1 record"):
        writer.append_sync(b"next")
    writer.close()
    assert read_quietly(tmp_path)[-1:] != [b"unwritten"]
