from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockagg.proto.blockagg.v1.envelope_pb2 import Envelope
from blockagg.proto.decode import PAD, decode_ranges, padded_buffer
from blockagg.proto.envelope import (
    JoinedValues,
    Parsed,
    Rejected,
    make_envelope,
    parse_envelope,
    parse_envelopes,
)

pytestmark = pytest.mark.usefixtures("wire_scan")


def test_roundtrip() -> None:
    value = make_envelope("db.t", [b"\x08\x01", b""], version=3)
    assert parse_envelope(value) == Parsed("db.t", 3, [b"\x08\x01", b""])


def test_latest_is_zero() -> None:
    parsed = parse_envelope(make_envelope("db.t", [b"x"]))
    assert isinstance(parsed, Parsed) and parsed.version == 0


def test_none_is_rejected() -> None:
    assert isinstance(parse_envelope(None), Rejected)


def test_garbage_is_rejected() -> None:
    result = parse_envelope(b"\xff\xff\xff")
    assert isinstance(result, Rejected)
    assert "Envelope" in result.reason


def test_bad_table_names() -> None:
    for name in ["", "t", "a.b.c", "1a.b", "a.", ".b", "a b.c"]:
        result = parse_envelope(make_envelope(name, [b"x"]))
        assert isinstance(result, Rejected), name


def test_no_rows_rejected() -> None:
    result = parse_envelope(make_envelope("db.t", []))
    assert isinstance(result, Rejected)
    assert result.table == "db.t"


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=200))
def test_never_raises(data: bytes) -> None:
    result = parse_envelope(data)
    assert isinstance(result, Parsed | Rejected)
    assert parse_envelope(data) == result


ENVELOPE_PARTS = st.one_of(
    st.builds(make_envelope, st.sampled_from(["db.t", "db.u", "bad"]),
              st.lists(st.binary(max_size=20), max_size=4), st.integers(0, 3)),
    st.binary(max_size=24),
    # an unknown group (field 4): upb skips it, the lock-step parse hands the row to upb
    st.builds(lambda v: v + b"\x23\x24", st.builds(make_envelope, st.just("db.t"),
                                                   st.lists(st.binary(max_size=5),
                                                            min_size=1, max_size=2))),
)


@settings(max_examples=200, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(ENVELOPE_PARTS, min_size=1, max_size=2).map(b"".join), max_size=12))
def test_spans_are_where_the_rows_column_copies_from(values: list[bytes]) -> None:
    """``decode_ranges(..., spans={"rows"})`` (the envelope's rows left in place) points
    at exactly the bytes the copied ``rows`` column holds, with the same errors and
    other columns; and a batch needing upb decodes as a column (no spans)."""
    descriptor: Any = Envelope.DESCRIPTOR
    lengths = np.array([len(v) for v in values], dtype=np.int64)
    ends = np.cumsum(lengths)
    buf = padded_buffer(b"".join(values))
    want = decode_ranges(descriptor, buf, ends - lengths, ends)
    got = decode_ranges(descriptor, buf, ends - lengths, ends, spans=frozenset({"rows"}))
    assert got.errors == want.errors
    if "rows" not in got.spans:
        assert got.columns["rows"].to_pylist() == want.columns["rows"].to_pylist()
        return
    assert set(got.columns) == set(want.columns) - {"rows"}
    for name, column in got.columns.items():
        assert column.to_pylist() == want.columns[name].to_pylist()
    spans = got.spans["rows"]
    rows = [[buf[a:b].tobytes() for a, b in zip(spans.starts[lo:hi].tolist(),
                                                spans.ends[lo:hi].tolist(), strict=True)]
            for lo, hi in itertools.pairwise(spans.bounds.tolist())]
    good = [i for i in range(len(values)) if i not in want.errors]
    listed = want.columns["rows"].to_pylist()
    assert [rows[i] for i in good] == [listed[i] for i in good]


