"""The benchmark workload, shared by ``bench_limits`` and ``bench_e2e``: the same rows
for every contender, built once per run from a seed.

Rows are ``bench/row.proto``'s 10-field ``Event`` (the same 10 columns in ClickHouse,
:data:`tests.faults.workload.COLUMNS`). Row ``i`` has id ``i`` (1-based) and the other
nine fields of pool entry ``i % POOL`` (seeded), so every representation can be built
without materialising Python objects per row: protobuf (field 1 + a pre-serialized
tail), JSON lines (for ClickHouse's Kafka engine), and columns (for the raw insert).
Messages carry ``rows_per_message`` consecutive rows of one table; messages go to
partitions round-robin, and within each partition to tables round-robin, so every
partition carries every table (as with keys hashed over partitions): a micro-batch
forms ``tables x partitions`` blocks.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
JOB_PY = REPO_ROOT / "blockagg" / "spark" / "job.py"
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from blockagg.proto.envelope import make_envelope  # noqa: E402
from tests.faults.workload import COLUMNS, random_events, varint  # noqa: E402

POOL = 1024
KINDS = ("KIND_UNSPECIFIED", "KIND_VIEW", "KIND_CLICK", "KIND_BUY")
COLUMN_NAMES = ("id", "user", "delta", "price", "score", "name", "country", "time", "kind",
                "tags")
__all__ = ["COLUMNS", "COLUMN_NAMES", "Rows", "stack_env"]


@dataclass(frozen=True)
class PoolEntry:
    tail: bytes
    values: tuple[Any, ...]  # user, delta, price, score, name, country, time, kind, tags


def make_pool(seed: int) -> list[PoolEntry]:
    """The :data:`POOL` row tails of :func:`tests.faults.workload.random_events`, each
    with its nine values as ClickHouse returns them."""
    out = []
    for m in random_events(POOL, seed):
        tail = m.SerializeToString()
        # float32 round trip so the column value equals what protobuf carries
        score = type(m).FromString(tail).score
        out.append(PoolEntry(tail, (
            m.user, m.delta, m.price, score, m.name, m.country, m.time.seconds,
            KINDS[m.kind], list(m.tags))))
    return out


@dataclass
class Rows:
    """``rows`` rows over ``tables`` tables of database ``database``."""

    rows: int
    tables: int
    rows_per_message: int
    partitions: int
    seed: int
    database: str = "bench"

    def __post_init__(self) -> None:
        self.pool = make_pool(self.seed)

    @property
    def messages(self) -> int:
        return -(-self.rows // self.rows_per_message)

    def table(self, m: int) -> str:
        return f"{self.database}.t{(m // self.partitions) % self.tables:03d}"

    def partition(self, m: int) -> int:
        return m % self.partitions

    def message_ids(self, m: int) -> range:
        first = m * self.rows_per_message + 1
        return range(first, min(first + self.rows_per_message, self.rows + 1))

    def envelopes(self) -> Iterator[tuple[int, bytes]]:
        """(partition, envelope value) per message."""
        pool = self.pool
        for m in range(self.messages):
            rows = [b"\x08" + varint(i) + pool[i % POOL].tail for i in self.message_ids(m)]
            yield self.partition(m), make_envelope(self.table(m), rows, version=1)

    def json_messages(self) -> Iterator[tuple[int, bytes]]:
        """(partition, JSONEachRow lines) per message: the same rows for the Kafka engine."""
        pool = self.pool
        lines = []
        for entry in pool:
            u, d, p, s, name, country, t, kind, tags = entry.values
            lines.append(json.dumps({
                "user": u, "delta": d, "price": p, "score": s, "name": name,
                "country": country, "time": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)),
                "kind": kind, "tags": tags})[1:])
        for m in range(self.messages):
            text = "\n".join(f'{{"id":{i},{lines[i % POOL]}' for i in self.message_ids(m))
            yield self.partition(m), text.encode()

    def columns(self, first: int, last: int) -> list[list[Any]]:
        """Columns of rows ``first..last`` (1-based, inclusive), in :data:`COLUMN_NAMES`."""
        from datetime import UTC, datetime

        ids = list(range(first, last + 1))
        entries = [self.pool[i % POOL].values for i in ids]
        cols: list[list[Any]] = [ids]
        for k in range(9):
            col = [e[k] for e in entries]
            if k == 6:
                col = [datetime.fromtimestamp(v, tz=UTC).replace(tzinfo=None)
                       for v in col]
            cols.append(col)
        return cols

    @property
    def encoded_row_bytes(self) -> float:
        tails = sum(len(e.tail) for e in self.pool) / POOL
        return tails + 1 + len(varint(self.rows // 2))


def stack_env() -> dict[str, str]:
    """Addresses of the stack the environment points at (``scripts/stack env``)."""
    out = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "stack"), "env"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    env: dict[str, str] = {}
    for line in out.splitlines():
        if line.startswith("export ") and "=" in line:
            key, _, value = line[len("export "):].partition("=")
            env[key] = value.strip("'\"")
    return env


def stack_addresses() -> dict[str, str]:
    """The stack's addresses: the ``BLOCKAGG_*`` variables of the environment where set
    (``eval "$(scripts/stack env)"``), else what ``scripts/stack env`` says of the stack
    the port variables point at, so a benchmark runs without the ``eval`` too."""
    given = {k: v for k, v in os.environ.items() if k.startswith("BLOCKAGG_")}
    needed = ("BLOCKAGG_BOOTSTRAP_SERVERS", "BLOCKAGG_CH_PORTS", "BLOCKAGG_SPARK_JARS")
    return given if all(k in given for k in needed) else {**stack_env(), **given}


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its waited-for children, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / ticks


DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def drop_page_cache(control: Path = DROP_CACHES) -> bool:
    """Write dirty pages out, then drop the kernel's clean page cache (``echo 1`` to
    ``drop_caches``; root only). Returns whether it could.

    On the Firecracker VMs these benchmarks run on, the kernel time of creating,
    writing and deleting files grows with use and falls back once the page cache is
    dropped: 9,000 small files cost 7.7 CPU-s of system time, 1.1 right after a drop,
    2.6 in the next round; a ClickHouse insert of a 1,250-row part 5 ms of the server's
    system time after a drop and 27 ms ten rounds later (docs/BENCHMARKS.md, *What the
    servers' drift is*). Every part the servers write pays it, so contenders compared
    in one ABBA each start from a dropped cache, or the later ones pay for the earlier."""
    os.sync()
    try:
        control.write_text("1\n")
    except OSError:
        return False
    return True


def server_events(client: Any) -> dict[str, int]:
    """A ClickHouse server's cumulative ``system.events`` (every query's and background
    task's counters since it started): the difference of two snapshots is what the server
    did in between, whatever asked for it, with no query log configured."""
    return {str(name): int(value)
            for name, value in client.execute("SELECT event, value FROM system.events")}


def events_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """``after - before`` per event, events that did not move left out."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def session_processes(sid: int) -> dict[int, tuple[float, int]]:
    """``pid -> (utime + stime + waited-for children's, in seconds; RSS in bytes)`` of
    every live process in session ``sid``, from ``/proc``."""
    ticks, page = os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE")
    out: dict[int, tuple[float, int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:
            out[int(entry.name)] = (sum(int(fields[i]) for i in (11, 12, 13, 14)) / ticks,
                                    int(fields[21]) * page)
    return out


def self_cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def produce(bootstrap: str, topic: str, messages: Iterator[tuple[int, bytes]],
            timeout: float = 600, transactional_id: str = "") -> tuple[int, int, float]:
    """Produce and wait for every delivery; returns (messages, bytes, seconds). With a
    ``transactional_id``, every message is in one transaction, committed at the end: a
    ``read_committed`` reader (the job) sees none of them until then, and all of them
    in the first batch it plans after it."""
    from confluent_kafka import Producer

    settings: dict[str, Any] = {
        "bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all",
        "linger.ms": 50, "batch.size": 1 << 20, "compression.type": "lz4",
        "queue.buffering.max.messages": 2_000_000, "queue.buffering.max.kbytes": 1 << 21}
    if transactional_id:
        settings.update({"transactional.id": transactional_id,
                         "transaction.timeout.ms": int(timeout * 1000)})
    producer = Producer(settings)
    if transactional_id:
        producer.init_transactions(60)
        producer.begin_transaction()
    failures: list[str] = []

    def done(err: Any, msg: Any) -> None:
        if err is not None:
            failures.append(str(err))

    n = size = 0
    started = time.perf_counter()
    for partition, value in messages:
        while True:
            try:
                producer.produce(topic, value=value, partition=partition, on_delivery=done)
                break
            except BufferError:
                producer.poll(0.05)
        n += 1
        size += len(value)
        if n % 1000 == 0:
            producer.poll(0)
    left = producer.flush(timeout)
    if left or failures:
        raise RuntimeError(f"produce to {topic}: {left} undelivered, failures {failures[:3]}")
    if transactional_id:
        producer.commit_transaction(60)
    return n, size, time.perf_counter() - started


def create_topic(bootstrap: str, topic: str, partitions: int, timeout: float = 60) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for fut in admin.create_topics([NewTopic(topic, num_partitions=partitions,
                                             replication_factor=1)]).values():
        fut.result(timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        md = admin.list_topics(topic, timeout=10).topics.get(topic)
        if md is not None and md.error is None and len(md.partitions) == partitions \
                and all(p.leader >= 0 for p in md.partitions.values()):
            return
        time.sleep(0.2)
    raise TimeoutError(f"topic {topic}: no leaders after {timeout}s")


def ch_client(host: str, port: int, **settings: Any) -> Any:
    from clickhouse_driver import Client

    return Client(host, port=port, connect_timeout=10, send_receive_timeout=600,
                  settings=settings)


def execute_everywhere(host: str, ports: Sequence[int], statements: Sequence[str],
                       connections: int = 8) -> None:
    """Run ``statements`` on every replica, one replica after the other, ``connections``
    at a time on each; the order among the statements is not kept. DDL of a replicated
    table is a dozen ZooKeeper round trips, so 2,000 tables one at a time take minutes of
    set-up before a run; in parallel they take seconds. Replicas in turn, not at once:
    18.16 hung (10 minutes, until restarted) dropping a table on one replica while the
    other dropped it too. The first error is raised after every connection has
    finished."""
    from concurrent.futures import ThreadPoolExecutor

    def lane(port: int, chunk: Sequence[str]) -> None:
        client = ch_client(host, port)
        try:
            for statement in chunk:
                client.execute(statement)
        finally:
            client.disconnect()

    width = max(1, min(connections, len(statements)))
    chunks = [statements[i::width] for i in range(width)] if statements else []
    for port in ports:
        with ThreadPoolExecutor(max_workers=width) as pool:
            futures = [pool.submit(lane, port, chunk) for chunk in chunks]
        for f in futures:
            f.result()


def create_tables(clients: Sequence[Any], database: str, names: Sequence[str],
                  replicated: bool = True) -> None:
    for c in clients:
        c.execute(f"CREATE DATABASE IF NOT EXISTS {database}")
        for name in names:
            engine = (f"ReplicatedMergeTree('/clickhouse/tables/{{shard}}/{database}/{name}', "
                      "'{replica}')" if replicated else "MergeTree()")
            c.execute(f"CREATE TABLE IF NOT EXISTS {database}.{name} ({COLUMNS}) "
                      f"ENGINE = {engine} ORDER BY id")
