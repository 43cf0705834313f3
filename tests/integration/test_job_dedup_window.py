"""The job's refusal of a deduplication window below the need, on the real stack
(schema registry in Kafka, two ClickHouse 18.16 replicas whose tables keep the
default ``replicated_deduplication_window = 100``): at start, and for a table
registered while the job runs, before its first insert."""

from __future__ import annotations

import subprocess

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


def test_a_window_below_the_need_refuses_the_start_unless_allowed(chjob: ChJob) -> None:
    """max_offsets_per_trigger 51: the need is 2 x 51 = 102 blocks (one per message,
    whatever max_rows), above the tables' window of 100: refused at start, naming
    table, window and need; allow_small_dedup_window starts with a warning."""
    sizing = ("--set", "job.max_offsets_per_trigger=51", "--set", "blocks.max_rows=1000")
    refused = _start(chjob, *sizing)
    said = refused.stdout + refused.stderr
    assert refused.returncode == 1, said[-5000:]
    assert "DedupWindowTooSmall" in said or "replicated_deduplication_window = 100" in said
    assert f"table {chjob.database}." in said and "below the 102 blocks" in said, said[-5000:]
    assert "job.max_offsets_per_trigger 51" in said and "at most 50" in said
    allowed = _start(chjob, *sizing, "--set", "clickhouse.allow_small_dedup_window=true")
    said = allowed.stdout + allowed.stderr
    assert allowed.returncode == 0, said[-5000:]
    assert "below the 102 blocks" in said


def test_a_table_registered_while_running_is_judged_before_its_first_insert(
        chjob: ChJob) -> None:
    """Issue 25, path 4: the job starts (max_offsets_per_trigger 50, need 100, the
    tables' window). A table created with replicated_deduplication_window = 20 and
    registered while it runs is met by a task when a message names it: the batch is
    refused (DedupWindowTooSmall, naming the table, the window and the need) before
    anything of it is inserted; the table stays empty."""
    from click.testing import CliRunner

    from blockagg.proto.cli import cli as ba_schema
    from blockagg.proto.envelope import make_envelope

    late = f"{chjob.database}.late"
    columns, message = TABLES["clicks"]
    for client in chjob.clients:
        client.execute(f"CREATE TABLE {late} ({columns}, {COORDINATES}) ENGINE = "
                       + replicated_engine(chjob.database, "late", "(_topic, _partition, _offset)")
                       + " SETTINGS replicated_deduplication_window = 20")
    running = chjob.popen()
    try:
        chjob.feed.good(30)
        running.wait_batches(1)
        env = chjob.stack_env
        res = CliRunner().invoke(ba_schema, [
            "--bootstrap-servers", chjob.bootstrap, "--topic", chjob.schema_topic,
            "--clickhouse", f"{env['BLOCKAGG_CH_HOST']}:{env['BLOCKAGG_CH_PORTS'].split(',')[0]}",
            "register", late, "--proto", str(chjob.tmp / "itjob.proto"), "--message", message])
        assert res.exit_code == 0, res.output
        value = make_envelope(late, [chjob.feed.row("clicks", 10**6)], version=1)
        chjob.feed.plain.produce(chjob.topic, value=value, partition=0)
        chjob.feed.flush(chjob.feed.plain)
        code = running.proc.wait(timeout=180)
    finally:
        if running.proc.poll() is None:
            running.proc.kill()
    running._reader.join(10)
    said = running.output
    assert code == 1, said[-6000:]
    assert (f"table {late}: replicated_deduplication_window = 20 is below the 100 blocks"
            in said), said[-6000:]
    for client in chjob.clients:
        assert client.execute(f"SELECT count() FROM {late}") == [(0,)]
