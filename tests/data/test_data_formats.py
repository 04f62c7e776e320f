"""File formats on local and fsspec filesystems: CSV, JSON lines, TFRecord (+ tf.train.Example),
Parquet row groups, images. Real files (tmp_path) and fsspec's in-memory filesystem, no network."""

from __future__ import annotations

import subprocess
import sys
import uuid

import fsspec
import numpy as np
import pytest
from _helpers import distribute, elements, needs, py, read

import dask_dataservice as dds
from dask_dataservice.data import Dataset, ListSplitProvider
from dask_dataservice.data.formats import RowGroupSplit
from dask_dataservice.data.tfrecord import (
    FixedLenFeature,
    TFRecordCorruptError,
    VarLenFeature,
    encode_example,
    parse_example,
    read_records,
    write_records,
)
from dask_dataservice.testing import gen_cluster

pytestmark = pytest.mark.pure

pq = needs("pyarrow.parquet", "parquet")
pa = needs("pyarrow", "parquet")


@pytest.fixture
def mem():
    """A fresh directory on fsspec's in-memory filesystem, removed afterwards."""
    root = f"memory://t{uuid.uuid4().hex}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


def put(url: str, data: bytes) -> None:
    with fsspec.open(url, "wb") as f:
        f.write(data)


# -- CSV / JSON lines --------------------------------------------------------------------


def test_csv_rows_types_defaults_selection(tmp_path, mem):
    text = "id,score,name\n1,0.5,ann\n2,,bob\n3,1.25,\n"
    (tmp_path / "a.csv").write_text(text)
    put(f"{mem}/a.csv", text.encode())
    for pattern in (str(tmp_path / "*.csv"), f"{mem}/*.csv"):
        ds = Dataset.from_csv(pattern, column_defaults={"score": 0.0, "name": "?"})
        assert elements(ds) == [{"id": 1, "score": 0.5, "name": "ann"},
                                {"id": 2, "score": 0.0, "name": "bob"},
                                {"id": 3, "score": 1.25, "name": "?"}]
        assert isinstance(next(iter(ds))["id"], np.int64)
    sel = Dataset.from_csv(str(tmp_path / "a.csv"), select_columns=["id"])
    assert elements(sel) == [{"id": 1}, {"id": 2}, {"id": 3}]
    with pytest.raises(ValueError, match=r"a.csv:3: column 'score' is empty and has no default"):
        list(Dataset.from_csv(str(tmp_path / "a.csv")))
    with pytest.raises(KeyError, match="no column"):
        list(Dataset.from_csv(str(tmp_path / "a.csv"), select_columns=["nope"]))
    with pytest.raises(FileNotFoundError, match="no files match"):
        Dataset.from_csv(str(tmp_path / "missing-*.csv"))


