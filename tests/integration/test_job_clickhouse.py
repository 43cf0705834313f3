"""The job's delivery proofs on the real stack, end to end: ``spark/job.py`` under
``spark-submit`` (Spark's Kafka source, the Kafka metadata store, the offset log),
the real data path (``proto.envelope`` envelopes, the schema registry in a Kafka topic
written by ``ba-schema``, ``blockagg.rows.prepare`` and the block writer) into
two ClickHouse 18.16 replicas (``ReplicatedMergeTree`` on ZooKeeper, insert_quorum 2).

Each test produces rows with ids unique over the test, records from the producer's
delivery reports where each id landed (partition, offset), and checks, on **both**
replicas after ``SYSTEM SYNC REPLICA``:

* per table: ``count() == uniqExact(id) ==`` the number of ids produced, the set of
  ids equals the produced set, and every row holds its own Kafka coordinates
  (``_partition``, ``_offset``) and its values;
* dead letters: each bad message's ``(topic, partition, offset)`` exactly once, with
  its reason, and nothing else;
* ``arv verify`` over the metadata group exits 0 and ``arv audit`` (the tables carry
  ``_topic/_partition/_offset``) exits 0, both run in-process with click's CliRunner.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import replicated_engine

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
JOB_PY = REPO / "blockagg" / "spark" / "job.py"
PARTITIONS = 3

PROTO = """
syntax = "proto3";
package itjob.v1;

message Order {
  uint64 id = 1;
  string customer = 2;
  double amount = 3;
  int64 created = 4;
  repeated string items = 5;
}

message Click {
  uint64 id = 1;
  string url = 2;
  uint32 status = 3;
  bool bot = 4;
  int32 day = 5;
}

