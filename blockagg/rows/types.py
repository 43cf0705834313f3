"""ClickHouse column types and the conversion of decoded protobuf columns into them.

Two questions, answered from one table of rules so they never disagree:

* :func:`field_mismatch` (registration time): can this protobuf field feed this
  column without loss? ``None`` if yes, otherwise the reason.
* :func:`convert_column` (decode time): turn the field's Arrow column (from
  :func:`proto.decode.decode_rows`) into the Python values clickhouse-driver writes,
  and report every row whose value doesn't fit (an ``int64`` that overflows
  ``UInt8``, an enum number the column's ``Enum8`` lacks, a malformed UUID) instead
  of truncating it. Such a row's message becomes a dead letter.

Conversion is a pure function of (column type, field, values), so a retried block
converts to the same bytes. Rules (see ``docs/schemas.md``):

========================  ===============================================================
ClickHouse                protobuf field
========================  ===============================================================
Int8..Int64, UInt8..64    any integer type or bool; values out of range are rejected
Float32                   float
Float64                   float, double
Decimal(P, S)             string (decimal text, at most S fraction digits), integers
String                    string, bytes
FixedString(N)            bytes or string of at most N bytes
UUID                      string (text form) or bytes (16)
Date                      Timestamp (UTC day), int32/int64 days since 1970-01-01, string
DateTime                  Timestamp (whole seconds), integer seconds since the epoch
DateTime64(p)             Timestamp (truncated to p digits), integer ticks of 10**-p s
Enum8/Enum16              enum (by name), string (name), integer (value)
Bool                      bool
IPv4                      string (dotted) or uint32/fixed32
IPv6                      string or bytes (16)
Nullable(T)               as T; absent optional/message/wrapper fields become NULL
LowCardinality(T)         as T
Array(T)                  repeated field of an element type that converts to T
Map(K, V)                 map field
Tuple(T1, ...)            message field, fields matched by position
wrappers (Int64Value…)    as their ``value``; absent is NULL (Nullable) or the default
========================  ===============================================================

Above 500 lines because the type parser and a converter per ClickHouse type are the one
table of rules both questions above are answered from.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import pyarrow as pa
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from blockagg.proto.descriptors import is_repeated
from blockagg.rows.exceptions import TypeParseError
from blockagg.rows.layout import EnumColumn, ListColumn, StringColumn

_T = FieldDescriptor

INT_RANGES: Final = {
    "Int8": (-(2**7), 2**7 - 1), "Int16": (-(2**15), 2**15 - 1),
    "Int32": (-(2**31), 2**31 - 1), "Int64": (-(2**63), 2**63 - 1),
    "UInt8": (0, 2**8 - 1), "UInt16": (0, 2**16 - 1), "UInt32": (0, 2**32 - 1),
    "UInt64": (0, 2**64 - 1),
}
_INT_FIELDS: Final = {
    _T.TYPE_INT32, _T.TYPE_INT64, _T.TYPE_UINT32, _T.TYPE_UINT64, _T.TYPE_SINT32,
    _T.TYPE_SINT64, _T.TYPE_FIXED32, _T.TYPE_FIXED64, _T.TYPE_SFIXED32, _T.TYPE_SFIXED64,
    _T.TYPE_BOOL,
}
_WRAPPERS: Final = {
    f"google.protobuf.{name}" for name in
    ("DoubleValue", "FloatValue", "Int64Value", "UInt64Value", "Int32Value", "UInt32Value",
     "BoolValue", "StringValue", "BytesValue")
}
TIMESTAMP: Final = "google.protobuf.Timestamp"
_EPOCH_DATE: Final = dt.date(1970, 1, 1)


@dataclass(frozen=True)
class CHType:
    """A parsed ClickHouse type: ``name`` with ``args`` (numbers and strings of
    parametric types, the element names of a named Tuple), ``children`` (element
    types) and, for enums, ``enum`` (name -> value)."""

    name: str
    args: tuple[Any, ...] = ()
    children: tuple[CHType, ...] = ()
    enum: dict[str, int] = field(default_factory=dict)

    @property
    def nullable(self) -> bool:
        return self.name == "Nullable"

    def unwrap(self) -> CHType:
        """The type without ``Nullable``/``LowCardinality`` wrappers."""
        t = self
        while t.name in ("Nullable", "LowCardinality"):
            t = t.children[0]
        return t

    def __str__(self) -> str:
        if self.enum:
            inner = ", ".join(f"{_quote(k)} = {v}" for k, v in self.enum.items())
            return f"{self.name}({inner})"
        parts = [str(c) for c in self.children] + [_quote(a) if isinstance(a, str) else str(a)
                                                   for a in self.args]
        return f"{self.name}({', '.join(parts)})" if parts else self.name


_TOKEN = re.compile(r"\s*(?:(?P<str>'(?:[^'\\]|\\.)*')|(?P<num>-?\d+)"
                    r"|(?P<id>[A-Za-z_][A-Za-z0-9_]*)|(?P<punct>[(),=]))")


def parse_type(text: str) -> CHType:
    """Parse a type as ``system.columns.type`` spells it; raises :class:`TypeParseError`."""
    tokens: list[tuple[str, str]] = []
    pos = 0
    stripped = text.strip()
    while pos < len(stripped):
        m = _TOKEN.match(stripped, pos)
        if m is None or m.end() == pos:
            raise TypeParseError(f"can't parse ClickHouse type {text!r} at position {pos}")
        kind = m.lastgroup or ""
        tokens.append((kind, m.group(kind)))
        pos = m.end()
        while pos < len(stripped) and stripped[pos].isspace():
            pos += 1
    result, end = _parse(tokens, 0, text)
    if end != len(tokens):
        raise TypeParseError(f"trailing text in ClickHouse type {text!r}")
    return result


def _parse(tokens: list[tuple[str, str]], i: int, text: str) -> tuple[CHType, int]:
    if i >= len(tokens) or tokens[i][0] != "id":
        raise TypeParseError(f"expected a type name in {text!r}")
    name = tokens[i][1]
    i += 1
    if i >= len(tokens) or tokens[i][1] != "(":
        return CHType(name), i
    i += 1
    args: list[Any] = []
    children: list[CHType] = []
    enum: dict[str, int] = {}
    while True:
        kind, value = tokens[i]
        if kind == "str" and i + 1 < len(tokens) and tokens[i + 1][1] == "=":
            enum[_unquote(value)] = int(tokens[i + 2][1])
            i += 3
        elif kind == "str":
            args.append(_unquote(value))
            i += 1
        elif kind == "num":
            args.append(int(value))
            i += 1
        elif kind == "id" and i + 1 < len(tokens) and tokens[i + 1][0] == "id":
            args.append(value)
            child, i = _parse(tokens, i + 1, text)
            children.append(child)
        else:
            child, i = _parse(tokens, i, text)
            children.append(child)
        if tokens[i][1] == ")":
            return CHType(name, tuple(args), tuple(children), enum), i + 1
        if tokens[i][1] != ",":
            raise TypeParseError(f"expected ',' or ')' in {text!r}")
        i += 1


def _quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _unquote(token: str) -> str:
    return token[1:-1].replace("\\'", "'").replace("\\\\", "\\")


def _msg_name(fd: FieldDescriptor) -> str:
    return fd.message_type.full_name if fd.message_type is not None else ""


def _is_map(fd: FieldDescriptor) -> bool:
    return (is_repeated(fd) and fd.message_type is not None
            and fd.message_type.GetOptions().map_entry)


def _type_name(fd: FieldDescriptor) -> str:
    if fd.type == _T.TYPE_MESSAGE:
        return _msg_name(fd)
    names = {v: k[5:].lower() for k, v in vars(_T).items()
             if k.startswith("TYPE_") and isinstance(v, int)}
    return names.get(fd.type, str(fd.type))


def describe(fd: FieldDescriptor) -> str:
    """``repeated int64``, ``map``, ``google.protobuf.Timestamp``…, for messages."""
    if _is_map(fd):
        return "map"
    return ("repeated " if is_repeated(fd) else "") + _type_name(fd)


def field_mismatch(ch: CHType, fd: FieldDescriptor) -> str | None:
    """Why ``fd`` can't feed a column of type ``ch`` (``None``: it can)."""
    if ch.name == "Nullable":
        return field_mismatch(ch.children[0], fd)
    if ch.name == "LowCardinality":
        return field_mismatch(ch.children[0], fd)
    if ch.name == "Array":
        if not is_repeated(fd) or _is_map(fd):
            return f"Array column needs a repeated field, got {describe(fd)}"
        return _scalar_mismatch(ch.children[0].unwrap(), fd)
    if ch.name == "Map":
        if not _is_map(fd):
            return f"Map column needs a map field, got {describe(fd)}"
        entry = fd.message_type
        assert entry is not None
        for sub, want in zip(entry.fields, ch.children, strict=True):
            reason = field_mismatch(want, sub)
            if reason:
                return f"map {sub.name}: {reason}"
        return None
    if is_repeated(fd):
        return f"{describe(fd)} field needs an Array or Map column, got {ch}"
    return _scalar_mismatch(ch.unwrap(), fd)


