"""The per-partition task: one Kafka partition's rows of one micro-batch -> one
aggregator run -> one report dict for the driver.

``run_arrow_partition(ctx, batches)`` is the ``mapInArrow`` function (the default
hand-over, ``job.handover = "arrow"``: columns straight from Arrow, no Python object per
record) and ``run_partition(ctx, rows)`` the ``rdd.mapPartitions`` one (``"rows"``: a
pickled ``Row`` per record); both feed :func:`run_range` the same lists. The Kafka source
gives each Kafka topic-partition range its own Spark partition (``minPartitions`` and
``maxRecordsPerPartition`` are refused by the configuration), in offset order; the
task checks both and refuses rows that break them.

An attempt (``_run_attempt``) runs the stages straight down, each handing the next a
value (docs/architecture.md): the partition's last commit FIRST; the rows stage's
:func:`~rows.partition.prepare_partition` (envelopes, the pins the batch must be
prepared under: :func:`current_pins`, then a replay keeps its intent's registry
position, topic incarnation and deduplication mode; the registry view, decoded columns,
dead letters, abandoned blocks) -> :class:`Batch`; :func:`plan_partition` (the checks
that need the shard, then the core's plan) -> ``Plan``; the core's ``run_batch`` with the
shard's writer as the sink -> ``BatchReport``; :func:`task_report` -> the report.
What the stages need of the adapters is passed in from the components here.
``run_range(ctx, tp, [])`` is the same for a planned range without a visible row (only
transaction markers or aborted records): the driver runs it, so the final metadata of
that range is still committed.

Above 500 lines because it is the task's whole contract with Spark: both hand-overs (Arrow
and rows), the attempt and its fencing, and the report; each stage it calls lives elsewhere.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from blockagg import logs
from blockagg.aggregator.core.metadata import (
    DedupMode,
    Pins,
)
from blockagg.aggregator.core.model import (
    Batch,
    Block,
    BlockShare,
    BlockSink,
    BuildAheadSink,
    Committed,
    MetadataStore,
    Thresholds,
)
from blockagg.aggregator.core.protocol import (
    BatchReport,
    Plan,
    plan_batch,
    read_committed,
    run_batch,
)
from blockagg.config import Config, TopicConfig
from blockagg.proto.envelope import (
    Envelopes,
    JoinedValues,
    Parsed,
    Rejected,
)
from blockagg.rows.deadletters import DeadLetter
from blockagg.rows.partition import positioned, prepare_partition
from blockagg.rows.prepare import Plans
from blockagg.spark.components import (
    Attempt,
    Components,
    cached,
    describer,
    insert_lanes,
    open_attempt,
)
from blockagg.spark.exceptions import TaskContractError
from blockagg.spark.heap import keep_heap
from blockagg.spark.offsets import PlannedRange, TopicPartition
from blockagg.spark.zip_imports import keep_zip_directories

_log = logs.get("task")


@dataclass(frozen=True)
class TaskContext:
    """Everything a task needs, pickled into it by the driver (small)."""

    config: Config
    components: Components
    ranges: dict[TopicPartition, PlannedRange]
    batch_id: int
    run_id: int
    partition_ends: Mapping[TopicPartition, int] = field(default_factory=dict)
    """Each partition's log-end offset as the driver read it after planning the batch
    (``Batch.partition_end``)."""
    shard_partitions: Mapping[str, int] = field(default_factory=dict)
    """For each topic, ``P``: the partitions of every topic writing its shard, as the
    driver counted them (``aggregator.clickhouse.dedup_window.shard_partitions``); a
    topic without it has no guard (:func:`block_shares`)."""
    structure_marks: Mapping[str, int] = field(default_factory=dict)
    """For each topic whose shard deduplicates by content hash, ``Pins.structure`` as the
    driver read it before submitting the batch's tasks (:func:`structure_marks`); a topic
    without one has its mark read by each task (:func:`current_pins`)."""


def now_s() -> int:
    """The wall-clock time recorded as the first send of the blocks a plan forms
    (``Metadata.since_s``): seconds since the epoch."""
    return int(time.time())


def reason_label(reason: str) -> str:
    """A low-cardinality label for a dead-letter reason."""
    low = reason.lower()
    for needle, label in (
        ("not registered", "unregistered_table"),
        ("no value", "no_value"),
        ("does not decode", "bad_envelope"),
        ("is not 'database.table'", "bad_table_name"),
        ("no rows", "no_rows"),
        ("row", "bad_row"),
        ("schema", "schema"),
    ):
        if needle in low:
            return label
    return "other"


def live_columns(config: Config, topic: TopicConfig, table: str) -> Any:
    """The live columns of ``table`` on ``topic``'s shard, once the table is known to
    drop a retried block (``writer.check_tables``): raises
    :class:`~aggregator.clickhouse.exceptions.DedupNotConfigured` otherwise, which
    fails the task before anything of the batch is committed or inserted (the
    driver's startup check only warns about registered tables, since the registry
    may hold tables this job never receives), and ``TableNotFound`` refuses the batch
    too (a dead letter must not depend on the live server). The check also reads the
    table's deduplication window, which :func:`block_shares` judges and turns into the
    guard before the batch is planned, so a table registered after the start is judged
    before its first insert. Called once per table per ``[schemas] refresh_interval``
    per worker (``Plans`` caches). The columns are those the check read."""
    return live_columns_many(config, topic, [table])[table]


def live_columns_many(config: Config, topic: TopicConfig, tables: Sequence[str]
                      ) -> dict[str, Any]:
    """:func:`live_columns` of several tables with one check (a few queries per
    database instead of seven per table): what ``Plans.prefetch`` reads for a batch's
    tables whose live columns expired. Raises as :func:`live_columns` does, for the
    first table that fails its check."""
    writer = describer(config, topic)
    writer.check_tables(list(tables))
    return {t: writer.checked(t).columns for t in tables}


def block_shares(ctx: TaskContext, topic: TopicConfig, batch: Batch) -> tuple[BlockShare, ...]:
    """Each table of ``batch``'s share of its deduplication window
    (``Thresholds.max_blocks_per_table``): ``floor(W_t / (2 x P))`` with ``P`` from
    the driver (``ctx.shard_partitions``) and ``W_t`` as the worker last checked it
    (``components.dedup_windows``). A window holding no block (``W_t < 2 x P``) raises
    :class:`~aggregator.clickhouse.exceptions.DedupWindowTooSmall` before anything of
    the batch is committed or inserted, as at start; with ``clickhouse.
    allow_small_dedup_window`` that table has no guard. Tables whose window is unknown
    (components without ``dedup_windows``, a table not on the shard) have none."""
    from blockagg.aggregator.clickhouse.dedup_window import DedupNeed, judge_window

    partitions = ctx.shard_partitions.get(batch.topic)
    windows_of = getattr(ctx.components, "dedup_windows", None)
    if partitions is None or windows_of is None or not batch.tables:
        return ()
    windows = windows_of(ctx.config, topic, sorted(set(batch.tables.values())))
    need = DedupNeed(partitions)
    shares = []
    for table_id, name in sorted(batch.tables.items()):
        window = windows.get(name)
        if window is None or judge_window(
                name, window.setting, window.blocks, need,
                ctx.config.clickhouse.allow_small_dedup_window) is not None:
            continue
        shares.append(BlockShare(table_id, window.blocks, partitions))
    return tuple(shares)


def current_pins(components: Any, config: Config, topic: TopicConfig, name: str,
                 registry: Any, parsed: Sequence[Parsed | Rejected] | Envelopes,
                 timestamps_ms: Sequence[int], driver_mark: int = 0) -> Pins:
    """What a batch that replays nothing is prepared under now.

    * ``registry``: 1 + the registry topic's end offset the worker's snapshot covers,
      checked first when ``[schemas] refresh_interval`` has passed or a message needs
      a newer snapshot (:func:`blockagg.rows.prepare.needs_newer`);
    * ``incarnation``: ``incarnation_of(cluster id, topic id)``, read from Kafka;
    * ``dedup``: the shard's server mode (token or content hash);
    * ``structure``: under content hash, the ZooKeeper mark of the columns of every
      registered table and the dead-letter table, read before any first attempt:
      ``driver_mark`` when the driver read one for the batch, else read here.

    Components without ``incarnation``/``dedup_mode`` (test doubles) leave those 0,
    and a registry without positions leaves ``registry`` 0: unpinned, as before."""
    from blockagg.proto.registry import registry_pin
    from blockagg.rows.prepare import needs_newer, needs_newer_any

    position = 0
    if positioned(registry):
        snapshot = registry.current()
        if isinstance(parsed, Envelopes):
            newer = needs_newer_any(snapshot, parsed, np.asarray(timestamps_ms, dtype=np.int64))
        else:
            newer = any(isinstance(p, Parsed) and needs_newer(snapshot, p.table, p.version, ts)
                        for p, ts in zip(parsed, timestamps_ms, strict=True))
        position = registry_pin(registry.position(newer))
    incarnation = getattr(components, "incarnation", None)
    dedup = getattr(components, "dedup_mode", None)
    mode = int(dedup(config, topic)) if dedup else 0
    mark = getattr(components, "structure_mark", None)
    structure = 0
    if mode == DedupMode.BLOCK_HASH and driver_mark > 0:
        structure = driver_mark
    elif mark and mode == DedupMode.BLOCK_HASH:
        structure = int(mark(config, topic, registered_tables(config, registry)))
    return Pins(registry=position,
                incarnation=int(incarnation(config, name)) if incarnation else 0,
                dedup=mode, structure=structure)


def structure_marks(components: Any, config: Config, topics: Iterable[str]) -> dict[str, int]:
    """``Pins.structure`` of each of ``topics`` whose shard deduplicates by content
    hash, read once by the driver before a batch's tasks are submitted, so that a
    batch reads the shard's ZooKeeper once and not once per task (a new Python worker
    reads every table's ``columns`` nodes).

    Read before the tasks start, a mark is at most the one a task would read, and still
    at or above each covered table's last change then: any later change, and the
    table of a worker whose registry knows more tables, is only checked more often on a
    re-send, never less (:mod:`aggregator.clickhouse.structure`). A topic whose mark is
    0 (no table replicated in the driver's view) or can't be read now is left out: its
    tasks read their own, which retries and fails the task as before."""
    mark = getattr(components, "structure_mark", None)
    dedup = getattr(components, "dedup_mode", None)
    if mark is None or dedup is None:
        return {}
    marks: dict[str, int] = {}
    for name in sorted(set(topics)):
        topic = config.topic_for(name)
        try:
            if int(dedup(config, topic)) != DedupMode.BLOCK_HASH:
                continue
            tables = registered_tables(config, components.registry(config))
            value = int(mark(config, topic, tables))
        except Exception as exc:  # the tasks read it themselves, with their retries
            logs.event(_log, "structure mark not read by the driver (each task reads it)",
                       level=30, topic=name, error=f"{type(exc).__name__}: {exc}"[:500])
            continue
        if value > 0:
            marks[name] = value
    return marks


def registered_tables(config: Config, registry: Any) -> list[str]:
    """Every table a batch of the topic may write: the registry's tables and the
    dead-letter table (those the structure mark covers)."""
    tables = registry.current().tables().values() if positioned(registry) else (
        getattr(registry, "tables", {}))
    return sorted({*tables, config.dead_letters.table})


def refuse_stored_coordinates(components: Any, config: Config, topic: TopicConfig,
                              registry: Any, batch: Batch, committed: Committed | None) -> None:
    """Refuse a partition that starts without a blockagg commit (none, or one written
    by a tool: the ``TopicIncarnationChanged`` recovery, a first start, an operator's
    reset) into tables that already hold rows of it from its resume offset on and can't
    tell them from its own: no ``_incarnation`` column, under content-hash
    deduplication (``aggregator.clickhouse.stored``). Raises
    :class:`~aggregator.clickhouse.exceptions.CoordinatesInUse` before anything is
    committed or inserted. Asked once per partition start, not per batch: from the
    partition's first commit on, every row at its coordinates is this job's."""
    from blockagg.aggregator.clickhouse.exceptions import CoordinatesInUse
    from blockagg.aggregator.clickhouse.stored import coordinates_in_use_error

    if batch.pins.dedup != DedupMode.BLOCK_HASH or config.clickhouse.allow_stored_coordinates:
        return
    resumption = read_committed(committed)
    if resumption.metadata is not None and resumption.foreign is None:
        return
    stored = getattr(components, "stored_coordinates", None)
    if stored is None:
        return
    start = batch.start if resumption.resume is None else resumption.resume
    if batch.end <= start:
        return
    found = stored(config, topic, registered_tables(config, registry), batch.topic,
                   batch.partition, start)
    if found:
        raise CoordinatesInUse(coordinates_in_use_error(batch.topic, batch.partition, start,
                                                        found))


def _error_code(exc: BaseException) -> str | None:
    code = getattr(exc, "code", None)
    return str(code) if isinstance(code, int) else None


class _MeasuredStore:
    def __init__(self, inner: MetadataStore) -> None:
        self.inner = inner
        self.seconds: list[float] = []
        self.failures = 0

    def committed(self, topic: str, partition: int) -> Committed | None:
        return self.inner.committed(topic, partition)

    def commit(self, topic: str, partition: int, offset: int, metadata: str) -> None:
        start = time.perf_counter()
        try:
            self.inner.commit(topic, partition, offset, metadata)
        except Exception:
            self.failures += 1
            raise
        self.seconds.append(time.perf_counter() - start)


class _MeasuredSink:
    """Figures of the inserts; ``insert`` may run on several insert lanes at once."""

    def __init__(self, inner: BlockSink) -> None:
        self.inner = inner
        self._lock = threading.Lock()
        self.seconds: list[tuple[str, float]] = []
        self.inserted: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
        self.block_rows: list[int] = []
        self.errors: dict[str, int] = defaultdict(int)
        self._waits_before = self._waits()

    def _waits(self) -> int:
        return int(getattr(self.inner, "quorum_waits", 0))

    @property
    def quorum_waits(self) -> int:
        """Inserts of this task sent again behind another insert's pending quorum (the
        writer is this worker's and runs one task at a time)."""
        return self._waits() - self._waits_before

    def build_ahead(self, blocks: Sequence[Block], batch: Batch) -> None:
        if isinstance(self.inner, BuildAheadSink):
            self.inner.build_ahead(blocks, batch)

    def insert(self, block: Block, batch: Batch, confirmed_at: float | None = None) -> None:
        start = time.perf_counter()
        try:
            self.inner.insert(block, batch, confirmed_at)
        except Exception as exc:
            code = _error_code(exc)
            if code is not None:
                with self._lock:
                    self.errors[code] += 1
            raise
        with self._lock:
            self.seconds.append((block.table, time.perf_counter() - start))
            figures = self.inserted[block.table]
            figures[0] += block.rows
            figures[1] += block.size
            figures[2] += 1
            figures[3] += int(block.replay)
            self.block_rows.append(block.rows)


def run_range(
    ctx: TaskContext,
    tp: TopicPartition,
    offsets: Sequence[int],
    values: Sequence[bytes | None],
    timestamps_ms: Sequence[int],
) -> dict[str, Any]:
    """Run the protocol over one planned range; return the report dict."""
    logs.setup_worker()
    keep_heap()
    keep_zip_directories()
    started = time.time()
    config = ctx.config
    rng = ctx.ranges.get(tp)
    if rng is None:
        raise TaskContractError(
            f"{tp[0]}[{tp[1]}]: rows arrived for a partition without a planned range in batch "
            f"{ctx.batch_id}; the offset log and the source disagree"
        )
    if offsets and (
        (rng.exact_start and offsets[0] < rng.start) or offsets[-1] >= rng.end
    ):
        raise TaskContractError(
            f"{tp[0]}[{tp[1]}]: rows [{offsets[0]}, {offsets[-1]}] fall outside the planned "
            f"range [{rng.start}, {rng.end}) of batch {ctx.batch_id}"
        )
    try:
        # Fence every older attempt at this partition before reading anything (invariant 6).
        attempt = open_attempt(ctx.components.store(config), tp[0], tp[1])
        try:
            return _run_attempt(ctx, tp, rng, offsets, values, timestamps_ms, attempt,
                                started)
        finally:
            if attempt is not None:
                attempt.close()
    except Exception as exc:
        _log_failed_attempt(ctx, tp, exc)
        raise


def _log_failed_attempt(ctx: TaskContext, tp: TopicPartition, exc: BaseException) -> None:
    """One line per failed task attempt, in the log of the process that ran it: Spark's
    own "Lost task" warning (the whole Java and Python trace) is quieted
    (``driver.QUIET_SPARK_LOGGERS``), and the driver learns of an attempt that failed
    and was retried only from Spark. The trace is at DEBUG."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())[:1000]
    logs.event(_log, "task attempt failed", level=30, batch=ctx.batch_id,
               partition=f"{tp[0]}[{tp[1]}]", attempt=spark_attempt(), error=text)
    _log.debug("task attempt failed", exc_info=exc)


def spark_attempt() -> int:
    """Which attempt of its Spark task this is (1 for the first; 1 outside a task)."""
    try:
        from pyspark import TaskContext as SparkTask

        spark_task = SparkTask.get()
        return 1 + (spark_task.attemptNumber() if spark_task is not None else 0)
    except Exception:  # not in a Spark task (the driver runs empty ranges itself)
        return 1


def _run_attempt(
    ctx: TaskContext,
    tp: TopicPartition,
    rng: PlannedRange,
    offsets: Sequence[int],
    values: Sequence[bytes | None],
    timestamps_ms: Sequence[int],
    attempt: Attempt | None,
    started: float,
) -> dict[str, Any]:
    """One attempt at the partition, one stage after another, each handing the next a
    value: the last commit (first: a replay must be prepared under its intent's pins)
    -> the rows stage's :class:`Batch` -> the core's plan -> its run -> the report."""
    config = ctx.config
    registry = ctx.components.registry(config)
    topic_config = config.topic_for(tp[0])
    store = _MeasuredStore(attempt or ctx.components.store(config))
    sink = _MeasuredSink(ctx.components.sink(config, topic_config))
    committed = store.committed(tp[0], tp[1])
    preparing = time.time()
    batch = prepare_partition(
        rng, offsets, values, timestamps_ms, committed, registry,
        pins_now=lambda parsed, stamps: current_pins(
            ctx.components, config, topic_config, tp[0], registry, parsed, stamps,
            ctx.structure_marks.get(tp[0], 0)),
        plans=lambda: worker_plans(config, topic_config, registry),
        dead_letter_table=config.dead_letters.table,
        missing_blocks=config.job.dead_letter_missing_blocks,
        partition_end=ctx.partition_ends.get(tp))
    plan = plan_partition(ctx, topic_config, registry, batch, committed, attempt)
    prepared = time.time() - preparing
    report = run_batch(plan, store, sink, attempt, insert_lanes(config))
    return task_report(tp, batch, report, store, sink, config.dead_letters.table, started,
                       prepared)


def worker_plans(config: Config, topic: TopicConfig, registry: Any) -> Plans:
    """This worker's decode plans for ``topic`` over ``registry`` (one per worker
    process, :func:`~spark.components.cached`): the live columns each version is
    checked against come from the shard's tables through :func:`live_columns`, which
    also checks that a table drops a retried block."""
    plans: Plans = cached(
        ("plans", topic.label, str(id(registry))),
        lambda: Plans(registry.current(),
                      columns=lambda table: live_columns(config, topic, table),
                      columns_ttl_s=config.schemas.refresh_interval,
                      columns_many=lambda tables: live_columns_many(config, topic, tables)),
    )
    return plans


def plan_partition(ctx: TaskContext, topic: TopicConfig, registry: Any, batch: Batch,
                   committed: Committed | None, attempt: Attempt | None) -> Plan:
    """The core's plan of ``batch`` (:func:`~aggregator.core.protocol.plan_batch`), once
    the checks that need the shard have passed: a partition starting without a blockagg
    commit into tables holding rows at its coordinates is refused
    (:func:`refuse_stored_coordinates`), and each table's blocks are bounded by its
    share of the deduplication window (:func:`block_shares`). Both raise before anything
    of the batch is committed or inserted. The dead-letter rate is judged by the driver
    over whole batches (a window of them, from dead_letters.min_messages on), after
    they are delivered: a partition's share alone says little (1 bad message of 1 is
    100%)."""
    config = ctx.config
    refuse_stored_coordinates(ctx.components, config, topic, registry, batch, committed)
    thresholds = Thresholds(config.blocks.max_rows, config.blocks.max_bytes,
                            config.job.offset_metadata_max_bytes,
                            block_shares(ctx, topic, batch))
    return plan_batch(batch, committed, thresholds, ctx.run_id, ctx.batch_id,
                      attempt=attempt.nonce if attempt is not None else 0, now_s=now_s())


def task_report(tp: TopicPartition, batch: Batch, report: BatchReport, store: _MeasuredStore,
                sink: _MeasuredSink, dead_letter_table: str, started: float,
                prepare_seconds: float) -> dict[str, Any]:
    """The report dict the driver aggregates: the run's figures, each table's consumed
    rows and bytes, the dead letters by reason, the commits' and inserts' timings, and
    the time it took to prepare the batch and plan its blocks (``prepare_seconds``)."""
    consumed: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    dead_letters: dict[str, int] = defaultdict(int)
    ids, owner = np.unique(batch.table_ids, return_inverse=True)
    rows = np.bincount(owner, weights=batch.row_counts, minlength=ids.size)
    sizes = np.bincount(owner, weights=batch.sizes, minlength=ids.size)
    for k, table_id in enumerate(ids.tolist()):
        name = batch.tables[table_id]
        consumed[name][0] += int(rows[k])
        consumed[name][1] += int(sizes[k])
        if name != dead_letter_table:
            continue
        for i in np.flatnonzero(batch.table_ids == table_id).tolist():
            message = batch.payloads[i]
            dead_letters[reason_label(message.error) if isinstance(message, DeadLetter)
                         else "other"] += 1
    return {
        "topic": tp[0],
        "partition": tp[1],
        "start": batch.start,
        "end": batch.end,
        "resume": report.resume,
        "skipped": report.skipped,
        "messages": len(batch),
        "blocks": report.blocks,
        "replayed_blocks": report.replayed_blocks,
        "rows": report.rows,
        "bytes": report.bytes,
        "commits": report.commits,
        "warning": report.warning,
        "consumed": dict(consumed),
        "inserted": dict(sink.inserted),
        "block_rows": sink.block_rows,
        "insert_seconds": sink.seconds,
        "commit_seconds": store.seconds,
        "commit_failures": store.failures,
        "dead_letters": dict(dead_letters),
        "clickhouse_errors": dict(sink.errors),
        "quorum_waits": sink.quorum_waits,
        "seconds": time.time() - started,
        "prepare_seconds": prepare_seconds,
        "attempt": spark_attempt(),
    }


def _one_partition(current: TopicPartition | None, tp: TopicPartition) -> TopicPartition:
    if current is not None and tp != current:
        raise TaskContractError(
            f"one Spark partition holds rows of {current[0]}[{current[1]}] and "
            f"{tp[0]}[{tp[1]}]: a Kafka partition range must be one Spark partition "
            "(remove minPartitions/maxRecordsPerPartition, do not repartition)"
        )
    return tp


def _out_of_order(tp: TopicPartition, before: int, after: int) -> TaskContractError:
    return TaskContractError(
        f"{tp[0]}[{tp[1]}]: offsets out of order ({before} then {after}): a "
        "Kafka partition's rows must reach the aggregator in offset order"
    )


@dataclass(frozen=True, slots=True)
class Records:
    """One task's Kafka records, as :func:`run_range` takes them (offset order)."""

    tp: TopicPartition
    offsets: list[int]
    values: Sequence[bytes | None]
    timestamps_ms: list[int]


