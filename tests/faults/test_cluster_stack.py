"""The stack as a Kafka cluster (``scripts/stack up --brokers 3``; issue 27 items 1 and 5).

One private three-node KRaft stack for the module (its own ``BLOCKAGG_STACK_DIR`` under
``.stack/cluster`` and ports at default + ``BLOCKAGG_CLUSTER_PORT_SHIFT``, 4000 unless
taken: ``.ci/run`` gives the default stack 0/1000/5000/7000 and the fault suite
2000/3000/6000/8000). It shows that the three nodes form one cluster with Kafka's
production durability settings, that a kill -9 of one node (the leader of the partition
written) leaves a transactional produce + offset commit working with ``acks=all`` and
two replicas in sync, that the node rejoins after ``scripts/stack up``, and that the
job's start-up durability check (``preflight.check_topics`` then
``preflight.check_durability``, the path ``preflight.run`` takes) refuses a topic of
replication factor 1 and one with ``min.insync.replicas=1`` on it, and accepts RF 3 /
min.insync 2 (invariants 1 and 9). The stack also runs ``--shards 2`` (the second
shard's two ClickHouse replicas start beside the first's, costing no time): shard 02
replicates within itself and the ``blockagg`` cluster lists both shards. Where the
machine allows it the nodes are isolated (``--isolate-brokers``): a node cut off the
network both ways (issue 27 item 3) is fenced and dropped from every ISR while the other
two commit transactions, and rejoins every ISR once healed.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from blockagg.aggregator.kafka.exceptions import UnsafeKafkaDurability
from blockagg.aggregator.kafka.startup import check_topics
from blockagg.config import Config, loads
from blockagg.spark import preflight
from tests.faults.stack import StackControl

pytestmark = pytest.mark.integration

@pytest.fixture
def cluster(cluster_stack: StackControl) -> Iterator[StackControl]:
    """The session's three-broker, two-shard stack (``conftest.cluster_fault_stack``,
    shared with the cluster scenario of ``test_scenarios``: one start instead of two),
    every node back up and on the network after each test."""
    yield cluster_stack


def admin(control: StackControl, servers: str | None = None):  # type: ignore[no-untyped-def]
    from confluent_kafka.admin import AdminClient

    return AdminClient({"bootstrap.servers": servers or control.bootstrap})


def create_topic(control: StackControl, name: str, rf: int = -1,
                 config: dict[str, str] | None = None) -> str:
    from confluent_kafka.admin import NewTopic  # type: ignore[attr-defined]

    client = admin(control)  # kept referenced until the futures are done
    fut = client.create_topics(
        [NewTopic(name, num_partitions=1, replication_factor=rf, config=config or {})])
    fut[name].result(30)
    deadline = time.monotonic() + 30
    for b in control.cfg.kafka_brokers:  # every node knows it (the job asks any of them)
        node = admin(control, control.broker_address(b.node_id))
        while name not in node.list_topics(timeout=30).topics:
            assert time.monotonic() < deadline, f"node {b.node_id} never listed {name}"
            time.sleep(0.2)
    return name


def topic_config(control: StackControl, name: str) -> dict[str, str]:
    from confluent_kafka.admin import ConfigResource  # type: ignore[attr-defined]

    client = admin(control)
    futures = client.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, name)])
    return {k: str(v.value) for k, v in next(iter(futures.values())).result(30).items()}


def replicas_and_isr(control: StackControl, name: str) -> list[tuple[int, int]]:
    meta = admin(control).list_topics(name, timeout=30)
    return [(len(p.replicas), len(p.isrs)) for p in meta.topics[name].partitions.values()]


def init_transactions(producer: Any, budget_s: float) -> None:
    """``init_transactions`` called again on a retriable error until ``budget_s``, as
    librdkafka documents and the job does (``FencedAttempt``): while a cut node's
    coordinator partitions move, their new leaders answer COORDINATOR_LOAD_IN_PROGRESS
    until loaded, and one call reports that at its timeout."""
    from confluent_kafka import KafkaException

    from blockagg.aggregator.kafka.errors import error_of, is_retriable

    started = time.monotonic()
    while True:
        try:
            producer.init_transactions(30)
        except KafkaException as exc:
            error = error_of(exc)
            waited = time.monotonic() - started
            if error is None or error.fatal() or not is_retriable(error) or waited > budget_s:
                raise
            print(f"\ninit_transactions after {waited:.1f}s: {error.str()}; again")
        else:
            return


def transactional_round(control: StackControl, topic: str, group: str, n: int = 20) -> int:
    """Produce ``n`` records and commit an offset for ``group`` in one transaction
    (acks=all, idempotent); returns how many a read_committed consumer then sees."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    producer = Producer({"bootstrap.servers": control.bootstrap, "acks": "all",
                         "enable.idempotence": True,
                         "transactional.id": f"cluster-{uuid.uuid4().hex[:8]}",
                         "transaction.timeout.ms": 30_000, "log_level": 0})
    init_transactions(producer, 180)
    producer.begin_transaction()
    for i in range(n):
        producer.produce(topic, value=f"m{i}".encode())
    consumer = Consumer({"bootstrap.servers": control.bootstrap, "group.id": group,
                         "enable.auto.commit": False, "isolation.level": "read_committed",
                         "auto.offset.reset": "earliest", "log_level": 0})
    try:
        producer.send_offsets_to_transaction([TopicPartition(topic, 0, n)],
                                             consumer.consumer_group_metadata(), 60)
        producer.commit_transaction(60)
        consumer.assign([TopicPartition(topic, 0, 0)])
        seen = 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is not None and msg.error() is None:
                seen += 1
            elif msg is None and seen:
                break
        committed = consumer.committed([TopicPartition(topic, 0)], 30)[0].offset
        assert committed == n, f"the transaction's offset commit: {committed} != {n}"
        return seen
    finally:
        consumer.close()