def _scalar_mismatch(ch: CHType, fd: FieldDescriptor) -> str | None:
    t = fd.type
    name = ch.name
    msg = _msg_name(fd)
    if msg in _WRAPPERS:
        assert fd.message_type is not None
        return _scalar_mismatch(ch, fd.message_type.fields_by_name["value"])
    ok: bool
    if name in INT_RANGES:
        ok = t in _INT_FIELDS
    elif name == "Float32":
        ok = t == _T.TYPE_FLOAT
    elif name == "Float64":
        ok = t in (_T.TYPE_FLOAT, _T.TYPE_DOUBLE)
    elif name.startswith("Decimal"):
        ok = t == _T.TYPE_STRING or (t in _INT_FIELDS and t != _T.TYPE_BOOL)
    elif name in ("String", "FixedString") or name in ("UUID", "IPv6"):
        ok = t in (_T.TYPE_STRING, _T.TYPE_BYTES)
    elif name == "IPv4":
        ok = t in (_T.TYPE_STRING, _T.TYPE_UINT32, _T.TYPE_FIXED32)
    elif name == "Date":
        ok = msg == TIMESTAMP or t in (_T.TYPE_INT32, _T.TYPE_INT64, _T.TYPE_STRING)
    elif name in ("DateTime", "DateTime64"):
        ok = msg == TIMESTAMP or (t in _INT_FIELDS and t != _T.TYPE_BOOL)
    elif name in ("Enum8", "Enum16"):
        ok = t in (_T.TYPE_ENUM, _T.TYPE_STRING) or (t in _INT_FIELDS and t != _T.TYPE_BOOL)
        if ok and t == _T.TYPE_ENUM and fd.enum_type is not None:
            missing = [v.name for v in fd.enum_type.values if v.name not in ch.enum]
            if missing:
                return f"enum values {missing} are not in the column's {ch}"
    elif name == "Bool":
        ok = t == _T.TYPE_BOOL
    elif name == "Tuple":
        if t != _T.TYPE_MESSAGE or msg == TIMESTAMP:
            return f"Tuple column needs a message field, got {describe(fd)}"
        assert fd.message_type is not None
        subs = list(fd.message_type.fields)
        if len(subs) != len(ch.children):
            return (f"Tuple has {len(ch.children)} elements, message {msg} has "
                    f"{len(subs)} fields")
        for sub, want in zip(subs, ch.children, strict=True):
            reason = field_mismatch(want, sub)
            if reason:
                return f"{msg}.{sub.name}: {reason}"
        return None
    else:
        return f"column type {ch} is not supported"
    if not ok:
        return f"{describe(fd)} does not convert to {ch}"
    return None


