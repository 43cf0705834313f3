"""Safety nets of the running job on the real stack (Kafka source, metadata store,
offset log; the deduplicating file sink of ``job_support``):

* a commit beyond the partition's end (the group's offsets reset forward, or a topic
  recreated under the job) refuses the next batch in its task
  (``MetadataAheadOfPartition``) instead of skipping it as delivered;
* quiet partitions are re-committed with their unchanged metadata, so
  ``offsets.retention.minutes`` never expires them, and ``arv verify`` stays clean.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import re
import signal
import time

import msgpack
import pytest
from click.testing import CliRunner

from blockagg.aggregator.core.metadata import BlockRange, Metadata, decode, encode, is_blockagg
from blockagg.aggregator.core.model import Committed
from blockagg.spark.offsets import make_consumer, read_committed, watermarks
from blockagg.verifier.cli import cli as verify_cli
from blockagg.verifier.history import HistoryReader
from blockagg.verifier.rules import Commit
from tests.integration import test_job_e2e as e2e
from tests.integration.job_support import stored
from tests.integration.test_job_e2e import JobEnv, Producer, _wait_for, assert_exact

pytestmark = pytest.mark.integration

job = e2e.job
producer = e2e.producer


def _committed(job: JobEnv) -> tuple[dict[tuple[str, int], Committed],
                                      dict[tuple[str, int], tuple[int, int]]]:
    """The metadata group's commits and the partitions' watermarks."""
    consumer = make_consumer({"bootstrap.servers": job.stack_env["BLOCKAGG_BOOTSTRAP_SERVERS"]},
                             job.group)
    try:
        partitions = [(job.topic, p) for p in range(3)]
        return read_committed(consumer, partitions), watermarks(consumer, partitions)
    finally:
        consumer.close()


def _wait_delivered(job: JobEnv, timeout: float = 180) -> dict[tuple[str, int], Committed]:
    """Wait until every partition's committed offset is its log end."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        commits, ends = _committed(job)
        if all(tp in commits and commits[tp].offset == high for tp, (_, high) in ends.items()):
            return commits
        time.sleep(1)
    raise AssertionError(f"not delivered after {timeout}s: {_committed(job)}")


def _commit(job: JobEnv, partition: int, offset: int, metadata: str) -> None:
    from confluent_kafka import TopicPartition

    consumer = make_consumer({"bootstrap.servers": job.stack_env["BLOCKAGG_BOOTSTRAP_SERVERS"]},
                             job.group)
    try:
        consumer.commit(offsets=[TopicPartition(job.topic, partition, offset, metadata)],
                        asynchronous=False)
    finally:
        consumer.close()


def test_commit_beyond_the_partitions_end_refuses_the_batch_in_its_task(
        job: JobEnv, producer: Producer) -> None:
    producer.messages(30)
    proc = job.popen()
    try:
        _wait_for(proc, "batch kind=")
        _wait_delivered(job)
        before = {key for rows in stored(job.sink).rows.values() for key in rows}
        # An offset reset forward that no tool clamped (or the topic recreated under a
        # group that kept its commits): partition 0's resume offset is now beyond its end.
        _commit(job, 0, 10_000, "")
        producer.messages(30)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, out[-5000:]
    assert "MetadataAheadOfPartition" in out and "beyond the partition's end" in out, \
        out[-5000:]
    after = {key for rows in stored(job.sink).rows.values() for key in rows}
    assert not {key for key in after - before if key[1] == 0}  # nothing of p0 inserted


CRAFTED = "ba1:" + base64.b85encode(msgpack.packb(
    [1, 0, 0, 10, 10, b"", [2**40, 0, 0, 0]], use_bin_type=True)).decode()
"""The issue's 31-byte metadata: 2**40 blocks of zero-bit fields."""


