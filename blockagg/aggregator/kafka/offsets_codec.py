"""A strict decoder (and, for tests, encoder) of Kafka's ``__consumer_offsets`` records.

Layout, from Kafka's ``group-coordinator`` message schemas (all integers big-endian):

* Key: ``int16`` record type, then the key's fields. Types 0 and 1 (``LegacyOffsetCommitKey``,
  ``OffsetCommitKey``) are offset commits: ``group`` string, ``topic`` string, ``partition``
  int32. Type 2 is ``GroupMetadataKey`` (``group`` string). Types 3 and above are the newer
  coordinator records (consumer, share and streams groups of Kafka 3.7+/4.x); they are
  skipped without looking at their body, so new Kafka releases don't break the verifier.
* Offset-commit value: ``int16`` version, then

  ====  ==================================================================================
  v0    offset int64, metadata string, commitTimestamp int64
  v1    offset int64, metadata string, commitTimestamp int64, expireTimestamp int64
  v2    offset int64, metadata string, commitTimestamp int64
  v3    offset int64, leaderEpoch int32, metadata string, commitTimestamp int64
  v4    as v3 with a compact string (unsigned-varint length + 1) for metadata and a
        trailing tagged-field section (flexible version, KIP-482)
  ====  ==================================================================================

  Kafka 4.x (observed on 4.x brokers) writes version 4 with one tagged field, tag 0, of
  16 bytes: the committed topic's id (:attr:`OffsetCommitValue.topic_id`).

  A ``string`` is an int16 length then UTF-8 bytes; -1 (null) is refused because the
  schemas declare these strings non-nullable. A missing value (``None``) is a tombstone:
  the group's offset for that partition was deleted or expired.

Guarantees: :func:`decode_record` either returns a record whose re-encoding
(:func:`encode_key`, :func:`encode_value`) is byte-for-byte the input, or raises
:class:`~.exceptions.OffsetsDecodeError` naming the offending bytes; no other
exception escapes on any input. Overlong varints, trailing bytes, invalid UTF-8, unknown
value versions and unsorted or duplicate tags are refused: Kafka never writes them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Final

from blockagg.aggregator.kafka.exceptions import OffsetsDecodeError

LEGACY_OFFSET_COMMIT: Final = 0
OFFSET_COMMIT: Final = 1
GROUP_METADATA: Final = 2
MAX_VALUE_VERSION: Final = 4
TOPIC_ID_TAG: Final = 0

_I16: Final = struct.Struct(">h")
_I32: Final = struct.Struct(">i")
_I64: Final = struct.Struct(">q")
_KEY_HEAD: Final = struct.Struct(">hh")


@dataclass(frozen=True, slots=True)
class OffsetCommitKey:
    """Which group committed which topic-partition. ``record_type`` is 0 or 1."""

    group: str
    topic: str
    partition: int
    record_type: int = OFFSET_COMMIT


@dataclass(frozen=True, slots=True)
class OffsetCommitValue:
    """The committed position, as stored by the group coordinator.

    ``leader_epoch`` is -1 where the version has no such field or the client sent none;
    ``expire_timestamp`` is -1 except in version 1. Timestamps are milliseconds since
    the epoch, set by the coordinator's clock (``commit_timestamp``) or the client.
    ``tagged_fields`` keeps version 4's tagged fields as ``(tag, raw bytes)``, ascending.
    """

    offset: int
    metadata: str
    commit_timestamp: int
    version: int = 3
    leader_epoch: int = -1
    expire_timestamp: int = -1
    tagged_fields: tuple[tuple[int, bytes], ...] = field(default=())

    @property
    def topic_id(self) -> bytes | None:
        """Tag 0 of version 4 when it is 16 bytes: the topic's id, which Kafka 4.x writes."""
        for tag, raw in self.tagged_fields:
            if tag == TOPIC_ID_TAG and len(raw) == 16:
                return raw
        return None


