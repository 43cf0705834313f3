"""The limits, measured in one run on the same rows: ``python -m bench.bench_limits``.

* **raw consume**: librdkafka (confluent-kafka) reads every message of the envelope
  topic, no decode: the ceiling of any Kafka consumer on this machine.
* **raw insert**: clickhouse-driver inserts the same rows from prepared columns (no
  Kafka, no decode) in blocks of ``--block-rows`` into a ``ReplicatedMergeTree`` of the
  same 10-column shape: the ceiling of any ClickHouse writer.
* **raw insert, the job's blocks**: the very blocks ``bench_e2e`` makes the job form
  (the whole topic one micro-batch: per partition and table, blocks of up to
  ``--job-block-rows`` rows), into the same tables (``t000``... plus the ``_topic``,
  ``_partition``, ``_offset`` columns, ``ReplicatedMergeTree``, ``insert_quorum``
  ``--quorum``), sent as the job sends them (numpy columns through clickhouse-driver's
  numpy mode, to the first replica), ``--same-blocks-lanes`` inserts at a time (each
  on its own connection; comma list: one line each). The columns are built from the
  workload's pool with numpy inside the timed interval (about a millisecond a block).
  What this costs the servers per insert is what any writer of these blocks pays;
  the rest of blockagg's time is its own.
* **Kafka engine**: ClickHouse 18.16's own ``ENGINE = Kafka`` (bundled librdkafka)
  reads the same rows as JSONEachRow from a topic with the same partitions and rows
  per message, through a materialized view into one table of the same shape (it can't
  route one topic to many tables: that is why blockagg exists). The group's offsets
  are committed at 0 before the engine starts, because 18.16's consumer starts a new
  group at the end (librdkafka's default ``auto.offset.reset=largest``).

Rows/s and MB/s use the same row count and the same byte size per row (the envelope's
encoded protobuf row) for every contender, so the figures compare. CPU is the client
process's (RUSAGE_SELF) plus the server processes' (``/proc/<pid>/stat`` of ClickHouse
r1 and r2, and of the broker) over the measured interval. Run against the stack the
environment points at (``eval "$(scripts/stack env)"``); ``--append`` adds the result
to ``docs/BENCHMARKS.md`` under ``## End to end``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from bench.workload import (
    COLUMN_NAMES,
    COLUMNS,
    KINDS,
    POOL,
    REPO_ROOT,
    Rows,
    ch_client,
    create_tables,
    create_topic,
    execute_everywhere,
    proc_cpu_seconds,
    produce,
    self_cpu_seconds,
    stack_addresses,
    stack_env,
)
from tests.faults.stack import StackControl
from tests.faults.workload import COORDINATES


@dataclass
class Result:
    name: str
    rows: int
    seconds: float
    client_cpu_s: float
    server_cpu_s: float
    row_bytes: float
    note: str = ""
    servers: dict[str, Any] | None = None
    """The servers' split of the interval (:meth:`ServerSample.since`), where measured."""

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.rows_per_s * self.row_bytes / 1e6

    @property
    def cpu_s_per_mrows(self) -> float:
        return (self.client_cpu_s + self.server_cpu_s) / self.rows * 1e6

    def line(self) -> str:
        return (f"{self.name:<26} {self.rows_per_s:>12,.0f} rows/s {self.mb_per_s:>7.1f} MB/s "
                f"{self.seconds:>7.2f} s  cpu {self.cpu_s_per_mrows:>6.2f} s/Mrows "
                f"(client {self.client_cpu_s:.1f} s, servers {self.server_cpu_s:.1f} s)"
                f"{'  ' + self.note if self.note else ''}")