@dataclass
class Converted:
    """Column values for clickhouse-driver, and the rows that did not convert.

    ``values`` is a list (:func:`convert_column`) or, from :func:`convert_array` where
    a vectorised rule applies, a numpy array or a column of
    :mod:`blockagg.rows.layout` (String, Enum, Array) whose ``tolist()``
    equals that list."""

    values: Any
    errors: dict[int, str]


def convert_column(ch: CHType, fd: FieldDescriptor, column: pa.Array) -> Converted:
    """Convert ``column`` (field ``fd`` decoded) to values of ClickHouse type ``ch``."""
    errors: dict[int, str] = {}
    values = _converter(ch, fd, is_repeated(fd))(column.to_pylist() if not _numeric_fast(
        ch, fd) else column, errors, None)
    return Converted(values, errors)


NUMPY_DTYPES: Final[dict[str, type[np.generic]]] = {
    "Int8": np.int8, "Int16": np.int16, "Int32": np.int32, "Int64": np.int64,
    "UInt8": np.uint8, "UInt16": np.uint16, "UInt32": np.uint32, "UInt64": np.uint64,
    "Float32": np.float32, "Float64": np.float64, "DateTime": np.uint32,
}
"""The numpy dtype of a vectorised column of these ClickHouse types (DateTime:
seconds since the epoch, as clickhouse-driver's numpy mode writes integers)."""

_VecConv = Callable[[pa.Array], tuple[Any, npt.NDArray[np.bool_]]]
"""A vectorised conversion: (values, bad rows). Values are a numpy array or one of
:mod:`blockagg.rows.layout`'s columns (String, Enum, Array)."""