message Metric {
  enum Kind {
    KIND_UNSPECIFIED = 0;
    KIND_A = 1;
    KIND_B = 2;
  }
  uint64 id = 1;
  string name = 2;
  optional int64 value = 3;
  float ratio = 4;
  Kind kind = 5;
}
"""

COORDINATES = "_topic String, _partition UInt32, _offset UInt64"
TABLES: dict[str, tuple[str, str]] = {
    # short name -> (columns, message type); different column types on purpose
    "orders": ("id UInt64, customer String, amount Float64, created DateTime, "
               "items Array(String)", "itjob.v1.Order"),
    "clicks": ("id UInt64, url String, status UInt16, bot UInt8, day Date", "itjob.v1.Click"),
    "metrics": ("id UInt64, name String, value Nullable(Int64), ratio Float32, "
                "kind Enum8('KIND_UNSPECIFIED' = 0, 'KIND_A' = 1, 'KIND_B' = 2)",
                "itjob.v1.Metric"),
}
# Per table: the checked value columns, and the expected values of a row of id ``i``.
CHECKED: dict[str, tuple[str, Callable[[int], tuple[Any, ...]]]] = {
    "orders": ("customer, amount, toUnixTimestamp(created), items",
               lambda i: (f"c{i}", i * 0.25, 1_700_000_000 + i, [f"i{i}", "x"][: 1 + i % 2])),
    "clicks": ("url, status, bot, toUInt32(day)",
               lambda i: (f"/p/{i}", 200 + i % 300, int(i % 2 == 0), 19_000 + i % 100)),
    "metrics": ("name, value, ratio, toString(kind)",
                lambda i: (f"m{i}", None if i % 4 == 0 else i * 7, 0.5,
                           "KIND_A" if i % 2 else "KIND_B")),
}


# --------------------------------------------------------------------------- producing

@dataclass
class Produced:
    """Ground truth from delivery reports."""

    rows: dict[str, dict[int, tuple[int, int]]] = field(
        default_factory=lambda: {t: {} for t in TABLES})  # table -> id -> (partition, offset)
    # (partition, offset) -> (table, error regex)
    dead: dict[tuple[int, int], tuple[str, str]] = field(default_factory=dict)
    aborted: int = 0

    @property
    def total_rows(self) -> int:
        return sum(len(ids) for ids in self.rows.values())


class Feed:
    """Envelopes for the three tables (and deliberately bad messages), with ids
    unique over the test; plain (idempotent) and transactional producers."""

    def __init__(self, bootstrap: str, topic: str, database: str, proto_file: Path) -> None:
        from confluent_kafka import Producer

        from blockagg.logs import kafka_client_config
        from blockagg.proto.descriptors import compile_proto, load_descriptor, message_class

        self.topic = topic
        self.database = database
        fds = compile_proto(proto_file)
        self.cls: dict[str, Any] = {
            t: message_class(load_descriptor(fds, msg)) for t, (_, msg) in TABLES.items()}
        self.produced = Produced()
        self.next_id = 1
        self.counter = 0
        self.errors: list[str] = []
        # through the logging setup: a feed may outlive its broker (a private one)
        self.plain = Producer(kafka_client_config({
            "bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 5}))
        self.bootstrap = bootstrap
        self._txn: Any = None

    def table(self, short: str) -> str:
        return f"{self.database}.{short}"

    def row(self, short: str, i: int) -> bytes:
        msg = self.cls[short]()
        msg.id = i
        if short == "orders":
            msg.customer, msg.amount, msg.created = f"c{i}", i * 0.25, 1_700_000_000 + i
            msg.items.extend([f"i{i}", "x"][: 1 + i % 2])
        elif short == "clicks":
            msg.url, msg.status, msg.bot, msg.day = f"/p/{i}", 200 + i % 300, i % 2 == 0, \
                19_000 + i % 100
        else:
            msg.name, msg.ratio, msg.kind = f"m{i}", 0.5, 1 if i % 2 else 2
            if i % 4:
                msg.value = i * 7
        data: bytes = msg.SerializeToString()
        return data

    def _on_delivery(self, short: str | None, ids: list[int],
                     reason: tuple[str, str] | None, record: bool) -> Callable[[Any, Any], None]:
        def done(err: Any, msg: Any) -> None:
            if err is not None:
                self.errors.append(str(err))
                return
            if not record:
                return
            where = (msg.partition(), msg.offset())
            if short is None:
                assert reason is not None
                self.produced.dead[where] = reason
            else:
                for i in ids:
                    self.produced.rows[short][i] = where
        return done

    def _envelope(self) -> tuple[str, list[int], bytes]:
        from blockagg.proto.envelope import make_envelope

        short = list(TABLES)[self.counter % len(TABLES)]
        n = 1 + self.counter % 3
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        self.counter += 1
        return short, ids, make_envelope(self.table(short), [self.row(short, i) for i in ids],
                                         version=1)

    def good(self, messages: int) -> None:
        """``messages`` envelopes, round robin over tables and partitions."""
        for _ in range(messages):
            short, ids, value = self._envelope()
            self.plain.produce(self.topic, value=value, partition=self.counter % PARTITIONS,
                               on_delivery=self._on_delivery(short, ids, None, True))
            self.plain.poll(0)
        self.flush(self.plain)

    def bad(self, partition: int, value: bytes | None, table: str, reason: str) -> None:
        """A message that must become one dead letter naming ``table`` (the envelope's,
        "" when there is none) with an error matching the regex ``reason``."""
        self.plain.produce(self.topic, value=value, partition=partition,
                           on_delivery=self._on_delivery(None, [], (table, reason), True))
        self.flush(self.plain)

    def transaction(self, messages: int, commit: bool, partition: int | None = None) -> None:
        """One Kafka transaction (commit markers in the partitions); an aborted one's
        records are invisible to ``read_committed`` and must never arrive."""
        from confluent_kafka import Producer

        from blockagg.logs import kafka_client_config

        if self._txn is None:
            self._txn = Producer(kafka_client_config({
                "bootstrap.servers": self.bootstrap,
                "transactional.id": f"it-ch-{uuid.uuid4().hex[:8]}"}))
            self._txn.init_transactions(30)
        self._txn.begin_transaction()
        for k in range(messages):
            short, ids, value = self._envelope()
            p = partition if partition is not None else k % PARTITIONS
            self._txn.produce(self.topic, value=value, partition=p,
                              on_delivery=self._on_delivery(short, ids, None, commit))
        self.flush(self._txn)
        if commit:
            self._txn.commit_transaction(30)
        else:
            self._txn.abort_transaction(30)
            self.produced.aborted += messages

    def flush(self, producer: Any) -> None:
        left = producer.flush(30)
        assert left == 0 and not self.errors, f"produce failed: {self.errors[:3]}, {left} left"


# --------------------------------------------------------------------------- the job

@dataclass
class ChJob:
    """One test's names, its job configuration and its producer."""

    tmp: Path
    stack_env: dict[str, str]
    database: str
    topic: str
    group: str
    schema_topic: str
    clients: list[Any]
    feed: Feed
    config: Path
    checkpoint: Path
    env: dict[str, str]
    runs: list[tuple[float, str]] = field(default_factory=list)  # (seconds, output)

    @property
    def bootstrap(self) -> str:
        return self.stack_env["BLOCKAGG_BOOTSTRAP_SERVERS"]

    @property
    def dead_table(self) -> str:
        return f"{self.database}.dead_letters"

    def spark_args(self, master: str) -> list[str]:
        return ["--master", master, "--jars", self.stack_env["BLOCKAGG_SPARK_JARS"],
                "--conf", "spark.ui.enabled=false", "--conf", "spark.driver.host=127.0.0.1",
                "--conf", "spark.driver.bindAddress=127.0.0.1",
                "--conf", "spark.sql.shuffle.partitions=2"]

    def run(self, *extra: str, master: str = "local[2]", env: dict[str, str] | None = None,
            timeout: float = 240) -> str:
        """``spark-submit spark/job.py --until-caught-up``; fails on a non-zero exit."""
        cmd = ["spark-submit", *self.spark_args(master), str(JOB_PY),
               "--config", str(self.config), "--until-caught-up", *extra]
        started = time.monotonic()
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                 env={**self.env, **(env or {})}, cwd=REPO, check=False)
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (
                exc.stdout or "")
            raise AssertionError(f"the job did not catch up within {timeout}s:\n"
                                 f"{out[-6000:]}") from None
        out = res.stdout + res.stderr
        self.runs.append((time.monotonic() - started, out))
        log = self.tmp / f"job-{len(self.runs)}.log"
        log.write_text(out)
        assert res.returncode == 0, (
            f"the job exited {res.returncode} (whole output: {log}):\n{out[-8000:]}")
        return out

    def popen(self, *extra: str, env: dict[str, str] | None = None) -> Running:
        """The job without ``--until-caught-up`` as a plain Python process (pyspark
        starts the JVM as its child, so signals reach the driver's handlers), in its
        own session (so a test can kill the whole process group)."""
        cmd = [sys.executable, str(JOB_PY), "--config", str(self.config),
               *extra]
        full = {**self.env, **(env or {}),
                "PYSPARK_SUBMIT_ARGS": " ".join([*self.spark_args("local[2]"),
                                                 "pyspark-shell"])}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=full, cwd=REPO, start_new_session=True)
        return Running(proc)

    # -- reading ClickHouse -------------------------------------------------------

    def count(self, short: str, replica: int = 0) -> int:
        return int(self.clients[replica].execute(
            f"SELECT count() FROM {self.database}.{short}")[0][0])

    def stored_rows(self, replica: int = 0) -> int:
        return sum(self.count(t, replica) for t in TABLES)

    def sync(self) -> None:
        for client in self.clients:
            for short in [*TABLES, "dead_letters"]:
                client.execute(f"SYSTEM SYNC REPLICA {self.database}.{short}")

    def assert_exact(self) -> dict[str, int]:
        """The exactly-once proof (see the module docstring); returns figures."""
        produced = self.feed.produced
        self.sync()
        for replica, client in enumerate(self.clients):
            where = f"replica r{replica + 1}"
            for short, want in produced.rows.items():
                table = f"{self.database}.{short}"
                count, unique = client.execute(f"SELECT count(), uniqExact(id) FROM {table}")[0]
                assert (count, unique) == (len(want), len(want)), (
                    f"{table}@{where}: count() {count}, uniqExact(id) {unique}, produced "
                    f"{len(want)} distinct ids")
                columns, values = CHECKED[short]
                rows = client.execute(
                    f"SELECT id, _topic, _partition, _offset, {columns} FROM {table}")
                have = {int(r[0]): r[1:] for r in rows}
                missing, extra = set(want) - set(have), set(have) - set(want)
                assert not missing and not extra, (
                    f"{table}@{where}: missing ids {sorted(missing)[:10]}, unexpected ids "
                    f"{sorted(extra)[:10]}")
                for i, (p, o) in want.items():
                    expected = (self.topic, p, o, *values(i))
                    got = tuple(have[i])
                    assert got == expected, f"{table}@{where} id {i}: {got} != {expected}"
            dead = client.execute(
                f"SELECT topic, partition, offset, count(), any(table), any(error) "
                f"FROM {self.dead_table} GROUP BY topic, partition, offset")
            stored = {(int(p), int(o)): (t, int(n), str(tb), str(err))
                      for t, p, o, n, tb, err in dead}
            assert set(stored) == set(produced.dead), (
                f"dead letters@{where}: missing {sorted(set(produced.dead) - set(stored))}, "
                f"unexpected {sorted(set(stored) - set(produced.dead))}")
            for key, (table_name, reason) in produced.dead.items():
                topic, n, table_stored, error = stored[key]
                assert (topic, n, table_stored) == (self.topic, 1, table_name), (
                    f"dead letter {key}@{where}: stored {n} times, topic {topic}, table "
                    f"{table_stored!r} (expected once, {self.topic}, {table_name!r})")
                assert re.search(reason, error), (
                    f"dead letter {key}@{where}: error {error!r} does not match {reason!r}")
        self.assert_arv()
        return {"rows": produced.total_rows, "dead_letters": len(produced.dead)}

    def assert_arv(self) -> None:
        from click.testing import CliRunner

        from blockagg.verifier.cli import cli

        runner = CliRunner()
        verify = runner.invoke(cli, ["verify", "--bootstrap-servers", self.bootstrap,
                                     "--group", self.group, "--topic", self.topic])
        assert verify.exit_code == 0, (
            f"arv verify exit {verify.exit_code}:\n{verify.output[-4000:]}\n{verify.exception!r}")
        host, port = self.stack_env["BLOCKAGG_CH_HOST"], self.stack_env["BLOCKAGG_CH_PORTS"]
        audit = runner.invoke(cli, [
            "audit", "--bootstrap-servers", self.bootstrap, "--group", self.group,
            "--topic", self.topic, "--clickhouse", f"{host}:{port.split(',')[0]}",
            "--database", self.database, "--dead-letter-table", self.dead_table])
        assert audit.exit_code == 0, (
            f"arv audit exit {audit.exit_code}:\n{audit.output[-4000:]}\n{audit.exception!r}")

    def wait_rows(self, at_least: int, job: Running | None = None,
                  timeout: float = 150) -> int:
        """Poll until replica r1 holds ``at_least`` rows over the three tables."""
        deadline = time.monotonic() + timeout
        have = 0
        while time.monotonic() < deadline:
            have = self.stored_rows()
            if have >= at_least:
                return have
            if job is not None:
                job.check_alive(f"storing {at_least} rows ({have} so far)")
            time.sleep(0.3)
        raise AssertionError(f"only {have} of {at_least} rows stored after {timeout}s")

    def figures(self) -> str:
        total = sum(s for s, _ in self.runs)
        rows = self.feed.produced.total_rows
        return (f"{rows} rows, {len(self.feed.produced.dead)} dead letters, "
                f"{len(self.runs)} runs in {total:.1f}s ({rows / max(total, 1e-9):.0f} rows/s "
                "incl. Spark start)")


