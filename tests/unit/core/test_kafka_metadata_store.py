"""The Kafka MetadataStore against a scripted consumer: per-partition errors are
checked, retriable errors retried with backoff, the others surface at once with what
to change. (tests/integration/test_metadata_store.py runs it against a real broker.)"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from blockagg.aggregator.core.exceptions import MetadataTooLarge
from blockagg.aggregator.kafka.exceptions import MetadataCommitError, OffsetMetadataTooLarge
from blockagg.aggregator.kafka.metadata_store import KafkaMetadataStore
from blockagg.exceptions import ConfigError


class ScriptedConsumer:
    """Answers each call with the next scripted outcome: an error code (raised as a
    KafkaException or returned per partition) or success."""

    def __init__(self, script: list[tuple[str, int | None]]) -> None:
        self.script = script
        self.commits: list[tuple[str, int, int, str]] = []
        self.config: dict[str, Any] = {}
        self.stored: dict[tuple[str, int], tuple[int, str]] = {}

    def _next(self) -> tuple[str, int | None]:
        return self.script.pop(0) if self.script else ("ok", None)

    def committed(self, partitions: list[Any], timeout: float = 0) -> list[Any]:
        how, code = self._next()
        if how == "raise" and code is not None:
            raise KafkaException(KafkaError(code))
        tp = partitions[0]
        offset, metadata = self.stored.get((tp.topic, tp.partition), (-1001, None))
        error = KafkaError(code) if how == "partition" and code is not None else None
        return [SimpleNamespace(offset=offset, metadata=metadata, error=error)]

    def commit(self, *, offsets: list[Any], asynchronous: bool) -> list[Any]:
        assert asynchronous is False
        how, code = self._next()
        if how == "raise" and code is not None:
            raise KafkaException(KafkaError(code))
        tp = offsets[0]
        if how == "partition" and code is not None:
            return [SimpleNamespace(error=KafkaError(code))]
        self.stored[(tp.topic, tp.partition)] = (tp.offset, tp.metadata)
        self.commits.append((tp.topic, tp.partition, tp.offset, tp.metadata))
        return [SimpleNamespace(error=None)]

    def close(self) -> None:
        pass

    def consumer_group_metadata(self) -> Any:
        return ("group-metadata", -1)


def store_with(script: list[tuple[str, int | None]]) -> tuple[KafkaMetadataStore,
                                                               ScriptedConsumer, list[float]]:
    consumer = ScriptedConsumer(script)
    sleeps: list[float] = []

    def factory(config: dict[str, Any]) -> ScriptedConsumer:
        consumer.config = config
        return consumer

    store = KafkaMetadataStore(
        {"bootstrap.servers": "b:9092", "group.id": "g", "security.protocol": "SASL_SSL"},
        consumer_factory=factory, sleep=sleeps.append, retries=3, backoff=0.1,
    )
    return store, consumer, sleeps


def test_config_is_passed_through_with_auto_commit_forced_off() -> None:
    _, consumer, _ = store_with([])
    assert consumer.config["security.protocol"] == "SASL_SSL"
    assert consumer.config["enable.auto.commit"] is False


def test_group_id_is_required_and_auto_commit_refused() -> None:
    with pytest.raises(ConfigError, match=r"group\.id"):
        KafkaMetadataStore({"bootstrap.servers": "b:9092"})
    with pytest.raises(ConfigError, match=r"enable\.auto\.commit"):
        KafkaMetadataStore({"group.id": "g", "enable.auto.commit": "true"})


def test_commit_then_read_back_round_trips_offset_and_metadata() -> None:
    store, _, _ = store_with([])
    assert store.committed("t", 0) is None
    store.commit("t", 0, 42, "ba1:xyz")
    committed = store.committed("t", 0)
    assert committed is not None and (committed.offset, committed.metadata) == (42, "ba1:xyz")


def test_retriable_errors_are_retried_with_exponential_backoff() -> None:
    store, consumer, sleeps = store_with(
        [("raise", KafkaError.COORDINATOR_LOAD_IN_PROGRESS),
         ("partition", KafkaError.NOT_COORDINATOR),
         ("raise", KafkaError._TRANSPORT)]
    )
    store.commit("t", 0, 7, "m")
    assert consumer.commits == [("t", 0, 7, "m")]
    assert sleeps == pytest.approx([0.1, 0.2, 0.4])


def test_retries_run_out_into_a_commit_error() -> None:
    store, _, sleeps = store_with([("raise", KafkaError.REQUEST_TIMED_OUT)] * 4)
    with pytest.raises(MetadataCommitError, match="safe to run again"):
        store.commit("t", 0, 7, "m")
    assert len(sleeps) == 3


def test_non_retriable_partition_error_fails_at_once() -> None:
    store, _, sleeps = store_with([("partition", KafkaError.GROUP_AUTHORIZATION_FAILED)])
    with pytest.raises(MetadataCommitError):
        store.commit("t", 0, 7, "m")
    assert sleeps == []


def test_metadata_too_large_names_offset_metadata_max_bytes() -> None:
    store, _, _ = store_with([("partition", KafkaError.OFFSET_METADATA_TOO_LARGE)])
    with pytest.raises(OffsetMetadataTooLarge, match=r"offset\.metadata\.max\.bytes") as info:
        store.commit("t", 0, 7, "m" * 5000)
    assert isinstance(info.value, MetadataTooLarge)


def test_a_long_retry_names_what_it_waits_for_at_warn_rate_limited(
        caplog: pytest.LogCaptureFixture) -> None:
    """A broker that keeps timing out: after 2 s of retries one WARN line names the
    partition and the group, then at most one per 10 s (the clock moves with the sleeps)."""
    now = [0.0]
    consumer = ScriptedConsumer([("raise", KafkaError._TIMED_OUT)] * 8)

    def sleep(seconds: float) -> None:
        now[0] += seconds + 3.0  # each try also waits out its request timeout

    store = KafkaMetadataStore({"bootstrap.servers": "b:9092", "group.id": "g"},
                               consumer_factory=lambda c: consumer, sleep=sleep,
                               clock=lambda: now[0], retries=8, backoff=0.1,
                               diagnose=lambda *args, **kwargs: None)
    with caplog.at_level("WARNING", logger="blockagg.metadata"):
        assert store.committed("events", 3) is None
    lines = [r for r in caplog.records if r.name == "blockagg.metadata"]
    assert 2 <= len(lines) <= 3, [r.getMessage() for r in lines]
    assert lines[0].getMessage() == ("still waiting for the last commit of events[3] in group "
                                     "'g' (Kafka does not answer)")
    fields = lines[0].blockagg_fields  # type: ignore[attr-defined]
    assert fields["attempt"] >= 2 and fields["attempts"] == 9 and fields["error"]
