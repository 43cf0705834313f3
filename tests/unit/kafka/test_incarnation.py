"""The incarnation reader's errors say what went wrong, whatever confluent-kafka's
future raised (a future that times out raises a ``TimeoutError`` with no text)."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest

from blockagg.aggregator.kafka.errors import CONTROLLER_TRIES as TRIES
from blockagg.aggregator.kafka.incarnation import IncarnationError, TopicIncarnations


class _Admin:
    """An AdminClient whose every future ends with ``error``, or never ends when
    ``error`` is ``None`` (its controller cut off)."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error

    def _failed(self) -> Future[Any]:
        future: Future[Any] = Future()
        if self.error is not None:
            future.set_exception(self.error)
        return future

    def describe_topics(self, topics: Any, request_timeout: float) -> dict[str, Future[Any]]:
        return {name: self._failed() for name in topics.topic_names}

    def describe_cluster(self, request_timeout: float) -> Future[Any]:
        return self._failed()


class _Answering:
    def describe_topics(self, topics: Any, request_timeout: float) -> dict[str, Future[Any]]:
        future: Future[Any] = Future()
        future.set_result(SimpleNamespace(topic_id="0f2d"))
        return {name: future for name in topics.topic_names}


class _Clients:
    """The AdminClients a reader makes, in turn: ``first`` for the first ones, then
    answering ones."""

    def __init__(self, *first: Any) -> None:
        self.first = list(first)
        self.made = 0

    def __call__(self, config: object) -> Any:
        self.made += 1
        return self.first.pop(0) if self.first else _Answering()


def _reader(error: BaseException, monkeypatch: pytest.MonkeyPatch | None = None,
            timeout_s: float = 30.0) -> TopicIncarnations:
    reader = TopicIncarnations({"bootstrap.servers": "unused:9092"}, timeout_s=timeout_s)
    reader._admin = _Admin(error)
    if monkeypatch is not None:
        from confluent_kafka import admin as kafka_admin

        monkeypatch.setattr(kafka_admin, "AdminClient", lambda config: _Admin(error))
    return reader


def test_a_silent_controller_is_left_for_a_fresh_client(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """DescribeTopics goes to the broker the client's metadata named controller; in
    KRaft a random live broker, a cut one included until it is fenced. Before, the read
    asked that broker until the timeout and the start or the batch failed; now the
    silent try drops the client and a fresh one asks again, within the same timeout."""
    from confluent_kafka import admin as kafka_admin

    clients = _Clients(_Admin(None))
    monkeypatch.setattr(kafka_admin, "AdminClient", clients)
    reader = TopicIncarnations({"bootstrap.servers": "unused:9092"}, timeout_s=1.5)
    assert reader.topic_id("events") == "0f2d"
    assert clients.made == 2


def test_a_refusal_is_not_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    from confluent_kafka import admin as kafka_admin

    clients = _Clients(_Admin(RuntimeError("TOPIC_AUTHORIZATION_FAILED")))
    monkeypatch.setattr(kafka_admin, "AdminClient", clients)
    with pytest.raises(IncarnationError, match=r"TOPIC_AUTHORIZATION_FAILED$"):
        TopicIncarnations({"bootstrap.servers": "unused:9092"}).topic_id("events")
    assert clients.made == 1


def test_the_tries_stop_at_their_count(monkeypatch: pytest.MonkeyPatch) -> None:
    from confluent_kafka import admin as kafka_admin

    clients = _Clients(*[_Admin(TimeoutError()) for _ in range(TRIES + 1)])
    monkeypatch.setattr(kafka_admin, "AdminClient", clients)
    with pytest.raises(IncarnationError, match="no broker answered within 30s"):
        TopicIncarnations({"bootstrap.servers": "unused:9092"}).topic_id("events")
    assert clients.made == TRIES


def test_a_topic_id_read_that_timed_out_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(IncarnationError, match=r"^can't read the topic id of events: no "
                                               r"broker answered within 30s \(TimeoutError\)"
                                               r": a broker cut off"):
        _reader(TimeoutError(), monkeypatch).topic_id("events")


def test_a_cluster_id_read_that_timed_out_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(IncarnationError, match=r"^can't read the Kafka cluster id: no broker "
                                               r"answered within 30s"):
        _reader(TimeoutError(), monkeypatch).cluster_id()


def test_an_error_with_text_keeps_it_and_one_without_is_named() -> None:
    with pytest.raises(IncarnationError, match=r"of events: UNKNOWN_TOPIC_OR_PART$"):
        _reader(RuntimeError("UNKNOWN_TOPIC_OR_PART")).topic_id("events")
    with pytest.raises(IncarnationError, match=r"of events: ConnectionError$"):
        _reader(ConnectionError()).topic_id("events")


def test_librdkafkas_own_timeout_reads_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    from confluent_kafka import KafkaError, KafkaException

    timed_out = KafkaException(KafkaError(KafkaError._TIMED_OUT, "Timed out"))
    with pytest.raises(IncarnationError, match=r"of events: no broker answered within 30s "
                                               r"\(KafkaError.*Timed out.*\): a broker cut"):
        _reader(timed_out, monkeypatch).topic_id("events")


def test_the_audits_reason_for_a_timed_out_future_is_not_blank() -> None:
    """``arv audit`` words its Kafka failures with the same rule (a future's timeout
    has no text of its own)."""
    from blockagg.verifier.audit_sources import _reason

    assert _reason(TimeoutError()) == "TimeoutError"
    assert _reason(RuntimeError("no such group")) == "no such group"
