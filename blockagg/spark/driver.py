"""The driver: start position, the streaming query, ``foreachBatch``, stop.

One run of the job:

1. **Checks.** The start-up checks (``spark.preflight``) ran before the session:
   speculation off, the Kafka connector, the metrics port, the services and the
   tables. Speculation is checked again on the session. The metadata group must have no active
   member; the job joins the lock group ``<group>.lock`` (``spark.lock``) so a second
   job on the same group and topic is refused.
2. **Start position.** The metadata group's commits are read for every partition of
   the subscribed topics. A commit ahead of the partition's end is refused. Spark's
   ``startingOffsets`` is the resume offset of each committed partition and the
   configured default for the others; it applies when the checkpoint has no offset
   log (first run, or the checkpoint was deleted); otherwise Spark resumes from its
   checkpoint and the protocol checks that start against the commits.
3. **Recovery.** A commit that still lists blocks (the previous run stopped inside a
   batch) is completed first by a bounded *batch* read of exactly
   ``[resume, last block + 1)``, so the blocks are rebuilt identically whatever the
   streaming query's first batch would have been (``maxOffsetsPerTrigger`` could
   otherwise cut it inside a block, which the protocol refuses).
4. **Micro-batches.** ``foreachBatch`` reads the batch's planned ranges from the
   offset log (``spark.offsets``), runs one task per Kafka partition range
   (``spark.task.run_arrow_partition`` over Arrow record batches, or
   ``run_partition`` over rows with ``job.handover = "rows"``), runs ranges that had
   no visible row on the driver,
   and folds the reports into metrics and one log line. Quiet partitions are
   re-committed unchanged every ``job.idle_commit_interval`` (``spark.idle``).
5. **Sizing.** With ``blocks.min_rows`` the Kafka source holds triggers until enough
   offsets are available (``minOffsetsPerTrigger``, for at most ``maxTriggerDelay``),
   both decided by ``spark.sizing`` from the last batches' blocks. Spark fixes them for
   the life of a query, so the driver applies a new sizing by restarting the query
   between batches (a few seconds without batches): once after the calibration batches,
   then on a change beyond a factor of two, at most every ten minutes. A restart
   re-runs a batch Spark had planned with the range its offset log recorded.
6. **Stop.** SIGTERM/SIGINT stop the query between batches (a batch in progress is
   finished first, up to ``stop_timeout``); a kill -9 anywhere is safe, the next run
   replays.

Above 500 lines because the start checks, the offset plan, the lock and the batch loop share
the driver's state over one run.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import secrets
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from types import FrameType
from typing import Any, Final

from blockagg import logs
from blockagg.aggregator.clickhouse.dedup_window import (
    DedupNeed,
)
from blockagg.aggregator.core.exceptions import MetadataDecodeError
from blockagg.aggregator.core.metadata import decode, is_blockagg
from blockagg.aggregator.core.model import Committed
from blockagg.aggregator.core.protocol import undecodable_commit
from blockagg.aggregator.kafka.exceptions import MetadataUnstable
from blockagg.aggregator.kafka.hanging import read_or_diagnose
from blockagg.config import Config, TopicConfig
from blockagg.rows.deadletter_rate import RateThreshold, RateWindow
from blockagg.rows.exceptions import DeadLetterRateExceeded
from blockagg.spark.components import Components, DefaultComponents
from blockagg.spark.exceptions import BatchTimedOut, JobError, StoppedBeforeBatch, refusal_in
from blockagg.spark.heal import heal_hanging
from blockagg.spark.idle import IdleRefresher, broker_retention_minutes, check_idle_interval
from blockagg.spark.lock import GroupLock, check_metadata_group_idle
from blockagg.spark.metrics import JobMetrics
from blockagg.spark.offsets import (
    OffsetLog,
    PlannedRange,
    TopicPartition,
    assign_json,
    list_partitions,
    make_consumer,
    offsets_json,
    read_committed,
    starting_offsets_json,
    watermarks,
)
from blockagg.spark.sizing import HISTORY as SIZING_HISTORY
from blockagg.spark.sizing import (
    OFF,
    BatchFigures,
    Sizing,
    SizingGoal,
    decide,
    should_apply,
)
from blockagg.spark.tables import TableGuard
from blockagg.spark.task import (
    REPORT_SCHEMA,
    TaskContext,
    run_arrow_partition,
    run_partition,
    run_range,
    structure_marks,
)
from blockagg.spark.watch import BatchWatch, Watchdog, job_times, stage_progress

log = logs.get("job")

ROW_COLUMNS = ("topic", "partition", "offset", "value", "timestamp")

READER_DEFAULTS: Final[Mapping[str, str]] = {"kafka.fetch.max.wait.ms": "10"}
"""Spark's Kafka source options the job sets unless ``[kafka]`` / ``[kafka.spark]`` set
them. ``fetch.max.wait.ms`` (the Java consumer's 500 ms otherwise): a task whose range
ends at the log end, as every range of a caught-up stream does, waited about that long.
After each poll Spark asks the broker for the partition's available offsets, and the
broker answers a connection's requests in order, behind the consumer's prefetch, which
it holds at the log end for ``fetch.max.wait.ms`` (``bench/bench_kafka_read.py``: a
micro-batch's read of 8 partitions on 2 slots, 2.28 s → 0.66 s; docs/BENCHMARKS.md). A
consumer only fetches while a task polls it, so the shorter wait adds no requests to
an idle job."""

BATCH_LINE_SECONDS: Final = (
    "seconds", "max_task_seconds", "task_seconds", "commit_seconds", "insert_seconds",
    "plan_seconds", "checks_seconds", "ends_seconds", "mark_seconds", "spark_seconds",
    "build_seconds",
    "start_seconds", "last_start_seconds", "submit_seconds", "launch_seconds",
    "read_seconds", "prepare_seconds")
"""The :class:`BatchSummary` timings on the batch line, in its order (docs/running.md)."""


@dataclass
class BatchSummary:
    batch_id: int
    partitions: int = 0
    messages: int = 0
    rows: int = 0
    bytes: int = 0
    blocks: int = 0
    replayed_blocks: int = 0
    dead_letters: int = 0
    skipped: int = 0
    commits: int = 0
    seconds: float = 0.0
    max_task_seconds: float = 0.0
    task_seconds: float = 0.0
    """Summed over the batch's tasks: against ``seconds`` x task slots, what Spark
    itself took; ``commit_seconds`` and ``insert_seconds`` (each insert's own time,
    summed, so above the task's wall time when inserts run concurrently) say where
    the tasks' time went."""
    commit_seconds: float = 0.0
    insert_seconds: float = 0.0
    plan_seconds: float = 0.0
    """The batch's phases on the driver, where ``seconds`` goes beyond the tasks:
    reading its planned ranges (the offset log, and a consumer for inexact starts);
    ``checks_seconds`` the new-partition check and the idle re-commits;
    ``ends_seconds`` the partitions' log-end offsets (``partition_ends``);
    ``mark_seconds`` the structure marks under content-hash deduplication
    (``spark.task.structure_marks``);
    ``spark_seconds`` Spark's job over the tasks, submission to the collected reports."""
    checks_seconds: float = 0.0
    ends_seconds: float = 0.0
    mark_seconds: float = 0.0
    spark_seconds: float = 0.0
    start_seconds: float = 0.0
    """From the Spark job's submission to the first task's Python function starting
    (the driver's and the executors' clocks; one host in local mode): planning, task
    launch and Python worker start, what Spark takes before any of our task code
    runs; ``last_start_seconds`` to the last task's."""
    last_start_seconds: float = 0.0
    submit_seconds: float = 0.0
    """Of ``start_seconds``, Spark's status store's account (0 when it can't tell):
    from the collect to the job's submission to the scheduler (planning the query in
    the JVM), then ``launch_seconds`` to its first task's launch; the rest of
    ``start_seconds`` is the executor starting the task and its Python worker."""
    launch_seconds: float = 0.0
    build_seconds: float = 0.0
    """Of ``spark_seconds``, building the tasks' plan on the driver (pickling the task
    function and its context, Spark's analysis) before the job is submitted."""
    fresh_workers: int = 0
    """Tasks that ran in a new Python worker (which imported the job's code first)."""
    read_seconds: float = 0.0
    """The slowest task's wait for its rows before the protocol ran: the Kafka fetch in
    the JVM and the rows' handover to Python (``read_seconds`` of the reports)."""
    prepare_seconds: float = 0.0
    """Of ``task_seconds``, summed over the tasks: building each partition's batch
    (envelopes, registry, decoding, dead letters) and planning its blocks, before its
    first commit; the rest of a task is its commits and inserts."""
    task_starts: list[float] = field(default_factory=list)
    """Each task's start (epoch seconds, the report's ``entered``)."""
    warnings: list[str] = field(default_factory=list)
    reasons: Counter[str] = field(default_factory=Counter)
    retried: dict[str, int] = field(default_factory=dict)
    """``topic[partition] -> attempt`` of each task that succeeded after failed attempts
    (each failed attempt logged its own ``task attempt failed`` line where it ran)."""
    offsets: int = 0
    """Offsets the batch planned over all partitions (what ``minOffsetsPerTrigger``
    and ``maxOffsetsPerTrigger`` count)."""
    block_rows: list[int] = field(default_factory=list)
    """Rows of each block the batch inserted (``blocks.min_rows`` sizes batches by them)."""
    quorum_waits: int = 0
    """Inserts sent again because their table's previous quorum insert was pending
    (ClickHouse 18.16's code 286: partitions writing one table queue), summed over the
    tasks."""

    def add(self, rep: Mapping[str, Any]) -> None:
        self.partitions += 1
        self.messages += int(rep["messages"])
        self.rows += int(rep["rows"])
        self.bytes += int(rep["bytes"])
        self.blocks += int(rep["blocks"])
        self.replayed_blocks += int(rep["replayed_blocks"])
        self.dead_letters += sum(rep["dead_letters"].values())
        self.reasons.update(rep["dead_letters"])
        self.skipped += int(bool(rep["skipped"]))
        self.commits += int(rep["commits"])
        self.max_task_seconds = max(self.max_task_seconds, float(rep["seconds"]))
        self.task_seconds += float(rep["seconds"])
        self.read_seconds = max(self.read_seconds, float(rep.get("read_seconds", 0.0)))
        self.prepare_seconds += float(rep.get("prepare_seconds", 0.0))
        if rep.get("entered") is not None:
            self.task_starts.append(float(rep["entered"]))
        self.fresh_workers += int(bool(rep.get("fresh_worker", False)))
        self.block_rows.extend(int(r) for r in rep.get("block_rows", ()))
        self.quorum_waits += int(rep.get("quorum_waits", 0))
        self.commit_seconds += sum(rep.get("commit_seconds", ()))
        self.insert_seconds += sum(s for _, s in rep.get("insert_seconds", ()))
        if rep.get("warning"):
            self.warnings.append(f"{rep['topic']}[{rep['partition']}]: {rep['warning']}")
        if int(rep.get("attempt", 1)) > 1:
            self.retried[f"{rep['topic']}[{rep['partition']}]"] = int(rep["attempt"])


def check_speculation(spark: Any) -> None:
    """The session's ``spark.speculation`` again (``preflight.check_speculation``
    refused it before the session from the configuration it could see): refused,
    never forced off."""
    from blockagg.spark.preflight import check_speculation as refuse_speculation

    refuse_speculation(
        {"spark.speculation": str(spark.sparkContext.getConf().get("spark.speculation",
                                                                   "false"))})


def last_progress(query: Any) -> dict[str, Any] | None:
    """The query's last progress as a dict, from the JVM's own JSON: one Py4J call.
    PySpark 4's ``StreamingQuery.lastProgress`` builds its object field by field (a
    Py4J call each, some of them class lookups through every jar): 68 ms of wall and
    17 ms of the driver's CPU a call against 0.8 ms (docs/BENCHMARKS.md, "1 KiB rows, the
    driver's progress poll, and the JVM's share of a warm batch"), and the driver asks
    twice a second."""
    jsq = getattr(query, "_jsq", None)
    if jsq is None:  # not PySpark's query object
        return _progress_dict(query.lastProgress)
    progress = jsq.lastProgress()
    return None if progress is None else _progress_dict(progress)


def _progress_dict(progress: Any) -> dict[str, Any] | None:
    if progress is None:
        return None
    if isinstance(progress, dict):
        return progress
    text = getattr(progress, "json", None)
    if text is not None:
        parsed = json.loads(text() if callable(text) else text)
        return parsed if isinstance(parsed, dict) else None
    return None


def _offsets_of(value: Any) -> dict[TopicPartition, int]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:  # e.g. "" in the first progress of a query resumed from its
            return {}       # checkpoint: no offsets known yet
    out: dict[TopicPartition, int] = {}
    if isinstance(value, dict):
        for topic, parts in value.items():
            if isinstance(parts, dict):
                for p, o in parts.items():
                    out[(topic, int(p))] = int(o)
    return out


class Driver:
    def __init__(
        self,
        config: Config,
        spark: Any,
        components: Components | None = None,
        metrics: JobMetrics | None = None,
        run_id: int | None = None,
        tables: TableGuard | None = None,
    ) -> None:
        self.config = config
        self.spark = spark
        self.components: Components = components or DefaultComponents()
        self.metrics = metrics or JobMetrics()
        self.run_id = run_id if run_id is not None else (
            config.job.run_id if config.job.run_id is not None else secrets.randbits(64))
        self.offset_log = OffsetLog(spark, config.job.checkpoint_location)
        self._consumer: Any = None
        self._state = threading.Lock()
        self._stop_requested = threading.Event()
        self._in_batch = False
        self._signals: Counter[str] = Counter()
        self.jvm_signals: Any = None
        self.lock: GroupLock | None = None
        self.query: Any = None
        self.batches: list[BatchSummary] = []
        self.caught_up = False
        self.failure: BaseException | None = None
        self.batch_error: str | None = None
        dl = config.dead_letters
        self.dead_letter_rate = RateWindow(RateThreshold(
            max_rate=dl.max_rate, min_messages=dl.min_messages, window=dl.window,
            table=dl.table))
        self.idle = IdleRefresher(config.job.idle_commit_interval, time.monotonic)
        self.partitions: set[TopicPartition] = set()
        self.tables = tables or TableGuard(config, self.components)
        """The tables' check and ``P`` per shard; the start-up checks ran it already
        when they pass it (``spark.preflight``)."""
        self.watch = BatchWatch(config.job.batch_timeout)
        self.watchdog = Watchdog(self.watch, self.warn_slow_batch, self.cancel_overrun_batch)
        self.sizing_goal = SizingGoal(
            min_rows=config.blocks.min_rows, max_latency=config.blocks.max_latency,
            trigger_interval=config.job.trigger_interval,
            percentile=config.blocks.min_rows_percentile,
            max_offsets_per_trigger=config.job.max_offsets_per_trigger)
        self.sizing: Sizing = OFF
        """The sizing of the running query (``spark.sizing``)."""
        self._resize_to: Sizing | None = None
        self._sizing_changed_at: float | None = None
        self._restarting = False
        self._starting = "latest"
        self.restarts = 0

    # ------------------------------------------------------------------ startup

    def _owns(self, topic: str) -> bool:
        return any(t.matches(topic) for t in self.config.topics)

    def _lock_subscription(self) -> list[str]:
        kind, value = self.config.subscription
        if kind == "subscribe":
            return value.split(",")
        return [f"^(?:{value})$"]

    def acquire_lock(self) -> None:
        rdk = self.config.kafka.librdkafka_config()
        check_metadata_group_idle(rdk, self.config.job.metadata_group_id)
        self.lock = GroupLock(
            rdk,
            self.config.job.metadata_group_id,
            self._lock_subscription(),
            self._owns,
            client_id=f"blockagg-lock-{self.config.job.name}-{self.run_id:016x}",
            session_timeout_ms=round(self.config.job.lock_session_timeout * 1000),
            on_lost=self.on_lock_lost,
        )
        self.lock.acquire(self.config.job.lock_timeout)

    @property
    def shard_partitions(self) -> dict[str, int]:
        """``P`` per shard, counted by the table check (``spark.tables``)."""
        return self.tables.shard_partitions

    def shard_keys(self) -> dict[str, frozenset[str]]:
        return self.tables.shard_keys()

    def dedup_need(self, topic: TopicConfig) -> DedupNeed:
        return self.tables.dedup_need(topic)

    def count_shard_partitions(self, partitions: Iterable[TopicPartition]) -> None:
        self.tables.count_shard_partitions(partitions)

    def check_tables(self, partitions: Sequence[TopicPartition]) -> None:
        """The tables' check (``spark.tables.TableGuard.check_tables``)."""
        self.tables.check_tables(partitions)

    def check_new_partitions(self, partitions: Iterable[TopicPartition]) -> None:
        """Partitions the job had not seen (a topic's partitions added, a new topic
        matched by the pattern) join the idle refresher's set and raise their shard's
        ``P``, which shrinks every share (``aggregator.clickhouse.dedup_window``): every
        table is judged again and ``P`` recounted before the batch reads or writes
        anything, so a window that no longer holds a block per partition-batch refuses
        here as it would at start (``DedupWindowTooSmall``), and the batch's tasks
        bound their blocks by the smaller shares."""
        new = set(partitions) - self.partitions
        if not new:
            return
        self.partitions.update(new)
        logs.event(log, "new partitions: tables checked again", level=30,
                   partitions=",".join(f"{t}[{p}]" for t, p in sorted(new)),
                   total=len(self.partitions))
        self.check_tables(sorted(self.partitions))

    def check_idle_interval(self) -> None:
        """Refuse a ``job.idle_commit_interval`` that the brokers' offset retention
        would outrun (``spark.idle``); a cluster that does not tell its retention
        gets a warning."""
        from confluent_kafka.admin import AdminClient

        settings: dict[str, str | int | float | bool] = dict(
            self.config.kafka.librdkafka_config())
        retention = broker_retention_minutes(AdminClient(logs.kafka_client_config(settings)))
        if retention is None:
            logs.event(log, "offsets.retention.minutes unknown", level=30,
                       warning="could not describe the brokers' configuration; make sure "
                       "job.idle_commit_interval is well below offsets.retention.minutes")
            return
        check_idle_interval(self.config.job.idle_commit_interval, retention)

    def refresh_idle(self, busy: Mapping[TopicPartition, object] | None = None) -> None:
        """Re-commit, unchanged, the partitions not committed for
        ``job.idle_commit_interval`` that no task of the current batch touches
        (``busy``), so the brokers' offset retention never expires them. A failure is
        logged and retried at the next chance: nothing depends on it yet."""
        due = self.idle.due(self.partitions, busy)
        if not due:
            return
        unknown = len(self.idle.unknown_age(due))
        try:
            count = self.idle.refresh(self.components.store(self.config), due)
        except Exception as exc:
            logs.event(log, "idle re-commit failed", level=30,
                       error=f"{type(exc).__name__}: {str(exc)[:500]}")
            return
        if count:
            if unknown:  # first refresh of this run: no task committed them since start
                logs.event(log, "idle partitions re-committed", partitions=count,
                           unknown_age=unknown)
            else:
                logs.event(log, "idle partitions re-committed", partitions=count)

    def read_start(self) -> tuple[list[TopicPartition], dict[TopicPartition, Committed],
                                  dict[TopicPartition, tuple[int, int]]]:
        consumer = make_consumer(self.config.kafka.librdkafka_config(),
                                 self.config.job.metadata_group_id)
        try:
            partitions = list_partitions(consumer, self._owns)
            if not partitions:
                raise JobError(
                    f"no partition found for the configured topics "
                    f"({', '.join(t.label for t in self.config.topics)}): create them first"
                )
            committed = self._read_committed_or_heal(consumer, partitions)
            marks = watermarks(consumer, partitions)
        finally:
            consumer.close()
        for tp, commit in committed.items():
            _low, high = marks[tp]
            if commit.offset > high:
                raise JobError(
                    f"{tp[0]}[{tp[1]}]: the committed resume offset {commit.offset} of group "
                    f"{self.config.job.metadata_group_id} is beyond the partition's end {high}: "
                    "the topic was recreated or its offsets reset. Reset the group "
                    "(kafka-consumer-groups.sh --reset-offsets --to-earliest) and restart"
                )
        return partitions, committed, marks

    def _read_committed_or_heal(self, consumer: Any, partitions: list[TopicPartition]
                                ) -> dict[TopicPartition, Committed]:
        """The group's stable commits; if a hanging transaction refuses them, end it
        (``spark.heal``, unless ``kafka.heal_hanging_transactions`` is off) and read
        again. A hanging transaction that cannot be ended safely is refused as before,
        with the runbook in its message."""
        settings = self.config.kafka.librdkafka_config()
        group = self.config.job.metadata_group_id

        def read() -> dict[TopicPartition, Committed]:
            return read_or_diagnose(lambda: read_committed(consumer, partitions),
                                    settings, group, partitions)

        try:
            return read()
        except MetadataUnstable as hang:
            if not self.config.kafka.heal_hanging_transactions:
                raise
            logs.event(log, "healing a hanging transaction", level=30, group=group)
            try:
                plan = heal_hanging(self.config, self.spark._jvm)
            except Exception as exc:
                logs.event(log, "healing failed", level=40,
                           error=f"{type(exc).__name__}: {str(exc)[:500]}")
                raise MetadataUnstable(
                    f"{hang} The job's attempt to end it failed: {type(exc).__name__}: "
                    f"{str(exc)[:300]}") from None
            if not plan.complete:
                reasons = "; ".join(item.reason for item in plan.left if item.blocks)
                raise MetadataUnstable(
                    f"{hang} The job does not end it by itself: {reasons}") from None
            return read()

    def recovery_ranges(self, committed: Mapping[TopicPartition, Committed]) -> tuple[
            dict[TopicPartition, PlannedRange], int]:
        """Ranges ``[resume, last block + 1)`` of commits that still list blocks."""
        ranges: dict[TopicPartition, PlannedRange] = {}
        batch_id = 0
        for tp, commit in committed.items():
            text = commit.metadata.rstrip("\x00")
            if not is_blockagg(text):
                continue
            try:
                metadata = decode(text)
            except MetadataDecodeError as exc:
                raise JobError(undecodable_commit(
                    tp[0], tp[1], commit.offset, exc,
                    self.config.job.metadata_group_id)) from None
            if metadata.resume != commit.offset or not metadata.blocks:
                continue
            end = max(b.last for b in metadata.blocks) + 1
            ranges[tp] = PlannedRange(tp[0], tp[1], metadata.resume, end)
            batch_id = max(batch_id, metadata.batch)
        return ranges, batch_id

    def _reader_options(self) -> dict[str, str]:
        """Spark's Kafka source options: :data:`READER_DEFAULTS`, then ``[kafka]`` /
        ``[kafka.spark]``, ``[source]``, then what the job owns."""
        options = dict(READER_DEFAULTS)
        options.update(self.config.kafka.spark_source_options())
        options.update({k: v if isinstance(v, str) else v.reveal()
                        for k, v in self.config.source.items()})
        options["kafka.isolation.level"] = "read_committed"
        options["failOnDataLoss"] = "true"
        return options

    def run_ranges(self, df: Any, ranges: dict[TopicPartition, PlannedRange],
                   batch_id: int, kind: str = "stream") -> BatchSummary:
        """Run the tasks of one batch over ``df``, then the ranges without rows. The
        tasks run under the batch watch (``spark.watch``): WARN lines while they are
        slow, :class:`BatchTimedOut` past ``job.batch_timeout``."""
        started = time.time()
        nonempty = {tp: r for tp, r in ranges.items() if not r.empty}
        ends = self.partition_ends(nonempty)
        ends_seconds = time.time() - started
        reports: list[dict[str, Any]] = []
        names = [f"{t}[{p}]" for t, p in sorted(nonempty)]
        with self.watch.watching(batch_id, kind, names):
            marks = self.read_structure_marks({t for t, _ in nonempty})
            mark_seconds = time.time() - started - ends_seconds
            ctx = TaskContext(self.config, self.components, nonempty, batch_id, self.run_id,
                              ends, dict(self.shard_partitions), marks)
            submitted = built = time.time()
            try:
                if nonempty and self.config.job.handover == "arrow":
                    tasks = df.select(*ROW_COLUMNS).mapInArrow(
                        partial(run_arrow_partition, ctx), REPORT_SCHEMA)
                    built = time.time()
                    reports = [pickle.loads(row[0]) for row in tasks.collect()]
                elif nonempty:
                    rdd = df.select(*ROW_COLUMNS).rdd.mapPartitions(
                        partial(run_partition, ctx))
                    built = time.time()
                    reports = rdd.collect()
            except Exception as exc:
                if self.watch.timed_out is not None:
                    raise BatchTimedOut(self.watch.timed_out) from exc
                raise
        spark_seconds = time.time() - submitted
        times = job_times(self.spark) if nonempty else None
        done = {(r["topic"], r["partition"]) for r in reports}
        for tp in sorted(set(nonempty) - done):
            reports.append(run_range(ctx, tp, [], [], []))
        summary = BatchSummary(batch_id)
        summary.offsets = sum(r.end - r.start for r in nonempty.values())
        for rep in reports:
            summary.add(rep)
            if int(rep["commits"]):
                self.idle.saw_commit((rep["topic"], rep["partition"]))
        summary.ends_seconds = ends_seconds
        summary.mark_seconds = mark_seconds
        summary.spark_seconds = spark_seconds
        summary.build_seconds = built - submitted
        if times is not None:
            summary.submit_seconds = max(0.0, times[0] - built)
            summary.launch_seconds = max(0.0, times[1] - times[0])
        if summary.task_starts:
            summary.start_seconds = max(0.0, min(summary.task_starts) - submitted)
            summary.last_start_seconds = max(0.0, max(summary.task_starts) - submitted)
        summary.seconds = time.time() - started
        self.metrics.observe_reports(reports)
        return summary

    def read_structure_marks(self, topics: set[str]) -> dict[str, int]:
        """The batch's structure marks (:func:`spark.task.structure_marks`), read under
        the batch watch: the read runs in a thread of its own and the batch waits for it
        only until ``job.batch_timeout``, as it would for a task (a replica that stops
        answering holds a ClickHouse read up to ``send_receive_timeout``); then
        :class:`BatchTimedOut` stops the job and the read is abandoned with it."""
        if not topics:
            return {}
        result: dict[str, int] = {}
        failure: list[BaseException] = []
        done = threading.Event()

        def read() -> None:
            try:
                result.update(structure_marks(self.components, self.config, topics))
            except BaseException as exc:  # raised in the batch's thread below
                failure.append(exc)
            finally:
                done.set()

        threading.Thread(target=read, name="blockagg-structure-marks", daemon=True).start()
        while not done.wait(0.05):
            if self.watch.timed_out is not None:
                raise BatchTimedOut(self.watch.timed_out)
        if failure:
            raise failure[0]
        return result

    def partition_ends(self, ranges: Mapping[TopicPartition, PlannedRange]
                       ) -> dict[TopicPartition, int]:
        """Each planned partition's log-end offset (high watermark), read after the
        batch was planned, so at or above every resume offset blockagg committed for
        it: a task whose last commit is beyond it refuses the batch
        (``MetadataAheadOfPartition``: offsets reset or topic recreated) instead of
        skipping the batch as delivered. When the brokers don't answer, the batch runs
        without that check (logged): the tasks' own commits retry through an outage,
        and a batch should not fail for its safety net alone."""
        if not ranges:
            return {}
        try:
            marks = self._watermarks(ranges)
        except Exception as exc:
            logs.event(log, "partition ends unknown", level=30,
                       error=f"{type(exc).__name__}: {str(exc)[:500]}")
            return {}
        return {tp: max(high, ranges[tp].end) for tp, (_low, high) in marks.items()}

    def _watermarks(self, partitions: Iterable[TopicPartition]
                    ) -> dict[TopicPartition, tuple[int, int]]:
        """``watermarks`` on the kept consumer, asked once more on a fresh one when it
        fails: a kept consumer's metadata is only refreshed every
        ``topic.metadata.refresh.interval.ms``, so a partition added while the job runs
        is unknown to it (``_UNKNOWN_PARTITION``) until a new consumer reads the
        topic's metadata. A failure on the fresh one too is raised, and the next call
        connects afresh again."""
        partitions = list(partitions)
        try:
            return watermarks(self._offsets_consumer(), partitions)
        except Exception as exc:
            self.close_offsets_consumer()
            log.debug("watermarks on the kept consumer failed, asking a fresh one: %s", exc)
        try:
            return watermarks(self._offsets_consumer(), partitions)
        except Exception:
            self.close_offsets_consumer()
            raise

    def _offsets_consumer(self) -> Any:
        """The driver's consumer for watermarks (``partition_ends``, inexact starts),
        made once and kept across batches: a consumer per batch cost each batch its
        connection to the brokers (``ends_seconds``). It never joins its group nor
        commits, so keeping it holds no partition."""
        if self._consumer is None:
            self._consumer = make_consumer(self.config.kafka.librdkafka_config(),
                                           self.config.job.metadata_group_id)
        return self._consumer

    def close_offsets_consumer(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            try:
                consumer.close()
            except Exception as exc:  # closing a consumer whose brokers are gone
                log.debug("closing the offsets consumer failed: %s", exc)

    def recover(self, committed: Mapping[TopicPartition, Committed]) -> None:
        ranges, batch_id = self.recovery_ranges(committed)
        if not ranges:
            return
        logs.event(log, "recovery: completing the blocks of an interrupted batch",
                   partitions=[f"{t}[{p}] [{r.start}, {r.end})" for (t, p), r in
                               sorted(ranges.items())])
        reader = self.spark.read.format("kafka")
        for key, value in self._reader_options().items():
            if key != "failOnDataLoss":
                reader = reader.option(key, value)
        df = (
            reader.option("assign", assign_json(ranges))
            .option("startingOffsets", offsets_json({tp: r.start for tp, r in ranges.items()}))
            .option("endingOffsets", offsets_json({tp: r.end for tp, r in ranges.items()}))
            .option("failOnDataLoss", "true")
            .load()
        )
        summary = self.run_ranges(df, ranges, batch_id, "recovery")
        self._log_batch(summary, "recovery")

    def warn_slow_batch(self) -> None:
        """The watch's WARN line on a batch still running (``spark.watch``)."""
        running = self.watch.running
        if running is None:
            return
        logs.event(log, "batch still running", level=30, batch=running.batch_id,
                   kind=running.kind, seconds=round(self.watch.seconds()),
                   partitions=list(running.partitions),
                   tasks=stage_progress(self.spark) or "unknown",
                   waiting_for="its tasks: a task's own lines name the table, replica or "
                               "partition it retries; a task without a line is stuck in "
                               "its Python worker",
                   timeout=f"{self.watch.timeout:g}s (job.batch_timeout)")

    def cancel_overrun_batch(self) -> None:
        """Past ``job.batch_timeout``: cancel the batch's jobs, so that its collect
        fails with the watch's one-line error (:class:`BatchTimedOut`)."""
        if self.watch.running is None:
            return
        error = self.watch.timeout_error(stage_progress(self.spark))
        self.watch.timed_out = error
        logs.event(log, "batch timeout: cancelling it", level=40, error=error)
        self.spark.sparkContext.cancelAllJobs()

    # ------------------------------------------------------------------ batches

    def _planned(self, batch_id: int) -> dict[TopicPartition, PlannedRange]:
        ranges = self.offset_log.planned_ranges(batch_id)
        inexact = [tp for tp, r in ranges.items() if not r.exact_start]
        if inexact:
            low = {tp: lo for tp, (lo, _) in self._watermarks(inexact).items()}
            ranges = self.offset_log.planned_ranges(batch_id, earliest=low)
        return ranges

    def on_batch(self, df: Any, batch_id: int) -> None:
        """One micro-batch. A batch that was running when the stop was requested runs
        in full; one that Spark starts after it is refused at once
        (:class:`StoppedBeforeBatch`, nothing read or written), which ends the query:
        ``query.stop()`` would interrupt it wherever it is, and with a backlog Spark
        starts the next batch as soon as one ends."""
        with self._state:
            if self._stop_requested.is_set():
                logs.event(log, "batch not started: the stop was requested (the next "
                           "start runs it)", batch=batch_id)
                raise StoppedBeforeBatch(f"batch {batch_id} not started: stop requested")
            if self._restarting:
                logs.event(log, "batch not started: the query restarts with a new sizing "
                           "(the restarted query runs it)", batch=batch_id)
                raise StoppedBeforeBatch(f"batch {batch_id} not started: query restarts")
            self._in_batch = True
        started = time.time()
        try:
            ranges = self._planned(batch_id)
            planned = time.time()
            self.check_new_partitions(ranges)
            self.refresh_idle({tp: r for tp, r in ranges.items() if not r.empty})
            checked = time.time()
            summary = self.run_ranges(df, ranges, batch_id)
        except BaseException as exc:
            self.metrics.batches.labels("failed").inc()
            for code in re.findall(r"Code: (\d+)", str(exc))[:1]:
                self.metrics.clickhouse_errors.labels(code).inc()
            for reason in refusal_reasons(str(exc))[:1]:
                self.metrics.partitions_refused.labels(reason).inc()
            if self._stop_requested.is_set() and _cancelled(exc):
                logs.event(log, "batch cancelled by the stop (the next start replays it)",
                           level=30, batch=batch_id)
                raise
            self.batch_error = root_cause(exc)
            logs.event(log, "batch failed", level=40, batch=batch_id, error=self.batch_error)
            raise
        finally:
            with self._state:
                self._in_batch = False
        duration = time.time() - started
        summary.seconds = duration
        summary.plan_seconds = planned - started
        summary.checks_seconds = checked - planned
        self.metrics.batches.labels("ok").inc()
        self.metrics.batch_duration.observe(duration)
        self.metrics.last_batch_id.set(batch_id)
        self.metrics.last_batch_timestamp.set(time.time())
        self.batches.append(summary)
        self._log_batch(summary, "stream")
        self.check_dead_letter_rate(summary)
        self.plan_sizing()

    def plan_sizing(self) -> None:
        """After a batch: the sizing the last batches call for (``spark.sizing``); one
        worth a restart of the query is left for :meth:`wait` to apply between batches."""
        if self.sizing_goal.min_rows <= 0:
            return
        history = [BatchFigures(b.offsets, tuple(b.block_rows), b.seconds,
                                warm=b.fresh_workers == 0)
                   for b in self.batches[-SIZING_HISTORY:]]
        proposed = decide(self.sizing_goal, history)
        since = (None if self._sizing_changed_at is None
                 else time.monotonic() - self._sizing_changed_at)
        if should_apply(self.sizing, proposed, since):
            # from now on Spark's batches are refused until the query restarts: with a
            # backlog Spark starts the next batch at once, leaving no gap between them
            with self._state:
                self._resize_to = proposed
                self._restarting = True

    def _apply_sizing(self) -> None:
        """Restart the query with :attr:`_resize_to` between batches: batches Spark
        starts meanwhile are refused before they read anything (the restarted query
        runs them with the range their offset log recorded), and ``stop()`` is called
        only outside a trigger, as for the stop."""
        proposed = self._resize_to
        assert proposed is not None and self.query is not None
        with self._state:
            if self._in_batch:
                return
            self._restarting = True
        deadline = time.monotonic() + 30.0
        while (self.query.isActive and self._trigger_active()
               and time.monotonic() < deadline):
            time.sleep(0.05)
        self.query.stop()
        error = self.query.exception()
        with self._state:
            self._restarting = False
            self._resize_to = None
        if error is not None and not (_stop_ended(error) or _cancelled(error)):
            self.failure = error
            return
        logs.event(log, "sizing: restarting the query", reason=proposed.reason,
                   min_offsets_per_trigger=proposed.min_offsets,
                   max_trigger_delay=f"{proposed.max_trigger_delay:g}s",
                   previous=self.sizing.min_offsets)
        self.sizing = proposed
        self._sizing_changed_at = time.monotonic()
        self.restarts += 1
        self.start_query(self._starting)

    def check_dead_letter_rate(self, summary: BatchSummary) -> None:
        """Stop the job when the dead letters of the last ``dead_letters.window``
        batches are over ``max_rate`` (from ``min_messages`` messages on). The batch
        is delivered and committed already (its dead letters are in the table, once),
        so the query is stopped between batches and the job exits 1 with the reason."""
        try:
            self.dead_letter_rate.add(summary.dead_letters, summary.messages,
                                      summary.reasons, label=f"batch {summary.batch_id}")
        except DeadLetterRateExceeded as exc:
            logs.event(log, "dead-letter rate exceeded", level=40, batch=summary.batch_id,
                       error=str(exc))
            self.failure = exc
            self.request_stop("dead-letter rate exceeded")

    def _log_batch(self, summary: BatchSummary, kind: str) -> None:
        retried: dict[str, Any] = {"retried": summary.retried} if summary.retried else {}
        for warning in summary.warnings:
            logs.event(log, "foreign commit", level=30, batch=summary.batch_id,
                       warning=warning)
        logs.event(
            log, "batch", kind=kind, batch=summary.batch_id, run=f"{self.run_id:016x}",
            partitions=summary.partitions, messages=summary.messages, rows=summary.rows,
            bytes=summary.bytes, blocks=summary.blocks, replayed_blocks=summary.replayed_blocks,
            dead_letters=summary.dead_letters, skipped=summary.skipped,
            commits=summary.commits,
            **{name: round(getattr(summary, name), 3) for name in BATCH_LINE_SECONDS},
            fresh_workers=summary.fresh_workers, quorum_waits=summary.quorum_waits,
            **retried,
        )

    # ------------------------------------------------------------------ query

    def start_query(self, starting: str) -> Any:
        reader = self.spark.readStream.format("kafka")
        for key, value in self._reader_options().items():
            reader = reader.option(key, value)
        kind, value = self.config.subscription
        reader = reader.option(kind, value).option("startingOffsets", starting)
        if self.config.job.max_offsets_per_trigger is not None:
            reader = reader.option("maxOffsetsPerTrigger",
                                   str(self.config.job.max_offsets_per_trigger))
        for key, value in self.sizing.source_options().items():
            reader = reader.option(key, value)
        self._starting = starting
        df = reader.load()
        interval_ms = max(1, round(self.config.job.trigger_interval * 1000))
        self.query = (
            df.writeStream.foreachBatch(self.on_batch)
            .queryName(re.sub(r"\W", "_", self.config.job.name))
            .option("checkpointLocation", self.config.job.checkpoint_location)
            .trigger(processingTime=f"{interval_ms} milliseconds")
            .start()
        )
        return self.query

    def request_stop(self, reason: str = "requested") -> None:
        if not self._stop_requested.is_set():
            logs.event(log, "stop requested", reason=reason)
        self._stop_requested.set()

    def on_lock_lost(self, error: BaseException) -> None:
        """The lock's membership expired (``LockLost``, from the lock's thread): stop
        between batches and exit 1 with the reason, as for any failure."""
        self.failure = error
        self.request_stop("lock membership lost")

    def _trigger_active(self) -> bool:
        """Whether Spark is in a trigger: planning a micro-batch, in ``on_batch``, or
        writing its commit log after it. The stop calls ``query.stop()`` only outside
        one, since ``stop()`` interrupts whatever the trigger does (Hadoop then logs the
        interrupted checkpoint write with a Java trace). A trigger that starts a batch
        after the stop request ends the query by itself (:class:`StoppedBeforeBatch`)."""
        try:
            return bool(self.query is not None and self.query.status.get("isTriggerActive"))
        except Exception:  # the query ending under us: nothing runs any more
            return False

    def _update_lag(self) -> bool:
        """Lag gauges from the last progress; True when every partition is caught up."""
        progress = last_progress(self.query) if self.query else None
        if not progress or not progress.get("sources"):
            return False
        source = progress["sources"][0]
        latest = _offsets_of(source.get("latestOffset"))
        end = _offsets_of(source.get("endOffset"))
        if not latest or not end:
            return False
        caught_up = True
        for tp, top in latest.items():
            lag = max(0, top - end.get(tp, 0))
            self.metrics.lag.labels(tp[0], str(tp[1])).set(lag)
            caught_up = caught_up and lag == 0
        return caught_up

    def on_signal(self, name: str, origin: str) -> None:
        """A stop signal received by ``origin`` (``python`` or ``jvm``).

        A second signal *of one origin* means "now": exiting anywhere is safe (the
        next start replays). Ctrl-C reaches the Python driver only, since the JVM
        ignores SIGINT while the driver runs (:mod:`blockagg.spark.signals`). Before
        the query runs nothing needs finishing: the job stops at once, exit 0."""
        self._signals[origin] += 1
        if self._signals[origin] > 1:
            logs.event(log, "exiting at once", signal=name, origin=origin)
            os._exit(128 + signal.Signals[name].value)
        if self.query is None:
            logs.event(log, "stopped", signal=name, before="the query started",
                       run=f"{self.run_id:016x}")
            os._exit(0)
        self.request_stop(name)

    def install_signal_handlers(self) -> None:
        def handler(signum: int, frame: FrameType | None) -> None:
            self.on_signal(signal.Signals(signum).name, "python")

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handler)
        from blockagg.spark.signals import JvmSignals

        self.jvm_signals = JvmSignals(self.spark)
        self.jvm_signals.install(lambda name: self.on_signal(name, "jvm"))

    def start(self) -> None:
        """Checks, lock, recovery and query start (no waiting)."""
        check_speculation(self.spark)
        self.watchdog.start()
        self.acquire_lock()
        self.check_idle_interval()
        partitions, committed, _ = self.read_start()
        self.partitions.update(partitions)
        self.tables.ensure_checked(partitions)  # once: the start-up checks ran it
        self.recover(committed)
        if self.recovery_ranges(committed)[0]:
            _, committed, _ = self.read_start()
        resume = {tp: c.offset for tp, c in committed.items()}
        starting = starting_offsets_json(partitions, resume, self.config.job.starting_offsets)
        from_checkpoint = self.offset_log.has_offsets()
        logs.event(
            log, "starting query", run=f"{self.run_id:016x}",
            checkpoint=self.config.job.checkpoint_location,
            start="checkpoint" if from_checkpoint else "committed metadata",
            partitions=len(partitions), committed=len(committed),
            default=self.config.job.starting_offsets,
        )
        self.start_query(starting)

    def wait(self, until_caught_up: bool = False,
             should_stop: Callable[[Driver], bool] | None = None) -> int:
        """Watch the query until it ends or a stop is requested; the exit code."""
        assert self.query is not None
        stop_deadline: float | None = None
        stopped_here = False
        try:
            while True:
                if self._resize_to is not None and not self._stop_requested.is_set():
                    self._apply_sizing()
                if not self.query.isActive:
                    break
                self.caught_up = self._update_lag()
                if until_caught_up and self.caught_up:
                    self.request_stop("caught up")
                if should_stop is not None and should_stop(self):
                    self.request_stop("test")
                with self._state:
                    if not self._in_batch and not self._stop_requested.is_set():
                        self.refresh_idle()
                if self._stop_requested.is_set():
                    if stop_deadline is None:
                        stop_deadline = time.monotonic() + self.config.job.stop_timeout
                    with self._state:
                        busy = self._in_batch
                    busy = busy or self._trigger_active()
                    if not busy or time.monotonic() > stop_deadline:
                        if busy:
                            logs.event(log, "stop timeout: abandoning the running batch",
                                       level=30)
                        stopped_here = True
                        quiet_query_stop(self.spark)
                        self.query.stop()
                        break
                try:
                    self.query.awaitTermination(0.5)
                except Exception as exc:  # the query ended with an error
                    if self._resize_to is not None and _stop_ended(exc) and (
                            not self._stop_requested.is_set()):
                        continue  # a batch refused for the restart: restarted above
                    if self.failure is None and not _stop_ended(exc):
                        self.failure = exc
                    break
        finally:
            self.watchdog.stop()
            with self._state:
                in_batch = self._in_batch
            if not in_batch:  # an abandoned batch may still use it: the exit closes it
                self.close_offsets_consumer()
            if self.lock is not None:
                self.lock.release()
            if self.jvm_signals is not None:
                self.jvm_signals.restore()
        error = self.query.exception()
        if error is not None and self.failure is None and not _stop_ended(error):
            self.failure = error
        if stopped_here and self.failure is not None and _cancelled(self.failure):
            # a batch that started between the last check and query.stop() was
            # cancelled by the stop: abandoned like a kill -9, the next start replays it
            logs.event(log, "stop: abandoned the batch that had just started", level=30)
            self.failure = None
        if self.failure is not None:
            logs.event(log, "query failed", level=40,
                       error=self.batch_error or root_cause(self.failure))
            return 1
        logs.event(log, "stopped", batches=len(self.batches), run=f"{self.run_id:016x}")
        return 0


REFUSALS: dict[str, str] = {
    # BatchRefused subclasses (aggregator.core.exceptions) -> the metric's reason label
    "OffsetGap": "gap",
    "MetadataAheadOfPartition": "metadata_ahead",
    "BatchEndsInsideReplayBlock": "ends_inside_replay_block",
    "ReplayBlockMissing": "replay_block_missing",
    "MetadataContractViolation": "metadata_contract",
    "TopicIncarnationChanged": "topic_incarnation_changed",
    "PinsMismatch": "pins_mismatch",
    "TooManyBlocks": "too_many_blocks",
    # refused by the writer before a re-send (aggregator.clickhouse.structure)
    "ReplayAcrossAlter": "replay_across_alter",
    "ReplayBeyondDedupAge": "replay_beyond_dedup_age",
    # refused by the task at a partition's start (aggregator.clickhouse.stored)
    "CoordinatesInUse": "coordinates_in_use",
}


def refusal_reasons(text: str) -> list[str]:
    """The ``blockagg_batches_refused_total`` reasons named in a failed batch's error
    (it reaches the driver as text through Spark)."""
    return [label for name, label in REFUSALS.items() if re.search(rf"\b{name}\b", text)]


_PYTHON_ERROR = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Z]\w*): (.+)$", re.M)


def _stop_ended(exc: BaseException) -> bool:
    """Whether the query ended because :meth:`Driver.on_batch` refused a batch that
    started after the stop request (the stop itself, not a failure)."""
    return StoppedBeforeBatch.__name__ in str(getattr(exc, "desc", None) or exc)


def _cancelled(exc: BaseException) -> bool:
    """Whether a query's error is the cancellation of its running jobs by ``stop()``:
    Spark cancels the job group and interrupts the batch's thread, which surfaces as a
    cancelled job, an ``InterruptedException`` or, inside a blocking read (the offset
    log, a socket), a ``ClosedByInterruptException``."""
    text = str(getattr(exc, "desc", None) or exc)
    return re.search(r"cancel|interrupt", text, re.I) is not None


def root_cause(exc: BaseException) -> str:
    """One line for a failed batch or query: the blockagg error a task or
    ``foreachBatch`` raised last (:func:`refusal_in`; Spark wraps it in Java and Python
    traces), else the innermost Python error, else :func:`short_error`; the server's
    stack trace cut off."""
    log.debug("error details", exc_info=exc)
    text = str(getattr(exc, "desc", None) or exc)
    refusal = refusal_in(text)
    if refusal is not None:
        return " ".join(re.split(r"\.?\s*Stack trace:", refusal)[0].split())[:2000]
    frames = [m for m in _PYTHON_ERROR.finditer(text)
              if not m.group(1).endswith(("Exception", "Warning")) or "blockagg" in m.group(0)]
    if "Traceback (most recent call last)" in text and frames:
        last = frames[-1]
        message = re.split(r"\.?\s*Stack trace:", last.group(2))[0]
        return f"{last.group(1)}: {' '.join(message.split())}"[:2000]
    return f"{type(exc).__name__}: {short_error(exc)}"


def short_error(exc: BaseException, limit: int = 4000) -> str:
    """An error on one line: a Java/Python trace or a server's stack trace cut off
    (the whole error is logged at DEBUG)."""
    log.debug("error details", exc_info=exc)
    text = str(getattr(exc, "desc", None) or exc)
    refusal = refusal_in(text)
    if refusal is not None:
        return refusal[:2000]
    text = re.split(r"\n\s*at |\n\tat |Traceback \(most recent|\.?\s*Stack trace:", text)[0]
    return " ".join(text.split())[:limit]


def spark_log_level() -> str | None:
    """Spark's (log4j's) level: WARN unless blockagg logs at DEBUG (then INFO) or the
    user chose one (``--conf spark.log.level``). Set on the running JVM at once, so
    the SparkContext's start-up is quiet too; None when the user's choice stands."""
    from pyspark import SparkConf, SparkContext

    debug = logging.getLogger().getEffectiveLevel() <= logging.DEBUG
    level = "INFO" if debug else "WARN"
    try:
        SparkContext._ensure_initialized()
        if SparkConf().contains("spark.log.level"):
            return None
        jvm: Any = SparkContext._jvm
        jvm.org.apache.logging.log4j.core.config.Configurator.setRootLevel(
            jvm.org.apache.logging.log4j.Level.getLevel(level))
    except Exception as exc:  # a JVM without log4j 2: Spark's own level still applies
        log.debug("setting log4j's root level failed: %s", exc)
    return level


def make_spark(config: Config, extra_conf: Mapping[str, str] | None = None,
               builder: Any = None) -> Any:
    from pyspark.sql import SparkSession

    b = builder or SparkSession.builder
    b = b.appName(config.job.name)
    spark_level = spark_log_level()
    for key, value in session_defaults(spark_level).items():
        b = b.config(key, value)
    for key, value in (extra_conf or {}).items():
        b = b.config(key, value)
    spark = b.getOrCreate()
    check_speculation(spark)
    if spark_level == "WARN":
        quiet_spark_loggers(spark)
    return spark


def session_defaults(spark_level: str | None) -> dict[str, str]:
    """What the job sets on its session unless the user set it (``--conf``): Spark's
    log level, the Python workers' log level and format (the driver's, so one format
    across driver and executors), no adaptive execution (streaming has none), and no
    console progress bar ever (it fills a job's log with ``[Stage 1:===>`` lines)."""
    from pyspark import SparkConf

    user = SparkConf()
    wanted = {f"spark.executorEnv.{k}": v for k, v in logs.worker_env().items()}
    # streaming queries run without adaptive execution; Spark warns at each start
    # that it turned it off
    wanted["spark.sql.adaptive.enabled"] = "false"
    if spark_level is not None:
        wanted["spark.log.level"] = spark_level
    chosen = {k: v for k, v in wanted.items() if not user.contains(k)}
    # a shell's default, not the user's choice: pyspark's launcher turns it on
    chosen["spark.ui.showConsoleProgress"] = "false"
    return chosen


QUIET_SPARK_LOGGERS = {
    # A failed task's or query's Java and Python traces, printed again and again: the
    # driver logs the failure as one line ("batch failed", "query failed") and the
    # task logs why it failed as one line ("task attempt failed").
    "org.apache.spark.executor.Executor": "OFF",
    "org.apache.spark.sql.execution.streaming.MicroBatchExecution": "OFF",
    "org.apache.spark.sql.execution.streaming.StreamExecution": "OFF",
    # "Lost task ... (the whole trace)" per failed attempt; its ERROR "failed N times;
    # aborting job" stays.
    "org.apache.spark.scheduler.TaskSetManager": "ERROR",
    # "Current batch is falling behind": the batch lines carry each batch's duration.
    "org.apache.spark.sql.execution.streaming.ProcessingTimeExecutor": "ERROR",
    # A failed batch's other tasks are killed; their Kafka consumers, interrupted while
    # closing, log an ERROR with ~80 Java frames each ("Failed to close fetcher",
    # "Error closing Kafka consumer"): the consumer is dropped either way.
    "org.apache.kafka.clients.consumer.internals.ClassicKafkaConsumer": "OFF",
    "org.apache.spark.sql.kafka010.consumer.InternalKafkaConsumerPool"
    "$CustomSwallowedExceptionListener": "OFF",
}


def quiet_query_stop(spark: Any) -> None:
    """``query.stop()`` cancels the query's job group whether a job runs or not, and
    Spark's scheduler warns when none did ("Failed to cancel job group ... Cannot find
    active jobs for it"): a clean stop is no warning. The job is stopping, so its
    scheduler stays at ERROR (not at ``--log-level DEBUG``)."""
    if logging.getLogger().getEffectiveLevel() <= logging.DEBUG:
        return
    try:
        jvm = spark.sparkContext._jvm
        jvm.org.apache.logging.log4j.core.config.Configurator.setLevel(
            "org.apache.spark.scheduler.DAGScheduler", jvm.org.apache.logging.log4j.Level.ERROR)
    except Exception as exc:  # a JVM without log4j 2
        log.debug("quieting Spark's scheduler failed: %s", exc)


def quiet_spark_loggers(spark: Any) -> None:
    """Spark's traces and notices that need no action only at DEBUG (``--log-level
    DEBUG`` leaves every logger on)."""
    try:
        jvm = spark.sparkContext._jvm
        for name, level in QUIET_SPARK_LOGGERS.items():
            jvm.org.apache.logging.log4j.core.config.Configurator.setLevel(
                name, jvm.org.apache.logging.log4j.Level.getLevel(level))
    except Exception as exc:  # a JVM without log4j 2: the traces stay
        log.debug("quieting Spark's loggers failed: %s", exc)

