"""Fenced attempts against an in-process transaction coordinator (epochs per
transactional id, as the broker keeps them): a newer attempt fences the older one's
commits, the older one's inserts stop at ``confirm``, a zombie can't duplicate rows.
(tests/integration/test_fencing.py runs the same against the real broker.)"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException
from hypothesis import given, settings
from hypothesis import strategies as st

from blockagg.aggregator.core.exceptions import BatchEndsInsideReplayBlock
from blockagg.aggregator.core.metadata import decode, is_blockagg
from blockagg.aggregator.core.model import Thresholds
from blockagg.aggregator.core.protocol import (
    CommitMetadata,
    InsertBlock,
    Plan,
    plan_batch,
    run_batch,
)
from blockagg.aggregator.kafka import fencing
from blockagg.aggregator.kafka.exceptions import AttemptFenced, MetadataCommitError
from blockagg.aggregator.kafka.fencing import FencedAttempt, transactional_id
from blockagg.aggregator.kafka.metadata_store import KafkaMetadataStore
from tests.unit.core.fakes import DedupSink, Message, expected_rows, make_batch
from tests.unit.core.history import anomalies


class Coordinator:
    """Offsets of one group and the current epoch of each transactional id."""

    def __init__(self) -> None:
        self.offsets: dict[tuple[str, int], tuple[int, str]] = {}
        self.history: list[str] = []
        self.epochs: dict[str, int] = {}
        self.fail_next: list[KafkaError] = []
        self.init_failures: list[KafkaError] = []
        self.init_calls = 0


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

    def list_topics(self, topic: str | None = None, timeout: float = 0) -> Any:
        return SimpleNamespace(topics={topic: None})

    def init_transactions(self, timeout: float = 0) -> None:
        self.coordinator.init_calls += 1
        if self.coordinator.init_failures:
            raise KafkaException(self.coordinator.init_failures.pop(0))
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
            self.coordinator.history.append(tp.metadata)

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


def loading() -> KafkaError:
    """What librdkafka's ``init_transactions`` reports at its timeout while the
    coordinator's new leader is still loading its partition."""
    return KafkaError(KafkaError.COORDINATOR_LOAD_IN_PROGRESS, retriable=True)


def test_a_coordinator_still_loading_is_asked_again_and_the_fence_holds() -> None:
    coordinator = Coordinator()
    _, attempt = store_and_opener(coordinator)
    old = attempt("t", 0)
    old.commit("t", 0, 10, "ba1:old")
    coordinator.init_failures = [loading()] * (fencing.INIT_TRIES - 1)
    new = attempt("t", 0)
    assert coordinator.init_calls == 1 + fencing.INIT_TRIES
    with pytest.raises(AttemptFenced):
        old.commit("t", 0, 12, "ba1:zombie")
    new.commit("t", 0, 11, "ba1:new")
    assert coordinator.offsets[("t", 0)] == (11, "ba1:new")


def test_a_coordinator_loading_past_every_try_fails_the_attempt_saying_so() -> None:
    coordinator = Coordinator()
    _, attempt = store_and_opener(coordinator)
    coordinator.init_failures = [loading()] * fencing.INIT_TRIES
    with pytest.raises(MetadataCommitError, match=r"did not answer within 4 calls.*"
                                                  r"Nothing was written") as caught:
        attempt("t", 0)
    assert "COORDINATOR_LOAD_IN_PROGRESS" in str(caught.value)
    assert coordinator.init_calls == fencing.INIT_TRIES and coordinator.epochs == {}


def test_a_refused_transactional_id_is_not_asked_again_and_names_the_acls() -> None:
    coordinator = Coordinator()
    _, attempt = store_and_opener(coordinator)
    coordinator.init_failures = [KafkaError(KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED)]
    with pytest.raises(MetadataCommitError, match="IdempotentWrite on the cluster"):
        attempt("t", 0)
    assert coordinator.init_calls == 1


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


