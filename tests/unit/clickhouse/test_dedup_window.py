"""blockagg.aggregator.clickhouse.dedup_window: the window a table needs, from the
configuration, and the refusal naming table, window and need."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockagg.aggregator.clickhouse.dedup_window import DedupNeed, judge_window, need_for
from blockagg.aggregator.clickhouse.exceptions import DedupWindowTooSmall
from blockagg.aggregator.config import loads
from blockagg.aggregator.core.blocks import form_blocks
from blockagg.aggregator.core.model import Batch, Thresholds
from blockagg.aggregator.core.protocol import plan_batch
from tests.unit.core.fakes import (
    DedupSink,
    MemoryMetadataStore,
    expected_rows,
    make_batch,
    run_crashing,
)


def old_need(partitions: int, max_offsets_per_trigger: int | None, max_rows: int) -> int:
    """The need before issue 25: 2 x (partitions + ceil(max_offsets_per_trigger /
    max_rows)), which assumed one small row per message."""
    extra = 0 if max_offsets_per_trigger is None else math.ceil(
        max_offsets_per_trigger / max_rows)
    return 2 * (partitions + extra)


def test_an_unbounded_batch_is_refused_on_any_window() -> None:
    """128 partitions into one table without max_offsets_per_trigger (the reproduced
    duplicate of the first review): no window holds an unbounded batch."""
    need = DedupNeed(max_offsets_per_trigger=None)
    assert need.blocks is None and not need.holds(10**9)
    with pytest.raises(DedupWindowTooSmall) as info:
        judge_window("db.events", "replicated_deduplication_window", 100, need, False)
    text = str(info.value)
    assert "db.events" in text and "= 100" in text and "unbounded" in text
    assert "job.max_offsets_per_trigger to at most 50" in text
    assert "allow_small_dedup_window" in text


def test_the_need_is_two_batches_of_max_offsets_per_trigger() -> None:
    need = DedupNeed(max_offsets_per_trigger=12)
    assert need.blocks_per_batch == 12 and need.blocks == 24
    assert judge_window("db.t", "replicated_deduplication_window", 24, need, False) is None
    warning = judge_window("db.t", "replicated_deduplication_window", 23, need, True)
    assert warning is not None and "23 is below the 24 blocks" in warning
    assert "max_bytes seals a block alone" in warning and "at most 11" in warning


def test_the_default_configuration_fits_clickhouses_default_window() -> None:
    """Invariant 7: the default max_offsets_per_trigger needs ClickHouse's default
    window of 100 at most."""
    config = loads('[job]\ncheckpoint_location = "/tmp/ck"\n[kafka]\n'
                   '"bootstrap.servers" = "x:1"\n[[topics]]\nname = "t"\n'
                   'replicas = ["ch:9000"]\n')
    assert need_for(config).blocks == 100
    assert judge_window("db.t", "replicated_deduplication_window", 100, need_for(config),
                        False) is None


def _batch(partition: int, rows: list[int], sizes: list[int], tables: list[int]) -> Batch:
    n = len(rows)
    return Batch(topic="events", partition=partition, start=0, end=n,
                 offsets=np.arange(n, dtype=np.int64),
                 table_ids=np.asarray(tables, dtype=np.int64),
                 row_counts=np.asarray(rows, dtype=np.int64),
                 sizes=np.asarray(sizes, dtype=np.int64), payloads=[None] * n,
                 tables={t: f"db.t{t}" for t in set(tables)})


@st.composite
def shard_batches(draw: st.DrawFn) -> tuple[list[Batch], Thresholds, int]:
    """One micro-batch over 1-8 partitions (of one or several topics, however their
    replicas are spelled): messages of any rows and bytes, 1-3 tables, any thresholds."""
    thresholds = Thresholds(max_rows=draw(st.integers(1, 50)),
                            max_bytes=draw(st.integers(1, 500)))
    batches = []
    for partition in range(draw(st.integers(1, 8))):
        n = draw(st.integers(0, 30))
        rows = draw(st.lists(st.integers(1, 60), min_size=n, max_size=n))
        sizes = draw(st.lists(st.integers(0, 600), min_size=n, max_size=n))
        tables = draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
        batches.append(_batch(partition, rows, sizes, tables))
    return batches, thresholds, sum(len(b) for b in batches)


@settings(max_examples=300, derandomize=True)
@given(shard_batches())
def test_need_bounds_the_blocks_one_batch_can_seal(
        case: tuple[list[Batch], Thresholds, int]) -> None:
    """Every way a block is sealed (rows, bytes, the batch's end), any rows and bytes
    per message: the blocks one table receives in a batch of at most
    max_offsets_per_trigger messages never exceed blocks_per_batch."""
    batches, thresholds, messages = case
    need = DedupNeed(max_offsets_per_trigger=max(messages, 1))
    per_table: dict[int, int] = {}
    for batch in batches:
        for block in form_blocks(batch, 0, {}, thresholds).blocks:
            per_table[block.table_id] = per_table.get(block.table_id, 0) + 1
    assert need.blocks_per_batch is not None
    assert all(count <= need.blocks_per_batch for count in per_table.values())


def test_messages_reaching_max_bytes_seal_a_block_each_beyond_the_old_need() -> None:
    """Path 5 of issue 25: messages reaching blocks.max_bytes are one block each: 20
    per partition-batch where the old need assumed 1; the new need counts them."""
    thresholds = Thresholds(max_rows=1_000_000, max_bytes=1_000)
    batch = _batch(0, [1] * 20, [1_000] * 20, [1] * 20)
    sealed = len(form_blocks(batch, 0, {}, thresholds).blocks)
    assert sealed == 20
    assert old_need(1, 20, 1_000_000) // 2 == 2 < sealed
    assert DedupNeed(20).blocks_per_batch == sealed


def _replay_after_two_batches(window: int) -> DedupSink:
    """Two partitions into one table, 20 messages each per batch (40 =
    max_offsets_per_trigger), every message reaching max_bytes. Partition 0's first
    block lands and its acknowledgement is lost; partition 1 inserts its blocks of
    that batch and of the next; then partition 0's retry replays its intent."""
    thresholds = Thresholds(max_rows=1_000, max_bytes=10)
    messages = [(offset, 1, 1) for offset in range(20)]  # partition 0
    others = [(offset, 1, 1) for offset in range(100, 140)]  # partition 1
    store, sink = MemoryMetadataStore(), DedupSink(window=window)

    def batch(partition: int, start: int, end: int) -> Any:
        return make_batch(others if partition else messages, start, end,
                          partition=partition, bytes_per_row=10)

    first = plan_batch(batch(0, 0, 20), None, thresholds, 1, 1)
    assert not run_crashing(first, store, sink, at=1, after=True)
    assert len(sink.inserted) == 1
    for start, batch_id in ((100, 1), (120, 2)):
        plan = plan_batch(batch(1, start, start + 20), store.committed("events", 1),
                          thresholds, 1, batch_id)
        assert run_crashing(plan, store, sink, None)
    retry = plan_batch(batch(0, 0, 20), store.committed("events", 0), thresholds, 1, 2)
    assert run_crashing(retry, store, sink, None)
    return sink


def test_a_replay_stored_twice_under_the_old_need_is_dropped_under_the_new_one() -> None:
    """The core model with the project's fakes: a window equal to the old need (2 x
    (2 partitions + ceil(40 / 1000)) = 6) stores the replayed block's row twice; a
    window equal to the new need (2 x 40 = 80) stores every row once."""
    expected = expected_rows([(offset, 1, 1) for offset in [*range(20), *range(100, 140)]])
    under_old = _replay_after_two_batches(old_need(2, 40, 1_000))
    assert under_old.duplicates() == [("db.t1", 0, 0)]
    under_new = _replay_after_two_batches(DedupNeed(40).blocks or 0)
    assert under_new.rows == expected and under_new.duplicates() == []
    assert len(under_new.deduplicated) == 1


TWO_SPELLINGS = """
[job]
checkpoint_location = "/tmp/ck"
max_offsets_per_trigger = 50
[kafka]
"bootstrap.servers" = "x:1"
[[topics]]
name = "a"
replicas = ["127.0.0.1:19000", "127.0.0.1:19001"]
[[topics]]
name = "b"
replicas = ["localhost:19001"]
"""


def test_two_spellings_of_one_shard_are_counted_together() -> None:
    """Reported with issue 25: two topics writing one shard under different spellings
    or subsets of its replicas each counted their own partitions (41 + ceil(50 /
    1,000,000) = 42 per batch each). A batch can hold one message on each of 50 of
    their 82 partitions, 50 end-of-batch blocks into one table: the need, the same for
    both topics and both spellings, holds them."""
    from unittest.mock import MagicMock

    from blockagg.spark.driver import Driver

    driver = Driver(loads(TWO_SPELLINGS), MagicMock(), components=MagicMock(), run_id=1)
    need = driver.dedup_need()
    sealed = sum(len(form_blocks(_batch(p, [1], [10], [1]), 0, {},
                                 Thresholds(1_000_000, 64 << 20)).blocks) for p in range(50))
    assert sealed == 50 > old_need(41, 50, 1_000_000) // 2
    assert need.blocks_per_batch is not None and need.blocks_per_batch >= sealed
