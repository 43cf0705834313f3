"""Typed columns in ClickHouse's Native layout, as the rows stage hands them on.

The converted columns of a block (:func:`blockagg.rows.types.convert_array`) are numpy
arrays for numbers and ``DateTime``, and, for the types whose Native layout is not one
fixed-width array, the classes here, which hold that layout:

* :class:`StringColumn`: byte offsets into one buffer of UTF-8 (or raw) bytes, as
  Arrow holds them. Native: per value a varint length, then the bytes.
* :class:`EnumColumn`: per row an index into the column's names. Native: the
  names' numbers as ``Int8``/``Int16``.
* :class:`ListColumn` (``Array(T)``): row offsets into one flat column of ``T``.
  Native: the rows' end offsets as ``UInt64``, then the flat values.

Each has ``tolist()`` giving exactly the values the per-value path
(:func:`~blockagg.rows.types.convert_column`) gives, ``driver_items()`` giving what
clickhouse-driver's numpy mode takes, and slicing. Pure data: the bytes the adapter
sends are written by :func:`blockagg.aggregator.clickhouse.native.encode_column`, so
the stage never imports the adapter (the arrow runs adapter -> stage only).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final, Union

import numpy as np
import numpy.typing as npt
import pyarrow as pa

_I64 = npt.NDArray[np.int64]


@dataclass(frozen=True, eq=False)
class StringColumn:
    """Strings (``binary``: bytes values) as ``data[offsets[i]:offsets[i + 1]]``."""

    offsets: _I64
    data: npt.NDArray[np.uint8]
    binary: bool = False
    constant: bytes | None = None
    """Every value's bytes when the column repeats one value (:meth:`repeat`)."""

    @classmethod
    def from_arrow(cls, column: pa.Array) -> StringColumn:
        """The values of an Arrow ``string``/``binary`` array without nulls (no copy
        of the bytes)."""
        if column.null_count:
            raise ValueError("StringColumn holds no nulls")
        wide = pa.types.is_large_string(column.type) or pa.types.is_large_binary(column.type)
        _, offsets_buf, data_buf = column.buffers()
        n = len(column)
        raw = np.frombuffer(offsets_buf, dtype=np.int64 if wide else np.int32)
        offsets = raw[column.offset:column.offset + n + 1].astype(np.int64)
        data = (np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None
                else np.zeros(0, dtype=np.uint8))
        binary = pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)
        return cls(offsets, data, binary)

    @classmethod
    def repeat(cls, value: str, n: int) -> StringColumn:
        """``value``, ``n`` times."""
        encoded = value.encode()
        width = len(encoded)
        # One arange and one bytes repetition (np.tile and a multiplied arange cost
        # 4x as much, once per block for the ``_topic`` column).
        offsets = (np.arange(0, (n + 1) * width, width, dtype=np.int64) if width
                   else np.zeros(n + 1, dtype=np.int64))
        return cls(offsets, np.frombuffer(encoded * n, dtype=np.uint8), constant=encoded)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __iter__(self) -> Iterator[Any]:
        return iter(self.tolist())

    def __getitem__(self, rows: slice) -> StringColumn:
        start, stop, step = rows.indices(len(self))
        if step != 1:
            raise ValueError("StringColumn slices are contiguous")
        return StringColumn(self.offsets[start:max(start, stop) + 1], self.data, self.binary,
                            self.constant)

    def tolist(self) -> list[Any]:
        raw = self.data.tobytes()
        o = self.offsets.tolist()
        if self.binary:
            return [raw[o[i]:o[i + 1]] for i in range(len(o) - 1)]
        return [raw[o[i]:o[i + 1]].decode() for i in range(len(o) - 1)]

    def driver_items(self) -> npt.NDArray[Any]:
        return _objects(self.tolist())



@dataclass(frozen=True, eq=False)
class EnumColumn:
    """Enum values as indexes into ``names`` (``None``: a value without a name, on a
    row that is a dead letter and never inserted) and ``numbers`` (the column's
    number for each name)."""

    index: npt.NDArray[np.intp]
    names: tuple[str | None, ...]
    numbers: npt.NDArray[np.int64]

    def __len__(self) -> int:
        return len(self.index)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.tolist())

    def __getitem__(self, rows: slice) -> EnumColumn:
        return EnumColumn(self.index[rows], self.names, self.numbers)

    def tolist(self) -> list[Any]:
        return list(_objects(list(self.names))[self.index].tolist())

    def driver_items(self) -> npt.NDArray[Any]:
        return _objects(list(self.names))[self.index]



Flat = Union[npt.NDArray[Any], StringColumn, EnumColumn, "ListColumn"]


@dataclass(frozen=True, eq=False)
class ListColumn:
    """``Array(T)`` rows: row ``i`` is ``flat[offsets[i]:offsets[i + 1]]``."""

    offsets: _I64
    flat: Flat

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __iter__(self) -> Iterator[Any]:
        return iter(self.tolist())

    def __getitem__(self, rows: slice) -> ListColumn:
        start, stop, step = rows.indices(len(self))
        if step != 1:
            raise ValueError("ListColumn slices are contiguous")
        return ListColumn(self.offsets[start:max(start, stop) + 1], self.flat)

    def _values(self) -> Flat:
        return self.flat[int(self.offsets[0]):int(self.offsets[-1])]

    def tolist(self) -> list[Any]:
        values = self._values().tolist()
        bounds = (self.offsets - self.offsets[0]).tolist()
        return [values[bounds[i]:bounds[i + 1]] for i in range(len(bounds) - 1)]

    def driver_items(self) -> npt.NDArray[Any]:
        return _objects(self.tolist())



NativeValues = npt.NDArray[Any] | StringColumn | EnumColumn | ListColumn
NATIVE_COLUMNS: Final = (StringColumn, EnumColumn, ListColumn)


def _objects(items: list[Any]) -> npt.NDArray[Any]:
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out