def test_a_stalled_attempt_fails_its_confirm_after_a_retrys_identical_intent() -> None:
    """Issue 25, path 1: attempt A commits its intent and stalls before its confirm;
    Spark's retry B of the same task plans the same batch, so its replay intent is A's
    text but for the attempt nonce; B inserts and dies before its next commit. A then
    resumes: its confirm must fail, since the last commit is B's, not its own (without
    the nonce the two texts are byte-identical and A inserted again, which an ALTER in
    between turns into a second copy on a content-hash server)."""
    coordinator = Coordinator()
    _, attempt = store_and_opener(coordinator)
    messages = [(i, 1 + i % 3, 1) for i in range(12)]
    batch = make_batch(messages, start=0, end=12)
    thresholds = Thresholds(max_rows=100, max_bytes=10**9, max_metadata_bytes=4096)
    sink = DedupSink(window=10**6)

    a = attempt(batch.topic, batch.partition)
    plan_a = plan_batch(batch, a.committed(batch.topic, batch.partition), thresholds, 1, 1,
                        attempt=a.nonce)
    intent_a = plan_a.operations[0]
    assert isinstance(intent_a, CommitMetadata)
    a.commit(batch.topic, batch.partition, intent_a.offset, intent_a.text)
    # A stalls; B (same run, batch, range and pins) replays A's intent:
    b = attempt(batch.topic, batch.partition)
    plan_b = plan_batch(batch, b.committed(batch.topic, batch.partition), thresholds, 1, 1,
                        attempt=b.nonce)
    intent_b, first_b = plan_b.operations[:2]
    assert isinstance(intent_b, CommitMetadata) and isinstance(first_b, InsertBlock)
    assert intent_b.metadata.blocks == intent_a.metadata.blocks
    assert intent_b.offset == intent_a.offset and intent_b.text != intent_a.text
    assert replace(decode(intent_b.text), attempt=a.nonce) == decode(intent_a.text)
    run_batch(replace(plan_b, operations=plan_b.operations[:2]), b, sink, b)
    # ... B dies before its next commit; A resumes with its confirm and insert:
    with pytest.raises(AttemptFenced, match="no longer this attempt's intent"):
        run_batch(replace(plan_a, operations=plan_a.operations[1:]), a, sink, a)
    assert len(sink.inserted) == 1 and not sink.deduplicated


def test_the_confirm_returns_when_its_read_began() -> None:
    """The writer judges a send's lateness from the confirming read's start: the last
    moment the attempt was known to be the partition's only writer."""
    coordinator = Coordinator()
    now = [0.0]
    store = KafkaMetadataStore({"bootstrap.servers": "b:9092", "group.id": "g"},
                               consumer_factory=lambda _: GroupConsumer(coordinator),
                               clock=lambda: now[0])
    one = FencedAttempt(store, "t", 0, sleep=lambda _: None, nonce=7,
                        producer_factory=lambda s: TxnProducer(coordinator, s))
    assert one.nonce == 7
    one.commit("t", 0, 5, "ba1:x")
    now[0] = 100.0
    assert one.confirm("t", 0) == 100.0
    now[0] = 150.0
    assert one.confirm("t", 0) == 150.0


@dataclass(frozen=True)
class Stalls:
    messages: list[Message]
    thresholds: Thresholds
    sizes: list[int]
    stalls: list[tuple[int, int, int, bool]]
    """(batch step, operations done before stalling, batches until it resumes, whether
    it resumes before that batch's newer attempt has committed anything)"""


@st.composite
def stalls(draw: st.DrawFn) -> Stalls:
    tables = draw(st.integers(min_value=1, max_value=4))
    offset = 0
    messages: list[Message] = []
    for _ in range(draw(st.integers(min_value=1, max_value=50))):
        messages.append((offset, draw(st.integers(min_value=0, max_value=tables)),
                         draw(st.integers(min_value=1, max_value=3))))
        offset += draw(st.sampled_from([1, 1, 2]))
    thresholds = Thresholds(max_rows=draw(st.integers(min_value=1, max_value=10)),
                            max_bytes=10**9, max_metadata_bytes=4096)
    sizes = draw(st.lists(st.integers(min_value=1, max_value=30), min_size=1, max_size=6))
    stalled = draw(st.lists(st.tuples(st.integers(min_value=0, max_value=8),
                                      st.integers(min_value=1, max_value=12),
                                      st.integers(min_value=0, max_value=3),
                                      st.booleans()), max_size=3))
    return Stalls(messages, thresholds, sizes, stalled)