def convert_array(ch: CHType, fd: FieldDescriptor, column: pa.Array) -> Converted:
    """:func:`convert_column` without a Python object per value where a vectorised
    rule exists: the values come back as a numpy array (typed: integers, floats,
    DateTime) or a column in Native layout (:mod:`blockagg.rows.layout`:
    String, Enum, Array) whose ``tolist()`` is exactly :func:`convert_column`'s list for every
    row that converts, and ``errors`` has exactly the same rows and reasons (a bad
    row's reason is computed by :func:`convert_column` on that row alone). Types and
    fields without a vectorised rule fall back to :func:`convert_column` (a list)."""
    vec = _vector_converter(ch, fd)
    nulls_ok = ch.name == "DateTime" and _msg_name(fd) == TIMESTAMP
    if vec is None or (column.null_count and not nulls_ok):
        return convert_column(ch, fd, column)
    values, bad = vec(column)
    errors: dict[int, str] = {}
    for i in np.flatnonzero(bad).tolist():
        reasons = convert_column(ch, fd, column.slice(i, 1)).errors
        errors[i] = reasons.get(0) or f"{fd.name}: does not convert to {ch}"
    return Converted(values, errors)


def _vector_converter(ch: CHType, fd: FieldDescriptor) -> _VecConv | None:
    if _msg_name(fd) in _WRAPPERS:
        return None
    if is_repeated(fd):
        if ch.name != "Array" or _is_map(fd):
            return None
        element = _vector_scalar(ch.children[0], fd)
        if element is None:
            return None
        return _vector_array(element)
    if fd.has_presence and not (ch.name == "DateTime" and _msg_name(fd) == TIMESTAMP):
        return None
    return _vector_scalar(ch, fd)


def _vector_scalar(ch: CHType, fd: FieldDescriptor) -> _VecConv | None:
    """A vectorised converter of non-null values (or absent Timestamps), or None."""
    name, t = ch.name, fd.type
    if name in INT_RANGES and t in _INT_FIELDS:
        return _vector_ints(ch)
    if (name == "Float32" and t == _T.TYPE_FLOAT) or (
            name == "Float64" and t in (_T.TYPE_FLOAT, _T.TYPE_DOUBLE)):
        dtype = NUMPY_DTYPES[name]

        def floats(column: pa.Array) -> tuple[npt.NDArray[Any], npt.NDArray[np.bool_]]:
            arr = column.to_numpy(zero_copy_only=False).astype(dtype)
            return arr, np.zeros(len(arr), dtype=np.bool_)
        return floats
    if name == "String" and t in (_T.TYPE_STRING, _T.TYPE_BYTES):
        def strings(column: pa.Array) -> tuple[Any, npt.NDArray[np.bool_]]:
            return StringColumn.from_arrow(column), np.zeros(len(column), dtype=np.bool_)
        return strings
    if name == "DateTime" and not ch.args and (
            _msg_name(fd) == TIMESTAMP or (t in _INT_FIELDS and t != _T.TYPE_BOOL)):
        return _vector_datetime(_msg_name(fd) == TIMESTAMP)
    if name in ("Enum8", "Enum16") and t == _T.TYPE_ENUM and fd.enum_type is not None:
        by_number = fd.enum_type.values_by_number
        numbers = sorted(by_number)
        return _vector_lookup(np.asarray(numbers, dtype=np.int64),
                              [by_number[k].name if by_number[k].name in ch.enum else None
                               for k in numbers], ch)
    if name in ("Enum8", "Enum16") and t in _INT_FIELDS and t != _T.TYPE_BOOL:
        by_value: dict[int, str] = {}
        for nm, num in ch.enum.items():
            by_value.setdefault(num, nm)
        values = sorted(by_value)
        return _vector_lookup(np.asarray(values, dtype=np.int64),
                              [by_value[v] for v in values], ch)
    return None


def _out_of_range(arr: npt.NDArray[Any], lo: int, hi: int) -> npt.NDArray[np.bool_]:
    """``(arr < lo) | (arr > hi)`` without comparing against a bound the array's
    dtype cannot hold."""
    info = np.iinfo(arr.dtype)
    bad = np.zeros(arr.shape, dtype=np.bool_)
    if lo > info.min:
        bad |= arr < lo
    if hi < info.max:
        bad |= arr > hi
    return bad


def _vector_ints(ch: CHType) -> _VecConv:
    lo, hi = INT_RANGES[ch.name]
    dtype = NUMPY_DTYPES[ch.name]

    def ints(column: pa.Array) -> tuple[npt.NDArray[Any], npt.NDArray[np.bool_]]:
        arr = column.to_numpy(zero_copy_only=False)
        if arr.dtype == np.bool_:
            arr = arr.astype(np.int64)
        bad = _out_of_range(arr, lo, hi)
        if bad.any():
            arr = np.where(bad, 0, arr)
        return arr.astype(dtype), bad
    return ints


