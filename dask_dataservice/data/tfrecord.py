"""TFRecord files and ``tf.train.Example`` protos, without TensorFlow.

So that existing TFRecord datasets move over unchanged:

- :func:`read_records` streams the records of a TFRecord file (local path or fsspec URL) as
  ``bytes``, checking both CRCs of every record; :func:`write_records` writes them.
- :func:`parse_example` decodes one serialized ``tf.train.Example`` into a dict of numpy arrays
  (``int64_list`` → int64, ``float_list`` → float32, ``bytes_list`` → bytes); given a
  ``features`` dict of :class:`FixedLenFeature`/:class:`VarLenFeature` it checks and shapes
  them as ``tf.io.parse_single_example`` does. :func:`encode_example` is the inverse.

Record format (TensorFlow's ``core/lib/io/record_writer.cc``)::

    uint64 length (little endian) | uint32 masked_crc32c(length bytes) | data | uint32 masked_crc32c(data)

with ``masked_crc = ((crc >> 15) | (crc << 17)) + 0xa282ead8`` (mod 2**32).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import TFRecordCorruptError
from ._fs import open_file

__all__ = [
    "FixedLenFeature",
    "TFRecordCorruptError",
    "VarLenFeature",
    "encode_example",
    "parse_example",
    "read_records",
    "write_records",
]

_MASK_DELTA = 0xA282EAD8


def _crc32c(data: bytes) -> int:
    import google_crc32c  # a dependency of zarr's codecs; fast C implementation

    return int(google_crc32c.value(data))


def _masked_crc(data: bytes) -> int:
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def read_records(path: str, check_crc: bool = True) -> Iterator[bytes]:
    """The records of one TFRecord file, in order (streamed: one record in memory at a time)."""
    with open_file(path, "rb") as f:
        offset = 0
        while True:
            header = f.read(12)
            if not header:
                return
            if len(header) < 12:
                raise TFRecordCorruptError(f"{path}: truncated record header at byte {offset}")
            length_bytes, length_crc = header[:8], struct.unpack("<I", header[8:])[0]
            if check_crc and _masked_crc(length_bytes) != length_crc:
                raise TFRecordCorruptError(f"{path}: corrupted record length at byte {offset} (CRC mismatch)")
            (length,) = struct.unpack("<Q", length_bytes)
            data = f.read(length)
            footer = f.read(4)
            if len(data) < length or len(footer) < 4:
                raise TFRecordCorruptError(f"{path}: truncated record at byte {offset}")
            if check_crc and _masked_crc(data) != struct.unpack("<I", footer)[0]:
                raise TFRecordCorruptError(f"{path}: corrupted record data at byte {offset} (CRC mismatch)")
            yield data
            offset += 16 + length


def write_records(path: str, records: Iterable[bytes]) -> int:
    """Write ``records`` (bytes) as a TFRecord file; returns how many were written."""
    n = 0
    with open_file(path, "wb") as f:
        for data in records:
            data = bytes(data)
            length = struct.pack("<Q", len(data))
            f.write(length + struct.pack("<I", _masked_crc(length)) + data
                    + struct.pack("<I", _masked_crc(data)))
            n += 1
    return n


# ---------------------------------------------------------------------------------------------
# tf.train.Example: a tiny protobuf wire-format codec for its three messages
# ---------------------------------------------------------------------------------------------
# Example  { Features features = 1; }
# Features { map<string, Feature> feature = 1; }          (entries: key = 1, value = 2)
# Feature  { oneof { BytesList bytes_list = 1; FloatList float_list = 2; Int64List int64_list = 3; } }
# BytesList { repeated bytes value = 1; }  FloatList { repeated float value = 1 [packed]; }
# Int64List { repeated int64 value = 1 [packed]; }


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 70:
            raise ValueError("varint too long")


def _fields(buf: bytes) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of a message: ints for varints, bytes otherwise."""
    pos = 0
    value: int | bytes
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            n, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + n], pos + n
            if pos > len(buf):
                raise ValueError("truncated length-delimited field")
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield number, wire, value


def _feature_values(feature: bytes) -> np.ndarray:
    for kind, _, payload in _fields(feature):
        if kind == 1:  # bytes_list
            return np.array([v for n, _, v in _fields(payload) if n == 1], dtype=object)
        if kind == 2:  # float_list: packed (wire 2) or one float per field (wire 5)
            out: list[float] = []
            for n, wire, v in _fields(payload):
                if n == 1:
                    out.extend(np.frombuffer(v, "<f4").tolist() if wire == 2 else [struct.unpack("<f", v)[0]])
            return np.asarray(out, dtype=np.float32)
        if kind == 3:  # int64_list: packed varints (wire 2) or one varint per field (wire 0)
            ints: list[int] = []
            for n, wire, v in _fields(payload):
                if n != 1:
                    continue
                if wire == 0:
                    ints.append(v)
                else:
                    pos = 0
                    while pos < len(v):
                        x, pos = _varint(v, pos)
                        ints.append(x)
            return np.asarray([x - (1 << 64) if x >= 1 << 63 else x for x in ints], dtype=np.int64)
    return np.asarray([], dtype=np.float32)  # an empty Feature (no kind set)


