"""Decoding the encoded rows of one table into Arrow columns, without a Python object
per row.

:func:`decode_rows` is a pure, deterministic function of (message descriptor, rows).
It parses the protobuf wire format in *lock step across rows*: the rows are joined
into one buffer, and each step reads the next field of every row at once with numpy
(tag, then the value by wire type), so the Python interpreter runs per field
occurrence *step*, not per row. Strings, bytes, packed repeated fields and nested
messages are gathered with vectorised index arithmetic; nested messages are decoded
by the same routine over their byte ranges.

Semantics are upb's (``google.protobuf`` with the upb backend), for every input: a
row is either decoded to exactly what upb decodes, or reported in
:attr:`Decoded.errors` exactly when upb raises ``DecodeError`` (truncated; varints
over 10 bytes; tags over 5 bytes or 2**32; length prefixes over 5 bytes, whatever
their value; field number 0; lengths past the row; stray end-group tags; wire types
6 and 7; invalid UTF-8 in a ``string`` field that validates it; a nested message
that does not decode). Unknown fields and fields whose wire type doesn't
match their declaration are skipped; for a singular field the last occurrence wins;
repeated scalars accept packed and unpacked encodings, mixed; a map keeps the last
entry for each key. Rows the lock-step parse doesn't reproduce cheaply are rare
and are detected and handed to upb one by one (``FromString``, then converted into
the same layout): groups (also in unknown fields), a singular message, a validated
string or a oneof occurring more than once (merges, overwritten values that must
still be valid), unknown values of closed (proto2) enums, map entries with an
unknown field (upb keeps those out of the map) and field numbers in extension
ranges. One exception, reported rather than silently changed: a ``string`` field
without UTF-8 validation (proto2) holding invalid UTF-8, which upb accepts (as
bytes) and a string column cannot hold. Errors
have a reason and never raise; the values of such rows in the columns are
unspecified and must be dropped by the caller.

Column types: ``int32``/``sint32``/``sfixed32``/enum -> int32 (enum numbers),
``int64``/``sint64``/``sfixed64`` -> int64, ``uint32``/``fixed32`` -> uint32,
``uint64``/``fixed64`` -> uint64, ``bool`` -> bool, ``float`` -> float32, ``double``
-> float64, ``string`` -> string, ``bytes`` -> binary, message -> struct (null where
absent), repeated -> list, map -> list of ``struct<key, value>``, one entry per key,
sorted by key (upb's map order is unspecified; convert with
:mod:`blockagg.rows.types`). Fields with presence (``optional``, messages,
oneof members) are null when absent; the others hold the proto3 default, and a map's
key and value are never null (an absent message value is the empty message).
Recursive message types are not supported (their Arrow type would be infinite).

The scan itself is compiled where ``blockagg.proto._wirescan`` was built (``_wirescan.c``:
one pass per row, recording the same occurrences); it reads only rows on which the lock step
sets no error code, and a batch holding any other row is scanned by numpy, so both paths give
the same columns and errors (``docs/architecture.md``, *The compiled parts*).

Above 500 lines because the lock-step wire decoder's paths (scalars, strings, packed,
nested) share one buffer layout and its varint kernels.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

from blockagg.proto.descriptors import is_repeated, message_class


def _compiled_scan() -> ModuleType | None:
    """``blockagg.proto._wirescan`` (``_wirescan.c``, built by ``pip install``), or None
    where it was not built (no C compiler) or cannot load (imported from a zip, as
    ``--py-files`` ships the package): the numpy scan then records the same occurrences."""
    try:
        return importlib.import_module("blockagg.proto._wirescan")
    except ImportError as exc:
        logging.getLogger(__name__).info(
            "rows decode with numpy alone (the same columns, more CPU a row): the compiled "
            "wire scan blockagg.proto._wirescan does not load here (%s); install the package "
            "with a C compiler present rather than ship it as a zip", exc)
        return None


_wirescan = _compiled_scan()

U8 = npt.NDArray[np.uint8]
U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]

_PAD: Final = 32
_WT_VARINT, _WT_I64, _WT_LEN, _WT_SGROUP, _WT_EGROUP, _WT_I32 = 0, 1, 2, 3, 4, 5

_T = FieldDescriptor
_VARINT_TYPES: Final = {
    _T.TYPE_INT32, _T.TYPE_INT64, _T.TYPE_UINT32, _T.TYPE_UINT64,
    _T.TYPE_SINT32, _T.TYPE_SINT64, _T.TYPE_BOOL, _T.TYPE_ENUM,
}
_I64_TYPES: Final = {_T.TYPE_DOUBLE, _T.TYPE_FIXED64, _T.TYPE_SFIXED64}
_I32_TYPES: Final = {_T.TYPE_FLOAT, _T.TYPE_FIXED32, _T.TYPE_SFIXED32}
_LEN_TYPES: Final = {_T.TYPE_STRING, _T.TYPE_BYTES, _T.TYPE_MESSAGE, _T.TYPE_GROUP}
_MESSAGE_TYPES: Final = {_T.TYPE_MESSAGE, _T.TYPE_GROUP}

_E_TRUNCATED: Final = 1
_E_VARINT: Final = 2
_E_GROUP: Final = 3
_E_UTF8: Final = 4
_E_NESTED: Final = 5
_E_TAG: Final = 6
_E_UTF8_UNCHECKED: Final = 7
_E_PACKED: Final = 8
_E_LENGTH: Final = 9
# Codes >= _F_GROUP are not errors: the row is one the lock-step parse doesn't
# reproduce cheaply, and decode_rows hands it to upb (see _fallback).
_F_GROUP: Final = 20
_F_OTHER: Final = 21
_F_UTF8: Final = 22
_REASONS: Final = {
    _E_TRUNCATED: "row is truncated: a field runs past the end of the row",
    _E_VARINT: "row has a varint longer than 10 bytes",
    _E_GROUP: "row has an end-group tag without its start group, or an invalid wire type "
              "(6 or 7)",
    _E_UTF8: "string field holds invalid UTF-8",
    _E_NESTED: "a nested message does not decode",
    _E_TAG: "row has an invalid tag (field number 0, longer than 5 bytes or above 2**32)",
    _E_UTF8_UNCHECKED: "string field holds invalid UTF-8: its schema does not ask for UTF-8 "
                       "validation, so upb accepts the row, but a string column cannot hold it",
    _E_PACKED: "packed fixed-width field's length is not a multiple of its width",
    _E_LENGTH: "row has a length prefix longer than 5 bytes",
    _F_GROUP: "row has a malformed group (upb rejects it)",
    _F_OTHER: "row does not decode (upb rejects it)",
    _F_UTF8: "row does not decode (upb rejects it)",
}


@dataclass(frozen=True)
class Decoded:
    """The columns of ``n`` decoded rows, keyed by field name, and the rows that
    failed: ``errors[i]`` is the reason row ``i`` does not decode."""

    n: int
    columns: dict[str, pa.Array]
    errors: dict[int, str] = field(default_factory=dict)
    spans: dict[str, Spans] = field(default_factory=dict)
    """Fields asked for as :class:`Spans` (``decode_ranges(..., spans=...)``), in place
    of their column."""

    def table(self) -> pa.Table:
        return pa.table(self.columns) if self.columns else pa.table({})


@dataclass(frozen=True, eq=False)
class Spans:
    """A repeated ``bytes`` field's values where they lie in the decoded buffer,
    without copying them: row ``i``'s values are ``buf[starts[j]:ends[j]]`` for ``j``
    in ``bounds[i]:bounds[i + 1]``, in the order the list column holds them."""

    starts: I64
    ends: I64
    bounds: I64


def arrow_type(fd: FieldDescriptor) -> pa.DataType:
    """The Arrow type :func:`decode_rows` produces for field ``fd``."""
    scalar = _scalar_arrow_type(fd)
    if is_repeated(fd):
        return pa.list_(scalar)
    return scalar


def _message_type(fd: FieldDescriptor) -> Descriptor:
    message_type = fd.message_type
    assert message_type is not None, fd.full_name
    return message_type


def _is_map(fd: FieldDescriptor) -> bool:
    message_type = fd.message_type
    return message_type is not None and bool(message_type.GetOptions().map_entry)


def _has_presence(fd: FieldDescriptor) -> bool:
    """Whether ``fd`` is null when absent. The key and value of a map entry never
    are: upb gives their default (an empty message for a message value)."""
    if not fd.has_presence:
        return False
    parent = fd.containing_type
    return parent is None or not parent.GetOptions().map_entry


def _validates_utf8(fd: FieldDescriptor) -> bool:
    """Whether upb rejects invalid UTF-8 in string field ``fd`` (proto3 and editions
    by default; not proto2)."""
    features = getattr(fd, "_GetFeatures", None)
    if features is None:
        return True
    return bool(features().utf8_validation != _UTF8_NONE)


_UTF8_NONE: Final = 3  # FeatureSet.Utf8Validation.NONE


def _closed_enum_values(fd: FieldDescriptor) -> npt.NDArray[np.int32] | None:
    """The numbers of ``fd``'s enum if it is closed (proto2): upb keeps other values
    out of the field (as unknown fields)."""
    enum_type = fd.enum_type
    if enum_type is None or not getattr(enum_type, "is_closed", False):
        return None
    return np.asarray(sorted(v.number for v in enum_type.values), dtype=np.int32)


def _scalar_arrow_type(fd: FieldDescriptor) -> pa.DataType:
    t = fd.type
    if t in _MESSAGE_TYPES:
        return pa.struct([pa.field(f.name, arrow_type(f)) for f in _message_type(fd).fields])
    return _SCALAR_ARROW[t]


_SCALAR_ARROW: Final[dict[int, pa.DataType]] = {
    _T.TYPE_INT32: pa.int32(), _T.TYPE_SINT32: pa.int32(), _T.TYPE_SFIXED32: pa.int32(),
    _T.TYPE_ENUM: pa.int32(), _T.TYPE_INT64: pa.int64(), _T.TYPE_SINT64: pa.int64(),
    _T.TYPE_SFIXED64: pa.int64(), _T.TYPE_UINT32: pa.uint32(), _T.TYPE_FIXED32: pa.uint32(),
    _T.TYPE_UINT64: pa.uint64(), _T.TYPE_FIXED64: pa.uint64(), _T.TYPE_BOOL: pa.bool_(),
    _T.TYPE_FLOAT: pa.float32(), _T.TYPE_DOUBLE: pa.float64(), _T.TYPE_STRING: pa.string(),
    _T.TYPE_BYTES: pa.binary(),
}


def decode_rows(descriptor: Descriptor, rows: Sequence[bytes]) -> Decoded:
    """Decode ``rows`` (each a serialized ``descriptor`` message) into columns."""
    n = len(rows)
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=n)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    return decode_ranges(descriptor, padded_buffer(b"".join(rows)), starts, ends)


PAD: Final = _PAD
"""Zero bytes :func:`decode_ranges` needs after the last row of its buffer."""


def padded_buffer(data: bytes | U8) -> U8:
    """``data`` as a buffer for :func:`decode_ranges` (followed by :data:`PAD` zeros)."""
    raw = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data
    out = np.zeros(raw.size + _PAD, dtype=np.uint8)
    out[:raw.size] = raw
    return out


class _Rows:
    """Row ``i`` of a buffer as ``bytes`` (for the upb fallback)."""

    def __init__(self, buf: U8, starts: I64, ends: I64) -> None:
        self.buf, self.starts, self.ends = buf, starts, ends

    def __getitem__(self, i: int) -> bytes:
        return self.buf[int(self.starts[i]):int(self.ends[i])].tobytes()


def gather_rows(buf: U8, starts: I64, ends: I64) -> tuple[U8, I64, I64]:
    """The rows ``buf[starts[i]:ends[i]]`` copied next to each other, in order, into
    a :func:`padded_buffer`, with their new bounds: the layout :func:`decode_ranges`
    takes."""
    data, offsets = _gather_ranges(buf, starts, ends - starts)
    return padded_buffer(data), offsets[:-1], offsets[1:]


def decode_ranges(descriptor: Descriptor, buf: U8, starts: I64, ends: I64,
                  spans: frozenset[str] = frozenset()) -> Decoded:
    """:func:`decode_rows` of the rows at ``buf[starts[i]:ends[i]]``, laid out as
    :func:`decode_rows` lays them out (:func:`gather_rows`): adjacent, in order,
    followed by :data:`PAD` zero bytes. The reason a damaged row gets can depend on
    the bytes after it (the next row), which is why the layout is the same: the same
    columns and errors as :func:`decode_rows` of those rows' bytes.

    ``spans`` names repeated ``bytes`` fields to return as :class:`Spans` (where
    their values lie in ``buf``) instead of a copied column: the envelope's rows.
    When a row had to go to upb (``_fallback``), whose values lie nowhere in ``buf``,
    every field is a column as without ``spans`` (``Decoded.spans`` is empty)."""
    n = int(starts.size)
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    if n and (np.any(starts[1:] != ends[:-1]) or int(ends[-1]) + _PAD > buf.size
              or buf[int(ends[-1]):int(ends[-1]) + _PAD].any()):
        raise ValueError("decode_ranges needs adjacent rows followed by PAD zero bytes "
                         "(gather_rows)")
    for name in spans:
        fd = descriptor.fields_by_name[name]
        if not is_repeated(fd) or fd.type != _T.TYPE_BYTES:
            raise ValueError(f"spans are for repeated bytes fields, not {fd.full_name}")
    err = np.zeros(n, dtype=np.int8)
    found: dict[str, Spans] = {}
    columns = _decode_message(descriptor, buf, starts, ends, err, spans, found)
    odd = np.flatnonzero(err >= _F_GROUP)
    if odd.size:
        if spans:
            return decode_ranges(descriptor, buf, starts, ends)
        columns = _fallback(descriptor, _Rows(buf, starts, ends), odd, columns, err)
    errors = {int(i): _REASONS[int(err[i])] for i in np.flatnonzero(err)}
    return Decoded(n, columns, errors, found)


def decode_in_place(descriptor: Descriptor, buf: U8, starts: I64, ends: I64) -> Decoded | None:
    """:func:`decode_ranges` of the rows at ``buf[starts[i]:ends[i]]`` where they lie
    (anywhere in ``buf``, which ends with :data:`PAD` zero bytes), without copying
    them next to each other, when every row decodes; ``None`` when one does not.

    A row that decodes is read within its bytes only, so its values, and its having
    no error, do not depend on what lies around it; only a damaged row's *reason*
    can (a varint or tag running past its end reads the next bytes). So ``None``
    sends the caller to :func:`decode_ranges` over :func:`gather_rows`, the layout
    whose reasons are the per-message path's."""
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    if starts.size and (int(ends.max()) + _PAD > buf.size or buf[buf.size - _PAD:].any()
                        or bool((ends < starts).any())):
        raise ValueError("decode_in_place needs rows inside a buffer that ends with PAD "
                         "zero bytes (padded_buffer)")
    err = np.zeros(starts.size, dtype=np.int8)
    columns = _decode_message(descriptor, buf, starts, ends, err)
    odd = np.flatnonzero(err >= _F_GROUP)
    if odd.size:
        columns = _fallback(descriptor, _Rows(buf, starts, ends), odd, columns, err)
    if err.any():
        return None
    return Decoded(int(starts.size), columns)


