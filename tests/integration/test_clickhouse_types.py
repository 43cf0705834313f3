"""Types the 18.16 server has, inserted for real through the writer and read back.
(18.16 has no IPv4/IPv6, Map, Bool or DateTime64: those are tested with chdb.)"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from blockagg.aggregator.clickhouse.writer import ClickHouseBlockWriter, Replica, WriterConfig
from blockagg.aggregator.core.model import Batch, Block, block_token
from blockagg.proto.descriptors import compile_proto, load_descriptor, message_class
from blockagg.proto.envelope import make_envelope
from blockagg.proto.registry import MemoryStore, Registry
from blockagg.registration.register import register
from blockagg.rows.prepare import Message, Plans, prepare
from tests.integration.conftest import replicated_engine

pytestmark = pytest.mark.integration

PROTO = """
syntax = "proto3";
package tys;
import "google/protobuf/timestamp.proto";
enum Level { LEVEL_UNSPECIFIED = 0; LOW = 1; HIGH = 1000; }
message Row {
  int32 i8 = 1; int32 i16 = 2; int32 i32 = 3; uint32 u8 = 4; uint32 u32 = 5;
  Level level = 6; string lc = 7; optional string maybe_text = 8; string d32 = 9;
  int64 d64 = 10; bytes fixed = 11; string uid = 12; repeated string tags = 13;
  repeated int32 nums = 14; google.protobuf.Timestamp at = 15; int32 day = 16;
  optional double maybe_float = 17; string lc_nullable = 18;
}
"""
COLUMNS = """
    i8 Int8, i16 Int16, i32 Int32, u8 UInt8, u32 UInt32,
    level Enum16('LEVEL_UNSPECIFIED' = 0, 'LOW' = 1, 'HIGH' = 1000),
    lc LowCardinality(String), maybe_text Nullable(String), d32 Decimal32(3),
    d64 Decimal64(2), fixed FixedString(3), uid UUID, tags Array(String),
    nums Array(Int32), at DateTime, day Date, maybe_float Nullable(Float64),
    lc_nullable LowCardinality(Nullable(String))
"""


def test_types_round_trip(stack_env: dict[str, str], ch_replicas: list[Any],
                          ch_database: str, tmp_path: Path) -> None:
    (tmp_path / "tys.proto").write_text(PROTO)
    fds = compile_proto(tmp_path / "tys.proto")
    table = f"{ch_database}.types"
    for c in ch_replicas:
        c.execute(f"CREATE TABLE {table} ({COLUMNS}) ENGINE = "
                  f"{replicated_engine(ch_database, 'types', 'i32')}",
                  settings={"allow_experimental_low_cardinality_type": 1})
    host = stack_env["BLOCKAGG_CH_HOST"]
    replicas = tuple(Replica(host, int(p)) for p in stack_env["BLOCKAGG_CH_PORTS"].split(","))
    writer = ClickHouseBlockWriter(WriterConfig(replicas=replicas), sleep=lambda s: None)
    store = MemoryStore()
    register(store, table, "tys.Row", fds, now_ms=0)
    plans = Plans(Registry.load(store), lambda t: writer.describe(t).columns)
    cls: Any = message_class(load_descriptor(fds, "tys.Row"))
    a = cls(i8=-128, i16=-32768, i32=2**31 - 1, u8=255, u32=2**32 - 1, level=1000, lc="x",
            maybe_text="t", d32="-1.125", d64=42, fixed=b"abc",
            uid="01234567-89ab-cdef-0123-456789abcdef", tags=["p", "q"], nums=[1, -1],
            day=18000, maybe_float=2.5, lc_nullable="n")
    a.at.seconds = 1_700_000_000
    b = cls(i32=1, d32="0", uid="00000000-0000-0000-0000-000000000000")  # "" is no UUID
    bad = cls(i32=2, i8=200)                            # out of Int8's range
    values = [make_envelope(table, [a.SerializeToString(), b.SerializeToString()], 1),
              make_envelope(table, [bad.SerializeToString()], 1)]
    msgs = [Message(i, 1_700_000_000_000, v) for i, v in enumerate(values)]
    p = prepare("topic", 0, msgs, plans)
    assert p.table_ids.tolist() == [1, 0]              # the bad message is a dead letter
    batch = Batch("topic", 0, 0, 2, p.offsets, p.table_ids, p.row_counts, p.sizes, p.payloads,
                  p.tables)
    writer.insert(Block("topic", 0, 1, table, 0, 0, np.array([0]), 2, 0,
                        block_token("topic", 0, table, 0, 0)), batch)
    ch_replicas[0].execute(f"SYSTEM SYNC REPLICA {table}")
    rows = ch_replicas[0].execute(
        f"SELECT i8, i16, i32, u8, u32, level, lc, maybe_text, toString(d32), toString(d64), "
        f"fixed, toString(uid), tags, nums, toUnixTimestamp(at), day, maybe_float, "
        f"lc_nullable FROM {table} ORDER BY i32")
    assert rows == [
        (0, 0, 1, 0, 0, "LEVEL_UNSPECIFIED", "", None, "0.000", "0.00", "",
         "00000000-0000-0000-0000-000000000000", [], [], 0, dt.date(1970, 1, 1), None, ""),
        (-128, -32768, 2**31 - 1, 255, 2**32 - 1, "HIGH", "x", "t", "-1.125", "42.00", "abc",
         "01234567-89ab-cdef-0123-456789abcdef", ["p", "q"], [1, -1], 1_700_000_000,
         dt.date(2019, 4, 14), 2.5, "n"),
    ]
