"""A compacted single-partition log on Kafka: the schema registry's topic (a
:class:`proto.registry.Store`) and the ownership topic (:mod:`kafka.ownership`) are both one.

A read returns every record with its offset, from the beginning up to the end offset at
the time of the read; one partition keeps the order of the records total, the same for
every reader. Here, in the Kafka adapter, not in ``proto``: the registry's read side takes
any :class:`~proto.registry.Store` and needs no Kafka client.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

from blockagg import logs
from blockagg.aggregator.kafka.durability import creation_settings
from blockagg.proto.exceptions import RegistryError
from blockagg.proto.registry import DEFAULT_TOPIC, Entry, RegistryCache


def _transient(error: Any) -> bool:
    """Whether a read failing with ``error`` may succeed if asked again: a leader moving
    (``NOT_LEADER_FOR_PARTITION`` while a restarted broker takes its partitions back),
    no answer (:data:`~blockagg.aggregator.kafka.errors.UNANSWERED_CODES`: a broker cut
    off, or ``_DESTROY_BROKER`` once the cluster fenced it and librdkafka dropped its
    requests), or librdkafka's retriable flag; never a fatal error."""
    from confluent_kafka import KafkaError

    from blockagg.aggregator.kafka.errors import UNANSWERED_CODES, is_retriable

    if not isinstance(error, KafkaError) or error.fatal():
        return False
    return (error.code() in (KafkaError.NOT_LEADER_FOR_PARTITION,
                             KafkaError.LEADER_NOT_AVAILABLE)
            or error.code() in UNANSWERED_CODES or is_retriable(error))


def _watermarks(consumer: Any, partition: Any, timeout_s: float) -> tuple[int, int]:
    """The partition's low and high watermarks, asked again while the error is
    :func:`_transient` until ``timeout_s`` passed."""
    from confluent_kafka import KafkaException

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            low, high = consumer.get_watermark_offsets(
                partition, timeout=max(1.0, deadline - time.monotonic()))
            return int(low), int(high)
        except KafkaException as exc:
            if not _transient(exc.args[0] if exc.args else None) or (
                    time.monotonic() + 0.5 > deadline):
                raise
            time.sleep(0.5)


