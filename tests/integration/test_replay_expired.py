"""A replay after downtime longer than the table's deduplication age, on the real 18.16
replicas (issue 25, path 6). ClickHouse forgets a stored block once a block newer by
``replicated_deduplication_window_seconds`` is stored (7 days by default; 1 s here,
with the cleanup running every second); a replay of a landed block after that is
stored twice by the server alone. The intent records when its blocks were first sent
(``Metadata.since_s``), so the writer settles such a replay by the block's rows."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest

from blockagg.aggregator.clickhouse.exceptions import ReplayBeyondDedupAge
from blockagg.aggregator.core.metadata import DedupMode, Pins
from tests.integration.test_clickhouse_writer import COLUMNS_1816, writer_for
from tests.integration.test_replay_across_alter import (
    WITHOUT_COORDINATES,
    _batch_and_blocks,
    _counts,
)

pytestmark = pytest.mark.integration

FORGETFUL = "SETTINGS replicated_deduplication_window_seconds = 1, cleanup_delay_period = 1, " \
            "cleanup_delay_period_random_add = 0"


def _table(ch_replicas: list[Any], database: str, name: str, columns: str) -> str:
    for c in ch_replicas:
        c.execute(f"CREATE TABLE {database}.{name} ({columns}) ENGINE = ReplicatedMergeTree("
                  f"'/clickhouse/tables/{{shard}}/{database}/{name}', '{{replica}}') "
                  f"ORDER BY tuple() {FORGETFUL}")
    return f"{database}.{name}"


def _forget_all_but_newest(ch_replicas: list[Any], table: str) -> None:
    """Wait until the server keeps one block id (the newest) of ``table``."""
    database, name = table.split(".")
    path = f"/clickhouse/tables/01/{database}/{name}/blocks"
    deadline = time.monotonic() + 90
    while int(ch_replicas[0].execute(
            "SELECT count() FROM system.zookeeper WHERE path = %(p)s", {"p": path})[0][0]) > 1:
        assert time.monotonic() < deadline, f"{table}: the server never forgot its blocks"
        time.sleep(0.5)


def test_a_replay_older_than_the_dedup_age_is_not_stored_twice(
        stack_env: dict[str, str], ch_replicas: list[Any], ch_database: str,
        tmp_path: Path) -> None:
    table = _table(ch_replicas, ch_database, "forgetful", COLUMNS_1816)
    writer = writer_for(stack_env, insert_quorum=2)
    batch, first, second = _batch_and_blocks(writer, table, tmp_path)
    batch = dataclasses.replace(batch, pins=Pins(dedup=DedupMode.BLOCK_HASH,
                                                 structure=writer.structure_mark([table])))
    sent_at = int(time.time())
    writer.insert(first, batch)
    time.sleep(2.5)
    writer.insert(second, batch)
    _forget_all_but_newest(ch_replicas, table)
    assert _counts(ch_replicas, table) == [40, 40]

    # A replay from an intent that recorded its first send: counted, not sent.
    writer.insert(dataclasses.replace(first, replay=True, since_s=sent_at), batch)
    assert _counts(ch_replicas, table) == [40, 40]

    # The hazard it avoided: the same replay without a recorded time (an intent written
    # before intents carried one) is sent, and the server, which forgot the block,
    # stores it twice.
    writer.insert(dataclasses.replace(first, replay=True, since_s=0), batch)
    assert _counts(ch_replicas, table) == [60, 60]


def test_an_expired_replay_without_coordinates_is_refused_and_sends_nothing(
        stack_env: dict[str, str], ch_replicas: list[Any], ch_database: str,
        tmp_path: Path) -> None:
    table = _table(ch_replicas, ch_database, "forgetful_plain", WITHOUT_COORDINATES)
    writer = writer_for(stack_env, insert_quorum=2)
    batch, first, _ = _batch_and_blocks(writer, table, tmp_path)
    batch = dataclasses.replace(batch, pins=Pins(dedup=DedupMode.BLOCK_HASH,
                                                 structure=writer.structure_mark([table])))
    sent_at = int(time.time()) - 120
    writer.insert(first, batch)
    with pytest.raises(ReplayBeyondDedupAge,
                       match=r"replicated_deduplication_window_seconds = 1.*Nothing was sent"):
        writer.insert(dataclasses.replace(first, replay=True, since_s=sent_at), batch)
    assert _counts(ch_replicas, table) == [20, 20]
