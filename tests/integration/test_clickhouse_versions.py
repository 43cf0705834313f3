"""Blocks mixing schema versions with different column sets, on the real 18.16
replicas: one insert with the union of the columns, defaults for the rows of the
version that lacks a column, message order kept, and a retry deduplicated."""

from __future__ import annotations

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

T0 = 1_700_000_000_000
PROTO = ('syntax = "proto3"; package mvi;\n'
         "message V1 { int64 id = 1; string name = 2; }\n"
         "message V2 { int64 id = 1; string name = 2; int32 score = 3; string tag = 4; }\n")


def encode(fds: bytes, message: str, **values: Any) -> bytes:
    cls: Any = message_class(load_descriptor(fds, message))
    return bytes(cls(**values).SerializeToString())


def test_two_versions_in_one_block(stack_env: dict[str, str], ch_replicas: list[Any],
                                   ch_database: str, tmp_path: Path) -> None:
    (tmp_path / "mvi.proto").write_text(PROTO)
    fds = compile_proto(tmp_path / "mvi.proto")
    table = f"{ch_database}.mixed"
    for c in ch_replicas:
        c.execute(
            f"CREATE TABLE {table} (id Int64, name String, score Int32 DEFAULT -1, "
            "tag Nullable(String) DEFAULT NULL, seen Date DEFAULT toDate(1000), "
            "_topic String, _partition UInt32, _offset UInt64) ENGINE = "
            f"{replicated_engine(ch_database, 'mixed', '(_offset, id)')}")
    host = stack_env["BLOCKAGG_CH_HOST"]
    replicas = tuple(Replica(host, int(p)) for p in stack_env["BLOCKAGG_CH_PORTS"].split(","))
    writer = ClickHouseBlockWriter(WriterConfig(replicas=replicas, insert_quorum=2),
                                   sleep=lambda s: None)
    store = MemoryStore()
    register(store, table, "mvi.V1", fds, now_ms=T0)
    register(store, table, "mvi.V2", fds, now_ms=T0 + 1000)
    plans = Plans(Registry.load(store), lambda t: writer.describe(t).columns)
    values = [
        make_envelope(table, [encode(fds, "mvi.V1", id=1, name="a")], 1),
        make_envelope(table, [encode(fds, "mvi.V2", id=2, name="b", score=5, tag="x"),
                              encode(fds, "mvi.V2", id=3, name="c")], 0),
        make_envelope(table, [encode(fds, "mvi.V1", id=4, name="d")], 0),
    ]
    stamps = [T0, T0 + 2000, T0 + 500]          # the last is "latest" before v2: v1
    msgs = [Message(50 + i, s, v) for i, (s, v) in enumerate(zip(stamps, values, strict=True))]
    p = prepare("topic", 1, msgs, plans)
    assert p.dead_letters == 0
    batch = Batch("topic", 1, 50, 53, p.offsets, p.table_ids, p.row_counts, p.sizes,
                  p.payloads, p.tables)
    block = Block("topic", 1, int(p.table_ids[0]), table, 50, 52, np.arange(3), 4, 0,
                  block_token("topic", 1, table, 50, 52))
    for _ in range(3):                          # retries: identical, deduplicated
        writer.insert(block, batch)
    only_v1 = Block("topic", 1, int(p.table_ids[0]), table, 50, 50, np.array([0]), 1, 0,
                    block_token("topic", 1, table, 50, 50))
    names, _ = writer.block_columns(only_v1, batch)
    assert "score" not in names and "tag" not in names   # left to the server's DEFAULT
    for c in ch_replicas:
        c.execute(f"SYSTEM SYNC REPLICA {table}")
        got = c.execute(f"SELECT id, name, score, tag, toString(seen), _offset FROM {table} "
                        "ORDER BY _offset, id")
        assert got == [(1, "a", -1, None, "1972-09-27", 50), (2, "b", 5, "x", "1972-09-27", 51),
                       (3, "c", 0, "", "1972-09-27", 51), (4, "d", -1, None, "1972-09-27", 52)]
