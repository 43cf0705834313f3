from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from blockagg.aggregator.core.model import Batch, Block
from blockagg.aggregator.kafka.dlq_topic import (
    DeadLetterTopic,
    DeadLetterTopicSink,
    dlq_headers,
    dlq_key,
)
from blockagg.aggregator.kafka.exceptions import DeadLetterPublishFailed
from blockagg.rows.deadletters import make_dead_letter


class FakeProducer:
    def __init__(self, fail: bool = False) -> None:
        self.sent: list[tuple[str, bytes | None, bytes | None, dict[str, Any]]] = []
        self.fail = fail
        self._pending: list[Any] = []

    def produce(self, topic: str, value: bytes | None = None, key: bytes | None = None,
                **kwargs: Any) -> None:
        self.sent.append((topic, value, key, kwargs))
        self._pending.append(kwargs["on_delivery"])

    def poll(self, timeout: float = 0) -> int:
        return 0

    def flush(self, timeout: float = 0) -> int:
        for cb in self._pending:
            cb("broker down" if self.fail else None, None)
        self._pending.clear()
        return 0


class Sink:
    def __init__(self) -> None:
        self.blocks: list[Block] = []

    def insert(self, block: Block, batch: Batch, confirmed_at: float | None = None) -> None:
        self.blocks.append(block)


def batch_and_blocks() -> tuple[Batch, Block, Block]:
    letters = [make_dead_letter("src", 4, off, 1_700_000_000_000 + i, b"raw%d" % i,
                                f"bad {i}", "db.t") for i, off in enumerate((70, 71, 73))]
    batch = Batch("src", 4, 70, 74, np.array([70, 71, 72, 73]), np.array([0, 0, 1, 0]),
                  np.ones(4, dtype=np.int64), np.ones(4, dtype=np.int64),
                  [letters[0], letters[1], object(), letters[2]],
                  {0: "blockagg.dead_letters", 1: "db.t"})
    dead = Block("src", 4, 0, "blockagg.dead_letters", 70, 73, np.array([0, 1, 3]), 3, 3, "t")
    data = Block("src", 4, 1, "db.t", 72, 72, np.array([2]), 1, 1, "u")
    return batch, dead, data


def test_key_and_headers_are_deterministic() -> None:
    letter = make_dead_letter("src", 4, 70, 5, b"x", "boom", "db.t")
    assert dlq_key(letter) == b"src/4/70"
    headers = dict(dlq_headers(letter))
    assert headers["blockagg.error"] == b"boom" and headers["blockagg.table"] == b"db.t"
    assert headers["__connect.errors.offset"] == b"70"
    assert dlq_headers(letter) == dlq_headers(make_dead_letter("src", 4, 70, 5, b"x", "boom",
                                                               "db.t"))


def test_sink_publishes_dead_letter_blocks_after_the_insert() -> None:
    producer = FakeProducer()
    dlq = DeadLetterTopic({"bootstrap.servers": "x"}, "dlq", producer_factory=lambda c: producer)
    inner = Sink()
    sink = DeadLetterTopicSink(inner, dlq)
    batch, dead, data = batch_and_blocks()
    sink.insert(data, batch)
    assert producer.sent == [] and inner.blocks == [data]
    sink.insert(dead, batch)
    sink.insert(dead, batch)                  # a retry publishes identical copies
    assert [s[2] for s in producer.sent] == [b"src/4/70", b"src/4/71", b"src/4/73"] * 2
    assert producer.sent[0][1] == b"raw0" and producer.sent[0][0] == "dlq"
    assert producer.sent[0][3]["timestamp"] == 1_700_000_000_000
    def strip(s: tuple[str, bytes | None, bytes | None, dict[str, Any]]) -> Any:
        return s[:3], s[3]["headers"], s[3]["timestamp"]
    assert [strip(s) for s in producer.sent[:3]] == [strip(s) for s in producer.sent[3:]]
    assert dlq.config["enable.idempotence"] is True and dlq.config["acks"] == "all"


def test_publish_failure_raises_so_the_batch_is_retried() -> None:
    dlq = DeadLetterTopic({}, "dlq", producer_factory=lambda c: FakeProducer(fail=True))
    batch, dead, _ = batch_and_blocks()
    with pytest.raises(DeadLetterPublishFailed, match="broker down"):
        DeadLetterTopicSink(Sink(), dlq).insert(dead, batch)


def test_the_producer_stays_idempotent_with_acks_all_whatever_the_settings_say() -> None:
    """Passed-through client settings cannot weaken the dead-letter producer: a record
    acknowledged by one replica could be lost."""
    dlq = DeadLetterTopic({"acks": "1", "enable.idempotence": False, "linger.ms": 50}, "dlq",
                          producer_factory=lambda c: FakeProducer())
    assert dlq.config["enable.idempotence"] is True and dlq.config["acks"] == "all"
    assert dlq.config["linger.ms"] == 50
