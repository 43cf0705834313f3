"""The optional Kafka dead-letter topic against the real broker."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest

from blockagg.aggregator.kafka.dlq_topic import DeadLetterTopic
from blockagg.rows.deadletters import make_dead_letter

pytestmark = pytest.mark.integration


def test_publish_keys_headers_and_values(kafka_bootstrap: str,
                                         new_topic: Callable[..., str]) -> None:
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    topic = new_topic(partitions=2, prefix="dlq")
    letters = [make_dead_letter("src", 1, 10 + i, 1_700_000_000_000 + i, b"v%d" % i,
                                f"err {i}", "db.t") for i in range(4)]
    dlq = DeadLetterTopic({"bootstrap.servers": kafka_bootstrap}, topic)
    assert dlq.publish(letters) == 4
    assert dlq.publish(letters[:2]) == 2            # a retry: same keys, same partitions
    dlq.close()
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": uuid.uuid4().hex,
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    # Assigned, not subscribed: reading back needs no group coordinator (one still
    # loading __consumer_offsets kept a subscriber waiting past the loop in CI).
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(2)])
    got: list[Any] = []
    try:
        for _ in range(60):
            msg = consumer.poll(1.0)
            if msg is not None and msg.error() is None:
                got.append(msg)
            if len(got) == 6:
                break
    finally:
        consumer.close()
    assert len(got) == 6
    by_key: dict[bytes, set[tuple[int, bytes]]] = {}
    for m in got:
        by_key.setdefault(m.key(), set()).add((m.partition(), m.value()))
        headers = dict(m.headers())
        assert headers["blockagg.table"] == b"db.t"
        assert headers["blockagg.offset"] == m.key().split(b"/")[-1]
    assert sorted(by_key) == [b"src/1/10", b"src/1/11", b"src/1/12", b"src/1/13"]
    assert all(len(copies) == 1 for copies in by_key.values())   # copies are identical
    first = next(m for m in got if m.key() == b"src/1/10")
    assert first.timestamp()[1] == 1_700_000_000_000 and first.value() == b"v0"
