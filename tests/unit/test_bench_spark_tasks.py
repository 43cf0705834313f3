"""``bench.spark_tasks``: a Spark job's slot time split from its event log. No Spark:
the event log is written here as Spark writes it (one JSON event a line)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.bench_curves import slot_figures
from bench.spark_tasks import read_jobs


def write_log(path: Path, submitted_ms: int, completed_ms: int,
              tasks: list[tuple[int, int, int]]) -> Path:
    """A job of one stage whose tasks are (launch ms, finish ms, run ms), and a
    one-task job before it (the driver's own small read) that the split leaves out."""
    events = [
        {"Event": "SparkListenerJobStart", "Job ID": 0, "Submission Time": 0,
         "Stage IDs": [0]},
        {"Event": "SparkListenerTaskEnd", "Stage ID": 0,
         "Task Info": {"Launch Time": 1, "Finish Time": 2},
         "Task Metrics": {"Executor Run Time": 1}},
        {"Event": "SparkListenerJobEnd", "Job ID": 0, "Completion Time": 3},
        {"Event": "SparkListenerJobStart", "Job ID": 1, "Submission Time": submitted_ms,
         "Stage IDs": [1]},
    ]
    for launch, finish, run in tasks:
        events.append({"Event": "SparkListenerTaskEnd", "Stage ID": 1,
                       "Task Info": {"Launch Time": launch, "Finish Time": finish},
                       "Task Metrics": {"Executor Run Time": run,
                                        "Executor Deserialize Time": 10,
                                        "Input Metrics": {"Records Read": 100,
                                                          "Bytes Read": 0}}})
    events.append({"Event": "SparkListenerJobEnd", "Job ID": 1,
                   "Completion Time": completed_ms})
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def test_two_slots_four_tasks_split_into_before_between_and_tail(tmp_path: Path) -> None:
    # slot A: [1000, 3000) then [3500, 5000); slot B: [1200, 2000) then [2100, 6000)
    log = write_log(tmp_path / "app", 0, 6000,
                    [(1000, 3000, 1900), (1200, 2000, 700), (2100, 6000, 3800),
                     (3500, 5000, 1400)])
    jobs = read_jobs(log)
    assert [len(j.tasks) for j in jobs] == [1, 4]
    split = jobs[1].slot_split(2)
    assert split["span"] == pytest.approx(6.0)
    assert split["slot_seconds"] == pytest.approx(12.0)
    assert split["before_first"] == pytest.approx(2.0)
    assert split["in_tasks"] == pytest.approx(7.8)
    assert split["between"] == pytest.approx(0.1 + 0.5)
    assert split["tail"] == pytest.approx(1.0)
    assert split["records"] == 400


def test_slot_figures_take_the_largest_job_and_nothing_without_a_log(tmp_path: Path) -> None:
    assert slot_figures(tmp_path / "missing", 2) == {}
    events = tmp_path / "run.events" / "local-1"
    events.parent.mkdir()
    write_log(events, 0, 6000, [(1000, 3000, 1900), (1200, 2000, 700)])
    assert slot_figures(tmp_path / "run.events", 2)["tasks"] == 2
