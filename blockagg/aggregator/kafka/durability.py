"""Whether the Kafka cluster keeps what it acknowledged: the start-up check of the
durability settings of every topic the job depends on (invariants 1, 2 and 7).

The job's intents are consumer-group offset commits made in transactions: they live in
``__consumer_offsets``, and a commit is decided in ``__transaction_state``. Its input
is the data topics of ``[[topics]]``, its ownership records and registrations live in
compacted topics of their own. If Kafka loses an acknowledged record of any of them,
no protocol above it can notice: a lost intent lets a replay skip or duplicate a
block; a lost message is a gap nobody can fill.

**The rule** (:func:`assess`). On a cluster of two or more brokers every relevant
topic must have

* a replication factor of at least 2 (with 1, the loss of one broker's disk loses
  every record of its partitions);
* an effective ``min.insync.replicas`` of at least 2 (the job's producers use
  ``acks=all``, which waits for the *in-sync* replicas only: with 1, an acknowledged
  write may exist on one broker, whose loss loses it);
* ``unclean.leader.election.enable=false`` (an unclean election makes an out-of-sync
  replica leader, truncating acknowledged records).

These three are exactly "Kafka itself could lose an acknowledged record"; each is a
refusal (one line: the setting, its value, the risk, the fix, the opt-out
``kafka.allow_unsafe_durability``). A topic whose replication factor is not above
its ``min.insync.replicas`` (RF 2 with min.insync 2, Kafka's standard being RF 3 with
min.insync 2) loses nothing acknowledged, but one broker down stops every commit:
that is a warning, never a refusal. A cluster of one broker (a development stack) is
accepted with one notice and no per-topic lines: nothing on it can be replicated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from blockagg import logs
from blockagg.aggregator.kafka.exceptions import UnsafeKafkaDurability

OPT_OUT = "kafka.allow_unsafe_durability = true (--set kafka.allow_unsafe_durability=true)"
SAFE_RF = 3
SAFE_MIN_INSYNC = 2


@dataclass(frozen=True, slots=True)
class TopicDurability:
    """What Kafka keeps of one topic. ``replication_factor`` is the smallest of its
    partitions'; ``min_insync_replicas`` and ``unclean_leader_election`` are effective
    (the topic's own setting, else the broker's). ``created_from``: for a topic that
    does not exist yet and that Kafka will create (``__transaction_state`` before the
    first transaction), the broker setting that decides its replication factor
    (else "")."""

    topic: str
    role: str
    replication_factor: int
    min_insync_replicas: int
    unclean_leader_election: bool
    created_from: str = ""


@dataclass(frozen=True, slots=True)
class Finding:
    """One unsafe setting: ``refuse`` when Kafka could lose an acknowledged record,
    else a warning (availability)."""

    topic: str
    role: str
    setting: str
    value: str
    risk: str
    fix: str
    refuse: bool = True

    def line(self) -> str:
        """The one line an operator reads: setting, value, risk, fix, opt-out."""
        tail = f"; or accept the risk with {OPT_OUT}" if self.refuse else ""
        return (f"Kafka topic {self.topic} ({self.role}): {self.setting}={self.value}: "
                f"{self.risk}. Fix: {self.fix}{tail}")


@dataclass(frozen=True, slots=True)
class Assessment:
    brokers: int
    findings: tuple[Finding, ...]

    @property
    def dev_stack(self) -> bool:
        """A single-broker cluster: accepted, with :data:`DEV_NOTICE`."""
        return self.brokers <= 1

    @property
    def refusals(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.refuse)

    @property
    def accepted(self) -> bool:
        return not self.refusals


DEV_NOTICE = ("Kafka cluster of 1 broker: every topic has one copy, so a lost disk loses "
              "committed intents and messages; accepted as a development stack, never "
              "for production (docs/running.md#production-kafka)")


def _alter(topic: str, setting: str) -> str:
    return (f"kafka-configs.sh --bootstrap-server <servers> --alter --entity-type topics "
            f"--entity-name {topic} --add-config {setting}")


def assess(brokers: int, topics: Sequence[TopicDurability]) -> Assessment:
    """The findings of the rule in the module's docstring, in ``topics``' order."""
    if brokers <= 1:
        return Assessment(brokers, ())
    out: list[Finding] = []
    for t in topics:
        rf, isr = t.replication_factor, t.min_insync_replicas
        if rf < 2:
            fix = (f"set the broker's {t.created_from}={SAFE_RF} before it is created"
                   if t.created_from else
                   f"raise it to {min(SAFE_RF, brokers)} with kafka-reassign-partitions.sh "
                   "(docs/running.md#production-kafka)")
            out.append(Finding(t.topic, t.role, "replication.factor", str(rf),
                               f"one copy on a cluster of {brokers} brokers: losing one "
                               "broker's disk loses acknowledged records", fix))
        if isr < 2:
            out.append(Finding(t.topic, t.role, "min.insync.replicas", str(isr),
                               "acks=all is acknowledged by a single in-sync replica, whose "
                               "loss loses the record",
                               _alter(t.topic, f"min.insync.replicas={SAFE_MIN_INSYNC}")))
        if t.unclean_leader_election:
            out.append(Finding(t.topic, t.role, "unclean.leader.election.enable", "true",
                               "an out-of-sync replica can become leader and truncate "
                               "acknowledged records",
                               _alter(t.topic, "unclean.leader.election.enable=false")))
        if rf >= 2 and isr >= 2 and rf <= isr:
            out.append(Finding(t.topic, t.role, "replication.factor", str(rf),
                               f"not above min.insync.replicas={isr}: one broker down stops "
                               "every write (nothing is lost)",
                               f"replication factor {SAFE_RF} with min.insync.replicas="
                               f"{SAFE_MIN_INSYNC}", refuse=False))
    return Assessment(brokers, tuple(out))


# The shell: read the settings with one AdminClient, each request bounded.

OFFSETS_TOPIC = "__consumer_offsets"
TRANSACTIONS_TOPIC = "__transaction_state"


def read(config: Mapping[str, Any], data_topics: Sequence[str],
         own_topics: Mapping[str, str], timeout: float = 6.0
         ) -> tuple[int, list[TopicDurability]]:
    """The broker count and the durability of ``data_topics``, the two internal topics
    and ``own_topics`` (name -> role; the ones not created yet are skipped: blockagg
    creates them with :func:`creation_settings`). An internal topic not created yet is
    judged by the broker settings Kafka will create it with. Two reads, each within
    ``timeout`` seconds: the metadata (brokers, topics, replicas) from any broker
    librdkafka has up, never a DescribeCluster, which goes to the broker the last
    metadata named controller and so, in KRaft, to a random live broker, a cut one
    included until it is fenced; then the configs from the first broker that answers
    (:func:`~blockagg.aggregator.kafka.broker_config.read_configs`). Raises
    :class:`UnsafeKafkaDurability` when the cluster does not tell (no DescribeConfigs
    permission)."""
    from confluent_kafka.admin import AdminClient

    from blockagg.aggregator.kafka.broker_config import read_configs
    from blockagg.aggregator.kafka.errors import describe, unanswered

    admin = AdminClient(logs.kafka_client_config(config))
    step = "the request for the cluster's brokers and topics (Metadata)"
    try:
        metadata = admin.list_topics(timeout=timeout)
        brokers = len(metadata.brokers)
        wanted: list[tuple[str, str]] = [(t, "data topic") for t in data_topics]
        wanted += [(OFFSETS_TOPIC, "metadata commits"),
                   (TRANSACTIONS_TOPIC, "transaction state")]
        wanted += list(own_topics.items())
        present = {name: t for name, t in metadata.topics.items() if t.error is None}
        step = "the request for the broker's and topics' settings (DescribeConfigs)"
        _, broker_settings, configs = read_configs(
            admin, list(metadata.brokers),
            [name for name, _ in wanted if name in present], timeout)
        configs[""] = broker_settings
    except Exception as exc:
        servers = str(config.get("bootstrap.servers", ""))
        if unanswered(exc):
            raise UnsafeKafkaDurability(
                f"can't read the durability settings of the Kafka cluster {servers}: no "
                f"broker answered {step} within {timeout:.0f}s ({describe(exc)}). A broker "
                "is down or failing over, or the cluster is out of the driver's reach; "
                "nothing was written, so start the job again once the cluster answers (or "
                f"accept not knowing with {OPT_OUT})") from None
        raise UnsafeKafkaDurability(
            f"can't read the durability settings of the Kafka cluster {servers}: {step} "
            f"was refused ({describe(exc)}): grant DescribeConfigs on its topics and "
            f"cluster, or accept not knowing with {OPT_OUT}") from None
    replicas = {name: [len(p.replicas) for p in t.partitions.values()]
                for name, t in present.items()}
    return brokers, described(wanted, replicas, configs)


def described(wanted: Sequence[tuple[str, str]], replicas: Mapping[str, Sequence[int]],
              configs: Mapping[str, Mapping[str, str]]) -> list[TopicDurability]:
    """The durability of each ``(topic, role)`` of ``wanted`` from what the cluster
    described: ``replicas`` (existing topic -> each partition's replica count) and
    ``configs`` (topic -> its effective configuration; ``""`` -> the broker's)."""
    out: list[TopicDurability] = []
    b = configs.get("", {})
    for name, role in wanted:
        if name in replicas:
            c = configs.get(name, b)
            out.append(TopicDurability(
                name, role, min(replicas[name], default=0),
                int(c.get("min.insync.replicas", "1")),
                c.get("unclean.leader.election.enable", "false").lower() == "true"))
        elif name in (OFFSETS_TOPIC, TRANSACTIONS_TOPIC):
            rf_key = ("offsets.topic.replication.factor" if name == OFFSETS_TOPIC
                      else "transaction.state.log.replication.factor")
            isr = (b.get("min.insync.replicas", "1") if name == OFFSETS_TOPIC
                   else b.get("transaction.state.log.min.isr", "1"))
            out.append(TopicDurability(
                name, role, int(b.get(rf_key, "3")), int(isr),
                b.get("unclean.leader.election.enable", "false").lower() == "true",
                created_from=rf_key))
    return out


def creation_settings(brokers: int) -> tuple[int, dict[str, str]]:
    """The replication factor and topic configuration blockagg creates its own
    compacted topics (ownership records, registry) with on a cluster of ``brokers``:
    the broker's defaults (replication factor 1 unless changed) would make a
    multi-broker cluster unsafe, so there it asks for RF 3 (at most the broker count)
    with ``min.insync.replicas=2`` and no unclean election, which :func:`assess`
    accepts."""
    if brokers <= 1:
        return -1, {}
    return min(SAFE_RF, brokers), {"min.insync.replicas": str(SAFE_MIN_INSYNC),
                                   "unclean.leader.election.enable": "false"}
