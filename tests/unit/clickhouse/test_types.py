"""Table-driven conversion tests: protobuf field -> ClickHouse column type."""

from __future__ import annotations

import datetime as dt
import ipaddress
import uuid
from decimal import Decimal
from typing import Any

import numpy as np
import pytest
from google.protobuf.descriptor import Descriptor

from blockagg.proto.decode import decode_rows
from blockagg.proto.descriptors import message_class
from blockagg.rows.layout import NATIVE_COLUMNS, EnumColumn, ListColumn, StringColumn
from blockagg.rows.types import (
    convert_array,
    convert_column,
    field_mismatch,
    parse_type,
)


def convert(sample: Descriptor, ch: str, field: str, msgs: list[dict[str, Any]]
            ) -> tuple[list[Any], dict[int, str]]:
    cls: Any = message_class(sample)
    rows = []
    for m in msgs:
        msg = cls()
        for k, v in m.items():
            if k == "ts":
                msg.ts.seconds, msg.ts.nanos = v
            elif k == "wrapped":
                msg.wrapped.value = v
            elif k == "counts":
                for a, b in v.items():
                    msg.counts[a] = b
            elif k == "inner":
                msg.inner.a, msg.inner.b = v
            elif isinstance(v, list):
                getattr(msg, k).extend(v)
            else:
                setattr(msg, k, v)
        rows.append(msg.SerializeToString())
    decoded = decode_rows(sample, rows)
    fd = sample.fields_by_name[field]
    chtype = parse_type(ch)
    assert field_mismatch(chtype, fd) is None
    out = convert_column(chtype, fd, decoded.columns[field])
    assert isinstance(out.values, list)
    return out.values, out.errors


CASES: list[tuple[str, str, list[dict[str, Any]], list[Any], set[int]]] = [
    ("Int8", "i32", [{"i32": 5}, {"i32": 300}, {"i32": -128}], [5, 0, -128], {1}),
    ("UInt8", "i64", [{"i64": 255}, {"i64": -1}], [255, 0], {1}),
    ("Int16", "s32", [{"s32": -32768}], [-32768], set()),
    ("UInt16", "u32", [{"u32": 65535}, {"u32": 65536}], [65535, 0], {1}),
    ("Int32", "sf32", [{"sf32": -5}], [-5], set()),
    ("Int64", "u64", [{"u64": 2**63}], [0], {0}),
    ("UInt32", "f32", [{"f32": 2**32 - 1}], [2**32 - 1], set()),
    ("UInt64", "f64", [{"f64": 2**64 - 1}], [2**64 - 1], set()),
    ("UInt8", "flag", [{"flag": True}, {}], [1, 0], set()),
    ("Float32", "fl", [{"fl": 1.5}], [1.5], set()),
    ("Float64", "db", [{"db": 2.25}], [2.25], set()),
    ("Decimal(9, 2)", "text", [{"text": "12.34"}, {"text": "1.234"}, {"text": "x"}],
     [Decimal("12.34"), Decimal(0), Decimal(0)], {1, 2}),
    ("Decimal64(3)", "i64", [{"i64": 42}], [Decimal(42)], set()),
    ("String", "text", [{"text": "héllo"}], ["héllo"], set()),
    ("String", "blob", [{"blob": b"\x00\xff"}], [b"\x00\xff"], set()),
    ("FixedString(2)", "blob", [{"blob": b"ab"}, {"blob": b"abc"}], [b"ab", b""], {1}),
    ("UUID", "text", [{"text": "12345678-1234-5678-1234-567812345678"}, {"text": "zz"}],
     [uuid.UUID("12345678-1234-5678-1234-567812345678"), uuid.UUID(int=0)], {1}),
    ("Date", "ts", [{"ts": (86400 * 3 + 5, 0)}], [dt.date(1970, 1, 4)], set()),
    ("Date", "i32", [{"i32": 1}], [dt.date(1970, 1, 2)], set()),
    ("DateTime", "ts", [{"ts": (1_700_000_000, 999)}], [1_700_000_000], set()),
    ("DateTime", "i64", [{"i64": -1}], [0], {0}),
    ("DateTime64(3)", "ts", [{"ts": (1, 123_456_789)}], [1123], set()),
    ("DateTime64(6, 'UTC')", "ts", [{"ts": (1, 123_456_789)}], [1_123_456], set()),
    ("Enum8('COLOR_UNSPECIFIED' = 0, 'RED' = 1, 'GREEN' = 2)", "color",
     [{"color": 1}, {}], ["RED", "COLOR_UNSPECIFIED"], set()),
    ("Enum16('a' = 1, 'b' = 1000)", "text", [{"text": "b"}, {"text": "c"}], ["b", None],
     {1}),
    ("Bool", "flag", [{"flag": True}], [True], set()),
    ("IPv4", "text", [{"text": "10.0.0.1"}, {"text": "nope"}], [167772161, 0], {1}),
    ("IPv4", "u32", [{"u32": 1}], [1], set()),
    ("IPv6", "text", [{"text": "::1"}], [ipaddress.IPv6Address("::1")], set()),
    ("Nullable(Int64)", "maybe", [{"maybe": 3}, {}], [3, None], set()),
    ("Nullable(Int64)", "wrapped", [{"wrapped": 7}, {}], [7, None], set()),
    ("Int64", "wrapped", [{"wrapped": 7}], [7], set()),
    ("Nullable(DateTime)", "ts", [{}, {"ts": (5, 0)}], [None, 5], set()),
    ("LowCardinality(String)", "text", [{"text": "x"}], ["x"], set()),
    ("LowCardinality(Nullable(String))", "maybe_text", [{}, {"maybe_text": "y"}],
     [None, "y"], set()),
    ("Array(Int64)", "packed_ints", [{"packed_ints": [1, 2]}, {}], [[1, 2], []], set()),
    ("Array(UInt8)", "packed_ints", [{"packed_ints": [1, 256]}], [[1, 0]], {0}),
    ("Array(String)", "names", [{"names": ["a", "b"]}], [["a", "b"]], set()),
    ("Map(String, Int64)", "counts", [{"counts": {"a": 1}}], [{"a": 1}], set()),
    ("Tuple(Int32, String)", "inner", [{"inner": (1, "x")}, {}], [(1, "x"), (0, "")],
     set()),
    ("Tuple(a Int32, b String)", "inner", [{"inner": (2, "y")}], [(2, "y")], set()),
]


