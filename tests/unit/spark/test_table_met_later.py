"""blockagg.spark.task.block_shares: every table of a batch, including one the job meets
after its start (registered while it runs) and the dead-letter table, is judged for its
deduplication window before the batch is planned, with the driver's P and refusal
(issue 25, path 4), and its share bounds the batch's blocks (path 5)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from blockagg.aggregator.clickhouse.exceptions import DedupWindowTooSmall
from blockagg.aggregator.core.model import Batch, BlockShare
from blockagg.config import loads
from blockagg.spark import components, task
from tests.unit.clickhouse.test_writer import ALLOWED, _check_script, make_writer

CONFIG = """
[job]
checkpoint_location = "/tmp/ck"
[kafka]
"bootstrap.servers" = "x:1"
[[topics]]
name = "t"
replicas = ["ch:9000"]
"""


def _script(window: int) -> dict[str, Any]:
    return _check_script("ReplicatedMergeTree", "CREATE TABLE db.t (x Int64) ENGINE = "
                         "ReplicatedMergeTree('/t', 'r') ORDER BY x SETTINGS "
                         f"replicated_deduplication_window = {window}, index_granularity = 8192")


def _batch() -> Batch:
    return Batch(topic="t", partition=0, start=0, end=1, offsets=np.array([0]),
                 table_ids=np.array([5]), row_counts=np.array([1]), sizes=np.array([10]),
                 payloads=[None], tables={5: "db.t"})


def _ctx(extra: str, partitions: int = 4) -> task.TaskContext:
    return task.TaskContext(loads(CONFIG + extra), components.DefaultComponents(), {}, 1, 1,
                            shard_partitions={"t": partitions})


@pytest.mark.parametrize("extra", ["", "[clickhouse]\nallow_small_dedup_window = true\n"])
def test_a_table_met_after_the_start_is_judged_before_its_first_insert(
        monkeypatch: pytest.MonkeyPatch, extra: str) -> None:
    """A window of 7 where 2 batches in flight x 4 partitions = 8 blocks are needed for
    one block per partition-batch: the task refuses before anything of the batch is
    committed or inserted (with allow_small_dedup_window: no guard for it); a window of
    8 gives a share of 1, 16 of 2, the guard the batch is planned with."""
    ctx = _ctx(extra)
    topic = ctx.config.topics[0]
    inserts: list[Any] = []

    def serve(window: int) -> None:
        writer = make_writer(_script(window), inserts, allow_without_coordinates=ALLOWED)
        monkeypatch.setattr(components, "describer", lambda c, t: writer)
        monkeypatch.setattr(task, "describer", lambda c, t: writer)

    serve(7)
    if extra:
        assert task.block_shares(ctx, topic, _batch()) == ()
    else:
        with pytest.raises(DedupWindowTooSmall,
                           match=r"table db\.t: replicated_deduplication_window = 7 is "
                                 r"below the 8 blocks \(2 batches in flight x 4 partitions"):
            task.block_shares(ctx, topic, _batch())
    serve(8)
    assert [c.name for c in task.live_columns(ctx.config, topic, "db.t")] == ["x"]
    assert task.block_shares(ctx, topic, _batch()) == (BlockShare(5, 8, 4),)
    serve(16)
    [share] = task.block_shares(ctx, topic, _batch())
    assert share.blocks == 2
    assert inserts == []


def test_a_table_checked_by_live_columns_is_not_asked_again_within_the_refresh(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The window read by live_columns' check serves the guard (no second query); a
    topic without P or components without dedup_windows leave the batch unguarded."""
    ctx = _ctx("")
    topic = ctx.config.topics[0]
    log: list[Any] = []
    writer = make_writer(_script(40), log, allow_without_coordinates=ALLOWED)
    monkeypatch.setattr(components, "describer", lambda c, t: writer)
    monkeypatch.setattr(task, "describer", lambda c, t: writer)
    task.live_columns(ctx.config, topic, "db.t")
    calls: list[Any] = []

    def check(*args: Any, **kw: Any) -> list[str]:
        calls.append(args)
        return []

    monkeypatch.setattr(writer, "check_tables", check)
    assert task.block_shares(ctx, topic, _batch()) == (BlockShare(5, 40, 4),)
    assert calls == []
    unknown = task.TaskContext(ctx.config, ctx.components, {}, 1, 1)
    assert task.block_shares(unknown, topic, _batch()) == ()
    bare = task.TaskContext(ctx.config, object(), {}, 1, 1,  # type: ignore[arg-type]
                            shard_partitions={"t": 4})
    assert task.block_shares(bare, topic, _batch()) == ()
