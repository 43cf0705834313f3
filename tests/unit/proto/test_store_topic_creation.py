"""The compacted topics blockagg creates (registry, ownership records) are created safe
on a cluster of several brokers: replication factor 3 (at most the brokers) with
``min.insync.replicas=2``, not the broker's ``default.replication.factor`` (1 unless
changed), which the start-up durability check would refuse."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from blockagg.proto.registry import KafkaStore


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
