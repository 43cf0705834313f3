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
encoding of the whole ``Event``. A row's every value is therefore a function of its id
(the tail is ``id % 512``), which is what lets the checker compare values, not only ids.

Schemas change while the job runs (:meth:`Workload.schema_change`, the ``schema_change``
fault): a table gets a column (``ALTER TABLE ... ADD COLUMN xN Int64 DEFAULT d`` on every
replica, then ``ba-schema register`` of ``Event`` with field ``xN``), a new version
(``Event`` moved to another package: the same fields), or a new table joins the stream.
Producers pin the version they write (``schema_version = N``) and switch to the new one
right after the registration; the first id each table's producer wrote under each
schema is recorded, so the value of every row, the added columns included, is known:
a row written before a column's version holds its ``DEFAULT``, a row written after,
``id * factor % 1000003``.

Two shards (eBay's layout, :attr:`Workload.other_shards`): one multi-table topic per
shard, ``fx-<run>`` for shard 1 and ``fx-<run>-s<k>`` for shard ``k``; every table (and
the dead-letter table) exists on every replica of every shard, each message goes to one
shard's topic (drawn, seeded, on a generator of its own, so a one-shard run draws its
tables exactly as before), and the ground truth is kept per shard: a shard must hold
exactly what was produced to its topic.

A run outlives its process (:meth:`Workload.resume`): everything above is rebuilt from
what the run left in Kafka, the data topic (every message once: the producer is
idempotent) and the schema topic, so a run whose harness was killed with its whole stack
continues on the same tables, topic and job, and its checks then hold the job to every
message in the topic.
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from blockagg.aggregator.kafka.log_store import KafkaStore
from blockagg.proto.descriptors import compile_proto, load_descriptor, message_class
from blockagg.proto.envelope import Envelopes, make_envelope, parse_envelopes
from blockagg.proto.registry import MemoryStore, Registration, Registry
from blockagg.registration.register import register
from blockagg.rows.deadletters import dead_letter_ddl

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

COORDINATES = "_topic String, _partition UInt32, _offset UInt64, _incarnation UInt64 DEFAULT 0"
"""Kafka-coordinate columns (filled by the block writer) that make a table auditable by
``arv audit``; the fault tables have them, the benchmark tables keep the 10 columns.
``_incarnation`` tells a recreated topic's rows (the ``topic_recreate`` fault) from the
old incarnation's at the same coordinates, where the writer fills it; a writer that does
not know it leaves the server's ``DEFAULT 0``."""

BAD_ENVELOPE = b"\xff\xfe not an envelope"


SCHEMAS_REFRESH_S = 10.0
"""``[schemas] refresh_interval`` of the job (:meth:`Workload.job_config` keeps the default)."""

ADDED_MODULUS = 1_000_003
"""An added column's value in a row of id ``i``: ``i * factor % ADDED_MODULUS``."""

ALTER_WAIT_S = 15
"""How long a replicated ``ADD COLUMN`` waits for the shard's other replica
(``replication_alter_columns_timeout``, 60 s on the server) before the harness applies
18.16's remedy to a replica that has not applied it (``Workload._add_column``)."""


@dataclass(frozen=True)
class AddedField:
    """A field (and its ``Int64`` column) added to a table's ``Event`` after v1."""

    column: str
    number: int
    default: int
    factor: int

    def value(self, row_id: int) -> int:
        return row_id * self.factor % ADDED_MODULUS


@dataclass(frozen=True)
class TableSchema:
    """What a table's producer writes now: the version it pins, the package of its
    ``Event`` (a new version may only move it) and the fields added since v1."""

    version: int = 1
    package: str = "blockagg.bench"
    added: tuple[AddedField, ...] = ()

    def encode_added(self, row_id: int) -> bytes:
        return b"".join(varint(f.number << 3) + varint(f.value(row_id)) for f in self.added)


V1 = TableSchema()


def added_field(column: str, number: int) -> AddedField:
    """The added field ``column`` (``x<n>``, made by the run's ``n``-th schema change)
    with field ``number``: its default and factor follow from ``n``."""
    n = int(column[1:])
    return AddedField(column, number, 1000 + n, 3 + n)


def table_schema(version: int, message_name: str, fields: Iterable[tuple[str, int]]
                 ) -> TableSchema:
    """A registered version of ``Event`` as a :class:`TableSchema`: its package, and
    the fields beyond the 10 of v1 (``fields``: name, number) as added ones."""
    added = tuple(added_field(name, number) for name, number in fields if number > 10)
    return TableSchema(version, message_name.rsplit(".", 1)[0], added)


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