def _fallback(descriptor: Descriptor, rows: Sequence[bytes] | _Rows, odd: I64,
              columns: dict[str, pa.Array], err: npt.NDArray[np.int8]) -> dict[str, pa.Array]:
    """Decode rows ``odd`` with upb (``FromString``, then field by field into the
    layout of :func:`arrow_type`) and splice them into ``columns``. Rows upb rejects
    keep their fallback code as the error; the others are cleared."""
    cls = message_class(descriptor)
    values: dict[str, list[Any]] = {fd.name: [] for fd in descriptor.fields}
    for i in odd.tolist():
        try:
            msg = cls.FromString(rows[i])
            converted = {fd.name: _py_field(fd, msg) for fd in descriptor.fields}
        except DecodeError:
            converted = None
        except _Unrepresentable:
            err[i] = _E_UTF8_UNCHECKED
            converted = None
        if converted is None:
            # A row upb rejects gets the values of an empty row: a column holds no
            # null its field can't have, so converting the batch's columns does not
            # trip over the row that is a dead letter anyway.
            for fd in descriptor.fields:
                values[fd.name].append(_empty_value(fd))
            continue
        err[i] = 0
        for name, value in converted.items():
            values[name].append(value)
    n = err.size
    index = np.arange(n, dtype=np.int64)
    index[odd] = n + np.arange(odd.size, dtype=np.int64)
    take = pa.array(index, type=pa.int64())
    out = {}
    for fd in descriptor.fields:
        extra = pa.array(values[fd.name], type=arrow_type(fd))
        out[fd.name] = pa.concat_arrays([columns[fd.name], extra]).take(take)
    return out


