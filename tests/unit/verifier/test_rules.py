"""The anomaly rules: each kind caught, each with a clean twin that is not flagged."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockagg.aggregator.core.metadata import BlockRange, Metadata, encode
from blockagg.verifier.rules import AnomalyKind, Commit, Verifier

B = BlockRange


def md(start: int, end: int, resume: int, *blocks: BlockRange, run: int = 1,
       batch: int = 0) -> Metadata:
    return Metadata(run, batch, start, end, resume, tuple(blocks))


def commit(metadata: Metadata | str, offset: int | None = None, ts: int = 0,
           partition: int = 0) -> Commit:
    if isinstance(metadata, Metadata):
        text = encode(metadata)
        offset = metadata.resume if offset is None else offset
    else:
        text = metadata
        assert offset is not None
    return Commit("g", "t", partition, offset, text, ts)


def kinds(*commits: Commit, high_watermark: int | None = None) -> list[AnomalyKind]:
    verifier = Verifier(None if high_watermark is None else lambda t, p, c: high_watermark)
    found: list[AnomalyKind] = []
    for c in commits:
        found.extend(a.kind for a in verifier.observe(c))
    return found


# A clean batch [100, 200) of two tables, then the next batch: what the protocol writes.
CLEAN = [
    md(100, 200, 100, B(1, 100, 150), B(2, 105, 160)),
    md(100, 200, 105, B(1, 151, 199), B(2, 105, 160)),
    md(100, 200, 200),
    md(200, 300, 200, B(1, 200, 299), B(2, 201, 290), batch=1),
    md(200, 300, 300, batch=1),
]


def test_clean_history_has_no_anomaly() -> None:
    assert kinds(*(commit(m, ts=i) for i, m in enumerate(CLEAN)), high_watermark=300) == []


def test_replay_after_crash_and_client_retry_are_clean() -> None:
    crashed = CLEAN[0]
    replay = md(100, 220, 100, *crashed.blocks, run=2, batch=0)
    assert kinds(commit(crashed), commit(crashed), commit(replay), commit(replay)) == []


def test_backward_block() -> None:
    m = md(100, 200, 151, B(1, 151, 199))
    assert kinds(commit(m), commit(md(100, 200, 151, B(1, 160, 199)))) == [AnomalyKind.OVERLAP]
    rewound = md(100, 200, 151, B(1, 151, 199), B(2, 155, 160))
    again = md(100, 200, 151, B(1, 151, 199), B(2, 151, 152))
    assert kinds(commit(rewound), commit(again)) == [AnomalyKind.BACKWARD]
    assert kinds(commit(rewound), commit(rewound)) == []


def test_backward_resume() -> None:
    assert kinds(commit(md(100, 200, 151)), commit(md(100, 200, 120))) == [AnomalyKind.BACKWARD]
    assert kinds(commit(md(100, 200, 151)), commit(md(100, 200, 151))) == []


def test_overlap_of_different_blocks_and_identical_replay_twin() -> None:
    first = md(100, 200, 100, B(1, 100, 150))
    assert kinds(commit(first), commit(md(100, 200, 100, B(1, 100, 160)))) == [
        AnomalyKind.OVERLAP]
    assert kinds(commit(first), commit(md(100, 200, 100, B(1, 100, 150)))) == []
    assert kinds(commit(first), commit(md(100, 200, 100, B(1, 100, 150), B(2, 120, 130)))) == []


def test_overlap_is_per_table() -> None:
    first = md(100, 200, 100, B(1, 100, 150))
    assert kinds(commit(first), commit(md(100, 200, 100, B(1, 100, 150), B(2, 100, 150)))) == []


def test_gap_batch_starts_past_resume() -> None:
    final = md(100, 200, 200)
    assert kinds(commit(final), commit(md(201, 300, 201, batch=1))) == [AnomalyKind.GAP]
    assert kinds(commit(final), commit(md(200, 300, 200, batch=1))) == []


def test_gap_intent_then_next_batch() -> None:
    intent = md(100, 200, 150, B(1, 150, 199))
    assert kinds(commit(intent), commit(md(200, 300, 200, batch=1))) == [AnomalyKind.GAP]
    retry = md(100, 200, 150, B(1, 150, 199), run=2)
    assert kinds(commit(intent), commit(retry)) == []


def test_gap_forgotten_block() -> None:
    intent = md(100, 200, 100, B(1, 100, 150), B(2, 120, 180))
    forgot = md(100, 200, 160, B(1, 160, 199))
    assert kinds(commit(intent), commit(forgot)) == [AnomalyKind.GAP]
    kept = md(100, 200, 120, B(1, 160, 199), B(2, 120, 180))
    assert kinds(commit(intent), commit(kept)) == []


def test_gap_block_starting_below_resume() -> None:
    assert kinds(commit(md(100, 200, 151, B(1, 140, 199)))) == [AnomalyKind.GAP]
    assert kinds(commit(md(100, 200, 151, B(1, 151, 199)))) == []


def test_offset_holes_inside_batches_never_raise_gap() -> None:
    history = [
        md(0, 100, 0, B(1, 0, 40)),
        md(0, 100, 57, B(1, 57, 99)),
        md(0, 100, 100),
        md(100, 200, 180, B(1, 180, 199), batch=1),
        md(100, 200, 200, batch=1),
    ]
    assert kinds(*(commit(m) for m in history)) == []


def test_offset_mismatch() -> None:
    m = md(100, 200, 150, B(1, 150, 199))
    assert kinds(commit(m, offset=160)) == [AnomalyKind.OFFSET_MISMATCH]
    assert kinds(commit(m, offset=140)) == [AnomalyKind.OFFSET_MISMATCH]
    assert kinds(commit(m, offset=150)) == []


def test_offset_mismatch_resets_the_comparison_like_the_aggregator_does() -> None:
    moved = md(100, 200, 150, B(1, 150, 199))
    rebuilt = md(160, 300, 160, B(1, 160, 170), run=2)
    assert kinds(commit(moved, offset=160), commit(rebuilt)) == [AnomalyKind.OFFSET_MISMATCH]
    assert kinds(commit(moved, offset=160), commit(md(170, 300, 170, run=2))) == [
        AnomalyKind.OFFSET_MISMATCH, AnomalyKind.GAP]


def test_trailing_nul_is_not_an_anomaly() -> None:
    m = md(100, 200, 200)
    assert kinds(Commit("g", "t", 0, 200, encode(m) + "\x00", 0)) == []


def test_undecodable_metadata_keeps_the_last_good_one() -> None:
    final = md(100, 200, 200)
    found = kinds(commit(final), commit("ba1:!!not-base85", offset=200),
                  commit(md(201, 300, 201, batch=1)))
    assert found == [AnomalyKind.UNDECODABLE, AnomalyKind.GAP]
    assert kinds(commit(final), commit(md(200, 300, 200, batch=1))) == []


def test_foreign_writer_is_a_notice_and_resets_the_comparison() -> None:
    before = md(100, 200, 150, B(1, 150, 199))
    after_rewind = md(50, 150, 50, B(1, 50, 149), run=2)
    found = kinds(commit(before), commit("", offset=50), commit(after_rewind))
    assert found == [AnomalyKind.FOREIGN_WRITER]
    assert AnomalyKind.FOREIGN_WRITER.is_notice
    skipped = md(60, 150, 60, run=2)
    assert kinds(commit(before), commit("", offset=50), commit(skipped)) == [
        AnomalyKind.FOREIGN_WRITER, AnomalyKind.GAP]


def test_a_rewind_below_a_reset_is_an_anomaly_not_a_notice() -> None:
    before = md(100, 200, 150, B(1, 150, 199))
    below_reset = md(40, 150, 40, B(1, 40, 149), run=2)
    found = kinds(commit(before), commit("", offset=50), commit(below_reset))
    # the resume offset and table 1's block both go below the reset: each is named
    assert found == [AnomalyKind.FOREIGN_WRITER, AnomalyKind.BACKWARD, AnomalyKind.BACKWARD]
    assert not AnomalyKind.BACKWARD.is_notice
    moved = md(100, 200, 150, B(1, 150, 199))
    assert kinds(commit(moved, offset=160), commit(md(155, 300, 155, run=2))) == [
        AnomalyKind.OFFSET_MISMATCH, AnomalyKind.BACKWARD]


def test_a_forward_reset_under_a_checkpoint_behind_is_a_notice_not_backward() -> None:
    """Issue 25: the group reset forward to 180 while Spark's checkpoint is at 100. The
    next batch is planned [100, 300); the core leaves [100, 180) out as delivered and
    consumes from 180, so its commits say start = 100 with resume and blocks at or
    above 180: nothing lost, nothing duplicated, only the reset's notice."""
    before = md(100, 200, 150, B(1, 150, 199))
    intent = md(100, 300, 180, B(1, 180, 260), B(2, 185, 299), run=2)
    final = md(100, 300, 300, run=2)
    assert kinds(commit(before), commit("", offset=180), commit(intent), commit(final)) == [
        AnomalyKind.FOREIGN_WRITER]
    assert kinds(commit(before), commit("", offset=180), commit(final)) == [
        AnomalyKind.FOREIGN_WRITER]
    # the same under an offset moved by a tool that kept blockagg's metadata
    assert kinds(commit(before, offset=180), commit(intent), commit(final)) == [
        AnomalyKind.OFFSET_MISMATCH]


