"""Pins on the real stack (issue 12): the topic incarnation read from the Kafka broker,
registry positions on a real registry topic, and the task's wiring with the real
metadata group, registry topic and two ClickHouse 18.16 replicas: a replay after a
registry change and an ALTER TABLE decides as the first attempt did, under its pinned
deduplication mode."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from blockagg.aggregator.core.metadata import DedupMode, Pins, decode
from blockagg.aggregator.core.model import Committed
from blockagg.aggregator.kafka.incarnation import TopicIncarnations
from blockagg.aggregator.kafka.log_store import KafkaStore
from blockagg.config import loads
from blockagg.proto.descriptors import compile_proto, load_descriptor, message_class
from blockagg.proto.envelope import make_envelope
from blockagg.proto.registry import Registry, RegistryCache, registry_pin
from blockagg.registration.register import register
from blockagg.rows.deadletters import dead_letter_ddl
from blockagg.spark import components
from blockagg.spark.components import DefaultComponents
from blockagg.spark.offsets import PlannedRange
from blockagg.spark.task import TaskContext, run_range
from tests.integration.conftest import replicated_engine, unique_name

pytestmark = pytest.mark.integration

PROTO = ('syntax = "proto3"; package pin;\n'
         "message V1 { int32 a = 1; }\n"
         "message V2 { int32 a = 1; string b = 2; }\n")
COORDINATES = "_topic String, _partition UInt32, _offset UInt64"


def test_the_incarnation_changes_when_the_topic_is_recreated(
        kafka_bootstrap: str, kafka_admin: Any, new_topic: Callable[..., str]) -> None:
    from confluent_kafka.admin import NewTopic  # type: ignore[attr-defined]

    topic = new_topic()
    reader = TopicIncarnations({"bootstrap.servers": kafka_bootstrap})
    first = reader.of(topic)
    assert first and TopicIncarnations({"bootstrap.servers": kafka_bootstrap}).of(topic) == first
    assert reader.of(new_topic()) != first              # another topic, same cluster
    kafka_admin.delete_topics([topic])[topic].result(timeout=30)
    deadline = time.monotonic() + 60
    while True:
        try:
            kafka_admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(timeout=30)
            break
        except Exception:
            assert time.monotonic() < deadline, "the deleted topic never went away"
            time.sleep(0.5)
    while True:
        try:
            again = reader.of(topic)
            break
        except Exception:
            assert time.monotonic() < deadline
            time.sleep(0.5)
    assert again != first and again == reader.of(topic)


def test_registry_positions_on_the_registry_topic(kafka_bootstrap: str, tmp_path: Path) -> None:
    path = tmp_path / "pin.proto"
    path.write_text(PROTO)
    fds = compile_proto(path)
    store = KafkaStore({"bootstrap.servers": kafka_bootstrap}, unique_name("_schemas"))
    store.ensure_topic(replication_factor=1)
    assert store.end() == 0 and Registry.load(store).position == 0
    register(store, "db.a", "pin.V1", fds)
    register(store, "db.b", "pin.V1", fds)
    register(store, "db.a", "pin.V2", fds)
    registry = Registry.load(store)
    assert registry.position == store.end() == 3
    assert [v.position for v in registry.get("db.a").versions] == [1, 3]
    assert "db.b" not in registry.as_of(1) and registry.as_of(2).get("db.a").latest.version == 1
    cache = RegistryCache(store, refresh_interval_s=3600)
    assert cache.position() == 3 and cache.at(1).registrations() == registry.as_of(
        1).registrations()


def last_commit(config: Any, topic: str) -> Committed:
    committed = DefaultComponents().store(config).committed(topic, 0)
    assert committed is not None
    return committed


class CrashAfter(Exception):
    pass


class CrashingStore:
    def __init__(self, inner: Any, commits: int) -> None:
        self.inner, self.left = inner, commits

    def committed(self, topic: str, partition: int) -> Committed | None:
        return self.inner.committed(topic, partition)  # type: ignore[no-any-return]

    def commit(self, topic: str, partition: int, offset: int, metadata: str) -> None:
        self.inner.commit(topic, partition, offset, metadata)
        self.left -= 1
        if self.left == 0:
            raise CrashAfter("the worker dies after this commit")


class Worker(DefaultComponents):
    """The production adapters; the metadata store dies after ``crash_after`` commits."""

    def __init__(self, crash_after: int = 0) -> None:
        self.crash_after = crash_after

    def store(self, config: Any) -> Any:
        inner = super().store(config)
        return CrashingStore(inner, self.crash_after) if self.crash_after else inner


def test_a_replay_after_a_registry_change_decides_as_the_first_attempt(
        stack_env: dict[str, str], ch_replicas: list[Any], ch_database: str,
        kafka_bootstrap: str, new_topic: Callable[..., str], tmp_path: Path) -> None:
    path = tmp_path / "pin.proto"
    path.write_text(PROTO)
    fds = compile_proto(path)
    db = ch_database
    for client in ch_replicas:
        for table in ("a", "b"):
            client.execute(f"CREATE TABLE {db}.{table} (a Int32, {COORDINATES}) ENGINE = "
                           f"{replicated_engine(db, table, '_offset')}")
        client.execute(dead_letter_ddl(f"{db}.dead_letters"))
    topic = new_topic()
    schemas = unique_name("_schemas")
    replicas = ", ".join(f'"{stack_env["BLOCKAGG_CH_HOST"]}:{p}"'
                         for p in stack_env["BLOCKAGG_CH_PORTS"].split(","))
    config = loads(f"""
