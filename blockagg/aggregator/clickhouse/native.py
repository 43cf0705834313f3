"""The insert that sends columns kept in ClickHouse's Native layout as they are.

The columns (numpy arrays, and the :mod:`blockagg.rows.layout` classes
:class:`~blockagg.rows.layout.StringColumn`, :class:`~blockagg.rows.layout.EnumColumn`
and :class:`~blockagg.rows.layout.ListColumn`) come from the rows stage; this adapter
joins a block's parts (:func:`concat`) and writes their bytes.

:func:`encode_column` serialises a column to the bytes clickhouse-driver writes for
the same values (``tests/unit/clickhouse/test_native.py`` compares them byte for byte
for every type here, against the driver's own serialisation), without a Python object
per value. :class:`NativeClient` is clickhouse-driver's client with one addition: an
insert whose data is a :class:`NativeBlock` is sent as those bytes, once the server's
sample block names the same columns with the same types; otherwise (another table
shape, compression) the driver serialises the block's arrays itself, as before. Either
way the server receives the same block, so its deduplication hash (18.16) is the same
on a first attempt, a retry and a replay, whichever path sent it.
"""

from __future__ import annotations

import functools
import importlib
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from blockagg.aggregator.clickhouse.exceptions import ClickHouseError
from blockagg.aggregator.clickhouse.query_packet import (
    QUERY_PACKET_TYPE,
    end_of_data_packet,
    insert_query_packet,
)
from blockagg.aggregator.clickhouse.sample_block import uses_fast_reader
from blockagg.rows.layout import (
    NATIVE_COLUMNS,
    EnumColumn,
    ListColumn,
    NativeValues,
    StringColumn,
)
from blockagg.rows.types import NUMPY_DTYPES, CHType, parse_type

_I64 = npt.NDArray[np.int64]