@pytest.mark.parametrize(("ch", "field", "msgs", "want", "bad"), CASES,
                         ids=[f"{c[0]}<-{c[1]}" for c in CASES])
def test_convert(sample: Descriptor, ch: str, field: str, msgs: list[dict[str, Any]],
                 want: list[Any], bad: set[int]) -> None:
    values, errors = convert(sample, ch, field, msgs)
    assert set(errors) == bad
    assert [v for i, v in enumerate(values) if i not in bad] == [
        w for i, w in enumerate(want) if i not in bad]


MISMATCHES = [
    ("Float32", "db"), ("String", "i64"), ("Array(Int64)", "i64"), ("Int64", "packed_ints"),
    ("Map(String, Int64)", "names"), ("Tuple(Int32)", "inner"), ("DateTime", "text"),
    ("Enum8('RED' = 1)", "color"), ("Bool", "i32"), ("UUID", "i64"), ("Object('json')", "text"),
]


@pytest.mark.parametrize(("ch", "field"), MISMATCHES)
def test_mismatch(sample: Descriptor, ch: str, field: str) -> None:
    reason = field_mismatch(parse_type(ch), sample.fields_by_name[field])
    assert reason


@pytest.mark.parametrize("text", [
    "UInt8", "Nullable(String)", "Array(Array(Nullable(Int8)))", "Map(String, Array(UInt64))",
    "Tuple(a Int32, b Tuple(c String))", "DateTime64(3, 'Europe/Berlin')",
    "Enum8('a' = 1, 'b\\'c' = -2)", "Decimal(18, 4)", "FixedString(16)",
    "LowCardinality(Nullable(String))",
])
def test_parse_roundtrip(text: str) -> None:
    parsed = parse_type(text)
    assert parse_type(str(parsed)) == parsed


