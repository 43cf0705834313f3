"""The topic incarnation: which Kafka cluster and which creation of a topic a batch
reads, as ``incarnation_of(cluster id, topic id)``.

Kafka gives every cluster an id and every topic an id (a UUID) at creation; deleting
and recreating a topic of the same name gives a new id. The incarnation is pinned in
the committed metadata and part of every block's deduplication token, so a block of
a recreated topic (or of another cluster's topic of the same name) never shares a
token with an old one, and a group whose last commit names another incarnation is
refused (:class:`aggregator.core.exceptions.TopicIncarnationChanged`).

The cluster id is read once per process (it never changes for a cluster); the topic
id at every call, since a recreation must be seen by the next batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from blockagg import logs
from blockagg.aggregator.core.metadata import incarnation_of
from blockagg.aggregator.kafka.errors import ask_controller, describe, unanswered
from blockagg.aggregator.kafka.exceptions import KafkaAdapterError


class IncarnationError(KafkaAdapterError):
    """The cluster id or a topic's id could not be read."""


class TopicIncarnations:
    """Reads incarnations with confluent-kafka's ``AdminClient`` (``config`` is
    librdkafka configuration, passed through: ``bootstrap.servers``, SASL/TLS...)."""

    def __init__(self, config: Mapping[str, Any], timeout_s: float = 30.0) -> None:
        self.config = dict(config)
        self.timeout_s = timeout_s
        self._admin: Any = None
        self._cluster_id: str | None = None

    def _client(self) -> Any:
        if self._admin is None:
            from confluent_kafka.admin import AdminClient

            self._admin = AdminClient(logs.kafka_client_config(self.config))
        return self._admin

    def cluster_id(self) -> str:
        if self._cluster_id is None:
            result = self._ask("the Kafka cluster id", lambda admin, seconds: (
                admin.describe_cluster(request_timeout=seconds).result(seconds)))
            if not result.cluster_id:
                raise IncarnationError("the Kafka cluster reports no cluster id; blockagg "
                                       "needs a KRaft or ZooKeeper cluster of Kafka 2.8+")
            self._cluster_id = str(result.cluster_id)
        return self._cluster_id

    def topic_id(self, topic: str) -> str:
        from confluent_kafka import TopicCollection

        description = self._ask(f"the topic id of {topic}", lambda admin, seconds: (
            admin.describe_topics(TopicCollection([topic]),
                                  request_timeout=seconds)[topic].result(seconds)))
        return str(description.topic_id)

    def _ask(self, what: str, call: Callable[[Any, float], Any]) -> Any:
        """``call(admin, seconds)`` by :func:`~blockagg.aggregator.kafka.errors.ask_controller`
        (DescribeCluster and DescribeTopics go to the named controller, a cut node
        included): a try without an answer drops the kept client."""
        def dropped() -> None:
            self._admin = None

        try:
            return ask_controller(lambda seconds: call(self._client(), seconds),
                                  self.timeout_s, dropped)
        except Exception as exc:
            raise IncarnationError(f"can't read {what}: {self._why(exc)}") from exc

    def _why(self, exc: BaseException) -> str:
        if unanswered(exc):
            return (f"no broker answered within {self.timeout_s:g}s ({describe(exc)}): a "
                    "broker cut off or failing over, or the cluster out of reach; asked "
                    "again at the next read")
        return describe(exc)

    def of(self, topic: str) -> int:
        """The topic's current incarnation (:func:`aggregator.core.metadata.incarnation_of`)."""
        return incarnation_of(self.cluster_id(), self.topic_id(topic))
