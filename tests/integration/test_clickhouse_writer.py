"""The block writer against the real stack: two ClickHouse 18.16 replicas of one shard
on ReplicatedMergeTree with ZooKeeper."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from blockagg.aggregator.clickhouse.dedup_window import DedupNeed
from blockagg.aggregator.clickhouse.exceptions import (
    DedupNotConfigured,
    DedupWindowTooSmall,
    InsertFailed,
    TableNotFound,
)
from blockagg.aggregator.clickhouse.writer import ClickHouseBlockWriter, Replica, WriterConfig
from blockagg.aggregator.core.model import Batch, Block, block_token
from blockagg.proto.descriptors import compile_proto, load_descriptor, message_class
from blockagg.proto.envelope import make_envelope
from blockagg.proto.registry import MemoryStore, Registry
from blockagg.registration.register import register
from blockagg.rows.deadletters import dead_letter_ddl
from blockagg.rows.prepare import Message, Plans, prepare
from tests.integration.conftest import replicated_engine

pytestmark = pytest.mark.integration

SAMPLE = Path(__file__).resolve().parents[1] / "unit" / "proto" / "sample.proto"
ROW_PROTO = """
syntax = "proto3";
package it.v1;
import "google/protobuf/timestamp.proto";
import "google/protobuf/wrappers.proto";
import "sample.proto";
message Row {
  int32 i32 = 1; int64 i64 = 2; uint32 u32 = 3; uint64 u64 = 4; float fl = 11; double db = 12;
  bool flag = 13; string text = 14; bytes blob = 15; blockagg.test.Color color = 16;
  optional int64 maybe = 17; google.protobuf.Timestamp ts = 18;
  google.protobuf.Int64Value wrapped = 19; blockagg.test.Inner inner = 20;
  repeated int64 packed_ints = 21; repeated string names = 24;
  string uid = 30; string price = 31;
}
"""

COLUMNS_1816 = """
    i32 Int8, i64 Int64, u32 UInt16, u64 UInt64, fl Float32, db Float64, flag UInt8,
    text String, blob FixedString(4), color Enum8('COLOR_UNSPECIFIED' = 0, 'RED' = 1,
    'GREEN' = 2), maybe Nullable(Int64), ts DateTime, wrapped Nullable(Int64),
    inner Tuple(Int32, String), packed_ints Array(Int64), names Array(String),
    uid UUID, price Decimal(12, 2), day Date DEFAULT
    toDate(ts), _topic String, _partition UInt32, _offset UInt64