class Running:
    """A job process started by :meth:`ChJob.popen`; a thread collects its output, so
    waits poll conditions with deadlines instead of blocking on a read."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def check_alive(self, what: str) -> None:
        if self.proc.poll() is not None:
            self._reader.join(5)
            raise AssertionError(f"the job exited {self.proc.returncode} before {what}:\n"
                                 f"{self.output[-6000:]}")

    def wait_batches(self, n: int, timeout: float = 150) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(batch_lines(self.output)) >= n:
                return
            self.check_alive(f"{n} batches")
            time.sleep(0.2)
        raise AssertionError(f"fewer than {n} batches after {timeout}s:\n{self.output[-6000:]}")

    def wait_file(self, path: Path, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists() and path.read_text().strip():
                return path.read_text()
            self.check_alive(f"writing {path.name}")
            time.sleep(0.2)
        raise AssertionError(f"{path} not written within {timeout}s:\n{self.output[-6000:]}")

    def terminate(self, timeout: float = 120) -> int:
        """SIGTERM to the driver; its exit code once it stopped."""
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"no exit {timeout}s after SIGTERM:\n"
                                 f"{self.output[-6000:]}") from None
        self._reader.join(5)
        return code

    def kill(self) -> None:
        """kill -9 of the job's process group (driver and JVM)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self._reader.join(5)