def _empty_value(fd: FieldDescriptor) -> Any:
    """Field ``fd`` of an empty message, as :func:`arrow_type` lays it out."""
    if is_repeated(fd):
        return []
    if _has_presence(fd) or fd.type in _MESSAGE_TYPES:
        return None
    return fd.default_value


class _Unrepresentable(Exception):
    """upb accepted a value that the field's Arrow type cannot hold."""


def _py_field(fd: FieldDescriptor, msg: Any) -> Any:
    """Field ``fd`` of upb message ``msg`` as :func:`arrow_type` lays it out."""
    value = getattr(msg, fd.name)
    if is_repeated(fd):
        if _is_map(fd):
            entry = _message_type(fd)
            key_fd, value_fd = entry.fields_by_name["key"], entry.fields_by_name["value"]
            keys = sorted((_py_scalar(key_fd, k), k) for k in value)
            return [{"key": key, "value": _py_scalar(value_fd, value[k])} for key, k in keys]
        return [_py_scalar(fd, v) for v in value]
    if _has_presence(fd) and not msg.HasField(fd.name):
        return None
    return _py_scalar(fd, value)


def _py_scalar(fd: FieldDescriptor, value: Any) -> Any:
    if fd.type in _MESSAGE_TYPES:
        return {f.name: _py_field(f, value) for f in _message_type(fd).fields}
    if fd.type == _T.TYPE_STRING and isinstance(value, bytes):
        raise _Unrepresentable(fd.full_name)
    return value


_LOW7: Final = np.uint64(0x7F7F7F7F7F7F7F7F)
_HIGH: Final = np.uint64(0x8080808080808080)
_ONE: Final = np.uint64(1)
_63: Final = np.uint64(63)
_SWAR: Final = (
    (np.uint64(0x007F007F007F007F), np.uint64(0x7F007F007F007F00), np.uint64(1)),
    (np.uint64(0x00003FFF00003FFF), np.uint64(0x3FFF00003FFF0000), np.uint64(2)),
    (np.uint64(0x000000000FFFFFFF), np.uint64(0x0FFFFFFF00000000), np.uint64(4)),
)


def _read_varint(buf: U8, pos: I64, err: npt.NDArray[np.int8], rows: I64) -> tuple[U64, I64]:
    """Varints at ``pos`` (one per element): their values and the positions after.
    Over-long varints set ``err`` for the corresponding ``rows``.

    Varints of up to 8 bytes (values below 2**56) are decoded 8 bytes at a time:
    one unaligned little-endian load per element, the terminating byte found from
    the high bits, the 7-bit groups compacted with three shift-and-mask steps.
    Longer ones (negative ``int32``/``int64``, huge ``uint64``) go byte by byte."""
    x = _load8(buf, pos)
    stop = ~x & _HIGH
    low = stop & (~stop + _ONE)
    keep = (low << _ONE) - _ONE
    v = x & keep & _LOW7
    for lo, hi, shift in _SWAR:
        v = (v & lo) | ((v & hi) >> shift)
    after = pos + (_popcount(keep) >> 3)
    long = np.flatnonzero(stop == 0)
    if long.size:
        _read_long_varints(buf, pos, long, v, after, err, rows)
    return v, after


