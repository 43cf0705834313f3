"""Pins: what besides the messages decided a batch's blocks (registry position, topic
incarnation, deduplication mode), carried in the metadata so a replay decides alike.
The codec round trip, the layout choice, and the rules of ``batch_pins``."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockagg.aggregator.core.exceptions import (
    MetadataDecodeError,
    PinsMismatch,
    TopicIncarnationChanged,
)
from blockagg.aggregator.core.metadata import (
    NO_PINS,
    PREFIX,
    PREFIX_PINNED,
    PREFIX_WIDE,
    BlockRange,
    DedupMode,
    Metadata,
    Pins,
    decode,
    encode,
    encode_base85,
    incarnation_of,
    is_blockagg,
)
from blockagg.aggregator.core.model import Committed, Thresholds, block_token
from blockagg.aggregator.core.protocol import batch_pins, plan_batch, run_batch
from tests.unit.core.fakes import DedupSink, MemoryMetadataStore, make_batch
from tests.unit.core.test_metadata import metadatas

pins_strategy = st.builds(
    Pins,
    registry=st.integers(min_value=0, max_value=2**63 - 1),
    incarnation=st.integers(min_value=0, max_value=2**64 - 1),
    dedup=st.sampled_from(list(DedupMode)),
    structure=st.one_of(st.just(0), st.integers(min_value=1, max_value=2**63 - 1)),
)

OLD = incarnation_of("cluster-a", "topic-id-1")
NEW = incarnation_of("cluster-a", "topic-id-2")
STREAM = [(o, 1 + o % 3, 1) for o in range(20)]
THRESHOLDS = Thresholds(max_rows=3, max_bytes=10_000)


@settings(max_examples=300, derandomize=True)
@given(metadatas(), pins_strategy)
def test_round_trip_preserves_the_pins(metadata: Metadata, pins: Pins) -> None:
    pinned = dataclasses.replace(metadata, pins=pins)
    text = encode(pinned, max_bytes=1 << 20)
    assert decode(text) == pinned
    assert text.startswith(PREFIX_WIDE) and is_blockagg(text) and "\x00" not in text
    old = encode_base85(pinned, max_bytes=1 << 20)
    assert decode(old) == pinned
    assert old.startswith(PREFIX if pins == NO_PINS else PREFIX_PINNED)
    assert is_blockagg(old) and old.isascii() and "\x00" not in old


def test_metadata_without_pins_encodes_exactly_as_before() -> None:
    """Strings written before pins existed stay the strings written now for the same
    metadata, so an upgrade changes no committed string's meaning."""
    metadata = Metadata(7, 3, 100, 200, 120, (BlockRange(2, 120, 150),))
    assert encode_base85(metadata).startswith(PREFIX)
    assert decode(encode_base85(metadata)).pins == NO_PINS
    assert decode(encode(metadata)) == decode(encode_base85(metadata))


def test_500_tables_with_pins_fit_the_default_limit() -> None:
    start, end = 3_000_000_000, 3_001_000_000
    spread = [(t * 7_919**2) % 990_000 for t in range(1, 501)]
    blocks = tuple(
        BlockRange(t, start + 5_000 + s, start + 5_000 + s + (t * 104_729) % 4_000)
        for t, s in zip(range(1, 501), spread, strict=True)
    )
    pins = Pins(registry=2**40, incarnation=2**64 - 1, dedup=DedupMode.TOKEN)
    metadata = Metadata(2**64 - 1, 10**9, start, end, start + 5_000, blocks, pins)
    text = encode(metadata)
    assert len(text) <= 4096
    assert decode(text) == metadata


def test_pins_without_a_structure_mark_encode_exactly_as_before() -> None:
    """An intent of a token-deduplicating server (no mark) is the string it was."""
    pins = Pins(registry=40, incarnation=OLD, dedup=DedupMode.TOKEN)
    metadata = Metadata(7, 3, 100, 200, 120, (BlockRange(2, 120, 150),), pins)
    text = encode_base85(metadata)
    marked = encode_base85(
        dataclasses.replace(metadata, pins=dataclasses.replace(pins, structure=9)))
    assert len(marked) > len(text)
    assert decode(text).pins.structure == 0 and decode(marked).pins.structure == 9


@pytest.mark.parametrize("bad", [[1, 2], [1, 2, 9], [-1, 0, 0], [2**63, 0, 0], "x", [True, 0, 0],
                                 [1, 2, 1, -5], [1, 2, 1, 2**63], [1, 2, 1, 3, 4]])
def test_bad_pins_are_a_decode_error(bad: object) -> None:
    import base64

    import msgpack

    body = msgpack.packb([1, 0, 0, 10, 10, b"", None, bad], use_bin_type=True)
    with pytest.raises(MetadataDecodeError):
        decode(PREFIX_PINNED + base64.b85encode(body).decode("ascii"))


def test_incarnation_is_a_pure_nonzero_fingerprint_of_cluster_and_topic_id() -> None:
    assert incarnation_of("c", "t") == incarnation_of("c", "t") != 0
    assert len({incarnation_of("c", "t"), incarnation_of("c2", "t"),
                incarnation_of("c", "t2")}) == 3