@dataclass(frozen=True)
class FixedLenFeature:
    """A feature of fixed ``shape`` (TF's ``tf.io.FixedLenFeature``)."""

    shape: tuple[int, ...] | list[int]
    dtype: Any
    default_value: Any = None


@dataclass(frozen=True)
class VarLenFeature:
    """A feature of any length, as a 1-D array (TF gives a SparseTensor; we give its values)."""

    dtype: Any


def _kind(dtype: Any) -> str:
    if dtype in (bytes, str, object, "string") or np.dtype(dtype).kind in "SUO":
        return "bytes"
    return "float" if np.dtype(dtype).kind == "f" else "int"


def parse_example(serialized: bytes, features: dict[str, Any] | None = None) -> dict[str, np.ndarray]:
    """Decode one serialized ``tf.train.Example`` (see the module docstring)."""
    try:
        raw: dict[str, np.ndarray] = {}
        for number, _, features_msg in _fields(bytes(serialized)):
            if number != 1:
                continue
            for n, _, entry in _fields(features_msg):
                if n != 1:
                    continue
                key, value = None, b""
                for k, _, v in _fields(entry):
                    if k == 1:
                        key = v.decode("utf-8")
                    elif k == 2:
                        value = v
                if key is not None:
                    raw[key] = _feature_values(value)
    except (ValueError, UnicodeDecodeError, struct.error) as e:
        raise ValueError(f"parse_example: not a serialized tf.train.Example ({e})") from None
    if features is None:
        return raw
    out = {}
    for name, spec in features.items():
        values = raw.get(name)
        if isinstance(spec, VarLenFeature):
            out[name] = _as(values if values is not None else np.asarray([]), spec.dtype, name)
            continue
        if not isinstance(spec, FixedLenFeature):
            raise TypeError(f"parse_example: features[{name!r}] must be a FixedLenFeature or VarLenFeature")
        shape = tuple(spec.shape)
        if values is None or values.size == 0:
            if spec.default_value is None:
                raise ValueError(f"parse_example: feature {name!r} is required but missing")
            out[name] = np.broadcast_to(_as(np.asarray(spec.default_value), spec.dtype, name), shape).copy()
            continue
        size = int(np.prod(shape)) if shape else 1
        if values.size != size:
            raise ValueError(
                f"parse_example: feature {name!r} has {values.size} values, FixedLenFeature{shape} needs {size}")
        out[name] = _as(values, spec.dtype, name).reshape(shape)
    return out


def _as(values: np.ndarray, dtype: Any, name: str) -> np.ndarray:
    kind = _kind(dtype)
    have = "bytes" if values.dtype == object else ("float" if values.dtype.kind == "f" else "int")
    if values.size and kind != have:
        raise TypeError(f"parse_example: feature {name!r} holds {have} values, the spec asks for {kind}")
    if kind == "bytes":
        return np.asarray(values, dtype=object)
    return values.astype(np.dtype(dtype), copy=False)


def _key(number: int, wire: int) -> bytes:
    return _enc_varint((number << 3) | wire)


def _enc_varint(x: int) -> bytes:
    x &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = x & 0x7F
        x >>= 7
        if x:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _delimited(number: int, payload: bytes) -> bytes:
    return _key(number, 2) + _enc_varint(len(payload)) + payload


def encode_example(features: dict[str, Any]) -> bytes:
    """Serialize a dict of values as a ``tf.train.Example`` (ints → int64_list, floats →
    float_list, bytes/str → bytes_list; scalars and 1-D or N-D arrays, flattened)."""
    entries = b""
    for name, value in features.items():
        arr = np.asarray(value)
        flat = arr.reshape(-1)
        if arr.dtype.kind in "SUO":
            items = [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in flat.tolist()]
            feature = _delimited(1, b"".join(_delimited(1, v) for v in items))
        elif arr.dtype.kind == "f":
            feature = _delimited(2, _delimited(1, flat.astype("<f4").tobytes()))
        elif arr.dtype.kind in "iub":
            feature = _delimited(3, _delimited(1, b"".join(_enc_varint(int(v)) for v in flat.tolist())))
        else:
            raise TypeError(f"encode_example: feature {name!r} has unsupported dtype {arr.dtype}")
        entries += _delimited(1, _delimited(1, name.encode("utf-8")) + _delimited(2, feature))
    return _delimited(1, entries)
