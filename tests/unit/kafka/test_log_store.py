"""The compacted single-partition log on Kafka (``aggregator.kafka.log_store``).

The compacted topics blockagg creates (registry, ownership records) are created safe
on a cluster of several brokers: replication factor 3 (at most the brokers) with
``min.insync.replicas=2``, not the broker's ``default.replication.factor`` (1 unless
changed), which the start-up durability check would refuse. A read asks for the
watermarks again while a restarted broker takes its partitions back."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from blockagg.aggregator.kafka.log_store import KafkaStore


class FakeAdmin:
    created: ClassVar[list[Any]] = []
    brokers = 3

    def __init__(self, config: dict[str, Any]) -> None:
        pass

    def list_topics(self, timeout: float) -> Any:
        return SimpleNamespace(topics={}, brokers={i: None for i in range(self.brokers)})

    def create_topics(self, topics: list[Any]) -> dict[str, Any]:
        FakeAdmin.created.extend(topics)
        return {t.topic: SimpleNamespace(result=lambda timeout: None) for t in topics}


@pytest.mark.parametrize("brokers,rf,min_insync", [(1, -1, None), (2, 2, "2"), (3, 3, "2"),
                                                   (6, 3, "2")])
def test_the_store_topic_is_created_with_the_durability_the_cluster_needs(
        monkeypatch: pytest.MonkeyPatch, brokers: int, rf: int, min_insync: str | None) -> None:
    import confluent_kafka.admin

    FakeAdmin.created, FakeAdmin.brokers = [], brokers
    monkeypatch.setattr(confluent_kafka.admin, "AdminClient", FakeAdmin)
    KafkaStore({"bootstrap.servers": "x:1"}, "_blockagg_owners").ensure_topic()
    [made] = FakeAdmin.created
    assert made.replication_factor == rf and made.config["cleanup.policy"] == "compact"
    assert made.config.get("min.insync.replicas") == min_insync
    if brokers > 1:
        assert made.config["unclean.leader.election.enable"] == "false"


def test_an_explicit_replication_factor_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    import confluent_kafka.admin

    FakeAdmin.created, FakeAdmin.brokers = [], 3
    monkeypatch.setattr(confluent_kafka.admin, "AdminClient", FakeAdmin)
    KafkaStore({"bootstrap.servers": "x:1"}, "_s").ensure_topic(replication_factor=1)
    assert FakeAdmin.created[0].replication_factor == 1


class FakeProducer:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def produce(self, topic: str, key: bytes, value: bytes, on_delivery: Any) -> None:
        on_delivery(None, None)

    def flush(self, timeout: float) -> int:
        return 0


def test_a_registration_creates_a_missing_registry_topic_itself_not_by_auto_creation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A broker's auto-created topic has ``cleanup.policy=delete`` (registrations gone
    after the retention) and ``default.replication.factor``: the first write creates it."""
    import confluent_kafka
    import confluent_kafka.admin

    FakeAdmin.created, FakeAdmin.brokers = [], 3
    monkeypatch.setattr(confluent_kafka.admin, "AdminClient", FakeAdmin)
    monkeypatch.setattr(confluent_kafka, "Producer", FakeProducer)
    KafkaStore({"bootstrap.servers": "x:1"}, "_blockagg_schemas").write(b"t", b"v")
    [made] = FakeAdmin.created
    assert made.topic == "_blockagg_schemas" and made.replication_factor == 3
    assert made.config["cleanup.policy"] == "compact"


def test_watermarks_are_asked_again_while_a_restarted_broker_takes_its_partitions_back(
        monkeypatch: Any) -> None:
    """Seen in CI right after a kill -9 of the broker: NOT_LEADER_FOR_PARTITION for a
    moment, then the answer. A non-transient error is raised at once."""
    from confluent_kafka import KafkaError, KafkaException

    from blockagg.aggregator.kafka import log_store

    monkeypatch.setattr("blockagg.aggregator.kafka.log_store.time.sleep", lambda s: None)

    class Consumer:
        def __init__(self, errors: list[int]) -> None:
            self.errors = errors
            self.calls = 0

        def get_watermark_offsets(self, partition: Any, timeout: float) -> tuple[int, int]:
            self.calls += 1
            if self.errors:
                raise KafkaException(KafkaError(self.errors.pop(0)))
            return 3, 9

    flaky = Consumer([KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE])
    assert log_store._watermarks(flaky, None, 30.0) == (3, 9) and flaky.calls == 3
    with pytest.raises(KafkaException):
        log_store._watermarks(Consumer([KafkaError.TOPIC_AUTHORIZATION_FAILED]), None, 30.0)