@dataclass(frozen=True, slots=True)
class OffsetCommit:
    """An offset commit record: ``key`` committed ``value``."""

    key: OffsetCommitKey
    value: OffsetCommitValue


@dataclass(frozen=True, slots=True)
class OffsetTombstone:
    """The group's committed offset for ``key``'s partition was deleted."""

    key: OffsetCommitKey


@dataclass(frozen=True, slots=True)
class SkippedRecord:
    """A record that is not an offset commit (group metadata, newer coordinator records).

    ``group`` is set for group-metadata records (type 2) and ``None`` otherwise.
    """

    record_type: int
    group: str | None = None


Record = OffsetCommit | OffsetTombstone | SkippedRecord


def _shown(data: bytes) -> str:
    return data[:48].hex() + ("..." if len(data) > 48 else "")


class _Reader:
    __slots__ = ("data", "pos", "what")

    def __init__(self, data: bytes, what: str) -> None:
        self.data = data
        self.pos = 0
        self.what = what

    def fail(self, reason: str) -> OffsetsDecodeError:
        return OffsetsDecodeError(
            f"malformed {self.what} at byte {self.pos} of {len(self.data)}: {reason} "
            f"(bytes {_shown(self.data)})"
        )

    def _take(self, size: int) -> int:
        start = self.pos
        if size > len(self.data) - start:
            raise self.fail(f"needs {size} more bytes, only {len(self.data) - start} left")
        self.pos = start + size
        return start

    def int16(self) -> int:
        value: int = _I16.unpack_from(self.data, self._take(2))[0]
        return value

    def int32(self) -> int:
        value: int = _I32.unpack_from(self.data, self._take(4))[0]
        return value

    def int64(self) -> int:
        value: int = _I64.unpack_from(self.data, self._take(8))[0]
        return value

    def uvarint(self) -> int:
        result = 0
        for shift in range(0, 35, 7):
            if self.pos >= len(self.data):
                raise self.fail("truncated varint")
            byte = self.data[self.pos]
            self.pos += 1
            result |= (byte & 0x7F) << shift
            if not byte & 0x80:
                if byte == 0 and shift:
                    raise self.fail("overlong varint")
                if result > 0xFFFFFFFF:
                    raise self.fail(f"varint {result} exceeds 32 bits")
                return result
        raise self.fail("varint longer than 5 bytes")

    def _utf8(self, size: int) -> str:
        start = self._take(size)
        try:
            return self.data[start:self.pos].decode("utf-8")
        except UnicodeDecodeError as exc:
            self.pos = start
            raise self.fail(f"string is not UTF-8 ({exc.reason})") from None

    def string(self) -> str:
        size = self.int16()
        if size < 0:
            raise self.fail(f"null or negative string length {size} in a non-nullable field")
        return self._utf8(size)

    def compact_string(self) -> str:
        size = self.uvarint()
        if size == 0:
            raise self.fail("null compact string in a non-nullable field")
        return self._utf8(size - 1)

    def tagged_fields(self) -> tuple[tuple[int, bytes], ...]:
        count = self.uvarint()
        if count > (len(self.data) - self.pos) // 2:
            raise self.fail(f"{count} tagged fields can't fit in the "
                            f"{len(self.data) - self.pos} bytes left (2 bytes each at least)")
        tags: list[tuple[int, bytes]] = []
        previous = -1
        for _ in range(count):
            tag = self.uvarint()
            if tag <= previous:
                raise self.fail(f"tag {tag} after tag {previous}: tags must be ascending")
            size = self.uvarint()
            start = self._take(size)
            tags.append((tag, bytes(self.data[start:self.pos])))
            previous = tag
        return tuple(tags)

    def end(self) -> None:
        if self.pos != len(self.data):
            raise self.fail(f"{len(self.data) - self.pos} trailing bytes")


