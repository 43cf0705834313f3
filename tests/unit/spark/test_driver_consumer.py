"""The driver's watermark reads (the partitions' ends each batch, inexact starts) share
one consumer across batches: a consumer per batch cost each batch a connection to the
brokers (issue 28 item 2, ``ends_seconds`` on the batch line). A kept consumer does not
see a partition added after it read the topic's metadata, so a failed read is asked again
on a fresh consumer before it counts as failed."""

from __future__ import annotations

from typing import Any
from unittest.mock import MagicMock

import pytest

from blockagg.config import loads
from blockagg.spark.driver import Driver
from blockagg.spark.offsets import PlannedRange

CONFIG = """
[job]
checkpoint_location = "/tmp/ck"
[kafka]
"bootstrap.servers" = "x:1"
[[topics]]
name = "t"
replicas = ["ch:9000"]
"""

RANGES = {("t", 0): PlannedRange("t", 0, 10, 20), ("t", 1): PlannedRange("t", 1, 5, 9)}


class Brokers:
    """Consumers as the driver sees them: watermarks per partition, or a failure."""

    def __init__(self) -> None:
        self.made: list[MagicMock] = []
        self.down = False
        self.partitions = 2

    def consumer(self, config: Any, group: str) -> MagicMock:
        consumer = MagicMock()
        known = self.partitions  # librdkafka's metadata as the consumer first read it

        def marks(tp: Any, timeout: float) -> tuple[int, int]:
            if self.down or consumer.close.called:
                raise RuntimeError("KafkaError: _TRANSPORT")
            if tp.partition >= known:
                raise RuntimeError("KafkaError: _UNKNOWN_PARTITION")
            return 0, 30 + tp.partition

        consumer.get_watermark_offsets.side_effect = marks
        self.made.append(consumer)
        return consumer


@pytest.fixture
def brokers(monkeypatch: pytest.MonkeyPatch) -> Brokers:
    b = Brokers()
    monkeypatch.setattr("blockagg.spark.driver.make_consumer", b.consumer)
    return b


def test_one_consumer_serves_every_batchs_partition_ends(brokers: Brokers) -> None:
    d = Driver(loads(CONFIG), MagicMock(), components=MagicMock(), run_id=1)
    for _ in range(3):
        assert d.partition_ends(RANGES) == {("t", 0): 30, ("t", 1): 31}
    assert len(brokers.made) == 1 and not brokers.made[0].close.called


def test_a_failed_read_drops_the_consumer_and_the_next_batch_connects_afresh(
        brokers: Brokers) -> None:
    d = Driver(loads(CONFIG), MagicMock(), components=MagicMock(), run_id=1)
    d.partition_ends(RANGES)
    brokers.down = True
    assert d.partition_ends(RANGES) == {}  # the batch runs without the check
    assert brokers.made[0].close.called and brokers.made[1].close.called  # asked twice
    brokers.down = False
    assert d.partition_ends(RANGES) == {("t", 0): 30, ("t", 1): 31}
    assert len(brokers.made) == 3
    d.close_offsets_consumer()
    assert brokers.made[2].close.called


def test_a_partition_added_while_running_is_read_on_a_fresh_consumer(
        brokers: Brokers) -> None:
    """CI's failure at 98c5084: the kept consumer answered _UNKNOWN_PARTITION for a
    partition added after it was made, and the batch that first read it failed."""
    d = Driver(loads(CONFIG), MagicMock(), components=MagicMock(), run_id=1)
    d.partition_ends(RANGES)
    brokers.partitions = 3
    grown = {**RANGES, ("t", 2): PlannedRange("t", 2, 0, 4)}
    assert d.partition_ends(grown) == {("t", 0): 30, ("t", 1): 31, ("t", 2): 32}
    assert len(brokers.made) == 2 and brokers.made[0].close.called
    assert d.partition_ends(grown) == {("t", 0): 30, ("t", 1): 31, ("t", 2): 32}
    assert len(brokers.made) == 2  # the fresh one is kept


def test_an_added_partitions_inexact_start_is_read_on_a_fresh_consumer(
        brokers: Brokers) -> None:
    """The batch that first reads a new partition plans it from Spark's ``earliest``
    (an inexact start): its low watermark is read on the driver's consumer."""
    d = Driver(loads(CONFIG), MagicMock(), components=MagicMock(), run_id=1)
    d.partition_ends(RANGES)
    brokers.partitions = 3
    assert d._watermarks([("t", 2)]) == {("t", 2): (0, 32)}
    assert len(brokers.made) == 2


def test_the_source_waits_10ms_at_the_log_end_unless_the_user_says_otherwise() -> None:
    """Spark's source: ``kafka.fetch.max.wait.ms`` 10 (``READER_DEFAULTS``: a caught-up
    stream's tasks each waited the consumer's default 500 ms), a user's value kept, and
    the job's own options still its own."""
    d = Driver(loads(CONFIG), MagicMock(), components=MagicMock(), run_id=1)
    options = d._reader_options()
    assert options["kafka.fetch.max.wait.ms"] == "10"
    assert options["kafka.isolation.level"] == "read_committed"
    assert options["kafka.bootstrap.servers"] == "x:1"
    mine = loads(CONFIG.replace('[[topics]]', '[kafka.spark]\n"fetch.max.wait.ms" = "200"\n'
                                              '[[topics]]'))
    d = Driver(mine, MagicMock(), components=MagicMock(), run_id=1)
    assert d._reader_options()["kafka.fetch.max.wait.ms"] == "200"
