"""How large a table's deduplication window must be, computed from the configuration.

A replayed block is dropped by ClickHouse only while its first attempt is still among
the table's last ``replicated_deduplication_window`` blocks (or
``non_replicated_deduplication_window`` on 22+). Between the first attempt and the
replay, every partition that can write the table inserts its own blocks into it:

* **partitions**: every partition of every topic on the shard (an envelope may name
  any registered table, and the dead-letter table is fed by all of them);
* **blocks per batch**: each partition's share of a micro-batch seals at most
  ``ceil(its messages / max_rows) + 1`` blocks per table when messages carry one row
  each, so all partitions together at most ``partitions + ceil(max_offsets_per_trigger
  / max_rows)``;
* **batches in flight**: the batch whose block failed, and the one that replays it
  (a task retry runs inside the batch; a restart replays before any new batch).

The need is ``batches in flight x (partitions + ceil(max_offsets_per_trigger /
max_rows))``. Messages with several rows seal more blocks than this counts, and
without ``max_offsets_per_trigger`` a catch-up batch is unbounded: both are said in
the explanation so the operator can size above it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from blockagg.aggregator.clickhouse.exceptions import DedupWindowTooSmall

BATCHES_IN_FLIGHT: Final = 2
"""The batch whose block failed and the batch that replays it."""


@dataclass(frozen=True, slots=True)
class DedupNeed:
    """The blocks a table can receive between a block's first attempt and its replay."""

    partitions: int
    max_offsets_per_trigger: int | None
    max_rows: int
    batches_in_flight: int = BATCHES_IN_FLIGHT

    @property
    def blocks_per_batch(self) -> int:
        """Blocks one micro-batch can insert into one table, over every partition."""
        extra = 0
        if self.max_offsets_per_trigger is not None:
            extra = -(-self.max_offsets_per_trigger // self.max_rows)
        return self.partitions + extra

    @property
    def blocks(self) -> int:
        return self.batches_in_flight * self.blocks_per_batch

    def explain(self) -> str:
        bound = (f"ceil(max_offsets_per_trigger {self.max_offsets_per_trigger} / max_rows "
                 f"{self.max_rows})" if self.max_offsets_per_trigger is not None else
                 "0 (max_offsets_per_trigger unset: a catch-up batch can seal more)")
        return (f"{self.batches_in_flight} batches in flight x ({self.partitions} partitions "
                f"on the shard + {bound}) = {self.blocks} blocks")


def judge_window(table: str, setting: str, window: int, need: DedupNeed,
                 allow_small: bool) -> str | None:
    """``None`` when ``window`` holds ``need``; else raise :class:`DedupWindowTooSmall`
    naming the table, the window and the need, or, with ``allow_small`` (the
    operator's ``clickhouse.allow_small_dedup_window``), return it as a warning."""
    if window >= need.blocks:
        return None
    message = (
        f"table {table}: {setting} = {window} is below the {need.blocks} blocks a retried "
        f"block may have to outlive ({need.explain()}): a replayed block could land "
        f"twice. Raise it to at least {need.blocks} (the table's SETTINGS, ALTER TABLE "
        f"{table} MODIFY SETTING on 19.x+, or <merge_tree> in config.xml), or lower "
        "max_offsets_per_trigger / raise blocks.max_rows; "
        "clickhouse.allow_small_dedup_window = true starts anyway")
    if allow_small:
        return message
    raise DedupWindowTooSmall(message)
