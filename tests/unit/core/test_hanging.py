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


# -- healing: the plan ----------------------------------------------------------------

GROUP = "g"
P = 7  # the group's __consumer_offsets partition


def tid(group: str, topic: str, partition: int) -> str:
    return f"blockagg.{group}.{topic}.{partition}"


def intent(resume: int, last: int, attempt: int = 2**31 + 5) -> str:
    from blockagg.aggregator.core.metadata import BlockRange, Metadata, encode

    return encode(Metadata(run=9, batch=3, start=max(0, resume - 10), resume=resume, end=last + 1,
                           blocks=(BlockRange(0, resume, last),), attempt=attempt))


def commit(topic: str, partition: int, offset: int, metadata: str,
           group: str = GROUP) -> Any:
    from blockagg.aggregator.kafka.offsets_codec import (
        OffsetCommit,
        OffsetCommitKey,
        OffsetCommitValue,
    )

    return OffsetCommit(OffsetCommitKey(group, topic, partition),
                        OffsetCommitValue(offset, metadata + "\x00", 1, version=4))


def txn(pid: int, start: int, epoch: int = 3) -> Any:
    from blockagg.aggregator.kafka.hanging import OpenTransaction

    return OpenTransaction(producer_id=pid, epoch=epoch, coordinator_epoch=-1,
                           start_offset=start)


def plan(open_txns: list[Any], records: Mapping[int, Any],
         coordinator: Mapping[str, Any] | None = None) -> Any:
    from blockagg.aggregator.kafka.hanging import plan_heal

    return plan_heal(GROUP, P, open_txns, records, coordinator or {}, tid)


def test_a_hanging_intent_is_committed_again_before_it_is_aborted() -> None:
    """The coordinator forgot it (id not found): the intent rolls forward, then the
    abort ends the hanging one; in that order, so a crash between repeats the plan."""
    from blockagg.aggregator.kafka.hanging import Abort, Recommit

    m = intent(100, 140)
    p = plan([txn(11, 50)], {50: commit("t", 2, 100, m)}, {tid(GROUP, "t", 2): None})
    assert p.steps == (Recommit("t", 2, 100, m, 50), Abort(P, 11, 3, -1, 50))
    assert p.left == () and p.complete


@pytest.mark.parametrize("state", ["CompleteCommit", "CompleteAbort", "Empty"])
def test_the_intent_rolls_forward_whatever_the_coordinator_says_it_did(state: str) -> None:
    """Committed (its blocks may be stored) or aborted (they were never inserted),
    replaying the intent is exact: one rule, no trust in a state that may be gone."""
    from blockagg.aggregator.kafka.hanging import CoordinatorView, Recommit

    view = CoordinatorView(state, 11, 3, frozenset())
    p = plan([txn(11, 50)], {50: commit("t", 2, 100, intent(100, 140))},
             {tid(GROUP, "t", 2): view})
    assert isinstance(p.steps[0], Recommit) and len(p.steps) == 2 and p.complete


def test_an_attempts_probe_is_only_aborted() -> None:
    """``FencedAttempt._still_current``'s probe (offset 0, no metadata) was always going
    to be aborted: nothing to roll forward."""
    from blockagg.aggregator.kafka.hanging import Abort

    p = plan([txn(12, 60)], {60: commit("t", 1, 0, "")})
    assert p.steps == (Abort(P, 12, 3, -1, 60),) and p.complete


def test_a_transaction_its_coordinator_still_runs_is_left_to_it() -> None:
    from blockagg.aggregator.kafka.hanging import CoordinatorView

    view = CoordinatorView("Ongoing", 11, 3, frozenset({("__consumer_offsets", P)}))
    p = plan([txn(11, 50)], {50: commit("t", 2, 100, intent(100, 140))},
             {tid(GROUP, "t", 2): view})
    assert p.steps == () and not p.complete
    assert "still runs it (Ongoing)" in p.left[0].reason


def test_a_newer_epoch_or_another_partition_in_the_coordinators_transaction_is_hanging(
) -> None:
    from blockagg.aggregator.kafka.hanging import CoordinatorView

    for view in (CoordinatorView("Ongoing", 11, 4, frozenset({("__consumer_offsets", P)})),
                 CoordinatorView("Ongoing", 11, 3, frozenset({("__consumer_offsets", 0)}))):
        p = plan([txn(11, 50)], {50: commit("t", 2, 100, intent(100, 140))},
                 {tid(GROUP, "t", 2): view})
        assert len(p.steps) == 2 and p.complete


def test_only_the_newest_hanging_intent_of_a_partition_rolls_forward() -> None:
    from blockagg.aggregator.kafka.hanging import Abort, Recommit

    old, new = intent(100, 140), intent(141, 190)
    p = plan([txn(13, 80), txn(11, 50), txn(12, 60)],
             {50: commit("t", 2, 100, old), 60: commit("t", 2, 0, ""),
              80: commit("t", 2, 141, new)})
    assert p.steps == (Recommit("t", 2, 141, new, 80), Abort(P, 11, 3, -1, 50),
                       Abort(P, 12, 3, -1, 60), Abort(P, 13, 3, -1, 80))


def test_what_is_not_this_groups_blockagg_commit_is_left_alone() -> None:
    """Another group's transaction does not block this group (left, not blocking);
    a foreign writer's commit on this group, or an unreadable record, is not guessed at."""
    from blockagg.aggregator.kafka.offsets_codec import SkippedRecord

    p = plan([txn(1, 10), txn(2, 20), txn(3, 30), txn(4, 40)],
             {10: commit("t", 0, 5, intent(5, 9), group="other"),
              20: commit("t", 0, 5, "app-offsets"), 30: None, 40: SkippedRecord(2, GROUP)})
    assert p.steps == ()
    assert [(item.producer_id, item.blocks) for item in p.left] == [
        (1, False), (2, True), (3, False), (4, False)]
    assert "not blockagg's ('app-offsets')" in p.left[1].reason and not p.complete


def test_a_partition_with_a_running_transaction_is_left_whole() -> None:
    """A hanging intent of a partition whose newest attempt is inside a transaction is
    not rolled forward under it; other partitions are healed."""
    from blockagg.aggregator.kafka.hanging import CoordinatorView

    running = CoordinatorView("Ongoing", 14, 3, frozenset({("__consumer_offsets", P)}))
    p = plan([txn(11, 50), txn(14, 90), txn(15, 95)],
             {50: commit("t", 2, 100, intent(100, 140)), 90: commit("t", 2, 0, ""),
              95: commit("t", 3, 7, intent(7, 9))},
             {tid(GROUP, "t", 2): running})
    assert [(type(s).__name__, s.start_offset) for s in p.steps] == [
        ("Recommit", 95), ("Abort", 95)]
    assert not p.complete