def concat(parts: Sequence[NativeValues]) -> NativeValues:
    """The rows of ``parts`` in order, as one column of the same kind."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if isinstance(first, np.ndarray):
        return np.concatenate(parts)  # type: ignore[arg-type]
    if isinstance(first, StringColumn):
        strings = [p for p in parts if isinstance(p, StringColumn)]
        data = np.concatenate([p.data[int(p.offsets[0]):int(p.offsets[-1])] for p in strings])
        return StringColumn(_joined_offsets([p.offsets for p in strings]), data, first.binary)
    if isinstance(first, EnumColumn):
        enums = [p for p in parts if isinstance(p, EnumColumn)]
        if any(p.names != first.names or not np.array_equal(p.numbers, first.numbers)
               for p in enums):
            raise ClickHouseError("enum columns of one block disagree on their names")
        return EnumColumn(np.concatenate([p.index for p in enums]), first.names,
                          first.numbers)
    lists = [p for p in parts if isinstance(p, ListColumn)]
    flat = concat([p._values() for p in lists])
    return ListColumn(_joined_offsets([p.offsets for p in lists]), flat)


def _joined_offsets(parts: Sequence[_I64]) -> _I64:
    """Offsets of consecutive parts rebased to start at 0 and follow each other."""
    out = [np.zeros(1, dtype=np.int64)]
    end = 0
    for offsets in parts:
        out.append(offsets[1:] - offsets[0] + end)
        end += int(offsets[-1] - offsets[0])
    return np.concatenate(out)


def native_type_ok(ch: CHType) -> bool:
    """Whether :func:`encode_column` writes a column of type ``ch``."""
    if ch.name == "Array":
        return native_type_ok(ch.children[0])
    if ch.name == "DateTime":
        return not ch.args
    return ch.name in NUMPY_DTYPES or ch.name in ("String", "Enum8", "Enum16")


def encode_column(ch: CHType, values: NativeValues) -> bytes:
    """The column's Native bytes, as clickhouse-driver writes them for these values
    (no state prefix: none of these types has one)."""
    if isinstance(values, ListColumn) and ch.name == "Array":
        return _list_native(values, ch)
    if isinstance(values, EnumColumn) and ch.name in ("Enum8", "Enum16"):
        return _enum_native(values, ch)
    if isinstance(values, StringColumn) and ch.name == "String":
        return _string_native(values)
    if isinstance(values, np.ndarray) and ch.name in NUMPY_DTYPES and values.dtype != object:
        if ch.name == "DateTime" and ch.args:
            raise ClickHouseError(f"no Native encoding of {ch} here")
        wire = _wire_dtype(ch.name)
        return (values if values.dtype == wire else values.astype(wire)).tobytes()
    raise ClickHouseError(f"no Native encoding of a {type(values).__name__} column as {ch}")


@functools.cache
def _wire_dtype(name: str) -> np.dtype[Any]:
    """The little-endian numpy type of a column of type ``name`` on the wire."""
    return np.dtype(NUMPY_DTYPES[name]).newbyteorder("<")


def _compiled_strings() -> ModuleType | None:
    """``_native.c``'s encoder where ``pip install`` built it (else numpy's, same bytes)."""
    try:
        return importlib.import_module("blockagg.aggregator.clickhouse._native")
    except ImportError:
        return None


_compiled = _compiled_strings()


def _string_native(column: StringColumn) -> bytes:
    """Per value: its length as a LEB128 varint, then its bytes."""
    if column.constant is not None:
        n = len(column.offsets) - 1
        return (_varint(len(column.constant)) + column.constant) * n if n > 0 else b""
    if _compiled is not None:
        encoded: bytes = _compiled.strings(np.ascontiguousarray(column.offsets, dtype=np.int64),
                                           np.ascontiguousarray(column.data, dtype=np.uint8))
        return encoded
    lengths = np.diff(column.offsets)
    n = len(lengths)
    if n == 0:
        return b""
    base, end = int(column.offsets[0]), int(column.offsets[-1])
    if int(lengths.max()) < 0x80:
        # One length byte per value (short strings, the usual case): each value's
        # length byte goes before its bytes, the bytes fill the rest in order.
        at = column.offsets[:-1] - base + np.arange(n, dtype=np.int64)
        out = np.empty(n + end - base, dtype=np.uint8)
        out[at] = lengths
        is_data = np.ones(out.size, dtype=np.bool_)
        is_data[at] = False
        out[is_data] = column.data[base:end]
        return out.tobytes()
    widths = np.ones(n, dtype=np.int64)
    for k in range(1, 10):
        longer = lengths >= (1 << (7 * k))
        if not longer.any():
            break
        widths += longer
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(widths[:-1] + lengths[:-1], out=starts[1:])
    total = int(starts[-1] + widths[-1] + lengths[-1])
    out = np.empty(total, dtype=np.uint8)
    is_data = np.ones(total, dtype=np.bool_)
    for k in range(int(widths.max())):
        rows = np.flatnonzero(widths > k)
        byte = (lengths[rows] >> (7 * k)) & 0x7F
        byte |= np.where(widths[rows] > k + 1, 0x80, 0)
        out[starts[rows] + k] = byte
        is_data[starts[rows] + k] = False
    out[is_data] = column.data[int(column.offsets[0]):int(column.offsets[-1])]
    return out.tobytes()

def _enum_native(column: EnumColumn, ch: CHType) -> bytes:
    dtype = "<i1" if ch.name == "Enum8" else "<i2"
    return column.numbers[column.index].astype(dtype).tobytes()

def _list_native(column: ListColumn, ch: CHType) -> bytes:
    ends: bytes = (column.offsets[1:] - column.offsets[0]).astype("<u8").tobytes()
    return ends + encode_column(ch.children[0], column._values())

def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _binary_str(text: str) -> bytes:
    raw = text.encode()
    return _varint(len(raw)) + raw


@functools.lru_cache(maxsize=4096)
def _column_headers(columns_with_types: tuple[tuple[str, str], ...], custom: bool
                    ) -> tuple[bytes, ...]:
    """Each column's header in a Data packet (name, type, and with ``custom`` the
    custom-serialisation byte): the same for every block of a table, so built once
    per (sample block, protocol) rather than once per insert."""
    return tuple(_binary_str(name) + _binary_str(spec) + (b"\x00" if custom else b"")
                 for name, spec in columns_with_types)


BLOCK_INFO: Final = b"\x01\x00\x02\xff\xff\xff\xff\x00"
"""clickhouse-driver's ``BlockInfo``: field 1 ``is_overflows`` 0, field 2
``bucket_num`` -1, end."""


@functools.lru_cache(maxsize=4096)
def _parsed(spec: str) -> CHType:
    return parse_type(spec)


_MATCHED: dict[tuple[tuple[str, str], ...], tuple[tuple[str, ...], tuple[CHType, ...]]] = {}
""":meth:`NativeBlock.matches`' last match per sample block."""