# The vectorised conversion (convert_array) must give, for every case, the same
# values (as ``tolist()``) and the same bad rows with the same reasons as the
# per-value one: a retried or re-prepared block inserts identical data, and a value
# that doesn't convert still makes its message a dead letter.
VECTOR_CASES: list[tuple[str, str, list[dict[str, Any]]]] = [
    *[(ch, field, msgs) for ch, field, msgs, _want, _bad in CASES],
    ("Int64", "u64", [{"u64": 2**64 - 1}, {"u64": 5}]),
    ("UInt64", "i64", [{"i64": -5}, {"i64": 2**63 - 1}]),
    ("UInt32", "i32", [{"i32": -1}, {"i32": 7}]),
    ("Int8", "flag", [{"flag": True}, {}]),
    ("Float64", "fl", [{"fl": 0.1}]),
    ("DateTime", "ts", [{}, {"ts": (-1, 0)}, {"ts": (2**32, 0)}, {"ts": (2**32 - 1, 5)}]),
    ("DateTime", "u64", [{"u64": 2**32}, {"u64": 3}]),
    ("Enum8('COLOR_UNSPECIFIED' = 0, 'RED' = 1, 'GREEN' = 2)", "color",
     [{"color": 7}, {"color": 2}, {"color": -3}]),
    ("Enum16('COLOR_UNSPECIFIED' = 0, 'RED' = 1, 'GREEN' = 2, 'BLUE' = 300)", "color",
     [{"color": 2}]),
    ("Enum8('a' = 1, 'b' = 2)", "i64", [{"i64": 2}, {"i64": 3}, {"i64": 2**40}]),
    ("Enum8('RED' = 1)", "color", [{"color": 1}, {}]),
    ("Array(Int8)", "packed_ints", [{"packed_ints": [1, 300, -400]}, {}, {"packed_ints": [5]},
                                    {"packed_ints": [2**40]}]),
    ("Array(Float64)", "doubles", [{"doubles": [0.5]}, {}]),
    ("Array(UInt32)", "fixeds", [{"fixeds": [1, 2]}, {"fixeds": [3]}]),
    ("Array(Int32)", "zigzags", [{"zigzags": [-1, 2]}]),
    ("Array(String)", "names", [{}, {"names": ["", "é"]}]),
    ("String", "text", [{}, {"text": "x"}]),
    ("String", "maybe_text", [{}, {"maybe_text": "y"}]),
]


def encode(sample: Descriptor, msgs: list[dict[str, Any]]) -> list[bytes]:
    cls: Any = message_class(sample)
    rows = []
    for m in msgs:
        msg = cls()
        for k, v in m.items():
            if k == "ts":
                msg.ts.seconds, msg.ts.nanos = v
            elif k == "wrapped":
                msg.wrapped.value = v
            elif k == "counts":
                for a, b in v.items():
                    msg.counts[a] = b
            elif k == "inner":
                msg.inner.a, msg.inner.b = v
            elif isinstance(v, list):
                getattr(msg, k).extend(v)
            else:
                setattr(msg, k, v)
        rows.append(msg.SerializeToString())
    return rows


@pytest.mark.parametrize(("ch", "field", "msgs"), VECTOR_CASES,
                         ids=[f"{c[0]}<-{c[1]}-{i}" for i, c in enumerate(VECTOR_CASES)])
def test_convert_array_matches_convert_column(sample: Descriptor, ch: str, field: str,
                                              msgs: list[dict[str, Any]]) -> None:
    chtype = parse_type(ch)
    fd = sample.fields_by_name[field]
    decoded = decode_rows(sample, encode(sample, msgs))
    # also a slice, as Arrow hands out offset arrays
    for column in (decoded.columns[field], decoded.columns[field].slice(1)):
        old = convert_column(chtype, fd, column)
        new = convert_array(chtype, fd, column)
        assert new.errors == old.errors
        values = new.values.tolist() if hasattr(new.values, "tolist") else new.values
        assert len(values) == len(old.values) == len(column)
        good = [i for i in range(len(column)) if i not in old.errors]
        assert [values[i] for i in good] == [old.values[i] for i in good]
        assert [type(values[i]) for i in good] == [type(old.values[i]) for i in good]


@pytest.mark.parametrize(("ch", "field", "dtype"), [
    ("UInt64", "id_u64", np.uint64), ("Int8", "i32", np.int8), ("Float32", "fl", np.float32),
    ("DateTime", "ts", np.uint32), ("String", "text", StringColumn),
    ("Enum8('COLOR_UNSPECIFIED' = 0, 'RED' = 1, 'GREEN' = 2)", "color", EnumColumn),
    ("Array(Int64)", "packed_ints", ListColumn),
])
def test_convert_array_is_vectorised(sample: Descriptor, ch: str, field: str,
                                     dtype: Any) -> None:
    field = "u64" if field == "id_u64" else field
    decoded = decode_rows(sample, encode(sample, [{}, {}]))
    out = convert_array(parse_type(ch), sample.fields_by_name[field], decoded.columns[field])
    if isinstance(dtype, type) and issubclass(dtype, NATIVE_COLUMNS):
        assert isinstance(out.values, dtype)
    else:
        assert isinstance(out.values, np.ndarray) and out.values.dtype == dtype
    assert len(out.values) == 2


def test_convert_array_falls_back_to_lists(sample: Descriptor) -> None:
    decoded = decode_rows(sample, encode(sample, [{"maybe": 1}, {}]))
    out = convert_array(parse_type("Nullable(Int64)"), sample.fields_by_name["maybe"],
                        decoded.columns["maybe"])
    assert out.values == [1, None]
