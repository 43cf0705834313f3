"""Exactly once through any crash: random multi-table streams with offset holes,
random thresholds and batch boundaries, a crash injected at a random operation of
random batches (before or after a commit, before or after an insert, an insert
applied whose acknowledgement is lost), each followed by a retry that reuses the
batch's range (a Spark task retry) or plans a new one from the committed resume
offset, possibly starting below it (a lost checkpoint). Every run must end with every
row in ClickHouse exactly once and a commit history the verifier accepts. The same
holds with an event's inserts run concurrently (``InFlightLanes``: any order, and any
subset of the event's blocks landed when one of them fails)."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from blockagg.aggregator.core.exceptions import BatchEndsInsideReplayBlock
from blockagg.aggregator.core.model import Lanes, Thresholds
from blockagg.aggregator.core.protocol import SERIAL, plan_batch
from tests.unit.core.fakes import (
    DedupSink,
    InFlightLanes,
    MemoryMetadataStore,
    Message,
    expected_rows,
    make_batch,
    run_crashing,
)
from tests.unit.core.history import anomalies


@dataclass(frozen=True)
class Scenario:
    messages: list[Message]
    log_end: int
    thresholds: Thresholds
    sizes: list[int]
    backs: list[int]
    crashes: list[tuple[int, bool, bool]]
    """(operation index, after the operation, retry the same range)"""
    seed: int = 0
    """Of the concurrent lanes' order and of which in-flight inserts land."""


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    tables = draw(st.integers(min_value=1, max_value=5))
    count = draw(st.integers(min_value=0, max_value=60))
    offset = draw(st.integers(min_value=0, max_value=3))
    messages: list[Message] = []
    for _ in range(count):
        table_id = draw(st.integers(min_value=0, max_value=tables))
        rows = draw(st.integers(min_value=1, max_value=4))
        messages.append((offset, table_id, rows))
        offset += draw(st.sampled_from([1, 1, 1, 2, 3]))
    log_end = offset + draw(st.integers(min_value=0, max_value=2))
    thresholds = Thresholds(
        max_rows=draw(st.integers(min_value=1, max_value=12)),
        max_bytes=draw(st.integers(min_value=10, max_value=150)),
    )
    sizes = draw(st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=8))
    backs = draw(st.lists(st.integers(min_value=0, max_value=6), min_size=1, max_size=8))
    crashes = draw(
        st.lists(
            st.tuples(st.integers(min_value=0, max_value=25), st.booleans(), st.booleans()),
            max_size=6,
        )
    )
    seed = draw(st.integers(min_value=0, max_value=2**32 - 1))
    return Scenario(messages, log_end, thresholds, sizes, backs, crashes, seed)


@settings(max_examples=400, derandomize=True, deadline=None)
@given(scenarios())
def test_any_crash_sequence_ends_with_every_row_exactly_once(scenario: Scenario) -> None:
    deliver_through_crashes(scenario, SERIAL)


@settings(max_examples=400, derandomize=True, deadline=None)
@given(scenarios())
def test_any_crash_sequence_with_concurrent_inserts_ends_with_every_row_exactly_once(
        scenario: Scenario) -> None:
    deliver_through_crashes(scenario, InFlightLanes(scenario.seed))


def deliver_through_crashes(scenario: Scenario, lanes: Lanes) -> None:
    store, sink = MemoryMetadataStore(), DedupSink(window=100)
    crashes = list(scenario.crashes)
    retry_range: tuple[int, int] | None = None
    batch_id = 0
    for step in range(300):
        committed = store.committed("events", 0)
        resume = 0 if committed is None else committed.offset
        if resume >= scenario.log_end and retry_range is None:
            break
        if retry_range is not None:
            start, end = retry_range
        else:
            start = max(0, resume - scenario.backs[step % len(scenario.backs)])
            end = min(scenario.log_end, resume + scenario.sizes[step % len(scenario.sizes)])
            batch_id += 1
        batch = make_batch(scenario.messages, start, end, partition_end=scenario.log_end)
        try:
            plan = plan_batch(batch, committed, scenario.thresholds, step % 3, batch_id)
        except BatchEndsInsideReplayBlock:
            retry_range = None
            end = scenario.log_end
            batch = make_batch(scenario.messages, start, end, partition_end=scenario.log_end)
            plan = plan_batch(batch, committed, scenario.thresholds, step % 3, batch_id)
        crash = crashes.pop(0) if crashes else None
        at, after, same_range = crash if crash is not None else (None, False, False)
        completed = run_crashing(plan, store, sink, at, after, lanes)
        retry_range = (start, end) if not completed and same_range else None
    else:
        raise AssertionError("the stream was not fully delivered within 300 batches")

    assert sink.rows == expected_rows(scenario.messages)
    history = store.metadata_history()
    assert anomalies(history) == []
    if scenario.log_end > 0:
        assert history[-1].is_final and history[-1].resume == scenario.log_end