def _load8(buf: U8, pos: I64) -> U64:
    """The 8 bytes at each ``pos`` as a little-endian ``uint64``: compiled, or two aligned
    words around them, shifted together (1-D ``take``s, cheaper than gathering 8-byte rows
    of a strided view). ``pos`` lie before the buffer's :data:`PAD` zero bytes."""
    if _wirescan is not None and buf.flags.c_contiguous:
        out = np.empty(pos.size, dtype=np.uint64)
        _wirescan.load8(buf, np.ascontiguousarray(pos, dtype=np.int64), out)
        return out
    words = buf[:buf.size - buf.size % 8].view("<u8")
    q = pos >> 3
    shift = ((pos & 7) << 3).astype(np.uint64)
    low = words.take(q)
    high = words.take(q + 1, mode="clip")  # q + 1 is inside the padding, never clipped
    return (low >> shift) | ((high << _ONE) << (_63 - shift))


def _popcount(x: U64) -> I64:
    count = getattr(np, "bitwise_count", None)
    if count is not None:
        return np.asarray(count(x), dtype=np.int64)
    bits = np.zeros(x.shape, dtype=np.int64)
    y = x.copy()
    while True:
        nz = y != 0
        if not nz.any():
            return bits
        bits += nz
        y &= y - _ONE


def _read_long_varints(buf: U8, pos: I64, idx: I64, value: U64, after: I64,
                       err: npt.NDArray[np.int8], rows: I64) -> None:
    value[idx] = 0
    p = pos[idx]
    for shift in range(0, 70, 7):
        b = buf[p]
        value[idx] |= (b & 0x7F).astype(np.uint64) << np.uint64(shift)
        after[idx] = p + 1
        more = (b & 0x80) != 0
        idx, p = idx[more], p[more] + 1
        if not idx.size:
            return
    _mark(err, rows[idx], _E_VARINT)
    after[idx] = pos[idx]


_LONG_RANGE_BYTES: Final = 256
"""From this mean length of the ranges :func:`_gather_ranges` copies (bytes), it
copies them one slice at a time: a slice costs ~0.3 us whatever its length, the
mask path ~1.5 ns a byte of the span, in memory a task touches for the first time
(``bench.bench_task --string-bytes 1024 --stages``; docs/BENCHMARKS.md, "1 KiB rows,
the driver's progress poll, and the JVM's share of a warm batch")."""


def _gather_ranges(buf: U8, starts: I64, lengths: I64) -> tuple[U8, I64]:
    """Concatenate ``buf[s:s+l]`` for every range; returns the bytes and the Arrow
    offsets (``len(starts) + 1`` of them). Compiled, a copy per range; else by whichever
    numpy path costs least for the ranges' lengths and spread."""
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    if total == 0:
        return np.zeros(0, dtype=np.uint8), offsets
    if _wirescan is not None and buf.flags.c_contiguous:
        out = np.empty(total, dtype=np.uint8)
        _wirescan.gather(buf, np.ascontiguousarray(starts, dtype=np.int64),
                         np.ascontiguousarray(lengths, dtype=np.int64), out)
        return out, offsets
    nonempty = lengths > 0
    s, n = starts[nonempty], lengths[nonempty]
    if total >= _LONG_RANGE_BYTES * s.size:
        # Long ranges (1 KiB strings, say): one copy per range beats the vectorised
        # paths below, which touch a mask byte or an index word per byte gathered.
        view = memoryview(buf.data)
        joined = b"".join([view[a:a + k] for a, k in zip(s.tolist(), n.tolist(), strict=True)])
        return np.frombuffer(joined, dtype=np.uint8), offsets
    e = s + n
    lo = int(s[0])
    if int(e[-1]) - lo <= 4 * total and bool(np.all(s[1:] >= e[:-1])):
        # Ranges in order and apart, covering much of their span (a table's rows in
        # its envelopes): a mask over the span, built run by run (gap, range, gap,
        # ...), costs a byte per byte of the span instead of an int64 index per byte
        # gathered.
        runs = np.empty(2 * n.size, dtype=np.int64)
        runs[0::2] = s - np.concatenate(([lo], e[:-1]))
        runs[1::2] = n
        pattern = np.zeros(2 * n.size, dtype=np.bool_)
        pattern[1::2] = True
        return buf[lo:int(e[-1])][np.repeat(pattern, runs)], offsets
    index = np.repeat(starts - offsets[:-1], lengths) + np.arange(total, dtype=np.int64)
    return buf[index], offsets


def _fixed(buf: U8, pos: I64, width: int, dtype: str) -> npt.NDArray[Any]:
    x = _load8(buf, pos)
    return (x if width == 8 else x.astype(np.uint32)).view(dtype)


class _Field:
    """Accumulates one field's occurrences across steps."""

    __slots__ = ("elem_pos", "elem_rows", "elem_vals", "fd", "last_step", "oneof_seen",
                 "ordered", "pack_len", "pack_pos", "pack_rows", "pack_step", "packable",
                 "present", "repeated", "single_len", "single_step", "value",
                 "watch_repeats")

    def __init__(self, fd: FieldDescriptor, n: int, oneof_seen: Bools | None) -> None:
        self.fd = fd
        self.present = np.zeros(n, dtype=np.bool_)
        self.value = np.zeros(n, dtype=np.uint64)
        self.elem_rows: list[I64] = []
        self.elem_vals: list[U64] = []
        self.elem_pos: list[I64] = []
        self.single_step: list[I64] = []
        self.pack_rows: list[I64] = []
        self.pack_pos: list[I64] = []
        self.pack_len: list[I64] = []
        self.pack_step: list[I64] = []
        self.single_len: list[I64] = []
        # The compiled scan records a repeated field's values already in row, then wire
        # order (packed runs' values in place), so they need no sort.
        self.ordered = False
        self.repeated = is_repeated(fd)
        # Only repeated scalars (numbers, bools, enums) have a packed encoding.
        self.packable = self.repeated and fd.type not in _LEN_TYPES
        # A second occurrence of a singular message (merged by upb) or of a string
        # upb validates (the overwritten one must be valid UTF-8 too), or of any
        # member of a oneof (upb clears a message member when the case changes),
        # sends the row to upb.
        self.oneof_seen = oneof_seen
        self.watch_repeats = not self.repeated and (
            fd.type in _MESSAGE_TYPES or oneof_seen is not None
            or (fd.type == _T.TYPE_STRING and _validates_utf8(fd)))
        self.last_step = (np.full(n, -1, dtype=np.int64)
                          if fd.containing_oneof is not None else None)


