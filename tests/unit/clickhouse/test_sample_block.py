"""The server's blocks read by blockagg's reader are the blocks clickhouse-driver's own
reader gives, for the bytes the driver's writer frames: a sample block (no rows), a
block with rows, an empty block, on revisions with and without the
custom-serialisation byte."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from blockagg.aggregator.clickhouse.sample_block import uses_fast_reader

from .test_native import ENUM8, _context, captured

REVISIONS = (54406, 54454, 54467)  # 18.16; the first with custom serialisation; newer

BLOCKS: list[tuple[list[tuple[str, str]], list[list[Any]]]] = [
    ([("id", "UInt64"), ("name", "String"), ("kind", ENUM8), ("tags", "Array(Int64)"),
      ("é", "Nullable(String)")], [[]] * 5),
    ([("id", "UInt64"), ("name", "String"), ("tags", "Array(Int64)")],
     [[1, 2, 3], ["x", "", "yé"], [[1, -2], [], [3]]]),
    ([], []),
    ([(f"column_{i}", "Array(Nullable(String))") for i in range(300)], [[]] * 300),
]


def _framed(ctx: Any, specs: list[tuple[str, str]], values: list[list[Any]]) -> bytes:
    from clickhouse_driver.block import ColumnOrientedBlock
    from clickhouse_driver.streams.native import BlockOutputStream

    return captured(lambda out: BlockOutputStream(out, ctx).write(
        ColumnOrientedBlock(specs, [list(v) for v in values])))


def _read_twice(ctx: Any, data: bytes) -> tuple[Any, Any, bytes]:
    """``data`` twice over one socket: read by the driver's reader, then by
    blockagg's; what is left after both."""
    from clickhouse_driver.bufferedreader import BufferedSocketReader
    from clickhouse_driver.streams.native import BlockInputStream

    a, b = socket.socketpair()
    try:
        a.sendall(data + data + b"\x2a")
        a.shutdown(socket.SHUT_WR)
        fin = BufferedSocketReader(b, 256)  # names and types across its refills
        connection = _Connection(BlockInputStream(fin, ctx))
        theirs = connection.block_in.read()
        assert uses_fast_reader(connection)
        ours = connection.block_in.read()
        return theirs, ours, fin.read(1)
    finally:
        a.close()
        b.close()


class _Connection:
    compression = False

    def __init__(self, block_in: Any) -> None:
        self.block_in = block_in


@pytest.mark.parametrize("revision", REVISIONS)
@pytest.mark.parametrize("case", range(len(BLOCKS)))
def test_blocks_read_as_the_driver_reads_them(revision: int, case: int) -> None:
    specs, values = BLOCKS[case]
    ctx = _context()
    ctx.server_info.used_revision = revision
    theirs, ours, rest = _read_twice(ctx, _framed(ctx, specs, values))
    assert ours.columns_with_types == theirs.columns_with_types == specs
    assert ours.get_columns() == theirs.get_columns()
    assert ours.num_rows == theirs.num_rows == (len(values[0]) if values else 0)
    assert type(ours) is type(theirs)
    assert rest == b"\x2a"  # each read ends where its block ends


def test_a_compressed_connection_keeps_the_drivers_reader() -> None:
    class Compressed(_Connection):
        compression = True

    connection = Compressed(object())
    reader = connection.block_in
    assert not uses_fast_reader(connection)
    assert connection.block_in is reader


@pytest.mark.parametrize("revision", REVISIONS)
def test_a_name_that_is_not_utf8_fails_as_in_the_driver(revision: int) -> None:
    """The compiled reader gives ``bytes`` for a string that is not UTF-8; the
    driver's reader raises, and so does blockagg's."""
    ctx = _context()
    ctx.server_info.used_revision = revision
    data = _framed(ctx, [("id", "UInt64")], [[]]).replace(b"\x02id", b"\x02\xff\xfe")
    with pytest.raises(UnicodeDecodeError):
        _read_twice(ctx, data)  # the driver's read, first
    with pytest.raises(UnicodeDecodeError):
        _read_fast_only(ctx, data)


def _read_fast_only(ctx: Any, data: bytes) -> Any:
    from clickhouse_driver.bufferedreader import BufferedSocketReader
    from clickhouse_driver.streams.native import BlockInputStream

    a, b = socket.socketpair()
    try:
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        connection = _Connection(BlockInputStream(BufferedSocketReader(b, 256), ctx))
        assert uses_fast_reader(connection)
        return connection.block_in.read()
    finally:
        a.close()
        b.close()
