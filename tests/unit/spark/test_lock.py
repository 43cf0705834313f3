"""blockagg.spark.lock.GroupLock's rebalance callbacks, without a broker.

A partition *revoked* from a held lock means another member joined (a second job); a
partition *lost* means our own session expired (the broker was unreachable). The two
must be told apart in the log, and both must leave the assignment consistent.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import pytest

from blockagg.spark.exceptions import LockLost
from blockagg.spark.lock import GroupLock


@dataclass(frozen=True)
class _Partition:
    topic: str
    partition: int


class _Consumer:
    def __init__(self) -> None:
        self.unassigned: list[Any] = []

    def incremental_unassign(self, partitions: list[Any]) -> None:
        self.unassigned.extend(partitions)


@pytest.fixture
def held_lock() -> GroupLock:
    # No connection is made before subscribe/poll: the address is never dialled.
    lock = GroupLock({"bootstrap.servers": "127.0.0.1:1"}, "g", ["t"], lambda t: t == "t",
                     client_id="test")
    lock._assigned = {("t", 0), ("t", 1)}
    lock._held = True
    return lock


def test_lost_partitions_are_dropped_and_logged_as_a_lost_session(
        held_lock: GroupLock, caplog: pytest.LogCaptureFixture) -> None:
    consumer = _Consumer()
    with caplog.at_level(logging.WARNING):
        held_lock._on_lost(consumer, [_Partition("t", 0)])
    assert held_lock._assigned == {("t", 1)}
    assert consumer.unassigned == [_Partition("t", 0)]
    assert "membership lost" in caplog.text
    assert "second job on the same metadata group and topic is starting" not in caplog.text
    assert not held_lock._held


def test_lost_membership_tells_the_driver_once() -> None:
    reasons: list[LockLost] = []
    lock = GroupLock({"bootstrap.servers": "127.0.0.1:1"}, "g", ["t"], lambda t: t == "t",
                     client_id="test", on_lost=reasons.append)
    lock._assigned = {("t", 0), ("t", 1)}
    lock._held = True
    lock._on_lost(_Consumer(), [_Partition("t", 0), _Partition("t", 1)])
    lock._on_lost(_Consumer(), [])
    assert len(reasons) == 1 and "g.lock membership lost" in str(reasons[0])
    assert "this job stops" in str(reasons[0])


def test_a_driver_told_of_a_lost_lock_stops_with_the_reason() -> None:
    from blockagg.spark.driver import Driver

    driver = Driver.__new__(Driver)
    driver._stop_requested = threading.Event()
    driver.failure = None
    driver.on_lock_lost(LockLost("lock group g.lock membership lost"))
    assert driver._stop_requested.is_set()
    assert isinstance(driver.failure, LockLost) and "membership lost" in str(driver.failure)


def test_revoked_partitions_name_a_second_job(
        held_lock: GroupLock, caplog: pytest.LogCaptureFixture) -> None:
    consumer = _Consumer()
    with caplog.at_level(logging.WARNING):
        held_lock._on_revoke(consumer, [_Partition("t", 1)])
    assert held_lock._assigned == {("t", 0)}
    assert "a second job on the same metadata group and topic is starting" in caplog.text