def records_from_rows(rows: Iterable[Any]) -> Records | None:
    """The records of ``rdd.mapPartitions`` rows (topic, partition, offset, value,
    timestamp); ``None`` for none. Refuses a second partition or offsets out of order."""
    current: TopicPartition | None = None
    offsets: list[int] = []
    values: list[bytes | None] = []
    stamps: list[int] = []
    for row in rows:
        current = _one_partition(current, (row[0], row[1]))
        offset = int(row[2])
        if offsets and offset <= offsets[-1]:
            raise _out_of_order(current, offsets[-1], offset)
        offsets.append(offset)
        value = row[3]
        values.append(bytes(value) if value is not None else None)
        stamp = row[4]
        stamps.append(int(stamp.timestamp() * 1000) if stamp is not None else 0)
    return None if current is None else Records(current, offsets, values, stamps)


def records_from_arrow(batches: Iterable[pa.RecordBatch]) -> Records | None:
    """The records of ``mapInArrow`` record batches with the same columns; the same
    refusals. The values stay in Arrow's layout, copied once into one buffer
    (:class:`~proto.envelope.JoinedValues`), not into a Python object each.
    Timestamps are Kafka's milliseconds, which Spark keeps as microseconds: the
    division is exact."""
    current: TopicPartition | None = None
    offsets: list[int] = []
    values: list[pa.Array] = []
    stamps: list[int] = []
    for batch in batches:
        if batch.num_rows == 0:
            continue
        for topic in pc.unique(batch.column("topic")).to_pylist():
            for part in pc.unique(batch.column("partition")).to_pylist():
                current = _one_partition(current, (topic, int(part)))
        assert current is not None
        batch_offsets = batch.column("offset").to_numpy(zero_copy_only=False)
        before = (np.concatenate(([offsets[-1]], batch_offsets[:-1])) if offsets
                  else batch_offsets[:-1])
        after = batch_offsets if offsets else batch_offsets[1:]
        wrong = np.flatnonzero(after <= before)
        if wrong.size:
            raise _out_of_order(current, int(before[wrong[0]]), int(after[wrong[0]]))
        offsets.extend(batch_offsets.tolist())
        values.append(batch.column("value"))
        micros = pc.cast(batch.column("timestamp"), pa.int64()).fill_null(0)
        stamps.extend((micros.to_numpy() // 1000).tolist())
    return (None if current is None
            else Records(current, offsets, JoinedValues.from_arrow(values), stamps))


def run_partition(ctx: TaskContext, rows: Iterable[Any]) -> Iterator[dict[str, Any]]:
    """``mapPartitions`` function: rows are (topic, partition, offset, value, timestamp)."""
    entered = time.time()
    records = records_from_rows(rows)
    read = time.time() - entered
    if records is not None:
        yield _timed(run_range(ctx, records.tp, records.offsets, records.values,
                               records.timestamps_ms), entered, read)


_WORKER_TASKS = [0]
"""Tasks this Python worker process ran before the current one (Spark reuses a worker
across tasks and batches unless ``spark.python.worker.reuse`` is off)."""


def _timed(report: dict[str, Any], entered: float, read: float) -> dict[str, Any]:
    """The report with when the task's Python function started (``entered``, epoch
    seconds), how long it waited for its rows before the protocol ran
    (``read_seconds``: the Kafka fetch in the JVM and the handover to Python) and
    whether its Python worker was new (``fresh_worker``: it imported the job's code
    for this task), so the batch line tells Spark's part of a task from ours
    (``seconds``)."""
    report["entered"] = entered
    report["read_seconds"] = read
    report["fresh_worker"] = _WORKER_TASKS[0] == 0
    _WORKER_TASKS[0] += 1
    return report


REPORT_SCHEMA = "report binary"
"""The schema of :func:`run_arrow_partition`'s output: one pickled report per task."""


def run_arrow_partition(ctx: TaskContext,
                        batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` function over record batches of (topic, partition, offset, value,
    timestamp), in offset order; yields one batch holding the pickled report."""
    entered = time.time()
    records = records_from_arrow(batches)
    read = time.time() - entered
    if records is None:
        return
    report = _timed(run_range(ctx, records.tp, records.offsets, records.values,
                              records.timestamps_ms), entered, read)
    yield pa.RecordBatch.from_pydict(
        {"report": [pickle.dumps(report, protocol=pickle.HIGHEST_PROTOCOL)]},
        schema=pa.schema([("report", pa.binary())]))