def _fields(desc: Descriptor, n: int) -> dict[int, _Field]:
    """An empty accumulator per field of ``desc``, by number, for ``n`` rows; the members
    of a oneof share one "seen" flag per row."""
    # Oneofs of one member (proto3 ``optional``) behave like any singular field.
    seen = {oneof.full_name: np.zeros(n, dtype=np.bool_)
            for oneof in desc.oneofs if len(oneof.fields) > 1}
    return {fd.number: _Field(fd, n, None if fd.containing_oneof is None
                              else seen.get(fd.containing_oneof.full_name))
            for fd in desc.fields}


def _decode_message(
    desc: Descriptor, buf: U8, starts: I64, ends: I64, err: npt.NDArray[np.int8],
    spans: frozenset[str] = frozenset(), found: dict[str, Spans] | None = None,
) -> dict[str, pa.Array]:
    n = starts.size
    scanned = _scanned(desc, buf, starts, ends)
    if scanned is not None:
        return _finished(desc, scanned, buf, err, n, spans, found)
    fields = _fields(desc, n)
    expected = {number: _expected_wire_type(f.fd) for number, f in fields.items()}
    max_number = max(fields, default=0)
    map_entry = bool(desc.GetOptions().map_entry)
    extension_ranges = [(int(a), int(b)) for a, b in desc.extension_ranges]
    keep = starts < ends
    act = np.flatnonzero(keep)
    pos = starts[act]
    end = ends[act]
    step = 0
    errors_seen = int(np.count_nonzero(err))
    # Invariant: the active rows have no error code (a row leaves at the step it
    # gets one), so a step's new codes always change errors_seen, and every active
    # row advances by at least one byte per step.
    while act.size:
        errors_before = errors_seen
        first = buf[pos]
        if int(first.max()) < 0x80:
            tag = first.astype(np.int64)
            p = pos + 1
        else:
            tag64, p = _read_varint(buf, pos, err, act)
            bad_tag = (tag64 > np.uint64(0xFFFFFFFF)) | (p - pos > 5)
            if bad_tag.any():
                _mark(err, act[bad_tag], _E_TAG)
            tag = np.minimum(tag64, np.uint64(1 << 40)).astype(np.int64)
        wt = tag & 7
        fnum = tag >> 3
        wt_counts = np.bincount(wt, minlength=8)
        uniform = next((k for k in (0, 1, 2, 5) if wt_counts[k] == act.size), None)
        val: U64
        dpos = p
        if uniform == _WT_VARINT:
            val, nxt = _read_varint(buf, p, err, act)
        elif uniform == _WT_LEN:
            val, dpos = _read_varint(buf, p, err, act)
            nxt = _bounded(val, p, dpos, end, act, err)
        elif uniform is not None:
            val = np.zeros(0, dtype=np.uint64)
            nxt = p + (8 if uniform == _WT_I64 else 4)
        else:
            nxt = np.empty_like(p)
            val = np.zeros(act.size, dtype=np.uint64)
            if wt_counts[_WT_VARINT]:
                m = wt == _WT_VARINT
                val[m], nxt[m] = _read_varint(buf, p[m], err, act[m])
            if wt_counts[_WT_I64]:
                m = wt == _WT_I64
                nxt[m] = p[m] + 8
            if wt_counts[_WT_I32]:
                m = wt == _WT_I32
                nxt[m] = p[m] + 4
            if wt_counts[_WT_LEN]:
                m = wt == _WT_LEN
                ln, after = _read_varint(buf, p[m], err, act[m])
                nxt[m] = _bounded(ln, p[m], after, end[m], act[m], err)
                val[m] = ln
                dpos = p.copy()
                dpos[m] = after
            # upb skips a group in an unknown field (or one whose wire type doesn't
            # match): rare, so such rows go to upb.
            group = wt == _WT_SGROUP
            if group.any():
                _mark(err, act[group], _F_GROUP)
            bad = (wt == _WT_EGROUP) | (wt > _WT_I32)
            if bad.any():
                _mark(err, act[bad], _E_GROUP)
        over_end = nxt > end
        if over_end.any():
            _mark(err, act[over_end], _E_TRUNCATED)
        if (fnum == 0).any():
            _mark(err, act[fnum == 0], _E_TAG)
        for first_number, last_number in extension_ranges:
            # upb parses (and validates) extensions it knows: to upb.
            ext = (fnum >= first_number) & (fnum <= last_number)
            if ext.any():
                _mark(err, act[ext], _F_OTHER)
        if map_entry:
            # upb keeps a map entry with an unknown field (or a key or value of the
            # wrong wire type) out of the map: rare, so such rows go to upb.
            known = np.zeros(act.size, dtype=np.bool_)
            for number, wire_type in expected.items():
                known |= (fnum == number) & (wt == wire_type)
            if not known.all():
                _mark(err, act[~known], _F_OTHER)
        errors_seen = int(np.count_nonzero(err))
        if errors_seen != errors_before:
            failed = err[act] != 0
            ok_mask: Bools | None = ~failed
            nxt[failed] = end[failed]
        else:
            ok_mask = None
        counts = np.bincount(np.minimum(fnum, max_number + 1), minlength=max_number + 2)
        sent = False
        for number in (np.flatnonzero(counts[1:max_number + 1]) + 1).tolist():
            f = fields.get(number)
            if f is None:
                continue
            if ok_mask is None and counts[number] == act.size:
                sel = None
            elif ok_mask is None:
                sel = np.flatnonzero(fnum == number)
            else:
                sel = np.flatnonzero((fnum == number) & ok_mask)
            sent |= _take(f, expected[number], sel, uniform, wt, act, val, dpos, step, err)
        if sent:
            # Rows sent to upb while recording stop here (see the invariant).
            stopped = err[act] != 0
            nxt[stopped] = end[stopped]
            errors_seen = int(np.count_nonzero(err))
        going = nxt < end
        if not going.all():
            act, pos, end = act[going], nxt[going], end[going]
        else:
            pos = nxt
        step += 1
    for oneof in desc.oneofs:
        members = [fields[fd.number] for fd in oneof.fields]
        if len(members) > 1:
            latest = np.max([m.last_step for m in members if m.last_step is not None], axis=0)
            for m in members:
                m.present &= m.last_step == latest
    return _finished(desc, fields, buf, err, n, spans, found)


def _finished(desc: Descriptor, fields: dict[int, _Field], buf: U8, err: npt.NDArray[np.int8],
              n: int, spans: frozenset[str], found: dict[str, Spans] | None
              ) -> dict[str, pa.Array]:
    """The columns of the recorded ``fields`` (and ``spans`` into ``found``)."""
    if spans and found is not None:
        for f in fields.values():
            if f.fd.name in spans:
                found[f.fd.name] = _spans(f, n)
    return {f.fd.name: _finish(f, buf, err, n) for f in fields.values()
            if f.fd.name not in spans}