_MATCHED_KEPT: Final = 4096


class NativeBlock(tuple[NativeValues, ...]):
    """A block's columns for :class:`NativeClient`: a tuple (so clickhouse-driver's
    ``execute`` takes it as insert data) of the converted columns, with their names
    and types. The encoded bytes are computed once and reused by every attempt."""

    names: tuple[str, ...]
    types: tuple[CHType, ...]
    rows: int

    def __new__(cls, names: Sequence[str], types: Sequence[CHType],
                columns: Sequence[NativeValues]) -> NativeBlock:
        block = super().__new__(cls, columns)
        block.names = tuple(names)
        block.types = tuple(types)
        block.rows = len(columns[0]) if columns else 0
        return block

    @functools.cached_property
    def encoded(self) -> tuple[bytes, ...]:
        return tuple(encode_column(ch, values)
                     for ch, values in zip(self.types, self, strict=True))

    def matches(self, columns_with_types: Sequence[tuple[str, str]]) -> bool:
        """Whether the server's sample block has exactly these columns and types.

        The last (names, types) that matched a sample block are kept with it (held,
        so compared by identity safely): the blocks of one table share their plan's
        tuples, so the type-by-type comparison runs once per table and plan."""
        spec = tuple(columns_with_types)
        kept = _MATCHED.get(spec)
        if kept is not None and kept[0] is self.names and kept[1] is self.types:
            return True
        ok = (tuple(n for n, _ in spec) == self.names
              and all(_parsed(t) == ch for (_, t), ch in zip(spec, self.types, strict=True)))
        if ok:
            if len(_MATCHED) >= _MATCHED_KEPT:
                _MATCHED.clear()
            _MATCHED[spec] = (self.names, self.types)
        return ok

    def packet_body(self, columns_with_types: Sequence[tuple[str, str]],
                    revision: int) -> bytes:
        """The Data packet's block, as clickhouse-driver's ``BlockOutputStream``
        frames it for a server of protocol ``revision``."""
        return b"".join(self.packet_parts(columns_with_types, revision))

    def packet_parts(self, columns_with_types: Sequence[tuple[str, str]],
                     revision: int) -> list[bytes]:
        """:meth:`packet_body` in pieces, written one after another (the columns'
        bytes are not copied into one body first)."""
        from clickhouse_driver import defines

        parts = [BLOCK_INFO] if revision >= defines.DBMS_MIN_REVISION_WITH_BLOCK_INFO else []
        parts.append(_varint(len(self.names)) + _varint(self.rows))
        custom = revision >= defines.DBMS_MIN_REVISION_WITH_CUSTOM_SERIALIZATION
        headers = _column_headers(tuple((n, t) for n, t in columns_with_types), custom)
        for header, data in zip(headers, self.encoded, strict=True):
            parts.append(header)
            parts.append(data)
        return parts

    def driver_columns(self) -> list[Any]:
        """The same columns as clickhouse-driver's numpy mode takes them."""
        return [c.driver_items() if isinstance(c, NATIVE_COLUMNS) else c.copy() for c in self]


