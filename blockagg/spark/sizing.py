"""Micro-batch sizing for large blocks (``blocks.min_rows``): pure policy.

Every micro-batch ends in a forced flush, so a table-partition's block holds what that
partition received for that table during one batch: at 10k rows/s, a 10 s trigger and
800 table-partitions, ~125 rows, one ClickHouse part each. The lever is the batch's
size: Spark's Kafka source holds a trigger while fewer than ``minOffsetsPerTrigger``
offsets are available over all partitions, for at most ``maxTriggerDelay`` since the
last batch (Spark 3.3+, SPARK-35312; both fixed for the life of a query). This module
decides both from the figures of the last batches, so that the chosen percentile of
the blocks' rows reaches ``blocks.min_rows`` while no message waits longer than
``blocks.max_latency``:

- ``minOffsetsPerTrigger``: rows per block grow in proportion to the offsets a batch
  takes (the table-partitions it touches stay the same), so each recent batch with
  blocks gives an estimate ``offsets x min_rows / percentile(block rows)``; the median
  of the estimates, capped by ``job.max_offsets_per_trigger`` (Spark refuses a minimum
  above the maximum).
- ``maxTriggerDelay``: ``max_latency - trigger_interval - p90(batch seconds)``: a
  message arriving just after a batch was planned waits at most the delay, one trigger
  tick, and its batch's own run. With no room left (slow batches), nothing is held.

A backlog is caught up at full speed: the minimum only holds a trigger that finds fewer
offsets than it, and a batch takes everything available up to the maximum.

Replays never depend on this: the blocks of a committed intent are rebuilt from its
metadata (``aggregator.core.protocol``), and Spark re-runs a planned batch from its
offset log with the range it recorded, whatever the options of the new query
(invariant 3, deterministic blocks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

HISTORY: Final = 20
"""Batches the estimate looks back over."""
CALIBRATION_BATCHES: Final = 3
"""Batches with new blocks observed before the first sizing is applied."""
RESIZE_FACTOR: Final = 2.0
"""A running sizing is replaced only when the new minimum differs by more than this
factor: each change restarts the streaming query (a few seconds without batches)."""
RESIZE_INTERVAL_S: Final = 600.0
"""... and at most once per this many seconds after the first (calibration) change."""


@dataclass(frozen=True, slots=True)
class BatchFigures:
    """What one streaming batch formed: the offsets it planned over all partitions,
    the rows of each block it inserted, and its wall time."""

    offsets: int
    block_rows: tuple[int, ...]
    seconds: float
    warm: bool = True
    """No task of the batch started a Python worker. A query's first batch usually
    does: it pays the workers' start (imports, first reads of the shard) once, which
    the batches after it do not."""


@dataclass(frozen=True, slots=True)
class SizingGoal:
    """The user's ask (``[blocks]``) and the query's fixed settings (``[job]``)."""

    min_rows: int
    max_latency: float
    trigger_interval: float
    percentile: float = 0.5
    max_offsets_per_trigger: int | None = None


@dataclass(frozen=True, slots=True)
class Sizing:
    """The Kafka source's ``minOffsetsPerTrigger`` (None: hold nothing) and
    ``maxTriggerDelay`` (seconds), with why."""

    min_offsets: int | None
    max_trigger_delay: float
    reason: str

    def source_options(self) -> dict[str, str]:
        """The Spark Kafka source options of this sizing (none when nothing is held)."""
        if self.min_offsets is None:
            return {}
        return {"minOffsetsPerTrigger": str(self.min_offsets),
                "maxTriggerDelay": f"{max(1, round(self.max_trigger_delay * 1000))}ms"}


OFF: Final = Sizing(None, 0.0, "blocks.min_rows = 0")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0 < q <= 1) of ``values``, nearest rank (a row count that
    some block actually had)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


def trigger_delay(goal: SizingGoal, history: Sequence[BatchFigures]) -> float:
    """The longest a trigger may be held so that a message still lands within
    ``goal.max_latency``: the bound less one trigger tick and the p90 batch time, of the
    warm batches when there are any. A cold batch's start-up is paid once per worker,
    not by every held trigger: counted, a loaded machine's 5.6 s first batch left a
    1.9 s delay for the query's life, where its warm batches took 0.7-1.3 s."""
    recent_all = history[-HISTORY:]
    recent = [b.seconds for b in recent_all if b.warm] or [b.seconds for b in recent_all]
    batch = percentile(recent, 0.9) if recent else 0.0
    return max(0.0, goal.max_latency - goal.trigger_interval - batch)


def decide(goal: SizingGoal, history: Sequence[BatchFigures]) -> Sizing:
    """The sizing for the next query, from the last batches' figures (oldest first)."""
    if goal.min_rows <= 0:
        return OFF
    delay = trigger_delay(goal, history)
    if delay < goal.trigger_interval:
        return Sizing(None, delay, f"no room to wait: batches take too long for "
                                   f"blocks.max_latency = {goal.max_latency:g}s")
    estimates = [
        b.offsets * goal.min_rows / percentile(b.block_rows, goal.percentile)
        for b in history[-HISTORY:] if b.block_rows and b.offsets > 0
    ]
    if len(estimates) < CALIBRATION_BATCHES:
        return Sizing(None, delay, f"calibrating: {len(estimates)} of "
                                   f"{CALIBRATION_BATCHES} batches with blocks seen")
    needed = max(1, math.ceil(percentile(estimates, 0.5)))
    cap = goal.max_offsets_per_trigger
    if cap is not None and needed > cap:
        return Sizing(cap, delay, f"{needed} offsets needed, capped by "
                                  f"job.max_offsets_per_trigger = {cap}")
    return Sizing(needed, delay, f"p{round(goal.percentile * 100)} of block rows reaches "
                                 f"{goal.min_rows} at {needed} offsets per batch")


def should_apply(current: Sizing, proposed: Sizing, seconds_since_change: float | None
                 ) -> bool:
    """Whether the driver restarts the query with ``proposed``: the first sizing
    (``seconds_since_change`` None) as soon as there is one, then only a change of the
    minimum by more than :data:`RESIZE_FACTOR`, at most every :data:`RESIZE_INTERVAL_S`."""
    if proposed.min_offsets == current.min_offsets:
        return False
    if seconds_since_change is None:
        return proposed.min_offsets is not None
    if seconds_since_change < RESIZE_INTERVAL_S:
        return False
    if current.min_offsets is None or proposed.min_offsets is None:
        return True
    ratio = proposed.min_offsets / current.min_offsets
    return ratio > RESIZE_FACTOR or ratio < 1 / RESIZE_FACTOR
