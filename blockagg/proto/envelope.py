"""Parsing one Kafka message value as a :class:`blockagg.v1.Envelope`.

:func:`parse_envelope` never raises on bad input: garbage, a missing value, an empty
row list or a malformed table name yield a :class:`Rejected` with the reason, which
the caller turns into a dead letter. The result is a pure function of the bytes, so
a replayed message is classified exactly like the first time.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, overload

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
from google.protobuf.message import DecodeError

from blockagg.proto.blockagg.v1.envelope_pb2 import Envelope
from blockagg.proto.decode import PAD, decode_ranges, gather_rows, padded_buffer
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


@dataclass(frozen=True, eq=False)
class JoinedValues(Sequence[bytes | None]):
    """Many Kafka message values laid end to end in one buffer, as Spark's Arrow
    hand-over delivers a partition's: value ``i`` is ``buf[ends[i-1]:ends[i]]`` (from
    0 for the first), or ``None`` where :attr:`null` (a tombstone, 0 bytes long).
    :attr:`buf` ends with :data:`~proto.decode.PAD` zero bytes, so
    :func:`parse_envelopes` decodes it where it lies; the per-message paths (dead
    letters, a replay without the registry) see a ``Sequence[bytes | None]``, each
    value copied out only when asked for."""

    buf: npt.NDArray[np.uint8]
    ends: npt.NDArray[np.int64]
    null: npt.NDArray[np.bool_]

    @classmethod
    def from_arrow(cls, chunks: Sequence[pa.Array]) -> JoinedValues:
        """The values of binary Arrow arrays ``chunks`` (``binary``, or ``large_binary``
        with Spark's ``spark.sql.execution.arrow.useLargeVarTypes``), in order, copied
        once into one padded buffer (a null's bytes, if its producer left any, are
        dropped)."""
        parts: list[tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]] = []
        nulls: list[npt.NDArray[np.bool_]] = []
        for chunk in chunks:
            if chunk.null_count:
                nulls.append(chunk.is_null().to_numpy(zero_copy_only=False))
                chunk = chunk.fill_null(b"")
            else:
                nulls.append(np.zeros(len(chunk), dtype=np.bool_))
            if not (pa.types.is_binary(chunk.type) or pa.types.is_large_binary(chunk.type)):
                raise TypeError(f"Kafka values must be binary Arrow arrays, not {chunk.type}")
            width = np.int64 if pa.types.is_large_binary(chunk.type) else np.int32
            _, offsets_buf, data_buf = chunk.buffers()
            offsets = np.frombuffer(offsets_buf, dtype=width)[
                chunk.offset:chunk.offset + len(chunk) + 1].astype(np.int64)
            data = (np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None
                    else np.zeros(0, dtype=np.uint8))
            parts.append((data[int(offsets[0]):int(offsets[-1])], offsets - offsets[0]))
        total = sum(data.size for data, _ in parts)
        buf = np.empty(total + PAD, dtype=np.uint8)
        buf[total:] = 0
        ends: list[npt.NDArray[np.int64]] = []
        at = 0
        for data, offsets in parts:
            buf[at:at + data.size] = data
            ends.append(offsets[1:] + at)
            at += data.size
        return cls(buf, np.concatenate(ends) if ends else np.zeros(0, dtype=np.int64),
                   np.concatenate(nulls) if nulls else np.zeros(0, dtype=np.bool_))

    @property
    def lengths(self) -> npt.NDArray[np.int64]:
        """Each value's length in bytes (0 for ``None``)."""
        return np.diff(self.ends, prepend=0)

    def __len__(self) -> int:
        return int(self.ends.size)

    @overload
    def __getitem__(self, i: int) -> bytes | None: ...

    @overload
    def __getitem__(self, i: slice) -> list[bytes | None]: ...

    def __getitem__(self, i: int | slice) -> bytes | list[bytes | None] | None:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        if self.null[i]:
            return None
        start = int(self.ends[i - 1]) if i else 0
        return self.buf[start:int(self.ends[i])].tobytes()

    def __iter__(self) -> Iterator[bytes | None]:
        return (self[i] for i in range(len(self)))


@dataclass(frozen=True, eq=False)
class Envelopes:
    """The envelopes of many messages (a partition's, in offset order), parsed at
    once: what :func:`parse_envelope` gives for each, without a Python object per
    message or row.

    Message ``i`` is :attr:`rejected` ``[i]`` (the very :class:`Rejected` of
    :func:`parse_envelope`), or table :attr:`tables` ``[table_index[i]]`` with
    ``schema_version`` :attr:`versions` ``[i]`` and rows ``row_lo[i]`` to
    ``row_hi[i]`` (exclusive), row ``j`` being ``buf[row_starts[j]:row_ends[j]]``
    (``buf`` is padded for :func:`proto.decode.decode_ranges`). :attr:`sizes` are
    the messages' lengths in bytes (0 for a message without a value)."""

    tables: tuple[str, ...]
    table_index: npt.NDArray[np.int64]
    versions: npt.NDArray[np.int64]
    row_lo: npt.NDArray[np.int64]
    row_hi: npt.NDArray[np.int64]
    row_starts: npt.NDArray[np.int64]
    row_ends: npt.NDArray[np.int64]
    buf: npt.NDArray[np.uint8]
    rejected: dict[int, Rejected]
    sizes: npt.NDArray[np.int64]

    def __len__(self) -> int:
        return len(self.table_index)

    def rows(self, i: int) -> list[bytes]:
        """Message ``i``'s encoded rows (empty for a rejected message)."""
        return [self.buf[int(a):int(b)].tobytes() for a, b in
                zip(self.row_starts[self.row_lo[i]:self.row_hi[i]],
                    self.row_ends[self.row_lo[i]:self.row_hi[i]], strict=True)]

    def rows_of(self, messages: npt.NDArray[np.int64]) -> tuple[
            npt.NDArray[np.uint8], npt.NDArray[np.int64], npt.NDArray[np.int64],
            npt.NDArray[np.int64]]:
        """The rows of ``messages`` (accepted ones, in this order) laid out as
        :func:`proto.decode.decode_rows` lays out that list of rows, for
        :func:`proto.decode.decode_ranges`: (buffer, row starts, row ends, rows per
        message), copied next to each other."""
        lo, hi = self.row_lo[messages], self.row_hi[messages]
        counts = hi - lo
        rows = (np.repeat(lo - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
                + np.arange(int(counts.sum()), dtype=np.int64))
        buf, starts, ends = gather_rows(self.buf, self.row_starts[rows], self.row_ends[rows])
        return buf, starts, ends, counts

    def rows_in_spans(self, messages: npt.NDArray[np.int64]) -> tuple[
            npt.NDArray[np.uint8], npt.NDArray[np.int64], npt.NDArray[np.int64],
            npt.NDArray[np.int64]]:
        """The rows of ``messages`` (accepted ones, in this order) as
        :meth:`rows_of` gives them, but each message's span of :attr:`buf` copied
        whole (its rows with the envelope's tag and length bytes between them), for
        :func:`proto.decode.decode_in_place`: one slice per message instead of a
        gather per row."""
        lo, hi = self.row_lo[messages], self.row_hi[messages]
        counts = hi - lo
        rows = (np.repeat(lo - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
                + np.arange(int(counts.sum()), dtype=np.int64))
        first = self.row_starts[lo]
        last = np.where(counts > 0, self.row_ends[np.maximum(hi - 1, 0)], first)
        span = last - first
        buf = self.buf
        joined = np.concatenate([buf[a:b] for a, b in zip(first.tolist(), last.tolist(),
                                                          strict=True)]
                                + [np.zeros(PAD, dtype=np.uint8)])
        shift = np.repeat(first - (np.cumsum(span) - span), counts)
        return joined, self.row_starts[rows] - shift, self.row_ends[rows] - shift, counts

    def parsed(self, i: int) -> Parsed | Rejected:
        """:func:`parse_envelope` of message ``i``."""
        if i in self.rejected:
            return self.rejected[i]
        return Parsed(self.tables[int(self.table_index[i])], int(self.versions[i]),
                      self.rows(i))

    def __iter__(self) -> Iterator[Parsed | Rejected]:
        return (self.parsed(i) for i in range(len(self)))


def parse_envelopes(values: Sequence[bytes | None]) -> Envelopes:
    """:func:`parse_envelope` of every value, decoded in lock step across messages
    (:func:`proto.decode.decode_rows` over the ``Envelope`` type, exact to upb).
    A message the lock-step parse flags (does not decode, no value, a bad table
    name, no rows) is parsed again alone by :func:`parse_envelope`, whose
    :class:`Rejected` (the reason a dead letter carries) it then gets: the reasons
    are those of the per-message parser, byte for byte."""

    n = len(values)
    descriptor: Any = Envelope.DESCRIPTOR
    if isinstance(values, JoinedValues):
        lengths, ends, joined = values.lengths, values.ends, values.buf
    else:
        present = [b"" if v is None else v for v in values]
        lengths = np.fromiter(map(len, present), dtype=np.int64, count=n)
        ends = np.cumsum(lengths)
        joined = np.frombuffer(b"".join([*present, bytes(PAD)]), dtype=np.uint8)
    # decode_rows' layout; the rows stay where they are in it (Spans), not copied.
    decoded = decode_ranges(descriptor, joined, ends - lengths, ends,
                            spans=frozenset({"rows"}))
    flagged = np.zeros(n, dtype=np.bool_)
    if decoded.errors:
        flagged[np.fromiter(decoded.errors, dtype=np.int64, count=len(decoded.errors))] = True
    flagged |= lengths == 0  # no value, or an empty one: neither has a table or rows
    encoded = pc.dictionary_encode(decoded.columns["table"])
    names = encoded.dictionary.to_pylist()
    table_index = encoded.indices.fill_null(len(names)).to_numpy(
        zero_copy_only=False).astype(np.int64)
    good_name = np.array([is_table_name(t) for t in names] + [False], dtype=np.bool_)
    flagged |= ~good_name[table_index]
    spans = decoded.spans.get("rows")
    if spans is not None:
        bounds, row_starts, row_ends, buf = spans.bounds, spans.starts, spans.ends, joined
    else:  # a row went to upb: the rows as a column, copied
        lists = decoded.columns["rows"]
        bounds = lists.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
        children = lists.values
        _, offsets_buf, data_buf = children.buffers()
        child_offsets = np.frombuffer(offsets_buf, dtype=np.int32)[
            children.offset:children.offset + len(children) + 1].astype(np.int64)
        row_starts, row_ends = child_offsets[:-1], child_offsets[1:]
        buf = padded_buffer(np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None
                            else np.zeros(0, dtype=np.uint8))
    flagged |= bounds[1:] == bounds[:-1]
    rejected: dict[int, Rejected] = {}
    for i in np.flatnonzero(flagged).tolist():
        again = parse_envelope(values[i])
        if not isinstance(again, Rejected):
            raise EnvelopeDecodeError(
                f"message {i} of the batch: the lock-step envelope parser and upb disagree "
                "on it (a bug in blockagg.proto.decode; report it with the message)")
        rejected[i] = again
    row_lo, row_hi = bounds[:-1].copy(), bounds[1:].copy()
    row_hi[flagged] = row_lo[flagged]
    table_index[flagged] = -1
    versions = decoded.columns["schema_version"].to_numpy(zero_copy_only=False)
    return Envelopes(tuple(names), table_index,
                     np.where(flagged, 0, versions).astype(np.int64), row_lo, row_hi,
                     row_starts, row_ends, buf, rejected, lengths)


def make_envelope(table: str, rows: list[bytes], version: int = LATEST) -> bytes:
    """Serialize an envelope; the producer-side counterpart of :func:`parse_envelope`."""
    return Envelope(table=table, schema_version=version, rows=rows).SerializeToString()
