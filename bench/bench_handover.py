"""Hand-over benchmark: ``python -m bench.bench_handover [--rows N] [--repeat R]``.

How a task receives its Kafka records from Spark's JVM, alone: the same topic
(``bench.workload.Rows``: 10-row envelopes, 8 partitions) read by a Spark batch query,
and per partition either

* ``rows``: ``rdd.mapPartitions`` over pickled ``Row`` objects
  (:func:`spark.task.records_from_rows`, ``job.handover = "rows"``), or
* ``arrow``: ``mapInArrow`` over Arrow record batches
  (:func:`spark.task.records_from_arrow`, the default),

each ending where :func:`spark.task.run_range` would start (the task's offsets, values
and timestamps in Python lists); nothing is decoded or inserted. Passes alternate
(rows, arrow, arrow, rows, ...) in one Spark session (``local[2]``) and report wall
time and the CPU seconds of the whole process tree (this driver, the JVM, the Python
workers) per million messages. CPU is the figure to compare on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from bench.workload import REPO_ROOT, Rows, create_topic, produce, session_processes, stack_env


def session_cpu_seconds() -> float:
    """CPU seconds of every live process in this process's session."""
    return sum(cpu for cpu, _ in session_processes(os.getsid(0)).values())


def count_rows(rows: Iterable[Any]) -> Iterator[int]:
    from blockagg.spark.task import records_from_rows

    records = records_from_rows(rows)
    yield 0 if records is None else len(records.offsets)


def count_arrow(batches: Iterable[Any]) -> Iterator[Any]:
    import pyarrow as pa

    from blockagg.spark.task import records_from_arrow

    records = records_from_arrow(batches)
    n = 0 if records is None else len(records.offsets)
    yield pa.RecordBatch.from_pydict({"n": [n]})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=5_000_000)
    ap.add_argument("--rows-per-message", type=int, default=10)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3, help="passes of each hand-over")
    args = ap.parse_args(argv)
    env = stack_env()
    bootstrap = env["BLOCKAGG_BOOTSTRAP_SERVERS"]
    jars = env["BLOCKAGG_SPARK_JARS"].split(",")
    os.environ.setdefault("PYTHONPATH", str(REPO_ROOT))

    rows = Rows(args.rows, 100, args.rows_per_message, args.partitions, seed=1)
    topic = f"bench-handover-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, topic, args.partitions)
    messages, size, _ = produce(bootstrap, topic, rows.envelopes())

    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").appName("bench-handover")
             .config("spark.jars", ",".join(jars)).config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.memory", "2g").config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.executorEnv.PYTHONPATH", str(REPO_ROOT)).getOrCreate())
    spark.sparkContext.setLogLevel("WARN")
    df = (spark.read.format("kafka").option("kafka.bootstrap.servers", bootstrap)
          .option("subscribe", topic).option("startingOffsets", "earliest")
          .option("endingOffsets", "latest").load()
          .select("topic", "partition", "offset", "value", "timestamp"))

    passes: dict[str, Callable[[], int]] = {
        "rows": lambda: sum(df.rdd.mapPartitions(count_rows).collect()),
        "arrow": lambda: sum(r[0] for r in df.mapInArrow(count_arrow, "n long").collect()),
    }
    for name, run in passes.items():  # warm-up: workers started, jars loaded, JIT
        assert run() == messages, name
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in passes}
    order = [n for r in range(args.repeat) for n in (("rows", "arrow") if r % 2 == 0
                                                     else ("arrow", "rows"))]
    for name in order:
        cpu0, t0 = session_cpu_seconds(), time.perf_counter()
        got = passes[name]()
        wall, cpu = time.perf_counter() - t0, session_cpu_seconds() - cpu0
        assert got == messages, (name, got, messages)
        results[name].append((wall, cpu))
    spark.stop()

    load = os.getloadavg()
    print(f"# python {platform.python_version()}, pyspark local[2], {os.cpu_count()} cpus, "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at end")
    print(f"messages={messages:,} rows={args.rows:,} MB={size / 1e6:,.0f} "
          f"partitions={args.partitions} repeat={args.repeat} (best of; order ABBA)")
    best = {name: (min(w for w, _ in rs), min(c for _, c in rs)) for name, rs in results.items()}
    for name, (wall, cpu) in best.items():
        print(f"{name:6s} {messages / wall:12,.0f} msg/s  wall {wall:6.2f} s  "
              f"cpu {cpu / messages * 1e6:6.2f} s/Mmsg  (all passes: " + ", ".join(
                  f"{w:.2f}s/{c:.1f}cpu" for w, c in results[name]) + ")")
    (rw, rc), (aw, ac) = best["rows"], best["arrow"]
    print(f"arrow vs rows: {rw / aw:.2f}x faster (wall), {rc / ac:.2f}x less CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
