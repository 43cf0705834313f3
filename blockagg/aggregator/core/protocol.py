"""The REPLAY -> CONSUME protocol for one topic-partition and one micro-batch.

The protocol is pure: :func:`plan_batch` turns the batch, the last commit of the
partition, the thresholds and the writer's ids into a :class:`Plan`, an ordered list
of small frozen operations (:class:`CommitMetadata`, :class:`InsertBlock`) plus the
figures of the batch. Iterating a plan yields its operations; :func:`run_batch` is
the thin runner that executes them against a :class:`MetadataStore` (Kafka) and a
:class:`BlockSink` (ClickHouse). ``docs/protocol.md`` states the rules and why they
hold; in short:

* **Refuse, never guess**: every refusal (gap, metadata ahead of the partition, batch
  ending inside a replay block, replay block missing, contract violation, metadata
  too large, more blocks of a table than its share of the deduplication window) is
  decided while planning, so a refused batch commits and inserts
  nothing.
* **Intent before flush**: each seal event commits metadata describing its blocks,
  with a resume offset at or below every block not yet acknowledged and every
  buffered message, *before* any of those blocks is inserted.
* **Deterministic blocks**: blocks are a pure function of the batch, the committed
  metadata and the thresholds, so a retry rebuilds the blocks of the committed
  metadata identically (same rows, order and deduplication token).

Above 500 lines because the plan and its runner share the invariants stated here; splitting
them would separate each rule from the code that keeps it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Final

import numpy as np

from blockagg.aggregator.core.blocks import REPLAY_EVENT, Formation, form_blocks
from blockagg.aggregator.core.exceptions import (
    BatchEndsInsideReplayBlock,
    MetadataAheadOfPartition,
    MetadataContractViolation,
    MetadataDecodeError,
    OffsetGap,
    PinsMismatch,
    ReplayBlockMissing,
    TooManyBlocks,
    TopicIncarnationChanged,
)
from blockagg.aggregator.core.metadata import (
    DEAD_LETTER_TABLE_ID,
    BlockRange,
    Metadata,
    Pins,
    decode,
    encode,
    is_blockagg,
)
from blockagg.aggregator.core.model import (
    BATCHES_IN_FLIGHT,
    Batch,
    Block,
    BlockSink,
    BuildAheadSink,
    Committed,
    Fence,
    Lanes,
    MetadataStore,
    Thresholds,
)


@dataclass(frozen=True, slots=True)
class CommitMetadata:
    """Commit ``offset`` (the resume offset) with ``text`` (``metadata`` encoded)."""

    topic: str
    partition: int
    offset: int
    metadata: Metadata
    text: str


@dataclass(frozen=True, slots=True, eq=False)
class InsertBlock:
    """Insert ``block``; only ever yielded after a commit that lists it."""

    block: Block


Operation = CommitMetadata | InsertBlock


@dataclass(frozen=True, slots=True)
class Resumption:
    """Where the partition resumes, read from its last commit.

    ``resume`` is the resume offset (``None``: nothing committed yet), ``blocks`` the
    blocks to rebuild, ``foreign`` the warning when the last commit is not ours.
    ``metadata`` is the last commit's metadata when it is ours and in force.
    """

    resume: int | None
    blocks: tuple[BlockRange, ...] = ()
    foreign: str | None = None
    metadata: Metadata | None = None


def undecodable_commit(topic: str, partition: int, offset: int, error: MetadataDecodeError,
                       group: str = "the metadata group") -> str:
    """Why a partition whose last commit does not decode is refused, and what to do."""
    return (
        f"{topic}[{partition}]: the last commit of {group} (offset {offset}) carries "
        f"blockagg metadata that does not decode ({error}). The partition is refused: "
        "nothing of its batch is committed or inserted. "
        f"Inspect its history with arv verify --group ... --topic {topic}; to go on, commit "
        f"a position you know is delivered (kafka-consumer-groups.sh --reset-offsets "
        f"--topic {topic}:{partition} --to-offset N --execute), which the job reads as "
        "foreign metadata and resumes from without replay.")


def read_committed(committed: Committed | None) -> Resumption:
    """Interpret the partition's last commit.

    A commit without our prefix (``kafka-consumer-groups.sh --reset-offsets``, another
    tool) is the operator's acknowledgement: resume from its offset, with no blocks,
    and warn. Ours resumes at its resume offset and rebuilds its blocks. Ours with a
    committed offset that differs from its resume offset was moved by someone else:
    treated as foreign too. Corrupt metadata with our prefix raises
    :class:`MetadataDecodeError`.
    """
    if committed is None:
        return Resumption(resume=None)
    text = committed.metadata.rstrip("\x00")
    if not is_blockagg(text):
        shown = text if len(text) <= 40 else text[:40] + "..."
        return Resumption(
            resume=committed.offset,
            foreign=(
                f"the last commit (offset {committed.offset}, metadata {shown!r}) was not "
                "written by blockagg, e.g. kafka-consumer-groups.sh --reset-offsets: "
                f"resuming from offset {committed.offset} with no blocks to replay; "
                "messages between the previous blockagg commit and this offset are "
                "skipped or consumed again as the operator chose"
            ),
        )
    metadata = decode(text)
    if committed.offset != metadata.resume:
        return Resumption(
            resume=committed.offset,
            foreign=(
                f"the committed offset {committed.offset} differs from the resume offset "
                f"{metadata.resume} of the committed metadata (run {metadata.run}, batch "
                f"{metadata.batch}): the offset was moved outside blockagg; resuming from "
                f"{committed.offset} with no blocks to replay"
            ),
        )
    return Resumption(resume=metadata.resume, blocks=metadata.blocks, metadata=metadata)


def batch_pins(topic: str, partition: int, committed: Committed | None, current: Pins) -> Pins:
    """The pins a batch must be prepared under, given the partition's last commit and
    what is ``current`` now (the registry's position, the topic's incarnation, the
    server's deduplication mode).

    A replay uses exactly what its first attempt used (invariant 5): after an intent,
    its registry position and deduplication mode (where it recorded them) and its
    incarnation (``0`` for an intent written before pins existed, which keeps its
    blocks' earlier token format). After a final commit, a foreign one or none, the
    current pins: no block of the batch can have landed yet. Raises
    :class:`TopicIncarnationChanged` when the last commit names another incarnation
    of the topic than ``current``.
    """
    return _pins_for(f"{topic}[{partition}]", _read_partition(topic, partition, committed),
                     current)


def _read_partition(topic: str, partition: int, committed: Committed | None) -> Resumption:
    """:func:`read_committed`, an undecodable commit refused naming the partition."""
    try:
        return read_committed(committed)
    except MetadataDecodeError as exc:
        assert committed is not None
        raise MetadataDecodeError(undecodable_commit(
            topic, partition, committed.offset, exc)) from None


def _pins_for(where: str, resumption: Resumption, current: Pins) -> Pins:
    metadata = resumption.metadata
    if metadata is None:
        return current
    pinned = metadata.pins
    if pinned.incarnation and current.incarnation and pinned.incarnation != current.incarnation:
        lost = ""
        if metadata.blocks:
            listed = ", ".join(f"table {b.table_id} [{b.first}, {b.last}]"
                               for b in metadata.blocks)
            lost = (f" The last commit is an intent listing blocks ({listed}) of the old "
                    "topic that may not all be in ClickHouse; their messages went with it.")
        raise TopicIncarnationChanged(
            f"{where}: the last commit (run {metadata.run}, batch {metadata.batch}, resume "
            f"{metadata.resume}) was written for another incarnation of the topic (fingerprint "
            f"{pinned.incarnation:016x}, now {current.incarnation:016x}): the topic was "
            "deleted and recreated, or this is another Kafka cluster's topic of the same "
            "name, so its offsets do not apply. Nothing was committed or inserted. If that "
            "is intended, stop the job, reset the metadata group's offsets of this topic "
            "to its earliest offset (kafka-consumer-groups.sh --group <metadata group> "
            "--topic <topic> --reset-offsets --to-earliest --execute), delete the job's "
            "checkpoint_location (Spark's offsets are the old topic's) and start it: every "
            "message of the new topic is then delivered and none is taken for an old "
            "block, on ClickHouse 22.2+ by tokens that carry the incarnation, before 22.2 "
            "by the _incarnation column (incarnation in the dead-letter table) that blockagg "
            "fills; a table without it that still holds the old topic's rows at those "
            "offsets refuses the partition (CoordinatesInUse) instead of losing blocks "
            "equal to old ones." + lost
        )
    if not metadata.blocks:
        return current
    return Pins(
        registry=pinned.registry or current.registry,
        incarnation=pinned.incarnation,
        dedup=pinned.dedup or current.dedup,
        structure=pinned.structure,  # never a later mark: it must precede the first attempts
    )


@dataclass(frozen=True, eq=False)
class Plan:
    """Everything the protocol will do for one batch, decided before doing any of it.

    ``operations`` alternate intents and inserts and end with the final commit;
    empty when ``skipped`` (the whole batch is below the resume offset).
    """

    batch: Batch
    resume: int
    operations: tuple[Operation, ...]
    skipped: bool = False
    delivered_messages: int = 0
    warning: str | None = None
    blocks: tuple[Block, ...] = field(default=())

    def __iter__(self) -> Iterator[Operation]:
        yield from self.operations

    @property
    def replayed_blocks(self) -> int:
        return sum(1 for block in self.blocks if block.replay)


@dataclass(frozen=True, slots=True)
class BatchReport:
    """Figures of one executed batch, for the driver's per-batch report and metrics."""

    topic: str
    partition: int
    start: int
    end: int
    resume: int
    skipped: bool
    blocks: int
    replayed_blocks: int
    rows: int
    bytes: int
    messages: int
    delivered_messages: int
    commits: int
    warning: str | None = None


def _where(batch: Batch) -> str:
    return f"{batch.topic}[{batch.partition}] batch [{batch.start}, {batch.end})"


def _refusals(batch: Batch, resume: int, blocks: tuple[BlockRange, ...]) -> None:
    where = _where(batch)
    if batch.start > resume:
        raise OffsetGap(
            f"{where} starts after the resume offset {resume}: messages "
            f"[{resume}, {batch.start}) would be lost. Start the query from the committed "
            "offsets (a lost Spark checkpoint must restart from the consumer group's "
            "committed offsets), or acknowledge the loss with kafka-consumer-groups.sh "
            f"--reset-offsets --to-offset {batch.start}."
        )
    if batch.partition_end is not None and resume > batch.partition_end:
        raise MetadataAheadOfPartition(
            f"{where}: the resume offset {resume} is beyond the partition's end "
            f"{batch.partition_end}: the topic was recreated or its offsets reset since "
            "the metadata was committed. Reset the group's offset to the data you want "
            "(kafka-consumer-groups.sh --reset-offsets --to-earliest) and restart."
        )
    if batch.end <= resume:
        return
    for block in blocks:
        if block.last >= batch.end:
            raise BatchEndsInsideReplayBlock(
                f"{where} ends inside the committed block [{block.first}, {block.last}] of "
                f"table id {block.table_id}, which can't be rebuilt identically from part "
                f"of its messages. Raise maxOffsetsPerTrigger (the batch must reach offset "
                f"{block.last + 1}) and restart."
            )
        if block.first < resume:
            raise MetadataContractViolation(
                f"{where}: the committed block [{block.first}, {block.last}] of table id "
                f"{block.table_id} starts below the resume offset {resume}, which blockagg "
                "never commits (docs/metadata.md, invariant 5). Find out who wrote it; to "
                "go on, reset the group's offset with kafka-consumer-groups.sh."
            )


def _intent_resume(
    floor: int, latest: dict[int, Block]
) -> tuple[int, list[BlockRange]]:
    """The resume offset of an intent and the blocks it lists.

    Starting from ``floor`` (the first offset of every block not acknowledged and of
    every buffered or unrouted message), lower the resume offset to the first offset
    of every listed block, until stable: the listed blocks are each table's most
    recent block that ends at or after the resume offset, and they all start at or
    after it (invariant 5), so a retry from the resume offset can rebuild them.
    """
    resume = floor
    while True:
        listed = [block for block in latest.values() if block.last >= resume]
        lowest = min((block.first for block in listed), default=resume)
        if lowest >= resume:
            return resume, [BlockRange(b.table_id, b.first, b.last) for b in listed]
        resume = lowest


def _operations(
    batch: Batch,
    resume: int,
    formation: Formation,
    thresholds: Thresholds,
    run: int,
    batch_id: int,
    attempt: int,
    now_s: int,
) -> list[Operation]:
    n = len(batch)
    blocks = formation.blocks
    sealed_at = formation.sealed_at
    opening = sorted(
        (int(block.positions[0]), index)
        for index, block in enumerate(blocks)
        if sealed_at[index] != REPLAY_EVENT
    )
    open_heap: list[tuple[int, int]] = []
    next_open = 0
    latest: dict[int, Block] = {}
    operations: list[Operation] = []

    def commit(offset: int, listed: list[BlockRange]) -> None:
        since = min((_first_sent(latest[b.table_id], now_s) for b in listed), default=0)
        metadata = Metadata(run, batch_id, batch.start, batch.end, offset, tuple(listed),
                            batch.pins, attempt, since)
        text = encode(metadata, thresholds.max_metadata_bytes)
        operations.append(CommitMetadata(batch.topic, batch.partition, offset, metadata, text))

    index = 0
    while index < len(blocks):
        event = sealed_at[index]
        stop = index
        while stop < len(blocks) and sealed_at[stop] == event:
            stop += 1
        sealed = blocks[index:stop]
        if event == REPLAY_EVENT:
            routed = resume
        elif event >= n:
            routed = batch.end
        else:
            routed = int(batch.offsets[event]) + 1
            while next_open < len(opening) and opening[next_open][0] <= event:
                opened = blocks[opening[next_open][1]]
                heapq.heappush(open_heap, (opened.first, sealed_at[opening[next_open][1]]))
                next_open += 1
            while open_heap and open_heap[0][1] <= event:
                heapq.heappop(open_heap)
        floor = min(routed, *(block.first for block in sealed))
        if open_heap and event != REPLAY_EVENT and event < n:
            floor = min(floor, open_heap[0][0])
        for block in sealed:
            latest[block.table_id] = block
        offset, listed = _intent_resume(floor, latest)
        commit(offset, listed)
        operations.extend(InsertBlock(block) for block in sorted(sealed, key=lambda b: b.first))
        index = stop
    commit(batch.end, [])
    return operations


def _first_sent(block: Block, now_s: int) -> int:
    """When ``block``'s first attempt may have been sent, at the earliest: its intent's
    time for a replay block (``0`` when that intent did not record one), else now (the
    plan is made before any of its sends)."""
    return block.since_s if block.replay else now_s


def _without_abandoned(batch: Batch) -> tuple[Batch, int]:
    """The batch without the messages an abandoned block's table holds up to the
    block's last offset, and how many were left out.

    An abandoned block's surviving messages were routed to the dead-letter table by
    the task; the table's earlier messages from the resume offset on are delivered
    (``docs/metadata.md``, invariant 7) and those below it never reach the core, so
    none of them may be consumed again."""
    if not batch.abandoned:
        return batch, 0
    keep = np.ones(len(batch), dtype=bool)
    for block in batch.abandoned:
        keep &= ~((batch.table_ids == block.table_id) & (batch.offsets <= block.last))
    if keep.all():
        return batch, 0
    positions = np.flatnonzero(keep)
    return replace(
        batch,
        offsets=batch.offsets[keep], table_ids=batch.table_ids[keep],
        row_counts=batch.row_counts[keep], sizes=batch.sizes[keep],
        payloads=[batch.payloads[int(i)] for i in positions],
    ), int(len(batch) - positions.size)


def _refuse_too_many_blocks(batch: Batch, formation: Formation,
                            thresholds: Thresholds) -> None:
    """Every table with a share (``Thresholds.max_blocks_per_table``) receives at most
    its share of this partition-batch's blocks, counting every block formed: replays,
    and seals by rows, bytes and the batch's end. Counted once per block (never per
    message), before any operation exists."""
    shares = thresholds.max_blocks_per_table
    if not shares or not formation.blocks:
        return
    ids, counts = np.unique(np.fromiter((b.table_id for b in formation.blocks), np.int64,
                                        len(formation.blocks)), return_counts=True)
    formed = dict(zip(ids.tolist(), counts.tolist(), strict=True))
    for share in shares:
        blocks = formed.get(share.table_id, 0)
        if blocks <= share.blocks:
            continue
        name = batch.tables.get(share.table_id, f"id {share.table_id}")
        raise TooManyBlocks(
            f"{_where(batch)} forms {blocks} blocks of table {name}, above the "
            f"partition's share of its deduplication window: {share.blocks} = floor("
            f"window {share.window} / ({BATCHES_IN_FLIGHT} batches in flight x "
            f"{share.partitions} partitions on the shard)), so a replay could outlive the "
            "window and land twice; nothing was committed or inserted. Raise the table's "
            "deduplication window to at least "
            f"{BATCHES_IN_FLIGHT * share.partitions * blocks}, or raise blocks.max_rows / "
            "blocks.max_bytes, then restart; lower job.max_offsets_per_trigger so later "
            "batches form fewer (docs/running.md, Sizing the deduplication window)")


def _refuse_abandoned_inside_dead_letters(batch: Batch, listed: tuple[BlockRange, ...],
                                          replay: dict[int, BlockRange]) -> None:
    """The commit that lists an abandoned block was written before its messages were
    routed to dead letters: if it also lists a dead-letter block overlapping it, the
    routed messages would change that block, so it would not be rebuilt identically.
    (Later commits list dead-letter blocks formed with the routing: identical.)"""
    dead = replay.get(DEAD_LETTER_TABLE_ID)
    for block in batch.abandoned:
        if dead is not None and block in listed and dead.overlaps(block):
            raise ReplayBlockMissing(
                f"{_where(batch)}: the abandoned block {block} overlaps the dead-letter "
                f"table's replay block [{dead.first}, {dead.last}], which would then not be "
                "rebuilt identically; reset the group's offset with kafka-consumer-groups.sh "
                "after checking both blocks in ClickHouse (docs/running.md).")


def plan_batch(
    batch: Batch,
    committed: Committed | None,
    thresholds: Thresholds,
    run: int,
    batch_id: int,
    *,
    attempt: int = 0,
    now_s: int = 0,
) -> Plan:
    """Decide everything the protocol does for ``batch``, or refuse it.

    ``attempt`` is the nonce of the attempt that will run the plan, written into every
    commit so that its confirms recognise its own commits and no other attempt's
    (``Metadata.attempt``); ``now_s`` is the wall-clock time, in seconds since the
    epoch, recorded as the first send of the blocks the plan forms
    (``Metadata.since_s``). Both only label commits: the blocks do not depend on them.

    Raises a :class:`BatchRefused` subclass, :class:`MetadataDecodeError` or
    :class:`MetadataTooLarge` before any operation exists, so a refused batch leaves
    Kafka and ClickHouse untouched.
    """
    resumption = _read_partition(batch.topic, batch.partition, committed)
    expected = _pins_for(f"{batch.topic}[{batch.partition}]", resumption, batch.pins)
    if expected != batch.pins:
        raise PinsMismatch(
            f"{batch.topic}[{batch.partition}]: the batch was prepared under {batch.pins} "
            f"but the intent it replays pinned {expected}; prepare it with batch_pins() so "
            "the replay decides every message as its first attempt did"
        )
    resume = batch.start if resumption.resume is None else resumption.resume
    _refusals(batch, resume, tuple(b for b in resumption.blocks if b not in batch.abandoned))
    if batch.end <= resume:
        return Plan(
            batch=batch,
            resume=resume,
            operations=(),
            skipped=True,
            delivered_messages=len(batch),
            warning=resumption.foreign,
        )
    batch, abandoned = _without_abandoned(batch)
    replay = {block.table_id: block for block in resumption.blocks
              if block not in batch.abandoned}
    _refuse_abandoned_inside_dead_letters(batch, resumption.blocks, replay)
    formation = form_blocks(batch, resume, replay, thresholds)
    formation = replace(formation, delivered=formation.delivered + abandoned)
    _refuse_too_many_blocks(batch, formation, thresholds)
    since = resumption.metadata.since_s if resumption.metadata is not None else 0
    if since and replay:
        formation = replace(formation, blocks=tuple(
            replace(block, since_s=since) if block.replay else block
            for block in formation.blocks))
    operations = _operations(batch, resume, formation, thresholds, run, batch_id, attempt,
                             now_s)
    return Plan(
        batch=batch,
        resume=resume,
        operations=tuple(operations),
        delivered_messages=formation.delivered,
        warning=resumption.foreign,
        blocks=formation.blocks,
    )


class _Serial:
    """The inserts of an event one after another, stopping at the first failure."""

    def run(self, inserts: Sequence[Callable[[], None]]) -> None:
        for insert in inserts:
            insert()


SERIAL: Lanes = _Serial()
"""One insert at a time: the executor's behaviour before concurrent inserts, and the
one ``clickhouse.insert_concurrency = 1`` selects."""


def steps(plan: Plan) -> Iterator[CommitMetadata | tuple[InsertBlock, ...]]:
    """The plan's operations as the executor runs them: each commit alone, then the
    inserts that follow it (one seal event's blocks) together. Every insert group
    comes after the commit that lists its blocks and ends before the next commit."""
    group: list[InsertBlock] = []
    for operation in plan:
        if isinstance(operation, InsertBlock):
            group.append(operation)
            continue
        if group:
            yield tuple(group)
            group = []
        yield operation
    if group:
        yield tuple(group)


SPREAD: Final = 0.6180339887498949
"""The golden ratio's fraction: partition ``p`` starts its seal events' inserts at
fraction ``p * SPREAD mod 1`` of the group, so any few partitions start far apart."""


def insert_order(group: Sequence[InsertBlock], partition: int) -> list[InsertBlock]:
    """One seal event's inserts in the order the lanes take them: the plan's order,
    rotated to start at a point that depends on the partition.

    Every partition's forced flush holds one block per table, planned in the same
    order when the producers interleave tables alike. On 18.16, a table takes one
    quorum insert at a time (``UNSATISFIED_QUORUM_FOR_PREVIOUS_WRITE``, retried after
    a pause); two tasks running side by side would meet on every table. Rotating by
    partition keeps their lanes on different tables. Safe: a group's blocks are all
    listed by the intent just committed and belong to distinct tables, so any order
    keeps each table's blocks in offset order (docs/protocol.md, *Concurrent inserts*).
    """
    if len(group) <= 1:
        return list(group)
    start = int((partition * SPREAD) % 1.0 * len(group))
    return [*group[start:], *group[:start]]


def run_batch(protocol: Plan, store: MetadataStore, sink: BlockSink,
              fence: Fence | None = None, lanes: Lanes = SERIAL) -> BatchReport:
    """Execute the plan's operations in order; any error propagates at once.

    A batch interrupted anywhere is safe to run again from a fresh plan: the next plan
    reads the last commit that went through and rebuilds its blocks identically. With
    a ``fence``, each insert is preceded by ``fence.confirm``: an attempt overtaken by a
    newer one stops before inserting (invariant 6). ``lanes`` runs the inserts of one
    seal event, all listed by the intent just committed, one after another or several
    at once; every one of them is acknowledged before the next commit is sent, so a
    commit never moves the resume offset past a block still in flight (invariant 4).
    A :class:`BuildAheadSink` first builds the event's inserts on this thread
    (``build_ahead``), which sends nothing.
    """
    batch = protocol.batch
    commits = blocks = replayed = rows = size = messages = 0
    build_ahead = sink.build_ahead if isinstance(sink, BuildAheadSink) else None

    def insert(block: Block) -> Callable[[], None]:
        def run() -> None:
            confirmed_at = None
            if fence is not None:
                confirmed_at = fence.confirm(batch.topic, batch.partition)
            sink.insert(block, batch, confirmed_at)
        return run

    for step in steps(protocol):
        if isinstance(step, CommitMetadata):
            store.commit(step.topic, step.partition, step.offset, step.text)
            commits += 1
            continue
        ordered = insert_order(step, batch.partition)
        if build_ahead is not None:
            build_ahead([operation.block for operation in ordered], batch)
        lanes.run([insert(operation.block) for operation in ordered])
        for operation in step:
            block = operation.block
            blocks += 1
            replayed += block.replay
            rows += block.rows
            size += block.size
            messages += block.messages
    return BatchReport(
        topic=batch.topic,
        partition=batch.partition,
        start=batch.start,
        end=batch.end,
        resume=protocol.resume,
        skipped=protocol.skipped,
        blocks=blocks,
        replayed_blocks=replayed,
        rows=rows,
        bytes=size,
        messages=messages,
        delivered_messages=protocol.delivered_messages,
        commits=commits,
        warning=protocol.warning,
    )


def process_batch(
    batch: Batch,
    store: MetadataStore,
    sink: BlockSink,
    thresholds: Thresholds,
    run: int,
    batch_id: int,
    fence: Fence | None = None,
    lanes: Lanes = SERIAL,
    *,
    attempt: int = 0,
    now_s: int = 0,
) -> BatchReport:
    """Read the partition's last commit, plan the batch and run it: the whole protocol
    for one partition of one micro-batch (``attempt``, ``now_s``: see :func:`plan_batch`)."""
    committed = store.committed(batch.topic, batch.partition)
    return run_batch(plan_batch(batch, committed, thresholds, run, batch_id, attempt=attempt,
                                now_s=now_s), store, sink, fence, lanes)
