"""Snapshot chunks in open formats (data/snapshot.py, data/_snapshot_arrow.py), without a cluster.

Real files written by the chunk writer stage that ``distributed_save`` runs on the data
workers (``WriteChunks``), read back by ``Dataset.load`` and by pyarrow, pandas and
dask.dataframe; the pickle fallback and its opt-in; snapshots of the previous version (pickle +
zlib chunks, manifest version 1, built by the old format's own function ``encode_chunk``);
damaged chunks."""

from __future__ import annotations

import collections
import json
import os
import sys
import zlib

import numpy as np
import pytest
from _helpers import needs

from dask_dataservice.data import Dataset
from dask_dataservice.data.snapshot import (
    CHUNKS,
    SnapshotCorruptedError,
    WriteChunks,
    chunk_num_elements,
    committed_chunks,
    encode_chunk,
    read_chunk,
)
from dask_dataservice.errors import install_hint

pytestmark = pytest.mark.pure

Point = collections.namedtuple("Point", "x y")

#: every structure the open formats store, each as a list of elements of one chunk
CASES = {
    "py_int": [1, -2, 2**62],
    "py_float": [1.5, float("inf"), -0.0],
    "py_bool": [True, False],
    "py_str": ["a", "bé", ""],
    "py_bytes": [b"x", b"\x00y", b""],
    "np_scalars": [np.float32(1.5), np.float32(-2)],
    "np_uint8": [np.uint8(255), np.uint8(0)],
    "np_str_scalars": [np.str_("a"), np.str_("bcd")],
    "np_bytes_scalars": [np.bytes_(b"ab"), np.bytes_(b"c")],
    "vectors": [np.arange(3), np.arange(3) + 10],
    "ragged_vectors": [np.arange(3, dtype=np.int32), np.arange(5, dtype=np.int32), np.arange(0, dtype=np.int32)],
    "matrices": [np.zeros((2, 3), np.float32), np.ones((2, 3), np.float32)],
    "images": [np.random.default_rng(0).integers(0, 255, (4, 5, 3), dtype=np.uint8) for _ in range(3)],
    "ragged_matrices": [np.zeros((2, 3)), np.ones((4, 3)), np.zeros((0, 3))],
    "zero_d_arrays": [np.array(1.5), np.array(2.5)],
    "string_arrays": [np.array(["a", "bb"]), np.array(["cc", "d"])],
    "bytes_matrices": [np.array([[b"a"], [b"bc"]]), np.array([[b"de"], [b""]])],
    "bool_matrices": [np.array([[True, False]]), np.array([[False, False]])],
    "big_endian": [np.arange(4, dtype=">i4"), (np.arange(4) * 2).astype(">i4")],
    "float16": [np.arange(3, dtype=np.float16)],
    "datetimes": [np.array(["2020-01-01", "2021-06-30"], "datetime64[ms]")],
    "timedeltas": [np.timedelta64(5, "us"), np.timedelta64(7, "us")],
    "features": [{"id": i, "x": np.full(8, i, np.float32), "t": ("s", {"n": np.int8(i)})}
                 for i in range(20)],
    "namedtuples": [Point(1, np.arange(2)), Point(2, np.arange(2))],
    "tuples": [(1, "a"), (2, "b")],
    "int_and_str_keys": [{1: "a", "k": 2.0}, {1: "b", "k": 3.0}],
    "colliding_names": [{"a.b": 1, "a": {"b": 2}}],
}


def exact(a, b) -> bool:
    """Same type, dtype, shape, values, structure and key order (arrays: also writable)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(exact(a[k], b[k]) for k in a)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(exact(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray):
        return (a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
                and b.flags.writeable)
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and (a == b or (a != a and b != b))
    return a == b or (a != a and b != b)


def save(elements, path, max_elements=1000, **kwargs):
    """Write ``elements`` as the data workers do; a done manifest as distributed_save's."""
    source = Dataset.from_generator(lambda: iter(elements))
    descriptors = list(Dataset(WriteChunks(source._op, str(path), max_elements, 1 << 30,
                                           3600.0, **kwargs)))
    names = sorted(d["chunk"] for d in descriptors)
    (path / "snapshot.json").write_text(json.dumps({
        "format": "dask-dataservice-snapshot", "version": 2, "state": "done", "chunks": names,
        "num_elements": len(elements)}))
    return descriptors