def test_a_rewind_below_a_forward_reset_is_still_backward() -> None:
    """Same start as the accepted twin above; what rewinds is the resume offset or a
    block, below the offset the group was reset to."""
    before = md(100, 200, 150, B(1, 150, 199))
    resume_below = md(100, 300, 170, B(1, 180, 260), run=2)
    assert kinds(commit(resume_below)) == []  # well formed on its own
    found = kinds(commit(before), commit("", offset=180), commit(resume_below))
    assert found == [AnomalyKind.FOREIGN_WRITER, AnomalyKind.BACKWARD]
    block_below = md(100, 300, 175, B(1, 175, 260), run=2)
    verifier = Verifier()
    verifier.observe(commit(before))
    verifier.observe(commit("", offset=180))
    found_at = verifier.observe(commit(block_below))
    assert [(a.kind, a.table_id) for a in found_at] == [
        (AnomalyKind.BACKWARD, None), (AnomalyKind.BACKWARD, 1)]
    assert "[175, 180)" in found_at[1].detail
    moved = kinds(commit(before, offset=180), commit(resume_below))
    assert moved == [AnomalyKind.OFFSET_MISMATCH, AnomalyKind.BACKWARD]


def test_past_end() -> None:
    m = md(100, 200, 200)
    assert kinds(commit(m), high_watermark=199) == [AnomalyKind.PAST_END]
    assert kinds(commit(m), high_watermark=200) == []
    assert kinds(commit("", offset=500), high_watermark=200) == [
        AnomalyKind.FOREIGN_WRITER, AnomalyKind.PAST_END]


