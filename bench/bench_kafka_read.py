"""Spark's Kafka read of one micro-batch, alone: ``python -m bench.bench_kafka_read``.

A streaming batch spends about a second between its first task's launch and that
task's Python function (docs/BENCHMARKS.md, "Where a micro-batch's time goes beyond
its tasks"), most of it in the Kafka source. This bench isolates that read: a topic of
``--partitions`` partitions, read batch after batch by Spark batch queries over
consecutive offset ranges of ``--records`` records a partition (as a stream's
micro-batches read them; each batch produced just before its read, so that the read
ends at the log end as a caught-up stream's do, or with ``--backlog`` all first),
through ``mapInArrow`` as the job's hand-over does, with nothing decoded or inserted.
Each pass is a set of reader options (a
*variant*), and the variants alternate ABBA in one Spark session (``local[2]``).

Per batch it records the query's wall time and the time from the collect to the
first task's Python function (``to_python``). Consumers are pooled per
``kafka.group.id`` (a fixed one, as a running stream's executors have one), except in
the ``fresh_consumer`` variant, which gives every batch its own group, as a stream's
restart does (each other variant has its own fixed group: the pool refuses two sets of
parameters under one). Reported: each variant's median of both, and its ratio to ``default``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

from bench.workload import REPO_ROOT, Rows, create_topic, produce, stack_env

JOB_OPTIONS: dict[str, str] = {"kafka.isolation.level": "read_committed",
                               "failOnDataLoss": "true"}
"""The reader options the job sets (``Driver._reader_options``) beside the servers."""

VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "read_uncommitted": {"kafka.isolation.level": "read_uncommitted"},
    "fetch_wait_10ms": {"kafka.fetch.max.wait.ms": "10"},
    "fresh_consumer": {},
    "partition_fetch_16m": {"kafka.fetch.max.wait.ms": "10",
                            "kafka.max.partition.fetch.bytes": str(16 << 20)},
    "no_crc_check": {"kafka.fetch.max.wait.ms": "10", "kafka.check.crcs": "false"},
}
"""Reader options per variant, over :data:`JOB_OPTIONS` (and the bootstrap servers, the
offsets and, but for ``fresh_consumer``, the fixed group)."""


def entered(batches: Iterable[Any]) -> Iterator[Any]:
    """The task's start time (its Python function entered) and its record count."""
    import pyarrow as pa

    started = time.time()
    n = sum(b.num_rows for b in batches)
    yield pa.RecordBatch.from_pydict({"started": [started], "n": [n]})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--records", type=int, default=1_250,
                    help="records a partition-batch (10k rows/s, 10 s, 8 partitions: 1,250)")
    ap.add_argument("--rows-per-message", type=int, default=10)
    ap.add_argument("--batches", type=int, default=8, help="batches of each pass")
    ap.add_argument("--backlog", action="store_true",
                    help="produce every batch first (a catch-up), not each batch just "
                         "before its read (a stream at the log end)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, of {', '.join(VARIANTS)}")
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown or "default" not in variants:
        ap.error(f"unknown variants {sorted(unknown)}; 'default' is required")
    env = stack_env()
    bootstrap = env["BLOCKAGG_BOOTSTRAP_SERVERS"]
    os.environ.setdefault("PYTHONPATH", str(REPO_ROOT))

    per_pass = args.partitions * args.records
    # Every (variant, pass) reads its own ranges: no read is served by a previous one.
    passes = [(v, r) for r in range(2) for v in (variants if r == 0 else variants[::-1])]
    total = per_pass * (args.batches * len(passes) + 1)  # + the warm-up batch
    topic = f"bench-kafka-read-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, topic, args.partitions)
    rows = Rows(total * args.rows_per_message, 100, args.rows_per_message, args.partitions,
                seed=1)
    envelopes = rows.envelopes()
    if args.backlog:
        produce(bootstrap, topic, envelopes)

    def next_batch() -> None:
        """A stream's next batch: its records produced just before it is read, so its
        read ends at the log end, as a caught-up stream's do."""
        if not args.backlog:
            produce(bootstrap, topic, itertools.islice(envelopes, per_pass))

    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").appName("bench-kafka-read")
             .config("spark.jars", env["BLOCKAGG_SPARK_JARS"])
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.executorEnv.PYTHONPATH", str(REPO_ROOT)).getOrCreate())
    spark.sparkContext.setLogLevel("WARN")
    group = f"bench-kafka-read-{uuid.uuid4().hex[:8]}"

    def read(variant: str, start: int, end: int) -> tuple[float, float, int]:
        options = {"kafka.bootstrap.servers": bootstrap,
                   "assign": json.dumps({topic: list(range(args.partitions))}),
                   "startingOffsets": json.dumps(
                       {topic: {str(p): start for p in range(args.partitions)}}),
                   "endingOffsets": json.dumps(
                       {topic: {str(p): end for p in range(args.partitions)}}),
                   "kafka.group.id": (f"{group}-{uuid.uuid4().hex[:6]}"
                                      if variant == "fresh_consumer"
                                      else f"{group}-{variant}"),
                   **JOB_OPTIONS, **VARIANTS[variant]}
        reader = spark.read.format("kafka")
        for key, value in options.items():
            reader = reader.option(key, value)
        df = reader.load().select("topic", "partition", "offset", "value", "timestamp")
        t0 = time.time()
        out = df.mapInArrow(entered, "started double, n long").collect()
        wall = time.time() - t0
        return wall, min(r.started for r in out) - t0, sum(r.n for r in out)

    cursor, step = 0, args.records
    next_batch()
    read("default", cursor, cursor + step)  # warm-up: workers, jars, the pool's consumers
    cursor += step
    results: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    for variant, _ in passes:
        for _ in range(args.batches):
            next_batch()
            wall, to_python, n = read(variant, cursor, cursor + step)
            assert n == step * args.partitions, (variant, n)
            results[variant].append((wall, to_python))
            cursor += step
    spark.stop()

    load = os.getloadavg()
    print(f"# python {platform.python_version()}, pyspark local[2], {os.cpu_count()} cpus, "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at end")
    print(f"# {args.partitions} partitions x {step:,} records a batch, {args.batches} batches "
          f"a pass, {'a backlog' if args.backlog else 'each batch at the log end'}, "
          f"passes {' '.join(v for v, _ in passes)}")
    base_wall = statistics.median(w for w, _ in results["default"])
    base_python = statistics.median(p for _, p in results["default"])
    print("| variant | batches | wall s (median) | to Python s (median) | wall / default "
          "| to Python / default |")
    print("|---|---|---|---|---|---|")
    for variant, got in results.items():
        wall = statistics.median(w for w, _ in got)
        python = statistics.median(p for _, p in got)
        print(f"| {variant} | {len(got)} | {wall:.3f} | {python:.3f} | "
              f"{wall / base_wall:.2f} | {python / base_python:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
