"""The columnar data path (numpy arrays, clickhouse-driver's numpy mode) sends the
very bytes the list path sends: ClickHouse 18.16 deduplicates a retried block by the
hash of its data, so a block must serialise identically whichever path (or writer
version) sends it."""

from __future__ import annotations

import socket
import threading
from typing import Any

import numpy as np
import pytest
from google.protobuf.descriptor import Descriptor

from blockagg.aggregator.clickhouse.blockdata import numpy_inserts_available
from blockagg.aggregator.clickhouse.native import NativeBlock
from blockagg.aggregator.clickhouse.writer import ClickHouseBlockWriter, Replica, WriterConfig
from blockagg.aggregator.core.model import Batch, Block, block_token
from blockagg.proto.descriptors import message_class
from blockagg.rows.columns import Column, Rows, decode_messages, make_plan
from blockagg.rows.layout import NATIVE_COLUMNS

pytestmark = pytest.mark.skipif(not numpy_inserts_available(),
                                reason="clickhouse-driver's numpy extras (pandas) missing")

COLUMNS = [
    Column("i64", "Int64"), Column("u64", "UInt64"), Column("u32", "UInt32"),
    Column("i32", "Int8"), Column("fl", "Float32"), Column("db", "Float64"),
    Column("text", "String"), Column("blob", "String"), Column("ts", "DateTime"),
    Column("color", "Enum8('COLOR_UNSPECIFIED' = 0, 'RED' = 1, 'GREEN' = 2)"),
    Column("packed_ints", "Array(Int64)"), Column("names", "Array(String)"),
    Column("doubles", "Array(Float64)"),
    Column("_topic", "String"), Column("_partition", "UInt32"), Column("_offset", "UInt64"),
]


class ServerInfo:
    def get_timezone(self) -> str:
        return "UTC"


def serialise(names: tuple[str, ...], columns: list[Any], numpy: bool) -> bytes:
    """The column data clickhouse-driver writes for a block, as sent on the wire."""
    from clickhouse_driver.bufferedwriter import BufferedSocketWriter
    from clickhouse_driver.columns.service import write_column
    from clickhouse_driver.context import Context

    types = {c.name: c.type for c in COLUMNS}
    ctx = Context()
    ctx.client_settings = {"use_numpy": numpy, "strings_as_bytes": False,
                           "strings_encoding": "utf-8", "input_format_null_as_default": False}
    ctx.settings = {}
    ctx.server_info = ServerInfo()
    a, b = socket.socketpair()
    received: list[bytes] = []

    def drain() -> None:
        while chunk := b.recv(1 << 16):
            received.append(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        out = BufferedSocketWriter(a, 1 << 16)
        for name, items in zip(names, columns, strict=True):
            write_column(ctx, name, types[name], items, out)
        out.flush()
    finally:
        a.shutdown(socket.SHUT_WR)
        a.close()
        reader.join(10)
        b.close()
    return b"".join(received)


def make_batch(sample: Descriptor, columnar: bool) -> tuple[Batch, Block]:
    cls: Any = message_class(sample)
    plan, _ = make_plan("db.t", 1, 1, sample, COLUMNS)
    messages = []
    for m in range(5):
        rows = []
        for i in range(m * 7, m * 7 + 3 + m):
            msg = cls(i64=-i * 10**12, u64=2**64 - 1 - i, u32=i, i32=i % 100 - 50,
                      fl=i / 3, db=i / 7, text=f"héllo {i}" * (i % 3),
                      blob=bytes([i % 256, 0xFF]), color=i % 3,
                      packed_ints=list(range(i % 4)), names=["x", ""][: i % 3],
                      doubles=[0.25] * (i % 2))
            if i % 5:
                msg.ts.seconds = 1_700_000_000 + i
            rows.append(msg.SerializeToString())
        messages.append(rows)
    payloads = decode_messages(plan, messages, columnar=columnar)
    assert all(isinstance(p, Rows) for p in payloads)
    counts = [p.count for p in payloads if isinstance(p, Rows)]
    n = len(payloads)
    batch = Batch("top", 3, 100, 100 + n, np.arange(100, 100 + n), np.ones(n, dtype=np.int64),
                  np.array(counts), np.full(n, 10), list(payloads), {1: "db.t"})
    positions = np.array([0, 1, 3, 4])  # message 2 is left to another block
    block = Block("top", 3, 1, "db.t", 100, 104, positions,
                  int(sum(counts[p] for p in positions)), 40,
                  block_token("top", 3, "db.t", 100, 104))
    return batch, block


def writer(**kw: Any) -> ClickHouseBlockWriter:
    return ClickHouseBlockWriter(WriterConfig(replicas=(Replica("h"),), **kw))


def test_numpy_block_serialises_like_the_list_block(sample: Descriptor) -> None:
    old_batch, old_block = make_batch(sample, columnar=False)
    new_batch, new_block = make_batch(sample, columnar=True)
    old = writer(use_numpy=False).block_data(old_block, old_batch)
    new = writer().block_data(new_block, new_batch)
    assert not old.numpy and new.numpy
    assert old.names == new.names == tuple(c.name for c in COLUMNS)
    assert all(isinstance(c, (np.ndarray, *NATIVE_COLUMNS)) for c in new.columns)
    assert [c.tolist() for c in new.columns] == old.columns
    wire = serialise(old.names, old.fresh(), numpy=False)
    assert serialise(new.names, new.fresh(), numpy=True) == wire
    # the Native layout, encoded by blockagg itself (NativeClient), twice
    native = new.fresh(native=True)
    assert isinstance(native, NativeBlock) and new.fresh(native=True) is native
    assert b"".join(native.encoded) == wire
    # the numpy block's lists (a client without numpy mode) and a second attempt too
    assert serialise(new.names, new.fresh(lists=True), numpy=False) == wire
    assert serialise(new.names, new.fresh(), numpy=True) == wire
    # block_columns keeps its list contract
    assert writer().block_columns(new_block, new_batch)[1] == old.columns


def test_lists_when_a_type_has_no_numpy_mode(sample: Descriptor) -> None:
    cls: Any = message_class(sample)
    plan, _ = make_plan("db.t", 1, 1, sample, [Column("i64", "Int64"),
                                                Column("maybe", "Nullable(Int64)")])
    payloads = decode_messages(plan, [[cls(i64=1, maybe=2).SerializeToString()]])
    batch = Batch("top", 0, 0, 1, np.array([0]), np.array([1]), np.array([1]),
                  np.array([1]), list(payloads), {1: "db.t"})
    block = Block("top", 0, 1, "db.t", 0, 0, np.array([0]), 1, 1,
                  block_token("top", 0, "db.t", 0, 0))
    data = writer().block_data(block, batch)
    assert not data.numpy and data.columns == [[1], [2]]


def test_non_driver_client_gets_lists(sample: Descriptor) -> None:
    batch, block = make_batch(sample, columnar=True)
    sent: list[tuple[Any, Any]] = []

    class Fake:
        def execute(self, query: str, params: Any = None, *, columnar: bool = False,
                    settings: dict[str, Any] | None = None, **kwargs: Any) -> Any:
            if query.startswith("INSERT"):
                sent.append((params, settings))
                return None
            return [("18.16.1",)]

        def disconnect(self) -> None:
            pass

    ClickHouseBlockWriter(WriterConfig(replicas=(Replica("h"),)),
                          lambda r: Fake()).insert(block, batch)
    params, settings = sent[0]
    assert all(isinstance(c, list) for c in params)
    assert settings is not None and "use_numpy" not in settings
    assert params == writer(use_numpy=False).block_columns(block, batch)[1]
