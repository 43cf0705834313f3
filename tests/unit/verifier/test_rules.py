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
    assert found == [AnomalyKind.FOREIGN_WRITER, AnomalyKind.BACKWARD]
    assert not AnomalyKind.BACKWARD.is_notice
    moved = md(100, 200, 150, B(1, 150, 199))
    assert kinds(commit(moved, offset=160), commit(md(155, 300, 155, run=2))) == [
        AnomalyKind.OFFSET_MISMATCH, AnomalyKind.BACKWARD]


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
