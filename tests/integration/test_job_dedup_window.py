"""The job's deduplication-window rules on the real stack (schema registry in Kafka, two
ClickHouse 18.16 replicas): each partition-batch forms at most floor(W_t / (2 x P))
blocks of a table (``aggregator.clickhouse.dedup_window``). A window below 2 x P is
refused at start (over every topic writing the shard, however its replicas are
spelled), for a table registered while the job runs before its first insert, and when
partitions are added; a batch forming more blocks than its share is refused
(``TooManyBlocks``) before anything of it is committed or inserted. The fixture's tables
keep the default ``replicated_deduplication_window = 100``; ``narrow`` tables get
small windows."""

from __future__ import annotations

import subprocess
import time
from typing import Any

import pytest

from tests.integration import test_job_clickhouse as chjobs
from tests.integration.conftest import replicated_engine
from tests.integration.test_job_clickhouse import COORDINATES, JOB_PY, REPO, TABLES, ChJob

pytestmark = pytest.mark.integration

chjob = chjobs.chjob


def _start(job: ChJob, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = ["spark-submit", *job.spark_args("local[2]"), str(JOB_PY), "--config",
           str(job.config), "--until-caught-up", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=job.env,
                          cwd=REPO, check=False)


def _narrow(job: ChJob, short: str, window: int, register: bool = True) -> str:
    """A table like ``clicks`` with ``replicated_deduplication_window = window`` on
    both replicas, registered in the job's schema registry."""
    table = f"{job.database}.{short}"
    columns, message = TABLES["clicks"]
    for client in job.clients:
        client.execute(f"CREATE TABLE {table} ({columns}, {COORDINATES}) ENGINE = "
                       + replicated_engine(job.database, short, "(_topic, _partition, _offset)")
                       + f" SETTINGS replicated_deduplication_window = {window}")
    if register:
        _register(job, table, message)
    return table


def _register(job: ChJob, table: str, message: str) -> None:
    from click.testing import CliRunner

    from blockagg.registration.cli import cli as ba_schema

    env = job.stack_env
    res = CliRunner().invoke(ba_schema, [
        "--bootstrap-servers", job.bootstrap, "--topic", job.schema_topic,
        "--clickhouse", f"{env['BLOCKAGG_CH_HOST']}:{env['BLOCKAGG_CH_PORTS'].split(',')[0]}",
        "register", table, "--proto", str(job.tmp / "itjob.proto"), "--message", message])
    assert res.exit_code == 0, res.output


def _produce(job: ChJob, table: str, count: int, partition: int) -> None:
    from blockagg.proto.envelope import make_envelope

    for i in range(count):
        value = make_envelope(table, [job.feed.row("clicks", 10**6 + i)], version=1)
        job.feed.plain.produce(job.topic, value=value, partition=partition)
    job.feed.flush(job.feed.plain)


def _stored_twice(job: ChJob, table: str) -> list[Any]:
    return [row for client in job.clients for row in client.execute(
        f"SELECT _topic, _partition, _offset, count() AS c FROM {table} "
        "GROUP BY _topic, _partition, _offset HAVING c > 1")]


def test_a_window_below_two_blocks_per_partition_refuses_the_start_unless_allowed(
        chjob: ChJob, new_topic: Any) -> None:
    """The grouping item of issue 25 on the real pair: a second topic (2 partitions)
    lists the shard's replicas as localhost:<port 2>, localhost:<port 1> where the
    first lists 127.0.0.1:<port 1>, 127.0.0.1:<port 2>. P is 3 + 2 = 5 for both (the
    servers name one shard), so a table with a window of 8 (enough for the first
    topic's 3 partitions alone, 2 x 3 = 6) is refused at start, naming the table, the
    window and the 10 blocks of 5 partitions; allow_small_dedup_window starts with a
    warning."""
    narrow = _narrow(chjob, "narrow", 8)
    other = new_topic(partitions=2, prefix="itch2")
    spelled = ", ".join(f'"localhost:{port}"'
                        for port in reversed(chjob.stack_env["BLOCKAGG_CH_PORTS"].split(",")))
    text = chjob.config.read_text()
    chjob.config.write_text(text.replace("\n[blocks]", f'\n[[topics]]\nname = "{other}"\n'
                                         f'replicas = [{spelled}]\n\n[blocks]', 1))
    refused = _start(chjob)
    said = refused.stdout + refused.stderr
    assert refused.returncode == 1, said[-5000:]
    assert (f"table {narrow}: replicated_deduplication_window = 8 is below the 10 blocks "
            "(2 batches in flight x 5 partitions on the shard") in said, said[-5000:]
    allowed = _start(chjob, "--set", "clickhouse.allow_small_dedup_window=true")
    said = allowed.stdout + allowed.stderr
    assert allowed.returncode == 0, said[-5000:]
    assert "is below the 10 blocks" in said


def test_a_table_registered_while_running_is_judged_before_its_first_insert(
        chjob: ChJob) -> None:
    """Issue 25, path 4: the job starts (3 partitions, every window 100). A table
    created with replicated_deduplication_window = 5 (below 2 x 3 = 6) and registered
    while it runs is met by a task when a message names it: the batch is refused
    (DedupWindowTooSmall, naming the table, the window and P) before anything of it is
    inserted; the table stays empty."""
    late = _narrow(chjob, "late", 5, register=False)
    running = chjob.popen()
    try:
        chjob.feed.good(30)
        running.wait_batches(1)
        _register(chjob, late, TABLES["clicks"][1])
        _produce(chjob, late, 1, partition=0)
        code = running.proc.wait(timeout=180)
    finally:
        if running.proc.poll() is None:
            running.kill()
    running._reader.join(10)
    said = running.output
    assert code == 1, said[-6000:]
    assert (f"table {late}: replicated_deduplication_window = 5 is below the 6 blocks "
            "(2 batches in flight x 3 partitions on the shard") in said, said[-6000:]
    for client in chjob.clients:
        assert client.execute(f"SELECT count() FROM {late}") == [(0,)]


def test_partitions_added_while_running_refuse_a_window_that_no_longer_holds(
        chjob: ChJob) -> None:
    """3 partitions and a table with a window of 7: a share of floor(7 / 6) = 1 block
    per partition-batch, the job starts. A fourth partition added while it runs makes
    P = 4 and the share floor(7 / 8) = 0: the batch that first reads the new partition
    refuses before it writes anything, naming the 8 blocks of 4 partitions."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewPartitions  # type: ignore[attr-defined]

    _narrow(chjob, "narrow", 7)
    running = chjob.popen()
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
            running.kill()
    running._reader.join(10)
    said = running.output
    assert code == 1, said[-6000:]
    assert "new partitions: tables checked again" in said, said[-6000:]
    assert "is below the 8 blocks (2 batches in flight x 4 partitions on the shard" in said, (
        said[-6000:])


def test_a_batch_forming_more_blocks_than_its_share_is_refused(chjob: ChJob) -> None:
    """Path 5 of issue 25 on the real stack: blocks.max_bytes = 1, so every message is
    a block of its own. The fixture's sizing (3 partitions, max_offsets_per_trigger 60,
    max_rows 25) needed 2 x (3 + ceil(60 / 25)) = 12 blocks under the old need, which
    the tables' window of 100 passed. 40 messages into one table on one partition form
    40 blocks in one partition-batch, above the share floor(100 / (2 x 3)) = 16: the job
    exits 1 with the TooManyBlocks line, nothing of that partition-batch stored, nothing
    stored twice. Then with max_bytes back to its default the same batch is taken and
    every row is stored once."""
    table = f"{chjob.database}.clicks"
    _produce(chjob, table, 40, partition=0)
    refused = _start(chjob, "--set", "blocks.max_bytes=1")
    said = refused.stdout + refused.stderr
    assert refused.returncode == 1, said[-5000:]
    assert "TooManyBlocks" in said, said[-5000:]
    assert (f"{chjob.topic}[0] batch [0, 40) forms 40 blocks of table {table}, above the "
            "partition's share of its deduplication window: 16 = floor(window 100 / (2 "
            "batches in flight x 3 partitions on the shard))") in said, said[-5000:]
    assert "window to at least 240" in said
    for client in chjob.clients:
        assert client.execute(f"SELECT count() FROM {table}") == [(0,)]
    taken = _start(chjob)
    said = taken.stdout + taken.stderr
    assert taken.returncode == 0, said[-5000:]
    for client in chjob.clients:
        assert client.execute(f"SELECT count() FROM {table}") == [(40,)]
    assert _stored_twice(chjob, table) == []
