"""The job end to end through ``spark/job.py`` on the real stack (Kafka source,
metadata store, offset log), with the deduplicating file sink of ``job_support``:
exactly-once across partitions and tables, transaction markers and aborted
transactions, restarts, a deleted checkpoint, a task failing once, SIGTERM, kill -9,
and a second job on the same group refused.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from blockagg.proto.envelope import make_envelope
from tests.integration.job_support import stored

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
JOB_PY = REPO / "blockagg" / "spark" / "job.py"
TABLES = {"db.a": 1, "db.b": 2}
DEAD = "blockagg.dead_letters"


@dataclass
class Expected:
    rows: dict[str, dict[tuple[str, int, int], Any]] = field(default_factory=dict)

    def add(self, table: str, key: tuple[str, int, int], content: Any) -> None:
        self.rows.setdefault(table, {})[key] = content


class Producer:
    """Produces envelopes (plain and transactional) and records what must arrive."""

    def __init__(self, bootstrap: str, topic: str, partitions: int) -> None:
        from confluent_kafka import Producer as KProducer

        self.topic = topic
        self.partitions = partitions
        self.expected = Expected()
        self.plain = KProducer({"bootstrap.servers": bootstrap, "enable.idempotence": True,
                                "linger.ms": 5})
        self.txn = KProducer({"bootstrap.servers": bootstrap,
                              "transactional.id": f"it-{uuid.uuid4().hex[:8]}"})
        self.txn.init_transactions(30)
        self.counter = 0

    def _send(self, producer: Any, partition: int, value: bytes,
              expect: tuple[str, Any] | None) -> None:
        def on_delivery(err: Any, msg: Any) -> None:
            assert err is None, err
            if expect is not None:
                self.expected.add(expect[0], (msg.topic(), msg.partition(), msg.offset()),
                                  expect[1])

        producer.produce(self.topic, value=value, partition=partition, on_delivery=on_delivery)

    def messages(self, n: int, dead_every: int = 0) -> None:
        for _ in range(n):
            i = self.counter
            self.counter += 1
            partition = i % self.partitions
            if dead_every and i % dead_every == 0:
                if i % (2 * dead_every) == 0:
                    self._send(self.plain, partition, b"\xff not an envelope", (DEAD, None))
                else:
                    self._send(self.plain, partition,
                               make_envelope("db.unknown", [b"x"]), (DEAD, None))
                continue
            table = "db.a" if i % 3 else "db.b"
            rows = [f"{i}-{k}".encode() for k in range(1 + i % 3)]
            self._send(self.plain, partition, make_envelope(table, rows),
                       (table, [r.decode() for r in rows]))
        assert self.plain.flush(30) == 0

    def transaction(self, n: int, commit: bool, partition: int = 0) -> None:
        self.txn.begin_transaction()
        for _ in range(n):
            i = self.counter
            self.counter += 1
            rows = [f"t{i}".encode()]
            self._send(self.txn, partition, make_envelope("db.a", rows),
                       ("db.a", ["t" + str(i)]) if commit else None)
        self.txn.flush(30)
        if commit:
            self.txn.commit_transaction(30)
        else:
            self.txn.abort_transaction(30)


@dataclass
class JobEnv:
    config: Path
    sink: Path
    checkpoint: Path
    group: str
    topic: str
    env: dict[str, str]
    stack_env: dict[str, str]

    def command(self, *extra: str, master: str = "local[2]") -> list[str]:
        return [
            "spark-submit", "--master", master,
            "--jars", self.stack_env["BLOCKAGG_SPARK_JARS"],
            "--conf", "spark.ui.enabled=false",
            "--conf", "spark.driver.host=127.0.0.1",
            "--conf", "spark.driver.bindAddress=127.0.0.1",
            str(JOB_PY), "--config", str(self.config), *extra,
        ]

    def run(self, *extra: str, master: str = "local[2]", timeout: float = 300,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        res = subprocess.run(self.command(*extra, master=master), capture_output=True,
                             text=True, timeout=timeout, env={**self.env, **(env or {})},
                             cwd=REPO, check=False)
        return res

    def popen(self, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        """The driver as a plain Python process (pyspark starts the JVM as its child),
        so signals reach the driver's handlers directly."""
        cmd = [sys.executable, str(JOB_PY), "--config", str(self.config),
               *extra]
        full_env = {**self.env, **(env or {}),
                    "PYSPARK_SUBMIT_ARGS": f"--master local[2] --jars "
                    f"{self.stack_env['BLOCKAGG_SPARK_JARS']} --conf spark.ui.enabled=false "
                    "--conf spark.driver.host=127.0.0.1 pyspark-shell"}
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=full_env, cwd=REPO, start_new_session=True)