[job]
metadata_group_id = "{unique_name('pins')}"
checkpoint_location = "{tmp_path / 'ck'}"
[[topics]]
name = "{topic}"
replicas = [{replicas}]
[blocks]
max_rows = 2
[kafka]
"bootstrap.servers" = "{kafka_bootstrap}"
[schemas]
topic = "{schemas}"
[dead_letters]
table = "{db}.dead_letters"
""")
    store = KafkaStore({"bootstrap.servers": kafka_bootstrap}, schemas)
    store.ensure_topic(replication_factor=1)
    writer = components.make_writer(config, config.topics[0])
    register(store, f"{db}.a", "pin.V1", fds, columns=writer.describe(f"{db}.a").columns)

    def envelope(table: str, a: int, version: int = 0, b: str | None = None) -> bytes:
        cls: Any = message_class(load_descriptor(fds, "pin.V2" if b else "pin.V1"))
        row = cls(a=a, b=b) if b else cls(a=a)
        return make_envelope(f"{db}.{table}", [row.SerializeToString()], version)

    values = [envelope("a", 1), envelope("b", 2, 1), envelope("a", 3), envelope("a", 4, 2, "x"),
              envelope("a", 5), envelope("b", 6, 1), envelope("a", 7)]
    stamps = [int(time.time() * 1000)] * len(values)

    def run(worker: Any, vals: list[bytes]) -> dict[str, Any]:
        components._CACHE.clear()   # a fresh Python worker
        ctx = TaskContext(config, worker, {(topic, 0): PlannedRange(topic, 0, 0, len(vals))},
                          1, 2)
        return run_range(ctx, (topic, 0), list(range(len(vals))), vals, stamps[:1] * len(vals))

    with pytest.raises(CrashAfter):
        run(Worker(crash_after=3), values)
    intent = decode(last_commit(config, topic).metadata)
    incarnation = TopicIncarnations({"bootstrap.servers": kafka_bootstrap}).of(topic)
    assert intent.blocks and intent.pins == Pins(registry_pin(1), incarnation,
                                                 DedupMode.BLOCK_HASH, intent.pins.structure)
    assert intent.pins.structure > 0   # the replay compares db.a's columns with it
    # Between the attempt and the replay: db.b registered, column b added on every
    # replica and v2 registered with it.
    register(store, f"{db}.b", "pin.V1", fds, columns=writer.describe(f"{db}.b").columns)
    ch_replicas[0].execute(f"ALTER TABLE {db}.a ADD COLUMN b String DEFAULT 'none' AFTER a")
    deadline = time.monotonic() + 60    # a replicated ALTER reaches the other replica
    while ch_replicas[1].execute(f"SELECT count() FROM system.columns WHERE database = "
                                 f"'{db}' AND table = 'a' AND name = 'b'") != [(1,)]:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    register(store, f"{db}.a", "pin.V2", fds, columns=writer.describe(f"{db}.a").columns)
    report = run(Worker(), values)
    assert report["replayed_blocks"] >= 1
    for client in ch_replicas:
        client.execute(f"SYSTEM SYNC REPLICA {db}.a")
        client.execute(f"SYSTEM SYNC REPLICA {db}.dead_letters")
        rows = client.execute(f"SELECT _offset, a, b FROM {db}.a ORDER BY _offset")
        assert rows == [(0, 1, "none"), (2, 3, "none"), (4, 5, "none"), (6, 7, "none")]
        assert client.execute(f"SELECT count() FROM {db}.b") == [(0,)]
        dead = client.execute(f"SELECT offset, count() FROM {db}.dead_letters "
                              "GROUP BY offset ORDER BY offset")
        assert dead == [(1, 1), (3, 1), (5, 1)]   # as the first attempt decided, once
    # The next batch is pinned to the current registry: db.b and v2 are known.
    more = [*values, envelope("b", 8, 1), envelope("a", 9, 2, "y")]
    report = run(Worker(), more)
    final = decode(last_commit(config, topic).metadata)
    assert final.pins.registry == registry_pin(Registry.load(store).position)
    for client in ch_replicas:
        client.execute(f"SYSTEM SYNC REPLICA {db}.a")
        client.execute(f"SYSTEM SYNC REPLICA {db}.b")
        assert client.execute(f"SELECT _offset, a, b FROM {db}.a WHERE _offset > 6") == [
            (8, 9, "y")]
        assert client.execute(f"SELECT _offset, a FROM {db}.b") == [(7, 8)]


def test_the_content_hash_of_a_block_differs_between_18_16_and_a_modern_server(
        ch_replicas: list[Any], ch_database: str) -> None:
    """Why a replay pinned to content-hash deduplication refuses on a server with tokens
    (``ClickHouseBlockWriter.settings_for``): the same block gets another block id from
    ClickHouse 26 (chdb) than from 18.16, so an upgrade would let the replay land twice."""
    import glob

    chdb = pytest.importorskip("chdb")
    db = ch_database
    ch_replicas[0].execute(f"CREATE TABLE {db}.h (i64 Int64, text String) ENGINE = "
                           f"{replicated_engine(db, 'h', 'i64')}")
    ch_replicas[0].execute(f"INSERT INTO {db}.h (i64, text) VALUES", [[7, 8], ["u", "v"]],
                           columnar=True, settings={"insert_deduplicate": 1})
    path = ch_replicas[0].execute("SELECT zookeeper_path FROM system.replicas WHERE "
                                  f"database = '{db}' AND table = 'h'")[0][0]
    old = [name for (name,) in ch_replicas[0].execute(
        f"SELECT name FROM system.zookeeper WHERE path = '{path}/blocks'")]
    session: Any = chdb.session.Session()
    try:
        session.query("CREATE DATABASE IF NOT EXISTS db")
        session.query("CREATE TABLE db.h (i64 Int64, text String) ENGINE = MergeTree ORDER BY "
                      "i64 SETTINGS non_replicated_deduplication_window = 100")
        session.query("INSERT INTO db.h (i64, text) SETTINGS insert_deduplicate = 1 VALUES "
                      "(7, 'u'), (8, 'v')")
        data_path = session.query(
            "SELECT data_paths[1] FROM system.tables WHERE database = 'db' AND name = 'h'",
            "TabSeparated").bytes().decode().strip()
        new = [line.split()[-1]
               for f in glob.glob(data_path + "deduplication_logs/*")
               for line in Path(f).read_text().splitlines()]
    finally:
        session.close()
    assert len(old) == len(new) == 1 and old[0].startswith("all_") and new[0].startswith("all_")
    assert old != new


class DiesAfterInserts(DefaultComponents):
    """The production adapters; the worker dies once ``inserts`` blocks are stored."""

    def __init__(self, inserts: int) -> None:
        self.left = inserts

    def sink(self, config: Any, topic: Any) -> Any:
        inner = super().sink(config, topic)
        outer = self

        class Sink:
            def insert(self, block: Any, batch: Any, confirmed_at: Any = None) -> None:
                inner.insert(block, batch, confirmed_at)
                outer.left -= 1
                if outer.left == 0:
                    raise CrashAfter("the worker dies after this insert")

        return Sink()


def test_blocks_stored_before_an_alter_are_stored_once_by_the_replay(
        stack_env: dict[str, str], ch_replicas: list[Any], ch_database: str,
        kafka_bootstrap: str, new_topic: Callable[..., str], tmp_path: Path) -> None:
    """The long run's duplicate, end to end with the production adapters: blocks stored,
    the worker dies before its final commit, a column is added, the batch is replayed.
    On 18.16 the replayed blocks would hash differently (the part gained the column);
    the replay asks the table instead and stores every row exactly once."""
    path = tmp_path / "pin.proto"
    path.write_text(PROTO)
    fds = compile_proto(path)
    db = ch_database
    for client in ch_replicas:
        client.execute(f"CREATE TABLE {db}.a (a Int32, {COORDINATES}) ENGINE = "
                       f"{replicated_engine(db, 'a', '_offset')}")
        client.execute(dead_letter_ddl(f"{db}.dead_letters"))
    topic = new_topic()
    replicas = ", ".join(f'"{stack_env["BLOCKAGG_CH_HOST"]}:{p}"'
                         for p in stack_env["BLOCKAGG_CH_PORTS"].split(","))
    config = loads(f"""
