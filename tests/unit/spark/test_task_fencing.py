"""A task opens its fenced attempt before it reads anything, confirms the fence before
every insert, stops at the first refusal and always closes the attempt (no Spark)."""

from __future__ import annotations

from typing import Any

import pytest

from blockagg.aggregator.core.model import Batch, Block, Committed
from blockagg.aggregator.kafka.exceptions import AttemptFenced
from blockagg.proto.envelope import make_envelope
from blockagg.spark.offsets import PlannedRange
from blockagg.spark.task import run_partition
from tests.unit.spark.test_task import Components, ctx, rows


class Attempt:
    def __init__(self, log: list[str], commits: dict[tuple[str, int], Committed],
                 refuse_at: int | None) -> None:
        self.log = log
        self.commits = commits
        self.refuse_at = refuse_at
        self.confirms = 0
        self.nonce = 2**31 + 1

    def committed(self, topic: str, partition: int) -> Committed | None:
        self.log.append("read")
        return self.commits.get((topic, partition))

    def commit(self, topic: str, partition: int, offset: int, metadata: str) -> None:
        self.log.append("commit")
        self.commits[(topic, partition)] = Committed(offset, metadata)

    def confirm(self, topic: str, partition: int) -> float:
        self.confirms += 1
        if self.confirms == self.refuse_at:
            self.log.append("refused")
            raise AttemptFenced(f"{topic}[{partition}]: a newer attempt has started")
        self.log.append("confirm")
        return 0.0

    def close(self) -> None:
        self.log.append("close")


class FencingStore:
    def __init__(self, refuse_at: int | None = None) -> None:
        self.log: list[str] = []
        self.commits: dict[tuple[str, int], Committed] = {}
        self.refuse_at = refuse_at

    def committed(self, topic: str, partition: int) -> Committed | None:
        raise AssertionError("a fencing store is read through its attempt only")

    def commit(self, topic: str, partition: int, offset: int, metadata: str) -> None:
        raise AssertionError("a fencing store commits through its attempt only")

    def attempt(self, topic: str, partition: int) -> Attempt:
        self.log.append("open")
        return Attempt(self.log, self.commits, self.refuse_at)


class LoggingSink:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def insert(self, block: Block, batch: Batch, confirmed_at: float | None = None) -> None:
        self.log.append("insert")


class FencingComponents(Components):
    def __init__(self, refuse_at: int | None = None) -> None:
        super().__init__()
        self.fencing = FencingStore(refuse_at)

    def store(self, config: Any) -> Any:
        return self.fencing

    def sink(self, config: Any, topic: Any) -> Any:
        return LoggingSink(self.fencing.log)


VALUES = [make_envelope("db.a" if i % 2 else "db.b", [b"r"]) for i in range(6)]
RANGES = {("t", 0): PlannedRange("t", 0, 0, 6)}


def test_the_attempt_is_opened_first_and_confirmed_before_each_insert() -> None:
    comps = FencingComponents()
    [report] = list(run_partition(ctx(comps, RANGES), rows(range(6), VALUES)))
    log = comps.fencing.log
    assert log[:2] == ["open", "read"] and log[-1] == "close"
    inserts = [i for i, what in enumerate(log) if what == "insert"]
    assert len(inserts) == report["blocks"] > 0
    assert all(log[i - 1] == "confirm" for i in inserts)
    assert log.count("commit") == report["commits"]


def test_a_refused_confirm_stops_the_attempt_before_its_insert() -> None:
    comps = FencingComponents(refuse_at=2)
    with pytest.raises(AttemptFenced, match="newer attempt"):
        list(run_partition(ctx(comps, RANGES), rows(range(6), VALUES)))
    log = comps.fencing.log
    assert log[-2:] == ["refused", "close"]
    assert log.count("insert") == 1