@pytest.fixture
def job(tmp_path: Path, stack_env: dict[str, str], new_topic: Callable[..., str]) -> JobEnv:
    topic = new_topic(partitions=3, prefix="job")
    group = f"it-job-{uuid.uuid4().hex[:8]}"
    checkpoint = tmp_path / "checkpoint"
    sink = tmp_path / "sink.jsonl"
    config = tmp_path / "blockagg.toml"
    config.write_text(f"""
[job]
name = "it-job"
metadata_group_id = "{group}"
checkpoint_location = "{checkpoint}"
trigger_interval = "500ms"
max_offsets_per_trigger = 60
lock_timeout = "20s"

[[topics]]
name = "{topic}"
replicas = ["127.0.0.1:19000"]

[blocks]
max_rows = 7

[kafka]
"bootstrap.servers" = "{stack_env['BLOCKAGG_BOOTSTRAP_SERVERS']}"

[metrics]
port = 0
""")
    env = dict(os.environ)
    env.update({
        "BLOCKAGG_COMPONENTS": "tests.integration.job_support:from_env",
        "BLOCKAGG_TEST_SINK": str(sink),
        "BLOCKAGG_TEST_TABLES": ",".join(f"{k}={v}" for k, v in TABLES.items()),
        "PYTHONPATH": str(REPO),
        "BLOCKAGG_LOG_FORMAT": "text",
    })
    return JobEnv(config, sink, checkpoint, group, topic, env, stack_env)


@pytest.fixture
def producer(job: JobEnv) -> Iterator[Producer]:
    yield Producer(job.env.get("BLOCKAGG_BOOTSTRAP_SERVERS")
                   or job.stack_env["BLOCKAGG_BOOTSTRAP_SERVERS"], job.topic, 3)


def assert_exact(job: JobEnv, producer: Producer) -> None:
    got = stored(job.sink)
    expected = producer.expected.rows
    assert set(got.rows) == set(expected), (set(got.rows), set(expected))
    for table, rows in expected.items():
        have = got.rows[table]
        missing = set(rows) - set(have)
        extra = set(have) - set(rows)
        assert not missing and not extra, (table, sorted(missing)[:5], sorted(extra)[:5])
        if table != DEAD:
            for key, content in rows.items():
                assert have[key] == content, (table, key, have[key], content)


def ok(res: subprocess.CompletedProcess[str]) -> str:
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    return out


@pytest.mark.parametrize("handover", ["arrow", "rows"])
def test_multi_table_multi_partition_exact_with_markers_and_dead_letters(
        job: JobEnv, producer: Producer, handover: str) -> None:
    producer.messages(150, dead_every=11)
    producer.transaction(5, commit=True, partition=0)
    producer.transaction(4, commit=False, partition=1)  # only invisible records
    producer.transaction(3, commit=True, partition=2)
    out = ok(job.run("--until-caught-up", "--set", f"job.handover={handover}"))
    assert_exact(job, producer)
    assert "batch" in out
    assert len(stored(job.sink).rows[DEAD]) == 14


def test_restart_and_deleted_checkpoint_exact(job: JobEnv, producer: Producer) -> None:
    import shutil

    producer.messages(120)
    ok(job.run("--until-caught-up"))
    producer.messages(80)
    producer.transaction(2, commit=False, partition=1)
    ok(job.run("--until-caught-up"))  # restart on the same checkpoint
    assert_exact(job, producer)
    shutil.rmtree(job.checkpoint)
    producer.messages(90)
    out = ok(job.run("--until-caught-up"))  # start from the committed metadata
    assert "committed metadata" in out
    assert_exact(job, producer)


def test_task_failing_once_is_retried_exact(job: JobEnv, producer: Producer,
                                            tmp_path: Path) -> None:
    """Spark retries the failed task; the failure is one line where it ran ("task
    attempt failed", no trace) and the batch line names the partition that needed a
    retry."""
    marker = tmp_path / "failed-once"
    producer.messages(100)
    out = ok(job.run("--until-caught-up", master="local[2,4]",
                     env={"BLOCKAGG_TEST_FAIL_ONCE": str(marker)}))
    assert marker.exists()
    assert_exact(job, producer)
    failed = [line for line in out.splitlines() if "task attempt failed" in line]
    assert len(failed) == 1 and "attempt=1" in failed[0], out[-4000:]
    assert "retried={" in out and "attempt=2" not in failed[0], out[-4000:]
    assert "Traceback" not in out and "Lost task" not in out, out[-4000:]


def _wait_for(proc: subprocess.Popen[str], text: str, timeout: float = 120) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"{text!r} not seen; output:\n{''.join(lines)[-5000:]}")


def test_sigterm_graceful_kill9_safe_and_second_job_refused(
        job: JobEnv, producer: Producer) -> None:
    producer.messages(200)
    first = job.popen()
    try:
        _wait_for(first, "batch kind=")
        # A second job on the same group and topic is refused.
        second = job.run(timeout=180)
        assert second.returncode != 0
        assert "another job serves the same metadata group and topic" in (
            second.stdout + second.stderr), (second.stdout + second.stderr)[-3000:]
        # kill -9 mid-stream, then produce more, restart, SIGTERM.
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(30)
        producer.messages(100)
        third = job.popen()
        _wait_for(third, "batch kind=")
        time.sleep(3)
        os.kill(third.pid, signal.SIGTERM)
        rest, _ = third.communicate(timeout=120)
        assert third.returncode == 0, rest[-5000:]
        assert "stop requested" in rest
        ok(job.run("--until-caught-up"))
        assert_exact(job, producer)
    finally:
        for proc in (first,):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