@dataclass(frozen=True)
class ServerSample:
    """:meth:`Servers.sample` at one moment; two of them give an interval's split."""

    cpu: dict[str, float]
    by_replica: tuple[dict[str, int], ...]
    """Each replica's ``system.events``, in the order of the clients sampled."""

    @property
    def events(self) -> dict[str, int]:
        """The events summed over the replicas."""
        out: dict[str, int] = {}
        for events in self.by_replica:
            for name, value in events.items():
                out[name] = out.get(name, 0) + value
        return out

    def since(self, before: ServerSample) -> dict[str, Any]:
        """The interval from ``before``: CPU-s by process, and every event that moved,
        summed over the replicas and on each."""
        def moved(now: dict[str, int], then: dict[str, int]) -> dict[str, int]:
            return {n: v - then.get(n, 0) for n, v in sorted(now.items())
                    if v != then.get(n, 0)}

        return {"cpu_s": {n: round(c - before.cpu.get(n, 0.0), 2) for n, c in self.cpu.items()},
                "events": moved(self.events, before.events),
                "events_by_replica": [moved(now, then) for now, then
                                      in zip(self.by_replica, before.by_replica, strict=True)]}


class Servers:
    """CPU seconds of the stack's server processes (pids from the stack's pid files)."""

    def __init__(self, names: tuple[str, ...], also: tuple[str, ...] = ("zookeeper",)) -> None:
        """``names``: the processes :meth:`cpu` sums; ``also``: processes only
        :meth:`sample` reports, so its split shows them without moving the figure that
        earlier runs recorded."""
        self.control = StackControl({**os.environ, **stack_env()})
        self.names = names
        self.pids = {n: self.control.pid(n) for n in (*names, *also)}

    def cpu(self) -> float:
        by_name = self.cpu_by_name()
        return sum(by_name.get(n, 0.0) for n in self.names)

    def cpu_by_name(self) -> dict[str, float]:
        return {n: proc_cpu_seconds(p) for n, p in self.pids.items() if p is not None}

    def sample(self, clients: Sequence[Any] = ()) -> ServerSample:
        """Each process's CPU and, from every replica of ``clients``, the counters of
        ``system.events``: what a server did for the CPU it used."""
        return ServerSample(self.cpu_by_name(), tuple(
            {name: int(value) for name, value in
             client.execute("SELECT event, value FROM system.events")}
            for client in clients))

    def summed(self, split: dict[str, Any]) -> float:
        """:meth:`cpu`'s figure over an interval of :meth:`ServerSample.since`."""
        return float(sum(split["cpu_s"].get(n, 0.0) for n in self.names))

    def restart_replicas(self) -> float:
        """Stop every ClickHouse replica (SIGTERM, then its ports free) and start them
        again, writable; returns the seconds it took. Why: on 18.16 the servers' CPU
        for identical runs climbs run after run (26 -> 59 CPU-s per Mrows over six
        1M-row batches, docs/BENCHMARKS.md), so a run after a restart is measured
        against servers in the same state as every other."""
        import signal

        from scripts import stack_lib

        began = time.monotonic()
        for name in self.control.replica_services:
            svc = self.control.services[name]
            pid = svc.pid()
            if pid is None:
                continue
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 120
            while stack_lib.pid_alive(pid, svc.marker) or any(
                    stack_lib.port_in_use(port, svc.host) for port in svc.ports.values()):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} (pid {pid}) still running 120 s after SIGTERM")
                time.sleep(0.1)
        self.control.up()
        self.control.wait_replicas_writable()
        self.pids = {n: self.control.pid(n) for n in self.pids}
        return time.monotonic() - began


def measure(name: str, rows: int, row_bytes: float, servers: Servers,
            fn: Callable[[], str]) -> Result:
    c0, s0, t0 = self_cpu_seconds(), servers.cpu(), time.perf_counter()
    note = fn()
    t1, c1, s1 = time.perf_counter(), self_cpu_seconds(), servers.cpu()
    return Result(name, rows, t1 - t0, c1 - c0, s1 - s0, row_bytes, note)


