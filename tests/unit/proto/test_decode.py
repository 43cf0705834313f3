"""decode_rows against upb: same values for every row upb accepts, an error for
every row upb rejects, and determinism."""

from __future__ import annotations

import math
from typing import Any

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto.decode import arrow_type, decode_rows
from proto.descriptors import is_repeated, message_class

I32 = st.integers(-(2**31), 2**31 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)
U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
TEXT = st.text(max_size=12)


def _python(fd: FieldDescriptor, value: Any) -> Any:
    if fd.type == FieldDescriptor.TYPE_MESSAGE:
        return {f.name: _field(f, value) for f in fd.message_type.fields}
    if fd.type == FieldDescriptor.TYPE_FLOAT:
        return _float32(value)
    return value


def _float32(value: float) -> float:
    import numpy as np

    return float(np.float32(value))


def _field(fd: FieldDescriptor, msg: Message) -> Any:
    value = getattr(msg, fd.name)
    if is_repeated(fd):
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            return {k: value[k] for k in value}
        return [_python(fd, v) for v in value]
    if fd.has_presence and not msg.HasField(fd.name):
        return None
    return _python(fd, value)


def _decoded_value(fd: FieldDescriptor, value: Any) -> Any:
    if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
        return {e["key"]: e["value"] for e in value}
    return value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def check_against_upb(desc: Descriptor, rows: list[bytes]) -> None:
    cls = message_class(desc)
    decoded = decode_rows(desc, rows)
    assert decode_rows(desc, rows).errors == decoded.errors
    columns = {name: col.to_pylist() for name, col in decoded.columns.items()}
    for fd in desc.fields:
        assert decoded.columns[fd.name].type == arrow_type(fd)
    for i, row in enumerate(rows):
        try:
            msg = cls.FromString(row)
        except DecodeError:
            assert i in decoded.errors, f"upb rejects row {i} {row!r}, decode_rows accepts it"
            continue
        if i in decoded.errors:
            continue
        for fd in desc.fields:
            want = _field(fd, msg)
            got = _decoded_value(fd, columns[fd.name][i])
            assert _same(want, got), (i, fd.name, want, got, row)


@st.composite
def samples(draw: st.DrawFn, desc: Descriptor) -> bytes:
    cls = message_class(desc)
    m: Any = cls()
    for name, strat in [("i32", I32), ("i64", I64), ("u32", U32), ("u64", U64),
                        ("s32", I32), ("s64", I64), ("f32", U32), ("f64", U64),
                        ("sf32", I32), ("sf64", I64), ("fl", st.floats(width=32)),
                        ("db", st.floats()), ("flag", st.booleans()), ("text", TEXT),
                        ("blob", st.binary(max_size=8)), ("color", st.integers(0, 2))]:
        if draw(st.booleans()):
            setattr(m, name, draw(strat))
    if draw(st.booleans()):
        m.maybe = draw(I64)
    if draw(st.booleans()):
        m.maybe_text = draw(TEXT)
    if draw(st.booleans()):
        m.ts.seconds = draw(st.integers(-(2**40), 2**40))
        m.ts.nanos = draw(st.integers(0, 999_999_999))
    if draw(st.booleans()):
        m.wrapped.value = draw(I64)
    if draw(st.booleans()):
        m.inner.a = draw(I32)
        m.inner.b = draw(TEXT)
    m.packed_ints.extend(draw(st.lists(I64, max_size=4)))
    m.zigzags.extend(draw(st.lists(I32, max_size=4)))
    m.doubles.extend(draw(st.lists(st.floats(allow_nan=False), max_size=3)))
    m.names.extend(draw(st.lists(TEXT, max_size=3)))
    m.fixeds.extend(draw(st.lists(U32, max_size=3)))
    for a, b in draw(st.lists(st.tuples(I32, TEXT), max_size=3)):
        m.inners.add(a=a, b=b)
    for k, v in draw(st.dictionaries(TEXT, I64, max_size=3)).items():
        m.counts[k] = v
    choice = draw(st.sampled_from(["", "choice_text", "choice_num"]))
    if choice == "choice_text":
        m.choice_text = draw(TEXT)
    elif choice == "choice_num":
        m.choice_num = draw(I32)
    data: bytes = m.SerializeToString(deterministic=draw(st.booleans()))
    return data


SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(data=st.data())
def test_matches_upb(sample: Descriptor, data: st.DataObject) -> None:
    rows = data.draw(st.lists(samples(sample), max_size=20))
    check_against_upb(sample, rows)


@SETTINGS
@given(data=st.data())
def test_concatenated_rows_merge_like_upb(sample: Descriptor, data: st.DataObject) -> None:
    """Repeated fields append and scalars take the last value across occurrences."""
    parts = data.draw(st.lists(samples(sample), min_size=2, max_size=3))
    check_against_upb(sample, [b"".join(parts)] * 2)


@SETTINGS
@given(data=st.data())
def test_damaged_rows(sample: Descriptor, data: st.DataObject) -> None:
    rows = data.draw(st.lists(samples(sample), min_size=1, max_size=8))
    damaged = []
    for row in rows:
        kind = data.draw(st.sampled_from(["cut", "flip", "junk", "keep"]))
        if kind == "cut" and row:
            row = row[: data.draw(st.integers(0, len(row) - 1))]
        elif kind == "flip" and row:
            i = data.draw(st.integers(0, len(row) - 1))
            row = row[:i] + bytes([data.draw(st.integers(0, 255))]) + row[i + 1:]
        elif kind == "junk":
            row = data.draw(st.binary(max_size=30))
        damaged.append(row)
    check_against_upb(sample, damaged)


def test_empty_input(sample: Descriptor) -> None:
    decoded = decode_rows(sample, [])
    assert decoded.n == 0 and not decoded.errors
    assert all(len(c) == 0 for c in decoded.columns.values())


def test_reasons(sample: Descriptor) -> None:
    decoded = decode_rows(sample, [b"\x08", b"\x72\x05ab", b"\x72\x01\xff", b"\x0b", b""])
    assert set(decoded.errors) == {0, 1, 2, 3}
    assert "truncated" in decoded.errors[0]
    assert "UTF-8" in decoded.errors[2]
    assert "group" in decoded.errors[3]


def test_presence(sample: Descriptor) -> None:
    cls: Any = message_class(sample)
    rows = [cls(maybe=0).SerializeToString(), cls().SerializeToString()]
    decoded = decode_rows(sample, rows)
    assert decoded.columns["maybe"].to_pylist() == [0, None]
    assert decoded.columns["i64"].to_pylist() == [0, 0]
    assert decoded.columns["ts"].to_pylist() == [None, None]


@pytest.mark.parametrize("count", [1, 1000])
def test_many_rows(sample: Descriptor, count: int) -> None:
    cls: Any = message_class(sample)
    rows = [cls(i64=i, text=str(i), names=["a"] * (i % 3)).SerializeToString()
            for i in range(count)]
    check_against_upb(sample, rows)
