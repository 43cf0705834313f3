"""Waits that used to be silent and unbounded, against the real stack: a task stuck in its
Python worker (SIGSTOP) fails its batch after ``job.batch_timeout`` with one line; a
transactional commit that librdkafka leaves hanging after a broker restart ends the
attempt; and a quorum that a replica can't help reach ends the block's retries with one
line naming that replica (docs/running.md, *When a batch does not finish*, *When a
replica does not catch up*)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from blockagg.aggregator.clickhouse.exceptions import QuorumUnsatisfied
from blockagg.aggregator.clickhouse.writer import ClickHouseBlockWriter, Replica, WriterConfig
from blockagg.aggregator.core.metadata import DEAD_LETTER_TABLE_ID
from blockagg.aggregator.core.model import Batch, Block, block_token
from blockagg.aggregator.kafka.exceptions import MetadataCommitError
from blockagg.aggregator.kafka.metadata_store import KafkaMetadataStore
from blockagg.rows.deadletters import make_dead_letter
from tests.faults import driver, hooks
from tests.faults.stack import StackControl
from tests.faults.workload import Workload

pytestmark = pytest.mark.integration


@pytest.fixture
def workload(stack: StackControl) -> Iterator[Workload]:
    w = Workload(stack.bootstrap, "127.0.0.1", stack.ch_ports, tables=2, partitions=2,
                 rows_per_message=2, dead_every=7, seed=4)
    w.setup()
    yield w
    w.drop()


def test_a_task_stuck_in_its_worker_fails_the_batch_after_batch_timeout(
        workload: Workload, stack: StackControl, tmp_path: Path) -> None:
    """The mixed run's 20-minute silence: a task whose worker is stopped held its batch
    for as long as nobody restarted the job. Now the driver cancels it at
    ``job.batch_timeout`` and exits 1 with one line naming the batch and its progress."""
    job = driver.Job(workload, stack, tmp_path)
    job.config.write_text(job.config.read_text().replace(
        "[job]\n", '[job]\nbatch_timeout = "20s"\n', 1))
    workload.produce(200)
    job.arm("stall_after_commit")
    job.start()
    try:
        assert driver._wait(lambda: bool(hooks.stalled(job.hook_dir)), 180), job.tail()
        assert job.proc is not None
        assert job.proc.wait(300) == 1, job.tail()
        log = job.log.read_text(errors="replace")
        assert "batch timeout: cancelling it" in log, job.tail()
        failed = [line for line in log.splitlines() if "query failed" in line]
        assert failed, job.tail()
        assert "BatchTimedOut: batch " in failed[-1]
        assert "did not finish within job.batch_timeout (20s)" in failed[-1]
        assert "tasks done" in failed[-1]  # Spark's progress of the stuck stage
    finally:
        for record in hooks.stalled(job.hook_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(str(record["pid"])), signal.SIGKILL)
        job.close()


def test_a_replica_that_cannot_help_reach_the_quorum_is_named(
        workload: Workload, stack: StackControl) -> None:
    """r2 killed: a quorum-2 insert into r1 can't be acknowledged (the server says the
    quorum timed out, too few replicas are live, or the previous quorum is pending);
    after the writer's attempts, one error names the table and r2."""
    table = workload.dead_letter_table
    r1, r2 = stack.ch_ports
    stack.kill9("clickhouse-r2")
    dead = make_dead_letter("q", 0, 5, 1000, b"\xff", "envelope does not decode")
    batch = Batch("q", 0, 5, 6, np.array([5]), np.array([DEAD_LETTER_TABLE_ID]),
                  np.array([1]), np.array([1]), [dead], {DEAD_LETTER_TABLE_ID: table})
    block = Block("q", 0, DEAD_LETTER_TABLE_ID, table, 5, 5, np.array([0]), 1, 1,
                  block_token("q", 0, table, 5, 5))
    writer = ClickHouseBlockWriter(WriterConfig(
        replicas=(Replica("127.0.0.1", r1), Replica("127.0.0.1", r2)), insert_quorum=2,
        insert_quorum_timeout_ms=2000, max_attempts=3, backoff_initial_s=0.2,
        connect_timeout_s=2, dead_letter_table=table))
    try:
        with pytest.raises(QuorumUnsatisfied) as info:
            writer.insert(block, batch)
    finally:
        writer.close()
        stack.up()  # before the workload's tables are dropped on both replicas
    text = str(info.value)
    assert text.startswith(f"insert into {table} failed after 3 attempt(s): insert_quorum = 2 "
                           "was not reached"), text
    assert f"replica at 127.0.0.1:{r2} did not answer" in text, text
    assert f"replica r1 at 127.0.0.1:{r1}" in text, text
    assert "The replica that does not catch up: 127.0.0.1:" in text, text


def test_a_commit_left_hanging_by_a_broker_restart_ends_the_attempt(
        workload: Workload, stack: StackControl) -> None:
    """librdkafka 2.16: a transaction sent before a broker kill -9 and committed after its
    restart leaves the producer so that the next ``send_offsets_to_transaction`` waits on
    a condition variable for good, whatever its timeout (py-spy: ``cnd_wait`` in
    ``rd_kafka_txn_op_req0``; the 30-fault run's task held its batch this way). The
    attempt's commit must end, with the call named, and a new attempt must commit."""
    from confluent_kafka import TopicPartition

    topic = workload.topic
    store = KafkaMetadataStore({"bootstrap.servers": stack.bootstrap,
                                "group.id": f"{workload.group}-hang"}, timeout=5)
    attempt = store.attempt(topic, 0)
    attempt._hang_after = 10.0  # the store's 5 s timeout + 5 s
    attempt.commit(topic, 0, 1, "hang-test-1")
    producer = attempt._producer
    producer.begin_transaction()
    producer.send_offsets_to_transaction(
        [TopicPartition(topic, 0, 2, metadata="hang-test-2")], store.group_metadata(), 30)
    stack.kill9("kafka")
    time.sleep(2)
    stack.up()
    producer.commit_transaction(60)
    outcome: list[BaseException | None] = []

    def commit() -> None:
        try:
            attempt.commit(topic, 0, 3, "hang-test-3")
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=commit, daemon=True)
    worker.start()
    worker.join(120)
    assert outcome, "the attempt's commit never returned"
    if outcome[0] is not None:  # the hang (a librdkafka without it just commits)
        assert isinstance(outcome[0], MetadataCommitError), outcome[0]
        assert "did not return within 10s although given 5s" in str(outcome[0])
    attempt.close()
    newer = store.attempt(topic, 0)
    newer.commit(topic, 0, 4, "hang-test-4")
    newer.close()
    committed = store.committed(topic, 0)
    assert committed is not None and committed.offset == 4
    store.close()