def decode_key(data: bytes) -> OffsetCommitKey | SkippedRecord:
    """Decode a record key: an :class:`OffsetCommitKey`, or a :class:`SkippedRecord`."""
    reader = _Reader(data, "__consumer_offsets key")
    record_type = reader.int16()
    if record_type < 0:
        raise reader.fail(f"negative record type {record_type}")
    if record_type in (LEGACY_OFFSET_COMMIT, OFFSET_COMMIT):
        group = reader.string()
        topic = reader.string()
        partition = reader.int32()
        reader.end()
        return OffsetCommitKey(group, topic, partition, record_type)
    if record_type == GROUP_METADATA:
        group = reader.string()
        reader.end()
        return SkippedRecord(record_type, group)
    return SkippedRecord(record_type)


def decode_value(data: bytes) -> OffsetCommitValue:
    """Decode an offset-commit value of versions 0 to 4."""
    reader = _Reader(data, "offset commit value")
    version = reader.int16()
    if not 0 <= version <= MAX_VALUE_VERSION:
        raise reader.fail(f"unknown value version {version}, expected 0..{MAX_VALUE_VERSION}")
    offset = reader.int64()
    leader_epoch = reader.int32() if version >= 3 else -1
    metadata = reader.compact_string() if version >= 4 else reader.string()
    commit_timestamp = reader.int64()
    expire_timestamp = reader.int64() if version == 1 else -1
    tagged = reader.tagged_fields() if version >= 4 else ()
    reader.end()
    return OffsetCommitValue(
        offset, metadata, commit_timestamp, version, leader_epoch, expire_timestamp, tagged
    )


def decode_record(key: bytes | None, value: bytes | None) -> Record:
    """Decode one ``__consumer_offsets`` record from its key and value bytes.

    Values of skipped record types are not inspected.
    """
    if key is None:
        raise OffsetsDecodeError("__consumer_offsets record without a key")
    decoded = decode_key(key)
    if isinstance(decoded, SkippedRecord):
        return decoded
    if value is None:
        return OffsetTombstone(decoded)
    return OffsetCommit(decoded, decode_value(value))


def _put_string(out: bytearray, text: str) -> None:
    raw = text.encode("utf-8")
    if len(raw) > 0x7FFF:
        raise OffsetsDecodeError(f"string of {len(raw)} bytes does not fit an int16 length")
    out += _I16.pack(len(raw))
    out += raw


def _put_uvarint(out: bytearray, value: int) -> None:
    if not 0 <= value <= 0xFFFFFFFF:
        raise OffsetsDecodeError(f"varint {value} outside 0..2**32-1")
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def encode_key(key: OffsetCommitKey) -> bytes:
    """Encode an offset-commit key as the coordinator writes it (inverse of decode_key)."""
    out = bytearray(_I16.pack(key.record_type))
    _put_string(out, key.group)
    _put_string(out, key.topic)
    out += _I32.pack(key.partition)
    return bytes(out)


def encode_value(value: OffsetCommitValue) -> bytes:
    """Encode an offset-commit value in ``value.version`` (inverse of decode_value)."""
    version = value.version
    if not 0 <= version <= MAX_VALUE_VERSION:
        raise OffsetsDecodeError(f"unknown value version {version}")
    out = bytearray(_I16.pack(version))
    out += _I64.pack(value.offset)
    if version >= 3:
        out += _I32.pack(value.leader_epoch)
    if version >= 4:
        raw = value.metadata.encode("utf-8")
        _put_uvarint(out, len(raw) + 1)
        out += raw
    else:
        _put_string(out, value.metadata)
    out += _I64.pack(value.commit_timestamp)
    if version == 1:
        out += _I64.pack(value.expire_timestamp)
    if version >= 4:
        _put_uvarint(out, len(value.tagged_fields))
        for tag, raw_field in value.tagged_fields:
            _put_uvarint(out, tag)
            _put_uvarint(out, len(raw_field))
            out += raw_field
    return bytes(out)