def test_an_undecodable_commit_refuses_its_partition_with_a_clear_message(
        job: JobEnv, producer: Producer) -> None:
    """At start (the driver reads every commit) and while running (the task reads it):
    exit 1, the partition and the way out named, no traceback in the refusal."""
    producer.messages(30)
    proc = job.popen()
    try:
        _wait_for(proc, "batch kind=")
        _wait_delivered(job)
        _commit(job, 1, 10, CRAFTED)
        producer.messages(30)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, out[-5000:]
    [failed] = [line for line in out.splitlines() if "query failed" in line]
    assert f"MetadataDecodeError: {job.topic}[1]: the last commit" in failed, failed
    assert "Traceback" not in failed and f"--topic {job.topic}:1 --to-offset" in failed
    # the failure is its line and a handful more (issue 26, item 2): no trace, no frames
    loud = [line for line in out.splitlines()
            if re.search(r" (WARN|WARNING|ERROR|FATAL|CRITICAL) |^\s+at |Traceback", line)]
    assert len(loud) <= 8, "\n".join(loud)

    restart = job.run(timeout=240)
    assert restart.returncode == 1, restart.stdout[-3000:] + restart.stderr[-3000:]
    said = restart.stdout + restart.stderr
    assert f"{job.topic}[1]: the last commit of {job.group} (offset 10)" in said, said[-6000:]
    assert "Traceback" not in said


def _history(job: JobEnv) -> list[Commit]:
    """The group's commits, as read back from __consumer_offsets."""
    with HistoryReader(job.stack_env["BLOCKAGG_BOOTSTRAP_SERVERS"], [job.group],
                       [job.topic]) as reader:
        return [e for e in reader.events() if isinstance(e, Commit)]


def _but_attempt(text: str) -> object:
    """A commit's metadata as the verifier reads it: everything but the attempt nonce."""
    text = text.rstrip("\x00")
    return dataclasses.replace(decode(text), attempt=0) if is_blockagg(text) else text


def test_quiet_partitions_are_recommitted_unchanged_and_verify_stays_clean(
        job: JobEnv, producer: Producer) -> None:
    """job.idle_commit_interval = 2s: once the partitions are quiet, each one's last
    commit appears again in __consumer_offsets with the same offset and metadata (but
    for the attempt nonce: each re-commit is an attempt of its own) and a later commit
    time, so the brokers' retention restarts; arv verify stays clean."""
    producer.messages(30)
    proc = job.popen("--set", "job.idle_commit_interval=2s")
    try:
        _wait_for(proc, "batch kind=")
        delivered = _wait_delivered(job)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            history = _history(job)
            repeats = {tp: [c for c in history if (c.topic, c.partition) == tp
                            and c.offset == last.offset
                            and _but_attempt(c.metadata) == _but_attempt(last.metadata)]
                       for tp, last in delivered.items()}
            if all(len(same) >= 3 for same in repeats.values()):
                break
            time.sleep(2)
        os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-5000:]
    assert "idle partitions re-committed" in out
    for tp, same in repeats.items():
        assert len(same) >= 3, (tp, same)
        stamps = [c.commit_timestamp for c in same]
        assert stamps == sorted(stamps) and stamps[-1] - stamps[0] >= 2000, (tp, stamps)
    now = _committed(job)[0]
    assert {tp: (c.offset, _but_attempt(c.metadata)) for tp, c in now.items()} == \
        {tp: (c.offset, _but_attempt(c.metadata)) for tp, c in delivered.items()}  # nothing moved
    result = CliRunner().invoke(verify_cli, ["verify", "--bootstrap-servers",
                                             job.stack_env["BLOCKAGG_BOOTSTRAP_SERVERS"],
                                             "--group", job.group])
    assert result.exit_code == 0, result.stdout + result.stderr


