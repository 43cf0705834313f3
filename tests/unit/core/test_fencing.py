"""Fenced attempts against an in-process transaction coordinator (epochs per
transactional id, as the broker keeps them): a newer attempt fences the older one's
commits, the older one's inserts stop at ``confirm``, a zombie can't duplicate rows.
(tests/integration/test_fencing.py runs the same against the real broker.)"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from blockagg.aggregator.core.model import Thresholds
from blockagg.aggregator.core.protocol import CommitMetadata, InsertBlock, plan_batch, run_batch
from blockagg.aggregator.kafka.exceptions import AttemptFenced, MetadataCommitError
from blockagg.aggregator.kafka.fencing import FencedAttempt, transactional_id
from blockagg.aggregator.kafka.metadata_store import KafkaMetadataStore
from tests.unit.core.fakes import DedupSink, expected_rows, make_batch


class Coordinator:
    """Offsets of one group and the current epoch of each transactional id."""

    def __init__(self) -> None:
        self.offsets: dict[tuple[str, int], tuple[int, str]] = {}
        self.epochs: dict[str, int] = {}
        self.fail_next: list[KafkaError] = []


class GroupConsumer:
    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    def committed(self, partitions: list[Any], timeout: float = 0) -> list[Any]:
        tp = partitions[0]
        offset, metadata = self.coordinator.offsets.get((tp.topic, tp.partition), (-1001, None))
        return [SimpleNamespace(offset=offset, metadata=metadata, error=None)]

    def commit(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a fenced attempt never commits outside a transaction")

    def close(self) -> None:
        pass

    def consumer_group_metadata(self) -> Any:
        return "simple-group"


class TxnProducer:
    def __init__(self, coordinator: Coordinator, settings: dict[str, Any]) -> None:
        self.coordinator = coordinator
        self.tid = settings["transactional.id"]
        self.settings = settings
        self.epoch = -1
        self.pending: list[Any] = []

    def _alive(self) -> None:
        if self.coordinator.epochs[self.tid] != self.epoch:
            raise KafkaException(KafkaError(KafkaError._FENCED, fatal=True))

    def init_transactions(self, timeout: float = 0) -> None:
        self.epoch = self.coordinator.epochs.get(self.tid, -1) + 1
        self.coordinator.epochs[self.tid] = self.epoch

    def begin_transaction(self) -> None:
        self.pending = []

    def send_offsets_to_transaction(self, positions: list[Any], group_metadata: Any,
                                    timeout: float = 0) -> None:
        assert group_metadata == "simple-group"
        self._alive()
        if self.coordinator.fail_next:
            raise KafkaException(self.coordinator.fail_next.pop(0))
        self.pending = list(positions)

    def commit_transaction(self, timeout: float = 0) -> None:
        self._alive()
        for tp in self.pending:
            self.coordinator.offsets[(tp.topic, tp.partition)] = (tp.offset, tp.metadata)

    def abort_transaction(self, timeout: float = 0) -> None:
        self._alive()
        self.pending = []


def store_and_opener(coordinator: Coordinator) -> tuple[KafkaMetadataStore, Any]:
    store = KafkaMetadataStore({"bootstrap.servers": "b:9092", "group.id": "g",
                                "security.protocol": "SSL"},
                               consumer_factory=lambda _: GroupConsumer(coordinator))

    def attempt(topic: str, partition: int) -> FencedAttempt:
        return FencedAttempt(store, topic, partition, sleep=lambda _: None,
                             producer_factory=lambda s: TxnProducer(coordinator, s))

    return store, attempt


def test_the_producer_gets_the_connection_settings_and_one_id_per_partition() -> None:
    coordinator = Coordinator()
    _, attempt = store_and_opener(coordinator)
    first = attempt("t", 3)
    settings = first._producer.settings
    assert settings["transactional.id"] == transactional_id("g", "t", 3) == "blockagg.g.t.3"
    assert settings["security.protocol"] == "SSL" and "group.id" not in settings
    assert coordinator.epochs == {"blockagg.g.t.3": 0}


def test_a_newer_attempt_fences_the_older_ones_commit_and_insert() -> None:
    coordinator = Coordinator()
    _, attempt = store_and_opener(coordinator)
    old = attempt("t", 0)
    old.commit("t", 0, 10, "ba1:old")
    old.confirm("t", 0)  # still the partition's last commit: may insert
    new = attempt("t", 0)
    with pytest.raises(AttemptFenced, match=r"t\[0\].*newer attempt"):
        old.commit("t", 0, 12, "ba1:zombie")
    new.commit("t", 0, 11, "ba1:new")
    with pytest.raises(AttemptFenced, match="no longer this attempt's intent"):
        old.confirm("t", 0)
    assert coordinator.offsets[("t", 0)] == (11, "ba1:new")
    with pytest.raises(AttemptFenced):
        attempt("t", 1).confirm("t", 1)  # nothing written yet: never insert


def test_an_abortable_error_is_aborted_and_retried_a_fatal_one_is_not() -> None:
    coordinator = Coordinator()
    _, attempt = store_and_opener(coordinator)
    one = attempt("t", 0)
    coordinator.fail_next = [KafkaError(KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
                                          txn_requires_abort=True)]
    one.commit("t", 0, 5, "ba1:x")
    assert coordinator.offsets[("t", 0)] == (5, "ba1:x")
    coordinator.fail_next = [KafkaError(KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
                                          fatal=True)]
    with pytest.raises(MetadataCommitError, match="safe to run again"):
        one.commit("t", 0, 6, "ba1:y")


def test_a_zombie_resumed_after_a_newer_attempt_stores_nothing_twice() -> None:
    """The issue's scenario: an attempt stalls after its intent, a newer attempt replays
    and goes on, then the stalled one resumes: its insert and its commits are refused."""
    coordinator = Coordinator()
    store, attempt = store_and_opener(coordinator)
    messages = [(i, 1 + i % 3, 1) for i in range(40)]
    batch = make_batch(messages, start=0, end=40)
    thresholds = Thresholds(max_rows=4, max_bytes=10**9, max_metadata_bytes=4096)
    sink = DedupSink(window=10**6)

    zombie = attempt(batch.topic, batch.partition)
    plan = plan_batch(batch, zombie.committed(batch.topic, batch.partition), thresholds, 1, 1)
    intent, *rest = plan.operations
    assert isinstance(intent, CommitMetadata) and isinstance(rest[0], InsertBlock)
    zombie.commit(batch.topic, batch.partition, intent.offset, intent.text)
    # ... stalls here; a newer attempt runs the whole batch:
    newer = attempt(batch.topic, batch.partition)
    retry = plan_batch(batch, newer.committed(batch.topic, batch.partition), thresholds, 1, 1)
    run_batch(retry, newer, sink, newer)
    # ... the zombie resumes with the rest of its plan: its first insert is refused.
    inserted = len(sink.inserted)
    with pytest.raises(AttemptFenced, match="block was not inserted"):
        run_batch(replace(plan, operations=tuple(rest)), zombie, sink, zombie)
    assert len(sink.inserted) == inserted and not sink.deduplicated
    assert sink.rows == expected_rows(messages)
    last = store.committed(batch.topic, batch.partition)
    assert last is not None and last.offset == 40
