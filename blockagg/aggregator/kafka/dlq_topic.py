"""An optional Kafka dead-letter topic, for users whose tooling expects one.

The ClickHouse dead-letter table is the exactly-once record of rejected messages.
The topic is a copy, published **at least once**: :class:`DeadLetterTopicSink`
publishes a dead-letter block's messages only after ClickHouse acknowledged the
block, so a crash between the two, or a replayed block, publishes them again.
Every copy of a message is identical and carries a deterministic key, so consumers
can drop duplicates:

* key: ``{topic}/{partition}/{offset}`` of the original message (UTF-8), unique per
  rejected message and the same on every retry; with ``cleanup.policy=compact`` on
  the dead-letter topic, Kafka itself collapses duplicates;
* value: the original message value, byte for byte; timestamp: the original one;
* headers: ``blockagg.error``, ``blockagg.table``, ``blockagg.topic``,
  ``blockagg.partition``, ``blockagg.offset``, and Kafka Connect's
  ``__connect.errors.topic``/``partition``/``offset``/``exception.message`` for tools
  that read those.

Partitioning is by key with ``murmur2_random`` (the Java client's default), so a
message's copies land on one partition.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from blockagg import logs
from blockagg.aggregator.core.metadata import DEAD_LETTER_TABLE_ID
from blockagg.aggregator.core.model import Batch, Block, BlockSink
from blockagg.aggregator.kafka.exceptions import DeadLetterPublishFailed
from blockagg.rows.deadletters import DeadLetter

log = logging.getLogger(__name__)


class Producer(Protocol):
    """The part of ``confluent_kafka.Producer`` used here."""

    def produce(self, topic: str, value: bytes | None = None, key: bytes | None = None,
                **kwargs: Any) -> None: ...

    def poll(self, timeout: float = ...) -> int: ...

    def flush(self, timeout: float = ...) -> int: ...


def dlq_key(letter: DeadLetter) -> bytes:
    """The deterministic key: the original message's ``topic/partition/offset``."""
    return f"{letter.topic}/{letter.partition}/{letter.offset}".encode()


def dlq_headers(letter: DeadLetter) -> list[tuple[str, bytes]]:
    return [
        ("blockagg.error", letter.error.encode()),
        ("blockagg.table", letter.table.encode()),
        ("blockagg.topic", letter.topic.encode()),
        ("blockagg.partition", str(letter.partition).encode()),
        ("blockagg.offset", str(letter.offset).encode()),
        ("__connect.errors.topic", letter.topic.encode()),
        ("__connect.errors.partition", str(letter.partition).encode()),
        ("__connect.errors.offset", str(letter.offset).encode()),
        ("__connect.errors.exception.message", letter.error.encode()),
    ]


class DeadLetterTopic:
    """Publishes dead letters to ``topic``. ``config`` is librdkafka configuration
    (``bootstrap.servers``, SASL/TLS…), passed through; the producer is idempotent
    with ``acks=all``."""

    def __init__(self, config: Mapping[str, Any], topic: str, timeout_s: float = 60.0,
                 producer_factory: Callable[[dict[str, Any]], Producer] | None = None) -> None:
        self.topic = topic
        self.timeout_s = timeout_s
        self.config = {"partitioner": "murmur2_random", "linger.ms": 5, **dict(config),
                       "enable.idempotence": True, "acks": "all"}
        self._factory = producer_factory or _confluent_producer
        self._producer: Producer | None = None

    def publish(self, letters: Sequence[DeadLetter]) -> int:
        """Produce ``letters`` and wait until every one is acknowledged; raise
        :class:`DeadLetterPublishFailed` otherwise. Returns how many were sent."""
        if not letters:
            return 0
        if self._producer is None:
            self._producer = self._factory(self.config)
        producer = self._producer
        errors: list[str] = []

        def done(err: Any, msg: Any) -> None:
            if err is not None:
                errors.append(str(err))
        for letter in letters:
            kwargs: dict[str, Any] = {"headers": dlq_headers(letter), "on_delivery": done}
            if letter.timestamp_ms > 0:
                kwargs["timestamp"] = letter.timestamp_ms
            while True:
                try:
                    producer.produce(self.topic, value=letter.raw, key=dlq_key(letter),
                                     **kwargs)
                    break
                except BufferError:
                    producer.poll(0.5)
        left = producer.flush(self.timeout_s)
        if left or errors:
            raise DeadLetterPublishFailed(
                f"dead-letter topic {self.topic} did not acknowledge {left or len(errors)} of "
                f"{len(letters)} dead letters ({'; '.join(errors[:3]) or 'timeout'}); they are "
                "in the ClickHouse dead-letter table; check the topic exists and the "
                "producer's ACLs, and the retried batch will publish them again")
        return len(letters)

    def close(self) -> None:
        if self._producer is not None:
            self._producer.flush(self.timeout_s)
            self._producer = None


def _confluent_producer(config: dict[str, Any]) -> Producer:
    from confluent_kafka import Producer as KafkaProducer

    producer: Any = KafkaProducer(logs.kafka_client_config(config))
    return producer  # type: ignore[no-any-return]


class DeadLetterTopicSink:
    """A :class:`~aggregator.core.model.BlockSink` that inserts through ``inner``
    and then, for a dead-letter block, publishes its messages to ``dlq``. A block
    is acknowledged to the core only once both are done; a publish failure raises,
    so the batch is retried (ClickHouse drops the re-inserted block, the topic gets
    the copies again: at least once)."""

    def __init__(self, inner: BlockSink, dlq: DeadLetterTopic) -> None:
        self.inner = inner
        self.dlq = dlq

    def insert(self, block: Block, batch: Batch, confirmed_at: float | None = None) -> None:
        self.inner.insert(block, batch, confirmed_at)
        if block.table_id != DEAD_LETTER_TABLE_ID:
            return
        letters = [p for p in (batch.payloads[int(i)] for i in block.positions)
                   if isinstance(p, DeadLetter)]
        self.dlq.publish(letters)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