def test_a_missing_replay_block_is_given_up_without_losing_other_tables(
        job: JobEnv, producer: Producer) -> None:
    """Partition 0 carries only db.b; its last commit is made to list a block of db.a
    ([10, 15], as if compaction or a recreated topic had removed its messages): the task
    refuses with ReplayBlockMissing, printing the setting; restarted with it, db.b's
    messages in [10, 15], which a reset to 16 would have skipped, are delivered once."""
    producer.messages(30)
    proc = job.popen()
    try:
        _wait_for(proc, "batch kind=")
        _wait_delivered(job)
        _commit(job, 0, 10, encode(Metadata(1, 5, 10, 20, 10, (BlockRange(1, 10, 15),))))
        producer.messages(30)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, out[-5000:]
    [failed] = [line for line in out.splitlines() if "query failed" in line]
    setting = f'job.dead_letter_missing_blocks=["{job.topic}:0:1:10-15"]'
    assert "ReplayBlockMissing" in failed and setting in failed.replace("\\\"", '"'), failed
    result = job.run("--until-caught-up", "--set", setting, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    assert_exact(job, producer)
    # arv shows the given-up block once, as a gap: its table got none of its messages.
    verified = CliRunner().invoke(verify_cli, [
        "verify", "--bootstrap-servers", job.stack_env["BLOCKAGG_BOOTSTRAP_SERVERS"],
        "--group", job.group, "--json"])
    findings = [json.loads(line) for line in verified.stdout.splitlines() if line.strip()]
    assert [(f["kind"], f["partition"], f["table_id"]) for f in findings
            if f["kind"] != "foreign_writer"] == [("gap", 0, 1)], verified.stdout


def _reset_with_admin_client(job: JobEnv, partition: int, offset: int) -> None:
    """What ``kafka-consumer-groups.sh --reset-offsets --to-offset`` does: the group's
    offset moved by the AdminClient, with no metadata (a foreign commit)."""
    from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": job.stack_env["BLOCKAGG_BOOTSTRAP_SERVERS"]})
    [future] = admin.alter_consumer_group_offsets([ConsumerGroupTopicPartitions(
        job.group, [TopicPartition(job.topic, partition, offset)])]).values()
    [moved] = future.result(30).topic_partitions
    assert moved.error is None and moved.offset == offset, moved


def test_a_forward_reset_under_a_checkpoint_behind_is_delivered_from_the_reset_and_verifies(
        job: JobEnv, producer: Producer) -> None:
    """Issue 25: the operator resets partition 0 forward (to 25) while the job is stopped
    and its Spark checkpoint stays at 20. The restarted query plans partition 0 from
    20; the core leaves [20, 25) out as acknowledged and delivers from 25, committing
    start = 20 with resume and blocks at or above 25. Every other message lands exactly
    once, and arv verify reports the reset as a notice only (exit 0), no backward."""
    producer.messages(60)  # offsets [0, 20) of each partition
    ok = job.run("--until-caught-up", timeout=300)
    assert ok.returncode == 0, (ok.stdout + ok.stderr)[-5000:]
    producer.messages(60)  # offsets [20, 40)
    _reset_with_admin_client(job, 0, 25)
    again = job.run("--until-caught-up", timeout=300)
    assert again.returncode == 0, (again.stdout + again.stderr)[-5000:]
    assert "resuming from offset 25" in again.stdout + again.stderr

    skipped = {(job.topic, 0, offset) for offset in range(20, 25)}
    for rows in producer.expected.rows.values():
        for key in skipped & set(rows):
            del rows[key]
    assert_exact(job, producer)

    history = [c for c in _history(job) if c.partition == 0]
    # the reset, and the job's own unchanged re-commit of it (with librdkafka's NUL)
    foreign = [i for i, c in enumerate(history) if not c.metadata.startswith("ba")]
    assert foreign and {history[i].offset for i in foreign} == {25}, history
    from blockagg.aggregator.core.metadata import decode

    after = [decode(c.metadata.rstrip("\x00")) for c in history[foreign[-1] + 1:]]
    assert after and after[0].start == 20 and min(m.resume for m in after) >= 25, after
    result = CliRunner().invoke(verify_cli, ["verify", "--bootstrap-servers",
                                             job.stack_env["BLOCKAGG_BOOTSTRAP_SERVERS"],
                                             "--group", job.group, "--json"])
    findings = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert {(f["kind"], f["partition"], f["offset"]) for f in findings} == {
        ("foreign_writer", 0, 25)}, result.stdout + result.stderr
    assert result.exit_code == 0, result.stderr
