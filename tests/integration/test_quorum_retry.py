"""Issue 25, "also reported": on 18.16 a deduplicated retry may return success before
``insert_quorum`` is met. On the real 18.16 replicas it does not: the first attempt
times out waiting for the quorum (code 319), and every later attempt of the block, a
retry or a replay, on either replica, is refused (code 286, "Quorum for previous
write has not been satisfied yet") until the lagging replica holds the part, because
18.16 checks ``/quorum/status`` before it writes or deduplicates anything. The
writer's success therefore still means the quorum holds the block.

And when the quorum fails for good (no active replica holds the part while another
tries to fetch it, as when the replica that wrote it goes away), 18.16 marks it
failed, removes the block's deduplication record and, when the writing replica comes
back, detaches its copy as ``noquorum_*``: the retry is stored afresh, once."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from blockagg.aggregator.clickhouse.exceptions import QuorumUnsatisfied
from blockagg.aggregator.clickhouse.writer import ClickHouseBlockWriter, Replica, WriterConfig
from tests.integration.test_clickhouse_writer import COLUMNS_1816, writer_for
from tests.integration.test_replay_across_alter import _batch_and_blocks, _table

pytestmark = pytest.mark.integration


def _rows_now(ch_replicas: list[Any], table: str) -> list[int]:
    """Each replica's row count as it is (no SYNC REPLICA: what a lost disk would leave)."""
    return [int(c.execute(f"SELECT count() FROM {table}")[0][0]) for c in ch_replicas]


