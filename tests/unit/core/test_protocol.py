"""The REPLAY -> CONSUME protocol, case by case: the peers' classic cases (whole batch
new, retried, retried after the intent, after the insert, split differently, cropped,
inside or overlapping a previous block, offsets reset, entirely delivered) and our
refusals, each against an in-memory consumer group and a deduplicating ClickHouse."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockagg.aggregator.core.exceptions import (
    BatchEndsInsideReplayBlock,
    BatchRefused,
    MetadataAheadOfPartition,
    MetadataContractViolation,
    MetadataDecodeError,
    MetadataTooLarge,
    OffsetGap,
    ReplayBlockMissing,
)
from blockagg.aggregator.core.metadata import BlockRange, Metadata, encode
from blockagg.aggregator.core.model import Batch, Block, Committed, Thresholds
from blockagg.aggregator.core.protocol import (
    BatchReport,
    CommitMetadata,
    InsertBlock,
    Plan,
    plan_batch,
    process_batch,
    run_batch,
)
from tests.unit.core.fakes import (
    DedupSink,
    MemoryMetadataStore,
    Message,
    expected_rows,
    make_batch,
    run_crashing,
)
from tests.unit.core.history import anomalies

HOLES = (7, 15, 22)
STREAM: list[Message] = [(o, 1 + o % 3, 1 + o % 2) for o in range(30) if o not in HOLES]
"""Three interleaved tables, 1 or 2 rows per message, offset holes (transaction markers)."""

THRESHOLDS = Thresholds(max_rows=5, max_bytes=10_000)


def plan(store: MemoryMetadataStore, start: int, end: int, *, batch_id: int = 0,
         stream: Sequence[Message] = STREAM, partition_end: int | None = 30) -> Plan:
    batch = make_batch(stream, start, end, partition_end=partition_end)
    return plan_batch(batch, store.committed("events", 0), THRESHOLDS, run=1, batch_id=batch_id)


def run(store: MemoryMetadataStore, sink: DedupSink, start: int, end: int,
        **kwargs: object) -> BatchReport:
    return run_batch(plan(store, start, end, **kwargs), store, sink)  # type: ignore[arg-type]


def delivered(messages: Sequence[Message], start: int, end: int) -> list[Message]:
    return [m for m in messages if start <= m[0] < end]


def assert_exactly_once(store: MemoryMetadataStore, sink: DedupSink, until: int) -> None:
    assert sink.rows == expected_rows(delivered(STREAM, 0, until))
    history = store.metadata_history()
    assert anomalies(history) == []
    assert history[-1].is_final and history[-1].resume == until


def commit_metadata(store: MemoryMetadataStore, metadata: Metadata) -> None:
    store.commit("events", 0, metadata.resume, encode(metadata))


def test_new_batch_delivers_every_row_once_and_ends_with_the_final_commit() -> None:
    store, sink = MemoryMetadataStore(), DedupSink()
    report = run(store, sink, 0, 30)
    assert_exactly_once(store, sink, 30)
    assert report.rows == sum(m[2] for m in STREAM)
    assert report.messages == len(STREAM)
    assert report.replayed_blocks == 0 and report.delivered_messages == 0
    assert report.commits == len(store.history) >= 2


def test_every_insert_follows_a_commit_that_lists_it_and_resumes_at_or_below_it() -> None:
    operations = list(plan(MemoryMetadataStore(), 0, 30))
    last_commit: CommitMetadata | None = None
    for operation in operations:
        if isinstance(operation, CommitMetadata):
            last_commit = operation
            continue
        assert last_commit is not None
        block = operation.block
        assert last_commit.metadata.block_of(block.table_id) == BlockRange(
            block.table_id, block.first, block.last
        )
        assert last_commit.offset <= block.first
    assert isinstance(operations[-1], CommitMetadata) and operations[-1].metadata.is_final


def test_batch_retried_identically_after_success_is_skipped() -> None:
    store, sink = MemoryMetadataStore(), DedupSink()
    run(store, sink, 0, 30)
    commits, inserted = len(store.history), len(sink.inserted)
    report = run(store, sink, 0, 30)
    assert report.skipped and report.commits == 0 and report.blocks == 0
    assert (len(store.history), len(sink.inserted)) == (commits, inserted)


def test_retry_after_the_intent_before_the_insert_rebuilds_the_same_blocks() -> None:
    store, sink = MemoryMetadataStore(), DedupSink()
    first = plan(store, 0, 30)
    assert not run_crashing(first, store, sink, at=0, after=True)
    assert sink.inserted == []
    intent = store.metadata_history()[-1]
    retry = plan(store, 0, 30)
    head = retry.operations[0]
    assert isinstance(head, CommitMetadata) and head.metadata.blocks == intent.blocks
    rebuilt = [op.block for op in retry.operations[1:] if isinstance(op, InsertBlock)]
    originals = [op.block for op in first.operations[1:] if isinstance(op, InsertBlock)]
    assert [(b.token, b.rows, b.positions.tolist()) for b in rebuilt[: len(intent.blocks)]] == [
        (b.token, b.rows, b.positions.tolist()) for b in originals[: len(intent.blocks)]
    ]
    run_batch(retry, store, sink)
    assert_exactly_once(store, sink, 30)


@settings(max_examples=150, derandomize=True, deadline=None)
@given(st.integers(min_value=1, max_value=30), st.integers(min_value=0, max_value=40),
       st.integers(min_value=0, max_value=30))
def test_a_replay_after_a_sizing_change_rebuilds_the_recorded_blocks(
        first_end: int, crash_pick: int, extra: int) -> None:
    """``blocks.min_rows`` (``spark.sizing``) changes how many offsets the next batch
    takes, never a committed intent's blocks: a batch cut at ``first_end`` crashes after
    an intent listing blocks, and the retry, planned over a larger range as a new
    sizing would take, rebuilds exactly the recorded blocks (rows, order, token)."""
    store, sink = MemoryMetadataStore(), DedupSink()
    first = plan(store, 0, first_end)
    listing = [i for i, op in enumerate(first.operations)
               if isinstance(op, CommitMetadata) and op.metadata.blocks]
    if not listing:
        return
    at = listing[crash_pick % len(listing)]
    assert not run_crashing(first, store, sink, at=at, after=True)
    intent = store.metadata_history()[-1]
    originals = {(op.block.table_id, op.block.first, op.block.last):
                 (op.block.token, op.block.rows,
                  first.batch.offsets[op.block.positions].tolist())
                 for op in first.operations if isinstance(op, InsertBlock)}
    recorded = {(b.table_id, b.first, b.last) for b in intent.blocks}
    end = min(30, first_end + extra)
    retry = plan(store, intent.resume, end, batch_id=1)
    rebuilt = {(op.block.table_id, op.block.first, op.block.last):
               (op.block.token, op.block.rows,
                retry.batch.offsets[op.block.positions].tolist())
               for op in retry.operations if isinstance(op, InsertBlock) and op.block.replay}
    assert set(rebuilt) == recorded
    assert rebuilt == {key: originals[key] for key in recorded}
    run_batch(retry, store, sink)
    if end < 30:
        run(store, sink, end, 30, batch_id=2)
    assert_exactly_once(store, sink, 30)


def test_retry_after_the_insert_before_the_final_commit_is_deduplicated() -> None:
    store, sink = MemoryMetadataStore(), DedupSink()
    first = plan(store, 0, 30)
    assert not run_crashing(first, store, sink, at=len(first.operations) - 1, after=False)
    report = run(store, sink, 0, 30)
    assert report.replayed_blocks > 0
    assert len(sink.deduplicated) == report.replayed_blocks
    assert_exactly_once(store, sink, 30)


def test_batch_split_differently_on_retry_delivers_exactly_once() -> None:
    store, sink = MemoryMetadataStore(), DedupSink()
    first = plan(store, 0, 30)
    assert not run_crashing(first, store, sink, at=4, after=True)
    resume = store.metadata_history()[-1].resume
    run(store, sink, resume, 26, batch_id=1)
    run(store, sink, 26, 30, batch_id=2)
    assert_exactly_once(store, sink, 30)


def test_range_starting_before_the_resume_offset_is_cropped() -> None:
    store, sink = MemoryMetadataStore(), DedupSink()
    run(store, sink, 0, 10)
    report = run(store, sink, 5, 20, batch_id=1)
    assert report.delivered_messages == len(delivered(STREAM, 5, 10))
    assert min(b.first for b in sink.inserted[-report.blocks:]) >= 10
    run(store, sink, 20, 30, batch_id=2)
    assert_exactly_once(store, sink, 30)


def test_range_entirely_before_the_committed_metadata_is_skipped() -> None:
    store, sink = MemoryMetadataStore(), DedupSink()
    run(store, sink, 0, 20)
    before = (len(store.history), len(sink.inserted))
    report = run(store, sink, 3, 12, batch_id=1)
    assert report.skipped and report.delivered_messages == len(delivered(STREAM, 3, 12))
    assert (len(store.history), len(sink.inserted)) == before


def test_range_overlapping_a_replay_block_rebuilds_it_then_consumes() -> None:
    store, sink = MemoryMetadataStore(), DedupSink()
    run(store, sink, 0, 10)
    commit_metadata(store, Metadata(1, 1, 10, 30, 10, (BlockRange(1, 18, 21),)))
    report = run(store, sink, 4, 30, batch_id=2)
    replayed = [b for b in sink.inserted if b.replay]
    assert [(b.table_id, b.first, b.last, b.messages) for b in replayed] == [(1, 18, 21, 2)]
    assert report.delivered_messages == len(delivered(STREAM, 4, 10)) + 1
    assert sink.rows == expected_rows([m for m in STREAM if m[:2] != (12, 1)])


REFUSALS = [
    pytest.param(Metadata(1, 0, 0, 30, 10, ()), 15, 30, 30, OffsetGap,
                 "would be lost", id="gap_after_the_resume_offset"),
    pytest.param(Metadata(1, 0, 0, 30, 30, ()), 0, 10, 10, MetadataAheadOfPartition,
                 "recreated", id="offsets_reset_to_zero"),
    pytest.param(Metadata(1, 0, 0, 30, 10, (BlockRange(1, 10, 19),)), 10, 16, 30,
                 BatchEndsInsideReplayBlock, "maxOffsetsPerTrigger",
                 id="range_inside_an_unfinished_block"),
    pytest.param(Metadata(1, 0, 0, 30, 10, (BlockRange(1, 10, 19),)), 0, 19, 30,
                 BatchEndsInsideReplayBlock, "maxOffsetsPerTrigger",
                 id="batch_ends_at_the_replay_blocks_last_offset"),
    pytest.param(Metadata(1, 0, 0, 30, 10, (BlockRange(1, 11, 19),)), 10, 30, 30,
                 ReplayBlockMissing, "retention", id="replay_block_not_in_the_batch"),
    pytest.param(Metadata(1, 0, 0, 30, 12, (BlockRange(1, 10, 19),)), 0, 30, 30,
                 MetadataContractViolation, "invariant 5", id="block_below_the_resume_offset"),
]


@pytest.mark.parametrize(("metadata", "start", "end", "partition_end", "error", "says"),
                         REFUSALS)
def test_refused_batch_commits_and_inserts_nothing(
    metadata: Metadata, start: int, end: int, partition_end: int,
    error: type[BatchRefused], says: str,
) -> None:
    store, sink = MemoryMetadataStore(), DedupSink()
    commit_metadata(store, metadata)
    with pytest.raises(error, match=says):
        process_batch(
            make_batch(STREAM, start, end, partition_end=partition_end),
            store, sink, THRESHOLDS, run=2, batch_id=1,
        )
    assert len(store.history) == 1 and sink.inserted == []


def test_corrupt_metadata_of_ours_is_refused_as_a_decode_error() -> None:
    store = MemoryMetadataStore()
    store.commit("events", 0, 10, "ba1:%%%not-base85")
    with pytest.raises(MetadataDecodeError):
        plan(store, 0, 30)


def test_metadata_too_large_refuses_before_any_operation() -> None:
    wide = [(o, 1 + o, 1) for o in range(200)]
    batch = make_batch(wide, 0, 200)
    small = Thresholds(max_rows=1_000, max_bytes=1_000_000, max_metadata_bytes=150)
    store, sink = MemoryMetadataStore(), DedupSink()
    with pytest.raises(MetadataTooLarge, match=r"offset\.metadata\.max\.bytes"):
        process_batch(batch, store, sink, small, run=1, batch_id=0)
    assert store.history == [] and sink.inserted == []


def test_batch_ending_in_an_offset_hole_commits_its_planned_end() -> None:
    store, sink = MemoryMetadataStore(), DedupSink()
    run(store, sink, 0, 23)
    assert store.metadata_history()[-1].resume == 23
    report = run(store, sink, 22, 23, batch_id=1)
    assert report.skipped
    run(store, sink, 23, 30, batch_id=2)
    assert_exactly_once(store, sink, 30)


def test_batch_of_only_holes_advances_the_resume_offset() -> None:
    store, sink = MemoryMetadataStore(), DedupSink()
    run(store, sink, 0, 15)
    report = run(store, sink, 15, 16, batch_id=1)
    assert report.blocks == 0 and report.commits == 1
    assert store.metadata_history()[-1].resume == 16


def test_foreign_commit_is_the_operators_acknowledgement_and_is_reported() -> None:
    store, sink = MemoryMetadataStore(), DedupSink()
    run(store, sink, 0, 10)
    store.commit("events", 0, 20, "")
    report = run(store, sink, 10, 30, batch_id=1)
    assert report.warning is not None and "not written by blockagg" in report.warning
    assert sink.rows == expected_rows([m for m in STREAM if not 10 <= m[0] < 20])


def test_commit_moved_away_from_its_metadata_is_treated_as_foreign() -> None:
    store, sink = MemoryMetadataStore(), DedupSink()
    store.commit("events", 0, 5, encode(Metadata(1, 0, 0, 30, 10, (BlockRange(1, 10, 19),))))
    report = run(store, sink, 0, 30)
    assert report.warning is not None and "differs from the resume offset" in report.warning
    assert report.replayed_blocks == 0
    assert sink.rows == expected_rows(delivered(STREAM, 5, 30))


def test_crash_at_every_operation_then_retry_with_other_boundaries_is_exactly_once() -> None:
    operations = len(plan(MemoryMetadataStore(), 0, 30).operations)
    for at in range(operations):
        for after in (False, True):
            store, sink = MemoryMetadataStore(), DedupSink()
            assert not run_crashing(plan(store, 0, 30), store, sink, at=at, after=after)
            committed = store.committed("events", 0)
            resume = 0 if committed is None else committed.offset
            try:
                run(store, sink, resume, 27, batch_id=1)
            except BatchEndsInsideReplayBlock:
                run(store, sink, resume, 30, batch_id=1)
            if store.metadata_history()[-1].resume < 30:
                run(store, sink, 27, 30, batch_id=2)
            assert_exactly_once(store, sink, 30)


def test_abandoned_replay_block_loses_nothing_else_across_crashes() -> None:
    """A block of table 2 lost its first message (compaction): ReplayBlockMissing names
    the setting. With the block abandoned (its surviving messages relabelled as dead
    letters, as the task does), the retry, crashed at every operation and run again,
    rebuilds table 1's block, consumes table 3 from the resume offset (what a reset to
    last + 1 would have lost) and stores every surviving message exactly once."""
    import dataclasses

    missing = BlockRange(2, 10, 19)
    metadata = Metadata(1, 0, 0, 30, 10, (missing, BlockRange(1, 12, 18)))
    compacted = [m for m in STREAM if m[0] != 10]
    store = MemoryMetadataStore()
    commit_metadata(store, metadata)
    with pytest.raises(ReplayBlockMissing, match=r"dead_letter_missing_blocks=\[\"events:0:2:"
                       r"10-19\"\]"):
        plan(store, 10, 30, stream=compacted)
    routed = [(o, 0 if t == 2 and 10 <= o <= 19 else t, 1 if t == 2 and o <= 19 else r)
              for o, t, r in compacted]
    batch = dataclasses.replace(make_batch(routed, 10, 30, partition_end=30),
                                abandoned=(missing,))
    sink = DedupSink()
    for at in range(20):
        if run_crashing(plan_batch(batch, store.committed("events", 0), THRESHOLDS,
                                   run=2 + at, batch_id=1), store, sink, at=at, after=True):
            break
    assert at > 3
    committed = store.committed("events", 0)
    assert committed is not None and committed.offset == 30
    assert not sink.duplicates()
    stored = set(sink.rows)
    assert stored == set(expected_rows([m for m in routed if m[0] >= 10
                                        and not (m[1] == 2 and m[0] < 10)]))
    assert {("db.t0", o, 0) for o in (13, 16, 19)} <= stored  # the block's survivors
    assert {("db.t3", 11, 0), ("db.t3", 14, 0), ("db.t3", 17, 0)} <= stored
    assert not any(t == "db.t2" and o <= 19 for t, o, _ in stored)


def test_a_crafted_commit_refuses_its_partition_naming_it_and_the_way_out() -> None:
    """The issue's 31-byte string (2**40 blocks of zero-bit fields) as the last commit:
    the batch is refused with MetadataDecodeError naming the partition and the reset."""
    import base64

    import msgpack

    crafted = "ba1:" + base64.b85encode(msgpack.packb(
        [1, 0, 0, 10, 10, b"", [2**40, 0, 0, 0]], use_bin_type=True)).decode()
    store, sink = MemoryMetadataStore(), DedupSink()
    store.commit("events", 0, 10, crafted)
    with pytest.raises(MetadataDecodeError, match=r"events\[0\]: the last commit .* \(offset "
                       r"10\) .*can't hold 1099511627776 blocks.*--topic events:0 --to-offset"):
        process_batch(make_batch(STREAM, 10, 30), store, sink, THRESHOLDS, run=2, batch_id=1)
    assert len(store.history) == 1 and sink.inserted == []


def test_an_abandoned_block_may_span_several_batches() -> None:
    """The abandoned block [10, 19] with batches [10, 15) and [15, 30): no
    BatchEndsInsideReplayBlock for it, and every surviving message lands once."""
    import dataclasses

    missing = BlockRange(2, 10, 19)
    store, sink = MemoryMetadataStore(), DedupSink()
    commit_metadata(store, Metadata(1, 0, 0, 30, 10, (missing,)))
    compacted = [m for m in STREAM if m[0] != 10]
    routed = [(o, 0 if t == 2 and 10 <= o <= 19 else t, 1 if t == 2 and o <= 19 else r)
              for o, t, r in compacted]
    for start, end in ((10, 15), (15, 30)):
        batch = dataclasses.replace(make_batch(routed, start, end, partition_end=30),
                                    abandoned=(missing,))
        process_batch(batch, store, sink, THRESHOLDS, run=2, batch_id=start)
    assert not sink.duplicates()
    assert set(sink.rows) == set(expected_rows([m for m in routed if m[0] >= 10]))


def test_intents_record_the_attempt_and_when_their_blocks_were_first_sent() -> None:
    """Every commit names its attempt; an intent records when its oldest listed block
    was first sent: now for blocks the plan forms, the replayed intent's time for the
    blocks it rebuilds (so a replay of a replay still knows the first send's age)."""
    from blockagg.aggregator.core.metadata import decode
    from blockagg.aggregator.core.protocol import CommitMetadata, InsertBlock, plan_batch

    messages = [(i, 1 + i % 2, 1) for i in range(10)]
    batch = make_batch(messages, 0, 10)
    thresholds = Thresholds(max_rows=3, max_bytes=10**9)
    first = plan_batch(batch, None, thresholds, 1, 1, attempt=2**31 + 5, now_s=1_000)
    commits = [op for op in first if isinstance(op, CommitMetadata)]
    assert all(decode(c.text).attempt == 2**31 + 5 for c in commits)
    assert [decode(c.text).since_s for c in commits[:-1]] == [1_000] * (len(commits) - 1)
    assert decode(commits[-1].text).since_s == 0, "a final commit lists no block"
    intent = commits[0]
    retry = plan_batch(batch, Committed(intent.offset, intent.text), thresholds, 1, 1,
                       attempt=2**31 + 6, now_s=5_000)
    replayed = [op.block for op in retry if isinstance(op, InsertBlock) and op.block.replay]
    assert replayed and all(block.since_s == 1_000 for block in replayed)
    again = [op for op in retry if isinstance(op, CommitMetadata)]
    assert decode(again[0].text).since_s == 1_000
    assert decode(again[0].text).attempt == 2**31 + 6


class BuildingSink(DedupSink):
    """A :class:`DedupSink` that builds ahead; both calls go to one event list."""

    def __init__(self, events: list[tuple[str, object]]) -> None:
        super().__init__()
        self.events = events

    def build_ahead(self, blocks: Sequence[Block], batch: Batch) -> None:
        self.events.append(("build", tuple(b.token for b in blocks)))

    def insert(self, block: Block, batch: Batch, confirmed_at: float | None = None) -> None:
        self.events.append(("insert", block.token))
        super().insert(block, batch, confirmed_at)


def test_each_event_is_built_ahead_after_its_intent_in_the_lanes_order() -> None:
    events: list[tuple[str, object]] = []

    class Store(MemoryMetadataStore):
        def commit(self, topic: str, partition: int, offset: int, metadata: str) -> None:
            events.append(("commit", offset))
            super().commit(topic, partition, offset, metadata)

    store, sink = Store(), BuildingSink(events)
    protocol = plan(store, 0, 30)
    report = run_batch(protocol, store, sink)
    assert report.blocks == len(sink.inserted) > 0 and not sink.duplicates()
    kinds = "".join(kind[0] for kind, _ in events)
    # Every event: its intent, its blocks built ahead, then those very blocks inserted.
    assert kinds.startswith("cb") and "bc" not in kinds and "ib" not in kinds
    for i, (kind, tokens) in enumerate(events):
        if kind == "build":
            assert isinstance(tokens, tuple)
            assert [t for _, t in events[i + 1:i + 1 + len(tokens)]] == list(tokens)
    assert sink.rows == expected_rows([m for m in STREAM if m[0] < 30])