_SCAN_MAX_NUMBER: Final = 4096
"""Above this field number a message keeps the numpy scan (the compiled scan's table
holds an entry per number up to the largest)."""
_SCAN_REPEATED: Final = 0x10
_SCAN_PACKABLE: Final = 0x20
_SCAN_WATCH: Final = 0x40


def _scan_spec(desc: Descriptor, fields: dict[int, _Field]
               ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]] | None:
    """The compiled scan's tables for ``desc`` (see ``_wirescan.c``): an entry per field
    number, and per slot the slot whose "seen" flag it shares (a oneof's members share
    their first's: a second member sends the row to upb, as in :func:`_record`, so at most
    one is present and no case needs resolving). None for a message the scan does not
    serve: a map entry, extension ranges, groups, numbers above
    :data:`_SCAN_MAX_NUMBER`."""
    if (desc.GetOptions().map_entry or desc.extension_ranges
            or any(fd.type == _T.TYPE_GROUP for fd in desc.fields)
            or max(fields, default=0) > _SCAN_MAX_NUMBER):
        return None
    spec = np.full(max(fields, default=0) + 1, -1, dtype=np.int32)
    groups = np.arange(len(fields), dtype=np.int32)
    first_member: dict[int, int] = {}
    for slot, (number, f) in enumerate(sorted(fields.items())):
        spec[number] = ((slot << 8) | _expected_wire_type(f.fd)
                        | (_SCAN_REPEATED if f.repeated else 0)
                        | (_SCAN_PACKABLE if f.packable else 0)
                        | (_SCAN_WATCH if f.watch_repeats else 0))
        if f.oneof_seen is not None:
            groups[slot] = first_member.setdefault(id(f.oneof_seen), slot)
    return spec, groups


def _scanned(desc: Descriptor, buf: U8, starts: I64, ends: I64) -> dict[int, _Field] | None:
    """Every field occurrence of the rows, recorded by the compiled scan (one pass per row)
    as the lock-step loop of :func:`_decode_message` records them; None when the scan is
    not compiled, does not serve ``desc`` (:func:`_scan_spec`), or finds a row that is not
    *regular* (``_wirescan.c``): one on which the lock step would set an error code. So a
    row that is damaged, or that upb must decide, is always decided by the numpy scan, and
    both give the same columns."""
    if _wirescan is None:
        return None
    n = starts.size
    fields = _fields(desc, n)
    tables = _scan_spec(desc, fields)
    if tables is None:
        return None
    spec, groups = tables
    ordered = [f for _, f in sorted(fields.items())]
    singular: list[tuple[npt.NDArray[Any], ...] | None] = []
    for f in ordered:
        if f.repeated:
            singular.append(None)
            continue
        lengths = np.zeros(n if _expected_wire_type(f.fd) == _WT_LEN else 0, dtype=np.int64)
        singular.append((f.present.view(np.uint8), f.value, lengths))
        if lengths.size:
            f.single_len.append(lengths)
    repeated = _wirescan.scan(np.ascontiguousarray(buf, dtype=np.uint8),
                              np.ascontiguousarray(starts, dtype=np.int64),
                              np.ascontiguousarray(ends, dtype=np.int64), spec, groups, singular)
    if repeated is None:
        return None
    for f, arrays in zip(ordered, repeated, strict=True):
        if arrays is None:
            continue
        rows, steps, values, lengths = (np.frombuffer(a, dtype=np.int64) for a in arrays)
        f.ordered = True
        if rows.size:
            f.elem_rows.append(rows)
            f.single_step.append(steps)
            kind = _expected_wire_type(f.fd)
            if kind == _WT_VARINT:
                f.elem_vals.append(values.view(np.uint64))
            else:
                f.elem_pos.append(values)
                if kind == _WT_LEN:
                    f.single_len.append(lengths)
    return fields


def _mark(err: npt.NDArray[np.int8], rows: I64, code: int) -> None:
    """Record ``code`` for ``rows`` that have no error yet (the first error wins)."""
    err[rows[err[rows] == 0]] = code


def _bounded(ln: U64, start: I64, after: I64, ends: I64, rows: I64,
             err: npt.NDArray[np.int8]) -> I64:
    """End positions of length-delimited values whose length varint is at
    ``start:after``; lengths past the row's end mark the row truncated, length
    varints longer than 5 bytes (upb's limit, whatever their value) mark it too;
    both are clamped so nothing reads past the buffer."""
    long = after - start > 5
    if long.any():
        _mark(err, rows[long], _E_LENGTH)
        ln[long] = 0
    room = ends - after
    over = ln > np.maximum(room, 0).astype(np.uint64)
    if over.any():
        _mark(err, rows[over], _E_TRUNCATED)
        ln[over] = 0
    return after + ln.astype(np.int64)


def _expected_wire_type(fd: FieldDescriptor) -> int:
    t = fd.type
    if t == _T.TYPE_GROUP:
        return _WT_SGROUP
    if t in _VARINT_TYPES:
        return _WT_VARINT
    if t in _I64_TYPES:
        return _WT_I64
    if t in _I32_TYPES:
        return _WT_I32
    return _WT_LEN


def _take(f: _Field, expected: int, sel: I64 | None, uniform: int | None, wt: I64,
          act: I64, val: U64, dpos: I64, step: int, err: npt.NDArray[np.int8]) -> bool:
    """Record field ``f``'s occurrences at this step: the entries ``sel`` of the
    step's arrays (all of them when ``sel`` is None). True if rows were sent to upb."""
    if sel is None:
        if uniform is None:
            sel = np.arange(act.size, dtype=np.int64)
        elif uniform == expected:
            return _record(f, expected, act, val, dpos, step, err)
        elif uniform == _WT_LEN and f.packable:
            _record_packed(f, act, val, dpos, step)
            return False
        else:
            return False
    sub_wt = wt[sel]
    single = sel[sub_wt == expected]
    sent = False
    if single.size:
        sent = _record(f, expected, act[single], val[single] if val.size else val,
                       dpos[single], step, err)
    if f.packable:
        packed = sel[sub_wt == _WT_LEN]
        if packed.size:
            _record_packed(f, act[packed], val[packed], dpos[packed], step)
    return sent


