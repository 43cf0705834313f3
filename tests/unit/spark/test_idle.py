"""blockagg.spark.idle: which quiet partitions are re-committed, unchanged, and the
interval checked against the brokers' offsets.retention.minutes."""

from __future__ import annotations

import pytest

from blockagg.aggregator.core.model import Committed
from blockagg.aggregator.exceptions import ConfigError
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
    assert idle.due(partitions) == partitions  # not seen committed in this run: due
    assert idle.refresh(store, idle.due(partitions)) == 2  # t[2] has no commit
    assert store.history == [("t", 0, 5, "ba1:x"), ("t", 1, 9, "")]
    now[0] += 59
    assert idle.due(partitions) == []
    idle.saw_commit(("t", 0))  # a task committed it
    now[0] += 1
    assert idle.due(partitions) == [("t", 1), ("t", 2)]
    assert idle.due(partitions, busy={("t", 1): object()}) == [("t", 2)]
