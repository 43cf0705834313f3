"""A block sent again after an ALTER of its table, on the real 18.16 replicas
(content-hash deduplication): the server alone stores it twice; the writer's guard
(aggregator.clickhouse.structure) does not. The long fault run found this: a task
retried across a schema change stored 211 rows twice (docs/RELIABILITY.md)."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from blockagg.aggregator.clickhouse.exceptions import ReplayAcrossAlter
from blockagg.aggregator.clickhouse.writer import ClickHouseBlockWriter
from blockagg.aggregator.core.metadata import DedupMode, Pins
from blockagg.aggregator.core.model import Batch, Block, Thresholds, block_token
from blockagg.aggregator.core.protocol import InsertBlock, plan_batch, run_batch
from blockagg.aggregator.kafka.exceptions import AttemptFenced
from blockagg.aggregator.kafka.metadata_store import KafkaMetadataStore
from blockagg.proto.envelope import make_envelope
from blockagg.proto.registry import MemoryStore, Registry
from blockagg.registration.register import register
from blockagg.rows.prepare import Message, Plans, prepare
from tests.integration.conftest import replicated_engine
from tests.integration.test_clickhouse_writer import (
    COLUMNS_1816,
    make_rows,
    row_fds,
    writer_for,
)

pytestmark = pytest.mark.integration

WITHOUT_COORDINATES = COLUMNS_1816.replace(
    ", _topic String, _partition UInt32, _offset UInt64", "")


def test_the_server_alone_stores_a_block_again_after_add_column(
        ch_replicas: list[Any], ch_database: str) -> None:
    """The hazard itself: 18.16 hashes the part, which gains the new column."""
    c = ch_replicas[0]
    table = f"{ch_database}.bare"
    c.execute(f"CREATE TABLE {table} (id UInt64, v String) ENGINE = "
              f"{replicated_engine(ch_database, 'bare', 'id')}")
    rows = [(i, f"v{i}") for i in range(10)]
    for _ in range(2):
        c.execute(f"INSERT INTO {table} (id, v) VALUES", rows)
    assert c.execute(f"SELECT count() FROM {table}") == [(10,)]
    c.execute(f"ALTER TABLE {table} ADD COLUMN x Int64 DEFAULT 7")
    c.execute(f"INSERT INTO {table} (id, v) VALUES", rows)
    assert c.execute(f"SELECT count() FROM {table}") == [(20,)]


def _table(ch_replicas: list[Any], database: str, name: str, columns: str) -> str:
    for c in ch_replicas:
        c.execute(f"CREATE TABLE {database}.{name} ({columns}) ENGINE = "
                  f"{replicated_engine(database, name)}")
    return f"{database}.{name}"


def _batch_and_blocks(writer: ClickHouseBlockWriter, table: str, tmp: Path,
                      topic: str = "topic") -> tuple[Batch, Block, Block]:
    """Offsets 100..103, 10 rows each; block A = [100, 101], block B = [102, 103]."""
    fds = row_fds(tmp)
    store = MemoryStore()
    register(store, table, "it.v1.Row", fds)
    plans = Plans(Registry.load(store), lambda t: writer.describe(t).columns)
    rows = make_rows(fds, 40)
    msgs = [Message(100 + i, 1_700_000_000_000, make_envelope(table, rows[10 * i:10 * i + 10], 1))
            for i in range(4)]
    prepared = prepare(topic, 0, msgs, plans, dead_letter_table="blockagg.dead_letters")
    batch = Batch(topic, 0, 100, 104, prepared.offsets, prepared.table_ids,
                  prepared.row_counts, prepared.sizes, prepared.payloads, prepared.tables)
    tid = int(prepared.table_ids[0])

    def block(first: int, last: int) -> Block:
        return Block(topic, 0, tid, table, first, last, np.arange(first - 100, last - 99),
                     20, 0, block_token(topic, 0, table, first, last))

    return batch, block(100, 101), block(102, 103)


def _add_column(ch_replicas: list[Any], table: str) -> None:
    ch_replicas[0].execute(f"ALTER TABLE {table} ADD COLUMN x Int64 DEFAULT 7")
    database, name = table.split(".")
    deadline = time.monotonic() + 60
    while not all(c.execute("SELECT count() FROM system.columns WHERE database = %(d)s AND "
                            "table = %(t)s AND name = 'x'", {"d": database, "t": name})[0][0]
                  for c in ch_replicas):
        assert time.monotonic() < deadline, f"{table}: the ALTER did not reach every replica"
        time.sleep(0.2)


def _counts(ch_replicas: list[Any], table: str) -> list[int]:
    for c in ch_replicas:
        c.execute(f"SYSTEM SYNC REPLICA {table}")
    return [int(c.execute(f"SELECT count() FROM {table}")[0][0]) for c in ch_replicas]


def test_a_block_replayed_after_an_alter_is_not_stored_twice(
        stack_env: dict[str, str], ch_replicas: list[Any], ch_database: str,
        tmp_path: Path) -> None:
    table = _table(ch_replicas, ch_database, "events", COLUMNS_1816)
    writer = writer_for(stack_env, insert_quorum=2)
    batch, stored, lost = _batch_and_blocks(writer, table, tmp_path)
    mark = writer.structure_mark([table, "blockagg.dead_letters"])
    assert mark > 0
    batch = dataclasses.replace(batch, pins=Pins(dedup=DedupMode.BLOCK_HASH, structure=mark))
    writer.insert(stored, batch)

    replay = dataclasses.replace(stored, replay=True)
    writer.insert(replay, batch)
    assert _counts(ch_replicas, table) == [20, 20], "unchanged columns: the hash drops it"

    _add_column(ch_replicas, table)
    writer.insert(replay, batch)
    assert _counts(ch_replicas, table) == [20, 20], "stored already: not sent again"
    writer.insert(dataclasses.replace(lost, replay=True), batch)
    assert _counts(ch_replicas, table) == [40, 40], "never stored: sent"
    assert ch_replicas[1].execute(
        f"SELECT count(), uniqExact(_offset, i64) FROM {table}") == [(40, 40)]


def test_a_table_without_coordinates_refuses_the_replay_and_sends_nothing(
        stack_env: dict[str, str], ch_replicas: list[Any], ch_database: str,
        tmp_path: Path) -> None:
    table = _table(ch_replicas, ch_database, "plain", WITHOUT_COORDINATES)
    writer = writer_for(stack_env, insert_quorum=2)
    batch, stored, _ = _batch_and_blocks(writer, table, tmp_path)
    mark = writer.structure_mark([table])
    batch = dataclasses.replace(batch, pins=Pins(dedup=DedupMode.BLOCK_HASH, structure=mark))
    writer.insert(stored, batch)
    _add_column(ch_replicas, table)
    with pytest.raises(ReplayAcrossAlter, match="has no _topic/_partition/_offset columns"):
        writer.insert(dataclasses.replace(stored, replay=True), batch)
    assert _counts(ch_replicas, table) == [20, 20]
    assert writer.structure_mark([table]) > mark, "a new batch's mark covers the ALTER"


def test_an_attempt_still_running_holds_its_query_id_until_it_ends(
        stack_env: dict[str, str], ch_replicas: list[Any], ch_database: str,
        tmp_path: Path) -> None:
    """What the re-send check relies on, on the real 18.16 replicas: an insert waiting
    for its quorum shows under the block's query id in ``system.processes``, and a
    second query with that id is refused (code 216) until the first ends."""
    from clickhouse_driver.errors import ServerException

    table = _table(ch_replicas, ch_database, "slow", COLUMNS_1816)
    writer = writer_for(stack_env, insert_quorum=2, insert_quorum_timeout_ms=120_000)
    batch, block, _ = _batch_and_blocks(writer, table, tmp_path)
    mark = writer.structure_mark([table, "blockagg.dead_letters"])
    batch = dataclasses.replace(batch, pins=Pins(dedup=DedupMode.BLOCK_HASH, structure=mark))
    ch_replicas[1].execute(f"SYSTEM STOP FETCHES {table}")
    first = threading.Thread(target=writer.insert, args=(block, batch))
    first.start()
    try:
        other = writer_for(stack_env)
        deadline = time.monotonic() + 60
        while not other.resend.still_running(block.token):
            assert time.monotonic() < deadline, "the waiting insert never showed"
            time.sleep(0.1)
        port = stack_env["BLOCKAGG_CH_PORTS"].split(",")[0]
        address = f"{stack_env['BLOCKAGG_CH_HOST']}:{port}"
        assert other.resend.still_running(block.token) == [address]
        with pytest.raises(ServerException) as refused:
            ch_replicas[0].execute("SELECT 1", query_id=block.token)
        assert refused.value.code == 216
    finally:
        ch_replicas[1].execute(f"SYSTEM START FETCHES {table}")
        first.join(timeout=120)
    assert not first.is_alive()
    assert writer_for(stack_env).resend.still_running(block.token) == []
    assert _counts(ch_replicas, table) == [20, 20]


def test_a_stalled_attempt_does_not_store_a_block_again_after_a_retry_and_an_alter(
        stack_env: dict[str, str], ch_replicas: list[Any], ch_database: str,
        kafka_bootstrap: str, new_topic: Callable[..., str], tmp_path: Path) -> None:
    """Issue 25, path 1, on the real broker and 18.16 replicas. Attempt A commits its
    intent and stalls before its confirm; Spark's retry B of the same task commits the
    same replay intent (byte for byte, but for the attempt nonce), inserts the first
    block and dies before its next commit; the table is ALTERed; A resumes. Before the
    nonce A's confirm passed (the last commit read as its own text), A sent the block
    as an on-time first attempt, and 18.16 hashed the part with the new column:
    stored twice. Now A's confirm fails and nothing more is stored."""
    topic = new_topic(partitions=1, prefix="stall")
    table = _table(ch_replicas, ch_database, "stalled", COLUMNS_1816)
    writer = writer_for(stack_env, insert_quorum=2)
    batch, _, _ = _batch_and_blocks(writer, table, tmp_path, topic)
    mark = writer.structure_mark([table])
    batch = dataclasses.replace(batch, pins=Pins(dedup=DedupMode.BLOCK_HASH, structure=mark))
    thresholds = Thresholds(max_rows=20, max_bytes=1 << 30)
    group = f"blockagg-stall-{uuid.uuid4().hex[:10]}"
    with KafkaMetadataStore({"bootstrap.servers": kafka_bootstrap, "group.id": group},
                            timeout=15.0) as store:
        a = store.attempt(topic, 0)
        plan_a = plan_batch(batch, a.committed(topic, 0), thresholds, 1, 1,
                            attempt=a.nonce, now_s=int(time.time()))
        run_batch(dataclasses.replace(plan_a, operations=plan_a.operations[:1]), a, writer, a)
        # A stalls. B, Spark's retry of the same task, replays A's intent:
        b = store.attempt(topic, 0)
        plan_b = plan_batch(batch, b.committed(topic, 0), thresholds, 1, 1,
                            attempt=b.nonce, now_s=int(time.time()))
        assert [op.block.first for op in plan_b.operations if isinstance(op, InsertBlock)] \
            == [op.block.first for op in plan_a.operations if isinstance(op, InsertBlock)]
        run_batch(dataclasses.replace(plan_b, operations=plan_b.operations[:2]), b, writer, b)
        assert _counts(ch_replicas, table) == [20, 20]
        # B dies before its next commit; the table is ALTERed; A resumes:
        _add_column(ch_replicas, table)
        with pytest.raises(AttemptFenced, match="no longer this attempt's intent"):
            run_batch(dataclasses.replace(plan_a, operations=plan_a.operations[1:]), a,
                      writer, a)
        assert _counts(ch_replicas, table) == [20, 20], "nothing of A's stored"
        a.close()
        b.close()