def _record(f: _Field, expected: int, rows: I64, val: U64, dpos: I64, step: int,
            err: npt.NDArray[np.int8]) -> bool:
    if f.repeated:
        f.elem_rows.append(rows)
        f.single_step.append(np.full(rows.size, step, dtype=np.int64))
        if expected == _WT_VARINT:
            f.elem_vals.append(val)
        else:
            f.elem_pos.append(dpos)
            if expected == _WT_LEN:
                f.single_len.append(val.astype(np.int64))
        return False
    sent = False
    if f.watch_repeats:
        seen = f.present if f.oneof_seen is None else f.oneof_seen
        again = seen[rows]
        if again.any():
            _mark(err, rows[again], _F_OTHER)
            sent = True
        if f.oneof_seen is not None:
            f.oneof_seen[rows] = True
    f.present[rows] = True
    if f.last_step is not None:
        f.last_step[rows] = step
    if expected == _WT_VARINT:
        f.value[rows] = val
        return sent
    f.value[rows] = dpos.astype(np.uint64)
    if expected == _WT_LEN:
        if not f.single_len:
            f.single_len.append(np.zeros(f.present.size, dtype=np.int64))
        f.single_len[0][rows] = val.astype(np.int64)
    return sent


def _record_packed(f: _Field, rows: I64, val: U64, dpos: I64, step: int) -> None:
    f.pack_rows.append(rows)
    f.pack_pos.append(dpos)
    f.pack_len.append(val.astype(np.int64))
    f.pack_step.append(np.full(rows.size, step, dtype=np.int64))


def _convert_varint(t: int, raw: U64) -> npt.NDArray[Any]:
    if t in (_T.TYPE_INT32, _T.TYPE_ENUM):
        return raw.astype(np.uint32).view(np.int32)
    if t == _T.TYPE_INT64:
        return raw.view(np.int64)
    if t == _T.TYPE_UINT32:
        return raw.astype(np.uint32)
    if t == _T.TYPE_UINT64:
        return raw
    if t == _T.TYPE_SINT32:
        low = raw.astype(np.uint32)  # upb zigzag-decodes the low 32 bits
        return (low >> np.uint32(1)).view(np.int32) ^ -(low & np.uint32(1)).view(np.int32)
    if t == _T.TYPE_SINT64:
        return (raw >> np.uint64(1)).view(np.int64) ^ -(raw & np.uint64(1)).view(np.int64)
    return np.not_equal(raw, 0)


_FIXED: Final = {
    _T.TYPE_DOUBLE: (8, "<f8"), _T.TYPE_FIXED64: (8, "<u8"), _T.TYPE_SFIXED64: (8, "<i8"),
    _T.TYPE_FLOAT: (4, "<f4"), _T.TYPE_FIXED32: (4, "<u4"), _T.TYPE_SFIXED32: (4, "<i4"),
}


def _scalar_values(fd: FieldDescriptor, buf: U8, pos_or_raw: npt.NDArray[Any]) -> pa.Array:
    t = fd.type
    if t in _VARINT_TYPES:
        return pa.array(_convert_varint(t, pos_or_raw), type=_SCALAR_ARROW[t])
    width, dtype = _FIXED[t]
    return pa.array(_fixed(buf, pos_or_raw.astype(np.int64), width, dtype), type=_SCALAR_ARROW[t])


def _len_values(fd: FieldDescriptor, buf: U8, pos: I64, lengths: I64, owners: I64,
                err: npt.NDArray[np.int8], mask: Bools | None) -> pa.Array:
    """Strings, bytes or messages at ``buf[pos:pos+len]``; ``owners`` are the rows
    the values belong to (for error reporting)."""
    count = pos.size
    validity = None if mask is None else pa.array(mask, type=pa.bool_()).buffers()[1]
    null_count = -1 if mask is not None else 0
    if fd.type in _MESSAGE_TYPES:
        sub_err = np.zeros(count, dtype=np.int8)
        sub_starts = pos
        sub_ends = pos + lengths
        if mask is not None:
            sub_ends = np.where(mask, sub_ends, sub_starts)
        children = _decode_message(_message_type(fd), buf, sub_starts, sub_ends, sub_err)
        failed = np.flatnonzero(sub_err)
        if failed.size:
            odd = sub_err[failed] >= _F_GROUP
            _mark(err, owners[failed[~odd]], _E_NESTED)
            _mark(err, owners[failed[odd]], _F_OTHER)
        struct_type = _scalar_arrow_type(fd)
        return pa.Array.from_buffers(
            struct_type, count, [validity], null_count=null_count,
            children=[children[f.name] for f in _message_type(fd).fields])
    if mask is not None:
        lengths = np.where(mask, lengths, 0)
    data, offsets = _gather_ranges(buf, pos, lengths)
    arr = pa.Array.from_buffers(
        pa.binary(), count, [validity, pa.py_buffer(offsets.astype(np.int32)),
                             pa.py_buffer(data)], null_count=null_count)
    if fd.type == _T.TYPE_BYTES:
        return arr
    try:
        return arr.cast(pa.string())
    except pa.ArrowInvalid:
        raw = arr.to_pylist()
        bad = []
        for i, item in enumerate(raw):
            try:
                if item is not None:
                    item.decode("utf-8")
            except UnicodeDecodeError:
                bad.append(i)
        # Without validation upb accepts the string (as bytes): let it decide the
        # row, which becomes _E_UTF8_UNCHECKED if it is otherwise valid.
        _mark(err, owners[np.asarray(bad, dtype=np.int64)],
              _E_UTF8 if _validates_utf8(fd) else _F_UTF8)
        bad_set = set(bad)
        return pa.array([None if v is None or i in bad_set else v.decode("utf-8")
                         for i, v in enumerate(raw)], type=pa.string())


def _finish(f: _Field, buf: U8, err: npt.NDArray[np.int8], n: int) -> pa.Array:
    fd = f.fd
    t = fd.type
    all_rows = np.arange(n, dtype=np.int64)
    if f.repeated:
        return _finish_repeated(f, buf, err, n)
    mask = f.present if _has_presence(fd) else None
    if t in _LEN_TYPES:
        lengths = f.single_len[0] if f.single_len else np.zeros(n, dtype=np.int64)
        pos = f.value.astype(np.int64)
        if mask is None:
            pos = np.where(f.present, pos, 0)
        return _len_values(fd, buf, pos, lengths, all_rows, err, mask)
    raw = f.value
    if t not in _VARINT_TYPES:
        raw = np.where(f.present, raw, np.uint64(buf.size - _PAD))
    closed = _closed_enum_values(fd)
    if closed is not None:
        # upb keeps an unknown value of a closed enum out of the field (the previous
        # value stays): rare, so such rows go to upb.
        unknown = f.present & ~np.isin(raw.astype(np.uint32).view(np.int32), closed)
        if unknown.any():
            _mark(err, all_rows[unknown], _F_OTHER)
    values = _scalar_values(fd, buf, raw)
    if mask is None:
        return values
    return pa.Array.from_buffers(values.type, n, [
        pa.array(mask, type=pa.bool_()).buffers()[1], values.buffers()[1]], null_count=-1)