def _vector_datetime(timestamp: bool) -> _VecConv:
    def datetimes(column: pa.Array) -> tuple[npt.NDArray[Any], npt.NDArray[np.bool_]]:
        if timestamp:
            present = ~column.is_null().to_numpy(zero_copy_only=False)
            seconds = column.field("seconds").to_numpy(zero_copy_only=False)
            bad = present & _out_of_range(seconds, 0, 2**32 - 1)
            keep = present & ~bad
        else:
            seconds = column.to_numpy(zero_copy_only=False)
            bad = _out_of_range(seconds, 0, 2**32 - 1)
            keep = ~bad
        return np.where(keep, seconds, 0).astype(np.uint32), bad
    return datetimes


def _vector_lookup(keys: npt.NDArray[np.int64], names: list[str | None],
                   ch: CHType) -> _VecConv:
    """Integers to names of enum column ``ch`` through sorted ``keys``, as a
    :class:`~blockagg.rows.layout.EnumColumn`; a key without a name (None),
    or a number not in ``keys``, is a bad row."""
    table = (*names, None)
    numbers = np.array([ch.enum[n] if n is not None else 0 for n in table], dtype=np.int64)
    named = np.array([n is not None for n in table], dtype=np.bool_)

    def lookup(column: pa.Array) -> tuple[Any, npt.NDArray[np.bool_]]:
        arr = column.to_numpy(zero_copy_only=False).astype(np.int64)
        idx = np.searchsorted(keys, arr)
        idx[idx >= len(keys)] = len(keys)
        found = np.zeros(arr.shape, dtype=np.bool_)
        inside = idx < len(keys)
        found[inside] = keys[idx[inside]] == arr[inside]
        idx[~found] = len(keys)
        return EnumColumn(idx, table, numbers), ~named[idx]
    return lookup


def _vector_array(element: _VecConv) -> _VecConv:
    """Lists as a :class:`~blockagg.rows.layout.ListColumn`: the rows'
    offsets into the converted flat values (no Python list per row)."""
    def arrays(column: pa.Array) -> tuple[Any, npt.NDArray[np.bool_]]:
        n = len(column)
        offsets = column.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
        offsets = offsets - offsets[0]
        flat, flat_bad = element(column.flatten())
        bad = np.zeros(n, dtype=np.bool_)
        if flat_bad.any():
            owners = np.repeat(np.arange(n), np.diff(offsets))
            bad[owners[flat_bad]] = True
        return ListColumn(offsets, flat), bad
    return arrays


def _numeric_fast(ch: CHType, fd: FieldDescriptor) -> bool:
    base = ch.unwrap()
    return (not is_repeated(fd) and not fd.has_presence and base.name in INT_RANGES
            and fd.type in _INT_FIELDS) or (
        not is_repeated(fd) and not fd.has_presence
        and base.name in ("Float32", "Float64", "Bool") and fd.type != _T.TYPE_MESSAGE)


_Conv = Callable[[Any, dict[int, str], "list[int] | None"], list[Any]]


def _converter(ch: CHType, fd: FieldDescriptor, repeated: bool) -> _Conv:
    """A function (values, errors, owners) -> converted values. ``owners`` maps
    element positions to row numbers for nested values (None: identity)."""
    if ch.name in ("Nullable", "LowCardinality"):
        inner = _converter(ch.children[0], fd, repeated)
        if ch.name == "LowCardinality":
            return inner

        def nullable(values: Any, errors: dict[int, str], owners: list[int] | None
                     ) -> list[Any]:
            items = values if isinstance(values, list) else values.to_pylist()
            present = [i for i, v in enumerate(items) if v is not None]
            converted = inner([items[i] for i in present], errors,
                              [owners[i] if owners else i for i in present])
            out: list[Any] = [None] * len(items)
            for i, v in zip(present, converted, strict=True):
                out[i] = v
            return out
        return nullable
    if repeated and ch.name == "Array":
        element = _converter(ch.children[0], fd, False)

        def array(values: Any, errors: dict[int, str], owners: list[int] | None
                  ) -> list[Any]:
            flat: list[Any] = []
            flat_owner: list[int] = []
            for i, lst in enumerate(values):
                flat.extend(lst or ())
                flat_owner.extend([owners[i] if owners else i] * len(lst or ()))
            converted = element(flat, errors, flat_owner)
            out = []
            pos = 0
            for lst in values:
                k = len(lst or ())
                out.append(converted[pos:pos + k])
                pos += k
            return out
        return array
    if repeated and ch.name == "Map":
        entry = fd.message_type
        assert entry is not None
        key = _converter(ch.children[0], entry.fields_by_name["key"], False)
        value = _converter(ch.children[1], entry.fields_by_name["value"], False)

        def mapping(values: Any, errors: dict[int, str], owners: list[int] | None
                    ) -> list[Any]:
            out = []
            for i, entries in enumerate(values):
                row = owners[i] if owners else i
                ks = key([e["key"] for e in entries], errors, [row] * len(entries))
                vs = value([e["value"] for e in entries], errors, [row] * len(entries))
                out.append(dict(zip(ks, vs, strict=True)))
            return out
        return mapping
    return _scalar_converter(ch, fd)


