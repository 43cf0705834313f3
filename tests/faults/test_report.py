"""tests.faults.report: the RELIABILITY.md tables from a run's summary (no stack)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.faults.report import check_table, fault_table, hang_lines, main, shard_table

EVENTS: list[dict[str, Any]] = [
    {"kind": "driver_kill9", "recover_s": 30.0, "job_starts": 1},
    {"kind": "driver_kill9", "recover_s": 20.0, "job_starts": 1},
    {"kind": "lost_ack", "recover_s": 2.0, "job_starts": 0},
    {"kind": "lost_ack", "recover_s": None, "job_starts": 0},
    {"kind": "leader_kill9", "recover_s": 4.0, "job_starts": 0},
]
CHECK = {"rows_expected": 1000, "rows_stored": 1000, "duplicates": 0, "missing": 0,
         "dead_expected": 10, "dead_stored": {"0": 10, "1": 10}, "verify": 0, "audit": 0,
         "ok": True}


def test_fault_table_counts_restarts_and_unsettled_faults() -> None:
    rows = {line.split(" | ")[0].strip("| "): line for line in fault_table(EVENTS)}
    assert rows["driver_kill9"] == "| driver_kill9 | 2 | 0 | 2 | 25.0 / 30.0 / 30.0 | 0 |"
    assert rows["lost_ack"] == "| lost_ack | 2 | 0 | 0 | 2.0 / 2.0 / 2.0 | 1 |"
    assert rows["zookeeper_down"] == "| zookeeper_down | 0 | 0 | 0 | - | 0 |"
    assert rows["leader_kill9"] == "| leader_kill9 | 1 | 0 | 0 | 4.0 / 4.0 / 4.0 | 0 |"
    assert rows["rolling_restart"] == "| rolling_restart | 0 | 0 | 0 | - | 0 |"
    assert rows["all"] == "| all | 5 | 0 | 2 | | 1 |"


def test_check_table_lists_interim_then_final() -> None:
    summary = {"interim_checks": [{"after_faults": 100, "messages_produced": 5, **CHECK}],
               "check": CHECK}
    lines = check_table(summary)
    assert lines[2].startswith("| 100 | 5 | 1,000 | 1,000 | 0 | 0 | 10 / 10 of 10 |")
    assert lines[3].startswith("| final |") and lines[3].endswith("| 0 | 0 | True |")


def test_a_skipped_check_is_a_row_that_says_why() -> None:
    summary = {"interim_checks": [
        {"after_faults": 500, "messages_produced": 7, "skipped": "not caught up within 900 s"},
        {"after_faults": 600, "messages_produced": 9, **CHECK},
        {"after_faults": 700, "messages_produced": 11, "skipped": "not caught up within 900 s",
         "duplicates": 353}]}
    lines = check_table(summary)
    assert lines[2] == "| 500 | 7 | skipped: not caught up within 900 s | | | | | | | |"
    assert lines[3].startswith("| 600 | 9 | 1,000 |")
    assert lines[4] == ("| 700 | 11 | skipped: not caught up within 900 s | | 353 | | | | | "
                        "False |")


def test_a_check_made_on_resume_is_marked_and_the_resume_listed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps({
        "events": EVENTS, "seconds": 100.0, "check": None,
        "interim_checks": [{"after_faults": 4, "resumed": True, **CHECK}],
        "resumes": [{"after_faults": 4, "at_s": 61.2, "commit": "abc1234",
                     "messages_in_topic": 1010, "restored_s": 2.0}]}))
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "| 4 (resumed) |  | 1,000 |" in out
    assert "resumed after 4 faults (61 s into the run) at commit abc1234: 1,010 messages" in out


def test_main_reads_a_run_in_progress(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"events": EVENTS, "seconds": 61.2, "check": None}))
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("5 faults in 61 s") and "| lost_ack | 2 |" in out


def test_each_shard_is_a_row_at_each_check() -> None:
    shards = {"s1": {"rows_expected": 600, "rows_stored": 600, "duplicates": 0, "missing": 0},
              "s2": {"rows_expected": 400, "rows_stored": 399, "duplicates": 0, "missing": 1}}
    summary = {"interim_checks": [{"after_faults": 100, **CHECK, "shards": shards}],
               "check": {**CHECK, "shards": shards}}
    lines = shard_table(summary)
    assert lines[2] == "| 100 | s1 | 600 | 600 | 0 | 0 |"
    assert lines[3] == "| 100 | s2 | 400 | 399 | 0 | 1 |"
    assert lines[5] == "| final | s2 | 400 | 399 | 0 | 1 |"
    assert shard_table({"check": CHECK}) == []


def test_the_hanging_transactions_are_counted_from_the_job_log(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_text(
        "06:00:08 INFO    blockagg.job: configuration pid=1 config={}\n"
        "06:00:09 WARNING blockagg.metadata: healing a hanging transaction group=g\n"
        "06:01:00 INFO    blockagg.job: configuration pid=2 config={}\n"
        "06:01:01 ERROR   blockagg.metadata: healing failed error=TimeoutException\n"
        "blockagg.aggregator.kafka.exceptions.MetadataUnstable: the group's commits ...\n")
    assert hang_lines(log) == [
        "Hanging transactions on the metadata group, over 2 job starts (job.log): met 1, "
        "healing failed 1, start refused as unstable 1 (log lines)."]
