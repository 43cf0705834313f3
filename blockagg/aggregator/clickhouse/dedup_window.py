"""How large a table's deduplication window must be, computed from the configuration.

A replayed block is dropped by ClickHouse only while its first attempt is still among
the table's last ``replicated_deduplication_window`` blocks (or
``non_replicated_deduplication_window`` on 22+). Between the first attempt and the
replay, every partition of the job that can write the table inserts its own blocks
into it. The need bounds those blocks with what the configuration fixes:

* **blocks per batch <= messages per batch <= max_offsets_per_trigger.** Every
  block holds at least one message, and a message is in one block of its batch (a
  replay block is rebuilt from messages of the batch's range, the rest are routed
  once). Every way a block is sealed is inside this bound: the row threshold (a
  message carries any number of rows, so one message can reach ``max_rows`` alone),
  the byte threshold (one message can reach ``max_bytes`` alone), the end of the
  batch (its block still holds a message that sealed nothing) and the replay (its
  messages are in the range). Neither rows nor bytes per message are bounded by the
  configuration, so no smaller bound is safe: a batch of ``max_offsets_per_trigger``
  messages each reaching a threshold seals exactly that many blocks, all into one
  table if the envelopes say so. Spark's ``maxOffsetsPerTrigger`` counts offsets of
  every partition of the query, so the bound holds for a shard however its topics and
  replicas are spelled, and whatever the partitions are (added ones included).
* **batches in flight**: the batch whose block failed, and the one that replays it
  (a task retry runs inside the batch; a restart replays before any new batch). A
  block deduplicated by the server adds nothing to the window, so a block counts once
  over the two.

The need is ``batches in flight x max_offsets_per_trigger``. Without
``max_offsets_per_trigger`` a batch is unbounded and no window holds it: the need is
unbounded and every window is refused (the default, 50, fits ClickHouse's default
window of 100).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from blockagg.aggregator.clickhouse.exceptions import DedupWindowTooSmall

if TYPE_CHECKING:
    from blockagg.aggregator.config import Config

BATCHES_IN_FLIGHT: Final = 2
"""The batch whose block failed and the batch that replays it."""


@dataclass(frozen=True, slots=True)
class DedupNeed:
    """The blocks a table can receive between a block's first attempt and its replay."""

    max_offsets_per_trigger: int | None
    batches_in_flight: int = BATCHES_IN_FLIGHT

    @property
    def blocks_per_batch(self) -> int | None:
        """Blocks one micro-batch can insert into one table, over every partition of
        the job: one per message at most; ``None`` when batches are unbounded."""
        return self.max_offsets_per_trigger

    @property
    def blocks(self) -> int | None:
        """The window the table needs; ``None``: no window is enough."""
        per_batch = self.blocks_per_batch
        return None if per_batch is None else self.batches_in_flight * per_batch

    def holds(self, window: int) -> bool:
        blocks = self.blocks
        return blocks is not None and window >= blocks

    def explain(self) -> str:
        if self.max_offsets_per_trigger is None:
            return ("job.max_offsets_per_trigger is unset, so a batch, and the blocks it "
                    "seals, is unbounded")
        return (f"{self.batches_in_flight} batches in flight x job.max_offsets_per_trigger "
                f"{self.max_offsets_per_trigger}, one block per message at most since a "
                "message reaching blocks.max_rows or blocks.max_bytes seals a block alone, "
                f"= {self.blocks} blocks")


def need_for(config: Config) -> DedupNeed:
    """The need of every table the job writes: the same on every shard, for every
    table, in the driver and in every task (a pure function of the configuration)."""
    return DedupNeed(config.job.max_offsets_per_trigger)


def judge_window(table: str, setting: str, window: int, need: DedupNeed,
                 allow_small: bool) -> str | None:
    """``None`` when ``window`` holds ``need``; else raise :class:`DedupWindowTooSmall`
    naming the table, the window and the need, or, with ``allow_small`` (the
    operator's ``clickhouse.allow_small_dedup_window``), return it as a warning."""
    if need.holds(window):
        return None
    if need.blocks is None:
        message = (
            f"table {table}: {setting} = {window} cannot hold the blocks a retried block "
            f"may have to outlive ({need.explain()}): a replayed block could land twice. "
            f"Set job.max_offsets_per_trigger to at most "
            f"{window // need.batches_in_flight} (window / {need.batches_in_flight}); "
            "clickhouse.allow_small_dedup_window = true starts anyway")
    else:
        message = (
            f"table {table}: {setting} = {window} is below the {need.blocks} blocks a "
            f"retried block may have to outlive ({need.explain()}): a replayed block "
            f"could land twice. Raise it to at least {need.blocks} (the table's SETTINGS, "
            f"ALTER TABLE {table} MODIFY SETTING on 19.x+, or <merge_tree> in config.xml), "
            f"or lower job.max_offsets_per_trigger to at most "
            f"{window // need.batches_in_flight}; "
            "clickhouse.allow_small_dedup_window = true starts anyway")
    if allow_small:
        return message
    raise DedupWindowTooSmall(message)