def test_token_carries_the_incarnation_and_keeps_the_old_format_without_one() -> None:
    assert block_token("events", 0, "db.t", 5, 9) == "blockagg:events:0:db.t:5-9"
    assert block_token("events", 0, "db.t", 5, 9, 0xAB) == (
        "blockagg:00000000000000ab:events:0:db.t:5-9")
    assert block_token("events", 0, "db.t", 5, 9, OLD) != block_token(
        "events", 0, "db.t", 5, 9, NEW)


def _intent(store: MemoryMetadataStore, pins: Pins) -> Committed:
    """Run one batch whose insert dies after its first intent; return that commit."""

    class Dies(Exception):
        pass

    class DyingSink(DedupSink):
        def insert(self, block, batch, confirmed_at=None):  # type: ignore[no-untyped-def]
            raise Dies

    batch = make_batch(STREAM, 0, 20, pins=pins)
    with pytest.raises(Dies):
        run_batch(plan_batch(batch, store.committed("events", 0), THRESHOLDS, 1, 0), store,
                  DyingSink())
    committed = store.committed("events", 0)
    assert committed is not None and decode(committed.metadata).blocks
    return committed


def test_a_replay_uses_the_pins_of_the_intent_it_replays() -> None:
    store = MemoryMetadataStore()
    first = Pins(registry=40, incarnation=OLD, dedup=DedupMode.BLOCK_HASH)
    committed = _intent(store, first)
    now = Pins(registry=45, incarnation=OLD, dedup=DedupMode.TOKEN)
    assert batch_pins("events", 0, committed, now) == first


def test_a_replay_keeps_the_intents_structure_mark_never_a_later_one() -> None:
    """The mark must precede the replayed blocks' first attempts: a mark read now
    would hide an ALTER made since (aggregator.clickhouse.structure)."""
    for first_mark in (0, 17):
        store = MemoryMetadataStore()
        first = Pins(registry=40, incarnation=OLD, dedup=DedupMode.BLOCK_HASH,
                     structure=first_mark)
        committed = _intent(store, first)
        now = dataclasses.replace(first, structure=99)
        assert batch_pins("events", 0, committed, now).structure == first_mark


def test_after_a_final_commit_the_current_pins_apply() -> None:
    store = MemoryMetadataStore()
    first = Pins(registry=40, incarnation=OLD, dedup=DedupMode.BLOCK_HASH)
    batch = make_batch(STREAM, 0, 20, pins=first)
    run_batch(plan_batch(batch, None, THRESHOLDS, 1, 0), store, DedupSink())
    committed = store.committed("events", 0)
    assert committed is not None and decode(committed.metadata).is_final
    assert decode(committed.metadata).pins == first
    now = Pins(registry=45, incarnation=OLD, dedup=DedupMode.TOKEN)
    assert batch_pins("events", 0, committed, now) == now


def test_an_intent_written_before_pins_replays_with_the_old_token_format() -> None:
    store = MemoryMetadataStore()
    committed = _intent(store, NO_PINS)
    now = Pins(registry=45, incarnation=NEW, dedup=DedupMode.TOKEN)
    pins = batch_pins("events", 0, committed, now)
    assert pins == Pins(registry=45, incarnation=0, dedup=DedupMode.TOKEN)
    plan = plan_batch(make_batch(STREAM, 0, 20, pins=pins), committed, THRESHOLDS, 1, 1)
    assert all(":events:" in b.token and b.token.startswith("blockagg:events:")
               for b in plan.blocks)


@pytest.mark.parametrize("final", [False, True])
def test_a_recreated_topic_is_refused_naming_the_recovery(final: bool) -> None:
    store = MemoryMetadataStore()
    first = Pins(registry=40, incarnation=OLD)
    if final:
        run_batch(plan_batch(make_batch(STREAM, 0, 20, pins=first), None, THRESHOLDS, 1, 0),
                  store, DedupSink())
        committed = store.committed("events", 0)
    else:
        committed = _intent(store, first)
    with pytest.raises(TopicIncarnationChanged, match="--reset-offsets --to-earliest") as err:
        batch_pins("events", 0, committed, Pins(registry=40, incarnation=NEW))
    assert "events[0]" in str(err.value)
    assert ("intent listing blocks" in str(err.value)) is not final
    with pytest.raises(TopicIncarnationChanged):
        plan_batch(make_batch(STREAM, 0, 20, pins=Pins(registry=40, incarnation=NEW)),
                   committed, THRESHOLDS, 1, 1)


def test_a_batch_prepared_under_other_pins_than_its_intent_is_refused() -> None:
    store = MemoryMetadataStore()
    committed = _intent(store, Pins(registry=40, incarnation=OLD))
    with pytest.raises(PinsMismatch, match="registry=41"):
        plan_batch(make_batch(STREAM, 0, 20, pins=Pins(registry=41, incarnation=OLD)),
                   committed, THRESHOLDS, 1, 1)


def test_every_commit_of_a_batch_carries_its_pins() -> None:
    store = MemoryMetadataStore()
    pins = Pins(registry=3, incarnation=OLD, dedup=DedupMode.TOKEN)
    run_batch(plan_batch(make_batch(STREAM, 0, 20, pins=pins), None, THRESHOLDS, 1, 0),
              store, DedupSink())
    history = store.metadata_history()
    assert len(history) > 2 and {m.pins for m in history} == {pins}
