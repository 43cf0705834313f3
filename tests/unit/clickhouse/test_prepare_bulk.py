"""The bulk preparation (envelopes parsed in lock step, the registry consulted once per
(table, version): ``prepare_envelopes``) decides exactly as the per-message one
(``prepare`` over ``parse_envelope``): the same tables, dead letters with the same
reasons, the same rows in the same payloads. A replay prepared by either therefore
rebuilds the first attempt's blocks. Seeded property tests over mixes of good,
malformed, unregistered, unknown-version and undecodable messages."""

from __future__ import annotations

from typing import Any

import numpy as np
from google.protobuf.descriptor import Descriptor
from hypothesis import given, settings
from hypothesis import strategies as st

from blockagg.aggregator.clickhouse.writer import ClickHouseBlockWriter, Replica, WriterConfig
from blockagg.aggregator.core.model import Batch, Thresholds
from blockagg.aggregator.core.protocol import plan_batch
from blockagg.proto.descriptors import message_class
from blockagg.proto.envelope import make_envelope, parse_envelope, parse_envelopes
from blockagg.proto.registry import MemoryStore, Registry
from blockagg.registration.register import register
from blockagg.rows.columns import Column, Payloads, Rows
from blockagg.rows.deadletters import DeadLetter
from blockagg.rows.prepare import (
    Message,
    Plans,
    Prepared,
    prepare,
    prepare_envelopes,
)

LIVE = {"db.a": [Column("a", "UInt8"), Column("b", "String")],
        "db.b": [Column("a", "Int64"), Column("b", "String"),
                 Column("_offset", "UInt64")]}


def registry(sample_fds: bytes) -> Registry:
    store = MemoryStore()
    register(store, "db.a", "blockagg.test.Inner", sample_fds, now_ms=1_000)
    # version 2 of db.a: another message type the live columns don't fit
    register(store, "db.a", "blockagg.test.Sample", sample_fds, now_ms=2_000, force=True)
    register(store, "db.b", "blockagg.test.Inner", sample_fds, now_ms=5_000)
    return Registry.load(store)


@st.composite
def values(draw: st.DrawFn, inner: Any) -> tuple[bytes | None, int]:
    ts = draw(st.sampled_from([500, 1_000, 1_500, 2_000, 2_500, 6_000]))
    kind = draw(st.sampled_from(["ok", "ok", "ok", "garbage", "none", "bad_row", "mutated"]))
    if kind == "none":
        return None, ts
    if kind == "garbage":
        return draw(st.binary(max_size=12)), ts
    table = draw(st.sampled_from(["db.a", "db.a", "db.b", "db.nope", "bad name"]))
    version = draw(st.sampled_from([0, 0, 1, 1, 2, 9]))
    rows = [inner(a=draw(st.integers(-3, 300)), b=draw(st.text(max_size=4))).SerializeToString()
            for _ in range(draw(st.integers(0, 3)))]
    if kind == "bad_row":
        rows.append(b"\xff")
    value = make_envelope(table, rows, version)
    if kind == "mutated" and value:
        at = draw(st.integers(0, len(value) - 1))
        value = value[:at] + bytes([draw(st.integers(0, 255))]) + value[at + 1:]
    return value, ts


def same(old: Prepared, new: Prepared) -> None:
    assert old.offsets.tolist() == new.offsets.tolist()
    assert old.table_ids.tolist() == new.table_ids.tolist()
    assert old.row_counts.tolist() == new.row_counts.tolist()
    assert old.sizes.tolist() == new.sizes.tolist()
    assert list(old.tables.items()) == list(new.tables.items())
    for a, b in zip(old.payloads, new.payloads, strict=True):
        if isinstance(a, DeadLetter):
            assert a == b
            continue
        assert isinstance(a, Rows) and isinstance(b, Rows)
        pa_, pb = a.columns.plan, b.columns.plan
        assert (pa_.table, pa_.version, pa_.columns) == (pb.table, pb.version, pb.columns)
        assert (a.start, a.stop) == (b.start, b.stop)
        for x, y in zip(a.columns.values, b.columns.values, strict=True):
            assert list(x[a.start:a.stop]) == list(y[b.start:b.stop])