def write_config(path: Path, job: dict[str, str], max_offsets: int, max_rows: int) -> None:
    replicas = ", ".join(f'"{job["host"]}:{p}"' for p in job["ports"].split(","))
    path.write_text(f"""
[job]
name = "it-ch"
metadata_group_id = "{job['group']}"
checkpoint_location = "{job['checkpoint']}"
trigger_interval = "300ms"
max_offsets_per_trigger = {max_offsets}
lock_timeout = "40s"
stop_timeout = "60s"

[[topics]]
name = "{job['topic']}"
replicas = [{replicas}]

[blocks]
max_rows = {max_rows}

[clickhouse]
database = "{job['database']}"
insert_quorum = 2

[kafka]
"bootstrap.servers" = "{job['bootstrap']}"

[schemas]
topic = "{job['schema_topic']}"

[dead_letters]
table = "{job['database']}.dead_letters"

[metrics]
port = 0
""")


def make_job(tmp: Path, stack_env: dict[str, str], topic: str, database: str,
             clients: list[Any], max_offsets: int = 60, max_rows: int = 25) -> ChJob:
    """Tables on both replicas, schemas registered with ``ba-schema``, the job TOML."""
    from click.testing import CliRunner

    from blockagg.registration.cli import cli as ba_schema
    from blockagg.rows.deadletters import dead_letter_ddl

    for client in clients:
        for short, (columns, _) in TABLES.items():
            client.execute(
                f"CREATE TABLE {database}.{short} ({columns}, {COORDINATES}) ENGINE = "
                + replicated_engine(database, short, "(_topic, _partition, _offset)"))
        client.execute(dead_letter_ddl(f"{database}.dead_letters"))
    proto_file = tmp / "itjob.proto"
    proto_file.write_text(PROTO)
    bootstrap = stack_env["BLOCKAGG_BOOTSTRAP_SERVERS"]
    schema_topic = f"_blockagg_schemas_it_{uuid.uuid4().hex[:10]}"
    ch = f"{stack_env['BLOCKAGG_CH_HOST']}:{stack_env['BLOCKAGG_CH_PORTS'].split(',')[0]}"
    for short, (_, message) in TABLES.items():
        res = CliRunner().invoke(ba_schema, [
            "--bootstrap-servers", bootstrap, "--topic", schema_topic, "--clickhouse", ch,
            "register", f"{database}.{short}", "--proto", str(proto_file),
            "--message", message])
        assert res.exit_code == 0, f"ba-schema register {short}: {res.output}"
    group = f"it-ch-{uuid.uuid4().hex[:8]}"
    checkpoint = tmp / "checkpoint"
    config = tmp / "blockagg.toml"
    write_config(config, {"group": group, "checkpoint": str(checkpoint), "topic": topic,
                          "host": stack_env["BLOCKAGG_CH_HOST"],
                          "ports": stack_env["BLOCKAGG_CH_PORTS"], "database": database,
                          "bootstrap": bootstrap, "schema_topic": schema_topic},
                 max_offsets, max_rows)
    env = dict(os.environ)
    # SPARK_LOCAL_IP: what Spark's start-up warning about a loopback hostname asks for
    env.update({"PYTHONPATH": str(REPO), "BLOCKAGG_LOG_FORMAT": "text",
                "SPARK_LOCAL_IP": "127.0.0.1"})
    env.pop("BLOCKAGG_COMPONENTS", None)
    feed = Feed(bootstrap, topic, database, proto_file)
    return ChJob(tmp, stack_env, database, topic, group, schema_topic, clients, feed, config,
                 checkpoint, env)


