"""Block formation: where blocks seal, and that the columnar implementation forms
exactly the blocks of the plain per-message reference."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from blockagg.aggregator.core.blocks import (
    REPLAY_EVENT,
    Formation,
    form_blocks,
    form_blocks_per_message,
)
from blockagg.aggregator.core.exceptions import ReplayBlockMissing
from blockagg.aggregator.core.metadata import BlockRange
from blockagg.aggregator.core.model import Thresholds
from tests.unit.core.fakes import Message, make_batch


def shape(formation: Formation) -> list[tuple[object, ...]]:
    return [
        (b.table_id, b.first, b.last, b.positions.tolist(), b.rows, b.size, b.token, b.replay, at)
        for b, at in zip(formation.blocks, formation.sealed_at, strict=True)
    ]


def test_message_that_reaches_the_row_threshold_is_the_blocks_last() -> None:
    batch = make_batch([(0, 1, 2), (1, 1, 2), (2, 1, 1), (3, 1, 1)], 0, 4)
    formation = form_blocks(batch, 0, {}, Thresholds(max_rows=4, max_bytes=10**6))
    assert [(b.first, b.last, b.rows) for b in formation.blocks] == [(0, 1, 4), (2, 3, 2)]
    assert formation.sealed_at == (1, 4)


def test_message_at_or_above_a_threshold_forms_a_block_alone() -> None:
    batch = make_batch([(0, 1, 9), (1, 1, 1)], 0, 2)
    formation = form_blocks(batch, 0, {}, Thresholds(max_rows=5, max_bytes=10**6))
    assert [(b.first, b.last) for b in formation.blocks] == [(0, 0), (1, 1)]


def test_byte_threshold_seals_like_the_row_threshold() -> None:
    batch = make_batch([(0, 1, 1), (1, 1, 1), (2, 1, 1)], 0, 3, bytes_per_row=50)
    formation = form_blocks(batch, 0, {}, Thresholds(max_rows=1000, max_bytes=100))
    assert [(b.first, b.last, b.size) for b in formation.blocks] == [(0, 1, 100), (2, 2, 50)]


def test_every_open_buffer_seals_at_the_end_of_the_batch() -> None:
    batch = make_batch([(0, 1, 1), (1, 2, 1), (3, 1, 1)], 0, 5)
    formation = form_blocks(batch, 0, {}, Thresholds(max_rows=1000, max_bytes=10**6))
    assert [(b.table_id, b.first, b.last) for b in formation.blocks] == [(1, 0, 3), (2, 1, 1)]
    assert formation.sealed_at == (3, 3)


def test_replay_block_is_rebuilt_and_the_tables_next_block_starts_after_it() -> None:
    messages = [(o, 1, 1) for o in range(10)]
    batch = make_batch(messages, 0, 10)
    formation = form_blocks(batch, 2, {1: BlockRange(1, 4, 6)}, Thresholds(3, 10**6))
    assert [(b.first, b.last, b.replay) for b in formation.blocks] == [
        (4, 6, True), (7, 9, False)
    ]
    assert formation.sealed_at[0] == REPLAY_EVENT and formation.delivered == 4


def test_replay_block_whose_messages_are_gone_is_refused() -> None:
    batch = make_batch([(o, 1, 1) for o in range(5, 10)], 0, 10)
    for form in (form_blocks, form_blocks_per_message):
        try:
            form(batch, 0, {1: BlockRange(1, 2, 6)}, Thresholds(3, 10**6))
        except ReplayBlockMissing as error:
            assert "retention" in str(error)
        else:
            raise AssertionError("expected ReplayBlockMissing")


@st.composite
def formations(draw: st.DrawFn) -> tuple[list[Message], int, dict[int, BlockRange], Thresholds]:
    offset = 0
    messages: list[Message] = []
    for _ in range(draw(st.integers(min_value=0, max_value=80))):
        messages.append((offset, draw(st.integers(0, 300)) % 7, draw(st.integers(0, 5))))
        offset += draw(st.integers(min_value=1, max_value=3))
    resume = draw(st.integers(min_value=0, max_value=offset))
    replay: dict[int, BlockRange] = {}
    for table_id in draw(st.sets(st.integers(0, 6), max_size=3)):
        mine = [m[0] for m in messages if m[1] == table_id and m[0] >= resume]
        if mine:
            i = draw(st.integers(0, len(mine) - 1))
            j = draw(st.integers(i, len(mine) - 1))
            replay[table_id] = BlockRange(table_id, mine[i], mine[j])
    thresholds = Thresholds(draw(st.integers(1, 10)), draw(st.integers(1, 80)))
    return messages, resume, replay, thresholds


@settings(max_examples=400, derandomize=True, deadline=None)
@given(formations())
def test_columnar_formation_equals_the_per_message_reference(
    case: tuple[list[Message], int, dict[int, BlockRange], Thresholds],
) -> None:
    messages, resume, replay, thresholds = case
    end = messages[-1][0] + 1 if messages else 0
    batch = make_batch(messages, 0, end)
    columnar = form_blocks(batch, resume, replay, thresholds)
    reference = form_blocks_per_message(batch, resume, replay, thresholds)
    assert shape(columnar) == shape(reference)
    assert columnar.delivered == reference.delivered