def raw_consume(bootstrap: str, topic: str, partitions: int, messages: int,
                timeout: float = 600) -> str:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"raw-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "fetch.max.bytes": 64 << 20,
                         "max.partition.fetch.bytes": 16 << 20})
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    seen = size = 0
    deadline = time.monotonic() + timeout
    while seen < messages:
        if time.monotonic() > deadline:
            raise TimeoutError(f"raw consume: {seen} of {messages} after {timeout}s")
        for msg in consumer.consume(10_000, 1.0):
            if msg.error() is None:
                seen += 1
                size += len(msg.value() or b"")
    consumer.close()
    return f"{seen:,} messages, {size / 1e6:,.0f} MB of values"


def raw_insert(rows: Rows, client: Any, table: str, block_rows: int, servers: Servers
               ) -> Result:
    """Each block's columns are built untimed, then only the ``INSERT`` is measured (so
    10M rows never sit in memory as Python objects at once)."""
    names = ", ".join(COLUMN_NAMES)
    seconds = client_cpu = server_cpu = 0.0
    blocks = 0
    for first in range(1, rows.rows + 1, block_rows):
        cols = rows.columns(first, min(first + block_rows - 1, rows.rows))
        c0, s0, t0 = self_cpu_seconds(), servers.cpu(), time.perf_counter()
        client.execute(f"INSERT INTO {table} ({names}) VALUES", cols, columnar=True)
        seconds += time.perf_counter() - t0
        client_cpu += self_cpu_seconds() - c0
        server_cpu += servers.cpu() - s0
        blocks += 1
    return Result("raw ClickHouse insert", rows.rows, seconds, client_cpu, server_cpu,
                  rows.encoded_row_bytes, f"{blocks} blocks of {block_rows:,} rows")


@dataclass(frozen=True)
class JobBlock:
    """One block the job forms: ``messages`` (indexes into the workload) of ``table``
    in ``partition``, at the partition's offsets ``m // partitions``."""

    table: int
    partition: int
    messages: Any  # numpy int64 array


