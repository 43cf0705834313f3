"""The columnar path against the real 18.16 replicas: a block sent by the old list
path, by clickhouse-driver's numpy mode, and by blockagg's own Native serialisation
(NativeClient, the default) is deduplicated whichever sends it first (same data
hash), and the stored rows are the converted values."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from clickhouse_driver import Client as DriverClient

from blockagg.aggregator.clickhouse.blockdata import numpy_inserts_available
from blockagg.aggregator.clickhouse.native import NativeBlock, native_client_class
from blockagg.aggregator.clickhouse.writer import ClickHouseBlockWriter, Replica, WriterConfig
from blockagg.aggregator.core.model import Batch, Block, block_token
from blockagg.proto.descriptors import load_descriptor, message_class
from blockagg.proto.envelope import make_envelope
from blockagg.proto.registry import MemoryStore, Registry
from blockagg.registration.register import register
from blockagg.rows.layout import EnumColumn, StringColumn
from blockagg.rows.prepare import Message, Plans, prepare
from blockagg.rows.types import parse_type
from tests.faults.workload import COLUMNS, COORDINATES, ROW_MESSAGE, row_descriptor_set
from tests.integration.conftest import replicated_engine

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not numpy_inserts_available(),
                                 reason="clickhouse-driver's numpy extras (pandas) missing")]


def writer_for(env: dict[str, str], **kw: Any) -> ClickHouseBlockWriter:
    host = env["BLOCKAGG_CH_HOST"]
    replicas = tuple(Replica(host, int(p)) for p in env["BLOCKAGG_CH_PORTS"].split(","))
    return ClickHouseBlockWriter(WriterConfig(replicas=replicas, **kw), sleep=lambda s: None)


def test_old_and_new_path_blocks_deduplicate(stack_env: dict[str, str],
                                             ch_replicas: list[Any], ch_database: str) -> None:
    table = f"{ch_database}.events"
    for c in ch_replicas:
        c.execute(f"CREATE TABLE {table} ({COLUMNS}, {COORDINATES}) ENGINE = "
                  f"{replicated_engine(ch_database, 'events')}")
    fds = row_descriptor_set()
    cls: Any = message_class(load_descriptor(fds, ROW_MESSAGE))
    rows = []
    for i in range(1, 301):
        m = cls(id=i, user=-i, delta=i * 10**12, price=i / 7, score=i / 3,
                name=f"n{i}é" * (i % 3), country=["DE", ""][i % 2], kind=i % 4,
                tags=list(range(i % 4)))
        m.time.seconds = 1_700_000_000 + i
        rows.append(m.SerializeToString())
    store = MemoryStore()
    register(store, table, ROW_MESSAGE, fds)
    old = writer_for(stack_env, use_numpy=False)
    new = writer_for(stack_env)
    host = stack_env["BLOCKAGG_CH_HOST"]
    numpy_mode = ClickHouseBlockWriter(
        WriterConfig(replicas=tuple(Replica(host, int(p))
                                    for p in stack_env["BLOCKAGG_CH_PORTS"].split(","))),
        lambda r: DriverClient(r.host, port=r.port), sleep=lambda s: None)
    plans = Plans(Registry.load(store), lambda t: new.describe(t).columns)
    msgs = [Message(500 + k, 1_700_000_000_000, make_envelope(table, rows[i:i + 10], 1))
            for k, i in enumerate(range(0, 300, 10))]

    def block(columnar: bool, part: slice) -> tuple[Block, Batch]:
        prepared = prepare("topic", 2, msgs[part], plans, columnar=columnar)
        assert prepared.dead_letters == 0
        first, last = int(prepared.offsets[0]), int(prepared.offsets[-1])
        batch = Batch("topic", 2, first, last + 1, prepared.offsets, prepared.table_ids,
                      prepared.row_counts, prepared.sizes, prepared.payloads,
                      prepared.tables)
        positions = np.arange(len(prepared.offsets))
        return Block("topic", 2, int(prepared.table_ids[0]), table, first, last, positions,
                     int(prepared.row_counts.sum()), 0,
                     block_token("topic", 2, table, first, last)), batch

    b1, batch1 = block(False, slice(0, 15))
    b2, batch2 = block(True, slice(0, 15))
    data = new.block_data(b2, batch2)
    native = data.fresh(native=True)
    assert data.numpy and isinstance(native, NativeBlock)
    live = {c.name: c.type for c in new.describe(table).columns}
    assert native.matches([(n, live[n]) for n in native.names])  # sent as encoded
    old.insert(b1, batch1)
    new.insert(b2, batch2)  # the same block by the new path: deduplicated
    numpy_mode.insert(b2, batch2)  # and by the driver's numpy mode
    b3, batch3 = block(True, slice(15, 30))
    new.insert(b3, batch3)
    b4, batch4 = block(False, slice(15, 30))
    old.insert(b4, batch4)  # and the other way round
    new.insert(b3, batch3)  # a retry of the new path
    for c in ch_replicas:
        c.execute(f"SYSTEM SYNC REPLICA {table}")
        assert c.execute(f"SELECT count(), uniqExact(id), min(_offset), max(_offset) "
                         f"FROM {table}") == [(300, 300, 500, 529)]
    got = ch_replicas[0].execute(
        f"SELECT id, user, delta, price, score, name, country, toUInt32(time), "
        f"toString(kind), tags, _topic, _partition FROM {table} WHERE id IN (7, 150) "
        "ORDER BY id")
    assert got == [
        (7, -7, 7 * 10**12, 7 / 7, np.float32(7 / 3).item(), "n7é", "", 1_700_000_007,
         "KIND_BUY", [0, 1, 2], "topic", 2),
        (150, -150, 150 * 10**12, 150 / 7, np.float32(150 / 3).item(), "", "DE",
         1_700_000_150, "KIND_CLICK", [0, 1], "topic", 2),
    ]
    for w in (old, new, numpy_mode):
        w.close()


def test_native_block_falls_back_when_the_table_differs(stack_env: dict[str, str],
                                                        ch_replicas: list[Any],
                                                        ch_database: str) -> None:
    """A NativeBlock encoded for other column types than the server's sample block
    (an ALTER since the plan) is serialised by clickhouse-driver from its arrays,
    with the server's types, as before NativeClient existed."""
    table = f"{ch_database}.native_fallback"
    ch_replicas[0].execute(f"CREATE TABLE {table} (id UInt64, s String, k Enum8('a' = 1)) "
                           "ENGINE = MergeTree ORDER BY id")
    client = native_client_class()(stack_env["BLOCKAGG_CH_HOST"],
                                   port=int(stack_env["BLOCKAGG_CH_PORTS"].split(",")[0]))
    for id_type in ("UInt64", "UInt32"):  # the second does not match: fallback
        block = NativeBlock(["id", "s", "k"], [parse_type(id_type), parse_type("String"),
                                               parse_type("Enum8('a' = 1)")],
                            [np.array([1, 2], dtype=np.uint64), StringColumn.repeat("x", 2),
                             EnumColumn(np.array([0, 0]), ("a",), np.array([1]))])
        assert block.matches([("id", "UInt64"), ("s", "String"),
                              ("k", "Enum8('a' = 1)")]) == (id_type == "UInt64")
        client.execute(f"INSERT INTO {table} (id, s, k) VALUES", block, columnar=True,
                       settings={"use_numpy": True})
    assert ch_replicas[0].execute(f"SELECT id, s, k FROM {table} ORDER BY id") == [
        (1, "x", "a"), (1, "x", "a"), (2, "x", "a"), (2, "x", "a")]
    client.disconnect()
