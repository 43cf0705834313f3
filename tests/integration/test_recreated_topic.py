"""A topic deleted and recreated under content-hash deduplication (issue 25, paths 2
and 3), on the real stack: Kafka's topic ids and the metadata group, two ClickHouse
18.16 replicas (no ``insert_deduplication_token``). The new incarnation's messages sit
at the old one's offsets; the table keeps the old rows.

* Path 3: the new topic repeats the old payloads at the same offsets. 18.16 hashes a
  block's content, so without the incarnation in the rows the new blocks are the old
  ones and are dropped. The writer fills ``_incarnation``: all rows stored once.
* Path 2: a new block's first insert never landed, then an ALTER: the re-send check
  counts rows at the block's coordinates. The old topic's rows are there; counted as
  the block's, it would never be sent. The count is by incarnation: stored once.
* A table without ``_incarnation`` can't tell the old rows from new ones: the
  partition is refused at its start, before anything is committed or inserted."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from blockagg.aggregator.clickhouse.exceptions import CoordinatesInUse
from blockagg.aggregator.core.metadata import decode
from blockagg.aggregator.kafka.incarnation import TopicIncarnations
from blockagg.aggregator.kafka.log_store import KafkaStore
from blockagg.config import Config, loads
from blockagg.proto.descriptors import compile_proto, load_descriptor, message_class
from blockagg.proto.envelope import make_envelope
from blockagg.registration.register import register
from blockagg.rows.deadletters import dead_letter_ddl
from blockagg.spark import components
from blockagg.spark.components import DefaultComponents
from blockagg.spark.offsets import PlannedRange
from blockagg.spark.task import TaskContext, run_range
from tests.integration.conftest import replicated_engine, unique_name
from tests.integration.test_pins_stack import PROTO, CrashAfter, Worker

pytestmark = pytest.mark.integration

COORDINATES = "_topic String, _partition UInt32, _offset UInt64"
INCARNATION = ", _incarnation UInt64 DEFAULT 0"


class Stack:
    """One table ``a`` (and the dead-letter table) on both replicas, a topic, a job
    configuration and a registry with ``a`` registered."""

    def __init__(self, stack_env: dict[str, str], ch_replicas: list[Any], db: str,
                 kafka_bootstrap: str, topic: str, tmp_path: Path, incarnation: bool) -> None:
        self.ch, self.db, self.topic, self.bootstrap = ch_replicas, db, topic, kafka_bootstrap
        path = tmp_path / "pin.proto"
        path.write_text(PROTO)
        fds = compile_proto(path)
        for client in ch_replicas:
            client.execute(f"CREATE TABLE {db}.a (a Int32, {COORDINATES}"
                           f"{INCARNATION if incarnation else ''}) ENGINE = "
                           f"{replicated_engine(db, 'a', '_offset')}")
            client.execute(dead_letter_ddl(f"{db}.dead_letters"))
        replicas = ", ".join(f'"{stack_env["BLOCKAGG_CH_HOST"]}:{p}"'
                             for p in stack_env["BLOCKAGG_CH_PORTS"].split(","))
        self.config: Config = loads(f"""