def test_envelopes_parse_like_parse_envelope(sample: Descriptor) -> None:
    inner: Any = message_class(sample.fields_by_name["inner"].message_type)  # type: ignore[arg-type]

    @settings(max_examples=150, derandomize=True, deadline=None)
    @given(st.lists(values(inner), max_size=30))
    def check(items: list[tuple[bytes | None, int]]) -> None:
        batch = [v for v, _ in items]
        envelopes = parse_envelopes(batch)
        assert len(envelopes) == len(batch)
        assert [envelopes.parsed(i) for i in range(len(batch))] == [
            parse_envelope(v) for v in batch]
        assert list(envelopes) == [parse_envelope(v) for v in batch]
    check()


def test_bulk_prepare_decides_as_per_message(sample: Descriptor, sample_fds: bytes) -> None:
    inner: Any = message_class(sample.fields_by_name["inner"].message_type)  # type: ignore[arg-type]
    snapshot = registry(sample_fds)

    @settings(max_examples=150, derandomize=True, deadline=None)
    @given(st.lists(values(inner), max_size=40), st.booleans(), st.booleans())
    def check(items: list[tuple[bytes | None, int]], columnar: bool, reloads: bool) -> None:
        refreshed: list[int] = []

        def reload() -> Registry:
            refreshed.append(1)
            return snapshot

        def plans() -> Plans:
            return Plans(snapshot, lambda t: LIVE[t], reload if reloads else None)

        messages = [Message(10 + i, ts, v) for i, (v, ts) in enumerate(items)]
        old = prepare("top", 2, messages, plans(), "bl.dead", columnar)
        before = len(refreshed)
        new = prepare_envelopes("top", 2, [m.offset for m in messages],
                                [m.timestamp_ms for m in messages],
                                [m.value for m in messages], plans(), "bl.dead", columnar)
        assert len(refreshed) - before == before  # the same refresh decision
        same(old, new)
    check()


def test_bulk_prepare_example(sample: Descriptor, sample_fds: bytes) -> None:
    inner: Any = message_class(sample.fields_by_name["inner"].message_type)  # type: ignore[arg-type]
    ok = make_envelope("db.a", [inner(a=1).SerializeToString(),
                                inner(a=2, b="x").SerializeToString()], 1)
    values = [ok, b"\xff", make_envelope("db.nope", [b""]), make_envelope("db.a", [b""], 9),
              make_envelope("db.a", [inner(a=300).SerializeToString()], 1), None, ok,
              make_envelope("db.a", [b""], 0), make_envelope("db.b", [b""], 0)]
    stamps = [1_500] * 7 + [500, 6_000]
    plans = Plans(registry(sample_fds), lambda t: LIVE[t])
    prepared = prepare_envelopes("top", 3, list(range(100, 109)), stamps, values, plans)
    assert prepared.table_ids.tolist() == [1, 0, 0, 0, 0, 0, 1, 0, 2]
    assert prepared.tables == {1: "db.a", 2: "db.b", 0: "blockagg.dead_letters"}
    reasons = [p.error for p in prepared.payloads if isinstance(p, DeadLetter)]
    assert "Envelope" in reasons[0] and "not registered" in reasons[1]
    assert "version 9" in reasons[2] and "out of range" in reasons[3]
    assert "500 ms" in reasons[5]  # version 0 before any registration: names the timestamp
    rows = prepared.payloads[8]
    assert isinstance(rows, Rows)
    assert np.asarray(rows.columns.values[0][rows.start:rows.stop]).tolist() == [0]