def test_three_brokers_form_one_cluster_with_production_durability(
        cluster: StackControl) -> None:
    ids = set()
    for b in cluster.cfg.kafka_brokers:  # each node alone names all three and one id
        client = admin(cluster, cluster.broker_address(b.node_id))
        desc = client.describe_cluster(request_timeout=30).result(30)
        assert sorted(n.id for n in desc.nodes) == [1, 2, 3]
        ids.add(desc.cluster_id)
    assert len(ids) == 1, f"three cluster ids: {ids}"
    topic = create_topic(cluster, f"cl-new-{uuid.uuid4().hex[:8]}")  # broker defaults
    assert transactional_round(cluster, topic, f"cl-g-{uuid.uuid4().hex[:8]}") == 20
    for name in (topic, "__consumer_offsets", "__transaction_state"):
        assert {rf for rf, _ in replicas_and_isr(cluster, name)} == {3}, name
        config = topic_config(cluster, name)
        assert config["min.insync.replicas"] == "2", name
        assert config["unclean.leader.election.enable"] == "false", name


def test_a_killed_broker_leaves_transactions_working_and_rejoins(
        cluster: StackControl) -> None:
    topic = create_topic(cluster, f"cl-kill-{uuid.uuid4().hex[:8]}")
    group = f"cl-g-{uuid.uuid4().hex[:8]}"
    assert transactional_round(cluster, topic, group) == 20  # creates the internal topics
    victim = cluster.leader(topic, 0)
    print(f"\nleader {victim}, group coordinator {cluster.group_coordinator(group)}")
    cluster.kill9_broker(victim)
    try:
        started = time.monotonic()
        assert transactional_round(cluster, topic, group) == 40
        print(f"transaction with node {victim} dead: {time.monotonic() - started:.1f}s")
        assert cluster.leader(topic, 0) not in (victim, -1)
        assert {isr for _, isr in replicas_and_isr(cluster, topic)} == {2}
    finally:
        seconds = cluster.up()
    print(f"node {victim} restarted in {seconds:.1f}s")
    deadline = time.monotonic() + 60
    while replicas_and_isr(cluster, topic) != [(3, 3)]:
        assert time.monotonic() < deadline, f"node {victim} did not rejoin the ISR of {topic}"
        time.sleep(0.5)
    print(f"back in sync {time.monotonic() - started:.1f}s after the kill")


def _wait(cond, timeout: float, what) -> float:  # type: ignore[no-untyped-def]
    """Seconds until ``cond()``; ``what`` (text, or a function giving it) says what was
    still so when ``timeout`` ran out."""
    started = time.monotonic()
    while not cond():
        assert time.monotonic() - started < timeout, \
            f"{what() if callable(what) else what} after {timeout:.0f}s"
        time.sleep(0.5)
    return time.monotonic() - started