[job]
metadata_group_id = "{unique_name('incarnation')}"
checkpoint_location = "{tmp_path / 'ck'}"
[[topics]]
name = "{topic}"
replicas = [{replicas}]
[blocks]
max_rows = 3
[kafka]
"bootstrap.servers" = "{kafka_bootstrap}"
[schemas]
topic = "{unique_name('_schemas')}"
[dead_letters]
table = "{db}.dead_letters"
""")
        store = KafkaStore({"bootstrap.servers": kafka_bootstrap}, self.config.schemas.topic)
        store.ensure_topic(replication_factor=1)
        writer = components.make_writer(self.config, self.config.topics[0])
        register(store, f"{db}.a", "pin.V1", fds, columns=writer.describe(f"{db}.a").columns)
        self.cls: Any = message_class(load_descriptor(fds, "pin.V1"))

    def values(self, *a: int) -> list[bytes]:
        return [make_envelope(f"{self.db}.a", [self.cls(a=v).SerializeToString()], 1)
                for v in a]

    def run(self, worker: Any, values: list[bytes]) -> dict[str, Any]:
        components._CACHE.clear()   # a fresh Python worker
        n = len(values)
        ctx = TaskContext(self.config, worker,
                          {(self.topic, 0): PlannedRange(self.topic, 0, 0, n)}, 1, 2)
        return run_range(ctx, (self.topic, 0), list(range(n)), values,
                         [int(time.time() * 1000)] * n)

    def recreate_topic(self, kafka_admin: Any) -> None:
        """Delete the topic and create it again (a new topic id), then do what the
        ``TopicIncarnationChanged`` recovery says: the metadata group's offset of the
        topic to its earliest offset (when the broker kept the old one) and a fresh
        checkpoint (each run here plans its range afresh)."""
        from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
        from confluent_kafka.admin import NewTopic  # type: ignore[attr-defined]

        reader = TopicIncarnations({"bootstrap.servers": self.bootstrap})
        before = reader.of(self.topic)
        kafka_admin.delete_topics([self.topic])[self.topic].result(timeout=30)
        deadline = time.monotonic() + 60
        while True:
            try:
                kafka_admin.create_topics([NewTopic(self.topic, 1, 1)])[self.topic].result(
                    timeout=30)
                break
            except Exception:
                assert time.monotonic() < deadline, "the deleted topic never went away"
                time.sleep(0.5)
        while True:
            try:
                if reader.of(self.topic) != before:
                    break
            except Exception:
                pass
            assert time.monotonic() < deadline, "the recreated topic never got a new id"
            time.sleep(0.5)
        if DefaultComponents().store(self.config).committed(self.topic, 0) is not None:
            group = self.config.job.metadata_group_id
            kafka_admin.alter_consumer_group_offsets([ConsumerGroupTopicPartitions(
                group, [TopicPartition(self.topic, 0, 0)])])[group].result(timeout=30)

    def rows(self) -> list[list[tuple[int, int]]]:
        """``(_offset, a)`` of every row, per replica."""
        out = []
        for client in self.ch:
            client.execute(f"SYSTEM SYNC REPLICA {self.db}.a")
            out.append(client.execute(f"SELECT _offset, a FROM {self.db}.a ORDER BY _offset, a"))
        return out


def test_a_recreated_topic_repeating_old_payloads_at_the_same_offsets_is_stored_once(
        stack_env: dict[str, str], ch_replicas: list[Any], ch_database: str,
        kafka_bootstrap: str, kafka_admin: Any, new_topic: Callable[..., str],
        tmp_path: Path) -> None:
    """Path 3: 3 of 6 rows were lost (the new blocks hashed as the old ones)."""
    stack = Stack(stack_env, ch_replicas, ch_database, kafka_bootstrap, new_topic(),
                  tmp_path, incarnation=True)
    stack.run(Worker(), stack.values(1, 2, 3))
    assert stack.rows() == [[(0, 1), (1, 2), (2, 3)]] * 2
    stack.recreate_topic(kafka_admin)
    stack.run(Worker(), stack.values(1, 2, 3))
    assert stack.rows() == [[(0, 1), (0, 1), (1, 2), (1, 2), (2, 3), (2, 3)]] * 2
    incarnations = ch_replicas[0].execute(
        f"SELECT _incarnation, count() FROM {ch_database}.a GROUP BY _incarnation")
    assert len(incarnations) == 2 and all(i and n == 3 for i, n in incarnations)


def test_a_block_of_a_recreated_topic_resent_after_an_alter_is_stored_once(
        stack_env: dict[str, str], ch_replicas: list[Any], ch_database: str,
        kafka_bootstrap: str, kafka_admin: Any, new_topic: Callable[..., str],
        tmp_path: Path) -> None:
    """Path 2: the new block's first insert never landed; after an ALTER the re-send
    check counted the old topic's rows at its coordinates and never sent it (3 of 3
    rows lost)."""
    stack = Stack(stack_env, ch_replicas, ch_database, kafka_bootstrap, new_topic(),
                  tmp_path, incarnation=True)
    stack.run(Worker(), stack.values(1, 2, 3))
    stack.recreate_topic(kafka_admin)
    new = stack.values(11, 12, 13)
    with pytest.raises(CrashAfter):
        stack.run(Worker(crash_after=1), new)    # the intent, then the worker dies
    assert decode(DefaultComponents().store(stack.config).committed(
        stack.topic, 0).metadata).blocks  # type: ignore[union-attr]
    assert stack.rows() == [[(0, 1), (1, 2), (2, 3)]] * 2, "the first insert never landed"
    ch_replicas[0].execute(f"ALTER TABLE {ch_database}.a ADD COLUMN b String DEFAULT 'none'")
    deadline = time.monotonic() + 60
    while ch_replicas[1].execute(f"SELECT count() FROM system.columns WHERE database = "
                                 f"'{ch_database}' AND table = 'a' AND name = 'b'") != [(1,)]:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    report = stack.run(Worker(), new)
    assert report["replayed_blocks"] == 1
    assert stack.rows() == [[(0, 1), (0, 11), (1, 2), (1, 12), (2, 3), (2, 13)]] * 2


def test_a_recreated_topic_into_a_table_without_incarnation_is_refused_at_its_start(
        stack_env: dict[str, str], ch_replicas: list[Any], ch_database: str,
        kafka_bootstrap: str, kafka_admin: Any, new_topic: Callable[..., str],
        tmp_path: Path) -> None:
    """Without ``_incarnation`` the old rows can't be told from new ones: the partition
    is refused in one line naming the table, the partition, the stored offsets and the
    ways on; nothing is committed or inserted (before: 3 of 6 rows silently lost)."""
    stack = Stack(stack_env, ch_replicas, ch_database, kafka_bootstrap, new_topic(),
                  tmp_path, incarnation=False)
    stack.run(Worker(), stack.values(1, 2, 3))
    stack.recreate_topic(kafka_admin)
    before = DefaultComponents().store(stack.config).committed(stack.topic, 0)
    with pytest.raises(CoordinatesInUse) as refused:
        stack.run(Worker(), stack.values(1, 2, 3))
    text = str(refused.value)
    assert "\n" not in text
    for part in (f"{stack.topic}[0]", f"{ch_database}.a holds 3 rows", "offsets 0-2",
                 "_incarnation UInt64", "22.2", "clickhouse.allow_stored_coordinates"):
        assert part in text
    assert stack.rows() == [[(0, 1), (1, 2), (2, 3)]] * 2
    assert DefaultComponents().store(stack.config).committed(stack.topic, 0) == before
