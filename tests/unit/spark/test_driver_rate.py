"""blockagg.spark.driver: the dead-letter rate window judged after each batch (no Spark)."""

from __future__ import annotations

from typing import Any
from unittest.mock import MagicMock

from blockagg.config import loads
from blockagg.rows.exceptions import DeadLetterRateExceeded
from blockagg.spark.driver import BatchSummary, Driver

CONFIG = """
[job]
checkpoint_location = "/tmp/ck"
[kafka]
"bootstrap.servers" = "x:1"
[[topics]]
name = "t"
replicas = ["ch:9000"]
[dead_letters]
table = "db.dl"
"""


def driver(extra: str) -> Driver:
    return Driver(loads(CONFIG + extra), MagicMock(), components=MagicMock(), run_id=1)


def batch(batch_id: int, messages: int, dead: int, reason: str = "bad_envelope") -> BatchSummary:
    summary = BatchSummary(batch_id)
    rep: dict[str, Any] = {"messages": messages, "rows": 0, "bytes": 0, "blocks": 0,
                           "replayed_blocks": 0, "dead_letters": {reason: dead} if dead else {},
                           "skipped": False, "commits": 1, "seconds": 0.1, "topic": "t",
                           "partition": 0}
    summary.add(rep)
    return summary


def test_one_bad_message_in_a_tiny_batch_does_not_stop_the_job() -> None:
    d = driver("max_rate = 0.1\n")  # min_messages defaults to 100
    d.check_dead_letter_rate(batch(0, 1, 1))
    d.check_dead_letter_rate(batch(1, 3, 2))
    assert d.failure is None and not d._stop_requested.is_set()


def test_rate_over_the_window_stops_the_job_with_the_reasons() -> None:
    d = driver("max_rate = 0.2\nmin_messages = 50\nwindow = 3\n")
    d.check_dead_letter_rate(batch(0, 40, 40, "unregistered_table"))  # 40 < 50 messages
    assert d.failure is None
    d.check_dead_letter_rate(batch(1, 200, 0))  # 40 of 240
    assert d.failure is None
    d.check_dead_letter_rate(batch(2, 30, 30, "unregistered_table"))  # 70 of 270 = 26%
    assert isinstance(d.failure, DeadLetterRateExceeded)
    assert d._stop_requested.is_set()
    text = str(d.failure)
    for part in ("70 of 270 messages in the last 3 batches, up to batch 2",
                 "unregistered_table (70)", "db.dl", "max_rate = 20.0%"):
        assert part in text, (part, text)


def test_max_rate_one_never_stops() -> None:
    d = driver("min_messages = 0\n")
    d.check_dead_letter_rate(batch(0, 500, 500))
    assert d.failure is None


def test_the_batch_line_says_where_the_tasks_time_went() -> None:
    summary = BatchSummary(3)
    for seconds, commits, inserts, waits in (
            (2.0, [0.1, 0.2], [("a", 1.0), ("b", 1.5)], 2), (3.0, [0.3], [("a", 2.0)], 1)):
        summary.add({"messages": 1, "rows": 1, "bytes": 1, "blocks": 1, "replayed_blocks": 0,
                     "dead_letters": {}, "skipped": False, "commits": 2, "seconds": seconds,
                     "commit_seconds": commits, "insert_seconds": inserts,
                     "quorum_waits": waits, "topic": "t", "partition": 0})
    assert summary.quorum_waits == 3
    assert summary.max_task_seconds == 3.0
    assert summary.task_seconds == 5.0
    assert round(summary.commit_seconds, 6) == 0.6
    assert summary.insert_seconds == 4.5
