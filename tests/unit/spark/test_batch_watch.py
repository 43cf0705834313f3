"""blockagg.spark.watch: a batch whose task never finishes is logged, then failed with one
line, instead of holding the job silently (no Spark: the batch's collect is a stand-in
that blocks until its jobs are cancelled, as a task in a stopped Python worker does)."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace
from typing import Any
from unittest.mock import MagicMock

import pytest

from blockagg.config import loads
from blockagg.spark.driver import Driver
from blockagg.spark.exceptions import BatchTimedOut
from blockagg.spark.offsets import PlannedRange
from blockagg.spark.watch import BatchWatch, Watchdog, job_times, stage_progress

CONFIG = """
[job]
checkpoint_location = "/tmp/ck"
batch_timeout = "{timeout}"
[kafka]
"bootstrap.servers" = "x:1"
[[topics]]
name = "t"
replicas = ["ch:9000"]
"""


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_slow_batch_is_warned_about_every_interval_then_timed_out_once() -> None:
    clock = Clock()
    watch = BatchWatch(timeout=300, warn_every=60, clock=clock)
    assert watch.due() is None  # no batch
    with watch.watching(7, "stream", ["t[0]", "t[1]"]):
        verdicts = []
        for clock.now in (10, 59, 60, 61, 119, 125, 200, 299):
            verdicts.append(watch.due())
        assert verdicts == [None, None, "warn", None, None, "warn", "warn", "warn"]
        clock.now = 300
        assert watch.due() == "timeout"
        watch.timed_out = watch.timeout_error("stage 3: 1 of 2 tasks done, 1 running")
        assert watch.due() is None  # once
        assert watch.timed_out.startswith(
            "batch 7 (stream, partitions t[0], t[1]) did not finish within "
            "job.batch_timeout (300s): stage 3: 1 of 2 tasks done, 1 running; its jobs were "
            "cancelled")
    assert watch.due() is None and watch.running is None
    with watch.watching(8, "stream", ["t[0]"]):
        assert watch.timed_out is None  # a new batch starts clean
        clock.now = 359
        assert watch.due() is None


def test_stage_progress_names_the_running_tasks() -> None:
    spark = MagicMock()
    tracker = spark.sparkContext.statusTracker.return_value
    tracker.getActiveStageIds.return_value = [4]
    tracker.getStageInfo.return_value = MagicMock(numTasks=4, numActiveTasks=1,
                                                  numCompletedTasks=3, numFailedTasks=0)
    assert stage_progress(spark) == "stage 4: 3 of 4 tasks done, 1 running"
    tracker.getActiveStageIds.side_effect = RuntimeError("gone")
    assert stage_progress(spark) is None


def _stuck_driver() -> tuple[Driver, Any]:
    """A driver whose batch's collect blocks until its jobs are cancelled."""
    spark = MagicMock()
    cancelled = threading.Event()
    spark.sparkContext.cancelAllJobs.side_effect = cancelled.set
    spark.sparkContext.statusTracker.return_value.getActiveStageIds.return_value = []

    def collect() -> list[Any]:
        if not cancelled.wait(60):
            raise AssertionError("the batch was never cancelled")
        raise RuntimeError("Job 3 cancelled part of cancelled job group")

    df = MagicMock()
    df.select.return_value.mapInArrow.return_value.collect.side_effect = collect
    driver = Driver(loads(CONFIG.format(timeout="0.3s")), spark, components=MagicMock(),
                    run_id=1)
    driver.watch.warn_every = 0.1
    driver.watchdog = Watchdog(driver.watch, driver.warn_slow_batch,
                               driver.cancel_overrun_batch, tick=0.02)
    driver.partition_ends = lambda ranges: {}  # type: ignore[method-assign]
    return driver, df


def test_a_batch_whose_task_never_finishes_fails_with_one_line(
        caplog: pytest.LogCaptureFixture) -> None:
    driver, df = _stuck_driver()
    ranges = {("t", 0): PlannedRange("t", 0, 0, 10), ("t", 1): PlannedRange("t", 1, 5, 9)}
    driver.watchdog.start()
    try:
        with caplog.at_level(logging.INFO, logger="blockagg"), \
                pytest.raises(BatchTimedOut) as raised:
            driver.run_ranges(df, ranges, 3)
    finally:
        driver.watchdog.stop()
    text = str(raised.value)
    assert text.startswith("batch 3 (stream, partitions t[0], t[1]) did not finish within "
                           "job.batch_timeout (0.3s)")
    assert "the next start replays the batch" in text
    warnings = [r for r in caplog.records if r.getMessage() == "batch still running"]
    assert warnings and warnings[0].levelno == logging.WARNING
    fields = warnings[0].blockagg_fields  # type: ignore[attr-defined]
    assert fields["batch"] == 3 and fields["partitions"] == ["t[0]", "t[1]"]
    assert any(r.getMessage() == "batch timeout: cancelling it" for r in caplog.records)


def test_batch_timeout_is_configured_and_bounded() -> None:
    assert loads(CONFIG.replace('batch_timeout = "{timeout}"\n', "")).job.batch_timeout == 1800
    assert loads(CONFIG.format(timeout="10min")).job.batch_timeout == 600
    with pytest.raises(Exception, match="batch_timeout: must be greater than 0"):
        loads(CONFIG.format(timeout="0s"))


class _Option:
    def __init__(self, ms: int | None) -> None:
        self.ms = ms

    def isDefined(self) -> bool:  # py4j's Scala Option
        return self.ms is not None

    def get(self) -> Any:
        return SimpleNamespace(getTime=lambda: self.ms)


class _Seq(list[Any]):
    def size(self) -> int:
        return len(self)

    def apply(self, k: int) -> Any:
        return self[k]


def _spark(jobs: dict[int, tuple[int, list[int]]], stages: dict[int, int | None],
           group: str | None = "run-1") -> Any:
    """Spark's status tracker and store as py4j shows them: job -> (submitted ms,
    stage ids), stage -> first task launched ms."""
    store = SimpleNamespace(
        job=lambda i: SimpleNamespace(submissionTime=lambda: _Option(jobs[i][0]),
                                      stageIds=lambda: _Seq(jobs[i][1])),
        lastStageAttempt=lambda s: SimpleNamespace(
            firstTaskLaunchedTime=lambda: _Option(stages[s])))
    tracker = SimpleNamespace(
        getJobIdsForGroup=lambda g: sorted(jobs) if g == group else [])
    sc = SimpleNamespace(statusTracker=lambda: tracker,
                         getLocalProperty=lambda key: group,
                         _jsc=SimpleNamespace(sc=lambda: SimpleNamespace(
                             statusStore=lambda: store)))
    return SimpleNamespace(sparkContext=sc)


def test_job_times_are_the_last_jobs_submission_and_first_task_launch() -> None:
    spark = _spark({3: (1_000, [5]), 4: (10_500, [6, 7])}, {5: 1_200, 6: None, 7: 10_900})
    assert job_times(spark) == (10.5, 10.9)


def test_job_times_never_raise_when_spark_cannot_tell() -> None:
    assert job_times(_spark({}, {})) is None
    assert job_times(_spark({4: (10_500, [6])}, {6: None})) is None  # no task launched
    assert job_times(SimpleNamespace()) is None
