"""The ``__consumer_offsets`` codec: hand-built vectors per version, and fuzzing."""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from blockagg.aggregator.kafka.exceptions import OffsetsDecodeError
from blockagg.aggregator.kafka.offsets_codec import (
    OffsetCommit,
    OffsetCommitKey,
    OffsetCommitValue,
    OffsetTombstone,
    SkippedRecord,
    decode_key,
    decode_record,
    decode_value,
    encode_key,
    encode_value,
)


def s16(text: bytes) -> bytes:
    return struct.pack(">h", len(text)) + text


def i16(v: int) -> bytes:
    return struct.pack(">h", v)


def i32(v: int) -> bytes:
    return struct.pack(">i", v)


def i64(v: int) -> bytes:
    return struct.pack(">q", v)


KEY_V1 = i16(1) + s16(b"grp") + s16(b"orders") + i32(7)
META = b"ba1:xyz"

VALUE_VECTORS = [
    (i16(0) + i64(42) + s16(META) + i64(1_700_000_000_000),
     OffsetCommitValue(42, "ba1:xyz", 1_700_000_000_000, version=0)),
    (i16(1) + i64(42) + s16(META) + i64(1_700_000_000_000) + i64(1_700_086_400_000),
     OffsetCommitValue(42, "ba1:xyz", 1_700_000_000_000, version=1,
                       expire_timestamp=1_700_086_400_000)),
    (i16(2) + i64(42) + s16(META) + i64(1_700_000_000_000),
     OffsetCommitValue(42, "ba1:xyz", 1_700_000_000_000, version=2)),
    (i16(3) + i64(42) + i32(5) + s16(META) + i64(1_700_000_000_000),
     OffsetCommitValue(42, "ba1:xyz", 1_700_000_000_000, version=3, leader_epoch=5)),
    (i16(4) + i64(42) + i32(5) + bytes([len(META) + 1]) + META + i64(1_700_000_000_000)
     + b"\x00",
     OffsetCommitValue(42, "ba1:xyz", 1_700_000_000_000, version=4, leader_epoch=5)),
    (i16(4) + i64(42) + i32(-1) + b"\x01" + i64(1) + b"\x02" + b"\x00\x02ab" + b"\x05\x00",
     OffsetCommitValue(42, "", 1, version=4, tagged_fields=((0, b"ab"), (5, b"")))),
]


@pytest.mark.parametrize(("raw", "expected"), VALUE_VECTORS,
                         ids=[f"v{e.version}-{i}" for i, (_, e) in enumerate(VALUE_VECTORS)])
def test_value_vectors_decode_and_reencode(raw: bytes, expected: OffsetCommitValue) -> None:
    assert decode_value(raw) == expected
    assert encode_value(expected) == raw


def test_v4_long_metadata_uses_multibyte_varint_length() -> None:
    meta = b"ba1:" + b"x" * 300
    assert len(meta) + 1 == 0x31 | (0x02 << 7)
    raw = i16(4) + i64(1) + i32(0) + bytes([0xB1, 0x02]) + meta + i64(9) + b"\x00"
    assert decode_value(raw).metadata == meta.decode()


@pytest.mark.parametrize("record_type", [0, 1])
def test_offset_commit_keys(record_type: int) -> None:
    raw = i16(record_type) + s16("grüppe".encode()) + s16(b"t") + i32(0)
    assert decode_key(raw) == OffsetCommitKey("grüppe", "t", 0, record_type)
    assert encode_key(OffsetCommitKey("grüppe", "t", 0, record_type)) == raw


def test_group_metadata_key_is_skipped_with_its_group() -> None:
    assert decode_record(i16(2) + s16(b"grp"), b"\x00\x03garbage") == SkippedRecord(2, "grp")


@pytest.mark.parametrize("record_type", [3, 4, 8, 16, 21, 400])
def test_newer_coordinator_records_are_skipped_unread(record_type: int) -> None:
    assert decode_record(i16(record_type) + b"\xff\xff", b"\x00") == SkippedRecord(record_type)
    assert decode_record(i16(record_type), None) == SkippedRecord(record_type)


def test_tombstone_and_commit() -> None:
    key = OffsetCommitKey("grp", "orders", 7)
    assert decode_record(KEY_V1, None) == OffsetTombstone(key)
    raw, value = VALUE_VECTORS[3]
    assert decode_record(KEY_V1, raw) == OffsetCommit(key, value)