def _resume_zombie(zombie: FencedAttempt, rest: Plan, coordinator: Coordinator,
                   sink: DedupSink, stalled_after: int) -> None:
    """Run a stalled attempt's remaining operations after a newer attempt opened: it is
    refused before any commit of it lands, inserts at most blocks the partition's last
    commit lists, and nothing at all once another attempt has committed since it
    stalled (``stalled_after`` commits then), even a byte-identical replay intent."""
    commits = len(coordinator.history)
    inserted, deduplicated = len(sink.inserted), len(sink.deduplicated)
    last = decode(coordinator.offsets[("events", 0)][1])
    with pytest.raises(AttemptFenced):
        run_batch(rest, zombie, sink, zombie)
    assert len(coordinator.history) == commits
    late = [*sink.inserted[inserted:], *sink.deduplicated[deduplicated:]]
    assert not (late and commits > stalled_after), "a zombie inserted after a newer commit"
    for block in late:
        listed = last.block_of(block.table_id)
        assert listed is not None and (listed.first, listed.last) == (block.first, block.last)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(stalls())
def test_stalled_attempts_resumed_later_change_nothing(scenario: Stalls) -> None:
    """Attempts stall after a random number of their operations and resume (their
    remaining operations) a random number of batches later, right after a newer attempt
    opened or after it ran, while newer attempts, each opening its fenced attempt first,
    replay and go on: every resumed attempt is refused before it commits, inserts
    nothing the last commit does not list, and in the end every row is in exactly
    once and the commit history has no anomaly."""
    coordinator = Coordinator()
    _, attempt = store_and_opener(coordinator)
    sink = DedupSink(window=10**6)
    log_end = scenario.messages[-1][0] + 1
    stalled_at = {step: (done, wait, early) for step, done, wait, early in scenario.stalls}
    zombies: list[tuple[int, bool, FencedAttempt, Plan, int]] = []
    for step in range(200):
        current = attempt("events", 0)
        committed = current.committed("events", 0)
        for zombie in [z for z in zombies if z[0] == step and z[1]]:
            zombies.remove(zombie)
            _resume_zombie(zombie[2], zombie[3], coordinator, sink, zombie[4])
        resume = 0 if committed is None else committed.offset
        if resume >= log_end:
            for zombie in list(zombies):
                _resume_zombie(zombie[2], zombie[3], coordinator, sink, zombie[4])
            break
        end = min(log_end, resume + scenario.sizes[step % len(scenario.sizes)])
        batch = make_batch(scenario.messages, resume, max(end, resume + 1))
        try:
            plan = plan_batch(batch, committed, scenario.thresholds, 1, step,
                              attempt=current.nonce)
        except BatchEndsInsideReplayBlock:
            batch = make_batch(scenario.messages, resume, log_end)
            plan = plan_batch(batch, committed, scenario.thresholds, 1, step,
                              attempt=current.nonce)
        if step in stalled_at and len(plan.operations) > stalled_at[step][0]:
            done, wait, early = stalled_at[step]
            run_batch(replace(plan, operations=plan.operations[:done]), current, sink, current)
            zombies.append((step + 1 + wait, early, current,
                            replace(plan, operations=plan.operations[done:]),
                            len(coordinator.history)))
        else:
            run_batch(plan, current, sink, current)
        for zombie in [z for z in zombies if z[0] <= step]:
            zombies.remove(zombie)
            _resume_zombie(zombie[2], zombie[3], coordinator, sink, zombie[4])
    else:
        raise AssertionError("not delivered within 200 batches")
    assert sink.rows == expected_rows(scenario.messages)
    history = [decode(text) for text in coordinator.history if is_blockagg(text)]
    assert anomalies(history) == []


