"""The driver reads each batch's structure marks once, under the batch watch, and hands
them to the batch's tasks (no Spark: the batch's collect is a stand-in)."""

from __future__ import annotations

import threading
from typing import Any
from unittest.mock import MagicMock

import pytest

from blockagg.aggregator.core.metadata import DedupMode
from blockagg.config import loads
from blockagg.proto.registry import MemoryStore, RegistryCache
from blockagg.spark.driver import Driver
from blockagg.spark.exceptions import BatchTimedOut
from blockagg.spark.offsets import PlannedRange
from blockagg.spark.watch import Watchdog
from tests.unit.spark.test_batch_watch import CONFIG as WATCH_CONFIG

CONFIG = WATCH_CONFIG + '[[topics]]\nname = "u"\nreplicas = ["ch:9000"]\n'
RANGES = {("t", 0): PlannedRange("t", 0, 0, 10), ("t", 1): PlannedRange("t", 1, 5, 9),
          ("u", 0): PlannedRange("u", 0, 3, 3)}


class Shard:
    """The driver's components: a content-hash shard whose mark ``mark()`` gives."""

    def __init__(self, mark: Any) -> None:
        self.asked: list[str] = []
        self._mark = mark

    def registry(self, config: Any) -> RegistryCache:
        return RegistryCache(MemoryStore())

    def dedup_mode(self, config: Any, topic: Any) -> int:
        return DedupMode.BLOCK_HASH

    def structure_mark(self, config: Any, topic: Any, tables: Any) -> int:
        self.asked.append(topic.name)
        return int(self._mark())


class Submitted(Exception):
    """The batch's tasks were submitted (the stand-in collect ends the batch there)."""


def _driver(components: Any, timeout: str = "60s") -> tuple[Driver, Any]:
    df = MagicMock()
    df.select.return_value.mapInArrow.return_value.collect.side_effect = Submitted
    spark = MagicMock()
    spark.sparkContext.statusTracker.return_value.getActiveStageIds.return_value = []
    driver = Driver(loads(CONFIG.format(timeout=timeout)), spark, components=components,
                    run_id=1)
    driver.partition_ends = lambda ranges: {}  # type: ignore[method-assign]
    driver.watchdog = Watchdog(driver.watch, driver.warn_slow_batch,
                               driver.cancel_overrun_batch, tick=0.02)
    return driver, df


def test_each_topic_with_rows_has_its_mark_read_once_for_all_its_tasks() -> None:
    shard = Shard(lambda: 77)
    driver, df = _driver(shard)
    with pytest.raises(Submitted):
        driver.run_ranges(df, dict(RANGES), 4)
    task_function = df.select.return_value.mapInArrow.call_args.args[0]
    ctx = task_function.args[0]
    assert ctx.structure_marks == {"t": 77}, "u has no rows in the batch: no mark"
    assert shard.asked == ["t"]


def test_a_mark_read_that_hangs_past_the_batch_timeout_fails_the_batch() -> None:
    """The read runs under the batch watch: a replica that stops answering holds the batch
    no longer than ``job.batch_timeout``, and no task is submitted after it."""
    released = threading.Event()
    shard = Shard(lambda: released.wait(30) and 77)
    driver, df = _driver(shard, timeout="0.3s")
    driver.watchdog.start()
    try:
        with pytest.raises(BatchTimedOut, match=r"did not finish within job\.batch_timeout"):
            driver.run_ranges(df, dict(RANGES), 5)
        assert shard.asked == ["t"]
        assert not released.is_set(), "the batch failed while the read still hung"
    finally:
        driver.watchdog.stop()
        released.set()
    assert not df.select.return_value.mapInArrow.called