def _scalar_converter(ch: CHType, fd: FieldDescriptor) -> _Conv:
    name = ch.name
    msg = _msg_name(fd)
    if msg in _WRAPPERS:
        assert fd.message_type is not None
        inner = _scalar_converter(ch, fd.message_type.fields_by_name["value"])

        def unwrap(values: Any, errors: dict[int, str], owners: list[int] | None
                   ) -> list[Any]:
            items = values if isinstance(values, list) else values.to_pylist()
            return inner([None if v is None else v["value"] for v in items], errors, owners)
        return unwrap
    if name == "Tuple":
        assert fd.message_type is not None
        subs = [_converter(c, sub, is_repeated(sub))
                for c, sub in zip(ch.children, fd.message_type.fields, strict=True)]
        names = [sub.name for sub in fd.message_type.fields]
        sub_fields = list(fd.message_type.fields)

        def tuples(values: Any, errors: dict[int, str], owners: list[int] | None
                   ) -> list[Any]:
            items = values if isinstance(values, list) else values.to_pylist()
            cols = [conv([(v or {}).get(nm) if (v or {}).get(nm) is not None
                          else _default_of(sub) for v in items], errors, owners)
                    for conv, nm, sub in zip(subs, names, sub_fields, strict=True)]
            return [tuple(c[i] for c in cols) for i in range(len(items))]
        return tuples
    fn = _SCALARS.get(name)
    if fn is None:
        raise TypeParseError(f"column type {ch} is not supported")
    return fn(ch, fd)


def _default_of(fd: FieldDescriptor) -> Any:
    if is_repeated(fd):
        return []
    if fd.type == _T.TYPE_MESSAGE:
        return None
    return fd.default_value


def _fail(errors: dict[int, str], owners: list[int] | None, i: int, reason: str) -> None:
    errors.setdefault(owners[i] if owners else i, reason)


def _ints(ch: CHType, fd: FieldDescriptor) -> _Conv:
    lo, hi = INT_RANGES[ch.name]

    def conv(values: Any, errors: dict[int, str], owners: list[int] | None) -> list[Any]:
        if isinstance(values, pa.Array):
            arr = values.to_numpy(zero_copy_only=False)
            if arr.dtype == np.bool_:
                arr = arr.astype(np.int64)
            if arr.size and (int(arr.min()) < lo or int(arr.max()) > hi):
                for i in np.flatnonzero((arr < lo) | (arr > hi)).tolist():
                    _fail(errors, owners, i, f"{fd.name}={arr[i]} is out of range for {ch}")
                arr = np.where((arr < lo) | (arr > hi), 0, arr)
            return list(arr.tolist())
        out = []
        for i, v in enumerate(values):
            v = int(v)
            if not lo <= v <= hi:
                _fail(errors, owners, i, f"{fd.name}={v} is out of range for {ch}")
                v = 0
            out.append(v)
        return out
    return conv


def _plain(ch: CHType, fd: FieldDescriptor) -> _Conv:
    def conv(values: Any, errors: dict[int, str], owners: list[int] | None) -> list[Any]:
        if isinstance(values, pa.Array):
            return list(values.to_pylist())
        return list(values)
    return conv


def _per_value(fn: Callable[[Any], Any]) -> Callable[[CHType, FieldDescriptor], _Conv]:
    """A converter from a per-value function that raises ValueError on bad input."""
    def make(ch: CHType, fd: FieldDescriptor) -> _Conv:
        def conv(values: Any, errors: dict[int, str], owners: list[int] | None
                 ) -> list[Any]:
            items = values if isinstance(values, list) else values.to_pylist()
            out = []
            for i, v in enumerate(items):
                if v is None:
                    # An absent message field (Timestamp, wrapper) into a column that
                    # is not Nullable: the column's zero value, as proto3 reads it.
                    out.append(zero_value(ch))
                    continue
                try:
                    out.append(fn((ch, fd, v)))
                except (ValueError, TypeError, ArithmeticError) as exc:
                    _fail(errors, owners, i, f"{fd.name}={_show(v)} does not convert to {ch}: "
                          f"{exc}")
                    out.append(_ZERO.get(ch.name, 0))
            return out
        return conv
    return make


