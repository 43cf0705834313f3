"""The writer's data path, old vs new, in one run: ``python -m bench.bench_writer``.

For the same kind of blocks (``bench/row.proto``'s 10-field ``Event``, 10 rows per
message, plus the ``_topic``/``_partition``/``_offset`` columns the writer fills, into
a ``ReplicatedMergeTree`` on the local stack's two 18.16 replicas), times

* **prepare**: :func:`blockagg.rows.prepare.prepare` of the block's messages
  (envelope parsing, decode, conversion for clickhouse-driver), and
* **insert**: :meth:`aggregator.clickhouse.writer.ClickHouseBlockWriter.insert`
  (block assembly, clickhouse-driver serialisation, network, server, ack),

for the **old** path (``prepare(..., columnar=False)``: per-value converters into
Python lists, and ``WriterConfig(use_numpy=False)``: clickhouse-driver's list columns)
and the **new** one (vectorised conversions into numpy arrays, clickhouse-driver's
numpy mode), alternating old/new block by block so both see the same load. Each
block holds new ids (nothing is deduplicated). Before timing, one block is inserted
by the old path and then by the new one: the second must be dropped by 18.16's
block deduplication, i.e. both paths send identical data.

Client CPU is this process's (``time.process_time``); wall includes the servers'
share of the insert. Run against the stack the environment points at
(``eval "$(scripts/stack env)"``, default the local stack).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from bench.workload import POOL, Rows, stack_env
from blockagg.aggregator.clickhouse.writer import ClickHouseBlockWriter, Replica, WriterConfig
from blockagg.aggregator.core.model import Batch, Block, block_token
from blockagg.proto.envelope import make_envelope
from blockagg.proto.registry import MemoryStore, Registry
from blockagg.registration.register import register
from blockagg.rows.prepare import Message, Plans, prepare
from tests.faults.workload import COLUMNS, COORDINATES, ROW_MESSAGE, row_descriptor_set, varint

TOPIC = "bench_writer"
ROWS_PER_MESSAGE = 10


@dataclass
class Tally:
    blocks: int = 0
    rows: int = 0
    prepare_wall: float = 0.0
    prepare_cpu: float = 0.0
    insert_wall: float = 0.0
    insert_cpu: float = 0.0
    samples: list[float] = field(default_factory=list)

    def add(self, rows: int, pw: float, pc: float, iw: float, ic: float) -> None:
        self.blocks += 1
        self.rows += rows
        self.prepare_wall += pw
        self.prepare_cpu += pc
        self.insert_wall += iw
        self.insert_cpu += ic
        self.samples.append(pw + iw)

    @property
    def wall(self) -> float:
        return self.prepare_wall + self.insert_wall

    @property
    def cpu(self) -> float:
        return self.prepare_cpu + self.insert_cpu

    def line(self, name: str) -> str:
        m = self.rows / 1e6
        return (f"{name:<4} {self.rows / self.wall:>10,.0f} rows/s  "
                f"prepare {self.prepare_cpu / m:5.2f} + insert {self.insert_cpu / m:5.2f} = "
                f"{self.cpu / m:5.2f} client CPU-s/Mrows  "
                f"(wall prepare {self.prepare_wall:6.2f} s, insert {self.insert_wall:6.2f} s, "
                f"{self.blocks} blocks, {self.rows:,} rows)")


class Source:
    """Envelopes of consecutive ids, never repeating within a run."""

    def __init__(self, table: str, seed: int) -> None:
        self.table = table
        self.pool = Rows(1, 1, ROWS_PER_MESSAGE, 1, seed).pool
        self.next_id = 1
        self.next_offset = 0

    def messages(self, rows: int) -> list[Message]:
        out = []
        for first in range(self.next_id, self.next_id + rows, ROWS_PER_MESSAGE):
            last = min(first + ROWS_PER_MESSAGE, self.next_id + rows)
            payload = [b"\x08" + varint(i) + self.pool[i % POOL].tail for i in range(first, last)]
            out.append(Message(self.next_offset, 1_700_000_000_000,
                               make_envelope(self.table, payload, version=1)))
            self.next_offset += 1
        self.next_id += rows
        return out


def block_of(table: str, messages: list[Message], plans: Plans, columnar: bool
             ) -> tuple[Batch, Block]:
    prepared = prepare(TOPIC, 0, messages, plans, columnar=columnar)
    if prepared.dead_letters:
        raise RuntimeError(f"{prepared.dead_letters} dead letters in a benchmark block")
    first, last = messages[0].offset, messages[-1].offset
    batch = Batch(TOPIC, 0, first, last + 1, prepared.offsets, prepared.table_ids,
                  prepared.row_counts, prepared.sizes, prepared.payloads, prepared.tables)
    tid = int(prepared.table_ids[0])
    block = Block(TOPIC, 0, tid, table, first, last, np.arange(len(messages)),
                  int(prepared.row_counts.sum()), int(prepared.sizes.sum()),
                  block_token(TOPIC, 0, table, first, last))
    return batch, block


def timed(writer: ClickHouseBlockWriter, table: str, messages: list[Message], plans: Plans,
          columnar: bool) -> tuple[int, float, float, float, float]:
    w0, c0 = time.perf_counter(), time.process_time()
    batch, block = block_of(table, messages, plans, columnar)
    w1, c1 = time.perf_counter(), time.process_time()
    writer.insert(block, batch)
    w2, c2 = time.perf_counter(), time.process_time()
    return block.rows, w1 - w0, c1 - c0, w2 - w1, c2 - c1


def run(args: argparse.Namespace) -> int:
    env = {**stack_env(), **{k: v for k, v in os.environ.items() if k.startswith("BLOCKAGG_")}}
    host = env["BLOCKAGG_CH_HOST"]
    replicas = tuple(Replica(host, int(p)) for p in env["BLOCKAGG_CH_PORTS"].split(","))
    database = f"bench_writer_{uuid.uuid4().hex[:8]}"
    table = f"{database}.t"
    admin = [ClickHouseBlockWriter(WriterConfig(replicas=(r,))) for r in replicas]
    for w in admin:
        w.query(f"CREATE DATABASE {database}")
        w.query(f"CREATE TABLE {table} ({COLUMNS}, {COORDINATES}) ENGINE = "
                f"ReplicatedMergeTree('/clickhouse/tables/{{shard}}/{database}/t', '{{replica}}') "
                "ORDER BY id")
    old = ClickHouseBlockWriter(WriterConfig(replicas=replicas, use_numpy=False))
    new = ClickHouseBlockWriter(WriterConfig(replicas=replicas, use_numpy=True))
    store = MemoryStore()
    register(store, table, ROW_MESSAGE, row_descriptor_set())
    plans = Plans(Registry.load(store), lambda t: new.describe(t).columns)
    source = Source(table, args.seed)
    load = os.getloadavg()
    print(f"# python {platform.python_version()}, numpy {np.__version__}, "
          f"{platform.machine()}, {os.cpu_count()} cpus, load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start")
    try:
        # Identity: the same block by the old path, then the new one: deduplicated.
        same = source.messages(1000)
        batch, block = block_of(table, same, plans, columnar=False)
        old.insert(block, batch)
        batch2, block2 = block_of(table, same, plans, columnar=True)
        assert new.block_data(block2, batch2).numpy, "the new path did not take numpy mode"
        new.insert(block2, batch2)
        count = int(old.query(f"SELECT count() FROM {table}")[0][0])
        verdict = "deduplicated: identical data" if count == 1000 else "NOT deduplicated"
        print(f"identity: old-path block then new-path block of the same 1,000 rows -> "
              f"{count:,} rows stored ({verdict})")
        expected = count
        # warm-up (imports, first connections, numpy mode's pandas import)
        for columnar, writer in ((False, old), (True, new)):
            rows, *_ = timed(writer, table, source.messages(1000), plans, columnar)
            expected += rows
        results: dict[tuple[int, str], Tally] = {}
        for block_rows, blocks in ((1000, args.small_blocks), (100_000, args.large_blocks)):
            for _ in range(blocks):
                for name, columnar, writer in (("old", False, old), ("new", True, new)):
                    messages = source.messages(block_rows)
                    res = timed(writer, table, messages, plans, columnar)
                    results.setdefault((block_rows, name), Tally()).add(*res)
                    expected += res[0]
        load = os.getloadavg()
        for block_rows, _ in ((1000, 0), (100_000, 0)):
            o, n = results[(block_rows, "old")], results[(block_rows, "new")]
            print(f"block_rows={block_rows:,}")
            print("  " + o.line("old"))
            print("  " + n.line("new"))
            print(f"  new/old: throughput {o.wall / n.wall:.2f}x, client CPU per row "
                  f"{o.cpu / n.cpu:.2f}x less (prepare {o.prepare_cpu / n.prepare_cpu:.2f}x, "
                  f"insert {o.insert_cpu / n.insert_cpu:.2f}x)")
        stored = old.query(f"SELECT count(), uniqExact(id) FROM {table}")[0]
        print(f"stored {int(stored[0]):,} rows, {int(stored[1]):,} distinct ids, expected "
              f"{expected:,}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at end")
        ok = int(stored[0]) == expected == int(stored[1]) and count == 1000
        return 0 if ok else 1
    finally:
        for w in (old, new):
            w.close()
        if not args.keep:
            for w in admin:
                w.query(f"DROP DATABASE IF EXISTS {database}")
        for w in admin:
            w.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--small-blocks", type=int, default=100,
                    help="blocks of 1,000 rows per path (default 100)")
    ap.add_argument("--large-blocks", type=int, default=5,
                    help="blocks of 100,000 rows per path (default 5)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--keep", action="store_true", help="keep the benchmark database")
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
