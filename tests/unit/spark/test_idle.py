"""blockagg.spark.idle: which quiet partitions are re-committed, unchanged, and the
interval checked against the brokers' offsets.retention.minutes."""

from __future__ import annotations

import pytest

from blockagg.aggregator.core.model import Committed
from blockagg.exceptions import ConfigError
from blockagg.spark.idle import IdleRefresher, check_idle_interval


class Store:
    def __init__(self) -> None:
        self.commits: dict[tuple[str, int], Committed] = {("t", 0): Committed(5, "ba1:x"),
                                                          ("t", 1): Committed(9, "")}
        self.history: list[tuple[str, int, int, str]] = []

    def committed(self, topic: str, partition: int) -> Committed | None:
        return self.commits.get((topic, partition))

    def commit(self, topic: str, partition: int, offset: int, metadata: str) -> None:
        self.history.append((topic, partition, offset, metadata))


def test_the_default_and_a_quarter_of_the_retention_pass() -> None:
    check_idle_interval(3600.0, 7 * 24 * 60)
    check_idle_interval(42 * 3600.0, 7 * 24 * 60)
    with pytest.raises(ConfigError, match=r"idle_commit_interval = 151201s .* "
                       r"offsets\.retention\.minutes = 10080 .* at most 151200s") as info:
        check_idle_interval(42 * 3600.0 + 1, 7 * 24 * 60)
    assert "151201s" in str(info.value)


def test_quiet_partitions_are_recommitted_unchanged_once_per_interval() -> None:
    now = [1000.0]
    idle = IdleRefresher(60.0, lambda: now[0])
    store = Store()
    partitions = [("t", 0), ("t", 1), ("t", 2)]
    assert idle.due(partitions) == []  # of unknown age: due after the start grace
    now[0] += 60  # min(interval, START_GRACE_S)
    assert idle.due(partitions) == partitions
    assert idle.refresh(store, idle.due(partitions)) == 2  # t[2] has no commit
    assert store.history == [("t", 0, 5, "ba1:x"), ("t", 1, 9, "")]
    now[0] += 59
    assert idle.due(partitions) == []
    idle.saw_commit(("t", 0))  # a task committed it
    now[0] += 1
    assert idle.due(partitions) == [("t", 1), ("t", 2)]
    assert idle.due(partitions, busy={("t", 1): object()}) == [("t", 2)]


def test_a_start_does_not_recommit_what_the_first_batch_commits() -> None:
    """Issue 26: every start logged ``idle partitions re-committed partitions=4`` for
    commits a minute old, under the 1 h interval. Kafka does not say how old a commit
    is, so a partition not seen committed in this run waits START_GRACE_S for its first
    re-commit; the first batch commits those with messages, and only the quiet ones
    are re-committed, once, when the grace ends; then every interval."""
    from blockagg.spark.idle import START_GRACE_S

    now = [1000.0]
    idle = IdleRefresher(3600.0, lambda: now[0])
    partitions = [("t", 0), ("t", 1), ("t", 2), ("t", 3)]
    assert idle.due(partitions) == []
    now[0] += 20
    for tp in partitions[:3]:  # the first batch: three partitions have messages
        idle.saw_commit(tp)
    assert idle.unknown_age(partitions) == [("t", 3)]
    now[0] = 1000.0 + START_GRACE_S - 1
    assert idle.due(partitions) == []
    now[0] += 1
    assert idle.due(partitions) == [("t", 3)]
    assert idle.refresh(Store(), [("t", 3)]) == 0  # no commit: nothing to keep
    assert idle.due(partitions) == [] and idle.unknown_age(partitions) == []
    now[0] = 1020.0 + 3600
    assert idle.due(partitions) == partitions[:3]


def test_a_recommit_of_an_intent_carries_its_own_attempt_so_a_stalled_task_is_refused() -> None:
    """Issue 25: the refresher repeats a partition's last intent in a fencing attempt
    of its own. Repeated byte for byte, it would read to the task that wrote the
    intent (stalled before a confirm) as still its own commit; under the refresher's
    nonce the task's confirm fails. Everything the verifier reads stays the same, and
    so does the length (the broker's limit)."""
    from dataclasses import replace

    from blockagg.aggregator.core.metadata import BlockRange, Metadata, Pins, decode, encode
    from blockagg.aggregator.kafka.fencing import new_nonce
    from blockagg.spark.idle import with_attempt

    intent = Metadata(7, 3, 100, 200, 120, (BlockRange(1, 120, 150),), Pins(5, 9, 1, 4),
                      attempt=new_nonce(), since_s=1_790_000_000)
    text = encode(intent)
    other = new_nonce()
    again = with_attempt(text, other)
    assert again != text and len(again) == len(text)
    assert decode(again) == replace(intent, attempt=other)
    assert with_attempt("kafka-consumer-groups reset", other) == "kafka-consumer-groups reset"
    before_nonces = encode(replace(intent, attempt=0, since_s=0))
    assert with_attempt(before_nonces, other) == before_nonces
