"""blockagg.spark.driver: ``blocks.min_rows`` through the driver (no Spark): the
batches' figures feed the sizing, the first sizing is applied by restarting the query
with Spark's ``minOffsetsPerTrigger``/``maxTriggerDelay``, batches Spark starts during
the restart are refused before reading anything, and with ``min_rows = 0`` nothing
changes."""

from __future__ import annotations

from typing import Any
from unittest.mock import MagicMock

import pytest

from blockagg.config import loads
from blockagg.spark.driver import BatchSummary, Driver
from blockagg.spark.exceptions import StoppedBeforeBatch
from blockagg.spark.sizing import CALIBRATION_BATCHES

CONFIG = """
[job]
checkpoint_location = "/tmp/ck"
trigger_interval = "1s"
[kafka]
"bootstrap.servers" = "x:1"
[[topics]]
name = "t"
replicas = ["ch:9000"]
"""


def driver(blocks: str) -> Driver:
    d = Driver(loads(CONFIG + "[blocks]\n" + blocks), MagicMock(), components=MagicMock(),
               run_id=1)
    d.query = MagicMock()
    d.query.exception.return_value = None
    d.query.status = {"isTriggerActive": False}
    return d


def summary(batch_id: int, offsets: int, block_rows: list[int]) -> BatchSummary:
    s = BatchSummary(batch_id)
    rep: dict[str, Any] = {"messages": offsets, "rows": sum(block_rows), "bytes": 0,
                           "blocks": len(block_rows), "replayed_blocks": 0,
                           "dead_letters": {}, "skipped": False, "commits": 2,
                           "seconds": 0.5, "topic": "t", "partition": 0,
                           "block_rows": block_rows}
    s.add(rep)
    s.offsets, s.seconds = offsets, 2.0
    return s


def reader_options(d: Driver) -> dict[str, str]:
    reader = d.spark.readStream.format.return_value
    options: dict[str, str] = {}
    for call in reader.mock_calls:
        if call[0].endswith("option"):
            options[call.args[0]] = call.args[1]
    return options


def test_calibration_batches_then_a_restart_with_sparks_hold_options() -> None:
    d = driver('min_rows = 1000\nmax_latency = "30s"\n')
    for i in range(CALIBRATION_BATCHES):
        d.batches.append(summary(i, 2_000, [100] * 20))
        d.plan_sizing()
        assert (d._resize_to is None) == (i < CALIBRATION_BATCHES - 1)
    # Spark starts the next batch at once when one ends: refused until the restart
    with pytest.raises(StoppedBeforeBatch, match="query restarts"):
        d.on_batch(MagicMock(), 3)
    old = d.query
    d._apply_sizing()
    old.stop.assert_called_once()
    assert d.restarts == 1 and d.sizing.min_offsets == 20_000 and d._resize_to is None
    assert not d._restarting
    options = reader_options(d)
    # 20 table-partitions of 100 rows per 2000 offsets: 1000-row blocks at 20 000
    assert options["minOffsetsPerTrigger"] == "20000"
    assert options["maxTriggerDelay"] == "27000ms"
    # the same figures call for no further restart
    d.batches.append(summary(9, 20_000, [1000] * 20))
    d.plan_sizing()
    assert d._resize_to is None


def test_off_by_default_no_hold_and_no_restart() -> None:
    d = driver("")
    for i in range(10):
        d.batches.append(summary(i, 2_000, [100] * 20))
        d.plan_sizing()
    assert d._resize_to is None
    d.start_query("latest")
    options = reader_options(d)
    assert "minOffsetsPerTrigger" not in options and "maxTriggerDelay" not in options


def test_a_restart_keeps_a_failure_of_the_old_query() -> None:
    d = driver("min_rows = 1000\n")
    for i in range(CALIBRATION_BATCHES):
        d.batches.append(summary(i, 2_000, [100] * 20))
        d.plan_sizing()
    d.query.exception.return_value = RuntimeError("OffsetGap: boom")
    d._apply_sizing()
    assert isinstance(d.failure, RuntimeError) and d.restarts == 0