def test_partitions_are_independent_and_anomaly_carries_both_instances() -> None:
    verifier = Verifier()
    a0, b0 = md(100, 200, 200), md(0, 50, 50)
    assert verifier.observe(commit(a0, partition=0, ts=1)) == []
    assert verifier.observe(commit(b0, partition=1, ts=2)) == []
    gap = md(300, 400, 300, batch=1)
    [anomaly] = verifier.observe(commit(gap, partition=0, ts=3))
    assert (anomaly.kind, anomaly.partition, anomaly.commit_timestamp) == (
        AnomalyKind.GAP, 0, 3)
    assert (anomaly.previous, anomaly.current, anomaly.previous_commit_timestamp) == (a0, gap, 1)
    assert "[200, 300)" in anomaly.detail
    as_dict = anomaly.as_dict()
    assert as_dict["kind"] == "gap"
    assert as_dict["previous"]["resume"] == 200
    assert verifier.commits_checked == 3
    assert verifier.partitions == 2


@st.composite
def histories(draw: st.DrawFn) -> list[Metadata]:
    history = []
    for _ in range(draw(st.integers(1, 6))):
        start = draw(st.integers(0, 40))
        end = start + draw(st.integers(1, 40))
        resume = draw(st.integers(start, end))
        blocks = []
        for table in draw(st.sets(st.integers(0, 3), max_size=3)):
            if resume >= end:
                break
            first = draw(st.integers(start, end - 1))
            last = draw(st.integers(max(first, resume), end - 1))
            blocks.append(B(table, first, last))
        history.append(md(start, end, resume, *blocks))
    return history


