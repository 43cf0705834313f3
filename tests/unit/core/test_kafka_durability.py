"""The start-up check of Kafka's durability (``kafka.durability``): on a cluster of two
or more brokers every topic the job depends on needs a replication factor of at least
2, ``min.insync.replicas`` of at least 2 and no unclean leader election, or the start
is refused with one line per setting (value, risk, fix, opt-out); a single broker is a
development stack, accepted with one notice. The 3-broker outputs below are what
``describe_cluster``/``list_topics``/``describe_configs`` return for a cluster left at
Kafka's defaults (replication factor 1 from ``default.replication.factor``,
``min.insync.replicas=1``)."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockagg.aggregator.kafka import durability
from blockagg.aggregator.kafka.durability import (
    OPT_OUT,
    TopicDurability,
    assess,
    creation_settings,
    described,
)
from blockagg.aggregator.kafka.exceptions import KafkaAdapterError, UnsafeKafkaDurability
from blockagg.config import loads
from blockagg.exceptions import ConfigError
from blockagg.spark import preflight

BROKER_DEFAULTS = {"min.insync.replicas": "1", "unclean.leader.election.enable": "false",
                   "offsets.topic.replication.factor": "3",
                   "transaction.state.log.replication.factor": "3",
                   "transaction.state.log.min.isr": "2", "default.replication.factor": "1"}
WANTED = [("orders", "data topic"), ("__consumer_offsets", "metadata commits"),
          ("__transaction_state", "transaction state"), ("_blockagg_owners", "ownership records")]


def safe(name: str) -> TopicDurability:
    return TopicDurability(name, "data topic", 3, 2, False)


def test_a_three_broker_cluster_at_kafkas_defaults_is_refused_for_each_unsafe_setting() -> None:
    """``kafka-topics --create`` without ``--replication-factor`` on three brokers: the
    data topic has one copy; ``__consumer_offsets`` has three copies but
    min.insync.replicas 1; ``__transaction_state`` (not created yet) will get RF 3 and
    min.isr 2 from the broker; the ownership topic was made by blockagg (RF 3, 2)."""
    topics = described(
        WANTED,
        {"orders": [1, 1, 1], "__consumer_offsets": [3] * 50, "_blockagg_owners": [3]},
        {"": BROKER_DEFAULTS, "orders": BROKER_DEFAULTS,
         "__consumer_offsets": {**BROKER_DEFAULTS, "compression.type": "producer"},
         "_blockagg_owners": {**BROKER_DEFAULTS, "min.insync.replicas": "2"}})
    assert [t.topic for t in topics] == [w for w, _ in WANTED]
    result = assess(3, topics)
    assert not result.accepted and not result.dev_stack
    assert [(f.topic, f.setting, f.value) for f in result.refusals] == [
        ("orders", "replication.factor", "1"), ("orders", "min.insync.replicas", "1"),
        ("__consumer_offsets", "min.insync.replicas", "1")]


def test_a_cluster_configured_as_kafka_recommends_is_accepted_without_a_line() -> None:
    good = {**BROKER_DEFAULTS, "min.insync.replicas": "2", "default.replication.factor": "3"}
    topics = described(WANTED, {"orders": [3, 3], "__consumer_offsets": [3] * 50,
                                "__transaction_state": [3] * 50, "_blockagg_owners": [3]},
                       {"": good, "orders": good, "__consumer_offsets": good,
                        "__transaction_state": good, "_blockagg_owners": good})
    assert assess(3, topics).findings == ()


def test_one_under_replicated_partition_and_an_internal_topic_still_to_be_created() -> None:
    """The smallest replication factor of a topic's partitions is its; a missing
    ``__transaction_state`` is judged by the broker settings it will be created with."""
    broker = {**BROKER_DEFAULTS, "min.insync.replicas": "2",
              "transaction.state.log.replication.factor": "1"}
    [orders, offsets, txn] = described(WANTED[:3], {"orders": [3, 1, 3],
                                                    "__consumer_offsets": [3]},
                                       {"": broker, "orders": broker})
    assert orders.replication_factor == 1 and offsets.min_insync_replicas == 2
    assert txn.created_from == "transaction.state.log.replication.factor"
    [f] = [f for f in assess(3, [txn]).refusals]
    assert "transaction.state.log.replication.factor=3 before it is created" in f.line()


def test_unclean_leader_election_is_refused() -> None:
    [f] = assess(5, [TopicDurability("orders", "data topic", 3, 2, True)]).findings
    assert f.refuse and f.setting == "unclean.leader.election.enable"
    assert "--add-config unclean.leader.election.enable=false" in f.line()


def test_the_refusal_is_one_line_with_value_risk_fix_and_opt_out() -> None:
    [rf, isr] = assess(3, [TopicDurability("orders", "data topic", 1, 1, False)]).findings
    for line in (rf.line(), isr.line()):
        assert "\n" not in line and OPT_OUT in line and "Fix: " in line
        assert line.startswith("Kafka topic orders (data topic): ")
    assert "replication.factor=1: one copy on a cluster of 3 brokers" in rf.line()
    assert "kafka-reassign-partitions.sh" in rf.line()
    assert "min.insync.replicas=1: acks=all is acknowledged by a single" in isr.line()
    assert ("kafka-configs.sh --bootstrap-server <servers> --alter --entity-type topics "
            "--entity-name orders --add-config min.insync.replicas=2") in isr.line()


def test_replication_equal_to_min_insync_is_a_warning_not_a_refusal() -> None:
    """RF 2 with min.insync 2 loses nothing acknowledged; one broker down stops commits."""
    [f] = assess(3, [TopicDurability("orders", "data topic", 2, 2, False)]).findings
    assert not f.refuse and OPT_OUT not in f.line() and "nothing is lost" in f.line()


def test_a_single_broker_is_a_development_stack_accepted_with_no_finding() -> None:
    result = assess(1, [TopicDurability("orders", "data topic", 1, 1, True)])
    assert result.dev_stack and result.accepted and result.findings == ()
    assert "\n" not in durability.DEV_NOTICE and "1 broker" in durability.DEV_NOTICE


def test_blockagg_creates_its_topics_safe_where_the_broker_default_is_not() -> None:
    assert creation_settings(1) == (-1, {})
    for brokers in (2, 3, 9):
        rf, config = creation_settings(brokers)
        made = TopicDurability("_blockagg_owners", "ownership records", rf,
                               int(config["min.insync.replicas"]),
                               config["unclean.leader.election.enable"] == "true")
        assert assess(brokers, [made]).accepted
    assert creation_settings(5)[0] == 3


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(brokers=st.integers(2, 9),
       topics=st.lists(st.tuples(st.integers(1, 5), st.integers(1, 4), st.booleans()),
                       min_size=1, max_size=6))
def test_several_brokers_are_accepted_iff_no_topic_can_lose_an_acknowledged_record(
        brokers: int, topics: list[tuple[int, int, bool]]) -> None:
    """The rule: accepted iff every topic has RF >= 2, min.insync >= 2 and no unclean
    election; every finding names its topic, and refusals are exactly those three."""
    given_topics = [TopicDurability(f"t{i}", "data topic", rf, isr, unclean)
                    for i, (rf, isr, unclean) in enumerate(topics)]
    result = assess(brokers, given_topics)
    lossless = all(rf >= 2 and isr >= 2 and not unclean for rf, isr, unclean in topics)
    assert result.accepted == lossless and not result.dev_stack
    assert {f.setting for f in result.refusals} <= {
        "replication.factor", "min.insync.replicas", "unclean.leader.election.enable"}
    assert all(OPT_OUT in f.line() for f in result.refusals)
    assert all(t.topic in {f.topic for f in result.findings}
               for t in given_topics if t.replication_factor <= t.min_insync_replicas)


CONFIG = """
[job]
checkpoint_location = "/tmp/ck"
[kafka]
"bootstrap.servers" = "x:1"
{extra}
[[topics]]
name = "orders"
replicas = ["ch:9000"]
"""


def three_brokers_at_defaults(config: object, data: list[str], own: dict[str, str],
                              timeout: float) -> tuple[int, list[TopicDurability]]:
    assert data == ["orders"] and set(own) == {"_blockagg_owners", "_blockagg_schemas"}
    return 3, described([(t, "data topic") for t in data] + list(own.items()),
                        {"orders": [1, 1]}, {"": BROKER_DEFAULTS})


def test_preflight_refuses_an_unsafe_cluster_with_one_error_line_each(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(durability, "read", three_brokers_at_defaults)
    with caplog.at_level(logging.INFO), pytest.raises(UnsafeKafkaDurability) as err:
        preflight.check_durability(loads(CONFIG.format(extra="")), {"orders": 2})
    assert isinstance(err.value, KafkaAdapterError)
    assert str(err.value).startswith("Kafka topic orders (data topic): replication.factor=1")
    assert str(err.value).endswith("(and 1 more, logged above)")
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and all(OPT_OUT in e for e in errors)


def test_the_opt_out_logs_each_finding_as_a_warning_and_starts(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(durability, "read", three_brokers_at_defaults)
    config = loads(CONFIG.format(extra="allow_unsafe_durability = true"))
    assert config.kafka.allow_unsafe_durability
    assert "allow_unsafe_durability" not in config.kafka.librdkafka_config()
    assert not any("allow_unsafe" in k for k in config.kafka.spark_source_options())
    with caplog.at_level(logging.INFO):
        result = preflight.check_durability(config, {"orders": 2})
    assert len(result.refusals) == 2
    assert [r.levelno for r in caplog.records if "Kafka topic" in r.getMessage()] == [
        logging.WARNING] * 2


@pytest.mark.parametrize("key,value", [("acks", "1"), ("acks", "0"),
                                       ("enable.idempotence", "false")])
def test_producer_settings_that_can_lose_an_acknowledged_record_are_refused(
        key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f'kafka."{key}" = \'{value}\'.*remove the key'):
        loads(CONFIG.format(extra=f'"{key}" = "{value}"'))
    loads(CONFIG.format(extra='"acks" = "all"'))
    loads(CONFIG.format(extra='"acks" = "-1"'))


def test_running_md_shows_the_line_the_check_prints() -> None:
    from pathlib import Path

    doc = (Path(__file__).parents[3] / "docs" / "running.md").read_text()
    [_, isr] = assess(3, [TopicDurability("orders", "data topic", 1, 1, False)]).findings
    assert f"```\n{isr.line()}\n```" in doc


class _SilentAdmin:
    """An AdminClient whose cluster read ends with ``error``: a broker that never answers
    (a future's ``TimeoutError``, or librdkafka's ``_TIMED_OUT``) or one that refuses."""

    error: BaseException = TimeoutError()

    def __init__(self, config: object) -> None:
        pass

    def list_topics(self, timeout: float) -> object:
        raise self.error


@pytest.mark.parametrize("error", ["future", "librdkafka"])
def test_a_cluster_that_does_not_answer_is_named_as_such_not_as_a_permission(
        monkeypatch: pytest.MonkeyPatch, error: str) -> None:
    """A broker cut off at the start (seen in a ``txn_coordinator_cut`` run): the refusal
    says no broker answered and that nothing was written, never to grant DescribeConfigs,
    and is never blank (a future that timed out has no text)."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka import admin as kafka_admin

    silent = (TimeoutError() if error == "future"
              else KafkaException(KafkaError(KafkaError._TIMED_OUT, "Timed out")))
    monkeypatch.setattr(_SilentAdmin, "error", silent)
    monkeypatch.setattr(kafka_admin, "AdminClient", _SilentAdmin)
    with pytest.raises(UnsafeKafkaDurability) as err:
        durability.read({"bootstrap.servers": "k1:9092,k2:9092"}, ["orders"], {}, 6.0)
    text = str(err.value)
    assert text.startswith("can't read the durability settings of the Kafka cluster "
                           "k1:9092,k2:9092: no broker answered the request for the "
                           "cluster's brokers and topics (Metadata) within 6s (")
    assert "()" not in text and "grant" not in text
    assert "nothing was written" in text and OPT_OUT in text


def test_a_refused_read_still_names_the_permission(monkeypatch: pytest.MonkeyPatch) -> None:
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka import admin as kafka_admin

    refused = KafkaException(KafkaError(KafkaError.CLUSTER_AUTHORIZATION_FAILED,
                                        "Cluster authorization failed"))
    monkeypatch.setattr(_SilentAdmin, "error", refused)
    monkeypatch.setattr(kafka_admin, "AdminClient", _SilentAdmin)
    with pytest.raises(UnsafeKafkaDurability,
                       match=r"\(Metadata\) was refused \(.*Cluster "
                             r"authorization failed.*\): grant "
                             r"DescribeConfigs on its topics and cluster"):
        durability.read({"bootstrap.servers": "k1:9092"}, ["orders"], {}, 6.0)