@pytest.fixture
def chjob(tmp_path: Path, stack_env: dict[str, str], new_topic: Callable[..., str],
          ch_database: str, ch_replicas: list[Any]) -> Iterator[ChJob]:
    job = make_job(tmp_path, stack_env, new_topic(partitions=PARTITIONS, prefix="itch"),
                   ch_database, ch_replicas)
    yield job
    print(f"\n{job.figures()}")


def _pid_gone(pid: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def batch_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if "blockagg.job: batch " in line]


# --------------------------------------------------------------------------- tests

def test_three_tables_three_partitions_with_transactions_and_an_abort_are_exact(
        chjob: ChJob) -> None:
    # A registered table of another shard (the registry is shared; it does not exist on
    # this one) is skipped at startup; it does not block the job. (A registered table
    # that exists here and would not drop a retried block refuses the start:
    # tests/integration/test_startup_refusals.py.)
    from click.testing import CliRunner

    from blockagg.registration.cli import cli as ba_schema

    unrelated = f"{chjob.database}.unrelated"
    env = chjob.stack_env
    ch = f"{env['BLOCKAGG_CH_HOST']}:{env['BLOCKAGG_CH_PORTS'].split(',')[0]}"
    res = CliRunner().invoke(ba_schema, [
        "--bootstrap-servers", chjob.bootstrap, "--topic", chjob.schema_topic,
        "--clickhouse", ch, "register", unrelated, "--proto", str(chjob.tmp / "itjob.proto"),
        "--message", TABLES["clicks"][1], "--no-check"])
    assert res.exit_code == 0, res.output
    feed = chjob.feed
    feed.good(60)
    feed.transaction(12, commit=True)                 # markers in every partition
    feed.transaction(9, commit=False)                 # aborted: never visible
    feed.transaction(5, commit=False, partition=1)    # a range of only invisible records
    feed.good(30)
    feed.transaction(9, commit=True, partition=2)
    out = chjob.run()
    figures = chjob.assert_exact()
    assert figures["rows"] > 200 and feed.produced.aborted == 14
    assert all(chjob.count(t) > 0 for t in TABLES)
    assert len(batch_lines(out)) >= 2, out[-4000:]
    assert unrelated not in out, out[-4000:]