@settings(max_examples=1500, derandomize=True, deadline=None)
@given(histories())
def test_agrees_with_the_protocol_tests_oracle(history: list[Metadata]) -> None:
    """Same verdicts, kind by kind, as the oracle the aggregator's protocol tests use."""
    oracle = pytest.importorskip("tests.unit.core.history")
    names = {"Backward": "backward", "Overlap": "overlap", "Gap": "gap", "Invariant5": "gap"}
    expected = Counter(names[text.split(" ", 1)[0]] for text in oracle.anomalies(history))
    assert Counter(k.value for k in kinds(*(commit(m) for m in history))) == expected


@st.composite
def reset_scenarios(draw: st.DrawFn) -> dict[str, object]:
    messages = []
    offset = draw(st.integers(0, 3))
    for _ in range(draw(st.integers(1, 50))):
        messages.append((offset, draw(st.integers(0, 3)), draw(st.integers(1, 3))))
        offset += draw(st.sampled_from([1, 1, 1, 2]))
    return {
        "messages": messages,
        "log_end": offset + draw(st.integers(0, 2)),
        "max_rows": draw(st.integers(1, 8)),
        "sizes": draw(st.lists(st.integers(1, 30), min_size=1, max_size=6)),
        # per step: (reset forward by this many offsets (0: none), keep blockagg's
        # metadata with the moved offset instead of a foreign commit, crash at op / None)
        "steps": draw(st.lists(st.tuples(st.sampled_from([0, 0, 1, 3, 8, 20]), st.booleans(),
                                         st.none() | st.integers(0, 12)),
                               min_size=1, max_size=12)),
    }


