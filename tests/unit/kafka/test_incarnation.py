"""The incarnation reader's errors say what went wrong, whatever confluent-kafka's
future raised (a future that times out raises a ``TimeoutError`` with no text)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest

from blockagg.aggregator.kafka.incarnation import IncarnationError, TopicIncarnations


class _Admin:
    """An AdminClient whose every future ends with ``error``."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def _failed(self) -> Future[Any]:
        future: Future[Any] = Future()
        future.set_exception(self.error)
        return future

    def describe_topics(self, topics: Any, request_timeout: float) -> dict[str, Future[Any]]:
        return {name: self._failed() for name in topics.topic_names}

    def describe_cluster(self, request_timeout: float) -> Future[Any]:
        return self._failed()


def _reader(error: BaseException) -> TopicIncarnations:
    reader = TopicIncarnations({"bootstrap.servers": "unused:9092"}, timeout_s=30.0)
    reader._admin = _Admin(error)
    return reader


def test_a_topic_id_read_that_timed_out_says_so() -> None:
    with pytest.raises(IncarnationError, match=r"^can't read the topic id of events: no "
                                               r"broker answered within 30s \(TimeoutError\)"
                                               r": a broker cut off"):
        _reader(TimeoutError()).topic_id("events")


def test_a_cluster_id_read_that_timed_out_says_so() -> None:
    with pytest.raises(IncarnationError, match=r"^can't read the Kafka cluster id: no broker "
                                               r"answered within 30s"):
        _reader(TimeoutError()).cluster_id()


def test_an_error_with_text_keeps_it_and_one_without_is_named() -> None:
    with pytest.raises(IncarnationError, match=r"of events: UNKNOWN_TOPIC_OR_PART$"):
        _reader(RuntimeError("UNKNOWN_TOPIC_OR_PART")).topic_id("events")
    with pytest.raises(IncarnationError, match=r"of events: ConnectionError$"):
        _reader(ConnectionError()).topic_id("events")


def test_librdkafkas_own_timeout_reads_the_same() -> None:
    from confluent_kafka import KafkaError, KafkaException

    timed_out = KafkaException(KafkaError(KafkaError._TIMED_OUT, "Timed out"))
    with pytest.raises(IncarnationError, match=r"of events: no broker answered within 30s "
                                               r"\(KafkaError.*Timed out.*\): a broker cut"):
        _reader(timed_out).topic_id("events")


def test_the_audits_reason_for_a_timed_out_future_is_not_blank() -> None:
    """``arv audit`` words its Kafka failures with the same rule (a future's timeout
    has no text of its own)."""
    from blockagg.verifier.audit_sources import _reason

    assert _reason(TimeoutError()) == "TimeoutError"
    assert _reason(RuntimeError("no such group")) == "no such group"