@pytest.mark.parametrize("fmt", ["arrow", "parquet"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_supported_structure_round_trips_exactly(tmp_path, fmt, case):
    elements = CASES[case]
    (d,) = save(elements, tmp_path, format=fmt, fallback=False)
    assert d["format"] == fmt and d["chunk"].endswith(f".{fmt}") and d["elements"] == len(elements)
    back = list(Dataset.load(str(tmp_path)))
    assert len(back) == len(elements)
    for want, got in zip(elements, back, strict=True):  # in the order written
        assert exact(want, got), (want, got)


def test_namedtuples_come_back_as_the_writers_class_only_if_already_imported(tmp_path):
    save(CASES["namedtuples"], tmp_path)
    assert type(next(iter(Dataset.load(str(tmp_path))))) is Point
    chunk = str(tmp_path / CHUNKS / committed_chunks(str(tmp_path))[0])
    module = sys.modules.pop(Point.__module__)
    try:  # the class's module is not imported here: an equivalent namedtuple, nothing imported
        p = read_chunk(chunk)[0]
        assert Point.__module__ not in sys.modules
    finally:
        sys.modules[Point.__module__] = module
    assert type(p) is not Point and type(p).__name__ == "Point" and p._fields == ("x", "y")
    assert p.x == 1 and np.array_equal(p.y, np.arange(2))


def nested(v):
    """pandas' value of a nested fixed-size list (arrays of arrays) as one numpy array."""
    return np.stack([nested(x) for x in v]) if v.dtype == object else v


@pytest.mark.parametrize("fmt", ["arrow", "parquet"])
def test_chunks_are_read_by_pyarrow_pandas_and_dask(tmp_path, fmt):
    pa = needs("pyarrow", "parquet")
    import pandas as pd
    import pyarrow.dataset as pds

    rng = np.random.default_rng(1)
    images = rng.integers(0, 255, (30, 4, 5, 3), dtype=np.uint8)
    elements = [{"id": i, "x": np.full(3, i, np.float32), "image": images[i], "name": f"n{i}"}
                for i in range(30)]
    save(elements, tmp_path, max_elements=10, format=fmt, compression="ZSTD")
    where = str(tmp_path / CHUNKS)
    files = sorted(os.path.join(where, n) for n in os.listdir(where))
    assert len(files) == 3 and all(f.endswith(f".{fmt}") for f in files)

    table = pds.dataset(where, format="parquet" if fmt == "parquet" else "ipc").to_table()
    assert table.column_names == ["id", "x", "image", "name"]
    table = table.sort_by("id")
    assert table.column("id").to_pylist() == list(range(30))
    assert table.schema.field("x").type == pa.list_(pa.float32(), 3)
    assert table.schema.field("image").type == pa.list_(pa.list_(pa.list_(pa.uint8(), 3), 5), 4)
    values = table.column("image").combine_chunks().flatten().flatten().flatten()
    assert np.array_equal(values.to_numpy().reshape(30, 4, 5, 3), images)
    meta = json.loads(table.schema.metadata[b"dask_dataservice"])
    assert meta["format"] == "dask-dataservice-snapshot-chunk" and meta["version"] == 1
    x = meta["structure"]["items"][1]
    assert (x["column"], x["dtype"], x["shape"], x["layout"]) == ("x", "<f4", [3], "fixed_list")

    reader = pd.read_parquet if fmt == "parquet" else pd.read_feather
    df = pd.concat([reader(f) for f in files]).sort_values("id").reset_index(drop=True)
    assert list(df.columns) == ["id", "x", "image", "name"]
    assert df["id"].tolist() == list(range(30)) and df["name"].tolist() == [f"n{i}" for i in range(30)]
    assert all(np.array_equal(v, np.full(3, i, np.float32)) for i, v in enumerate(df["x"]))
    assert np.array_equal(np.stack([nested(v) for v in df["image"]]), images)
    if fmt == "parquet":
        import dask.dataframe as dd

        ddf = dd.read_parquet(where).compute(scheduler="sync").sort_values("id")  # no pool
        assert list(ddf.columns) == ["id", "x", "image", "name"]
        assert ddf["id"].tolist() == list(range(30))
        assert all(np.array_equal(v, np.full(3, i, np.float32)) for i, v in enumerate(ddf["x"]))
        assert np.array_equal(np.stack([nested(v) for v in ddf["image"]]), images)


def test_objects_fall_back_to_pickle_only_when_allowed(tmp_path):
    elements = [{"a": 1, "b": None}, {"a": 2, "b": [1, 2]}]
    descs = save(elements, tmp_path / "auto")  # format "arrow", fallback (what AUTO asks for)
    assert [d["format"] for d in descs] == ["pickle"] and descs[0]["chunk"].endswith(".chunk")
    assert descs[0]["structure"] is None
    assert list(Dataset.load(str(tmp_path / "auto"), allow_pickle=True)) == elements
    with pytest.raises(TypeError) as e:
        save(elements, tmp_path / "strict", format="parquet", fallback=False)
    assert str(e.value) == (
        "distributed_save(format='parquet'): the elements cannot be stored in parquet (column "
        "'b': leaves of different types ['NoneType', 'list']); use format='AUTO' (pickle for "
        "such chunks) or format='pickle'")
    # one chunk in the open format, the next pickled: the fallback is per chunk
    descs = save([1, 2, 3, object], tmp_path / "mixed", max_elements=2)
    assert [d["format"] for d in descs] == ["arrow", "pickle"]


PICKLE_REFUSED = (
    "{where}: it holds pickle chunks (format='pickle', or elements Arrow cannot represent). "
    "Loading a pickle can run arbitrary code: pass allow_pickle=True to Dataset.load only for "
    "a snapshot you trust")
OLD_REFUSED = (
    "{where}: it was written by a version of dask-dataservice before the open formats, as "
    "pickles. Loading a pickle can run arbitrary code: pass allow_pickle=True to Dataset.load "
    "only for a snapshot you trust")


def test_loading_pickle_chunks_needs_the_opt_in(tmp_path):
    elements = [{"a": np.arange(3)}, {"a": np.arange(2)}]
    save(elements, tmp_path, format="pickle")
    with pytest.raises(ValueError) as e:
        Dataset.load(str(tmp_path))
    assert str(e.value) == PICKLE_REFUSED.format(where=tmp_path)
    (name,) = committed_chunks(str(tmp_path))
    chunk = str(tmp_path / CHUNKS / name)
    with pytest.raises(ValueError) as e:
        read_chunk(chunk)  # what a data worker runs: refused there too
    assert str(e.value) == PICKLE_REFUSED.format(where=chunk)
    back = list(Dataset.load(str(tmp_path), allow_pickle=True))
    assert all(exact(a, b) for a, b in zip(elements, back, strict=True))
    assert chunk_num_elements(chunk) == 2  # from the header: nothing unpickled
    with pytest.raises(TypeError, match="allow_pickle must be a bool, got 'yes'"):
        Dataset.load(str(tmp_path), allow_pickle="yes")


@pytest.mark.parametrize("state", ["done", "running"])
@pytest.mark.parametrize("compress", [False, True])
def test_a_snapshot_of_the_previous_version_loads_with_the_opt_in(tmp_path, state, compress):
    """The previous version's layout: manifest version 1, ``<stream>-<n>.chunk`` files made by
    its ``encode_chunk`` (pickle, zlib under ``GZIP``)."""
    chunks = [[np.arange(3), {"a": np.float32(1.5)}], [(1, "s"), b"x"]]
    os.makedirs(tmp_path / CHUNKS)
    names = []
    for i, elements in enumerate(chunks):
        names.append(f"abcdef123456-{i:06d}.chunk")
        (tmp_path / CHUNKS / names[-1]).write_bytes(encode_chunk(elements, compress))
    manifest = {"format": "dask-dataservice-snapshot", "version": 1, "state": state,
                "fingerprint": "f", "cardinality": 4, "started": 0.0,
                "compression": "GZIP" if compress else "AUTO"}
    if state == "done":
        manifest.update(finished=1.0, chunks=names, num_elements=4, complete=True)
    (tmp_path / "snapshot.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError) as e:
        Dataset.load(str(tmp_path))
    assert str(e.value) == OLD_REFUSED.format(where=tmp_path)
    loaded = Dataset.load(str(tmp_path), allow_pickle=True)
    out = list(loaded)
    assert np.array_equal(out[0], np.arange(3)) and out[1:] == [{"a": np.float32(1.5)}, (1, "s"), b"x"]
    assert len(loaded.splits()) == 2


def test_a_newer_snapshot_version_is_refused_clearly(tmp_path):
    (tmp_path / "snapshot.json").write_text(json.dumps(
        {"format": "dask-dataservice-snapshot", "version": 3, "state": "done", "chunks": []}))
    with pytest.raises(SnapshotCorruptedError, match=r"snapshot version 3; this dask-dataservice "
                       r"reads versions 1 to 2 \(upgrade it to read this snapshot\)"):
        Dataset.load(str(tmp_path))


@pytest.mark.parametrize("fmt", ["arrow", "parquet"])
def test_a_torn_or_damaged_chunk_is_a_clear_error(tmp_path, fmt):
    elements = [np.random.default_rng(i).random(2000) for i in range(8)]  # 128 KB of floats
    save(elements, tmp_path, format=fmt)
    (name,) = committed_chunks(str(tmp_path))
    chunk = tmp_path / CHUNKS / name
    data = chunk.read_bytes()
    damaged = {
        "torn in half": data[: len(data) // 2],
        "last byte missing": data[:-1],
        "empty": b"",
        "a bit flipped in the values": data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 1])
        + data[len(data) // 2 + 1:],
    }
    for what, bad in damaged.items():
        chunk.write_bytes(bad)
        with pytest.raises(SnapshotCorruptedError) as e:
            list(Dataset.load(str(tmp_path)))
        assert str(e.value).startswith(f"{chunk}: "), what
    expected = "checksum mismatch" if fmt == "arrow" else "CRC"
    assert expected in str(e.value)  # the bit flip: found by the checksum, not by luck
    chunk.write_bytes(data)
    assert [x.tolist() for x in Dataset.load(str(tmp_path))] == [x.tolist() for x in elements]


def test_a_chunk_without_our_metadata_is_refused(tmp_path):
    pa = needs("pyarrow", "parquet")
    import pyarrow.parquet as pq

    os.makedirs(tmp_path / CHUNKS)
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / CHUNKS / "a-000000.parquet")
    (tmp_path / "snapshot.json").write_text(json.dumps({
        "format": "dask-dataservice-snapshot", "version": 2, "state": "done",
        "chunks": ["a-000000.parquet"], "num_elements": 2}))
    with pytest.raises(SnapshotCorruptedError, match="no dask_dataservice metadata in the schema"):
        list(Dataset.load(str(tmp_path)))


def test_chunk_sizes_are_read_from_the_schema_alone(tmp_path):
    descs = save(list(range(25)), tmp_path / "a", max_elements=10, format="arrow")
    descs += save(list(range(25)), tmp_path / "p", max_elements=10, format="parquet")
    counts = [chunk_num_elements(str(tmp_path / d["format"][0] / CHUNKS / d["chunk"]))
              for d in descs]
    assert counts == [10, 10, 5, 10, 10, 5]


def test_without_pyarrow_the_error_names_the_extra(tmp_path, monkeypatch):
    from dask_dataservice.service.client.snapshot import distributed_save

    save([1, 2], tmp_path / "s", format="arrow")
    for name in [m for m in sys.modules if m == "pyarrow" or m.startswith("pyarrow.")]:
        monkeypatch.setitem(sys.modules, name, None)  # import pyarrow raises ImportError
    with pytest.raises(ImportError) as e:
        distributed_save(Dataset.range(3), str(tmp_path / "new"), "tcp://127.0.0.1:1")
    assert str(e.value) == (
        "distributed_save(format='AUTO') (or format='pickle', which needs "
        "Dataset.load(allow_pickle=True)) needs the optional dependency 'pyarrow': "
        + install_hint("parquet"))
    with pytest.raises(ImportError, match=r"a snapshot in Arrow or Parquet format needs the "
                       r"optional dependency 'pyarrow': pip install 'dask-dataservice\[parquet\]'"):
        list(Dataset.load(str(tmp_path / "s")))
    assert not os.path.exists(tmp_path / "new")  # refused before anything was written
    # a pickle snapshot needs no pyarrow
    save([1, 2], tmp_path / "k", format="pickle")
    assert list(Dataset.load(str(tmp_path / "k"), allow_pickle=True)) == [1, 2]


def test_zlib_is_still_the_pickle_chunks_codec(tmp_path):
    descs = save([b"a" * 1000] * 10, tmp_path, format="pickle", compression="ZSTD")
    data = (tmp_path / CHUNKS / descs[0]["chunk"]).read_bytes()
    assert data[:8] == b"DDSCHNKZ" and zlib.decompress(data[24:])
