"""A hook fault that does not fire is detected, explained and not counted (no stack).

The mixed run of 2026-11-24 (docs/RELIABILITY.md) reported 4 of its 5 ``executor_stall``
faults as never fired. They had fired: every stall claims ``fired-0`` and writes
``stalled-0.json``, and the driver waited for *more* records than before arming, so from
the second stall on it never saw one, never killed the driver nor resumed the worker, and
the worker, stopped with SIGSTOP, held its batch until the job was next restarted (20
minutes in which no other hook could fire either). These tests pin the fix with real
processes stopping themselves through :meth:`hooks.Plan.stall`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.faults import driver, hooks
from tests.faults.report import fault_table, unfired_lines

REPO = Path(__file__).resolve().parents[2]


def _stall_in_child(folder: Path, step: str) -> int:
    """A process that takes ``step`` as a task would (:meth:`hooks.Plan.stall`); returns
    its pid once it has stopped itself."""
    code = ("import sys; from pathlib import Path; import tests.faults.hooks as h; "
            "h._in_spark_task = lambda: True; "
            f"h.Plan(Path(sys.argv[1])).stall({step!r}, {{'topic': 't', 'partition': 0}})")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder)], env=env, cwd=REPO)
    _, status = os.waitpid(proc.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), f"the child did not stall (status {status})"
    return proc.pid


def _end(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def test_a_second_stall_is_seen(tmp_path: Path) -> None:
    """Arming forgets the previous arming's stall record, so the next stall's record is
    the only one (before the fix the stale ``stalled-0.json`` stayed, and the driver,
    counting records, never saw the second stall fire)."""
    hooks.arm(tmp_path, "stall_after_commit")
    first = _stall_in_child(tmp_path, "stall_after_commit")
    try:
        assert [r["pid"] for r in hooks.stalled(tmp_path)] == [first]
    finally:
        _end(first)
    hooks.arm(tmp_path, "stall_before_commit")
    assert hooks.stalled(tmp_path) == []
    second = _stall_in_child(tmp_path, "stall_before_commit")
    try:
        (record,) = hooks.stalled(tmp_path)
        assert record["pid"] == second and record["step"] == "stall_before_commit"
    finally:
        _end(second)


LOG_BEFORE = """
===== start 10 04:32:01 =====
04:32:00 INFO    blockagg.job: batch kind="stream" batch=0 run="ac2a" partitions=4
"""
LOG_STUCK = ("[Stage 0:>          (0 + 2) / 4][Stage 0:=====>     (1 + 2) / 4]"
             "[Stage 0:==========>          (3 + 1) / 4]")
LOG_BATCHES = """
[Stage 0:>          (0 + 1) / 1]                04:52:33 INFO    blockagg.job: batch \
kind="recovery" batch=0 run="3745" partitions=1
04:52:43 INFO    blockagg.job: batch kind="stream" batch=0 run="3745" partitions=4
"""


def test_progress_tells_a_stuck_batch_from_an_idle_pipeline() -> None:
    stuck = driver.Progress.of(LOG_BEFORE, LOG_STUCK, alive=True)
    assert (stuck.batches, stuck.last_batch, stuck.starts, stuck.running_stage) == (
        0, "04:32:00", 0, "3 + 1 / 4")
    why = stuck.why_unfired("stall_after_commit", 180)
    assert why.startswith("no batch completed in the 180 s window (STUCK: a batch was in "
                          "progress, its stage at 3 + 1 / 4 tasks")
    assert "last batch at 04:32:00" in why
    # Later windows of the same stuck batch log nothing at all: still stuck.
    later = driver.Progress.of(LOG_BEFORE + LOG_STUCK, "", alive=True)
    assert later.running_stage == "3 + 1 / 4"
    idle = driver.Progress.of(LOG_BEFORE + LOG_STUCK + LOG_BATCHES, "", alive=True)
    assert idle.running_stage is None
    assert "(idle: no new messages reached the job; last batch at 04:52:43)" in (
        idle.why_unfired("commit_fails", 120))
    moving = driver.Progress.of(LOG_BEFORE, "===== start 11 04:52:11 =====\n" + LOG_BATCHES,
                                alive=True)
    assert (moving.batches, moving.last_batch, moving.starts) == (2, "04:52:43", 1)
    assert "2 batch(es) completed" in moving.why_unfired("between_blocks", 120)


@dataclass
class _Job:
    """The part of :class:`driver.Job` that :func:`driver.armed_fault` uses."""

    hook_dir: Path
    grows: str
    """What the job logs once the hook is armed."""
    on_arm: Any = None
    log_text: str = LOG_BEFORE
    armed: list[str] = field(default_factory=list)

    def log_mark(self) -> int:
        return len(self.log_text)

    def progress(self, mark: int) -> driver.Progress:
        return driver.Progress.of(self.log_text[:mark], self.log_text[mark:], True)

    def arm(self, step: str) -> None:
        hooks.arm(self.hook_dir, step)
        self.armed.append(step)
        self.log_text += self.grows
        if self.on_arm:
            self.on_arm()


@pytest.fixture
def no_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(driver, "_wait", lambda cond, timeout, poll=0.5: bool(cond()))


def test_a_hook_that_never_fires_says_the_pipeline_was_stuck(tmp_path: Path,
                                                             no_waiting: None) -> None:
    job = _Job(tmp_path, LOG_STUCK)
    info = driver.armed_fault(job, "after_insert",  # type: ignore[arg-type]
                              lambda: hooks.fired(tmp_path) >= 1, 120)
    assert job.armed == ["after_insert"] and info["fired"] is False
    assert info["unfired"].startswith("no batch completed in the 120 s window (STUCK")


def test_a_hook_that_fires_after_the_window_counts_as_fired(tmp_path: Path,
                                                           no_waiting: None) -> None:
    """Claimed as the wait ended, before the disarm: fired, so the driver goes on to
    resume the stalled worker instead of leaving it stopped."""
    job = _Job(tmp_path, LOG_BATCHES, on_arm=lambda: hooks.Plan(tmp_path).claim())
    seen = iter([False])
    info = driver.armed_fault(job, "stall_after_commit",  # type: ignore[arg-type]
                              lambda: next(seen, True), 180)
    assert info == {"fired": True}
    job.on_arm = None
    info = driver.armed_fault(job, "after_insert",  # type: ignore[arg-type]
                              lambda: hooks.fired(tmp_path) >= 1, 120)
    assert info["fired"] is False
    assert info["unfired"].startswith("2 batch(es) completed in the 120 s window")


def test_unfired_faults_are_counted_apart() -> None:
    events = [{"n": 1, "kind": "lost_ack", "recover_s": 2.0, "job_starts": 0},
              {"n": 2, "kind": "executor_stall", "step": "stall_after_commit", "fired": False,
               "unfired": "no batch completed in the 180 s window", "recover_s": 0.3,
               "job_starts": 0}]
    rows = {line.split(" | ")[0].strip("| "): line for line in fault_table(events)}
    assert rows["executor_stall"] == "| executor_stall | 0 | 1 | 0 | - | 0 |"
    assert rows["all"] == "| all | 1 | 1 | 0 | | 0 |"
    lines = unfired_lines(events)
    assert lines[0].startswith("**Faults armed but not fired: 1**")
    assert "fault 2 executor_stall stall_after_commit: no batch completed" in lines[1]
    outcome = driver.Outcome()
    outcome.faults["lost_ack"] += 1
    outcome.unfired["executor_stall"] += 1
    assert "ARMED BUT NOT FIRED: 1 (executor_stall 1)" in driver.unfired_line(outcome)
