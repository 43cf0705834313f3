"""``arv audit`` against the real stack: Kafka 4.x and ClickHouse 18.16 ReplicatedMergeTree.

Each test produces envelopes to a fresh topic, inserts the rows the aggregator would
have inserted for the offsets below a committed resume offset (commit made with
``Consumer.commit`` and blockagg metadata), then runs ``arv audit`` in-process.
A clean table passes; a duplicated row (inserted as a different block, so block
deduplication keeps it) and a missing row are caught, each naming the offset.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from click.testing import CliRunner, Result
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from blockagg.aggregator.core.metadata import BlockRange, Metadata, encode
from blockagg.proto.envelope import make_envelope
from blockagg.rows.deadletters import dead_letter_ddl
from blockagg.verifier.cli import cli
from tests.integration.conftest import replicated_engine

pytestmark = pytest.mark.integration

DELIVERED = 60
"""Messages below the committed resume offset."""
UNDELIVERED = 10
"""Messages produced after it (not inserted)."""


@dataclass
class Scenario:
    bootstrap: str
    topic: str
    database: str
    client: Any
    group: str
    messages: list[tuple[int, str | None, int]]
    """(offset, table or None for garbage, rows) of every produced message."""

    @property
    def tables(self) -> tuple[str, str]:
        return f"{self.database}.events", f"{self.database}.clicks"

    @property
    def dead_letters(self) -> str:
        return f"{self.database}.dead_letters"

    def insert(self, table: str, offsets: Sequence[int], copies: int = 1,
               tag: int = 0) -> None:
        """Insert the rows of the messages at ``offsets`` (one block), as the writer does."""
        rows = [(self.topic, 0, offset, i + tag)
                for offset, t, k in self.messages if offset in offsets and t == table
                for i in range(k) for _ in range(copies)]
        self.client.execute(f"INSERT INTO {table} (_topic, _partition, _offset, v) VALUES",
                            rows)

    def dead_letter(self, offset: int) -> None:
        self.client.execute(
            f"INSERT INTO {self.dead_letters} (table, topic, partition, offset, error, raw, "
            "time) VALUES", [("", self.topic, 0, offset, "garbage", b"", 0)])

    def commit(self, metadata: Metadata) -> None:
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": self.group,
                             "enable.auto.commit": False})
        try:
            consumer.assign([TopicPartition(self.topic, 0, OFFSET_BEGINNING)])
            consumer.commit(offsets=[TopicPartition(self.topic, 0, metadata.resume,
                                                    metadata=encode(metadata))],
                            asynchronous=False)
        finally:
            consumer.close()

    def deliver(self, skip: Sequence[int] = ()) -> None:
        """Insert every delivered message's rows in blocks of 10 messages, dead letters for
        the garbage, and commit the batch's final metadata."""
        for table in self.tables:
            for first in range(0, DELIVERED, 10):
                offsets = [o for o in range(first, first + 10) if o not in skip]
                self.insert(table, offsets)
        for offset, target, _ in self.messages:
            if target is None and offset < DELIVERED and offset not in skip:
                self.dead_letter(offset)
        self.commit(Metadata(7, 0, 0, DELIVERED, DELIVERED))

    def audit(self, *extra: str) -> tuple[Result, list[dict[str, Any]]]:
        host, port = self.client.connection.host, self.client.connection.port
        result = CliRunner().invoke(cli, [
            "audit", "--bootstrap-servers", self.bootstrap, "--group", self.group,
            "--topic", self.topic, "--clickhouse", f"{host}:{port}",
            "--database", self.database, "--dead-letter-table", self.dead_letters,
            "--json", *extra])
        lines = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
        return result, lines


@pytest.fixture
def scenario(new_topic: Callable[..., str], kafka_bootstrap: str, ch_database: str,
             ch_replicas: list[Any]) -> Scenario:
    topic = new_topic(partitions=1, prefix="audit")
    client = ch_replicas[0]
    for name in ("events", "clicks"):
        client.execute(
            f"CREATE TABLE {ch_database}.{name} (_topic String, _partition UInt32, "
            f"_offset UInt64, v UInt32) ENGINE = {replicated_engine(ch_database, name)}")
    client.execute(dead_letter_ddl(f"{ch_database}.dead_letters"))
    # A table without coordinate columns is never audited.
    client.execute(f"CREATE TABLE {ch_database}.plain (v UInt32) "
                   f"ENGINE = {replicated_engine(ch_database, 'plain')}")
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    messages: list[tuple[int, str | None, int]] = []
    for offset in range(DELIVERED + UNDELIVERED):
        if offset % 13 == 12:
            table, rows, value = None, 0, b"\xff\xff not an envelope"
        else:
            table = f"{ch_database}.events" if offset % 3 else f"{ch_database}.clicks"
            rows = 1 + offset % 4
            value = make_envelope(table, [b"row%d" % i for i in range(rows)])
        producer.produce(topic, value=value, partition=0)
        messages.append((offset, table, rows))
    assert producer.flush(30) == 0
    return Scenario(kafka_bootstrap, topic, ch_database, client,
                    f"audit-{uuid.uuid4().hex[:10]}", messages)