def _attempt_codes(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The server's message for each failed attempt the writer logged."""
    return [r.getMessage().split("): ", 1)[1] for r in caplog.records
            if "failed (attempt" in r.getMessage()]


def _patient_writer(stack_env: dict[str, str]) -> ClickHouseBlockWriter:
    """A writer that really backs off, so its retries outlast a replica catching up."""
    host = stack_env["BLOCKAGG_CH_HOST"]
    replicas = tuple(Replica(host, int(p)) for p in stack_env["BLOCKAGG_CH_PORTS"].split(","))
    return ClickHouseBlockWriter(WriterConfig(
        replicas=replicas, insert_quorum=2, insert_quorum_timeout_ms=30_000,
        backoff_initial_s=0.2, backoff_max_s=2.0), sleep=time.sleep)


def test_a_retry_after_a_quorum_timeout_succeeds_only_once_the_quorum_holds_the_block(
        stack_env: dict[str, str], ch_replicas: list[Any], ch_database: str,
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    table = _table(ch_replicas, ch_database, "quorum_retry", COLUMNS_1816)
    # No wait in the quorum queue (each 286 an attempt, as the attempts' diagnosis is
    # what this test reads): this writer's sleep returns at once, and a send repeated
    # that fast finds the refused one still registered (216, query id in use).
    writer = writer_for(stack_env, insert_quorum=2, insert_quorum_timeout_ms=1500,
                        max_attempts=4, quorum_pending_wait_s=0)
    batch, block, _ = _batch_and_blocks(writer, table, tmp_path)
    caplog.set_level(logging.INFO, logger="blockagg.aggregator.clickhouse.writer")
    ch_replicas[1].execute(f"SYSTEM STOP FETCHES {table}")
    try:
        # Attempt 1 stores the part on r1 and times out waiting for r2; attempts 2-4
        # (the writer's retries, on r2 then r1 again) are refused, not deduplicated.
        with pytest.raises(QuorumUnsatisfied) as info:
            writer.insert(block, batch)
        codes = _attempt_codes(caplog)
        assert "Unknown status, client must retry" in codes[0], codes  # code 319
        assert "Timeout while waiting for quorum" in codes[0], codes
        assert all("Quorum for previous write has not been satisfied yet" in c
                   for c in codes[1:]) and len(codes) == 4, codes
        assert info.value.code == 286
        assert "The replica that does not catch up" in str(info.value)
        assert _rows_now(ch_replicas, table) == [20, 0]

        # A replay of the block by a later run (a fresh writer) fares the same.
        caplog.clear()
        replay = dataclasses.replace(block, replay=True)
        with pytest.raises(QuorumUnsatisfied):
            writer_for(stack_env, insert_quorum=2, insert_quorum_timeout_ms=1500,
                       max_attempts=3, quorum_pending_wait_s=0).insert(replay, batch)
        assert all("Quorum for previous write" in c for c in _attempt_codes(caplog))
        assert _rows_now(ch_replicas, table) == [20, 0]
    finally:
        ch_replicas[1].execute(f"SYSTEM START FETCHES {table}")

    # With fetches back, the replay is deduplicated and returns only once r2 holds the
    # part: counted right after it returns, without waiting for replication.
    _patient_writer(stack_env).insert(dataclasses.replace(block, replay=True), batch)
    assert _rows_now(ch_replicas, table) == [20, 20]
    for c in ch_replicas:
        c.execute(f"SYSTEM SYNC REPLICA {table}")
    assert _rows_now(ch_replicas, table) == [20, 20], "stored once on each replica"


def _quorum_pending(client: Any, database: str, name: str) -> bool:
    """Whether the table's ``/quorum/status`` node (a quorum insert not yet on enough
    replicas) exists, read through ``client``'s replica."""
    path = client.execute("SELECT zookeeper_path FROM system.replicas WHERE database = %(d)s "
                          "AND table = %(t)s", {"d": database, "t": name})[0][0]
    return bool(client.execute(
        "SELECT count() FROM system.zookeeper WHERE path = %(p)s AND name = 'status'",
        {"p": f"{path}/quorum"})[0][0])


def test_a_retry_after_a_failed_quorum_is_stored_afresh_and_once(
        stack_env: dict[str, str], ch_replicas: list[Any], ch_database: str,
        tmp_path: Path) -> None:
    """The copy on r1 whose quorum never came is not what a retry gets deduplicated
    against once the quorum has failed: r1 leaves (its table detached: inactive, as if
    its server were gone) while r2 tries to fetch; r2 marks the quorum failed and
    removes the block id; r1 comes back and sets its copy aside; the retry stores the
    block on both replicas, once."""
    table = _table(ch_replicas, ch_database, "quorum_failed", COLUMNS_1816)
    writer = writer_for(stack_env, insert_quorum=2, insert_quorum_timeout_ms=1500,
                        max_attempts=2)
    batch, block, _ = _batch_and_blocks(writer, table, tmp_path)
    ch_replicas[1].execute(f"SYSTEM STOP FETCHES {table}")
    detached = False
    try:
        with pytest.raises(QuorumUnsatisfied):
            writer.insert(block, batch)
        assert _rows_now(ch_replicas, table) == [20, 0]
        ch_replicas[0].execute(f"DETACH TABLE {table}")
        detached = True
    finally:
        ch_replicas[1].execute(f"SYSTEM START FETCHES {table}")
    try:
        deadline = time.monotonic() + 90
        while _quorum_pending(ch_replicas[1], ch_database, "quorum_failed"):
            assert time.monotonic() < deadline, "r2 never marked the quorum failed"
            time.sleep(0.5)
    finally:
        if detached:
            ch_replicas[0].execute(f"ATTACH TABLE {table}")
    assert _rows_now(ch_replicas, table) == [0, 0], "r1 set its copy aside (noquorum_)"

    _patient_writer(stack_env).insert(dataclasses.replace(block, replay=True), batch)
    assert _rows_now(ch_replicas, table) == [20, 20]
    for c in ch_replicas:
        c.execute(f"SYSTEM SYNC REPLICA {table}")
        assert c.execute(f"SELECT count(), uniqExact(_offset, i64) FROM {table}") == [(20, 20)]


def test_an_insert_queued_behind_another_quorum_waits_on_the_same_replica_and_lands(
        stack_env: dict[str, str], ch_replicas: list[Any], ch_database: str,
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Two partitions' blocks for one table on 18.16: the second is refused (286) while
    the first one's quorum is pending. The writer waits that out on the same replica,
    counting no attempt and logging no retry, and lands the block within a pause (at
    most 0.1 s) of the first quorum being reached (r2 fetching again: 18.16 takes
    seconds to retry a fetch it postponed)."""
    from concurrent.futures import ThreadPoolExecutor

    table = _table(ch_replicas, ch_database, "quorum_queue", COLUMNS_1816)
    first = _patient_writer(stack_env)
    batch, block_a, block_b = _batch_and_blocks(first, table, tmp_path)
    host = stack_env["BLOCKAGG_CH_HOST"]
    replicas = tuple(Replica(host, int(p)) for p in stack_env["BLOCKAGG_CH_PORTS"].split(","))
    queued = ClickHouseBlockWriter(WriterConfig(
        replicas=replicas, insert_quorum=2, insert_quorum_timeout_ms=30_000,
        max_attempts=2, backoff_initial_s=1.0, quorum_pending_wait_s=40.0), sleep=time.sleep)
    caplog.set_level(logging.DEBUG, logger="blockagg.aggregator.clickhouse.writer")
    ch_replicas[1].execute(f"SYSTEM STOP FETCHES {table}")
    with ThreadPoolExecutor(1) as pool:
        try:
            pending = pool.submit(first.insert, block_a, batch)
            deadline = time.monotonic() + 30
            while not _quorum_pending(ch_replicas[0], ch_database, "quorum_queue"):
                assert time.monotonic() < deadline, "the first insert's quorum never began"
                time.sleep(0.05)
            pool_b = ThreadPoolExecutor(1)
            landed = pool_b.submit(queued.insert, block_b, batch)
            time.sleep(1.0)
        finally:
            ch_replicas[1].execute(f"SYSTEM START FETCHES {table}")
        pending.result(timeout=60)
        reached = time.monotonic()
        landed.result(timeout=60)
        pool_b.shutdown()
    after = time.monotonic() - reached
    assert _attempt_codes(caplog) == [], "a queued insert is not a failed attempt"
    waits = [r for r in caplog.records if "previous quorum insert is pending" in r.getMessage()]
    assert waits and all(r.levelno == logging.DEBUG for r in waits)
    assert all(f":{replicas[0].port}:" in r.getMessage() for r in waits), "no failover"
    assert queued.quorum_waits == len(waits)
    assert after < 0.5, f"landed {after:.2f} s after the quorum it queued behind"
    for c in ch_replicas:
        c.execute(f"SYSTEM SYNC REPLICA {table}")
    assert _rows_now(ch_replicas, table) == [40, 40]