def native_client_class() -> type[Any]:
    """:class:`NativeClient` (defined on first use: clickhouse-driver is imported
    lazily, like everywhere in this package)."""
    return _native_client()


@functools.cache
def _native_client() -> type[Any]:
    from clickhouse_driver import Client, defines
    from clickhouse_driver.block import ColumnOrientedBlock
    from clickhouse_driver.protocol import ClientPacketTypes
    from clickhouse_driver.varint import write_varint
    from clickhouse_driver.writer import write_binary_str

    class NativeClient(Client):  # type: ignore[misc]
        """clickhouse-driver's client; insert data given as a :class:`NativeBlock`
        goes out as its encoded bytes, and an insert's query packet as bytes cached
        per connection (see the module doc)."""

        def process_insert_query(self, query_without_data: str, data: Any,
                                 external_tables: Any = None, query_id: str | None = None,
                                 types_check: bool = False, columnar: bool = False) -> Any:
            """The driver's insert (query, sample block, data, end), the query packet
            from :meth:`send_insert_query`."""
            connection = self.connection
            if external_tables or connection.compression:
                return super().process_insert_query(
                    query_without_data, data, external_tables=external_tables,
                    query_id=query_id, types_check=types_check, columnar=columnar)
            self.send_insert_query(query_without_data, query_id)
            uses_fast_reader(connection)
            sample_block = self.receive_sample_block()
            if sample_block:
                rv = self.send_data(sample_block, data, types_check=types_check,
                                    columnar=columnar)
                self.receive_end_of_insert_query()
                return rv
            return None

        def send_insert_query(self, query: str, query_id: str | None) -> None:
            """What the driver's ``send_query`` and ``send_external_tables`` (none)
            write for this insert, from :func:`insert_query_packet`'s cached pieces:
            the query id, the query text (and, on servers that take one, the query's
            start time) are written afresh."""
            connection = self.connection
            if not connection.connected:
                connection.connect()
            packet = insert_query_packet(connection)
            if packet is None:
                connection.send_query(query, query_id=query_id)
                connection.send_external_tables(None)
                return
            fout = connection.fout
            fout.write(QUERY_PACKET_TYPE)
            write_binary_str(query_id or "", fout)
            if packet.info is not None:
                packet.info.initial_query_start_time_microseconds = int(time.time() * 1e6)
                packet.info.write(connection.server_info.used_revision, fout)
            fout.write(packet.before_query(connection.context.settings))
            write_binary_str(query, fout)
            fout.write(packet.after_query)
            fout.flush()

        def send_data(self, sample_block: Any, data: Any, types_check: bool = False,
                      columnar: bool = False) -> int:
            if not isinstance(data, NativeBlock):
                return int(super().send_data(sample_block, data, types_check, columnar))
            connection = self.connection
            spec = sample_block.columns_with_types
            if connection.compression or not data.matches(spec):
                return int(super().send_data(sample_block, data.driver_columns(),
                                             types_check, True))
            revision = connection.server_info.used_revision
            parts = data.packet_parts(spec, revision)
            write_varint(ClientPacketTypes.DATA, connection.fout)
            if revision >= defines.DBMS_MIN_REVISION_WITH_TEMPORARY_TABLES:
                write_binary_str("", connection.fout)
            for part in parts:
                connection.fout.write(part)
            if revision < defines.DBMS_MIN_PROTOCOL_VERSION_WITH_PROFILE_EVENTS_IN_INSERT:
                # No answer between the block and the end of data: both go in one
                # write, the end as the driver's own bytes for it.
                connection.fout.write(end_of_data_packet(connection))
                connection.fout.flush()
                return data.rows
            connection.fout.flush()
            self.receive_profile_events()
            connection.send_data(ColumnOrientedBlock())
            self.receive_profile_events()
            return data.rows

    return NativeClient
