"""Tables whose plans share a shape (one message descriptor, the same fields into the
same column types) are decoded in one pass and converted once per column
(``rows.decide_envelopes_many``), not once per table: the per-block cost of the
decoder (issue 28). The decisions and the insert bytes must be exactly those of the
per-message path (``prepare``): the block's deduplication hash (18.16) depends on
them, so a replay prepared by either rebuilds the first attempt's blocks. Seeded
property tests over mixes of tables of one and of several shapes, with rows that do
not decode and values that do not convert (which send a shape back to one decode per
table)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from google.protobuf.descriptor import Descriptor
from hypothesis import given, settings
from hypothesis import strategies as st

from blockagg.aggregator.clickhouse.writer import ClickHouseBlockWriter, Replica, WriterConfig
from blockagg.aggregator.core.model import Batch, Thresholds
from blockagg.aggregator.core.protocol import plan_batch
from blockagg.proto.decode import decode_in_place
from blockagg.proto.descriptors import compile_proto, load_descriptor, message_class
from blockagg.proto.envelope import make_envelope
from blockagg.proto.registry import MemoryStore, Registry
from blockagg.registration.register import register
from blockagg.rows import columns as rows_module
from blockagg.rows.columns import Column, Payloads, Rows
from blockagg.rows.deadletters import DeadLetter
from blockagg.rows.prepare import Message, Plans, prepare, prepare_envelopes

SMALL = [Column("a", "UInt8"), Column("b", "String")]
WIDE = [Column("a", "Int64"), Column("b", "String"), Column("_offset", "UInt64"),
        Column("_topic", "String")]
SHAPES = Path(__file__).parent.parent / "proto" / "shapes.proto"
WIDE_TYPES = [Column("i64", "Int64"), Column("u32", "UInt32"), Column("text", "String"),
              Column("blob", "String"),
              Column("kind", "Enum8('KIND_UNSPECIFIED' = 0, 'ONE' = 1, 'TWO' = 2)"),
              Column("fl", "Float32"), Column("db", "Float64"), Column("ts", "DateTime"),
              Column("packed_ints", "Array(Int64)"), Column("doubles", "Array(Float64)"),
              Column("names", "Array(String)"), Column("_offset", "UInt64")]
LIVE = {"db.a": SMALL, "db.c": SMALL, "db.d": SMALL, "db.e": WIDE, "db.f": WIDE,
        "db.s1": WIDE_TYPES, "db.s2": WIDE_TYPES}
INNER_TABLES = ("db.a", "db.c", "db.d", "db.e", "db.f")


@pytest.fixture(scope="module")
def shapes_fds() -> bytes:
    return compile_proto(SHAPES)


def registry(sample_fds: bytes, shapes_fds: bytes) -> Registry:
    store = MemoryStore()
    for table in INNER_TABLES:
        register(store, table, "blockagg.test.Inner", sample_fds, now_ms=1_000)
    for table in ("db.s1", "db.s2"):
        register(store, table, "blockagg.test.Wide", shapes_fds, now_ms=1_000)
    return Registry.load(store)


@st.composite
def envelope(draw: st.DrawFn, inner: Any, wide: Any) -> bytes:
    table = draw(st.sampled_from([*INNER_TABLES, "db.s1", "db.s2"]))
    n = draw(st.integers(1, 3))
    if table.startswith("db.s"):
        rows = [wide(i64=draw(st.integers(-2**40, 2**40)), u32=draw(st.integers(0, 2**32 - 1)),
                     text=draw(st.text(max_size=4)), blob=draw(st.binary(max_size=4)),
                     kind=draw(st.integers(0, 2)), fl=draw(st.floats(-1e6, 1e6, width=32)),
                     db=draw(st.floats(allow_nan=False)),
                     ts={"seconds": draw(st.integers(0, 2**31))},
                     packed_ints=draw(st.lists(st.integers(-2**62, 2**62), max_size=3)),
                     doubles=draw(st.lists(st.floats(allow_nan=False), max_size=3)),
                     names=draw(st.lists(st.text(max_size=3), max_size=3)),
                     ).SerializeToString() for _ in range(n)]
    else:
        # a up to 300: out of UInt8's range in db.a/c/d (a conversion error)
        rows = [inner(a=draw(st.integers(-3, 300)), b=draw(st.text(max_size=4))
                      ).SerializeToString() for _ in range(n)]
    if draw(st.integers(0, 9)) == 0:
        rows.append(b"\xff")  # a row that does not decode
    return make_envelope(table, rows, draw(st.sampled_from([0, 1])))


def messages_of(values: list[bytes]) -> list[Message]:
    return [Message(i, 5_000, v) for i, v in enumerate(values)]


def test_tables_of_one_shape_decide_and_insert_as_per_message(
        sample: Descriptor, sample_fds: bytes, shapes_fds: bytes) -> None:
    inner: Any = message_class(sample.fields_by_name["inner"].message_type)  # type: ignore[arg-type]
    wide: Any = message_class(load_descriptor(shapes_fds, "blockagg.test.Wide"))
    snapshot = registry(sample_fds, shapes_fds)
    sink = ClickHouseBlockWriter(WriterConfig(replicas=(Replica("h"),)))

    @settings(max_examples=120, derandomize=True, deadline=None, database=None)
    @given(st.lists(envelope(inner, wide), min_size=1, max_size=30),
           st.integers(1, 12), st.booleans(), st.sampled_from([1 << 15, 4]))
    def check(values: list[bytes], max_rows: int, numpy: bool, chunk: int) -> None:
        messages = messages_of(values)
        old = prepare("top", 2, messages, Plans(snapshot, lambda t: LIVE[t]), "bl.dead")
        default, rows_module.SHARED_DECODE_ROWS = rows_module.SHARED_DECODE_ROWS, chunk
        try:  # 4: shapes cut into several decodes
            new = prepare_envelopes("top", 2, [m.offset for m in messages],
                                    [m.timestamp_ms for m in messages], values,
                                    Plans(snapshot, lambda t: LIVE[t]), "bl.dead")
        finally:
            rows_module.SHARED_DECODE_ROWS = default
        assert old.table_ids.tolist() == new.table_ids.tolist()
        assert old.row_counts.tolist() == new.row_counts.tolist()
        assert list(old.tables.items()) == list(new.tables.items())
        for a, b in zip(old.payloads, new.payloads, strict=True):
            if isinstance(a, DeadLetter):
                assert a == b
                continue
            assert isinstance(a, Rows) and isinstance(b, Rows)
            assert a.columns.plan.table == b.columns.plan.table
            assert a.count == b.count
            for x, y in zip(a.columns.values, b.columns.values, strict=True):
                assert type(x) is type(y)
                assert list(x[a.start:a.stop]) == list(y[b.start:b.stop])
        assert isinstance(new.payloads, Payloads)
        batches = [Batch("top", 2, 0, len(values), p.offsets, p.table_ids, p.row_counts,
                         p.sizes, p.payloads, p.tables) for p in (old, new)]
        plan = plan_batch(batches[1], None, Thresholds(max_rows, 1 << 30), 1, 1)
        for block in plan.blocks:
            before, after = (sink.block_data(block, b, numpy=numpy) for b in batches)
            assert (before.names, before.numpy) == (after.names, after.numpy)
            assert before.fresh(lists=True) == after.fresh(lists=True)
            if before.numpy:
                # The Native bytes sent: what 18.16's block hash is computed on.
                assert before.fresh(native=True).encoded == after.fresh(native=True).encoded
    check()


def test_tables_of_one_shape_share_one_decode(sample: Descriptor, sample_fds: bytes,
                                              shapes_fds: bytes,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Five tables, two shapes (db.a/c/d, db.e/f): two decodes, and the tables of a
    shape hold row ranges of the same converted columns."""
    inner: Any = message_class(sample.fields_by_name["inner"].message_type)  # type: ignore[arg-type]
    calls: list[int] = []

    def counted(*args: Any) -> Any:
        calls.append(int(args[2].size))
        return decode_in_place(*args)

    monkeypatch.setattr(rows_module, "decode_in_place", counted)
    values = [make_envelope(t, [inner(a=i, b=t).SerializeToString()] * 2, 1)
              for i, t in enumerate([*INNER_TABLES, *INNER_TABLES])]
    prepared = prepare_envelopes("top", 0, list(range(len(values))), [5_000] * len(values),
                                 values, Plans(registry(sample_fds, shapes_fds), lambda t: LIVE[t]))
    assert sorted(calls) == [8, 12]
    payloads = list(prepared.payloads)
    assert all(isinstance(p, Rows) for p in payloads)
    by_table = {p.columns.plan.table: p for p in payloads if isinstance(p, Rows)}
    assert by_table["db.a"].columns.values is by_table["db.d"].columns.values
    assert by_table["db.e"].columns.values is by_table["db.f"].columns.values
    assert by_table["db.a"].columns.values is not by_table["db.e"].columns.values
    calls.clear()
    monkeypatch.setattr(rows_module, "SHARED_DECODE_ROWS", 8)  # two tables' rows a decode
    prepare_envelopes("top", 0, list(range(len(values))), [5_000] * len(values),
                      values, Plans(registry(sample_fds, shapes_fds), lambda t: LIVE[t]))
    assert calls == [8, 4, 8]
    got = [(p.columns.plan.table, np.asarray(p.columns.values[0][p.start:p.stop]).tolist())
           for p in payloads if isinstance(p, Rows)]
    assert got == [(t, [i, i]) for i, t in enumerate([*INNER_TABLES, *INNER_TABLES])]
