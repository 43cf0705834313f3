"""A multi-table workload with unique row ids, and what it takes to check it.

:class:`Workload` owns one run's names (database, topic, schema topic, group), creates
the ClickHouse tables on both replicas (``ReplicatedMergeTree``, so identical blocks
are deduplicated), registers every table's row type (``bench/row.proto``'s 10-field
``Event``) in a schema topic of its own, creates the data topic, and produces
``blockagg.v1.Envelope`` messages whose rows carry ids unique over the whole run.

What was produced is recorded from the producer's **delivery reports** (only messages
the broker acknowledged count): per table the ids, and for dead letters the
``(topic, partition, offset)`` of every deliberately bad message. Those records are
the checker's ground truth (:mod:`tests.faults.checker`). The producer is idempotent
(``enable.idempotence``), so a producer retry during a broker fault never writes a
message twice: a duplicate found later is the job's, never the producer's.

Rows are built fast enough for millions: a pool of pre-serialized row tails (fields
2..10, seeded) is prefixed with field 1 (the id), which is the canonical protobuf
encoding of the whole ``Event``.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from blockagg.aggregator.clickhouse.deadletters import dead_letter_ddl
from blockagg.proto.descriptors import compile_proto, load_descriptor, message_class
from blockagg.proto.envelope import make_envelope
from blockagg.proto.registry import KafkaStore, MemoryStore, register

REPO_ROOT = Path(__file__).resolve().parents[2]
ROW_PROTO = REPO_ROOT / "bench" / "row.proto"
ROW_MESSAGE = "blockagg.bench.Event"

COLUMNS = (
    "id UInt64, user Int32, delta Int64, price Float64, score Float32, name String, "
    "country String, time DateTime, "
    "kind Enum8('KIND_UNSPECIFIED' = 0, 'KIND_VIEW' = 1, 'KIND_CLICK' = 2, 'KIND_BUY' = 3), "
    "tags Array(Int64)"
)
"""The 10 columns of a benchmark/fault table, matching ``Event`` field for field."""

COORDINATES = "_topic String, _partition UInt32, _offset UInt64"
"""Kafka-coordinate columns (filled by the block writer) that make a table auditable by
``arv audit``; the fault tables have them, the benchmark tables keep the 10 columns."""

BAD_ENVELOPE = b"\xff\xfe not an envelope"


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        bits = n & 0x7F
        n >>= 7
        if n:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def row_descriptor_set() -> bytes:
    return compile_proto(ROW_PROTO)


def random_events(count: int, seed: int) -> list[Any]:
    """``count`` ``Event`` messages with every field but the id (field 1) set, seeded:
    the row pool of both the fault workload and the benchmark workload."""
    cls: Any = message_class(load_descriptor(row_descriptor_set(), ROW_MESSAGE))
    rng = random.Random(seed)
    countries = ["DE", "FR", "US", "JP", "BR", "IN", "", "GB"]
    events = []
    for i in range(count):
        msg = cls()
        msg.user = rng.randrange(0, 5_000_000)
        msg.delta = rng.randrange(-10_000, 10_000)
        msg.price = rng.random() * 1000
        msg.score = rng.random()
        msg.name = f"user-{rng.randrange(100000)}-event"
        msg.country = rng.choice(countries)
        msg.time.seconds = 1_700_000_000 + i
        msg.kind = rng.randrange(4)
        msg.tags.extend(rng.randrange(1 << 40) for _ in range(rng.randrange(4)))
        events.append(msg)
    return events


def row_tails(count: int, seed: int) -> list[bytes]:
    """``count`` serialized ``Event``s without the id (field 1), seeded."""
    return [msg.SerializeToString() for msg in random_events(count, seed)]


@dataclass
class Produced:
    """Ground truth from delivery reports."""

    ids: dict[str, list[np.ndarray[Any, Any]]] = field(default_factory=dict)
    dead: set[tuple[str, int, int]] = field(default_factory=set)
    messages: int = 0
    rows: int = 0
    bytes: int = 0
    failures: list[str] = field(default_factory=list)

    def ids_of(self, table: str) -> np.ndarray[Any, Any]:
        parts = self.ids.get(table, [])
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)


@dataclass
class Workload:
    """One run's names and its producer. ``tables`` tables named ``t000``...; every
    ``dead_every``-th message (0 = none) is a bad envelope (a dead letter)."""

    bootstrap: str
    ch_host: str
    ch_ports: Sequence[int]
    tables: int = 10
    partitions: int = 4
    rows_per_message: int = 10
    dead_every: int = 0
    seed: int = 1
    run: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    produced: Produced = field(default_factory=Produced)
    _next_id: int = 1
    _counter: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.tails = row_tails(512, self.seed)
        self._producer: Any = None

    # -- names ---------------------------------------------------------------------

    @property
    def database(self) -> str:
        return f"fx_{self.run}"

    @property
    def topic(self) -> str:
        return f"fx-{self.run}"

    @property
    def schema_topic(self) -> str:
        return f"_blockagg_schemas_fx_{self.run}"

    @property
    def group(self) -> str:
        return f"blockagg-fx-{self.run}"

    @property
    def dead_letter_table(self) -> str:
        return f"{self.database}.dead_letters"

    def table_names(self) -> list[str]:
        return [f"{self.database}.t{i:03d}" for i in range(self.tables)]

    # -- setup ---------------------------------------------------------------------

    def clients(self) -> list[Any]:
        from clickhouse_driver import Client

        return [Client(self.ch_host, port=p, connect_timeout=5, send_receive_timeout=120)
                for p in self.ch_ports]

    def setup(self, replicated: bool = True) -> None:
        """Tables on every replica, schemas registered, topic created."""
        for client in self.clients():
            client.execute(f"CREATE DATABASE IF NOT EXISTS {self.database}")
            for name in self.table_names():
                short = name.split(".", 1)[1]
                engine = (f"ReplicatedMergeTree('/clickhouse/tables/{{shard}}/{self.database}/"
                          f"{short}', '{{replica}}')" if replicated else "MergeTree()")
                client.execute(f"CREATE TABLE IF NOT EXISTS {name} ({COLUMNS}, {COORDINATES}) "
                               f"ENGINE = {engine} ORDER BY id")
            client.execute(dead_letter_ddl(self.dead_letter_table, replicated=replicated))
            client.disconnect()
        self.register_schemas()
        self.create_topic()

    def register_schemas(self) -> None:
        """All tables in one pass: registrations computed in memory, then written."""
        fds = row_descriptor_set()
        memory = MemoryStore()
        for name in self.table_names():
            register(memory, name, ROW_MESSAGE, fds)
        store = KafkaStore({"bootstrap.servers": self.bootstrap}, self.schema_topic)
        store.ensure_topic()
        for key, value in memory.read():
            assert key is not None and value is not None
            store.write(key, value)

    def create_topic(self, timeout: float = 60.0) -> None:
        from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        futures = admin.create_topics([NewTopic(self.topic, num_partitions=self.partitions,
                                                replication_factor=1)])
        for fut in futures.values():
            fut.result(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            md = admin.list_topics(self.topic, timeout=10).topics.get(self.topic)
            if md is not None and md.error is None and len(md.partitions) == self.partitions \
                    and all(p.leader >= 0 for p in md.partitions.values()):
                return
            time.sleep(0.2)
        raise TimeoutError(f"topic {self.topic} has no leaders after {timeout}s")

    def drop(self) -> None:
        for client in self.clients():
            client.execute(f"DROP DATABASE IF EXISTS {self.database}")
            client.disconnect()

    # -- producing -----------------------------------------------------------------

    def producer(self) -> Any:
        if self._producer is None:
            from confluent_kafka import Producer

            self._producer = Producer({
                "bootstrap.servers": self.bootstrap, "enable.idempotence": True,
                "acks": "all", "linger.ms": 20, "batch.size": 1 << 20,
                "compression.type": "lz4", "message.timeout.ms": 600_000,
                "queue.buffering.max.messages": 1_000_000,
            })
        return self._producer

    def _delivery(self, table: str | None, ids: np.ndarray[Any, Any] | None
                  ) -> Callable[[Any, Any], None]:
        produced = self.produced

        def done(err: Any, msg: Any) -> None:
            if err is not None:
                produced.failures.append(str(err))
                return
            produced.messages += 1
            produced.bytes += len(msg.value())
            if table is None:
                produced.dead.add((msg.topic(), msg.partition(), msg.offset()))
            else:
                assert ids is not None
                produced.ids.setdefault(table, []).append(ids)
                produced.rows += len(ids)

        return done

    def message(self) -> tuple[str | None, np.ndarray[Any, Any] | None, bytes]:
        """The next message (seeded): a table's envelope with fresh ids, or a dead one."""
        i = self._counter
        self._counter += 1
        if self.dead_every and i % self.dead_every == self.dead_every - 1:
            return None, None, BAD_ENVELOPE + str(i).encode()
        table = f"{self.database}.t{self.rng.randrange(self.tables):03d}"
        first = self._next_id
        self._next_id += self.rows_per_message
        ids = np.arange(first, first + self.rows_per_message, dtype=np.uint64)
        tails = self.tails
        rows = [b"\x08" + varint(int(n)) + tails[int(n) % len(tails)] for n in ids]
        return table, ids, make_envelope(table, rows, version=1)

    def produce(self, messages: int, rate: float = 0.0, flush_timeout: float = 300.0) -> None:
        """Produce ``messages`` messages round-robin over the partitions; ``rate``
        messages/s (0 = as fast as possible). Waits for every delivery report."""
        producer = self.producer()
        started = time.monotonic()
        for n in range(messages):
            table, ids, value = self.message()
            partition = self._counter % self.partitions
            while True:
                try:
                    producer.produce(self.topic, value=value, partition=partition,
                                     on_delivery=self._delivery(table, ids))
                    break
                except BufferError:
                    producer.poll(0.1)
            producer.poll(0)
            if rate > 0:
                ahead = (n + 1) / rate - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
        left = producer.flush(flush_timeout)
        if left:
            raise TimeoutError(f"{left} messages not delivered after {flush_timeout}s")
        if self.produced.failures:
            raise RuntimeError(f"delivery failed: {self.produced.failures[:3]}")

    def job_config(self, path: Path, checkpoint: Path, replicas: Sequence[str],
                   extra: str = "", quorum: int = 2) -> Path:
        """A job TOML for this workload (the keys of ``docs/configuration.md``)."""
        text = f"""
[job]
name = "{self.group}"
metadata_group_id = "{self.group}"
checkpoint_location = "{checkpoint}"
trigger_interval = "1s"
starting_offsets = "earliest"

[[topics]]
name = "{self.topic}"
replicas = [{", ".join(f'"{r}"' for r in replicas)}]

[clickhouse]
database = "{self.database}"
insert_quorum = {quorum}

[kafka]
"bootstrap.servers" = "{self.bootstrap}"

[schemas]
topic = "{self.schema_topic}"

[dead_letters]
table = "{self.dead_letter_table}"
max_rate = 1.0

[metrics]
port = 0
{extra}
"""
        path.write_text(text)
        return path
