"""The two ClickHouse 18.16 replicas (one shard, ZooKeeper) deduplicate a retried block and
accept quorum inserts: the server-side guarantees the aggregator's exactly-once design needs."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.integration.conftest import replicated_engine

pytestmark = pytest.mark.integration


def _count(client: Any, table: str) -> int:
    return int(client.execute(f"SELECT count() FROM {table}")[0][0])


def _create_on_both(ch_replicas: list[Any], db: str, table: str) -> str:
    for c in ch_replicas:
        c.execute(
            f"CREATE TABLE {db}.{table} (id UInt64, payload String) "
            f"ENGINE = {replicated_engine(db, table, 'id')}"
        )
    return f"{db}.{table}"


def test_replicated_table_drops_a_retried_block_and_both_replicas_see_one_copy(
    ch_replicas: list[Any], ch_database: str
) -> None:
    r1, r2 = ch_replicas
    table = _create_on_both(ch_replicas, ch_database, "dedup")
    block = [(i, f"row-{i}") for i in range(100)]
    r1.execute(f"INSERT INTO {table} (id, payload) VALUES", block)
    r1.execute(f"INSERT INTO {table} (id, payload) VALUES", block)  # the retry: same block
    r2.execute(f"INSERT INTO {table} (id, payload) VALUES", block)  # retried on the other replica
    r2.execute(f"SYSTEM SYNC REPLICA {table}")
    r1.execute(f"SYSTEM SYNC REPLICA {table}")
    assert _count(r1, table) == 100
    assert _count(r2, table) == 100
    assert r2.execute(f"SELECT sum(id) FROM {table}")[0][0] == sum(range(100))


def test_insert_with_quorum_2_succeeds_and_is_on_both_replicas(
    ch_replicas: list[Any], ch_database: str
) -> None:
    r1, r2 = ch_replicas
    table = _create_on_both(ch_replicas, ch_database, "quorum")
    r1.execute(
        f"INSERT INTO {table} (id, payload) VALUES",
        [(1, "a"), (2, "b")],
        settings={"insert_quorum": 2, "insert_quorum_timeout": 60000},
    )
    # With quorum 2 the insert returned only once both replicas had the part.
    deadline = time.monotonic() + 10
    while _count(r2, table) != 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _count(r1, table) == 2
    assert _count(r2, table) == 2
    assert (
        r2.execute(f"SELECT count() FROM {table}", settings={"select_sequential_consistency": 1})[
            0
        ][0]
        == 2
    )
