"""Modern-server semantics in-process with chdb (ClickHouse 26): the writer's own
inserts, through a small driver-shaped adapter, against a MergeTree table with
``non_replicated_deduplication_window``."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from google.protobuf.descriptor import Descriptor

from blockagg.aggregator.clickhouse.exceptions import DedupNotConfigured
from blockagg.aggregator.clickhouse.writer import ClickHouseBlockWriter, Replica, WriterConfig
from blockagg.aggregator.core.model import Batch, Block, block_token
from blockagg.proto.descriptors import message_class
from blockagg.rows.columns import Column, decode_messages, make_plan

chdb = pytest.importorskip("chdb")


def _literal(v: Any) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, bytes):
        return "unhex('" + v.hex() + "')"
    if isinstance(v, str):
        return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(v, list):
        return "[" + ", ".join(_literal(x) for x in v) + "]"
    return str(v)


class ChdbClient:
    """Just enough of clickhouse_driver.Client over a chdb session."""

    def __init__(self, session: Any) -> None:
        self.session = session

    def execute(self, query: str, params: Any = None, *, columnar: bool = False,
                settings: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        if params and not query.startswith("INSERT"):
            query = re.sub(r"%\((\w+)\)s", lambda m: _literal(params[m.group(1)]), query)
        if query.startswith("INSERT"):
            rows = list(zip(*params, strict=True))
            sets = ", ".join(f"{k} = {_literal(v)}" for k, v in (settings or {}).items())
            body = ", ".join("(" + ", ".join(_literal(v) for v in row) + ")" for row in rows)
            self.session.query(f"{query[:-len('VALUES')]} SETTINGS {sets} VALUES {body}")
            return None
        out = self.session.query(query, "TabSeparated")
        text = out.bytes().decode() if hasattr(out, "bytes") else str(out)
        return [tuple(line.split("\t")) for line in text.splitlines() if line]

    def disconnect(self) -> None:
        pass


@pytest.fixture(scope="module")
def chdb_session() -> Any:
    from chdb import session

    s: Any = session.Session()  # type: ignore[no-untyped-call]
    s.query("CREATE DATABASE IF NOT EXISTS db")
    yield s
    s.close()


def writer_for(s: Any) -> ClickHouseBlockWriter:
    return ClickHouseBlockWriter(WriterConfig(replicas=(Replica("chdb"),)),
                                 lambda r: ChdbClient(s), sleep=lambda x: None)


def test_token_semantics(chdb_session: Any, sample: Descriptor) -> None:
    s = chdb_session
    s.query("DROP TABLE IF EXISTS db.tok")
    s.query("CREATE TABLE db.tok (i64 Int64, text String) ENGINE = MergeTree ORDER BY i64 "
            "SETTINGS non_replicated_deduplication_window = 100")
    writer = writer_for(s)
    assert writer.supports_token
    assert writer.check_tables(["db.tok"])
    cls: Any = message_class(sample)
    plan, _problems = make_plan("db.tok", 1, 1, sample,
                               [Column("i64", "Int64"), Column("text", "String")])
    payloads = decode_messages(plan, [[cls(i64=1, text="x").SerializeToString()]] * 2)
    batch = Batch("top", 0, 0, 2, np.array([0, 1]), np.array([1, 1]), np.array([1, 1]),
                  np.array([1, 1]), payloads, {1: "db.tok"})

    def block(first: int) -> Block:
        return Block("top", 0, 1, "db.tok", first, first, np.array([first]), 1, 1,
                     block_token("top", 0, "db.tok", first, first))

    writer.insert(block(0), batch)
    writer.insert(block(0), batch)
    assert s.query("SELECT count() FROM db.tok", "CSV").bytes().strip() == b"1"
    writer.insert(block(1), batch)
    assert s.query("SELECT count() FROM db.tok", "CSV").bytes().strip() == b"2"


def test_check_refuses_plain_mergetree(chdb_session: Any) -> None:
    s = chdb_session
    s.query("DROP TABLE IF EXISTS db.plain")
    s.query("CREATE TABLE db.plain (x Int64) ENGINE = MergeTree ORDER BY x")
    with pytest.raises(DedupNotConfigured, match="non_replicated_deduplication_window"):
        writer_for(s).check_tables(["db.plain"])


def test_a_replay_across_the_token_upgrade_is_never_sent_under_another_identity(
        chdb_session: Any, sample: Descriptor) -> None:
    """Issue 12: a block first inserted by content hash (an 18.16 server, pinned
    BLOCK_HASH in its intent) must not be replayed on a server with tokens: with a
    token it is a new block (the per-process decision this replaces stored it twice),
    and without one the server's hash is not 18.16's (measured in
    ``tests/integration/test_pins_stack.py``). The writer refuses, sending nothing."""
    from blockagg.aggregator.clickhouse.exceptions import ClickHouseError
    from blockagg.aggregator.core.metadata import DedupMode, Pins

    s = chdb_session
    cls: Any = message_class(sample)
    plan, _ = make_plan("db.up", 1, 1, sample, [Column("i64", "Int64"), Column("text", "String")])
    payloads = decode_messages(plan, [[cls(i64=7, text="u").SerializeToString()]])
    block = Block("top", 0, 1, "db.up", 0, 0, np.array([0]), 1, 1,
                  block_token("top", 0, "db.up", 0, 0, 0xAB))

    def batch(mode: int) -> Batch:
        return Batch("top", 0, 0, 1, np.array([0]), np.array([1]), np.array([1]),
                     np.array([1]), payloads, {1: "db.up"}, pins=Pins(5, 0xAB, mode))

    s.query("DROP TABLE IF EXISTS db.up")
    s.query("CREATE TABLE db.up (i64 Int64, text String) ENGINE = MergeTree ORDER BY "
            "i64 SETTINGS non_replicated_deduplication_window = 100")
    writer = writer_for(s)
    s.query("INSERT INTO db.up (i64, text) VALUES (7, 'u')")     # the first attempt's block
    with pytest.raises(ClickHouseError, match="hash differently"):
        writer.insert(block, batch(DedupMode.BLOCK_HASH))
    assert s.query("SELECT count() FROM db.up", "CSV").bytes().strip() == b"1"
    writer.insert(block, batch(DedupMode.UNPINNED))   # what a per-process decision did
    assert s.query("SELECT count() FROM db.up", "CSV").bytes().strip() == b"2"


def test_two_kafka_clusters_equal_blocks_both_land_under_tokens(
        chdb_session: Any, sample: Descriptor) -> None:
    """Issue 27 (two data centres into one shard), token mode: two clusters' blocks
    with the same rows at the same topic name, partition and offsets differ only by
    the topic incarnation (``incarnation_of(cluster id, topic id)``, pinned), which the
    token carries: both are stored, and each one's retry is dropped. The table needs
    no ``_incarnation`` column here, even with
    ``clickhouse.shared_with_other_kafka_clusters``."""
    from blockagg.aggregator.core.metadata import DedupMode, Pins, incarnation_of

    s = chdb_session
    s.query("DROP TABLE IF EXISTS db.twodc")
    s.query("CREATE TABLE db.twodc (i64 Int64, text String) ENGINE = MergeTree ORDER BY "
            "i64 SETTINGS non_replicated_deduplication_window = 100")
    writer = ClickHouseBlockWriter(
        WriterConfig(replicas=(Replica("chdb"),), shared_with_other_kafka_clusters=True,
                     allow_without_coordinates=frozenset({"db.twodc"})),
        lambda r: ChdbClient(s), sleep=lambda x: None)
    writer.check_tables(["db.twodc"])
    cls: Any = message_class(sample)
    plan, _ = make_plan("db.twodc", 1, 1, sample,
                        [Column("i64", "Int64"), Column("text", "String")])
    payloads = decode_messages(plan, [[cls(i64=1, text="x").SerializeToString()]] * 2)
    for cluster in ("dc-east-cluster-id", "dc-west-cluster-id", "dc-east-cluster-id"):
        incarnation = incarnation_of(cluster, "topic-id")
        batch = Batch("events", 0, 40, 42, np.array([40, 41]), np.array([1, 1]),
                      np.array([1, 1]), np.array([1, 1]), payloads, {1: "db.twodc"},
                      pins=Pins(1, incarnation, int(DedupMode.TOKEN)))
        block = Block("events", 0, 1, "db.twodc", 40, 41, np.array([0, 1]), 2, 2,
                      block_token("events", 0, "db.twodc", 40, 41, incarnation))
        writer.insert(block, batch)
        writer.insert(block, batch)  # the retry
    assert s.query("SELECT count() FROM db.twodc", "CSV").bytes().strip() == b"4"
