"""Parsing one Kafka message value as a :class:`blockagg.v1.Envelope`.

:func:`parse_envelope` never raises on bad input: garbage, a missing value, an empty
row list or a malformed table name yield a :class:`Rejected` with the reason, which
the caller turns into a dead letter. The result is a pure function of the bytes, so
a replayed message is classified exactly like the first time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from google.protobuf.message import DecodeError

from blockagg.proto.blockagg.v1.envelope_pb2 import Envelope
from blockagg.proto.exceptions import EnvelopeDecodeError

LATEST: Final = 0
"""``schema_version`` meaning "the latest registered version"."""

_TABLE_RE: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True, slots=True)
class Parsed:
    """A well-formed envelope: ``rows`` are the encoded rows, in producer order."""

    table: str
    version: int
    rows: list[bytes]


@dataclass(frozen=True, slots=True)
class Rejected:
    """A message that is not a usable envelope; ``table`` is set when readable."""

    reason: str
    table: str = ""


def is_table_name(name: str) -> bool:
    """True for ``database.table`` with identifier-like parts (ClickHouse's unquoted
    identifiers: letters, digits, underscore, not starting with a digit)."""
    return _TABLE_RE.match(name) is not None


def decode_envelope(value: bytes | bytearray | memoryview | None) -> Parsed:
    """Decode one Kafka message value; raises :class:`EnvelopeDecodeError` (its
    ``table`` attribute set when readable) and nothing else.

    The bytes come from any producer, so nothing in them is trusted before it is
    checked: upb refuses a length-delimited field (table, row) longer than the bytes
    left before allocating it, so a row count is bounded by the value's size (a row
    takes at least 2 bytes); the fuzz tests hold it under a memory limit."""
    if value is None:
        raise EnvelopeDecodeError("message has no value (null or tombstone)")
    try:
        envelope = Envelope.FromString(bytes(value))
    except (DecodeError, ValueError, TypeError, RuntimeError) as exc:
        raise EnvelopeDecodeError(
            f"envelope does not decode as blockagg.v1.Envelope: {exc}") from None
    table = envelope.table
    if not is_table_name(table):
        error = EnvelopeDecodeError(
            f"envelope table {table!r:.120} is not 'database.table' "
            "(identifiers of letters, digits and '_')")
        error.table = table[:200]
        raise error
    if not envelope.rows:
        error = EnvelopeDecodeError("envelope carries no rows")
        error.table = table
        raise error
    return Parsed(table, int(envelope.schema_version), list(envelope.rows))


def parse_envelope(value: bytes | bytearray | memoryview | None) -> Parsed | Rejected:
    """Parse one Kafka message value; never raises: a value that does not decode is
    :class:`Rejected` with the reason (a dead letter)."""
    try:
        return decode_envelope(value)
    except EnvelopeDecodeError as exc:
        return Rejected(str(exc), table=exc.table)


def make_envelope(table: str, rows: list[bytes], version: int = LATEST) -> bytes:
    """Serialize an envelope; the producer-side counterpart of :func:`parse_envelope`."""
    return Envelope(table=table, schema_version=version, rows=rows).SerializeToString()