NOISE = re.compile(
    r"^\S+ (WARNING|ERROR|CRITICAL) "      # blockagg's text lines
    r"|^\d\d/\d\d/\d\d \S+ (WARN|ERROR|FATAL) "  # Spark's log4j lines
    r"|^%[0-4]\|"                            # librdkafka lines that bypassed the logger
    r"|^Traceback |^\s+at |\[Stage \d+:")     # traces, Java frames, progress bars


JVM_START = ("WARN NativeCodeLoader: Unable to load native-hadoop library",)
"""What the JVM prints before the job's Python code runs, out of its reach: silenced by
the cluster's log4j2.properties (docs/running.md, *Logs*), not by blockagg."""


def noise(out: str) -> list[str]:
    """The lines of a job's log that a healthy run must not print: warnings and errors
    from blockagg, Spark or librdkafka, traces and console progress bars."""
    return [line for line in out.splitlines()
            if NOISE.search(line) and not any(text in line for text in JVM_START)]


def test_restart_mid_stream_on_the_same_checkpoint_is_exact_and_quiet(chjob: ChJob) -> None:
    """A healthy run of 20+ batches (two ClickHouse replicas, insert_quorum 2, three
    partitions writing the same tables) with a SIGTERM restart on the same checkpoint:
    exact, and its log holds no warning, error or trace (issue 26, item 2)."""
    feed = chjob.feed
    feed.good(300)
    first = chjob.popen("--max-offsets-per-trigger", "16")
    try:
        first.wait_batches(10)
        code = first.terminate()
    finally:
        first.kill()
    assert code == 0, first.output[-6000:]
    assert "stop requested" in first.output
    stored = chjob.stored_rows()
    assert 0 < stored < feed.produced.total_rows, (
        f"not stopped mid-stream: {stored} of {feed.produced.total_rows} rows stored")
    feed.good(60)
    feed.transaction(9, commit=True)
    feed.transaction(6, commit=False)
    out = chjob.run("--max-offsets-per-trigger", "16")
    assert 'start="checkpoint"' in out, out[-4000:]
    chjob.assert_exact()
    batches = len(batch_lines(first.output)) + len(batch_lines(out))
    assert batches >= 20, f"{batches} batches"
    loud = noise(first.output) + noise(out)
    assert not loud, "\n".join(loud[:40])