"""


def row_fds(tmp: Path) -> bytes:
    import shutil

    shutil.copy(SAMPLE, tmp / "sample.proto")
    (tmp / "row.proto").write_text(ROW_PROTO)
    return compile_proto(tmp / "row.proto", [tmp])


def writer_for(env: dict[str, str], **kw: Any) -> ClickHouseBlockWriter:
    host = env["BLOCKAGG_CH_HOST"]
    replicas = tuple(Replica(host, int(p)) for p in env["BLOCKAGG_CH_PORTS"].split(","))
    return ClickHouseBlockWriter(WriterConfig(replicas=replicas, **kw), sleep=lambda s: None)


def make_rows(fds: bytes, n: int) -> list[bytes]:
    desc = load_descriptor(fds, "it.v1.Row")
    cls: Any = message_class(desc)
    rows = []
    for i in range(n):
        m = cls(i32=i % 100, i64=-i, u32=i, u64=2**63 + i, text=f"row {i}", blob=b"ab",
                color=i % 3, packed_ints=[i, i + 1], names=["x"] * (i % 3), fl=0.5, db=1.25,
                uid=f"00000000-0000-0000-0000-{i:012d}", price=f"{i}.25")
        m.ts.seconds = 1_700_000_000 + i
        if i % 2:
            m.maybe = i
            m.wrapped.value = i
            m.inner.a, m.inner.b = i, "in"
        rows.append(m.SerializeToString())
    return rows


def test_insert_retry_dedup_quorum_and_dead_letters(
        stack_env: dict[str, str], ch_replicas: list[Any], ch_database: str,
        tmp_path: Path) -> None:
    fds = row_fds(tmp_path)
    table = f"{ch_database}.events"
    dead = f"{ch_database}.dead_letters"
    for c in ch_replicas:
        c.execute(f"CREATE TABLE {table} ({COLUMNS_1816}) ENGINE = "
                  f"{replicated_engine(ch_database, 'events')}")
        c.execute(dead_letter_ddl(dead))
    writer = writer_for(stack_env, insert_quorum=2, dead_letter_table=dead)
    assert writer.server_version[:2] == (18, 16) and not writer.supports_token
    assert writer.check_tables([table, dead]) == []

    store = MemoryStore()
    register(store, table, "it.v1.Row", fds)
    plans = Plans(Registry.load(store), lambda t: writer.describe(t).columns)
    rows = make_rows(fds, 40)
    values = [make_envelope(table, rows[i:i + 10], 1) for i in range(0, 40, 10)]
    values.insert(2, b"\x00garbage")
    msgs = [Message(100 + i, 1_700_000_000_000, v) for i, v in enumerate(values)]
    prepared = prepare("topic", 0, msgs, plans, dead_letter_table=dead)
    assert prepared.dead_letters == 1
    batch = Batch("topic", 0, 100, 105, prepared.offsets, prepared.table_ids,
                  prepared.row_counts, prepared.sizes, prepared.payloads, prepared.tables)
    tid = int(prepared.table_ids[0])
    data = np.flatnonzero(prepared.table_ids == tid)
    block = Block("topic", 0, tid, table, 100, 104, data, 40, 0,
                  block_token("topic", 0, table, 100, 104))
    dl = Block("topic", 0, 0, dead, 102, 102, np.array([2]), 1, 0,
               block_token("topic", 0, dead, 102, 102))
    for _ in range(3):
        writer.insert(block, batch)
        writer.insert(dl, batch)
    for c in ch_replicas:
        c.execute(f"SYSTEM SYNC REPLICA {table}")
        assert c.execute(f"SELECT count(), uniqExact(_offset), min(_offset) FROM {table}") == [
            (40, 4, 100)]
        got = c.execute(f"SELECT error, offset, time FROM {dead}")
        assert len(got) == 1 and got[0][1] == 102
    row = ch_replicas[0].execute(
        f"SELECT i32, u64, color, maybe, inner, packed_ints, toString(uid), "
        f"toString(price), toString(day) FROM {table} WHERE i64 = -1")
    assert row[0] == (1, 2**63 + 1, "RED", 1, (1, "in"), [1, 2],
                      "00000000-0000-0000-0000-000000000001", "1.25", "2023-11-14")


def test_failover_and_refusals(stack_env: dict[str, str], ch_replicas: list[Any],
                               ch_database: str) -> None:
    plain = f"{ch_database}.plain"
    ch_replicas[0].execute(f"CREATE TABLE {plain} (x Int64) ENGINE = MergeTree ORDER BY x")
    writer = writer_for(stack_env)
    with pytest.raises(DedupNotConfigured, match="non_replicated_deduplication_window"):
        writer.check_tables([plain])
    host = stack_env["BLOCKAGG_CH_HOST"]
    port = int(stack_env["BLOCKAGG_CH_PORTS"].split(",")[0])
    flaky = ClickHouseBlockWriter(
        WriterConfig(replicas=(Replica(host, 1), Replica(host, port)), connect_timeout_s=1),
        sleep=lambda s: None)
    assert flaky.query("SELECT 1") == [(1,)]
    with pytest.raises(InsertFailed) as info:
        flaky.query(f"SELECT nope FROM {plain}")
    assert info.value.code == 47


def test_a_window_below_the_need_is_refused_naming_table_window_and_need(
        stack_env: dict[str, str], ch_replicas: list[Any], ch_database: str) -> None:
    """ReplicatedMergeTree with replicated_deduplication_window = 20 on the real 18.16
    pair: 16 partitions (need 2 x 16 = 32) are refused, 8 (need 16) pass, and
    allow_small_dedup_window turns the refusal into a warning. The window read is kept
    for the tasks' guard (share floor(20 / 16) = 1 with 8 partitions)."""
    small = f"{ch_database}.small_window"
    for c in ch_replicas:
        c.execute(f"CREATE TABLE {small} (x UInt64, _topic String, _partition UInt32, "
                  f"_offset UInt64) ENGINE = {replicated_engine(ch_database, 'small_window')} "
                  "SETTINGS replicated_deduplication_window = 20")
    writer = writer_for(stack_env)
    need = DedupNeed(partitions=16)
    with pytest.raises(DedupWindowTooSmall) as info:
        writer.check_tables([small], need)
    text = str(info.value)
    assert small in text and "replicated_deduplication_window = 20" in text
    assert "32 blocks" in text and "16 partitions" in text
    assert writer.check_tables([small], DedupNeed(8)) == []
    [warning] = writer.check_tables([small], need, allow_small_window=True)
    assert "below the 32 blocks" in warning
    window = writer.dedup_window(small)
    assert window is not None and window.blocks == 20
    assert window.setting == "replicated_deduplication_window"
    assert DedupNeed(8).share(window.blocks) == 1


def test_both_replicas_name_the_same_shard_whatever_they_are_called(
        stack_env: dict[str, str], ch_replicas: list[Any], ch_database: str) -> None:
    """Grouping by shard (issue 25): each replica of the pair, asked alone under either
    spelling of its host, gives the same shard identity (the dead-letter table's
    ZooKeeper path on 18.16, which has no getMacro), so topics listing the replicas
    differently are counted as one shard."""
    table = f"{ch_database}.dead_letters_id"
    for c in ch_replicas:
        c.execute(f"CREATE TABLE {table} (x UInt64) ENGINE = "
                  f"{replicated_engine(ch_database, 'dead_letters_id')}")
    host = stack_env["BLOCKAGG_CH_HOST"]
    identities = set()
    for port in stack_env["BLOCKAGG_CH_PORTS"].split(","):
        for spelling in (host, "localhost"):
            writer = ClickHouseBlockWriter(WriterConfig(replicas=(Replica(spelling, int(port)),)))
            try:
                identities.add(writer.shard_identity(table))
            finally:
                writer.close()
    [identity] = identities
    assert identity is not None and identity.startswith("zookeeper:")
    assert identity.endswith(f"/{ch_database}/dead_letters_id")


