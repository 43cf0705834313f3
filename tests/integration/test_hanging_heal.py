"""A hanging transaction on the metadata group, ended by the job itself at start.

A private single broker (its own stack dir, ports + 6000: the test kills it) gets two
transactions on the job's metadata group that no coordinator will ever end, made the
way Kafka loses them: the broker is killed (``kill -9``) while they are open and comes
back without its ``__transaction_state`` log, so its coordinator knows neither (the
long fault runs met the same state after a plain ``kill -9``, docs/RELIABILITY.md).
One holds partition 0's intent, the other an attempt's probe (offset 0, no metadata)
on partition 1. Every stable read of those partitions' commits then times out. The job
must start anyway, roll the intent forward, abort both, and store every row exactly
once on the shared ClickHouse replicas (``arv verify`` and ``arv audit`` clean).
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_job_clickhouse import PARTITIONS, ChJob, make_job

pytestmark = pytest.mark.integration

SHIFT = 6000
_KEPT: list[Any] = []
"""Producers of transactions left open: kept, not destroyed (their broker died under them)."""


class PrivateKafka:
    """One KRaft broker of ``scripts/stack``'s making, in its own dir and ports."""

    def __init__(self, root: Path) -> None:
        from scripts import stack_lib
        from tests.faults.stack import fault_stack_env, link_installed_jars

        # its own ports and folder, whatever the fault suite's variables say
        base = {k: v for k, v in os.environ.items()
                if k not in ("BLOCKAGG_FAULT_PORT_SHIFT", "BLOCKAGG_FAULT_STACK_DIR")}
        self.env = fault_stack_env(base, shift=SHIFT, root=root)
        link_installed_jars(self.env)
        cfg = stack_lib.StackConfig.from_env(self.env)
        self.service = stack_lib.build_services(cfg)["kafka"]
        for port in (cfg.ports.kafka, cfg.ports.kafka_controller):
            if stack_lib.port_in_use(port):
                pytest.fail(f"port {port} (stack port + {SHIFT}) is in use: the private "
                            "broker of this test needs it")
        self.data = cfg.service_dir("kafka") / "data"
        self.bootstrap = f"{stack_lib.HOST}:{cfg.ports.kafka}"

    def start(self) -> None:
        self.service.start()
        self.service.wait_up()

    def kill9(self) -> None:
        pid = self.service.pid()
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while self.service.is_up() and time.monotonic() < deadline:
            time.sleep(0.1)

    def forget_transactions(self) -> None:
        """What a coordinator that lost its state knows: no transactional id at all."""
        for folder in glob.glob(str(self.data / "__transaction_state-*")):
            shutil.rmtree(folder)

    def stop(self) -> None:
        self.service.stop()


@pytest.fixture(scope="module")
def private_kafka() -> Iterator[PrivateKafka]:
    root = Path(__file__).resolve().parents[2] / ".stack" / f"hanging-{uuid.uuid4().hex[:6]}"
    kafka = PrivateKafka(root)
    kafka.start()
    try:
        yield kafka
    finally:
        kafka.stop()
        shutil.rmtree(root, ignore_errors=True)


def new_private_topic(kafka: PrivateKafka) -> str:
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    topic = f"ithang-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    admin.create_topics([NewTopic(topic, PARTITIONS, 1)])[topic].result(30)
    return topic


def leave_open(bootstrap: str, group: str, topic: str, partition: int, offset: int,
               metadata: str) -> Any:
    """A transaction of the partition's own transactional id holding one offset commit
    of the group, left open; the producer is returned so it is not destroyed."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    from blockagg.aggregator.kafka.fencing import transactional_id
    from blockagg.logs import kafka_client_config

    # kept until exit, past its broker's stop: its lines go through the logging setup
    producer = Producer(kafka_client_config({
        "bootstrap.servers": bootstrap,
        "transactional.id": transactional_id(group, topic, partition),
        "transaction.timeout.ms": 60_000}))
    producer.init_transactions(30)
    producer.begin_transaction()
    member = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    producer.send_offsets_to_transaction(
        [TopicPartition(topic, partition, offset, metadata=metadata)],
        member.consumer_group_metadata(), 30)
    member.close()
    return producer


def stable_read(bootstrap: str, group: str, topic: str, partition: int) -> str:
    """What a stable read of the partition's commit gives: ``"timed out"`` while a
    transaction hangs (retried through a broker that is still loading), else what it
    answered."""
    from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                         "isolation.level": "read_committed", "enable.auto.commit": False})
    answer = "nothing"
    try:
        for _ in range(3):
            try:
                (tp,) = consumer.committed([TopicPartition(topic, partition)], timeout=8)
            except KafkaException as exc:
                if exc.args[0].code() == KafkaError._TIMED_OUT:
                    return "timed out"
                answer = str(exc)
                time.sleep(2)
                continue
            return f"offset {tp.offset} error {tp.error}"
    finally:
        consumer.close()
    return answer


@pytest.fixture
def hang_job(tmp_path: Path, stack_env: dict[str, str], private_kafka: PrivateKafka,
             ch_database: str, ch_replicas: list[Any]) -> Iterator[ChJob]:
    env = {**stack_env, "BLOCKAGG_BOOTSTRAP_SERVERS": private_kafka.bootstrap}
    job = make_job(tmp_path, env, new_private_topic(private_kafka), ch_database, ch_replicas)
    yield job
    print(f"\n{job.figures()}")


def hang_two(job: ChJob, kafka: PrivateKafka) -> None:
    from confluent_kafka import Consumer, TopicPartition

    reader = Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": job.group,
                       "enable.auto.commit": False})
    (last,) = reader.committed([TopicPartition(job.topic, 0)], timeout=30)
    reader.close()
    assert last.offset > 0 and last.metadata, "the first run committed partition 0"
    _KEPT.extend([leave_open(kafka.bootstrap, job.group, job.topic, 0, last.offset,
                            last.metadata),
                  leave_open(kafka.bootstrap, job.group, job.topic, 1, 0, "")])
    kafka.kill9()
    kafka.forget_transactions()
    kafka.start()


def test_the_job_ends_a_hanging_transaction_on_its_group_at_start_and_stays_exact(
        hang_job: ChJob, private_kafka: PrivateKafka) -> None:
    """With ``kafka.heal_hanging_transactions = false`` the start is refused with the
    runbook (what every start did before); with the default the job heals and runs."""
    job = hang_job
    job.feed.good(45)
    job.run()
    hang_two(job, private_kafka)
    reads = [stable_read(private_kafka.bootstrap, job.group, job.topic, p) for p in (0, 1)]
    assert reads == ["timed out"] * 2, f"the transactions hang: {reads}"
    job.feed.good(30)
    healing = job.config.read_text()
    job.config.write_text(healing.replace(
        "[kafka]\n", "[kafka]\nheal_hanging_transactions = false\n"))
    with pytest.raises(AssertionError, match="exited 1") as refused:
        job.run(timeout=180)
    assert "cannot be read as stable" in str(refused.value), str(refused.value)[-3000:]
    assert "find-hanging" in str(refused.value)
    job.config.write_text(healing)
    out = job.run()
    lines = [line for line in out.splitlines() if "blockagg.metadata: " in line]
    assert sum("hanging intent re-committed" in line for line in lines) == 1, out[-6000:]
    assert sum("hanging transaction aborted" in line for line in lines) == 2, out[-6000:]
    assert "cannot be read as stable" not in out
    job.assert_exact()
    assert not any(stable_read(private_kafka.bootstrap, job.group, job.topic, p) == "timed out"
                   for p in (0, 1))