def evolved_descriptor_set(schema: TableSchema) -> bytes:
    """``Event``'s descriptor set with ``schema``'s package and added ``int64`` fields."""
    from google.protobuf import descriptor_pb2

    fds = descriptor_pb2.FileDescriptorSet.FromString(row_descriptor_set())
    old = "blockagg.bench"
    for f in fds.file:
        if f.package != old:
            continue
        f.package = schema.package
        f.name = schema.package.replace(".", "/") + "/row.proto"
        for msg in f.message_type:
            for fd in msg.field:
                if fd.type_name.startswith(f".{old}."):
                    fd.type_name = f".{schema.package}." + fd.type_name[len(old) + 2:]
            if msg.name == "Event":
                for a in schema.added:
                    msg.field.add(name=a.column, number=a.number, json_name=a.column,
                                  type=descriptor_pb2.FieldDescriptorProto.TYPE_INT64,
                                  label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    data: bytes = fds.SerializeToString()
    return data


def row_tails(count: int, seed: int) -> list[bytes]:
    """``count`` serialized ``Event``s without the id (field 1), seeded."""
    return [msg.SerializeToString() for msg in random_events(count, seed)]


@dataclass
class Produced:
    """Ground truth from delivery reports. ``ids`` per ``(shard, table)`` (shard 0 is the
    first; a one-shard run has only 0); dead letters by coordinate, whose topic names
    the shard.

    The producing thread adds to it while other streams' threads read it: readers
    iterate a snapshot (``tuple`` of a set or dict view is taken in one step under the
    GIL), never the live container, which raises "changed size during iteration"."""

    ids: dict[tuple[int, str], list[np.ndarray[Any, Any]]] = field(default_factory=dict)
    dead: set[tuple[str, int, int]] = field(default_factory=set)
    kept_dead: Counter[tuple[str, int, int]] = field(default_factory=Counter)
    """Dead letters of earlier incarnations of the topic (``topic_recreate``) that were
    stored before it was deleted, per coordinate: a new incarnation's dead letter may
    have the same ``(topic, partition, offset)``, so each is expected that many times
    more."""
    messages: int = 0
    rows: int = 0
    bytes: int = 0
    failures: list[str] = field(default_factory=list)

    def ids_of(self, table: str, shard: int | None = None) -> np.ndarray[Any, Any]:
        """The ids of ``table`` produced to ``shard``'s topic (``None``: every shard's)."""
        parts = [a for (s, t), arrays in tuple(self.ids.items())
                 if t == table and shard in (None, s) for a in tuple(arrays)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)

    def count_of(self, table: str, shard: int) -> int:
        return sum(int(a.size) for a in tuple(self.ids.get((shard, table), [])))

    def dead_count(self, topic: str) -> int:
        """Dead letters produced to ``topic``, those kept from its earlier incarnations
        included."""
        return (sum(1 for c in tuple(self.dead) if c[0] == topic)
                + sum(n for c, n in tuple(self.kept_dead.items()) if c[0] == topic))


LEADERS_SETTLING = frozenset({"NOT_LEADER_FOR_PARTITION", "LEADER_NOT_AVAILABLE",
                              "UNKNOWN_TOPIC_OR_PART", "NOT_COORDINATOR",
                              "COORDINATOR_LOAD_IN_PROGRESS", "COORDINATOR_NOT_AVAILABLE",
                              "_TIMED_OUT", "REQUEST_TIMED_OUT", "_UNKNOWN_PARTITION",
                              "_UNKNOWN_TOPIC"})
"""Errors of a request that met a cluster whose leaders are still being elected: a
topic just created on three brokers, a leader just killed, or a client whose metadata
does not list the new topic's partitions yet (librdkafka's local ``_UNKNOWN_PARTITION``).
The operator retries."""


def while_leaders_settle(action: Callable[[], Any], timeout: float,
                         sleep: Callable[[float], None] = time.sleep) -> Any:
    """``action()``, retried for up to ``timeout`` s while it fails with one of
    :data:`LEADERS_SETTLING` (the long run's harness died of ``NOT_LEADER_FOR_PARTITION``
    reading a recreated topic's watermarks, half-way through ``topic_recreate``'s
    procedure)."""
    from confluent_kafka import KafkaError, KafkaException

    deadline = time.monotonic() + timeout
    while True:
        try:
            return action()
        except KafkaException as exc:
            error = exc.args[0] if exc.args else None
            name = error.name() if isinstance(error, KafkaError) else ""
            if name not in LEADERS_SETTLING or time.monotonic() > deadline:
                raise
            sleep(0.5)


def accepted_rows(envelopes: Envelopes) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The rows of the envelopes that parse (a rejected one has none): each row's
    message (its index in the chunk) and its id (field 1, this workload's first bytes)."""
    counts = envelopes.row_hi - envelopes.row_lo
    message = np.repeat(np.arange(len(envelopes)), counts)
    row = np.repeat(envelopes.row_lo - np.cumsum(counts) + counts, counts) + np.arange(
        int(counts.sum()))
    starts, buf = envelopes.row_starts[row], envelopes.buf
    if starts.size and not np.all(buf[starts] == 0x08):
        raise ValueError("a row does not start with field 1 (the id): not this workload's")
    ids = np.zeros(starts.size, dtype=np.uint64)
    going = np.ones(starts.size, dtype=np.bool_)
    for k in range(10):
        byte = buf[starts + 1 + k].astype(np.uint64)
        ids[going] |= (byte[going] & np.uint64(0x7F)) << np.uint64(7 * k)
        going &= (byte & np.uint64(0x80)) != 0
        if not going.any():
            break
    return message, ids


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
    other_shards: Sequence[Sequence[int]] = ()
    """The replicas' ports of every shard after the first (``ch_ports``): with any, the
    run has one topic per shard (module docstring)."""
    run: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    produced: Produced = field(default_factory=Produced)
    _next_id: int = 1
    _counter: int = 0
    # per table: what its producer writes now (absent: V1), replaced whole on a change
    schemas: dict[str, TableSchema] = field(default_factory=dict)
    # per table: (first id written, schema) at each schema its producer switched to
    switches: dict[str, list[tuple[int, TableSchema]]] = field(default_factory=dict)
    changed: set[str] = field(default_factory=set)  # tables whose values the checker reads
    schema_changes: int = 0
    reattached: list[tuple[str, int]] = field(default_factory=list)  # (table, replica)
    recreations: int = 0  # times the topic was deleted and recreated (``topic_recreate``)

    def __post_init__(self) -> None:
        self._initial_tables = self.tables
        # held by :meth:`produce` and across a topic's deletion and recreation
        self.topic_lock = threading.RLock()
        self.rng = random.Random(self.seed)
        # the shard of each message: its own generator, so the table draws don't change
        self.shard_rng = random.Random(self.seed * 7919 + 1)
        self.events = random_events(512, self.seed)
        self.tails = [msg.SerializeToString() for msg in self.events]
        self._producer: Any = None

    # -- names ---------------------------------------------------------------------

    @property
    def database(self) -> str:
        return f"fx_{self.run}"

    @property
    def topic(self) -> str:
        """Shard 1's topic (the only one of a one-shard run)."""
        return f"fx-{self.run}"

    @property
    def shards(self) -> int:
        return 1 + len(self.other_shards)

    @property
    def topics(self) -> list[str]:
        """One topic per shard, in shard order."""
        return [self.topic, *(f"{self.topic}-s{k + 2}" for k in range(len(self.other_shards)))]

    def shard_of_topic(self, topic: str) -> int:
        try:
            return self.topics.index(topic)
        except ValueError:
            raise ValueError(f"topic {topic!r} is not one of this run's {self.topics}") from None

    @property
    def shard_ports(self) -> list[tuple[int, ...]]:
        """Each shard's replicas' native ports, in shard order."""
        return [tuple(self.ch_ports), *(tuple(p) for p in self.other_shards)]

    @property
    def replica_shards(self) -> list[int]:
        """The shard of each replica, in :meth:`clients` order."""
        return [s for s, ports in enumerate(self.shard_ports) for _ in ports]

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
        """One client per replica of every shard (shard order, then replica order): DDL
        goes to all of them, the checks compare each with its shard's topic."""
        from clickhouse_driver import Client

        return [Client(self.ch_host, port=p, connect_timeout=5, send_receive_timeout=120)
                for ports in self.shard_ports for p in ports]

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

    def create_topic(self, timeout: float = 60.0, create: bool = True) -> None:
        """Create the data topics (``create``), one per shard, and wait until every
        partition has a leader.
        Its replication factor and ``min.insync.replicas`` are the broker's defaults: 1 on a
        single broker, 3 and 2 on the three-broker stack (the job's start-up durability
        check refuses less there)."""
        from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        if create:
            futures = admin.create_topics([NewTopic(t, num_partitions=self.partitions,
                                                    replication_factor=-1)
                                           for t in self.topics])
            for fut in futures.values():
                fut.result(timeout)
        deadline = time.monotonic() + timeout
        for topic in self.topics:
            while True:
                md = admin.list_topics(topic, timeout=10).topics.get(topic)
                if md is not None and md.error is None and len(md.partitions) == self.partitions \
                        and all(p.leader >= 0 for p in md.partitions.values()):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"topic {topic} has no leaders after {timeout}s")
                time.sleep(0.2)

    def drop(self) -> None:
        for client in self.clients():
            client.execute(f"DROP DATABASE IF EXISTS {self.database}")
            client.disconnect()

    # -- producing -----------------------------------------------------------------

    def producer(self) -> Any:
        if self._producer is None:
            from confluent_kafka import Producer

            from blockagg.logs import kafka_client_config

            # through the logging setup: it outlives the suite's stacks until exit
            self._producer = Producer(kafka_client_config({
                "bootstrap.servers": self.bootstrap, "enable.idempotence": True,
                "acks": "all", "linger.ms": 20, "batch.size": 1 << 20,
                "compression.type": "lz4", "message.timeout.ms": 600_000,
                "queue.buffering.max.messages": 1_000_000,
            }))
        return self._producer

    def _delivery(self, table: str | None, ids: np.ndarray[Any, Any] | None, shard: int = 0
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
                produced.ids.setdefault((shard, table), []).append(ids)
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
        schema = self.schemas.get(table, V1)
        if schema is not V1:
            seen = self.switches.setdefault(table, [])
            if not seen or seen[-1][1] is not schema:
                seen.append((first, schema))
            rows = [b"\x08" + varint(int(n)) + tails[int(n) % len(tails)]
                    + schema.encode_added(int(n)) for n in ids]
        else:
            rows = [b"\x08" + varint(int(n)) + tails[int(n) % len(tails)] for n in ids]
        return table, ids, make_envelope(table, rows, version=schema.version)

    def route(self) -> tuple[int, str | None, np.ndarray[Any, Any] | None, bytes]:
        """The next message (:meth:`message`) and the shard whose topic it goes to: drawn
        on :attr:`shard_rng` with two shards (the table draws stay a one-shard run's), 0
        with one."""
        shard = self.shard_rng.randrange(self.shards) if self.shards > 1 else 0
        return (shard, *self.message())

    def produce(self, messages: int, rate: float = 0.0, flush_timeout: float = 300.0) -> None:
        """Produce ``messages`` messages round-robin over the partitions; ``rate``
        messages/s (0 = as fast as possible). Waits for every delivery report. Never
        while the topic is being recreated (:meth:`producing`)."""
        with self.topic_lock:
            self._produce(messages, rate, flush_timeout)

    @contextlib.contextmanager
    def producing(self) -> Iterator[None]:
        """Nothing is produced in the ``with`` body (the topic is deleted and recreated
        there); a produce call in progress finishes first."""
        with self.topic_lock:
            yield

    def _produce(self, messages: int, rate: float, flush_timeout: float) -> None:
        producer = self.producer()
        started = time.monotonic()
        for n in range(messages):
            shard, table, ids, value = self.route()
            partition = self._counter % self.partitions
            while True:
                try:
                    producer.produce(self.topics[shard], value=value, partition=partition,
                                     on_delivery=self._delivery(table, ids, shard))
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

    # -- schema changes while the job runs (the ``schema_change`` fault) ------------

    def schema_change(self, rng: random.Random, folder: Path, timeout: float = 180.0,
                      warm: bool = True) -> dict[str, Any]:
        """One change: ``add_column`` (ALTER on every replica, then register the version
        with the field), ``new_table`` or ``new_version`` (``Event`` moved to another
        package): the run's first three changes are these in this order, later ones drawn
        with ``rng``. Producers switch to it once it is registered. Retries while a
        replica, ZooKeeper or the broker is coming back (``timeout``); with ``warm``,
        first waits until the table to change holds rows (the job knows it)."""
        folder.mkdir(parents=True, exist_ok=True)
        self.schema_changes += 1
        n = self.schema_changes
        actions = ["add_column", "new_table", "new_version"]
        action = actions[n - 1] if n <= len(actions) else rng.choice(actions)
        if action == "new_table":
            return {"action": action, "table": self.add_table(folder, timeout)}
        table = rng.choice(self.table_names())
        if action == "add_column":
            return {"action": action, **self.add_column(table, folder, timeout, warm, n=n)}
        if warm:
            _retry(lambda: self._has_rows(table), timeout, f"waiting for rows of {table}")
        old = self.schemas.get(table, V1)
        new = replace(old, version=old.version + 1, package=f"blockagg.bench.v{n}")
        _retry(lambda: self._register(table, new, folder), timeout,
               f"registering version {new.version} of {table}")
        self.changed.add(table)
        self.schemas = {**self.schemas, table: new}  # the producer writes it from now on
        return {"action": action, "table": table, "version": new.version}

    def add_table(self, folder: Path, timeout: float = 180.0) -> str:
        """A table joins the stream while the job runs (``new_table``, the ``table_added``
        fault): ``CREATE TABLE`` on every replica (the run's columns and coordinates),
        ``ba-schema register`` of ``Event`` as its v1, then the producer draws it. Its
        values are checked like a changed table's."""
        folder.mkdir(parents=True, exist_ok=True)
        table = f"{self.database}.t{self.tables:03d}"
        _retry(lambda: self._create_table(table), timeout, f"creating {table}")
        _retry(lambda: self._register(table, V1, folder), timeout, f"registering {table}")
        self.changed.add(table)
        self.tables += 1  # the producer draws it from now on
        return table

    def add_column(self, table: str, folder: Path, timeout: float = 180.0,
                   warm: bool = True, n: int | None = None) -> dict[str, Any]:
        """``ALTER TABLE table ADD COLUMN x<n> Int64 DEFAULT d`` on every replica, then
        (once the job's copies of the columns expired) the version with field ``x<n>``
        registered; the producer writes it from then on. Without ``n`` (the
        ``alter_during_stall`` fault) it is the run's next schema change."""
        folder.mkdir(parents=True, exist_ok=True)
        if n is None:
            self.schema_changes += 1
            n = self.schema_changes
        # The job has stored rows of the table, so its long-lived workers know the table
        # (its columns, its version) before it changes.
        if warm:
            _retry(lambda: self._has_rows(table), timeout, f"waiting for rows of {table}")
        old = self.schemas.get(table, V1)
        reattached = len(self.reattached)
        added = AddedField(f"x{n}", 10 + len(old.added) + 1, 1000 + n, 3 + n)
        new = replace(old, version=old.version + 1, added=(*old.added, added))
        _retry(lambda: self._add_column(table, added), timeout,
               f"adding column {added.column} to {table}")
        # The job's workers re-read a table's columns every [schemas]
        # refresh_interval: register once copies from before the ALTER have expired
        # (docs/schemas.md, "Evolving a table while the job runs").
        time.sleep(SCHEMAS_REFRESH_S + 0.5)
        _retry(lambda: self._register(table, new, folder), timeout,
               f"registering version {new.version} of {table}")
        self.changed.add(table)
        self.schemas = {**self.schemas, table: new}  # the producer writes it from now on
        return {"table": table, "version": new.version, "column": added.column,
                **({"reattached": [f"r{r + 1}" for _, r in self.reattached[reattached:]]}
                   if len(self.reattached) > reattached else {})}

    # -- the topic deleted and recreated under the job (``topic_recreate``) ---------

    def stored(self, timeout: float = 120.0
               ) -> tuple[dict[tuple[int, str], np.ndarray[Any, Any]],
                          Counter[tuple[str, int, int]]]:
        """What ClickHouse holds now, after ``SYSTEM SYNC REPLICA`` on every replica:
        per (shard, table) the ids stored on any replica of the shard, and the dead
        letters per coordinate (the most any replica of its topic's shard holds)."""
        ids: dict[tuple[int, str], np.ndarray[Any, Any]] = {}
        dead: Counter[tuple[str, int, int]] = Counter()
        clients = self.clients()
        try:
            for client in clients:
                for table in [*self.table_names(), self.dead_letter_table]:
                    client.execute(f"SYSTEM SYNC REPLICA {table}",
                                   settings={"receive_timeout": int(timeout)})
            for shard, client in zip(self.replica_shards, clients, strict=True):
                for table in self.table_names():
                    columns = client.execute(f"SELECT id FROM {table}", columnar=True)
                    got = np.asarray(columns[0] if columns else [], dtype=np.uint64)
                    key2 = (shard, table)
                    ids[key2] = np.union1d(ids.get(key2, np.zeros(0, np.uint64)), got)
                rows = client.execute(
                    f"SELECT topic, partition, offset, count() FROM {self.dead_letter_table} "
                    "GROUP BY topic, partition, offset")
                for t, part, off, n in rows:
                    key = (str(t), int(part), int(off))
                    if str(t) in self.topics and self.shard_of_topic(str(t)) != shard:
                        continue  # another shard's: the check reports it as foreign there
                    dead[key] = max(dead[key], int(n))
        finally:
            for c in clients:
                c.disconnect()
        return ids, dead

    def retire_incarnation(self, ids: Mapping[tuple[int, str], np.ndarray[Any, Any]],
                           dead: Counter[tuple[str, int, int]]) -> dict[str, int]:
        """The topic is about to be deleted with the job stopped: what the job stored
        of it (``ids``, ``dead``: :meth:`stored`) stays expected exactly once, and what
        it had not stored yet went with the topic (the procedure's documented loss,
        docs/protocol.md): no longer expected, and found later it is foreign. Returns
        the rows and dead letters kept and lost. Every shard's topic is recreated
        together, so this holds per (shard, table)."""
        kept_rows = lost_rows = 0
        for key, parts in list(self.produced.ids.items()):
            want = np.concatenate(parts) if parts else np.zeros(0, np.uint64)
            kept = np.intersect1d(want, ids.get(key, np.zeros(0, np.uint64)))
            kept_rows += int(kept.size)
            lost_rows += int(want.size - kept.size)
            self.produced.ids[key] = [kept]
        stored_now = {c for c in self.produced.dead if dead[c] > self.produced.kept_dead[c]}
        lost_dead = len(self.produced.dead) - len(stored_now)
        self.produced.kept_dead.update(stored_now)
        self.produced.dead = set()
        self.produced.rows = kept_rows
        self.recreations += 1
        return {"rows_kept": kept_rows, "rows_lost": lost_rows,
                "dead_kept": len(stored_now), "dead_lost": lost_dead}

    def save_retired(self, path: Path) -> None:
        """Right after :meth:`retire_incarnation`: what a resumed run can't read back from
        the new topic (:meth:`restore`), the old incarnations' rows and dead letters still
        expected and each table's first id per schema version (its values)."""
        keys = [(s, t) for s in range(self.shards) for t in self.table_names()
                if self.produced.count_of(t, s)]
        first = sorted({(t, schema.version, first) for t, seen in self.switches.items()
                        for first, schema in seen})
        meta = {"tables": [t for _, t in keys], "shards": [s for s, _ in keys],
                "first": first, "next_id": self._next_id, "recreations": self.recreations,
                "dead": [[*c, n] for c, n in sorted(self.produced.kept_dead.items())]}
        tmp = path.with_name(path.name + ".tmp.npz")
        # arr_0 the meta, arr_<i + 1> the ids of tables[i] on shards[i]
        np.savez(tmp, np.array(json.dumps(meta)),
                 *[self.produced.ids_of(t, s) for s, t in keys])
        tmp.replace(path)

    def recreate_topic(self, timeout: float = 120.0) -> None:
        """Delete the data topics (every shard's), wait until the broker forgot them,
        create them again (same names and partitions: new topic ids, offsets from 0),
        and start a new producer (the idempotent producer's sequence numbers were the
        old topics')."""
        from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

        if self._producer is not None:
            self._producer.flush(60)
            self._producer = None
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        for topic in self.topics:
            admin.delete_topics([topic])[topic].result(timeout)
        deadline = time.monotonic() + timeout
        for topic in self.topics:
            while True:
                try:
                    admin.create_topics([NewTopic(topic, num_partitions=self.partitions,
                                                  replication_factor=-1)])[topic].result(30)
                    break
                except Exception as exc:  # still being deleted
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"topic {topic} not recreated after {timeout}s: "
                                           f"{exc}") from exc
                    time.sleep(0.5)
        self.create_topic(timeout, create=False)

    def reset_group_to_earliest(self, timeout: float = 60.0) -> dict[int | str, int]:
        """What ``kafka-consumer-groups.sh --group <metadata group> --topic <topic>
        --reset-offsets --to-earliest --execute`` does, for every shard's topic: the
        group's offset of every partition set to the partition's earliest offset, without
        metadata (a foreign commit); returns them per partition (one shard) or per
        ``topic[partition]``."""
        from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, TopicPartition
        from confluent_kafka.admin import AdminClient

        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": self.group,
                             "enable.auto.commit": False})
        def low(topic: str, partition: int) -> int:
            def watermarks() -> tuple[int, int]:
                # a fresh metadata request first: a client that met the topic before
                # it was recreated keeps its partitions unknown otherwise
                consumer.list_topics(topic, timeout=timeout)
                return tuple(consumer.get_watermark_offsets(  # type: ignore[return-value]
                    TopicPartition(topic, partition), timeout=timeout))

            return int(while_leaders_settle(watermarks, timeout)[0])

        try:
            earliest = {(t, p): low(t, p) for t in self.topics for p in range(self.partitions)}
        finally:
            consumer.close()
        admin = AdminClient({"bootstrap.servers": self.bootstrap})

        def alter() -> Any:
            [future] = admin.alter_consumer_group_offsets([ConsumerGroupTopicPartitions(
                self.group, [TopicPartition(t, p, o) for (t, p), o in earliest.items()])
            ]).values()
            return future.result(timeout)

        for moved in while_leaders_settle(alter, timeout).topic_partitions:
            if moved.error is not None:
                raise RuntimeError(f"resetting {self.group} on {moved.topic}[{moved.partition}] "
                                   f"to {earliest[moved.topic, moved.partition]}: {moved.error}")
        if self.shards == 1:
            return {p: o for (_, p), o in earliest.items()}
        return {f"{t}[{p}]": o for (t, p), o in earliest.items()}

    # -- resuming a run (its harness and stack killed, its data kept) ---------------

    @classmethod
    def resume(cls, run: str, bootstrap: str, ch_host: str, ch_ports: Sequence[int],
               initial_tables: int, retired: Path | None = None, **kwargs: Any) -> Workload:
        """The workload of run ``run`` as its topics left it (:meth:`restore`): the
        schema topic's registrations and every message of the data topic, read from
        offset 0 to the end, and what ``retired`` kept of earlier incarnations."""
        from confluent_kafka import Consumer, TopicPartition

        workload = cls(bootstrap, ch_host, ch_ports, run=run, tables=initial_tables, **kwargs)
        registry = Registry.load(KafkaStore({"bootstrap.servers": bootstrap},
                                            workload.schema_topic))
        consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"resume-{run}",
                             "enable.auto.commit": False, "enable.partition.eof": True})
        try:
            def partition(topic: str, p: int
                          ) -> Iterable[tuple[str, int, int, list[bytes | None]]]:
                _, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)
                consumer.assign([TopicPartition(topic, p, 0)])
                at, first, values = 0, 0, list[bytes | None]()
                quiet_since = time.monotonic()
                while at < high:
                    for msg in consumer.consume(50_000, timeout=5):
                        offset = msg.offset()
                        if msg.error() is None and offset is not None:
                            first = first if values else offset
                            values.append(msg.value())
                            at, quiet_since = offset + 1, time.monotonic()
                    if time.monotonic() - quiet_since > 120:
                        raise TimeoutError(f"{topic}[{p}]: stuck at offset {at} of {high}")
                    if len(values) >= 200_000 or (values and at >= high):
                        yield topic, p, first, values
                        values = []

            metas = {t: consumer.list_topics(t, timeout=30).topics[t] for t in workload.topics}
            workload.restore((chunk for t, meta in metas.items()
                              for p in sorted(meta.partitions) for chunk in partition(t, p)),
                             {r.table: r for r in registry.registrations()}, retired)
        finally:
            consumer.close()
        return workload

    def restore(self, chunks: Iterable[tuple[str, int, int, list[bytes | None]]],
                registrations: Mapping[str, Registration],
                retired: Path | None = None) -> None:
        """Rebuild what :meth:`produce` and :meth:`schema_change` recorded from what
        they wrote: ``chunks`` are (topic, partition, first offset, consecutive message
        values; each topic's go to its shard), ``registrations`` the schema topic's;
        after a ``topic_recreate``,
        ``retired`` (:meth:`save_retired`) adds what the old incarnations left expected.

        Holds because every value is a function of what the producer knew: a row's id
        is its field 1, an envelope pins the version it was written with, a version's
        added fields are in its registered descriptor (their default and factor follow
        from their name), and ids only grow, so the first id of a (table, version) is
        where its producer switched. The table order of future messages differs from an
        uninterrupted run's (the seeded draw restarts); their ids stay unique."""
        ids: dict[tuple[int, str], list[np.ndarray[Any, Any]]] = {}
        first_of: dict[tuple[str, int], int] = {}
        produced = Produced()
        next_id = 1
        if retired is not None and retired.exists():
            with np.load(retired) as saved:
                meta = json.loads(str(saved["arr_0"]))
                shards = meta.get("shards") or [0] * len(meta["tables"])
                for i, (shard, name) in enumerate(zip(shards, meta["tables"], strict=True)):
                    ids[int(shard), name] = [saved[f"arr_{i + 1}"]]
            produced.kept_dead = Counter({(t, int(p), int(o)): int(n)
                                          for t, p, o, n in meta["dead"]})
            first_of = {(name, int(v)): int(first) for name, v, first in meta["first"]}
            next_id, self.recreations = int(meta["next_id"]), int(meta["recreations"])
        for topic, partition, offset, values in chunks:
            shard = self.shard_of_topic(topic)
            env = parse_envelopes(values)
            produced.messages += len(values)
            produced.bytes += sum(len(v or b"") for v in values)
            produced.dead.update((topic, partition, offset + i) for i in env.rejected)
            message, rows = accepted_rows(env)
            for t, name in enumerate(env.tables):
                mine = env.table_index[message] == t
                if not mine.any():
                    continue
                ids.setdefault((shard, name), []).append(rows[mine])
                versions = env.versions[message][mine]
                for v in np.unique(versions).tolist():
                    low = int(rows[mine][versions == v].min())
                    key = (name, int(v))
                    first_of[key] = min(first_of.get(key, low), low)
        produced.ids = ids
        produced.rows = sum(int(a.size) for parts in ids.values() for a in parts)
        self.produced = produced
        self._counter = produced.messages
        self._next_id = max(next_id, 1 + max((int(a.max()) for parts in ids.values()
                                              for a in parts if a.size), default=0))
        names = [f"{self.database}.t{i:03d}" for i in range(len(registrations) + 1)]
        self.tables = next(i for i, name in enumerate(names) if name not in registrations)
        self.changed = {name for name in self.table_names()[self.initial_tables:]}
        self.schemas, self.switches = {}, {}
        columns: set[str] = set()
        for name in self.table_names():
            for v in registrations[name].versions:
                fields = [(f.name, f.number) for f in v.descriptor.fields]
                schema = table_schema(v.version, v.message_name, fields)
                columns.update(f.column for f in schema.added)
                if v.version == 1:
                    continue
                self.changed.add(name)
                self.schemas[name] = schema
                if (name, v.version) in first_of:
                    self.switches.setdefault(name, []).append((first_of[name, v.version],
                                                               schema))
        # the n of the last change: x<n> columns and changes of every kind count
        self.schema_changes = max([int(c[1:]) for c in columns] + [
            sum(len(registrations[n].versions) for n in self.table_names())
            - self.initial_tables])

    @property
    def initial_tables(self) -> int:
        return self._initial_tables

    def _has_rows(self, table: str) -> None:
        client = self.clients()[0]
        try:
            if not client.execute(f"SELECT count() FROM {table}")[0][0]:
                raise RuntimeError(f"{table} is still empty")
        finally:
            client.disconnect()

    def _create_table(self, table: str) -> None:
        short = table.split(".", 1)[1]
        for client in self.clients():
            client.execute(
                f"CREATE TABLE IF NOT EXISTS {table} ({COLUMNS}, {COORDINATES}) ENGINE = "
                f"ReplicatedMergeTree('/clickhouse/tables/{{shard}}/{self.database}/{short}', "
                "'{replica}') ORDER BY id")
            client.disconnect()

    def _add_column(self, table: str, added: AddedField) -> None:
        """``ALTER TABLE ... ADD COLUMN`` on every replica that lacks the column (on
        ``ReplicatedMergeTree`` the first ALTER replicates through ZooKeeper), then
        until every replica lists it (docs/schemas.md).

        ClickHouse 18.16: a replica whose ZooKeeper session expired earlier (the
        ``zookeeper_down`` fault) may never apply a replicated ALTER (its alter thread
        stopped; the ALTER ends with code 341, "Alter is not finished because timeout
        when waiting for some replicas"), and quorum inserts then stall on it. The
        documented remedy: ``DETACH TABLE`` + ``ATTACH TABLE`` on that replica, which
        restarts the table's replication threads and applies the ALTER. So the ALTER is
        sent once per shard (its other replica gets it through ZooKeeper; a second ALTER
        there would wait out the same timeout again), and waits :data:`ALTER_WAIT_S`, not
        the server's 60 s, for the other replica before the remedy."""
        database, short = table.split(".", 1)
        clients = self.clients()
        try:
            def has(client: Any) -> bool:
                return bool(client.execute(
                    "SELECT count() FROM system.columns WHERE database = %(d)s AND "
                    "table = %(t)s AND name = %(c)s",
                    {"d": database, "t": short, "c": added.column})[0][0])

            altered: set[int] = set()
            for shard, client in zip(self.replica_shards, clients, strict=True):
                if shard in altered or has(client):
                    continue
                altered.add(shard)
                try:
                    client.execute(f"ALTER TABLE {table} ADD COLUMN {added.column} Int64 "
                                   f"DEFAULT {added.default}",
                                   settings={"replication_alter_columns_timeout": ALTER_WAIT_S})
                except Exception as exc:
                    # the replicated ALTER got here first, or it is applied later
                    if "already exists" not in str(exc) and "Code: 341" not in str(exc):
                        raise
            deadline = time.monotonic() + 20
            while not all(has(c) for c in clients) and time.monotonic() < deadline:
                time.sleep(0.5)
            for replica, client in enumerate(clients):
                if not has(client):
                    self.reattached.append((table, replica))
                    client.execute(f"DETACH TABLE {table}")
                    client.execute(f"ATTACH TABLE {table}")
            deadline = time.monotonic() + 30
            while not all(has(c) for c in clients):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{table}.{added.column} is not on every replica yet")
                time.sleep(0.5)
        finally:
            for c in clients:
                c.disconnect()

    def _register(self, table: str, schema: TableSchema, folder: Path) -> None:
        """``ba-schema register`` (in-process), checked against the live columns."""
        from click.testing import CliRunner

        from blockagg.registration.cli import cli as ba_schema

        path = folder / f"{table}.v{schema.version}.pb"
        path.write_bytes(evolved_descriptor_set(schema))
        res = CliRunner().invoke(ba_schema, [
            "--bootstrap-servers", self.bootstrap, "--topic", self.schema_topic,
            "--clickhouse", f"{self.ch_host}:{self.ch_ports[0]}", "register", table,
            "--descriptor-set", str(path), "--message", f"{schema.package}.Event"])
        if res.exit_code != 0:
            raise RuntimeError(f"ba-schema register {table}: exit {res.exit_code}: "
                               f"{res.output[-2000:]}")

    def added_since(self, table: str) -> list[tuple[AddedField, int]]:
        """Every column added to ``table``, with the first id written with it (a row of
        a smaller id holds its ``DEFAULT``; ``2**63`` when none was written yet)."""
        out: dict[str, tuple[AddedField, int]] = {}
        for first, schema in self.switches.get(table, []):
            for f in schema.added:
                out.setdefault(f.column, (f, first))
        for f in self.schemas.get(table, V1).added:
            out.setdefault(f.column, (f, 1 << 63))
        return list(out.values())

    def job_config(self, path: Path, checkpoint: Path, replicas: Sequence[str],
                   extra: str = "", quorum: int = 2,
                   other_replicas: Sequence[Sequence[str]] = ()) -> Path:
        """A job TOML for this workload (the keys of ``docs/configuration.md``): one
        ``[[topics]]`` entry per shard, shard 1's topic to ``replicas`` and shard ``k``'s
        to ``other_replicas[k - 2]`` (eBay's one topic per shard, one job for both)."""
        if len(other_replicas) != len(self.other_shards):
            raise ValueError(f"{len(other_replicas)} other shards' replicas given, the run "
                             f"has {len(self.other_shards)}: give one list per shard after "
                             "the first")
        more = "".join(f"""
[[topics]]
name = "{topic}"
replicas = [{", ".join(f'"{r}"' for r in shard)}]
""" for topic, shard in zip(self.topics[1:], other_replicas, strict=True))
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
{more}
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


def _retry(action: Callable[[], None], timeout: float, what: str) -> None:
    """``action`` until it succeeds (a service of the stack may be coming back from
    another fault), at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            action()
            return
        except Exception as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: still failing after {timeout:.0f}s: {exc}") from exc
            time.sleep(1.0)
