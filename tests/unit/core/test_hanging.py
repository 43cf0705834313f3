"""A transaction on the metadata group that never ends (``kafka.hanging``): the
``__consumer_offsets`` partition is found as Kafka finds it, and a stable read that
times out becomes one refusal naming the remedy, never a retry loop.
(tests/integration/test_fencing.py holds a real broker's transaction open.)"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from blockagg.aggregator.kafka.exceptions import CommittedReadError, MetadataUnstable
from blockagg.aggregator.kafka.hanging import offsets_partition, read_or_diagnose
from tests.unit.core.test_kafka_metadata_store import ScriptedConsumer


@pytest.mark.parametrize(("group", "partitions", "expected"), [
    # from Java with Kafka 4.3.1's jars: Utils.abs(s.hashCode()) % partitions
    ("blockagg-fx-9afaf273", 50, 41),
    ("my-group", 50, 12),  # a negative hashCode (-1906497762): negated, not masked
    ("runbook-a0d9ccfb3b", 3, 2),  # negative too; masking said 0 (the runbook test's flake)
    ("grüße-€-𝄞", 50, 29),  # non-ASCII and a surrogate pair: UTF-16 code units
    ("blockagg-metadata", 50, 0),
    ("polygenelubricants", 50, 0),  # hashCode Integer.MIN_VALUE: Utils.abs gives 0
    ("blockagg-fx-9afaf273", 3, 0),
])
def test_the_offsets_partition_is_kafkas(group: str, partitions: int, expected: int) -> None:
    assert offsets_partition(group, partitions) == expected


class Diagnosis:
    def __init__(self, answer: MetadataUnstable | None) -> None:
        self.answer = answer
        self.calls: list[tuple[str, list[tuple[str, int]], float]] = []

    def __call__(self, config: Mapping[str, Any], group: str,
                 partitions: Iterable[tuple[str, int]], *,
                 waited: float) -> MetadataUnstable | None:
        self.calls.append((group, list(partitions), waited))
        return self.answer


def timed_out() -> Any:
    raise KafkaException(KafkaError(KafkaError._TIMED_OUT))


def test_a_timeout_with_a_transaction_that_never_ends_is_refused_with_the_diagnosis() -> None:
    hang = MetadataUnstable("hanging transaction in __consumer_offsets-0")
    diagnose = Diagnosis(hang)
    with pytest.raises(MetadataUnstable) as info:
        read_or_diagnose(timed_out, {}, "g", [("t", 1)], diagnose=diagnose)
    assert info.value is hang and isinstance(info.value.__cause__, KafkaException)
    assert [(g, p) for g, p, _ in diagnose.calls] == [("g", [("t", 1)])]


def test_a_timeout_without_that_diagnosis_and_other_errors_surface_as_they_were() -> None:
    diagnose = Diagnosis(None)
    with pytest.raises(KafkaException, match="Timed out"):
        read_or_diagnose(timed_out, {}, "g", [("t", 1)], diagnose=diagnose)

    def refused() -> Any:
        raise KafkaException(KafkaError(KafkaError.GROUP_AUTHORIZATION_FAILED))

    with pytest.raises(KafkaException, match="uthoriz"):
        read_or_diagnose(refused, {}, "g", [("t", 1)], diagnose=diagnose)
    assert len(diagnose.calls) == 1
    assert read_or_diagnose(lambda: 7, {}, "g", [], diagnose=diagnose) == 7


def test_the_store_refuses_at_once_instead_of_retrying_a_hanging_transaction() -> None:
    """The store retries a timed-out read 8 times (30 s each); a transaction that will
    never end is refused on the first, as a ``CommittedReadError`` the task reports."""
    from blockagg.aggregator.kafka.metadata_store import KafkaMetadataStore

    consumer = ScriptedConsumer([("raise", KafkaError._TIMED_OUT)] * 8)
    sleeps: list[float] = []
    diagnose = Diagnosis(MetadataUnstable("hanging"))
    store = KafkaMetadataStore({"bootstrap.servers": "b:9092", "group.id": "g"},
                               consumer_factory=lambda c: consumer, sleep=sleeps.append,
                               diagnose=diagnose)
    with pytest.raises(CommittedReadError, match="hanging"):
        store.committed("events", 3)
    assert sleeps == [] and [(g, p) for g, p, _ in diagnose.calls] == [("g", [("events", 3)])]