def test_a_row_upb_rejects_is_a_dead_letter(sample_fds: bytes) -> None:
    """A malformed group goes to upb, which rejects it: a dead letter with upb's
    reason, by both paths (it used to fail the batch with a ValueError)."""
    value = make_envelope("db.a", [b"\x03\x01"], 1)
    for columnar in (True, False):
        old = prepare("top", 0, [Message(0, 1_500, value)],
                      Plans(registry(sample_fds), lambda t: LIVE[t]), columnar=columnar)
        new = prepare_envelopes("top", 0, [0], [1_500], [value],
                                Plans(registry(sample_fds), lambda t: LIVE[t]),
                                columnar=columnar)
        same(old, new)
        dead = new.payloads[0]
        assert isinstance(dead, DeadLetter) and "malformed group" in dead.error


def test_bulk_payloads_insert_the_same_bytes(sample: Descriptor, sample_fds: bytes) -> None:
    """The writer takes a block's rows from :class:`Payloads` as slices (no object
    per message): the same columns, path and Native bytes as from the list of the
    very same payloads, for every block of seeded mixes (several versions of a
    table in one block included), so a block is the same insert either way."""
    inner: Any = message_class(sample.fields_by_name["inner"].message_type)  # type: ignore[arg-type]
    snapshot = registry(sample_fds)
    sink = ClickHouseBlockWriter(WriterConfig(replicas=(Replica("h"),)))

    @settings(max_examples=120, derandomize=True, deadline=None, database=None)
    @given(st.lists(values(inner), max_size=40), st.integers(1, 12), st.booleans())
    def check(items: list[tuple[bytes | None, int]], max_rows: int, numpy: bool) -> None:
        prepared = prepare_envelopes("top", 2, list(range(len(items))), [t for _, t in items],
                                     [v for v, _ in items],
                                     Plans(snapshot, lambda t: LIVE[t]), "bl.dead")
        assert isinstance(prepared.payloads, Payloads)
        batches = [Batch("top", 2, 0, len(items), prepared.offsets, prepared.table_ids,
                         prepared.row_counts, prepared.sizes, payloads, prepared.tables)
                   for payloads in (prepared.payloads, list(prepared.payloads))]
        plan = plan_batch(batches[0], None, Thresholds(max_rows, 1 << 30), 1, 1)
        for block in plan.blocks:
            bulk, listed = (sink.block_data(block, b, numpy=numpy) for b in batches)
            assert (bulk.names, bulk.numpy, bulk.types) == (listed.names, listed.numpy,
                                                            listed.types)
            assert bulk.fresh(lists=True) == listed.fresh(lists=True)
            if bulk.numpy:
                assert (bulk.fresh(native=True).encoded
                        == listed.fresh(native=True).encoded)
    check()


def test_payloads_index_like_a_list(sample: Descriptor, sample_fds: bytes) -> None:
    inner: Any = message_class(sample.fields_by_name["inner"].message_type)  # type: ignore[arg-type]
    ok = make_envelope("db.b", [inner(a=1).SerializeToString(),
                                inner(a=2).SerializeToString()], 1)
    prepared = prepare_envelopes("top", 0, [0, 1, 2], [6_000] * 3, [ok, None, ok],
                                 Plans(registry(sample_fds), lambda t: LIVE[t]))
    payloads = prepared.payloads
    assert isinstance(payloads, Payloads) and len(payloads) == 3
    first, second, third = payloads
    assert isinstance(first, Rows) and (first.start, first.stop) == (0, 2)
    assert isinstance(third, Rows) and (third.start, third.stop) == (2, 4)
    assert isinstance(second, DeadLetter) and payloads[-2] is second
    assert len(payloads[1:]) == 2 and payloads[1:][0] is second
    runs = payloads.runs(np.array([0, 2]))
    assert runs is not None and [(r[1], r[2]) for r in runs[0]] == [(0, 4)]
    assert runs[1].tolist() == [2, 2]
    assert payloads.runs(np.array([0, 1])) is None