def test_a_cut_broker_is_fenced_while_the_other_two_commit_and_rejoins_once_healed(
        cluster: StackControl) -> None:
    """Issue 27 item 3: the leader of the partition written is cut off the network both
    ways (its veth down: clients, peers, its own fetches and heartbeats, the KRaft
    quorum). It runs on, unaware; the other two fence it, move its leaderships, drop it
    from every ISR and commit a transactional round (acks=all, min.insync 2); once
    healed it rejoins every ISR. A partition with no replica but the cut node's (a
    replication factor 1 topic of an earlier run on the same stack) has nowhere to move
    and is left out."""
    if (reason := cluster.cut_unavailable()) is not None:
        pytest.skip(f"no broker cut on this machine: {reason}")
    topic = create_topic(cluster, f"cl-cut-{uuid.uuid4().hex[:8]}")
    group = f"cl-g-{uuid.uuid4().hex[:8]}"
    assert transactional_round(cluster, topic, group) == 20
    victim = cluster.leader(topic, 0)
    pid = cluster.pid(cluster.broker_service(victim))
    others = ",".join(cluster.broker_address(n) for n in cluster.broker_ids if n != victim)

    def fenced() -> bool:
        client = admin(cluster, others)  # kept referenced until the future is done
        nodes = client.describe_cluster(request_timeout=10).result(10).nodes
        return victim not in {n.id for n in nodes}

    holding: list[str] = []

    def out_of_every_isr() -> bool:
        meta = admin(cluster, others).list_topics(timeout=10)
        holding[:] = [f"{name}[{p.id}] leader {p.leader} isr {p.isrs} replicas {p.replicas}"
                      for name, t in meta.topics.items() for p in t.partitions.values()
                      if victim in p.isrs or (p.leader in (victim, -1)
                                              and set(p.replicas) - {victim})]
        return not holding

    started = time.monotonic()
    with cluster.cut(victim):
        assert cluster.is_cut(victim)
        assert transactional_round(cluster, topic, group) == 40
        committed_s = time.monotonic() - started
        fenced_s = _wait(fenced, 60, f"node {victim} still registered") + committed_s
        out_s = _wait(out_of_every_isr, 60, lambda: (
            f"node {victim} still in an ISR: {'; '.join(holding[:10])}")) + fenced_s
        host, port = cluster.broker_address(victim).split(":")
        from scripts import stack_lib

        assert not stack_lib.probe_kafka(int(port), host=host), "the cut node answers"
        assert cluster.pid(cluster.broker_service(victim)) == pid, "the cut node died"
        print(f"\nnode {victim} cut: transaction committed on the other two after "
              f"{committed_s:.1f}s, fenced by {fenced_s:.1f}s, out of every ISR by "
              f"{out_s:.1f}s")
    assert not cluster.is_cut(victim)
    healed = time.monotonic()
    seconds = cluster.wait_in_sync(120)
    print(f"node {victim} healed: every ISR full {seconds:.1f}s later "
          f"({time.monotonic() - healed:.1f}s)")
    assert replicas_and_isr(cluster, topic) == [(3, 3)]
    assert cluster.pid(cluster.broker_service(victim)) == pid, "the healed node restarted"


def job_config(cluster: StackControl, topic: str) -> Config:
    return loads(f"""
[job]
checkpoint_location = "/tmp/ck"
[kafka]
"bootstrap.servers" = "{cluster.bootstrap}"
[[topics]]
name = "{topic}"
replicas = ["127.0.0.1:9000"]
""")


def start_checks(config: Config, topic: str) -> object:
    """What ``preflight.run`` does for Kafka before ClickHouse: the topics, then their
    durability."""
    found = check_topics(config.kafka.librdkafka_config(), [topic])
    return preflight.check_durability(config, found)


@pytest.mark.parametrize(("rf", "config", "refusal"), [
    (1, {}, "replication.factor=1"),
    (3, {"min.insync.replicas": "1"}, "min.insync.replicas=1"),
])
def test_the_start_refuses_an_unsafe_topic_on_the_cluster(
        cluster: StackControl, rf: int, config: dict[str, str], refusal: str) -> None:
    topic = create_topic(cluster, f"cl-unsafe-{uuid.uuid4().hex[:8]}", rf, config)
    with pytest.raises(UnsafeKafkaDurability, match=f"Kafka topic {topic} .*{refusal}"):
        start_checks(job_config(cluster, topic), topic)


