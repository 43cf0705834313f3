"""The compiled wire scan (``blockagg/proto/_wirescan.c``): it takes every batch of regular
rows, declines every batch holding a row the lock step would mark, gives the numpy scan's
columns, and refuses arrays that do not fit instead of writing past them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from google.protobuf.descriptor import Descriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockagg.proto import decode
from blockagg.proto.decode import decode_rows, padded_buffer
from tests.unit.proto.test_decode import _same, samples

pytestmark = pytest.mark.skipif(decode._wirescan is None, reason="_wirescan not built "
                                "(tests/unit/proto/conftest.py's wire_scan fails for that)")

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def both_scans(desc: Descriptor, rows: list[bytes], monkeypatch: pytest.MonkeyPatch
               ) -> tuple[decode.Decoded, decode.Decoded, int]:
    """``rows`` decoded with the compiled scan and with the numpy scan, and how many
    messages (nested ones included) the compiled scan recorded."""
    fills = 0
    compiled: Any = decode._wirescan
    assert compiled is not None

    class Counting:
        gather = staticmethod(compiled.gather)
        load8 = staticmethod(compiled.load8)

        @staticmethod
        def scan(*args: Any) -> Any:
            nonlocal fills
            out = compiled.scan(*args)
            fills += out is not None
            return out

    monkeypatch.setattr(decode, "_wirescan", Counting)
    fast = decode_rows(desc, rows)
    monkeypatch.setattr(decode, "_wirescan", None)
    slow = decode_rows(desc, rows)
    monkeypatch.setattr(decode, "_wirescan", compiled)
    return fast, slow, fills


def assert_same(a: decode.Decoded, b: decode.Decoded) -> None:
    assert a.errors == b.errors
    assert list(a.columns) == list(b.columns)
    for name in a.columns:
        assert a.columns[name].type == b.columns[name].type, name
        assert _same(a.columns[name].to_pylist(), b.columns[name].to_pylist()), name


@SETTINGS
@given(data=st.data())
def test_regular_rows_take_the_compiled_scan_and_decode_alike(
        sample: Descriptor, data: st.DataObject, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = data.draw(st.lists(samples(sample), min_size=1, max_size=12))
    fast, slow, fills = both_scans(sample, rows, monkeypatch)
    assert_same(fast, slow)
    assert not fast.errors
    assert fills >= 1  # the top-level message at least


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _tag(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


IRREGULAR = {
    "field number 0": _tag(0, 0) + b"\x01",
    "tag over 5 bytes": b"\x88\x80\x80\x80\x80\x00\x01",
    "tag above 2**32": b"\xf8\xff\xff\xff\x7f\x01",
    "varint over 10 bytes": _tag(1, 0) + b"\xff" * 10 + b"\x01",
    "varint past the row": _tag(1, 0) + b"\xff",
    "length prefix over 5 bytes": _tag(14, 2) + b"\x81\x80\x80\x80\x80\x00",
    "length past the row": _tag(14, 2) + b"\x05ab",
    "fixed64 past the row": _tag(8, 1) + b"\x01\x02",
    "fixed32 past the row": _tag(7, 5) + b"\x01",
    "start group": _tag(40, 3) + _tag(40, 4),
    "end group": _tag(40, 4),
    "wire type 6": _tag(1, 6),
    "validated string twice": _tag(14, 2) + b"\x01a" + _tag(14, 2) + b"\x01b",
    "message twice": _tag(20, 2) + b"\x00" + _tag(20, 2) + b"\x00",
    "two members of a oneof": _tag(27, 2) + b"\x01a" + _tag(28, 0) + b"\x01",
    "packed varint cut off": _tag(21, 2) + b"\x02\x01\x80",
    "packed double of 7 bytes": _tag(23, 2) + b"\x07" + b"\x00" * 7,
}


@pytest.mark.parametrize("row", IRREGULAR.values(), ids=IRREGULAR.keys())
def test_a_row_the_lock_step_marks_sends_the_batch_to_the_numpy_scan(
        sample: Descriptor, row: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    good = sample.fields_by_name["i32"]
    rows = [_tag(good.number, 0) + b"\x07", row, b""]
    fast, slow, _ = both_scans(sample, rows, monkeypatch)
    assert_same(fast, slow)
    buf = padded_buffer(b"".join(rows))
    ends = np.cumsum([len(r) for r in rows]).astype(np.int64)
    starts = ends - np.asarray([len(r) for r in rows], dtype=np.int64)
    monkeypatch.setattr(decode, "_wirescan", None)
    assert decode._scanned(sample, buf, starts, ends) is None  # not compiled
    monkeypatch.undo()
    assert decode._scanned(sample, buf, starts, ends) is None  # not regular
    assert decode._scanned(sample, buf, starts[:1], ends[:1]) is not None


def test_a_singular_field_repeated_on_the_wire_keeps_its_last_value(
        sample: Descriptor, monkeypatch: pytest.MonkeyPatch) -> None:
    row = _tag(1, 0) + b"\x01" + _tag(7, 5) + b"\x01\x00\x00\x00" + _tag(1, 0) + b"\x02" \
        + _tag(7, 5) + b"\x02\x00\x00\x00" + _tag(15, 2) + b"\x01a" + _tag(15, 2) + b"\x01b"
    fast, slow, fills = both_scans(sample, [row], monkeypatch)
    assert_same(fast, slow)
    assert fills >= 1
    assert fast.columns["i32"].to_pylist() == [2]
    assert fast.columns["f32"].to_pylist() == [2]
    assert fast.columns["blob"].to_pylist() == [b"b"]


def test_packed_and_unpacked_values_keep_their_wire_order(
        sample: Descriptor, monkeypatch: pytest.MonkeyPatch) -> None:
    row = (_tag(21, 0) + b"\x01" + _tag(21, 2) + b"\x02\x02\x03" + _tag(21, 0) + b"\x04"
           + _tag(29, 5) + b"\x05\x00\x00\x00" + _tag(29, 2) + b"\x04\x06\x00\x00\x00")
    fast, slow, fills = both_scans(sample, [row, row], monkeypatch)
    assert_same(fast, slow)
    assert fills >= 1
    assert fast.columns["packed_ints"].to_pylist() == [[1, 2, 3, 4]] * 2
    assert fast.columns["fixeds"].to_pylist() == [[5, 6]] * 2


def test_arrays_that_do_not_fit_are_refused() -> None:
    scan = decode._wirescan
    assert scan is not None
    buf = padded_buffer(_tag(1, 0) + b"\x01" + _tag(2, 0) + b"\x02")
    spec = np.asarray([-1, (0 << 8) | 0x10, (1 << 8)], dtype=np.int32)
    groups = np.asarray([0, 1], dtype=np.int32)
    starts, ends = np.asarray([0], dtype=np.int64), np.asarray([4], dtype=np.int64)
    singular = (np.zeros(1, dtype=np.uint8), np.zeros(1, dtype=np.uint64),
                np.zeros(0, dtype=np.int64))
    with pytest.raises(ValueError, match="outside the buffer"):
        scan.scan(buf, starts, np.asarray([buf.size + 1], dtype=np.int64), spec, groups,
                  [None, singular])
    with pytest.raises(ValueError, match="groups"):
        scan.scan(buf, starts, ends, spec, np.asarray([0, 5], dtype=np.int32), [None, singular])
    with pytest.raises(ValueError, match="3 arrays a singular slot"):
        scan.scan(buf, starts, ends, spec, groups, [singular, singular])
    with pytest.raises(ValueError, match="an item per slot"):
        scan.scan(buf, starts, ends, spec, groups, [None])
    with pytest.raises(BufferError):
        scan.scan(buf, starts, ends, spec, groups, [None, (b"", b"", b"")])
    too_short = (np.zeros(0, dtype=np.uint8), np.zeros(0, dtype=np.uint64),
                 np.zeros(0, dtype=np.int64))
    assert scan.scan(buf, starts, ends, spec, groups, [None, too_short]) is None
    repeated = scan.scan(buf, starts, ends, spec, groups, [None, singular])
    assert repeated is not None and repeated[1] is None
    rows, steps, values, lengths = (np.frombuffer(a, dtype=np.int64) for a in repeated[0])
    assert (rows.tolist(), steps.tolist(), values.tolist(), lengths.tolist()) == (
        [0], [0], [1], [])
    assert singular[0].tolist() == [1] and singular[1].tolist() == [2]


def test_gather_and_load8_refuse_ranges_outside_the_buffer() -> None:
    scan = decode._wirescan
    assert scan is not None
    buf = padded_buffer(b"abcdef")
    out = np.empty(3, dtype=np.uint8)
    scan.gather(buf, np.asarray([1, 4], dtype=np.int64), np.asarray([2, 1], dtype=np.int64), out)
    assert out.tobytes() == b"bce"
    with pytest.raises(ValueError, match="outside the buffer"):
        scan.gather(buf, np.asarray([buf.size - 1], dtype=np.int64),
                    np.asarray([3], dtype=np.int64), out)
    with pytest.raises(ValueError, match="total length"):
        scan.gather(buf, np.asarray([0], dtype=np.int64), np.asarray([2], dtype=np.int64), out)
    loaded = np.empty(1, dtype=np.uint64)
    scan.load8(buf, np.asarray([1], dtype=np.int64), loaded)
    assert int(loaded[0]) == int.from_bytes(b"bcdef\x00\x00\x00", "little")
    with pytest.raises(ValueError, match="within 8 bytes"):
        scan.load8(buf, np.asarray([buf.size - 7], dtype=np.int64), loaded)
