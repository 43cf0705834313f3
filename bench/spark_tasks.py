"""Where a Spark job's task slots spent a batch, from Spark's event log.

``python -m bench.spark_tasks EVENT_LOG [EVENT_LOG ...]`` prints, per Spark job of each
log, its tasks laid out on the slots they ran in (local mode: one executor, ``cores``
slots), and the slot time split into what the job cannot see from its own batch line:

* ``before_first``: from the job's submission to its first task's launch (planning,
  scheduling);
* ``in_tasks``: tasks' own run time (``Executor Run Time``: the Kafka read in the JVM,
  the hand-over to Python and the Python function);
* ``deserialize``: ``Executor Deserialize Time`` (the task's closure, the pickled
  function among it);
* ``between``: a slot idle between the end of one task and the launch of the next;
* ``tail``: a slot idle from its last task's end to the job's end (uneven waves).

Written with ``--conf spark.eventLog.enabled=true --conf spark.eventLog.dir=DIR``
(``bench_e2e --spark-event-log``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Task:
    launch: float
    finish: float
    run: float
    deserialize: float
    records: int
    bytes_read: int


@dataclass
class SparkJob:
    job_id: int
    submitted: float
    completed: float = 0.0
    stages: set[int] = field(default_factory=set)
    tasks: list[Task] = field(default_factory=list)

    def slot_split(self, slots: int) -> dict[str, float]:
        """The job's slot seconds split as the module docstring says; tasks are put on
        the slot that frees first, as Spark's local scheduler does."""
        tasks = sorted(self.tasks, key=lambda t: t.launch)
        free = [self.submitted] * slots
        between = 0.0
        first = min((t.launch for t in tasks), default=self.completed)
        for i, task in enumerate(tasks):
            slot = min(range(slots), key=lambda s: free[s])
            if i >= slots:
                between += max(0.0, task.launch - free[slot])
            free[slot] = max(free[slot], task.finish)
        span = self.completed - self.submitted
        return {
            "span": span,
            "slot_seconds": span * slots,
            "before_first": (first - self.submitted) * min(slots, len(tasks)),
            "in_tasks": sum(t.run for t in tasks),
            "deserialize": sum(t.deserialize for t in tasks),
            "between": between,
            "tail": sum(max(0.0, self.completed - f) for f in free),
            "tasks": float(len(tasks)),
            "records": float(sum(t.records for t in tasks)),
            "mb_read": sum(t.bytes_read for t in tasks) / 1e6,
        }


def read_jobs(path: Path) -> list[SparkJob]:
    """The Spark jobs of one event log, with their tasks (times in seconds)."""
    jobs: dict[int, SparkJob] = {}
    stage_job: dict[int, int] = {}
    with open(path) as log:
        for line in log:
            event: dict[str, Any] = json.loads(line)
            kind = event.get("Event")
            if kind == "SparkListenerJobStart":
                job = SparkJob(event["Job ID"], event["Submission Time"] / 1000)
                job.stages = set(event.get("Stage IDs", []))
                jobs[job.job_id] = job
                for stage in job.stages:
                    stage_job[stage] = job.job_id
            elif kind == "SparkListenerJobEnd":
                if event["Job ID"] in jobs:
                    jobs[event["Job ID"]].completed = event["Completion Time"] / 1000
            elif kind == "SparkListenerTaskEnd":
                job_id = stage_job.get(event["Stage ID"])
                if job_id is None:
                    continue
                info = event["Task Info"]
                metrics = event.get("Task Metrics") or {}
                inputs = metrics.get("Input Metrics") or {}
                jobs[job_id].tasks.append(Task(
                    info["Launch Time"] / 1000, info["Finish Time"] / 1000,
                    metrics.get("Executor Run Time", 0) / 1000,
                    metrics.get("Executor Deserialize Time", 0) / 1000,
                    int(inputs.get("Records Read", 0)), int(inputs.get("Bytes Read", 0))))
    return sorted(jobs.values(), key=lambda j: j.job_id)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", type=Path, nargs="+")
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--min-tasks", type=int, default=2,
                    help="leave out jobs of fewer tasks (the driver's small reads)")
    args = ap.parse_args(argv)
    keys = ("span", "slot_seconds", "before_first", "deserialize", "in_tasks", "between",
            "tail", "tasks", "records", "mb_read")
    print("| log | job | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 2) + "|")
    for path in args.logs:
        for job in read_jobs(path):
            if len(job.tasks) < args.min_tasks:
                continue
            split = job.slot_split(args.slots)
            print(f"| {path.name} | {job.job_id} | "
                  + " | ".join(f"{split[k]:.2f}" for k in keys) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
