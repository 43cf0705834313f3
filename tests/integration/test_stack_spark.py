"""Spark (local[2]) with the resolved spark-sql-kafka-0-10 jars reads our Kafka broker."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.conftest import ProducedTopic

pytestmark = pytest.mark.integration


def test_spark_batch_kafka_read_sees_every_message_with_partition_and_offset(
    spark_session: Any, kafka_bootstrap: str, produced_topic: ProducedTopic
) -> None:
    df = (
        spark_session.read.format("kafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("subscribe", produced_topic.topic)
        .option("startingOffsets", "earliest")
        .option("endingOffsets", "latest")
        .load()
    )
    rows = df.select("key", "value", "topic", "partition", "offset").collect()
    seen = sorted((bytes(r.key), bytes(r.value), r.partition, r.offset) for r in rows)
    want = sorted((m.key, m.value, m.partition, m.offset) for m in produced_topic.messages)
    assert seen == want
    assert {r.topic for r in rows} == {produced_topic.topic}
