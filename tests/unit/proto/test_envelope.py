from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from blockagg.proto.envelope import Parsed, Rejected, make_envelope, parse_envelope


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


@given(st.binary(max_size=200))
def test_never_raises(data: bytes) -> None:
    result = parse_envelope(data)
    assert isinstance(result, Parsed | Rejected)
    assert parse_envelope(data) == result
