"""The real Kafka broker does what the design relies on: produce/consume, offset commits that
carry a metadata string (visible through ``committed()`` and raw in ``__consumer_offsets``), and a
hard rejection of metadata over ``offset.metadata.max.bytes`` (4096, the broker default)."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    TopicPartition,
)

from tests.integration.conftest import STACK, ProducedTopic

pytestmark = pytest.mark.integration


def _consumer(bootstrap: str, group: str, **extra: Any) -> Consumer:
    return Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            **extra,
        }
    )


def _drain(consumer: Consumer, want: int, timeout: float = 30.0) -> list[Any]:
    out: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(out) < want and time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is None:
            continue
        assert msg.error() is None, msg.error()
        out.append(msg)
    return out


def test_produce_then_consume_every_message_on_a_fresh_topic(
    kafka_bootstrap: str, produced_topic: ProducedTopic
) -> None:
    assert len(produced_topic.messages) == 30
    c = _consumer(kafka_bootstrap, f"g-{uuid.uuid4().hex}")
    try:
        c.assign(
            [TopicPartition(produced_topic.topic, p, 0) for p in range(produced_topic.partitions)]
        )
        got = _drain(c, 30)
    finally:
        c.close()
    seen = sorted((m.key(), m.value(), m.partition(), m.offset()) for m in got)
    want = sorted((m.key, m.value, m.partition, m.offset) for m in produced_topic.messages)
    assert seen == want


def test_offset_commit_with_metadata_reads_back_and_is_in_consumer_offsets(
    kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=2, prefix="commitmeta")
    group = f"g-meta-{uuid.uuid4().hex}"
    metadata = "blockagg-test:" + uuid.uuid4().hex + ":" + "x" * 1000
    c = _consumer(kafka_bootstrap, group)
    try:
        c.assign([TopicPartition(topic, 1, 0)])
        result = c.commit(
            offsets=[TopicPartition(topic, 1, 42, metadata=metadata)], asynchronous=False
        )
        assert result is not None and all(tp.error is None for tp in result), result
        (committed,) = c.committed([TopicPartition(topic, 1)], timeout=10)
    finally:
        c.close()
    assert committed.offset == 42
    assert committed.metadata == metadata

    # The same commit, raw, in the internal topic: key = (version, group, topic, partition).
    raw = Consumer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": f"g-raw-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
        }
    )
    try:
        md = raw.list_topics("__consumer_offsets", timeout=10).topics["__consumer_offsets"]
        raw.assign(
            [TopicPartition("__consumer_offsets", p, OFFSET_BEGINNING) for p in md.partitions]
        )
        found = None
        deadline = time.monotonic() + 30
        while found is None and time.monotonic() < deadline:
            msg = raw.poll(0.5)
            if msg is None or msg.error() is not None:
                continue
            key, value = msg.key() or b"", msg.value() or b""
            if group.encode() in key and topic.encode() in key:
                found = value
    finally:
        raw.close()
    assert found is not None, "commit record not found in __consumer_offsets"
    assert metadata.encode() in found


def test_broker_rejects_metadata_over_4096_with_offset_metadata_too_large(
    kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=1, prefix="bigmeta")
    group = f"g-big-{uuid.uuid4().hex}"
    c = _consumer(kafka_bootstrap, group)
    errors: list[KafkaError] = []
    try:
        c.assign([TopicPartition(topic, 0, 0)])
        try:
            result = c.commit(
                offsets=[TopicPartition(topic, 0, 7, metadata="m" * 4097)], asynchronous=False
            )
            errors.extend(tp.error for tp in result or [] if tp.error is not None)
        except KafkaException as e:
            errors.append(e.args[0])
        (committed,) = c.committed([TopicPartition(topic, 0)], timeout=10)
    finally:
        c.close()
    assert errors, "an oversized metadata commit succeeded silently"
    assert all(e.code() == KafkaError.OFFSET_METADATA_TOO_LARGE for e in errors), errors
    assert committed.offset < 0, "nothing must be committed"


def test_scripts_stack_runs_kafkas_admin_tools_against_the_stack(
    stack_env: dict[str, str],
) -> None:
    """Issue 26: the runbooks' kafka-topics.sh, kafka-consumer-groups.sh and
    kafka-transactions.sh on the local stack, which runs Kafka from its jars: each tool
    once, through ``scripts/stack``, as the docs write it (stack.md)."""
    bootstrap = stack_env["BLOCKAGG_BOOTSTRAP_SERVERS"]
    env = {**os.environ, **stack_env}

    def tool(*args: str) -> str:
        res = subprocess.run([str(STACK), *args], env=env, capture_output=True, text=True,
                             check=False, timeout=300)
        assert res.returncode == 0, f"{args}: exit {res.returncode}\n{res.stderr[-3000:]}"
        return res.stdout

    created = f"tools_{uuid.uuid4().hex[:12]}"
    tool("kafka-topics", "--bootstrap-server", bootstrap, "--create", "--topic", created,
         "--partitions", "4")
    assert created in tool("kafka-topics", "--list").split()  # default bootstrap
    described = tool("kafka-topics", "--bootstrap-server", bootstrap, "--describe",
                     "--topic", created)
    assert described.count("Partition: ") == 4, described

    group = f"tools-{uuid.uuid4().hex[:8]}"
    c = _consumer(bootstrap, group)
    try:
        c.commit(offsets=[TopicPartition(created, 2, 0)], asynchronous=False)
    finally:
        c.close()
    groups = tool("kafka-consumer-groups", "--bootstrap-server", bootstrap, "--describe",
                  "--group", group)
    assert any(line.split()[:3] == [group, created, "2"] for line in groups.splitlines()), groups

    transactions = tool("kafka-transactions", "--bootstrap-server", bootstrap, "list")
    assert transactions.split()[:4] == ["TransactionalId", "Coordinator", "ProducerId",
                                        "TransactionState"], transactions[:500]