class HangingProducer(TxnProducer):
    """A producer whose commit_transaction blocks past its timeout (until released)."""

    release = threading.Event()

    def commit_transaction(self, timeout: float = 0) -> None:
        self.release.wait(30)
        super().commit_transaction(timeout)


def test_a_transactional_call_that_hangs_past_its_timeout_ends_the_attempt() -> None:
    """librdkafka's commit_transaction can block past the timeout it is given; the
    attempt stops with one error naming the call instead of holding its task for ever,
    and keeps the producer (destroying it could block as well)."""
    coordinator = Coordinator()
    store = KafkaMetadataStore({"bootstrap.servers": "b:9092", "group.id": "g"},
                               consumer_factory=lambda _: GroupConsumer(coordinator),
                               timeout=0.05)
    attempt = FencedAttempt(store, "t", 2, sleep=lambda _: None, hang_grace_s=0.05,
                            producer_factory=lambda s: HangingProducer(coordinator, s))
    try:
        with pytest.raises(MetadataCommitError) as info:
            attempt.commit("t", 2, 10, "ba1:intent")
        producer = attempt._producer
        attempt.close()
        assert fencing._ABANDONED[-1] is producer
    finally:
        HangingProducer.release.set()
    assert str(info.value).startswith(
        "t[2] in group 'g': librdkafka's commit_transaction of the transactional id "
        "'blockagg.g.t.2' did not return within 0.1s although given 0.05s")
    assert "the next one fences it" in str(info.value)
    assert coordinator.history == []  # never committed while the attempt waited


def test_a_partitions_next_attempt_reuses_the_producer_and_the_fence_still_holds() -> None:
    from blockagg.aggregator.kafka.fencing import IdleProducers

    coordinator = Coordinator()
    store, elsewhere = store_and_opener(coordinator)
    idle = IdleProducers()
    made: list[TxnProducer] = []

    def here(topic: str, partition: int) -> FencedAttempt:
        def factory(settings: dict[str, Any]) -> TxnProducer:
            made.append(TxnProducer(coordinator, settings))
            return made[-1]
        return FencedAttempt(store, topic, partition, sleep=lambda _: None, idle=idle,
                             producer_factory=factory)

    first = here("t", 0)
    first.commit("t", 0, 10, "ba1:first")
    first.close()
    second = here("t", 0)  # the same worker's next task at the partition
    assert second.reused and len(made) == 1 and coordinator.epochs == {"blockagg.g.t.0": 0}
    assert coordinator.offsets[("t", 0)] == (10, "ba1:first")  # the probe left nothing
    assert coordinator.history == ["ba1:first"]
    with pytest.raises(AttemptFenced):
        second.confirm("t", 0)  # a reused producer starts with nothing written
    second.commit("t", 0, 11, "ba1:second")
    second.close()

    # Another worker's attempt initialises the id: the kept producer is stale, so the
    # next attempt here starts a fresh one, which fences that other attempt.
    other = elsewhere("t", 0)
    third = here("t", 0)
    assert not third.reused and len(made) == 2 and coordinator.epochs["blockagg.g.t.0"] == 2
    with pytest.raises(AttemptFenced):
        other.commit("t", 0, 12, "ba1:other")
    third.commit("t", 0, 12, "ba1:third")
    third.close()

    # A reused producer is fenced by a newer attempt like a fresh one.
    fourth = here("t", 0)
    assert fourth.reused
    newer = elsewhere("t", 0)
    with pytest.raises(AttemptFenced):
        fourth.commit("t", 0, 13, "ba1:fourth")
    fourth.close()  # a producer that met an error is not kept
    newer.commit("t", 0, 13, "ba1:newer")
    fifth = here("t", 0)
    assert not fifth.reused and len(made) == 3
    assert coordinator.history == ["ba1:first", "ba1:second", "ba1:third", "ba1:newer"]
