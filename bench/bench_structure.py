"""What the structure mark costs: ``python -m bench.bench_structure [--tables N]``.

Under content-hash deduplication (servers before 22.2) every batch pins a ZooKeeper
mark of its tables' columns (``aggregator.clickhouse.structure``), and every re-sent
block first compares its table's ``columns`` nodes with it. Against the replicas of
``scripts/stack`` (``BLOCKAGG_CH_*`` or ``bench.workload.stack_env``), on ``--tables``
replicated tables, this measures:

* **per batch**: what a batch asks the shard before its first insert. Baseline: the
  deduplication mode (``SELECT version()``), which every batch asked before the mark.
  Marked: the mode and the mark (one ``system.replicas`` query per replica, cache warm).
  The two alternate ABBA, ``--batches`` each, ``--repeat`` rounds;
* **the first mark** of a fresh writer (every table's nodes read: ``2 + replicas``
  ``system.zookeeper`` queries per table), once per Python worker;
* **per re-send**: the check of one table's nodes (:func:`resend_risk`), and the count
  of a block's rows by its coordinates in a table of ``--rows`` rows, which runs only
  when the table changed since the mark.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
import uuid
from collections.abc import Callable

from bench.workload import stack_env
from blockagg.aggregator.clickhouse.structure import (
    TABLE_COORDINATES,
    landed_query,
    resend_risk,
)
from blockagg.aggregator.clickhouse.writer import ClickHouseBlockWriter, Replica, WriterConfig


def _ms(action: Callable[[], object], n: int) -> float:
    started = time.perf_counter()
    for _ in range(n):
        action()
    return (time.perf_counter() - started) * 1000 / n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", type=int, default=100)
    ap.add_argument("--batches", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rows", type=int, default=1_000_000)
    args = ap.parse_args(argv)

    env = stack_env()
    host = env["BLOCKAGG_CH_HOST"]
    replicas = tuple(Replica(host, int(p)) for p in env["BLOCKAGG_CH_PORTS"].split(","))

    def writer() -> ClickHouseBlockWriter:
        return ClickHouseBlockWriter(WriterConfig(replicas=replicas))

    db = f"bench_structure_{uuid.uuid4().hex[:8]}"
    from clickhouse_driver import Client

    clients = [Client(r.host, port=r.port) for r in replicas]
    for c in clients:
        c.execute(f"CREATE DATABASE {db}")
    tables = [f"{db}.t{i:03d}" for i in range(args.tables)]
    try:
        for c in clients:
            for t in tables:
                short = t.split(".")[1]
                c.execute(f"CREATE TABLE {t} (id UInt64, _topic String, _partition UInt32, "
                          f"_offset UInt64) ENGINE = ReplicatedMergeTree('/clickhouse/tables/"
                          f"{{shard}}/{db}/{short}', '{{replica}}') ORDER BY id")
        clients[0].execute(f"INSERT INTO {tables[0]} SELECT number, 'top', number % 8, "
                           f"number FROM system.numbers LIMIT {args.rows}")

        cold = []
        for _ in range(3):
            fresh = writer()
            started = time.perf_counter()
            mark = fresh.structure_mark(tables)
            cold.append((time.perf_counter() - started) * 1000)
            fresh.close()

        warm = writer()
        warm.structure_mark(tables)
        baseline: list[float] = []
        marked: list[float] = []
        for _ in range(args.repeat):
            for kind in ("baseline", "marked", "marked", "baseline"):
                if kind == "baseline":
                    baseline.append(_ms(warm.dedup_mode, args.batches))
                else:
                    marked.append(_ms(lambda: (warm.dedup_mode(), warm.structure_mark(tables)),
                                      args.batches))

        query = functools.partial(lambda c, s, p: c.execute(s, p or None), clients[0])
        check = _ms(lambda: resend_risk(query, tables[0], mark), args.batches)
        params = {"topic": "top", "partition": 3, "first": args.rows // 2,
                  "last": args.rows // 2 + 1000}
        count = _ms(lambda: clients[0].execute(landed_query(tables[0], TABLE_COORDINATES),
                                               params), 5)

        b, m = statistics.median(baseline), statistics.median(marked)
        print(f"tables={args.tables} replicas={len(replicas)} batches={args.batches} "
              f"repeat={args.repeat} (ABBA) rows_in_counted_table={args.rows:,}")
        print(f"per batch, baseline (dedup mode):     {b:7.2f} ms  (median of {len(baseline)})")
        print(f"per batch, marked (mode + mark):      {m:7.2f} ms  (median of {len(marked)})")
        print(f"per batch, marked / baseline:         {m / b:7.2f}")
        print(f"first mark of a fresh writer:         {statistics.median(cold):7.1f} ms  "
              f"({args.tables} tables, median of 3)")
        print(f"re-send check of one table:           {check:7.2f} ms")
        print(f"coordinate count, {args.rows:,}-row table: {count:7.2f} ms  (only after a change)")
        warm.close()
    finally:
        for c in clients:
            c.execute(f"DROP DATABASE IF EXISTS {db}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