def test_lost_checkpoint_after_kill9_mid_batch_and_between_runs_is_exact(chjob: ChJob) -> None:
    feed = chjob.feed
    pause = chjob.tmp / "pause"
    pause.mkdir()
    feed.good(300)
    first = chjob.popen("--max-offsets-per-trigger", "30", env={
        "BLOCKAGG_COMPONENTS": "tests.integration.job_support:pause_from_env",
        "BLOCKAGG_TEST_PAUSE_DIR": str(pause)})
    worker = 0
    try:
        chjob.wait_rows(1, first)
        (pause / "armed").touch()
        worker = int(first.wait_file(pause / "paused").split()[0])
        # The batch's metadata (its blocks) is committed, one block is not inserted.
        first.kill()
    finally:
        first.kill()
        if worker and not _pid_gone(worker, 5):
            os.kill(worker, signal.SIGKILL)  # the paused Python worker, if it outlived its JVM
    assert not worker or _pid_gone(worker), f"Python worker {worker} still alive"
    assert 0 < chjob.stored_rows() < feed.produced.total_rows
    shutil.rmtree(chjob.checkpoint)
    out = chjob.run()
    assert 'start="committed metadata"' in out, out[-4000:]
    assert "recovery: completing the blocks of an interrupted batch" in out, out[-4000:]
    chjob.assert_exact()

    feed.good(60)
    feed.transaction(6, commit=True)
    feed.transaction(3, commit=False)
    shutil.rmtree(chjob.checkpoint)
    out = chjob.run()
    assert 'start="committed metadata"' in out, out[-4000:]
    chjob.assert_exact()