_ZERO: Final[dict[str, Any]] = {
    "String": "", "FixedString": b"", "UUID": uuid.UUID(int=0), "Date": _EPOCH_DATE,
    "IPv6": ipaddress.IPv6Address(0), "IPv4": 0, "Enum8": None, "Enum16": None,
    "Decimal": Decimal(0),
}


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _string(args: tuple[CHType, FieldDescriptor, Any]) -> Any:
    return args[2]


def _fixed_string(args: tuple[CHType, FieldDescriptor, Any]) -> Any:
    ch, _, v = args
    raw = v.encode() if isinstance(v, str) else v
    if len(raw) > int(ch.args[0]):
        raise ValueError(f"{len(raw)} bytes is longer than {ch.args[0]}")
    return raw


def _uuid(args: tuple[CHType, FieldDescriptor, Any]) -> Any:
    v = args[2]
    return uuid.UUID(bytes=v) if isinstance(v, bytes) else uuid.UUID(v)


def _ipv4(args: tuple[CHType, FieldDescriptor, Any]) -> Any:
    v = args[2]
    return int(v) if isinstance(v, int) else int(ipaddress.IPv4Address(v))


def _ipv6(args: tuple[CHType, FieldDescriptor, Any]) -> Any:
    v = args[2]
    return ipaddress.IPv6Address(v)


def _decimal(args: tuple[CHType, FieldDescriptor, Any]) -> Any:
    ch, _, v = args
    precision, scale = _decimal_precision_scale(ch)
    try:
        d = Decimal(v) if isinstance(v, str) else Decimal(int(v))
    except InvalidOperation:
        raise ValueError("not a decimal number") from None
    if not d.is_finite():
        raise ValueError("not a finite number")
    exponent = d.as_tuple().exponent
    assert isinstance(exponent, int)
    if -exponent > scale:
        raise ValueError(f"more than {scale} fraction digits")
    if d.adjusted() + 1 > precision - scale:
        raise ValueError(f"more than {precision - scale} integer digits")
    return d


def _decimal_precision_scale(ch: CHType) -> tuple[int, int]:
    widths = {"Decimal32": 9, "Decimal64": 18, "Decimal128": 38, "Decimal256": 76}
    if ch.name == "Decimal":
        return int(ch.args[0]), int(ch.args[1])
    return widths[ch.name], int(ch.args[0])


def _seconds_nanos(v: Any) -> tuple[int, int]:
    return int(v.get("seconds", 0)), int(v.get("nanos", 0))