class KafkaStore:
    """The registry topic. ``config`` is librdkafka configuration
    (``bootstrap.servers``, SASL/TLS settings…), passed through unchanged."""

    def __init__(self, config: Mapping[str, Any], topic: str = DEFAULT_TOPIC,
                 timeout_s: float = 30.0) -> None:
        self.config = dict(config)
        self.topic = topic
        self.timeout_s = timeout_s
        self._watcher: Any = None

    def ensure_topic(self, replication_factor: int | None = None) -> None:
        """Create the topic (1 partition, ``cleanup.policy=compact``) if missing. By
        default with the durability ``kafka.durability.creation_settings`` gives for the
        cluster's broker count (RF 3 and ``min.insync.replicas=2`` on three brokers or
        more, not the broker's default of 1), so the start-up check accepts it.

        CreateTopics goes to the named controller, a cut node included, so it is sent by
        :func:`~blockagg.aggregator.kafka.errors.ask_controller`: a try without an answer
        is asked again by a fresh client. A try that was answered but whose answer was
        lost finds the topic there, which is success."""
        from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

        from blockagg.aggregator.kafka.errors import ask_controller

        def create(seconds: float) -> None:
            admin = AdminClient(logs.kafka_client_config(self.config))
            md = admin.list_topics(timeout=self.timeout_s)
            if self.topic in md.topics:
                return
            settings = {"cleanup.policy": "compact"}
            rf = replication_factor
            if rf is None:
                rf, extra = creation_settings(len(md.brokers))
                settings.update(extra)
            futures = admin.create_topics([NewTopic(
                self.topic, num_partitions=1, replication_factor=rf, config=settings)],
                request_timeout=seconds)
            for fut in futures.values():
                try:
                    fut.result(seconds)
                except Exception as exc:
                    if "TOPIC_ALREADY_EXISTS" not in str(exc):
                        raise

        try:
            ask_controller(create, self.timeout_s)
        except Exception as exc:
            raise RegistryError(
                f"can't create registry topic {self.topic}: {exc or type(exc).__name__}"
            ) from exc

    def read(self) -> list[tuple[bytes | None, bytes | None]]:
        return [(k, v) for _, k, v in self.scan()[0]]

    def end(self) -> int:
        """The topic's end offset now (one watermark request on a kept consumer):
        whether a snapshot is current, without reading the topic."""
        from confluent_kafka import Consumer, KafkaException, TopicPartition

        try:
            if self._watcher is None:
                self._watcher = Consumer(logs.kafka_client_config({
                    **self.config, "group.id": f"blockagg-registry-{uuid.uuid4().hex}",
                    "enable.auto.commit": False}))
            md = self._watcher.list_topics(self.topic, timeout=self.timeout_s)
            topic = md.topics.get(self.topic)
            if topic is None or topic.error is not None:
                return 0
            _single_partition(self.topic, len(topic.partitions))
            _, high = _watermarks(self._watcher, TopicPartition(self.topic, 0), self.timeout_s)
            return int(high)
        except KafkaException as exc:
            raise RegistryError(f"can't read the end of registry topic {self.topic}: "
                                f"{exc}") from exc

    def scan(self) -> tuple[list[Entry], int]:
        """Every record with its offset, up to the end offset at the time of the call,
        and that end offset (the registry position the records cover)."""
        from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

        conf = {**self.config, "group.id": f"blockagg-registry-{uuid.uuid4().hex}",
                "enable.auto.commit": False, "auto.offset.reset": "earliest",
                "enable.partition.eof": True, "isolation.level": "read_committed"}
        consumer = Consumer(logs.kafka_client_config(conf))
        try:
            md = consumer.list_topics(self.topic, timeout=self.timeout_s)
            topic = md.topics.get(self.topic)
            if topic is None or topic.error is not None:
                return [], 0
            _single_partition(self.topic, len(topic.partitions))
            ends: dict[int, int] = {}
            parts = []
            low, high = _watermarks(consumer, TopicPartition(self.topic, 0), self.timeout_s)
            if high > low:
                ends[0] = high
                parts.append(TopicPartition(self.topic, 0, low))
            records: list[Entry] = []
            if not parts:
                return records, int(high)
            consumer.assign(parts)
            deadline = time.monotonic() + self.timeout_s
            while ends:
                if time.monotonic() > deadline:
                    raise RegistryError(
                        f"timed out reading registry topic {self.topic} to its end")
                msg = consumer.poll(1.0)
                if msg is None:
                    continue
                error = msg.error()
                partition = int(msg.partition() or 0)
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        ends.pop(partition, None)
                        continue
                    if _transient(error):
                        continue  # the consumer reconnects itself; the deadline bounds it
                    raise RegistryError(f"reading {self.topic}: {error}")
                offset = int(msg.offset() or 0)
                records.append((offset, msg.key(), msg.value()))
                if offset + 1 >= ends.get(partition, 0):
                    ends.pop(partition, None)
            return records, int(high)
        except KafkaException as exc:
            raise RegistryError(f"can't read registry topic {self.topic}: {exc}") from exc
        finally:
            consumer.close()

    def write(self, key: bytes, value: bytes) -> None:
        """Write one record, creating the topic first if it is missing (compacted, with
        the durability :meth:`ensure_topic` gives it), never by the broker's
        ``auto.create.topics.enable`` (its defaults: ``cleanup.policy=delete``, which
        drops registrations after the retention, and ``default.replication.factor``)."""
        from confluent_kafka import KafkaException, Producer

        try:
            self.ensure_topic()
        except KafkaException as exc:
            raise RegistryError(f"can't read the topics of the cluster to write to registry "
                                f"topic {self.topic}: {exc}") from exc
        producer = Producer(logs.kafka_client_config(
            {**self.config, "enable.idempotence": True, "acks": "all"}))
        errors: list[str] = []

        def done(err: Any, msg: Any) -> None:
            if err is not None:
                errors.append(str(err))
        try:
            producer.produce(self.topic, key=key, value=value, on_delivery=done)
            left = producer.flush(self.timeout_s)
        except KafkaException as exc:
            raise RegistryError(f"can't write to registry topic {self.topic}: {exc}") from exc
        if left or errors:
            raise RegistryError(f"registration for {key.decode()} was not acknowledged by "
                                f"{self.topic}: {errors or 'timeout'}")


def _single_partition(topic: str, partitions: int) -> None:
    if partitions != 1:
        raise RegistryError(
            f"registry topic {topic} has {partitions} partitions; it must have exactly one "
            "(positions and the order of registrations are per partition): point "
            "[schemas] topic at a topic with one partition and cleanup.policy=compact")


def from_config(config: Any) -> RegistryCache:
    """The registry of a job configuration (``blockagg.config.Config``): the
    ``[schemas] topic`` read with the job's Kafka client settings."""
    return RegistryCache(KafkaStore(dict(config.kafka.librdkafka_config()),
                                    config.schemas.topic),
                         refresh_interval_s=config.schemas.refresh_interval)