def test_a_task_failing_once_after_its_insert_is_retried_by_spark_and_exact(
        chjob: ChJob) -> None:
    from tests.faults import hooks

    fault = chjob.tmp / "fault"
    hooks.arm(fault, "after_insert")  # the block is in, the task fails before going on
    feed = chjob.feed
    feed.good(150)
    feed.transaction(6, commit=True)
    out = chjob.run(master="local[2,4]", env={
        "BLOCKAGG_COMPONENTS": "tests.faults.hooks:from_env",
        "BLOCKAGG_FAULT_DIR": str(fault)})
    assert hooks.fired(fault) == 1
    assert "injected fault #0 at step after_insert" in out, out[-6000:]
    replayed = sum(int(n) for n in re.findall(r"replayed_blocks=(\d+)", out))
    assert replayed >= 1, "the retried task did not replay the announced blocks"
    chjob.assert_exact()


def test_tasks_sharing_executor_insert_permits_stay_exact_through_a_retried_task(
        chjob: ChJob) -> None:
    """``executor_insert_concurrency``: three task slots of four lanes share two
    permits (lock files the Python workers take), and a task that fails after an
    insert is retried by Spark; its worker's permits are released, the retry replays,
    and every row lands once."""
    from tests.faults import hooks

    text = chjob.config.read_text()
    chjob.config.write_text(text.replace(
        "[clickhouse]\n", "[clickhouse]\ninsert_concurrency = 4\n"
        "executor_insert_concurrency = 2\n", 1))
    fault = chjob.tmp / "fault"
    hooks.arm(fault, "after_insert")
    feed = chjob.feed
    feed.good(150)
    out = chjob.run(master="local[3,4]", env={
        "BLOCKAGG_COMPONENTS": "tests.faults.hooks:from_env",
        "BLOCKAGG_FAULT_DIR": str(fault)})
    assert hooks.fired(fault) == 1
    assert len(batch_lines(out)) >= 2, out[-4000:]
    chjob.assert_exact()


def test_bad_messages_are_dead_letters_once_with_their_reason_and_the_rest_exact(
        chjob: ChJob) -> None:
    from blockagg.proto.envelope import make_envelope

    feed = chjob.feed
    orders, clicks = feed.table("orders"), feed.table("clicks")
    feed.good(30)
    nope = f"{chjob.database}.nope"
    feed.good(30)
    # garbage value
    feed.bad(0, b"\xff\xfe garbage, not an envelope", "", r"^envelope does not decode")
    # unknown table
    feed.bad(1, make_envelope(nope, [feed.row("orders", 10**9)], version=1), nope,
             rf"^table {nope} is not registered; register it with ba-schema")
    # a row that doesn't decode; and one bad row among good ones (the whole message)
    feed.bad(2, make_envelope(orders, [b"\xff\xff\xff\xff"], version=1), orders,
             rf"^{orders} v1: row 0: .*invalid wire type")
    feed.bad(1, make_envelope(orders, [feed.row("orders", 10**9 + 2), b"\xff\xff"],
                              version=1), orders, rf"^{orders} v1: row 1: ")
    # a value that doesn't convert (UInt16)
    click = feed.cls["clicks"](id=10**9 + 1, url="/too-big", status=70_000)
    feed.bad(0, make_envelope(clicks, [click.SerializeToString()], version=1), clicks,
             rf"^{clicks} v1: row 0: column status: status=70000 is out of range for UInt16")
    # an unknown schema version, a tombstone
    feed.bad(2, make_envelope(orders, [feed.row("orders", 10**9 + 3)], version=7), orders,
             rf"^table {orders} has no schema version 7 in the schema registry; register it")
    feed.bad(0, None, "", r"^message has no value \(null or tombstone\)")
    feed.good(30)
    # 7 of 67 messages: the driver's rate window (dead_letters.min_messages = 100 by
    # default) does not judge so few, so a strict max_rate does not stop the job.
    out = chjob.run("--set", "dead_letters.max_rate=0.05")
    chjob.assert_exact()
    assert "dead-letter rate exceeded" not in out
    assert sum(int(n) for n in re.findall(r"dead_letters=(\d+)", out)) == 7