@pytest.mark.parametrize(("key", "value", "message"), [
    (None, b"", "without a key"),
    (b"", None, "needs 2 more bytes"),
    (b"\x00", None, "needs 2 more bytes"),
    (i16(-1), None, "negative record type -1"),
    (i16(1) + i16(-1), None, "null or negative string length -1"),
    (i16(1) + s16(b"g") + s16(b"t") + i32(1) + b"\x00", None, "1 trailing bytes"),
    (i16(1) + s16(b"\xff\xfe") + s16(b"t") + i32(1), None, "not UTF-8"),
    (i16(1) + s16(b"g") + s16(b"t") + b"\x00\x00", None, "needs 4 more bytes"),
    (i16(2) + s16(b"g") + b"x", None, "1 trailing bytes"),
    (KEY_V1, i16(5) + i64(1), "unknown value version 5"),
    (KEY_V1, i16(-1), "unknown value version -1"),
    (KEY_V1, i16(3) + i64(1) + i32(0) + s16(b"m"), "needs 8 more bytes"),
    (KEY_V1, i16(0) + i64(1) + s16(b"m") + i64(1) + b"\x00", "1 trailing bytes"),
    (KEY_V1, i16(4) + i64(1) + i32(0) + b"\x00", "null compact string"),
    (KEY_V1, i16(4) + i64(1) + i32(0) + b"\x80\x00", "overlong varint"),
    (KEY_V1, i16(4) + i64(1) + i32(0) + b"\xff\xff\xff\xff\xff\xff", "longer than 5 bytes"),
    (KEY_V1, i16(4) + i64(1) + i32(0) + b"\xff\xff\xff\xff\x7f", "exceeds 32 bits"),
    (KEY_V1, i16(4) + i64(1) + i32(0) + b"\x01" + i64(1), "truncated varint"),
    (KEY_V1, i16(4) + i64(1) + i32(0) + b"\x01" + i64(1) + b"\x02\x05\x00\x03\x00",
     "tags must be ascending"),
    (KEY_V1, i16(4) + i64(1) + i32(0) + b"\x01" + i64(1) + b"\x01\x00\x05ab",
     "needs 5 more bytes"),
])
def test_malformed_records_raise_the_decoder_error(
    key: bytes | None, value: bytes | None, message: str
) -> None:
    with pytest.raises(OffsetsDecodeError, match=message):
        decode_record(key, value)


def test_error_carries_the_offending_bytes() -> None:
    with pytest.raises(OffsetsDecodeError, match="bytes 00090000"):
        decode_value(b"\x00\x09\x00\x00")


@st.composite
def any_value(draw: st.DrawFn) -> OffsetCommitValue:
    version = draw(st.integers(0, 4))
    tags: tuple[tuple[int, bytes], ...] = ()
    if version == 4:
        tag_ids = sorted(draw(st.sets(st.integers(0, 2**32 - 1), max_size=3)))
        tags = tuple((t, draw(st.binary(max_size=20))) for t in tag_ids)
    return OffsetCommitValue(
        offset=draw(st.integers(-(2**63), 2**63 - 1)),
        metadata=draw(st.text(max_size=300).filter(lambda t: len(t.encode()) < 2**15)),
        commit_timestamp=draw(st.integers(-(2**63), 2**63 - 1)),
        version=version,
        leader_epoch=draw(st.integers(-(2**31), 2**31 - 1)) if version >= 3 else -1,
        expire_timestamp=draw(st.integers(-(2**63), 2**63 - 1)) if version == 1 else -1,
        tagged_fields=tags,
    )


FUZZ = settings(max_examples=2000, derandomize=True, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(any_value())
def test_every_value_round_trips(value: OffsetCommitValue) -> None:
    assert decode_value(encode_value(value)) == value


@FUZZ
@given(st.text(max_size=100), st.text(max_size=100), st.integers(-(2**31), 2**31 - 1),
       st.sampled_from([0, 1]))
def test_every_key_round_trips(group: str, topic: str, partition: int, kind: int) -> None:
    key = OffsetCommitKey(group, topic, partition, kind)
    assert decode_key(encode_key(key)) == key


def _decode_or_error(key: bytes | None, value: bytes | None) -> None:
    """The fuzz property: an error of our type, or a unique parse (re-encodes to input)."""
    try:
        record = decode_record(key, value)
    except OffsetsDecodeError:
        return
    if isinstance(record, OffsetCommit):
        assert encode_key(record.key) == key
        assert encode_value(record.value) == value
    elif isinstance(record, OffsetTombstone):
        assert encode_key(record.key) == key
        assert value is None


@seed(20240601)
@FUZZ
@given(st.one_of(st.none(), st.binary(max_size=64)), st.one_of(st.none(), st.binary(max_size=80)))
def test_garbage_never_crashes_or_misparses(key: bytes | None, value: bytes | None) -> None:
    _decode_or_error(key, value)


@seed(20240602)
@FUZZ
@given(any_value(), st.data())
def test_mutated_values_never_crash_or_misparse(
    value: OffsetCommitValue, data: st.DataObject
) -> None:
    raw = bytearray(encode_value(value))
    action = data.draw(st.sampled_from(["flip", "truncate", "extend"]))
    if action == "flip" and raw:
        index = data.draw(st.integers(0, len(raw) - 1))
        raw[index] ^= data.draw(st.integers(1, 255))
    elif action == "truncate":
        del raw[data.draw(st.integers(0, len(raw))):]
    else:
        raw += data.draw(st.binary(min_size=1, max_size=8))
    _decode_or_error(KEY_V1, bytes(raw))
