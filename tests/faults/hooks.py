"""Fail a task at a chosen protocol step, without touching the job's code.

The job takes its adapters from ``BLOCKAGG_COMPONENTS=module:attr`` (``spark/job.py``,
:func:`spark.components.load_components`). ``BLOCKAGG_COMPONENTS=tests.faults.hooks:from_env``
wraps the real adapters (or those named by ``BLOCKAGG_FAULT_INNER``) so that a task
fails at one step of the protocol:

* ``after_commit``: the metadata commit succeeded, the insert it announces has not
  been sent (the intent is recorded; the retry must REPLAY the identical block);
* ``after_insert``: a block was acknowledged, the next commit has not been made (the
  retry sends the same block again; ClickHouse must drop it);
* ``between_blocks``: the second block of one partition's batch is about to be
  inserted, the first one is in (a batch half delivered);
* ``commit_fails``: a metadata commit raises as if the broker were unreachable, after
  a block of the partition was inserted since its previous commit.
* ``stall_after_commit`` / ``stall_after_insert`` / ``stall_before_commit``: the task
  stalls (``SIGSTOP`` of its own Python worker) right after an intent that lists blocks
  was committed, right after a block was inserted, or just before the commit that
  follows an insert (resumed, it sends that commit: the producer-epoch fence). It
  first leaves the job's process group and session (``os.setsid``), so that neither a
  kill of the driver's process group nor Spark's clean-up of a dead application's
  executors reaches it: an attempt that outlives its driver. It records
  ``stalled-<n>.json`` (pid, partition); the test resumes it with ``SIGCONT`` after
  newer attempts committed, and every refusal it then meets (:class:`AttemptFenced`)
  is recorded as ``fenced-<pid>.txt``.

Control is by files, because tasks run in Spark's Python worker processes:
``BLOCKAGG_FAULT_DIR/armed`` names the step (the test writes it with :func:`arm` at the
moment of its choosing; no restart needed) and each failure claims ``fired-<n>`` with
``O_EXCL`` for ``n < BLOCKAGG_FAULT_TIMES`` (default 1), so exactly that many failures
happen over all processes and retries. Without ``BLOCKAGG_FAULT_DIR`` nothing is
wrapped. ``BLOCKAGG_FAULT_ACTION=raise`` (default: the task fails and
Spark retries it) or ``exit`` (the Python worker dies with ``os._exit``).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blockagg.aggregator.core.metadata import decode, is_blockagg
from blockagg.aggregator.core.model import Batch, Block, BlockSink, Committed, MetadataStore
from blockagg.aggregator.kafka.exceptions import AttemptFenced
from blockagg.config import Config, TopicConfig
from blockagg.spark.components import (
    Attempt,
    Components,
    DefaultComponents,
    TableRegistry,
    load_components,
    open_attempt,
)

STEPS = ("after_commit", "after_insert", "between_blocks", "commit_fails",
         "stall_after_commit", "stall_after_insert", "stall_before_commit")


class InjectedFault(RuntimeError):
    """The failure a hook raises; its message names the step."""


@dataclass(frozen=True)
class Plan:
    """The file protocol: ``armed`` holds the step to fail at (a test writes it when it
    wants the fault, so the job needn't be restarted to change steps)."""

    folder: Path
    times: int = 1
    action: str = "raise"

    @classmethod
    def from_env(cls) -> Plan | None:
        folder = os.environ.get("BLOCKAGG_FAULT_DIR", "")
        if not folder:
            return None
        return cls(Path(folder), int(os.environ.get("BLOCKAGG_FAULT_TIMES", "1")),
                   os.environ.get("BLOCKAGG_FAULT_ACTION", "raise"))

    def step(self) -> str:
        try:
            return (self.folder / "armed").read_text().strip()
        except OSError:
            return ""

    def claim(self) -> int | None:
        """The number of the failure this call may inject, or None (used up)."""
        for n in range(self.times):
            try:
                fd = os.open(self.folder / f"fired-{n}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                continue
            os.write(fd, f"{time.time()} {os.getpid()}\n".encode())
            os.close(fd)
            return n
        return None

    def fail(self, step: str, what: str) -> None:
        if self.step() != step:
            return
        n = self.claim()
        if n is None:
            return
        if self.action == "exit":
            os._exit(17)
        raise InjectedFault(f"injected fault #{n} at step {step}: {what}")

    def stall(self, step: str, record: dict[str, object]) -> None:
        """At ``step`` (when armed and not used up): leave the job's session, record
        ``stalled-<n>.json`` and stop this process until someone sends SIGCONT."""
        if self.step() != step or not _in_spark_task():
            return
        n = self.claim()
        if n is None:
            return
        import blockagg

        os.setsid()
        record = {**record, "pid": os.getpid(), "step": step,
                  "blockagg": str(blockagg.__file__)}
        tmp = self.folder / f"stalled-{n}.tmp"
        tmp.write_text(json.dumps(record))
        tmp.replace(self.folder / f"stalled-{n}.json")
        os.kill(os.getpid(), signal.SIGSTOP)

    def refused(self, exc: BaseException) -> None:
        """Record a refusal met by this process (a fenced attempt)."""
        with open(self.folder / f"fenced-{os.getpid()}.txt", "a") as out:
            out.write(f"{type(exc).__name__}: {exc}\n")


def _in_spark_task() -> bool:
    """Stalls are for task attempts in Spark's Python workers, never the driver (its
    recovery runs the same code, outside any task)."""
    from pyspark import TaskContext

    return TaskContext.get() is not None


def arm(folder: Path, step: str) -> None:
    """Reset the fired markers and the stall records of the previous arming, and arm
    ``step`` (from the test process).

    The records go too: a stall claims ``fired-0`` again after the reset, so it writes
    ``stalled-0.json`` again, and a reader that compared the number of records before
    and after arming would never see a second stall fire (the stalled worker then stays
    stopped and holds its batch for good)."""
    if step not in STEPS:
        raise ValueError(f"unknown step {step!r}; known: {STEPS}")
    folder.mkdir(parents=True, exist_ok=True)
    for marker in [*folder.glob("fired-*"), *folder.glob("stalled-*.json")]:
        marker.unlink()
    tmp = folder / "armed.tmp"
    tmp.write_text(step)
    tmp.replace(folder / "armed")


def disarm(folder: Path) -> None:
    (folder / "armed").unlink(missing_ok=True)


def fired(folder: Path) -> int:
    """How many failures were injected so far (read by the test)."""
    return len(list(folder.glob("fired-*")))


def stalled(folder: Path) -> list[dict[str, object]]:
    """The records of the tasks stalled since the last :func:`arm` (read by the test)."""
    return [json.loads(p.read_text()) for p in sorted(folder.glob("stalled-*.json"))]


def refusals(folder: Path, pid: int) -> str:
    """What process ``pid`` was refused (its ``AttemptFenced`` messages), or ''."""
    try:
        return (folder / f"fenced-{pid}.txt").read_text()
    except OSError:
        return ""


# Per worker process: blocks inserted since the partition's last commit, and the
# batches whose first block went in.
_INSERTED_SINCE_COMMIT: dict[tuple[str, int], int] = {}
_BATCH_BLOCKS: dict[tuple[str, int, int, int], int] = {}


class FaultStore:
    def __init__(self, inner: MetadataStore, plan: Plan) -> None:
        self.inner = inner
        self.plan = plan

    def committed(self, topic: str, partition: int) -> Committed | None:
        return self.inner.committed(topic, partition)

    def commit(self, topic: str, partition: int, offset: int, metadata: str) -> None:
        tp = (topic, partition)
        if _INSERTED_SINCE_COMMIT.get(tp, 0) > 0:
            self.plan.fail("commit_fails",
                           f"commit of {topic}[{partition}] at {offset} (broker unreachable)")
            self.plan.stall("stall_before_commit", {"topic": topic, "partition": partition,
                                                    "offset": offset})
        try:
            self.inner.commit(topic, partition, offset, metadata)
        except AttemptFenced as exc:
            self.plan.refused(exc)
            raise
        _INSERTED_SINCE_COMMIT[tp] = 0
        self.plan.fail("after_commit", f"after committing {topic}[{partition}] at {offset}")
        if is_blockagg(metadata) and decode(metadata).blocks:
            self.plan.stall("stall_after_commit", {"topic": topic, "partition": partition,
                                                   "offset": offset, "metadata": metadata})

    def attempt(self, topic: str, partition: int) -> FaultAttempt | None:
        """The inner store's fenced attempt, with the same faults on its commits."""
        inner = open_attempt(self.inner, topic, partition)
        return None if inner is None else FaultAttempt(inner, self.plan)


class FaultAttempt(FaultStore):
    """A fenced attempt (``spark.components.Attempt``) with the hooks' faults."""

    def __init__(self, inner: Attempt, plan: Plan) -> None:
        super().__init__(inner, plan)
        self.attempt_inner = inner
        self.nonce = inner.nonce

    def confirm(self, topic: str, partition: int) -> float:
        try:
            return self.attempt_inner.confirm(topic, partition)
        except AttemptFenced as exc:
            self.plan.refused(exc)
            raise

    def close(self) -> None:
        self.attempt_inner.close()


class FaultSink:
    def __init__(self, inner: BlockSink, plan: Plan) -> None:
        self.inner = inner
        self.plan = plan

    def insert(self, block: Block, batch: Batch, confirmed_at: float | None = None) -> None:
        key = (batch.topic, batch.partition, batch.start, batch.end)
        if _BATCH_BLOCKS.get(key, 0) >= 1:
            self.plan.fail("between_blocks", f"before the second block ({block.token}) of a batch")
        self.inner.insert(block, batch, confirmed_at)
        if len(_BATCH_BLOCKS) > 10_000:
            _BATCH_BLOCKS.clear()
        _BATCH_BLOCKS[key] = _BATCH_BLOCKS.get(key, 0) + 1
        tp = (batch.topic, batch.partition)
        _INSERTED_SINCE_COMMIT[tp] = _INSERTED_SINCE_COMMIT.get(tp, 0) + 1
        self.plan.fail("after_insert", f"after inserting {block.token}")
        self.plan.stall("stall_after_insert", {"topic": batch.topic,
                                               "partition": batch.partition,
                                               "block": block.token})


@dataclass(frozen=True)
class FaultComponents:
    inner: Components
    plan: Plan | None

    def store(self, config: Config) -> MetadataStore:
        store = self.inner.store(config)
        return FaultStore(store, self.plan) if self.plan else store

    def sink(self, config: Config, topic: TopicConfig) -> BlockSink:
        sink = self.inner.sink(config, topic)
        return FaultSink(sink, self.plan) if self.plan else sink

    def registry(self, config: Config) -> TableRegistry:
        return self.inner.registry(config)

    def incarnation(self, config: Config, topic: str) -> int:
        of = getattr(self.inner, "incarnation", None)
        return int(of(config, topic)) if of else 0

    def dedup_mode(self, config: Config, topic: TopicConfig) -> int:
        mode = getattr(self.inner, "dedup_mode", None)
        return int(mode(config, topic)) if mode else 0

    def structure_mark(self, config: Config, topic: TopicConfig, tables: Sequence[str]) -> int:
        mark = getattr(self.inner, "structure_mark", None)
        return int(mark(config, topic, tables)) if mark else 0

    def dedup_windows(self, config: Config, topic: TopicConfig, tables: Sequence[str]
                      ) -> Mapping[str, Any]:
        windows = getattr(self.inner, "dedup_windows", None)
        return windows(config, topic, tables) if windows else {}

    def stored_coordinates(self, config: Config, topic: TopicConfig, tables: Sequence[str],
                           name: str, partition: int, start: int) -> list[Any]:
        stored = getattr(self.inner, "stored_coordinates", None)
        return list(stored(config, topic, tables, name, partition, start)) if stored else []


def from_env() -> FaultComponents:
    """``BLOCKAGG_COMPONENTS=tests.faults.hooks:from_env``."""
    spec = os.environ.get("BLOCKAGG_FAULT_INNER")
    inner: Components = load_components(spec) if spec else DefaultComponents()
    return FaultComponents(inner, Plan.from_env())
