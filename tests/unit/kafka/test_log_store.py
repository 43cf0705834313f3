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

    def create_topics(self, topics: list[Any], request_timeout: float) -> dict[str, Any]:
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


class _ScriptedAdmins:
    """The AdminClients ``ensure_topic`` makes, in turn: each one's CreateTopics ends
    as ``outcomes`` says (``None``: never answers, an exception: that error, ``"ok"``:
    created); the topic shows in the metadata once a CreateTopics was ``"created"``."""

    def __init__(self, *outcomes: Any) -> None:
        self.outcomes = list(outcomes)
        self.made = 0
        self.exists = False

    def __call__(self, config: object) -> Any:
        from concurrent.futures import Future

        self.made += 1
        outcome = self.outcomes.pop(0)
        scripted = self

        class _Admin:
            def list_topics(self, timeout: float) -> Any:
                topics = {"_blockagg_owners": None} if scripted.exists else {}
                return SimpleNamespace(topics=topics, brokers={1: None, 2: None, 3: None})

            def create_topics(self, topics: list[Any], request_timeout: float
                              ) -> dict[str, Any]:
                future: Future[None] = Future()
                if isinstance(outcome, BaseException):
                    future.set_exception(outcome)
                elif outcome == "ok":
                    future.set_result(None)
                elif outcome == "created":  # created, but the answer never came back
                    scripted.exists = True
                return {t.topic: future for t in topics}

        return _Admin()


def _ensure(monkeypatch: pytest.MonkeyPatch, admins: _ScriptedAdmins,
            timeout_s: float = 30.0) -> None:
    import confluent_kafka.admin

    monkeypatch.setattr(confluent_kafka.admin, "AdminClient", admins)
    KafkaStore({"bootstrap.servers": "x:1"}, "_blockagg_owners",
               timeout_s=timeout_s).ensure_topic()


def test_a_creation_sent_to_a_silent_controller_is_asked_again_by_a_fresh_client(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """CreateTopics goes to the broker the metadata named controller, in KRaft a random
    live broker, a cut one included until it is fenced. Before, the first start of a
    job during such a cut waited out the 30 s and was refused."""
    admins = _ScriptedAdmins(None, "ok")
    _ensure(monkeypatch, admins, timeout_s=1.5)
    assert admins.made == 2


def test_a_creation_whose_answer_was_lost_finds_the_topic_made(
        monkeypatch: pytest.MonkeyPatch) -> None:
    admins = _ScriptedAdmins("created", None)
    _ensure(monkeypatch, admins, timeout_s=1.5)
    assert admins.made == 2


def test_a_refused_creation_is_not_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    from confluent_kafka import KafkaError, KafkaException

    from blockagg.proto.exceptions import RegistryError

    refused = KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED,
                                        "Topic authorization failed"))
    admins = _ScriptedAdmins(refused, "ok")
    with pytest.raises(RegistryError, match=r"can't create registry topic _blockagg_owners: "
                                            r".*Topic authorization failed"):
        _ensure(monkeypatch, admins)
    assert admins.made == 1


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


def test_watermarks_wait_out_a_broker_cut_off_and_then_dropped(monkeypatch: Any) -> None:
    """A start during a broker cut (session 28's ``txn_coordinator_cut`` run): the
    watermark request to the cut leader failed with ``_DESTROY_BROKER`` once the cluster
    fenced it, and the start was refused; the next ask reaches the new leader."""
    from confluent_kafka import KafkaError, KafkaException

    from blockagg.aggregator.kafka import log_store

    monkeypatch.setattr("blockagg.aggregator.kafka.log_store.time.sleep", lambda s: None)
    codes = [KafkaError._TIMED_OUT, KafkaError._DESTROY_BROKER]

    class Consumer:
        def get_watermark_offsets(self, partition: Any, timeout: float) -> tuple[int, int]:
            if codes:
                raise KafkaException(KafkaError(codes.pop(0)))
            return 0, 4

    assert log_store._watermarks(Consumer(), None, 30.0) == (0, 4) and not codes
    fatal = KafkaError(KafkaError._DESTROY_BROKER, fatal=True)
    assert not log_store._transient(fatal)


class _Message:
    def __init__(self, offset: int, error: Any = None) -> None:
        self._offset, self._error = offset, error

    def error(self) -> Any:
        return self._error

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes:
        return f"k{self._offset}".encode()

    def value(self) -> bytes:
        return b"v"


def _scanning(monkeypatch: Any, polled: list[Any]) -> KafkaStore:
    import confluent_kafka

    topic = SimpleNamespace(error=None, partitions={0: None})

    class Consumer:
        def __init__(self, config: dict[str, Any]) -> None:
            pass

        def list_topics(self, topic_name: str, timeout: float) -> Any:
            return SimpleNamespace(topics={topic_name: topic})

        def get_watermark_offsets(self, partition: Any, timeout: float) -> tuple[int, int]:
            return 0, 2

        def assign(self, parts: Any) -> None:
            pass

        def poll(self, timeout: float) -> Any:
            return polled.pop(0)

        def close(self) -> None:
            pass

    monkeypatch.setattr(confluent_kafka, "Consumer", Consumer)
    return KafkaStore({"bootstrap.servers": "x:1"}, "_blockagg_schemas")


def test_a_scan_reads_on_through_a_transient_consumer_error(monkeypatch: Any) -> None:
    """A consumer's errors from ``poll`` are mostly news (the connection to a cut leader
    lost, all brokers down for a moment): librdkafka reconnects by itself. The scan read
    on within its deadline instead of refusing the start."""
    from confluent_kafka import KafkaError

    store = _scanning(monkeypatch, [_Message(0), _Message(-1, KafkaError(
        KafkaError._TRANSPORT)), _Message(-1, KafkaError(KafkaError._ALL_BROKERS_DOWN)),
        None, _Message(1)])
    records, end = store.scan()
    assert [offset for offset, _, _ in records] == [0, 1] and end == 2


def test_a_scan_still_refuses_an_error_that_asking_again_cannot_mend(
        monkeypatch: Any) -> None:
    from confluent_kafka import KafkaError

    from blockagg.proto.exceptions import RegistryError

    store = _scanning(monkeypatch, [_Message(-1, KafkaError(
        KafkaError.TOPIC_AUTHORIZATION_FAILED, "Topic authorization failed"))])
    with pytest.raises(RegistryError, match="Topic authorization failed"):
        store.scan()
