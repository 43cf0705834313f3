"""A block whose messages use schema versions with different column sets: the
insert's columns are the union, rows of a version lacking a column get its default,
and rows stay in message order."""

from __future__ import annotations

import datetime as dt
import uuid
from decimal import Decimal
from typing import Any

import numpy as np
import pytest

from blockagg.aggregator.clickhouse.writer import ClickHouseBlockWriter, Replica, WriterConfig
from blockagg.aggregator.core.model import Batch, Block, block_token
from blockagg.proto.descriptors import compile_proto, load_descriptor, message_class
from blockagg.proto.envelope import make_envelope
from blockagg.proto.registry import MemoryStore, Registry
from blockagg.registration.register import register
from blockagg.rows.columns import Column
from blockagg.rows.prepare import Message, Plans, prepare
from blockagg.rows.types import default_value, parse_type, zero_value

T0 = 1_700_000_000_000
PROTO = ('syntax = "proto3"; package mv;\n'
         "message V1 { int64 id = 1; string name = 2; }\n"
         "message V2 { int64 id = 1; string name = 2; int32 score = 3; string tag = 4; }\n")
COLUMNS = [Column("id", "Int64"), Column("name", "String"),
           Column("score", "Int32", "DEFAULT", "CAST(-1, 'Int32')"),
           Column("tag", "Nullable(String)", "DEFAULT", "NULL"),
           Column("day", "Date", "DEFAULT", "toDate(0)"),
           Column("_topic", "String"), Column("_partition", "UInt32"),
           Column("_offset", "UInt64")]


@pytest.fixture(scope="module")
def fds(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("mv") / "mv.proto"
    path.write_text(PROTO)
    return compile_proto(path)


def encode(fds: bytes, message: str, **values: Any) -> bytes:
    cls: Any = message_class(load_descriptor(fds, message))
    return bytes(cls(**values).SerializeToString())


def mixed_batch(fds: bytes) -> Batch:
    store = MemoryStore()
    register(store, "db.t", "mv.V1", fds, now_ms=T0)
    register(store, "db.t", "mv.V2", fds, now_ms=T0 + 1000)
    plans = Plans(Registry.load(store), lambda t: COLUMNS)
    values = [
        make_envelope("db.t", [encode(fds, "mv.V1", id=1, name="a")], 1),
        make_envelope("db.t", [encode(fds, "mv.V2", id=2, name="b", score=5, tag="x"),
                               encode(fds, "mv.V2", id=3, name="c")], 2),
        make_envelope("db.t", [encode(fds, "mv.V1", id=4, name="d")], 0),   # latest at T0: v1
        make_envelope("db.t", [encode(fds, "mv.V2", id=5, name="e", score=7)], 0),  # v2
    ]
    stamps = [T0, T0, T0 + 500, T0 + 1000]
    msgs = [Message(10 + i, s, v) for i, (s, v) in enumerate(zip(stamps, values, strict=True))]
    p = prepare("top", 2, msgs, plans)
    assert p.dead_letters == 0
    return Batch("top", 2, 10, 14, p.offsets, p.table_ids, p.row_counts, p.sizes,
                 p.payloads, p.tables)


def writer() -> ClickHouseBlockWriter:
    return ClickHouseBlockWriter(WriterConfig(replicas=(Replica("x"),)),
                                 client_factory=lambda r: None,  # type: ignore[arg-type,return-value]
                                 sleep=lambda s: None)


def test_union_of_columns_in_message_order(fds: bytes) -> None:
    batch = mixed_batch(fds)
    block = Block("top", 2, 1, "db.t", 10, 13, np.arange(4), 5, 0,
                  block_token("top", 2, "db.t", 10, 13))
    names, values = writer().block_columns(block, batch)
    assert names == ("id", "name", "score", "tag", "_topic", "_partition", "_offset")
    assert values == [[1, 2, 3, 4, 5], ["a", "b", "c", "d", "e"],
                      [-1, 5, 0, -1, 7],          # v1 rows: the column's DEFAULT -1
                      [None, "x", "", None, ""],  # v1 rows: NULL (v2 rows: proto3 "")
                      ["top"] * 5, [2] * 5, [10, 11, 11, 12, 13]]
    again = writer().block_columns(block, mixed_batch(fds))
    assert again == (names, values)              # a retry is identical


def test_single_version_block_keeps_its_columns(fds: bytes) -> None:
    batch = mixed_batch(fds)
    block = Block("top", 2, 1, "db.t", 10, 12, np.array([0, 2]), 2, 0,
                  block_token("top", 2, "db.t", 10, 12))
    names, values = writer().block_columns(block, batch)
    assert names == ("id", "name", "_topic", "_partition", "_offset")
    assert values[0] == [1, 4]


@pytest.mark.parametrize(("ch", "kind", "expr", "value", "exact"), [
    ("Int32", "DEFAULT", "CAST(-1, 'Int32')", -1, True),
    ("Int64", "", "", 0, True),
    ("Float64", "DEFAULT", "-1.5", -1.5, True),
    ("String", "DEFAULT", "'it''s'", "", False),
    ("String", "DEFAULT", r"'a\'b'", "a'b", True),
    ("Nullable(String)", "DEFAULT", "'x'", "x", True),
    ("Nullable(Int8)", "", "", None, True),
    ("Nullable(Int8)", "DEFAULT", "NULL", None, True),
    ("Date", "DEFAULT", "toDate(0)", dt.date(1970, 1, 1), False),
    ("Date", "DEFAULT", "'2020-02-03'", dt.date(2020, 2, 3), True),
    ("Decimal(9, 2)", "DEFAULT", "1.25", Decimal("1.25"), True),
    ("Enum8('a' = 1, 'b' = 2)", "", "", "a", True),
    ("UUID", "", "", uuid.UUID(int=0), True),
    ("Array(Int8)", "", "", [], True),
    ("Tuple(Int8, String)", "", "", (0, ""), True),
    ("LowCardinality(String)", "DEFAULT", "'z'", "z", True),
])
def test_default_values(ch: str, kind: str, expr: str, value: Any, exact: bool) -> None:
    got, got_exact = default_value(parse_type(ch), kind, expr)
    assert (got, got_exact) == (value, exact)


def test_zero_of_unknown_type_is_refused() -> None:
    from blockagg.rows.types import CHType

    with pytest.raises(Exception, match="no default value"):
        zero_value(CHType("Nothing"))