def _map_entries(rows: I64, entries: pa.StructArray) -> tuple[I64, pa.Array]:
    """One entry per key and row, the last one on the wire (protobuf's rule),
    sorted by key: upb's map order is unspecified, so the columns fix one."""
    if rows.size == 0:
        return rows, entries
    table = pa.table({"r": rows, "k": entries.field("key"),
                      "i": np.arange(rows.size, dtype=np.int64)})
    order = np.asarray(pc.sort_indices(
        table, sort_keys=[("r", "ascending"), ("k", "ascending"), ("i", "ascending")]),
        dtype=np.int64)
    sorted_rows = rows[order]
    keys = entries.field("key").take(pa.array(order))
    keep = np.ones(rows.size, dtype=np.bool_)
    keep[:-1] = (sorted_rows[:-1] != sorted_rows[1:]) | np.asarray(
        pc.not_equal(keys[:-1], keys[1:]), dtype=np.bool_)
    if keep.all() and bool((order == np.arange(rows.size)).all()):
        return rows, entries
    chosen = order[keep]
    return rows[chosen], entries.take(pa.array(chosen))


def _finish_repeated(f: _Field, buf: U8, err: npt.NDArray[np.int8], n: int) -> pa.Array:
    fd = f.fd
    t = fd.type
    rows_parts: list[I64] = list(f.elem_rows)
    step_parts: list[I64] = list(f.single_step)
    if t in _LEN_TYPES:
        pos = np.concatenate(f.elem_pos) if f.elem_pos else np.zeros(0, dtype=np.int64)
        lens = np.concatenate(f.single_len) if f.single_len else np.zeros(0, dtype=np.int64)
        rows = np.concatenate(rows_parts) if rows_parts else np.zeros(0, dtype=np.int64)
        if not f.ordered:
            order = np.argsort(rows, kind="stable")
            rows, pos, lens = rows[order], pos[order], lens[order]
        values = _len_values(fd, buf, pos, lens, rows, err, None)
        if _is_map(fd):
            rows, values = _map_entries(rows, values)
        return _lists(rows, values, n)
    if t in _VARINT_TYPES:
        raw_parts = list(f.elem_vals)
    else:
        raw_parts = [p.astype(np.uint64) for p in f.elem_pos]
    sub_parts: list[I64] = [np.zeros(p.size, dtype=np.int64) for p in raw_parts]
    for prow, ppos, plen, pstep in zip(f.pack_rows, f.pack_pos, f.pack_len, f.pack_step,
                                       strict=True):
        data, offsets = _gather_ranges(buf, ppos, plen)
        if t in _VARINT_TYPES:
            vals, counts = _packed_varints(data, offsets, prow, err)
        else:
            width = 8 if t in _I64_TYPES else 4
            counts = plen // width
            bad = (plen % width) != 0
            if bad.any():
                _mark(err, prow[bad], _E_PACKED)
                counts = np.where(bad, 0, counts)
            starts = np.repeat(ppos, counts)
            within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(
                np.cumsum(counts) - counts, counts)
            vals = (starts + within * width).astype(np.uint64)
        owners = np.repeat(prow, counts)
        rows_parts.append(owners)
        step_parts.append(np.repeat(pstep, counts))
        raw_parts.append(vals)
        sub_parts.append(np.arange(owners.size, dtype=np.int64))
    if not rows_parts:
        rows = np.zeros(0, dtype=np.int64)
        raw = np.zeros(0, dtype=np.uint64)
    elif f.ordered:
        rows, raw = np.concatenate(rows_parts), np.concatenate(raw_parts)
    else:
        rows = np.concatenate(rows_parts)
        raw = np.concatenate(raw_parts)
        steps = np.concatenate(step_parts)
        subs = np.concatenate(sub_parts)
        order = np.lexsort((subs, steps, rows))
        rows, raw = rows[order], raw[order]
    closed = _closed_enum_values(fd)
    if closed is not None and rows.size:
        # upb drops unknown values of a closed enum from the list: rare, to upb.
        unknown = ~np.isin(raw.astype(np.uint32).view(np.int32), closed)
        if unknown.any():
            _mark(err, rows[unknown], _F_OTHER)
    return _lists(rows, _scalar_values(fd, buf, raw), n)


def _spans(f: _Field, n: int) -> Spans:
    """A repeated bytes field's values as :class:`Spans`: the order of
    :func:`_finish_repeated` (by row, then as they occur), nothing copied."""
    pos = np.concatenate(f.elem_pos) if f.elem_pos else np.zeros(0, dtype=np.int64)
    lens = np.concatenate(f.single_len) if f.single_len else np.zeros(0, dtype=np.int64)
    rows = np.concatenate(f.elem_rows) if f.elem_rows else np.zeros(0, dtype=np.int64)
    if not f.ordered:
        order = np.argsort(rows, kind="stable")
        rows, pos, lens = rows[order], pos[order], lens[order]
    counts = np.bincount(rows, minlength=n) if rows.size else np.zeros(n, dtype=np.int64)
    bounds = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=bounds[1:])
    return Spans(pos, pos + lens, bounds)


def _packed_varints(data: U8, offsets: I64, owners: I64, err: npt.NDArray[np.int8]
                    ) -> tuple[U64, I64]:
    """Decode concatenated packed varint runs; returns values and per-run counts.
    A run whose last varint is cut off marks its owner truncated."""
    if data.size == 0:
        return np.zeros(0, dtype=np.uint64), np.zeros(owners.size, dtype=np.int64)
    last_byte = (data & 0x80) == 0
    run_ends = offsets[1:]
    nonempty = run_ends > offsets[:-1]
    truncated = nonempty & ~last_byte[np.maximum(run_ends - 1, 0)]
    if truncated.any():
        _mark(err, owners[truncated], _E_TRUNCATED)
        last_byte[run_ends[nonempty] - 1] = True
    starts = np.flatnonzero(np.concatenate(([True], last_byte[:-1])))
    padded = np.concatenate((np.where(last_byte, data & 0x7F, data),
                             np.zeros(_PAD, dtype=np.uint8)))
    element_owner = np.searchsorted(offsets, starts, side="right") - 1
    values, _ = _read_varint(padded, starts, err, owners[element_owner])
    counts = np.bincount(element_owner, minlength=owners.size).astype(np.int64)
    return values, counts


def _lists(rows: I64, values: pa.Array, n: int) -> pa.Array:
    counts = np.bincount(rows, minlength=n) if rows.size else np.zeros(n, dtype=np.int64)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(counts, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), values)