@settings(max_examples=400, derandomize=True, deadline=None)
@given(reset_scenarios())
def test_the_cores_history_under_forward_resets_and_a_checkpoint_behind_is_accepted(
        scenario: dict[str, object]) -> None:
    """The core itself writes the history: a stream delivered batch by batch, the
    group's offset moved forward at random points (a foreign commit, or a tool moving
    the offset under blockagg's metadata) while Spark's checkpoint stays behind, so the
    next batches are planned from below the new offset, with crashes retried on the
    same range. Every row outside the acknowledged ranges lands exactly once, none
    twice, and the verifier reports each reset once (a foreign_writer notice or the
    offset_mismatch of the moved commit) and nothing else."""
    from blockagg.aggregator.core.exceptions import BatchEndsInsideReplayBlock
    from blockagg.aggregator.core.metadata import decode, is_blockagg
    from blockagg.aggregator.core.model import Thresholds
    from blockagg.aggregator.core.protocol import plan_batch
    from tests.unit.core.fakes import (
        DedupSink,
        MemoryMetadataStore,
        expected_rows,
        make_batch,
        run_crashing,
    )

    messages = scenario["messages"]
    log_end = scenario["log_end"]
    sizes = scenario["sizes"]
    steps = scenario["steps"]
    assert isinstance(messages, list) and isinstance(log_end, int)
    assert isinstance(sizes, list) and isinstance(steps, list)
    assert isinstance(scenario["max_rows"], int)
    thresholds = Thresholds(max_rows=scenario["max_rows"], max_bytes=10_000)
    store, sink = MemoryMetadataStore(), DedupSink()
    checkpoint, resets = 0, 0
    retry: tuple[int, int] | None = None
    acknowledged: set[int] = set()
    for step in range(200):
        committed = store.committed("events", 0)
        resume = 0 if committed is None else committed.offset
        forward, keep, crash_at = steps[step % len(steps)]
        if retry is None and forward and resume < log_end and step < len(steps):
            moved = min(log_end, resume + forward)
            acknowledged.update(range(resume, moved))
            text = committed.metadata if committed and keep and is_blockagg(
                committed.metadata) else ""
            store.commit("events", 0, moved, text)
            resets += 1
            resume = moved
        if resume >= log_end and retry is None:
            break
        start, end = retry or (checkpoint, min(log_end, max(checkpoint, resume)
                                              + sizes[step % len(sizes)]))
        batch = make_batch(messages, start, end, partition_end=log_end)
        try:
            plan = plan_batch(batch, store.committed("events", 0), thresholds, step, step)
        except BatchEndsInsideReplayBlock:
            end = log_end
            batch = make_batch(messages, start, end, partition_end=log_end)
            plan = plan_batch(batch, store.committed("events", 0), thresholds, step, step)
        if run_crashing(plan, store, sink, crash_at if step < len(steps) else None):
            checkpoint, retry = end, None
        else:
            retry = (start, end)
    else:
        raise AssertionError("not delivered within 200 batches")

    expected = expected_rows([m for m in messages if m[0] not in acknowledged])
    assert sink.duplicates() == []
    assert +(expected - sink.rows) == Counter()
    assert all(key[1] in acknowledged for key in sink.rows - expected)
    found = Counter(kinds(*(commit(c.metadata, offset=c.offset)
                            for _, _, c in store.history)))
    moved = sum(1 for _, _, c in store.history
                if is_blockagg(c.metadata) and decode(c.metadata).resume != c.offset)
    assert found == Counter({AnomalyKind.FOREIGN_WRITER: resets - moved,
                             AnomalyKind.OFFSET_MISMATCH: moved}) - Counter(), found


def test_a_commit_of_an_earlier_topic_incarnation_is_not_judged_past_the_new_end() -> None:
    """After a topic is deleted and recreated, the old topic's last commits claim
    offsets beyond the new topic's high watermark: they are the old topic's, not past
    its end (the fault suite's topic_recreate). A commit of the current incarnation
    still is."""
    from blockagg.aggregator.core.metadata import Pins

    old = encode(Metadata(1, 0, 0, 750, 750, pins=Pins(incarnation=11)))
    new = encode(Metadata(2, 0, 0, 900, 900, pins=Pins(incarnation=22)))
    asked: list[tuple[str, int]] = []

    def incarnation(topic: str, seen: int) -> int:
        asked.append((topic, seen))
        return 22

    verifier = Verifier(lambda topic, partition, claimed: 250, incarnation)
    assert verifier.observe(Commit("g", "t", 0, 750, old, 1)) == []
    found = verifier.observe(Commit("g2", "t", 0, 900, new, 2))
    assert [a.kind for a in found] == [AnomalyKind.PAST_END]
    assert asked == [("t", 11), ("t", 22)]
    unknown = Verifier(lambda topic, partition, claimed: 250, lambda topic, seen: None)
    assert [a.kind for a in unknown.observe(Commit("g", "t", 0, 750, old, 1))] == \
        [AnomalyKind.PAST_END]