def test_json_lines(mem):
    put(f"{mem}/x.jsonl", b'{"a": 1, "v": [1, 2]}\n\n{"a": 2, "v": [3, 4]}\n')
    got = list(Dataset.from_json_lines(f"{mem}/x.jsonl"))
    assert [g["a"] for g in got] == [1, 2]
    assert isinstance(got[1]["v"], np.ndarray) and got[1]["v"].tolist() == [3, 4]
    put(f"{mem}/bad.jsonl", b'{"a": 1}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not JSON"):
        list(Dataset.from_json_lines(f"{mem}/bad.jsonl"))


# -- TFRecord ------------------------------------------------------------------------------


def test_tfrecord_round_trip_and_damage(tmp_path):
    path = str(tmp_path / "r.tfrecord")
    records = [b"", b"x", bytes(range(256)) * 10]
    assert write_records(path, records) == 3
    assert list(read_records(path)) == records
    assert elements(Dataset.from_tfrecord(path)) == records
    raw = bytearray(open(path, "rb").read())
    # flip one byte of the second record's data: its CRC catches it, naming the offset
    second = 16 + 0
    bad = bytearray(raw)
    bad[second + 12] ^= 0xFF
    (tmp_path / "bad.tfrecord").write_bytes(bytes(bad))
    with pytest.raises(TFRecordCorruptError, match=rf"bad.tfrecord: corrupted record data at byte {second}"):
        list(read_records(str(tmp_path / "bad.tfrecord")))
    bad = bytearray(raw)
    bad[0] ^= 0x01  # the first record's length
    (tmp_path / "len.tfrecord").write_bytes(bytes(bad))
    with pytest.raises(TFRecordCorruptError, match="corrupted record length at byte 0"):
        list(read_records(str(tmp_path / "len.tfrecord")))
    (tmp_path / "cut.tfrecord").write_bytes(bytes(raw[:-3]))
    with pytest.raises(TFRecordCorruptError, match="truncated record at byte 33"):
        list(read_records(str(tmp_path / "cut.tfrecord")))


def test_tfrecord_checksums_are_masked_crc32c():
    from dask_dataservice.data.tfrecord import _crc32c, _masked_crc

    # CRC-32C test vectors (RFC 3720, B.4; and the classic "123456789")
    assert _crc32c(b"\0" * 32) == 0x8A9136AA
    assert _crc32c(b"123456789") == 0xE3069283
    # TensorFlow's mask (core/lib/hash/crc32c.h): rotate right by 15, add kMaskDelta
    crc = 0xE3069283
    assert _masked_crc(b"123456789") == (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _protobuf_example_class():
    """tf.train.Example built with the real protobuf library (no TensorFlow), to cross-check."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    f = descriptor_pb2.FileDescriptorProto(name=f"ex{uuid.uuid4().hex}.proto", package="tfx", syntax="proto3")
    T = descriptor_pb2.FieldDescriptorProto
    for name, ftype in (("BytesList", T.TYPE_BYTES), ("FloatList", T.TYPE_FLOAT), ("Int64List", T.TYPE_INT64)):
        m = f.message_type.add(name=name)
        field = m.field.add(name="value", number=1, type=ftype, label=T.LABEL_REPEATED)
        if ftype != T.TYPE_BYTES:
            field.options.packed = True
    feat = f.message_type.add(name="Feature")
    feat.oneof_decl.add(name="kind")
    for i, (n, t) in enumerate((("bytes_list", "BytesList"), ("float_list", "FloatList"), ("int64_list", "Int64List"))):
        feat.field.add(name=n, number=i + 1, type=T.TYPE_MESSAGE, type_name=f".tfx.{t}",
                       label=T.LABEL_OPTIONAL, oneof_index=0)
    feats = f.message_type.add(name="Features")
    entry = feats.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=T.TYPE_STRING, label=T.LABEL_OPTIONAL)
    entry.field.add(name="value", number=2, type=T.TYPE_MESSAGE, type_name=".tfx.Feature", label=T.LABEL_OPTIONAL)
    feats.field.add(name="feature", number=1, type=T.TYPE_MESSAGE, type_name=".tfx.Features.FeatureEntry",
                    label=T.LABEL_REPEATED)
    ex = f.message_type.add(name="Example")
    ex.field.add(name="features", number=1, type=T.TYPE_MESSAGE, type_name=".tfx.Features", label=T.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tfx.Example"))


def test_example_codec_agrees_with_protobuf():
    needs("google.protobuf", "test")
    Example = _protobuf_example_class()
    ours = encode_example({"label": 3, "neg": np.array([-1, 2**40]), "w": np.array([0.5, 1.5], np.float32),
                           "name": b"cat", "tags": np.array(["a", "bc"])})
    theirs = Example()
    theirs.ParseFromString(ours)
    fm = theirs.features.feature
    assert list(fm["label"].int64_list.value) == [3]
    assert list(fm["neg"].int64_list.value) == [-1, 2**40]
    assert list(fm["w"].float_list.value) == [0.5, 1.5]
    assert list(fm["name"].bytes_list.value) == [b"cat"]
    assert list(fm["tags"].bytes_list.value) == [b"a", b"bc"]
    # and protobuf's serialization (unpacked too) parses with ours
    msg = Example()
    msg.features.feature["x"].int64_list.value.extend([5, -7])
    msg.features.feature["y"].float_list.value.append(2.0)
    msg.features.feature["z"].bytes_list.value.append(b"\x00\xff")
    got = parse_example(msg.SerializeToString())
    assert got["x"].tolist() == [5, -7] and got["x"].dtype == np.int64
    assert got["y"].tolist() == [2.0] and got["y"].dtype == np.float32
    assert got["z"].tolist() == [b"\x00\xff"]


def test_parse_example_with_a_feature_spec():
    rec = encode_example({"img": np.arange(6, dtype=np.float32), "label": 1, "ids": np.array([4, 5, 6])})
    spec = {"img": FixedLenFeature([2, 3], np.float32), "label": FixedLenFeature([], np.int64),
            "ids": VarLenFeature(np.int64), "extra": FixedLenFeature([], np.int64, default_value=-1)}
    out = parse_example(rec, spec)
    assert out["img"].shape == (2, 3) and out["label"].shape == () and int(out["label"]) == 1
    assert out["ids"].tolist() == [4, 5, 6] and int(out["extra"]) == -1
    with pytest.raises(ValueError, match="'missing' is required but missing"):
        parse_example(rec, {"missing": FixedLenFeature([], np.int64)})
    with pytest.raises(ValueError, match="has 6 values, FixedLenFeature"):
        parse_example(rec, {"img": FixedLenFeature([4], np.float32)})
    with pytest.raises(TypeError, match="holds float values"):
        parse_example(rec, {"img": FixedLenFeature([6], np.int64)})
    with pytest.raises(ValueError, match="not a serialized tf.train.Example"):
        parse_example(b"\xff\xff\xff")
    # a TFRecord of Examples, parsed in the pipeline
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        write_records(f"{d}/e.tfrecord", [encode_example({"label": i}) for i in range(3)])
        labels = Dataset.from_tfrecord(f"{d}/*.tfrecord").map(
            lambda r: parse_example(r, {"label": FixedLenFeature([], np.int64)})["label"])
        assert elements(labels) == [0, 1, 2]


# -- Parquet -------------------------------------------------------------------------------


def _parquet(path_or_file, n: int, row_group_size: int, start: int = 0) -> None:
    table = pa.table({"x": np.arange(start, start + n), "y": np.arange(start, start + n) * 0.5,
                      "s": [f"r{i}" for i in range(start, start + n)]})
    pq.write_table(table, path_or_file, row_group_size=row_group_size)


def test_parquet_row_groups_are_splits(tmp_path, mem):
    _parquet(str(tmp_path / "a.parquet"), 10, 4)
    _parquet(str(tmp_path / "b.parquet"), 5, 5, start=10)
    ds = Dataset.from_parquet(str(tmp_path / "*.parquet"), columns=["x", "s"])
    splits = ds.splits()
    assert splits == [RowGroupSplit(str(tmp_path / "a.parquet"), 0), RowGroupSplit(str(tmp_path / "a.parquet"), 1),
                      RowGroupSplit(str(tmp_path / "a.parquet"), 2), RowGroupSplit(str(tmp_path / "b.parquet"), 0)]
    assert ds.cardinality() == 15
    rows = elements(ds)
    assert rows == [{"x": i, "s": f"r{i}"} for i in range(15)]
    # two DYNAMIC-style workers: even and odd row groups, every row once
    got = [py(r)["x"] for r in ds.iterate(ListSplitProvider(splits[0::2]))] + \
          [py(r)["x"] for r in ds.iterate(ListSplitProvider(splits[1::2]))]
    assert sorted(got) == list(range(15))
    batches = list(Dataset.from_parquet(str(tmp_path / "a.parquet"), rows=False, batch_rows=3))
    assert [b["x"].tolist() for b in batches] == [[0, 1, 2], [3], [4, 5, 6], [7], [8, 9]]
    with fsspec.open(f"{mem}/c.parquet", "wb") as f:
        _parquet(f, 6, 2)
    assert [py(r)["y"] for r in Dataset.from_parquet(f"{mem}/c.parquet")] == [i * 0.5 for i in range(6)]
    with pytest.raises(KeyError, match=r"no column\(s\) \['nope'\]"):
        Dataset.from_parquet(str(tmp_path / "a.parquet"), columns=["nope"])


@pytest.mark.cluster
@gen_cluster(client=True, nthreads=[("", 1)] * 2)
async def test_parquet_through_the_service_dynamic(c, s, a, b):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        for i in range(3):
            _parquet(f"{d}/p{i}.parquet", 1000, 250, start=i * 1000)
        ds = Dataset.from_parquet(f"{d}/*.parquet", columns=["x"]).map(lambda r: r["x"])
        out = await read(await distribute(ds, "distributed_epoch", c))
        assert sorted(int(x) for x in out) == list(range(3000))
        out = await read(await distribute(Dataset.from_parquet(f"{d}/p0.parquet", columns=["x"])
                                          .map(lambda r: r["x"]), dds.ShardingPolicy.OFF, c))
        assert sorted(int(x) for x in out) == sorted(list(range(1000)) * 2)


# -- images, globs, optional dependencies ---------------------------------------------------------


def test_images_decode_to_uint8(tmp_path, mem):
    from PIL import Image

    rgb = (np.arange(4 * 5 * 3) % 256).astype(np.uint8).reshape(4, 5, 3)
    Image.fromarray(rgb).save(tmp_path / "a.png")
    with fsspec.open(f"{mem}/g.png", "wb") as f:
        Image.fromarray(rgb[..., 0]).save(f, format="PNG")
    (img,) = list(Dataset.from_images(str(tmp_path / "*.png")))
    assert img.dtype == np.uint8 and np.array_equal(img, rgb)
    (gray,) = list(Dataset.from_images(f"{mem}/*.png"))
    assert np.array_equal(gray, rgb[..., 0])
    (as_rgb,) = list(Dataset.from_images(f"{mem}/*.png", mode="RGB"))
    assert as_rgb.shape == (4, 5, 3)


def test_list_files_and_text_lines_on_memory_fs(mem):
    for i in range(3):
        put(f"{mem}/d/{i}.txt", f"a{i}\nb{i}\n".encode())
    files = Dataset.list_files(f"{mem}/d/*.txt")
    assert elements(files) == [f"{mem}/d/{i}.txt" for i in range(3)]
    lines = files.flat_map(lambda p: Dataset.from_files(p, dds.data.readers.text_lines))
    assert elements(lines) == ["a0", "b0", "a1", "b1", "a2", "b2"]
    buf = __import__("io").BytesIO()
    np.save(buf, np.arange(6).reshape(3, 2))
    put(f"{mem}/m.npy", buf.getvalue())
    assert elements(Dataset.from_files(f"{mem}/m.npy", dds.data.readers.npy)) == [[0, 1], [2, 3], [4, 5]]


@pytest.mark.process
def test_importing_the_package_imports_no_optional_dependency():
    code = ("import sys, dask_dataservice as dds; dds.Dataset.range(3); "
            "bad = [m for m in ('pyarrow', 'PIL', 'torch', 'jax', 'fsspec') if m in sys.modules]; "
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() in ("[]", "['fsspec']")  # fsspec comes with dask


@pytest.mark.process
def test_a_missing_extra_names_what_to_install(tmp_path):
    _parquet(str(tmp_path / "a.parquet"), 3, 3)
    code = ("import sys; sys.modules['pyarrow'] = None; sys.modules['pyarrow.parquet'] = None\n"
            "from dask_dataservice.data import Dataset\n"
            f"Dataset.from_parquet({str(tmp_path / 'a.parquet')!r})\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0
    assert "pip install 'dask-dataservice[parquet]'" in out.stderr
