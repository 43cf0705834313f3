"""The driver's watch over the running batch: no batch waits silently or for ever.

Spark waits for a task as long as its executor lives. A task whose Python worker is
stopped (SIGSTOP, a debugger, a frozen VM), hung in a system call, or stuck between two
calls that each have a timeout holds its batch, and every later one, and nothing is
logged: the job looks healthy and is idle. A mixed fault run lost 20 minutes to one such
task (``docs/RELIABILITY.md``).

So the driver watches each batch it runs (stream batches and the recovery batch):

* past :data:`SLOW_BATCH_WARN_S`, and again every as long, one WARN line names the
  batch, its partitions, how long it has run and Spark's task progress (``3 of 4 tasks
  done, 1 running``): the task's own lines (ClickHouse and Kafka retries, each with its
  table or partition) say what it waits for; a task with no line is stuck in its worker;
* past ``job.batch_timeout`` the batch's jobs are cancelled and the batch fails with one
  line that names it and what to do, so the job exits 1 for its supervisor to restart.
  That is safe: the next start replays the batch, and fencing (invariant 6) refuses the
  stuck attempt if it ever goes on.

:class:`BatchWatch` is the pure decision (clock injected); :class:`Watchdog` the thread
that asks it every second.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

log = logging.getLogger(__name__)

SLOW_BATCH_WARN_S: Final = 60.0
"""A batch running this long is logged at WARN, and again every as long."""

Verdict = Literal["warn", "timeout"]


@dataclass(frozen=True)
class RunningBatch:
    batch_id: int
    kind: str
    partitions: tuple[str, ...]
    started: float


class BatchWatch:
    """When the running batch deserves a WARN line, and when it has overrun
    ``timeout`` (0: never). Thread-safe: the batch runs in ``foreachBatch``'s thread,
    the watchdog asks from its own."""

    def __init__(self, timeout: float, warn_every: float = SLOW_BATCH_WARN_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        self.warn_every = warn_every
        self._clock = clock
        self._lock = threading.Lock()
        self._running: RunningBatch | None = None
        self._warned = 0
        self.timed_out: str | None = None
        """The timeout's one-line error, once the running batch overran (cleared by
        the next batch)."""

    @contextlib.contextmanager
    def watching(self, batch_id: int, kind: str, partitions: Sequence[str]
                 ) -> Iterator[None]:
        with self._lock:
            self._running = RunningBatch(batch_id, kind, tuple(partitions), self._clock())
            self._warned = 0
            self.timed_out = None
        try:
            yield
        finally:
            with self._lock:
                self._running = None

    @property
    def running(self) -> RunningBatch | None:
        with self._lock:
            return self._running

    def seconds(self) -> float:
        running = self.running
        return 0.0 if running is None else self._clock() - running.started

    def due(self) -> Verdict | None:
        """``"timeout"`` once per batch past the timeout; ``"warn"`` at every
        ``warn_every`` of its run time before that; else ``None``."""
        with self._lock:
            if self._running is None or self.timed_out is not None:
                return None
            elapsed = self._clock() - self._running.started
            if self.timeout and elapsed >= self.timeout:
                return "timeout"
            if elapsed >= self.warn_every * (self._warned + 1):
                self._warned = int(elapsed // self.warn_every)
                return "warn"
            return None

    def timeout_error(self, progress: str | None) -> str:
        """The batch error of a batch that overran: what, how long, what to do."""
        running = self.running
        assert running is not None
        return (
            f"batch {running.batch_id} ({running.kind}, partitions "
            f"{', '.join(running.partitions) or 'none'}) did not finish within "
            f"job.batch_timeout ({self.timeout:g}s): {progress or 'no Spark progress known'}; "
            "its jobs were cancelled and the job stops so that its supervisor restarts it "
            "(the next start replays the batch; fencing refuses the stuck attempt if it "
            "ever goes on). A task that logged nothing is stuck in its Python worker "
            "(stopped or hung: py-spy dump --pid on the executor's worker shows where); one "
            "that logged retries names the table, replica or partition it waits for. If "
            "batches are legitimately this long, raise job.batch_timeout or bound them "
            "with job.max_offsets_per_trigger"
        )


def stage_progress(spark: Any) -> str | None:
    """Spark's progress of the active stages, e.g. ``stage 7: 3 of 4 tasks done, 1
    running``; None when Spark can't tell (never raises: it only enriches a log line)."""
    try:
        tracker = spark.sparkContext.statusTracker()
        parts = []
        for stage_id in sorted(tracker.getActiveStageIds()):
            info = tracker.getStageInfo(stage_id)
            if info is None:
                continue
            parts.append(f"stage {stage_id}: {info.numCompletedTasks} of {info.numTasks} "
                         f"tasks done, {info.numActiveTasks} running"
                         + (f", {info.numFailedTasks} failed" if info.numFailedTasks else ""))
        return "; ".join(parts) or None
    except Exception:
        return None


def job_times(spark: Any) -> tuple[float, float] | None:
    """When Spark's last job of this thread's job group (the micro-batch's, Spark sets
    it to the query's run) was submitted to its scheduler and when its first task was
    launched (epoch seconds), from Spark's status store; None when Spark can't tell
    (never raises: it only splits the batch line's ``start_seconds``)."""
    try:
        sc = spark.sparkContext
        ids = sc.statusTracker().getJobIdsForGroup(sc.getLocalProperty("spark.jobGroup.id"))
        if not ids:
            return None
        store = sc._jsc.sc().statusStore()
        job = store.job(max(ids))
        submitted = job.submissionTime().get().getTime() / 1000
        stages = job.stageIds()
        launched = [store.lastStageAttempt(stages.apply(k)).firstTaskLaunchedTime()
                    for k in range(stages.size())]
        first = min(t.get().getTime() / 1000 for t in launched if t.isDefined())
        return float(submitted), float(first)
    except Exception:
        return None


class Watchdog:
    """A daemon thread asking :meth:`BatchWatch.due` every ``tick`` seconds and
    calling ``on_warn`` / ``on_timeout`` with the verdict."""

    def __init__(self, watch: BatchWatch, on_warn: Callable[[], None],
                 on_timeout: Callable[[], None], tick: float = 1.0) -> None:
        self.watch = watch
        self._on = {"warn": on_warn, "timeout": on_timeout}
        self._tick = tick
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="blockagg-batch-watch",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self._tick):
            verdict = self.watch.due()
            if verdict is None:
                continue
            try:
                self._on[verdict]()
            except Exception:  # a failed log line or cancel must not end the watch
                log.warning("batch watch: %s handling failed", verdict, exc_info=True)
