"""blockagg.aggregator.clickhouse.dedup_window: the window a table needs, from the
configuration, and the refusal naming table, window and need."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockagg.aggregator.clickhouse.dedup_window import DedupNeed, judge_window
from blockagg.aggregator.clickhouse.exceptions import DedupWindowTooSmall


def test_the_issues_overflow_is_refused() -> None:
    """128 partitions into one table with the default window of 100 (the reproduced
    duplicate): the need is 2 x 128 = 256 blocks."""
    need = DedupNeed(partitions=128, max_offsets_per_trigger=None, max_rows=1_000_000)
    assert need.blocks == 256
    with pytest.raises(DedupWindowTooSmall) as info:
        judge_window("db.events", "replicated_deduplication_window", 100, need, False)
    text = str(info.value)
    assert "db.events" in text and "= 100" in text and "256 blocks" in text
    assert "allow_small_dedup_window" in text and "128 partitions" in text


def test_blocks_sealed_by_max_rows_count() -> None:
    need = DedupNeed(partitions=8, max_offsets_per_trigger=100_000, max_rows=30_000)
    assert need.blocks_per_batch == 8 + 4 and need.blocks == 24
    assert judge_window("db.t", "replicated_deduplication_window", 24, need, False) is None
    warning = judge_window("db.t", "replicated_deduplication_window", 23, need, True)
    assert warning is not None and "23 is below the 24 blocks" in warning


@settings(max_examples=300, derandomize=True)
@given(st.lists(st.integers(0, 5_000), min_size=1, max_size=64), st.integers(1, 2_000))
def test_need_bounds_the_blocks_one_batch_can_seal(shares: list[int], max_rows: int) -> None:
    """Any split of max_offsets_per_trigger over the partitions, one row per message:
    the blocks one table receives in a batch (each partition seals ceil(m / max_rows),
    at least one when it has a message) never exceed blocks_per_batch."""
    total = sum(shares)
    need = DedupNeed(len(shares), total, max_rows)
    sealed = sum(math.ceil(m / max_rows) for m in shares)
    assert sealed <= need.blocks_per_batch