[job]
metadata_group_id = "{unique_name('alter')}"
checkpoint_location = "{tmp_path / 'ck'}"
[[topics]]
name = "{topic}"
replicas = [{replicas}]
[blocks]
max_rows = 2
[kafka]
"bootstrap.servers" = "{kafka_bootstrap}"
[schemas]
topic = "{unique_name('_schemas')}"
[dead_letters]
table = "{db}.dead_letters"
""")
    store = KafkaStore({"bootstrap.servers": kafka_bootstrap}, config.schemas.topic)
    store.ensure_topic(replication_factor=1)
    writer = components.make_writer(config, config.topics[0])
    register(store, f"{db}.a", "pin.V1", fds, columns=writer.describe(f"{db}.a").columns)
    cls: Any = message_class(load_descriptor(fds, "pin.V1"))
    values = [make_envelope(f"{db}.a", [cls(a=i).SerializeToString()], 1) for i in range(7)]

    def run(worker: Any) -> dict[str, Any]:
        components._CACHE.clear()   # a fresh Python worker
        ctx = TaskContext(config, worker, {(topic, 0): PlannedRange(topic, 0, 0, 7)}, 1, 2)
        return run_range(ctx, (topic, 0), list(range(7)), values,
                         [int(time.time() * 1000)] * 7)

    with pytest.raises(CrashAfter):
        run(DiesAfterInserts(2))
    assert decode(last_commit(config, topic).metadata).blocks
    stored = ch_replicas[0].execute(f"SELECT count() FROM {db}.a")[0][0]
    assert stored == 4, "two blocks of two rows landed before the worker died"
    ch_replicas[0].execute(f"ALTER TABLE {db}.a ADD COLUMN b String DEFAULT 'none'")
    deadline = time.monotonic() + 60
    while ch_replicas[1].execute(f"SELECT count() FROM system.columns WHERE database = "
                                 f"'{db}' AND table = 'a' AND name = 'b'") != [(1,)]:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    report = run(Worker())
    assert report["replayed_blocks"] >= 1
    for client in ch_replicas:
        client.execute(f"SYSTEM SYNC REPLICA {db}.a")
        assert client.execute(f"SELECT _offset, count() FROM {db}.a GROUP BY _offset "
                              "ORDER BY _offset") == [(o, 1) for o in range(7)]