def test_a_recently_used_connection_skips_the_ping_and_a_dead_one_is_retried(
        stack_env: dict[str, str], ch_replicas: list[Any], ch_database: str,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket
    import threading
    from dataclasses import replace

    from blockagg.aggregator.clickhouse.writer import _recently_used_connection
    from blockagg.aggregator.core.metadata import DedupMode, Pins

    fds = row_fds(tmp_path)
    table = f"{ch_database}.pings"
    for c in ch_replicas:
        c.execute(f"CREATE TABLE {table} ({COLUMNS_1816}) ENGINE = "
                  f"{replicated_engine(ch_database, 'pings')}")
    store = MemoryStore()
    register(store, table, "it.v1.Row", fds)
    describer = writer_for(stack_env)
    plans = Plans(Registry.load(store), lambda t: describer.describe(t).columns)
    rows = make_rows(fds, 30)
    msgs = [Message(10 + i, 1_700_000_000_000, make_envelope(table, rows[i * 10:i * 10 + 10], 1))
            for i in range(3)]
    prepared = prepare("topic", 0, msgs, plans, dead_letter_table="x.y")
    batch = Batch("topic", 0, 10, 13, prepared.offsets, prepared.table_ids,
                  prepared.row_counts, prepared.sizes, prepared.payloads, prepared.tables,
                  pins=Pins(dedup=DedupMode.BLOCK_HASH))
    tid = int(prepared.table_ids[0])
    blocks = [Block("topic", 0, tid, table, 10 + i, 10 + i, np.array([i]), 10, 0,
                    block_token("topic", 0, table, 10 + i, 10 + i)) for i in range(3)]

    pings: list[int] = []
    connection = _recently_used_connection()
    real_ping = connection.ping  # type: ignore[attr-defined]

    def counted(self: Any) -> Any:
        pings.append(1)
        return real_ping(self)

    monkeypatch.setattr(connection, "ping", counted)
    warm = writer_for(stack_env, ping_after_idle_s=60.0)
    for block in blocks[:2]:
        warm.insert(block, batch)
    assert pings == []  # connected once, then used within seconds: no ping

    # The server side of the connection goes away: the send fails and the identical
    # block is retried (on the other replica), landing once.
    client = warm._clients[(threading.get_ident(), warm._current_replica())]
    client.connection.socket.shutdown(socket.SHUT_RDWR)  # type: ignore[attr-defined]
    warm.insert(blocks[2], batch)
    warm.insert(blocks[2], batch)

    always = writer_for(stack_env, ping_after_idle_s=0.0)
    always.insert(blocks[0], batch)
    always.insert(replace(blocks[0]), batch)
    assert len(pings) >= 2  # ping_after_idle 0: a ping before each query, as before
    for c in ch_replicas:
        c.execute(f"SYSTEM SYNC REPLICA {table}")
        assert c.execute(f"SELECT count(), uniqExact(_offset) FROM {table}") == [(30, 3)]
    for w in (warm, always, describer):
        w.close()


def test_one_check_of_several_tables_reads_each_tables_own_window_and_columns(
        stack_env: dict[str, str], ch_replicas: list[Any], ch_database: str) -> None:
    """check_tables of three tables reads their columns and CREATE statements in one
    query each (``describe_many``, ``system.tables.create_table_query`` on the real
    18.16): each table keeps its own window (20 from its SETTINGS, the server's 100
    without), its own columns in order, and a table missing among them is refused by
    name."""
    tables = {"w20": " SETTINGS replicated_deduplication_window = 20", "wd": "",
              "wide": ""}
    for c in ch_replicas:
        for name, settings in tables.items():
            extra = ", y String" if name == "wide" else ""
            c.execute(f"CREATE TABLE {ch_database}.{name} (x UInt64{extra}, _topic String, "
                      f"_partition UInt32, _offset UInt64) ENGINE = "
                      f"{replicated_engine(ch_database, name)}{settings}")
    writer = writer_for(stack_env)
    names = [f"{ch_database}.{n}" for n in tables]
    assert writer.check_tables(names) == []
    windows = {n: writer.dedup_window(n) for n in names}
    assert [w.blocks if w else None for w in windows.values()] == [20, 100, 100]
    wide = writer.checked(f"{ch_database}.wide")
    assert wide is not None and [c.name for c in wide.columns] == [
        "x", "y", "_topic", "_partition", "_offset"]
    assert wide.engine == "ReplicatedMergeTree" and wide.coordinates
    with pytest.raises(TableNotFound, match=rf"{ch_database}\.absent"):
        writer.check_tables([*names, f"{ch_database}.absent"])