def job_blocks(rows: Rows, max_rows: int) -> list[JobBlock]:
    """The blocks of the whole topic as one micro-batch: per partition, per table (in
    the round-robin layout of ``bench.workload``), the table's messages in offset
    order, sealed when they reach ``max_rows`` rows (then the rest at the end)."""
    import numpy as np

    per_block = -(-max_rows // rows.rows_per_message)
    out: list[JobBlock] = []
    m = np.arange(rows.messages, dtype=np.int64)
    parts, tables = m % rows.partitions, (m // rows.partitions) % rows.tables
    for p in range(rows.partitions):
        for t in range(rows.tables):
            mine = m[(parts == p) & (tables == t)]
            out.extend(JobBlock(t, p, mine[i:i + per_block])
                       for i in range(0, mine.size, per_block))
    return out


class PoolColumns:
    """The workload pool's nine value columns as numpy arrays, to build any block's
    columns by index without a Python object per row."""

    def __init__(self, rows: Rows) -> None:
        import numpy as np

        values = [e.values for e in rows.pool]
        self.rows = rows
        self.columns: list[Any] = [
            np.array([v[0] for v in values], dtype=np.int32),
            np.array([v[1] for v in values], dtype=np.int64),
            np.array([v[2] for v in values], dtype=np.float64),
            np.array([v[3] for v in values], dtype=np.float32),
            np.array([v[4] for v in values], dtype=object),
            np.array([v[5] for v in values], dtype=object),
            np.array([v[6] for v in values], dtype="datetime64[s]"),
            np.array([KINDS.index(v[7]) for v in values], dtype=np.int64),
            np.empty(POOL, dtype=object),
        ]
        for i, v in enumerate(values):
            self.columns[8][i] = np.array(v[8], dtype=np.int64)
        self.kinds = np.array(KINDS, dtype=object)

    def block(self, topic: str, block: JobBlock) -> list[Any]:
        import numpy as np

        rpm = self.rows.rows_per_message
        starts = block.messages * rpm + 1
        ids = (starts[:, None] + np.arange(rpm)[None, :]).ravel()
        ids = ids[ids <= self.rows.rows].astype(np.uint64)
        pool = ids % POOL
        cols: list[Any] = [ids]
        for k, col in enumerate(self.columns):
            taken = col[pool]
            cols.append(self.kinds[taken] if k == 7 else taken)
        offsets = np.repeat(block.messages // self.rows.partitions, rpm)[:ids.size]
        cols.append(np.full(ids.size, topic, dtype=object))
        cols.append(np.full(ids.size, block.partition, dtype=np.uint32))
        cols.append(offsets.astype(np.uint64))
        return cols


PENDING_QUORUM: Final = 286
"""UNSATISFIED_QUORUM_FOR_PREVIOUS_WRITE: 18.16 takes one quorum insert per table at a
time."""


def insert_waiting_for_quorum(send: Callable[[], object], pause_s: float = 0.01,
                              sleep: Callable[[float], None] = time.sleep) -> int:
    """``send()`` the insert, sent again after ``pause_s`` each time the server refuses it
    because the table's previous quorum insert is still pending (code 286): any writer
    of these blocks waits for that, so the limit does too, at once (the job backs off
    from 0.2 s instead). Any other error is raised. Returns the waits."""
    from clickhouse_driver.errors import ServerException

    waits = 0
    while True:
        try:
            send()
            return waits
        except ServerException as exc:
            if exc.code != PENDING_QUORUM:
                raise
            waits += 1
            sleep(pause_s)


def create_job_tables(host: str, ports: list[int], database: str, names: list[str]) -> None:
    """Tables of the job's shape (the workload's columns and the coordinates) on every
    replica, on their own ZooKeeper paths."""
    execute_everywhere(host, ports, [
        f"CREATE TABLE {database}.{name} ({COLUMNS}, {COORDINATES}) ENGINE = "
        f"ReplicatedMergeTree('/clickhouse/tables/{{shard}}/{database}/{name}', "
        "'{replica}') ORDER BY id" for name in names])


@dataclass
class Inserted:
    """What one set of blocks cost, inserted ``lanes`` at a time."""

    seconds: float
    client_cpu_s: float
    server_cpu_s: float
    quorum_waits: int
    servers: dict[str, Any] | None = None
    """The interval's :meth:`ServerSample.since`, when the inserter was given replicas."""


class LaneInserter:
    """Blocks into tables of the job's shape, ``lanes`` inserts at a time, each lane on
    its own connection to the first replica, as the job's insert lanes send them (numpy
    columns, ``insert_deduplicate``, ``insert_quorum``): nothing of blockagg around
    them. Use as a context manager; :meth:`insert` may be called many times (the lanes
    stay connected, so only the inserts are timed)."""

    def __init__(self, pool: PoolColumns, host: str, ports: list[int], database: str,
                 names: list[str], lanes: int, quorum: int, servers: Servers,
                 replicas: Sequence[Any] = ()) -> None:
        import threading
        from concurrent.futures import ThreadPoolExecutor

        self.pool, self.host, self.port = pool, host, ports[0]
        self.database, self.names, self.lanes, self.servers = database, names, lanes, servers
        self.replicas = replicas
        self.columns = ", ".join([*COLUMN_NAMES, "_topic", "_partition", "_offset"])
        self.settings: dict[str, Any] = {"use_numpy": True, "insert_deduplicate": 1}
        if quorum:
            self.settings["insert_quorum"] = quorum
        self.local = threading.local()
        self.executor = ThreadPoolExecutor(lanes)
        self.waits = 0
        # The driver warns twice an insert that Enum8 and Array(Int64) take its generic
        # column path: thousands of lines a run, and CPU charged to this limit.
        logging.getLogger("clickhouse_driver.columns.service").setLevel(logging.ERROR)

    def __enter__(self) -> LaneInserter:
        # Connect every lane first. Not a warm-up insert: 18.16 refuses a second quorum
        # insert into a table while the first one's quorum is pending (code 286).
        list(self.executor.map(lambda _: self._connected(), range(self.lanes)))
        return self

    def __exit__(self, *exc: object) -> None:
        self.executor.shutdown(wait=True)

    def _connected(self) -> Any:
        client = getattr(self.local, "client", None)
        if client is None:
            client = self.local.client = ch_client(self.host, self.port)
            client.execute("SELECT 1")
        return client

    def _insert(self, block: JobBlock) -> int:
        cols = self.pool.block("bench", block)
        return insert_waiting_for_quorum(lambda: self._connected().execute(
            f"INSERT INTO {self.database}.{self.names[block.table]} ({self.columns}) VALUES",
            cols, columnar=True, settings=self.settings))

    def insert(self, blocks: list[JobBlock]) -> Inserted:
        """Every block of ``blocks``, timed from the first send to the last answer."""
        before = self.servers.sample(self.replicas)
        c0, t0 = self_cpu_seconds(), time.perf_counter()
        waits = sum(self.executor.map(self._insert, blocks))
        t1, c1 = time.perf_counter(), self_cpu_seconds()
        split = self.servers.sample(self.replicas).since(before)
        self.waits += waits
        return Inserted(t1 - t0, c1 - c0, self.servers.summed(split), waits,
                        split if self.replicas else None)


def raw_insert_job_blocks(rows: Rows, host: str, ports: list[int], database: str,
                          max_rows: int, lanes: int, quorum: int, servers: Servers,
                          generation: int, warm: Sequence[Rows] = (),
                          replicas: Sequence[Any] = (), warm_gap_s: float = 2.0) -> Result:
    """The job's blocks into fresh tables of the job's shape, ``lanes`` at a time.

    ``warm``: first, untimed, the blocks of each of these batches in turn, as a warm
    job's warm-up batches (:meth:`bench.bench_e2e.Bench.warm_run`) fill its tables, so the
    timed blocks land in tables holding the same parts as the job's, ``warm_gap_s`` after
    the last warm-up block (the warm job's gap: its final commits, then producing the
    measured rows, while the servers merge the warm-up's parts). ``replicas``: clients
    whose ``system.events`` split the servers' work (:class:`ServerSample`)."""
    names = [f"j{generation}_t{t:03d}" for t in range(rows.tables)]
    create_job_tables(host, ports, database, names)
    for batch in warm:
        with LaneInserter(PoolColumns(batch), host, ports, database, names, lanes, quorum,
                          servers) as lanes_:
            lanes_.insert(job_blocks(batch, max_rows))
    if warm:
        time.sleep(warm_gap_s)
    blocks = job_blocks(rows, max_rows)
    with LaneInserter(PoolColumns(rows), host, ports, database, names, lanes, quorum,
                      servers, replicas) as lanes_:
        done = lanes_.insert(blocks)
    stored = int(ch_client(host, ports[0]).execute(
        f"SELECT sum(rows) FROM system.parts WHERE database = '{database}' AND active "
        f"AND table LIKE 'j{generation}\\_%'")[0][0] or 0)
    sizes = sorted(b.messages.size for b in blocks)
    return Result(f"raw insert, job blocks x{lanes}", rows.rows, done.seconds,
                  done.client_cpu_s, done.server_cpu_s, rows.encoded_row_bytes,
                  f"{len(blocks)} blocks of {sizes[0] * rows.rows_per_message:,}-"
                  f"{sizes[-1] * rows.rows_per_message:,} rows, {lanes} at a time, "
                  f"quorum {quorum}, {stored:,} rows stored, {done.quorum_waits} quorum waits"
                  + (f", after {sum(w.rows for w in warm):,} warm-up rows" if warm else ""),
                  done.servers)


def kafka_engine(rows: Rows, client: Any, bootstrap: str, topic: str, database: str,
                 consumers: int, timeout: float, idle: list[float], stall_s: float = 30.0
                 ) -> Callable[[], str]:
    """Times the engine from its creation until every row is stored, or until the count
    has not moved for ``stall_s`` (then the stall is subtracted and losses reported)."""
    from confluent_kafka import Consumer, TopicPartition

    group = f"chkafka-{uuid.uuid4().hex[:8]}"
    setter = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                       "enable.auto.commit": False})
    setter.commit(offsets=[TopicPartition(topic, p, 0) for p in range(rows.partitions)],
                  asynchronous=False)
    setter.close()
    client.execute(f"CREATE TABLE {database}.kafka_dst ({COLUMNS}) ENGINE = ReplicatedMergeTree("
                   f"'/clickhouse/tables/{{shard}}/{database}/kafka_dst', '{{replica}}') "
                   "ORDER BY id")

    def run() -> str:
        client.execute(
            f"CREATE TABLE {database}.kafka_src ({COLUMNS}) ENGINE = Kafka SETTINGS "
            f"kafka_broker_list = '{bootstrap}', kafka_topic_list = '{topic}', "
            f"kafka_group_name = '{group}', kafka_format = 'JSONEachRow', "
            f"kafka_num_consumers = {consumers}")
        client.execute(f"CREATE MATERIALIZED VIEW {database}.kafka_mv TO {database}.kafka_dst "
                       f"AS SELECT * FROM {database}.kafka_src")
        deadline = time.monotonic() + timeout
        n = last_change_n = 0
        last_change = time.monotonic()
        while n < rows.rows:
            if time.monotonic() > deadline:
                break
            if time.monotonic() - last_change > stall_s:
                break  # nothing new for stall_s (> stream_flush_interval_ms): it stopped
            time.sleep(0.2)
            n = int(client.execute(f"SELECT count() FROM {database}.kafka_dst")[0][0])
            if n != last_change_n:
                last_change_n, last_change = n, time.monotonic()
        idle[0] = time.monotonic() - last_change if n < rows.rows else 0.0
        count, unique = client.execute(
            f"SELECT count(), uniqExact(id) FROM {database}.kafka_dst")[0]
        lost = rows.rows - int(unique)
        examples = client.execute(
            f"SELECT id FROM (SELECT number + 1 AS id FROM system.numbers LIMIT {rows.rows}) "
            f"WHERE id NOT IN (SELECT id FROM {database}.kafka_dst) LIMIT 8") if lost else []
        return (f"{int(count):,} rows stored, {int(count) - int(unique)} duplicated, {lost} LOST"
                f"{' e.g. ids ' + ','.join(str(e[0]) for e in examples) if lost else ''}; "
                f"{consumers} consumer(s)")

    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--tables", type=int, default=100)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--rows-per-message", type=int, default=10)
    ap.add_argument("--block-rows", type=int, default=100_000)
    ap.add_argument("--kafka-consumers", type=int, default=1)
    ap.add_argument("--job-block-rows", type=int, default=100_000,
                    help="the job's blocks.max_rows, for the raw insert of the job's blocks")
    ap.add_argument("--same-blocks-lanes", default="1,8",
                    help="comma list: inserts at a time for the raw insert of the job's "
                    "blocks (one line each; empty: skip)")
    ap.add_argument("--quorum", type=int, default=0,
                    help="insert_quorum of the raw insert of the job's blocks (as the job's)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--skip-kafka-engine", action="store_true")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", type=Path, help="also write the figures as JSON here")
    ap.add_argument("--append", action="store_true", help="append to docs/BENCHMARKS.md")
    args = ap.parse_args(argv)

    stack = stack_addresses()
    bootstrap = stack["BLOCKAGG_BOOTSTRAP_SERVERS"]
    host = stack.get("BLOCKAGG_CH_HOST", "127.0.0.1")
    ports = [int(p) for p in stack["BLOCKAGG_CH_PORTS"].split(",")]
    port = ports[0]
    run = uuid.uuid4().hex[:6]
    database = f"bench_{run}"
    rows = Rows(args.rows, args.tables, args.rows_per_message, args.partitions, args.seed,
                database)
    client = ch_client(host, port)
    clients = [ch_client(host, p) for p in ports]
    create_tables(clients, database, ["raw"])
    env_topic, json_topic = f"bench-env-{run}", f"bench-json-{run}"
    create_topic(bootstrap, env_topic, args.partitions)
    create_topic(bootstrap, json_topic, args.partitions)
    print(f"producing {rows.rows:,} rows ({rows.messages:,} messages) twice ...", file=sys.stderr)
    _, env_bytes, env_s = produce(bootstrap, env_topic, rows.envelopes())
    _, json_bytes, json_s = produce(bootstrap, json_topic, rows.json_messages())
    servers = Servers(("clickhouse-r1", "clickhouse-r2", "kafka"))
    rb = rows.encoded_row_bytes
    results = [
        measure("raw librdkafka consume", rows.rows, rb, servers,
                lambda: raw_consume(bootstrap, env_topic, args.partitions, rows.messages)),
        raw_insert(rows, client, f"{database}.raw", args.block_rows, servers),
    ]
    for generation, lanes in enumerate(int(x) for x in args.same_blocks_lanes.split(",") if x):
        results.append(raw_insert_job_blocks(rows, host, ports, database, args.job_block_rows,
                                              lanes, args.quorum, servers, generation))
    if not args.skip_kafka_engine:
        idle = [0.0]
        engine = measure(
            "ClickHouse Kafka engine", rows.rows, rb, servers,
            kafka_engine(rows, client, bootstrap, json_topic, database, args.kafka_consumers,
                         args.timeout, idle))
        engine.seconds -= idle[0]
        results.append(engine)
        client.execute(f"DROP TABLE IF EXISTS {database}.kafka_mv")
        client.execute(f"DROP TABLE IF EXISTS {database}.kafka_src")
    command = "python -m bench.bench_limits " + " ".join(
        a for a in (argv if argv is not None else sys.argv[1:]) if a != "--append")
    header = (f"rows={rows.rows:,} tables={args.tables} partitions={args.partitions} "
              f"rows/message={args.rows_per_message} block_rows={args.block_rows:,} "
              f"row_bytes={rb:.1f} (protobuf) envelope_MB={env_bytes / 1e6:,.0f} "
              f"json_MB={json_bytes / 1e6:,.0f} produce_s={env_s:.1f}/{json_s:.1f}")
    text = "\n".join([header, *(r.line() for r in results)])
    print(text, flush=True)
    if args.json:
        args.json.write_text(json.dumps({"header": header, "results": [
            {**asdict(r), "rows_per_s": r.rows_per_s, "mb_per_s": r.mb_per_s,
             "cpu_s_per_mrows": r.cpu_s_per_mrows} for r in results]}, indent=1))
    if args.append:
        append_section("Limits", command, text)
    for c in clients:
        c.execute(f"DROP DATABASE IF EXISTS {database}")
    return 0


def append_section(title: str, command: str, text: str) -> None:
    """Append under ``## End to end`` in docs/BENCHMARKS.md (created if missing)."""
    path = REPO_ROOT / "docs" / "BENCHMARKS.md"
    doc = path.read_text()
    if "## End to end" not in doc:
        doc = doc.rstrip("\n") + "\n\n## End to end\n"
    stamp = time.strftime("%Y-%m-%d")
    doc = doc.rstrip("\n") + (
        f"\n\n### {title}\n\n`{command}` (Python {platform.python_version()}, "
        f"{platform.machine()}, {os.cpu_count()} cores, {stamp})\n\n```\n{text}\n```\n")
    path.write_text(doc)


if __name__ == "__main__":
    raise SystemExit(main())