def test_the_start_accepts_rf3_min_insync2_on_the_cluster(cluster: StackControl) -> None:
    topic = create_topic(cluster, f"cl-safe-{uuid.uuid4().hex[:8]}", 3,
                         {"min.insync.replicas": "2"})
    result = start_checks(job_config(cluster, topic), topic)
    assert getattr(result, "brokers", None) == 3
    assert getattr(result, "accepted", False) and not getattr(result, "findings", ())


def test_the_start_reads_the_brokers_settings_past_a_cut_lowest_broker(
        cluster: StackControl) -> None:
    """A start while the lowest-id node is cut off, before the cluster fences it.

    Three reads used to refuse it: the brokers' settings asked of the lowest id alone
    (every time, after 6 s); the broker count from a DescribeCluster, which goes to the
    broker the metadata names controller, in KRaft a random live broker, the cut one
    included (about 1 start in 10, after 6 s); and the incarnation's reads, which go
    there too (30 s), as does a first start's creation of its compacted topics. Now the
    settings are asked of every broker at once, the count comes from the metadata, and a
    silent controller is left for a fresh client.

    The clients bootstrap from all three nodes, the cut one included, as a job's
    ``bootstrap.servers`` usually lists them: librdkafka tries another node while the
    cut one's connection hangs."""
    from blockagg.aggregator.kafka.incarnation import TopicIncarnations
    from blockagg.aggregator.kafka.log_store import KafkaStore

    if (reason := cluster.cut_unavailable()) is not None:
        pytest.skip(f"no broker cut on this machine: {reason}")
    topic = create_topic(cluster, f"cl-cutstart-{uuid.uuid4().hex[:8]}", 3,
                         {"min.insync.replicas": "2"})
    lowest = min(cluster.broker_ids)
    config = job_config(cluster, topic)
    expected = preflight.broker_metadata_max_bytes(config)
    incarnation = TopicIncarnations(config.kafka.librdkafka_config()).of(topic)
    assert expected is not None
    with cluster.cut(lowest):
        started = time.monotonic()
        result = start_checks(config, topic)
        assert getattr(result, "brokers", None) in (2, 3)
        assert getattr(result, "accepted", False) and not getattr(result, "findings", ())
        checked = time.monotonic() - started
        assert preflight.broker_metadata_max_bytes(config) == expected
        assert TopicIncarnations(config.kafka.librdkafka_config()).of(topic) == incarnation
        read = time.monotonic() - started
        store = KafkaStore(config.kafka.librdkafka_config(), f"_cl_cutstart_{topic[-8:]}")
        store.ensure_topic()
        assert store.end() == 0
        print(f"\nnode {lowest} cut: the start's Kafka checks passed in {checked:.1f}s, "
              f"the incarnation read after {read:.1f}s, a compacted topic created after "
              f"{time.monotonic() - started:.1f}s")
    cluster.wait_in_sync(120)


def test_the_second_shard_replicates_within_itself_and_joins_the_cluster(
        cluster: StackControl) -> None:
    from clickhouse_driver import Client

    first, second = cluster.cfg.shard_replicas().values()
    clients = {r.name: Client("127.0.0.1", port=r.tcp) for r in (*first, *second)}
    rows = clients["r1"].execute("SELECT shard_num, port FROM system.clusters "
                                 "WHERE cluster = 'blockagg' ORDER BY shard_num, port")
    assert rows == [(1, first[0].tcp), (1, first[1].tcp), (2, second[0].tcp),
                    (2, second[1].tcp)]
    db = f"cl_{uuid.uuid4().hex[:8]}"
    for c in clients.values():
        c.execute(f"CREATE DATABASE {db}")
        c.execute(f"CREATE TABLE {db}.t (x UInt64) ENGINE = ReplicatedMergeTree("
                  f"'/clickhouse/tables/{{shard}}/{db}/t', '{{replica}}') ORDER BY x")
    clients["r3"].execute(f"INSERT INTO {db}.t VALUES", [(i,) for i in range(10)])
    clients["r4"].execute(f"SYSTEM SYNC REPLICA {db}.t")
    counts = {n: c.execute(f"SELECT count() FROM {db}.t")[0][0] for n, c in clients.items()}
    assert counts == {"r1": 0, "r2": 0, "r3": 10, "r4": 10}
    for c in clients.values():
        c.execute(f"DROP DATABASE {db}")
        c.disconnect()
