"""The job's start-up refusal of a deduplication window below the need, on the real
stack (schema registry in Kafka, two ClickHouse 18.16 replicas whose tables keep the
default ``replicated_deduplication_window = 100``)."""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.integration import test_job_clickhouse as chjobs
from tests.integration.test_job_clickhouse import JOB_PY, REPO, ChJob

pytestmark = pytest.mark.integration

chjob = chjobs.chjob


def _start(job: ChJob, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = ["spark-submit", *job.spark_args("local[2]"), str(JOB_PY), "--config",
           str(job.config), "--until-caught-up", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=job.env,
                          cwd=REPO, check=False)


def test_a_window_below_the_need_refuses_the_start_unless_allowed(chjob: ChJob) -> None:
    """3 partitions, max_offsets_per_trigger 100000, max_rows 1000: the need is
    2 x (3 + 100) = 206 blocks, above the tables' window of 100: refused at start,
    naming table, window and need; allow_small_dedup_window starts with a warning."""
    sizing = ("--set", "job.max_offsets_per_trigger=100000", "--set", "blocks.max_rows=1000")
    refused = _start(chjob, *sizing)
    said = refused.stdout + refused.stderr
    assert refused.returncode == 1, said[-5000:]
    assert "DedupWindowTooSmall" in said or "replicated_deduplication_window = 100" in said
    assert f"table {chjob.database}." in said and "below the 206 blocks" in said, said[-5000:]
    assert "3 partitions on the shard" in said
    allowed = _start(chjob, *sizing, "--set", "clickhouse.allow_small_dedup_window=true")
    said = allowed.stdout + allowed.stderr
    assert allowed.returncode == 0, said[-5000:]
    assert "below the 206 blocks" in said


def test_partitions_added_while_running_refuse_a_window_that_no_longer_holds(
        chjob: ChJob) -> None:
    """3 partitions, max_offsets_per_trigger 47000, max_rows 1000: the need is
    2 x (3 + 47) = 100 blocks, the tables' window: the job starts. A fourth partition
    added while it runs makes it 2 x (4 + 47) = 102: the batch that first reads the
    new partition refuses before it writes anything, naming the need."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewPartitions  # type: ignore[attr-defined]

    running = chjob.popen("--set", "job.max_offsets_per_trigger=47000",
                          "--set", "blocks.max_rows=1000")
    try:
        chjob.feed.good(30)
        running.wait_batches(1)
        admin = AdminClient({"bootstrap.servers": chjob.bootstrap})
        admin.create_partitions([NewPartitions(chjob.topic, 4)])[chjob.topic].result(30)
        producer = Producer({"bootstrap.servers": chjob.bootstrap})
        deadline = time.monotonic() + 30
        while len(producer.list_topics(chjob.topic, 5).topics[chjob.topic].partitions) < 4:
            assert time.monotonic() < deadline, "the fourth partition never showed"
            time.sleep(0.2)
        _, _, value = chjob.feed._envelope()
        producer.produce(chjob.topic, value=value, partition=3)
        assert producer.flush(30) == 0
        code = running.proc.wait(timeout=180)
    finally:
        if running.proc.poll() is None:
            running.proc.kill()
    running._reader.join(10)
    said = running.output
    assert code == 1, said[-6000:]
    assert "new partitions: tables checked again" in said, said[-6000:]
    assert "below the 102 blocks" in said and "4 partitions on the shard" in said, said[-6000:]