def _date(args: tuple[CHType, FieldDescriptor, Any]) -> Any:
    _, _fd, v = args
    if isinstance(v, dict):
        seconds, _ = _seconds_nanos(v)
        day = _EPOCH_DATE + dt.timedelta(days=seconds // 86400)
    elif isinstance(v, str):
        day = dt.date.fromisoformat(v)
    else:
        day = _EPOCH_DATE + dt.timedelta(days=int(v))
    if not dt.date(1970, 1, 1) <= day <= dt.date(2149, 6, 6):
        raise ValueError("outside Date's range 1970-01-01..2149-06-06")
    return day


def _datetime(args: tuple[CHType, FieldDescriptor, Any]) -> Any:
    _, _, v = args
    seconds = _seconds_nanos(v)[0] if isinstance(v, dict) else int(v)
    if not 0 <= seconds <= 2**32 - 1:
        raise ValueError("outside DateTime's range 1970..2106")
    return seconds


def _datetime64(args: tuple[CHType, FieldDescriptor, Any]) -> Any:
    ch, _, v = args
    precision = int(ch.args[0]) if ch.args else 3
    if isinstance(v, dict):
        seconds, nanos = _seconds_nanos(v)
        return seconds * 10**precision + nanos // 10 ** (9 - precision)
    return int(v)


def _enum(args: tuple[CHType, FieldDescriptor, Any]) -> Any:
    ch, fd, v = args
    if fd.type == _T.TYPE_ENUM and isinstance(v, int):
        assert fd.enum_type is not None
        value = fd.enum_type.values_by_number.get(v)
        if value is None:
            raise ValueError(f"{v} is not a value of {fd.enum_type.full_name}")
        v = value.name
    if isinstance(v, str):
        if v not in ch.enum:
            raise ValueError(f"{v!r} is not one of the column's names")
        return v
    names = {num: nm for nm, num in ch.enum.items()}
    if int(v) not in names:
        raise ValueError(f"{v} is not one of the column's values")
    return names[int(v)]


_SCALARS: Final[dict[str, Callable[[CHType, FieldDescriptor], _Conv]]] = {
    **dict.fromkeys(INT_RANGES, _ints),
    "Float32": _plain, "Float64": _plain, "Bool": _plain, "String": _per_value(_string),
    "FixedString": _per_value(_fixed_string), "UUID": _per_value(_uuid),
    "IPv4": _per_value(_ipv4), "IPv6": _per_value(_ipv6), "Date": _per_value(_date),
    "DateTime": _per_value(_datetime), "DateTime64": _per_value(_datetime64),
    "Enum8": _per_value(_enum), "Enum16": _per_value(_enum),
    **dict.fromkeys(("Decimal", "Decimal32", "Decimal64", "Decimal128", "Decimal256"),
                    _per_value(_decimal)),
}


def message_fields(descriptor: Descriptor) -> dict[str, FieldDescriptor]:
    """The message's fields by name."""
    return {fd.name: fd for fd in descriptor.fields}


_INT_LITERAL: Final = re.compile(r"^-?\d+$")
_FLOAT_LITERAL: Final = re.compile(r"^-?(\d+\.\d*|\.\d+|\d+)([eE][-+]?\d+)?$")
_STRING_LITERAL: Final = re.compile(r"^'((?:[^'\\]|\\.)*)'$")
_CAST: Final = re.compile(r"^CAST\((.*), '[^']*'\)$", re.S)


def zero_value(ch: CHType) -> Any:
    """The value ClickHouse gives a column of type ``ch`` that an insert omits and
    that has no DEFAULT expression, in the form the native driver takes."""
    name = ch.name
    if name == "Nullable":
        return None
    if name == "LowCardinality":
        return zero_value(ch.children[0])
    if name.startswith(("Int", "UInt")) or name in ("DateTime", "DateTime64", "IPv4"):
        return 0
    if name.startswith("Float"):
        return 0.0
    if name == "Bool":
        return False
    if name == "String":
        return ""
    if name == "FixedString":
        return b""
    if name == "UUID":
        return uuid.UUID(int=0)
    if name in ("Date", "Date32"):
        return _EPOCH_DATE
    if name.startswith("Decimal"):
        return Decimal(0)
    if name.startswith("Enum"):
        return min(ch.enum.items(), key=lambda kv: kv[1])[0] if ch.enum else ""
    if name == "IPv6":
        return ipaddress.IPv6Address(0)
    if name == "Array":
        return []
    if name == "Map":
        return {}
    if name == "Tuple":
        return tuple(zero_value(c) for c in ch.children)
    raise TypeParseError(f"no default value known for type {ch}")


def default_value(ch: CHType, default_kind: str, expression: str) -> tuple[Any, bool]:
    """The value to insert for a column that a row does not carry, and whether it
    is exact: the literal of a constant ``DEFAULT`` expression (``7``, ``-1.5``,
    ``'x'``, ``CAST(7, 'Int64')``), else the type's :func:`zero_value` (exact when
    the column has no DEFAULT expression). A pure function of the column, so a
    retried block fills alike."""
    zero = zero_value(ch)
    if default_kind != "DEFAULT" or not expression:
        return zero, True
    text = expression.strip()
    cast = _CAST.match(text)
    if cast:
        text = cast.group(1).strip()
    base = ch.unwrap()
    if text.upper() == "NULL" and ch.nullable:
        return None, True
    try:
        if _STRING_LITERAL.match(text):
            raw = _STRING_LITERAL.match(text).group(1)  # type: ignore[union-attr]
            literal = raw.encode().decode("unicode_escape").encode("latin-1").decode()
            if base.name == "String":
                return literal, True
            if base.name == "FixedString":
                return literal.encode(), True
            if base.name.startswith("Enum") and literal in base.enum:
                return literal, True
            if base.name.startswith("Decimal"):
                return Decimal(literal), True
            if base.name == "UUID":
                return uuid.UUID(literal), True
            if base.name in ("Date", "Date32"):
                return dt.date.fromisoformat(literal), True
        elif _INT_LITERAL.match(text):
            if base.name.startswith(("Int", "UInt")) or base.name in ("DateTime", "DateTime64"):
                return int(text), True
            if base.name.startswith("Float"):
                return float(text), True
            if base.name.startswith("Decimal"):
                return Decimal(text), True
        elif _FLOAT_LITERAL.match(text):
            if base.name.startswith("Float"):
                return float(text), True
            if base.name.startswith("Decimal"):
                return Decimal(text), True
    except (ValueError, UnicodeError, InvalidOperation):
        pass
    return zero, False