def by_table(lines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {line["table"].split(".", 1)[1]: line for line in lines}


def test_clean_table_passes(scenario: Scenario) -> None:
    scenario.deliver()
    result, lines = scenario.audit()
    assert result.exit_code == 0, result.stderr
    tables = by_table(lines)
    assert set(tables) == {"events", "clicks", "dead_letters"}
    for name in ("events", "clicks"):
        line = tables[name]
        expected = sum(k for o, t, k in scenario.messages
                       if t is not None and t.endswith("." + name) and o < DELIVERED)
        assert line["expected_rows"] == line["found_rows"] == expected
        assert line["clean"] and line["resume"] == DELIVERED
    garbage = [o for o, t, _ in scenario.messages if t is None and o < DELIVERED]
    assert tables["dead_letters"]["messages"] == len(garbage) == 4
    assert tables["dead_letters"]["found_rows"] == 4
    assert "0 discrepancies" in result.stderr


def test_duplicated_row_is_caught(scenario: Scenario) -> None:
    scenario.deliver()
    offset = next(o for o, t, k in scenario.messages if t == scenario.tables[0] and k == 1)
    scenario.insert(scenario.tables[0], [offset], tag=1000)  # a new block: not deduplicated
    result, lines = scenario.audit()
    assert result.exit_code == 1, result.stderr
    events = by_table(lines)["events"]
    assert events["duplicated"] == {"count": 1, "offsets": [offset]}
    assert events["missing"]["count"] == 0 and events["unexpected"]["count"] == 0
    assert events["found_rows"] == events["expected_rows"] + 1
    assert by_table(lines)["clicks"]["clean"]


def test_missing_row_is_caught(scenario: Scenario) -> None:
    offset = next(o for o, t, k in scenario.messages if t == scenario.tables[1] and k > 1)
    scenario.deliver(skip=[offset])
    result, lines = scenario.audit()
    assert result.exit_code == 1, result.stderr
    clicks = by_table(lines)["clicks"]
    assert clicks["missing"] == {"count": 1, "offsets": [offset]}
    assert clicks["duplicated"]["count"] == 0 and clicks["unexpected"]["count"] == 0
    assert by_table(lines)["events"]["clean"]


def test_missing_dead_letter_and_undelivered_row_are_caught(scenario: Scenario) -> None:
    garbage = next(o for o, t, _ in scenario.messages if t is None)
    scenario.deliver(skip=[garbage])
    late = next(o for o, t, _ in scenario.messages if t == scenario.tables[0]
                and o >= DELIVERED)
    scenario.insert(scenario.tables[0], [late])
    result, lines = scenario.audit("--examples", "3")
    assert result.exit_code == 1, result.stderr
    tables = by_table(lines)
    assert tables["dead_letters"]["missing"]["offsets"] == [garbage]
    assert tables["events"]["unexpected"]["offsets"] == [late]


def test_intent_in_flight_block_and_from_offset(scenario: Scenario) -> None:
    """An intent commit lists a block above the resume offset: its rows may be present."""
    scenario.deliver()
    events = scenario.tables[0]
    block = [o for o, t, _ in scenario.messages if t == events and o >= DELIVERED][:2]
    scenario.insert(events, block)
    scenario.commit(Metadata(8, 1, DELIVERED, DELIVERED + UNDELIVERED, DELIVERED,
                             (BlockRange(1, block[0], block[-1]),)))
    result, lines = scenario.audit("--from-offset", f"{scenario.topic}:0=30")
    assert result.exit_code == 0, result.stderr + result.stdout
    line = by_table(lines)["events"]
    assert line["from_offset"] == 30
    assert line["in_flight_messages"] == 2 and line["in_flight_rows"] > 0


def test_human_table_and_usage_errors(scenario: Scenario) -> None:
    scenario.deliver()
    human = CliRunner().invoke(cli, [
        "audit", "--bootstrap-servers", scenario.bootstrap, "--group", scenario.group,
        "--topic", scenario.topic, "--clickhouse",
        f"{scenario.client.connection.host}:{scenario.client.connection.port}",
        "--table", scenario.tables[0], "--dead-letter-table", scenario.dead_letters])
    assert human.exit_code == 0, human.stderr
    assert human.stdout.splitlines()[0].startswith("PARTITION\tTABLE")
    plain = CliRunner().invoke(cli, [
        "audit", "--bootstrap-servers", scenario.bootstrap, "--group", scenario.group,
        "--topic", scenario.topic, "--clickhouse",
        f"{scenario.client.connection.host}:{scenario.client.connection.port}",
        "--table", f"{scenario.database}.plain"])
    assert plain.exit_code == 2 and "_topic" in plain.stderr