@settings(max_examples=200, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(ENVELOPE_PARTS, st.none()), max_size=12))
def test_bulk_envelopes_parse_like_parse_envelope(values: list[bytes | None]) -> None:
    """:func:`parse_envelopes` (rows left in place, or copied when upb had to decide
    a message) gives :func:`parse_envelope`'s result for every message, and
    ``rows_of`` lays out the accepted messages' rows as ``decode_rows`` would."""
    envelopes = parse_envelopes(values)
    assert list(envelopes) == [parse_envelope(v) for v in values]
    accepted = np.flatnonzero(envelopes.table_index >= 0)
    buf, starts, ends, counts = envelopes.rows_of(accepted)
    flat = [row for i in accepted.tolist() for row in envelopes.rows(i)]
    assert counts.tolist() == [len(envelopes.rows(i)) for i in accepted.tolist()]
    assert [buf[a:b].tobytes() for a, b in zip(starts.tolist(), ends.tolist(),
                                               strict=True)] == flat
    assert buf[:int(ends[-1]) if ends.size else 0].tobytes() == b"".join(flat)
    assert not buf[int(ends[-1]) if ends.size else 0:].any()


def test_an_envelope_upb_must_decide_parses_alike() -> None:
    """An unknown group in an envelope: upb skips it; the bulk parse agrees, and its
    neighbours' rows stay right."""
    odd = make_envelope("db.t", [b"\x08\x01"], 2) + b"\x23\x24"
    values = [make_envelope("db.u", [b"\x08\x02", b""], 1), odd, None]
    assert parse_envelope(odd) == Parsed("db.t", 2, [b"\x08\x01"])
    assert list(parse_envelopes(values)) == [parse_envelope(v) for v in values]


@settings(max_examples=200, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(ENVELOPE_PARTS, st.none()), max_size=12), st.data())
def test_joined_values_are_the_values_and_parse_alike(values: list[bytes | None],
                                                      data: st.DataObject) -> None:
    """The values of Arrow chunks (cut anywhere, some of them slices of a larger
    array) joined in one buffer are the values, one by one and as slices, and their
    envelopes parse exactly as the list's do."""
    cuts = sorted(data.draw(st.lists(st.integers(0, len(values)), max_size=3)))
    bounds = [0, *cuts, len(values)]
    chunks = []
    for lo, hi in itertools.pairwise(bounds):
        kind = data.draw(st.sampled_from([pa.binary(), pa.large_binary()]))
        whole = pa.array([b"pre", *values[lo:hi], b"post"], type=kind)
        chunks.append(whole.slice(1, hi - lo) if data.draw(st.booleans())
                      else pa.array(values[lo:hi], type=kind))
    joined = JoinedValues.from_arrow(chunks)
    assert len(joined) == len(values)
    assert list(joined) == values
    assert [joined[i] for i in range(-len(values), 0)] == values
    assert joined[1:5] == values[1:5]
    assert not joined.buf[joined.buf.size - PAD:].any()
    assert list(parse_envelopes(joined)) == list(parse_envelopes(values))
    assert parse_envelopes(joined).sizes.tolist() == parse_envelopes(values).sizes.tolist()


def test_a_null_value_whose_producer_left_bytes_is_none() -> None:
    """Arrow does not say a null's bytes are empty: a null that spans bytes is still
    ``None``, and its bytes are not another value's."""
    data = b"abcXYZdef"
    offsets = np.array([0, 3, 6, 9], dtype=np.int32)
    validity = pa.array([True, False, True]).buffers()[1]
    chunk = pa.Array.from_buffers(pa.binary(), 3, [validity, pa.py_buffer(offsets.tobytes()),
                                                   pa.py_buffer(data)], null_count=1)
    joined = JoinedValues.from_arrow([chunk, pa.array([b"g"], type=pa.binary())])
    assert list(joined) == [b"abc", None, b"def", b"g"]
    assert joined.lengths.tolist() == [3, 0, 3, 1]


def test_values_that_are_not_binary_are_refused() -> None:
    with pytest.raises(TypeError, match="binary"):
        JoinedValues.from_arrow([pa.array(["text"], type=pa.string())])
