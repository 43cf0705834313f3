"""Reading the blocks a server sends on an uncompressed connection, with a block of no
rows read in one compiled call.

Every insert's answer starts with a *sample block*: the table's columns, names and
types, and no rows. clickhouse-driver reads each name and each type with its own
Python call (two per column, per insert). :func:`uses_fast_reader` puts in the
driver's reader with one change:
the names and types of a block without rows are read by the driver's compiled
``read_strings``. A block with rows is read column by column as the driver reads it.
Both give the driver's :class:`~clickhouse_driver.block.ColumnOrientedBlock` with the
same columns (``tests/unit/clickhouse/test_sample_block.py`` compares them on the
driver's own bytes, on revisions with and without the custom-serialisation byte).
"""

from __future__ import annotations

import functools
from typing import Any


def uses_fast_reader(connection: Any) -> bool:
    """Whether ``connection`` reads blocks with this module's reader; puts it in place
    of the driver's plain one (each connect makes a new one) when it can: not on a
    compressed connection, whose reader is another class."""
    from clickhouse_driver.streams.native import BlockInputStream

    reader = connection.block_in
    cls = _stream_class()
    if type(reader) is cls:
        return True
    if type(reader) is not BlockInputStream or connection.compression:
        return False
    connection.block_in = cls(reader.fin, reader.context)
    return True


def _text(items: tuple[str | bytes, ...]) -> tuple[str, ...]:
    """``read_strings``' items, which are ``bytes`` where not UTF-8: raised as the
    driver's own reader raises them (``UnicodeDecodeError``)."""
    if all(type(item) is str for item in items):
        return items  # type: ignore[return-value]
    return tuple(item if isinstance(item, str) else item.decode("utf-8") for item in items)


@functools.cache
def _stream_class() -> type[Any]:
    from clickhouse_driver import defines
    from clickhouse_driver.block import BlockInfo, ColumnOrientedBlock
    from clickhouse_driver.columns.service import read_column
    from clickhouse_driver.reader import read_binary_str, read_binary_uint8
    from clickhouse_driver.streams.native import BlockInputStream
    from clickhouse_driver.varint import read_varint

    class SampleBlockInputStream(BlockInputStream):  # type: ignore[misc]
        def read(self, use_numpy: bool | None = None) -> Any:
            fin = self.fin
            revision = self.context.server_info.used_revision
            info = BlockInfo()
            if revision >= defines.DBMS_MIN_REVISION_WITH_BLOCK_INFO:
                info.read(fin)
            n_columns = read_varint(fin)
            n_rows = read_varint(fin)
            custom = revision >= defines.DBMS_MIN_REVISION_WITH_CUSTOM_SERIALIZATION
            if self.context.client_settings["use_numpy"]:
                from clickhouse_driver.numpy.block import NumpyColumnOrientedBlock
                block_cls: Any = NumpyColumnOrientedBlock
            else:
                block_cls = ColumnOrientedBlock
            names: list[str] = []
            types: list[str] = []
            data: list[Any] = []
            if not n_rows and not custom:
                pairs = _text(fin.read_strings(2 * n_columns, encoding="utf-8"))
                names, types = list(pairs[0::2]), list(pairs[1::2])
            for _ in range(n_columns if n_rows or custom else 0):
                if not n_rows:
                    name, type_ = _text(fin.read_strings(2, encoding="utf-8"))
                else:
                    name, type_ = read_binary_str(fin), read_binary_str(fin)
                names.append(name)
                types.append(type_)
                has_custom = bool(read_binary_uint8(fin)) if custom else False
                if n_rows:
                    data.append(read_column(self.context, type_, n_rows, fin,
                                            use_numpy=use_numpy,
                                            has_custom_serialization=has_custom))
            return block_cls(columns_with_types=list(zip(names, types, strict=True)),
                             data=data, info=info)

    return SampleBlockInputStream
