"""A user's job, for the operator tests (``test_startup_refusals.py``, ``test_stops.py``,
``test_docs_examples.py``): a user's own database, table, schema topic, topic and TOML,
the job run with ``spark-submit`` as a user runs it, and the checks that a refused
start wrote nothing.

A job's output is checked for one thing above all: a failure ends in **one** line of
the ``blockagg`` loggers at ERROR that names the thing, and no stack trace (Python,
Java, or the ClickHouse server's) unless the log level is DEBUG.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.integration.conftest import replicated_engine
from tests.integration.test_job_clickhouse import Running as ChRunning

REPO = Path(__file__).resolve().parents[2]
JOB_PY = REPO / "blockagg" / "spark" / "job.py"

PROTO = """
syntax = "proto3";
package firstday.v1;

message Order {
  uint64 id = 1;
  string customer = 2;
}

message Plain {
  uint64 id = 1;
}
"""

def fenced_blocks(markdown: Path, language: str) -> list[str]:
    """The fenced code blocks of ``markdown`` in ``language``, in order (indented
    blocks inside list items included, their indentation removed)."""
    blocks = []
    pattern = rf"^([ \t]*)```{language}\n(.*?)^\1```"
    for match in re.finditer(pattern, markdown.read_text(), re.M | re.S):
        indent = len(match.group(1))
        blocks.append("".join(line[indent:] + "\n"
                              for line in match.group(2).splitlines()))
    return blocks


def shell_commands(block: str) -> list[str]:
    """A sh block's commands (continuation lines joined, comments dropped)."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.split(" #")[0].strip() for line in joined.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def words(command: str) -> list[str]:
    return shlex.split(command)


TRACE_MARKERS = ("Traceback (most recent call last)", "\tat ", "Stack trace:",
                 "NullPointerException", "FOREACH_BATCH_USER_FUNCTION_ERROR",
                 "Py4JJavaError")


def error_lines(out: str) -> list[str]:
    """The job's own ERROR lines (``--log-format text``)."""
    return [line for line in out.splitlines()
            if re.match(r"\d\d:\d\d:\d\d ERROR\s+blockagg", line)]


def assert_no_trace(out: str) -> None:
    found = [m for m in TRACE_MARKERS if m in out]
    assert not found, f"stack trace markers {found} in the output:\n{out[-6000:]}"


def the_error(out: str) -> str:
    """The one ERROR line of a refused or failed run (asserts there is exactly one and
    no trace)."""
    lines = error_lines(out)
    assert len(lines) == 1, f"expected one ERROR line, got {len(lines)}:\n{out[-6000:]}"
    assert_no_trace(out)
    return lines[0]


@dataclass
class Run:
    code: int
    out: str
    seconds: float


@dataclass
class Job:
    """A user's setup on the real stack: database ``database`` with ``orders``
    (``ReplicatedMergeTree``) and ``dead_letters`` on both replicas, ``Order``
    registered with ``ba-schema`` in its own schema topic, a topic, a TOML."""

    tmp: Path
    stack_env: dict[str, str]
    database: str
    topic: str
    clients: list[Any]
    group: str = field(default_factory=lambda: f"fd-{uuid.uuid4().hex[:8]}")
    schema_topic: str = field(default_factory=lambda: f"_fd_schemas_{uuid.uuid4().hex[:8]}")
    produced_ids: list[int] = field(default_factory=list)

    @property
    def bootstrap(self) -> str:
        return self.stack_env["BLOCKAGG_BOOTSTRAP_SERVERS"]

    @property
    def replicas(self) -> list[str]:
        host = self.stack_env["BLOCKAGG_CH_HOST"]
        return [f"{host}:{p}" for p in self.stack_env["BLOCKAGG_CH_PORTS"].split(",")]

    @property
    def proto_file(self) -> Path:
        path = self.tmp / "firstday.proto"
        if not path.exists():
            path.write_text(PROTO)
        return path

    def create_tables(self) -> None:
        from blockagg.rows.deadletters import dead_letter_ddl

        for client in self.clients:
            client.execute(
                f"CREATE TABLE {self.database}.orders (id UInt64, customer String, "
                "_topic String, _partition UInt32, _offset UInt64) ENGINE = "
                + replicated_engine(self.database, "orders", "(_topic, _partition, _offset)"))
            client.execute(dead_letter_ddl(f"{self.database}.dead_letters"))
        self.register("orders", "firstday.v1.Order")

    def register(self, table: str, message: str, *flags: str, code: int = 0) -> Any:
        """``ba-schema register``; asserts its exit code, returns click's result."""
        from click.testing import CliRunner

        from blockagg.registration.cli import cli as ba_schema

        res = CliRunner().invoke(ba_schema, [
            "--bootstrap-servers", self.bootstrap, "--topic", self.schema_topic,
            "--clickhouse", self.replicas[0], "register", f"{self.database}.{table}",
            "--proto", str(self.proto_file), "--message", message, *flags])
        assert res.exit_code == code, f"ba-schema register {table}: {res.output}"
        return res

    def config(self, name: str = "blockagg.toml", *, bootstrap: str | None = None,
               topic: str | None = None, replicas: list[str] | None = None,
               clickhouse: str = "", dead_letters: str | None = None,
               job: str = "", checkpoint: str = "checkpoint",
               lock_timeout: str = "40s") -> Path:
        shown = ", ".join(f'"{r}"' for r in (replicas or self.replicas))
        path = self.tmp / name
        path.write_text(f"""
[job]
name = "first-day"
metadata_group_id = "{self.group}"
checkpoint_location = "{self.tmp / checkpoint}"
trigger_interval = "500ms"
lock_timeout = "{lock_timeout}"
stop_timeout = "60s"
{job}

[[topics]]
name = "{topic or self.topic}"
replicas = [{shown}]

[clickhouse]
database = "{self.database}"
{clickhouse}

[kafka]
"bootstrap.servers" = "{bootstrap or self.bootstrap}"

[schemas]
topic = "{self.schema_topic}"

[dead_letters]
table = "{dead_letters or f'{self.database}.dead_letters'}"

[metrics]
port = 0
""")
        return path

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.stack_env)
        env.update({"PYTHONPATH": str(REPO), "BLOCKAGG_LOG_FORMAT": "text"})
        env.pop("BLOCKAGG_COMPONENTS", None)
        env.pop("BLOCKAGG_LOG_LEVEL", None)
        return env

    def command(self, config: Path, *flags: str, jars: bool = True,
                spark: Sequence[str] = ()) -> list[str]:
        """``spark-submit`` as the README gives it; ``jars=False`` leaves ``--jars``
        out, ``spark`` adds spark-submit options."""
        return ["spark-submit", "--master", "local[2]",
                *(["--jars", self.stack_env["BLOCKAGG_SPARK_JARS"]] if jars else []),
                *spark,
                "--conf", "spark.ui.enabled=false",
                "--conf", "spark.driver.host=127.0.0.1",
                "--conf", "spark.driver.bindAddress=127.0.0.1",
                "--conf", "spark.sql.shuffle.partitions=2",
                str(JOB_PY), "--config", str(config), *flags]

    def run(self, config: Path, *flags: str, timeout: float = 300, jars: bool = True,
            spark: Sequence[str] = ()) -> Run:
        started = time.monotonic()
        res = subprocess.run(self.command(config, *flags, jars=jars, spark=spark),
                             capture_output=True, text=True,
                             env=self.env(), cwd=REPO, timeout=timeout, check=False)
        return Run(res.returncode, res.stdout + res.stderr, time.monotonic() - started)

    def start(self, config: Path, *flags: str) -> Running:
        """``spark-submit`` in its own session, as in a terminal: the JVM leads the
        process group that Ctrl-C signals."""
        proc = subprocess.Popen(self.command(config, *flags), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=self.env(),
                                cwd=REPO, start_new_session=True)
        return Running(proc)

    # -- data ---------------------------------------------------------------------

    def produce(self, count: int, table: str = "orders", message: str = "Order") -> None:
        """``count`` envelopes of one row each, ids unique over the test."""
        from confluent_kafka import Producer

        from blockagg.proto.blockagg.v1.envelope_pb2 import Envelope
        from blockagg.proto.descriptors import compile_proto, load_descriptor, message_class

        cls = message_class(load_descriptor(compile_proto(self.proto_file),
                                            f"firstday.v1.{message}"))
        producer = Producer({"bootstrap.servers": self.bootstrap, "enable.idempotence": True})
        first = len(self.produced_ids) + 1
        for i in range(first, first + count):
            fields: dict[str, Any] = {"id": i}
            if message == "Order":
                fields["customer"] = f"c{i % 7}"
            row = cls(**fields).SerializeToString()
            envelope = Envelope(table=f"{self.database}.{table}", schema_version=1, rows=[row])
            producer.produce(self.topic, value=envelope.SerializeToString())
            self.produced_ids.append(i)
        assert producer.flush(30) == 0

    def committed(self) -> dict[int, int]:
        """The group's committed offsets of the topic (partition -> offset), only those
        that exist."""
        from confluent_kafka import Consumer, TopicPartition

        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": self.group,
                             "enable.auto.commit": False})
        try:
            md = consumer.list_topics(self.topic, timeout=10).topics[self.topic]
            parts = [TopicPartition(self.topic, p) for p in md.partitions]
            return {tp.partition: tp.offset for tp in consumer.committed(parts, timeout=10)
                    if tp.offset >= 0}
        finally:
            consumer.close()

    def rows(self, table: str = "orders", replica: int = 0) -> int:
        return int(self.clients[replica].execute(
            f"SELECT count() FROM {self.database}.{table}")[0][0])

    def assert_nothing_written(self) -> None:
        assert self.committed() == {}, "a refused start committed metadata"
        for replica in range(len(self.clients)):
            assert self.rows(replica=replica) == 0
            assert self.rows("dead_letters", replica) == 0

    def assert_exactly_once(self) -> None:
        for client in self.clients:
            client.execute(f"SYSTEM SYNC REPLICA {self.database}.orders")
        for client in self.clients:
            count, unique = client.execute(
                f"SELECT count(), uniqExact(id) FROM {self.database}.orders")[0]
            assert (count, unique) == (len(self.produced_ids), len(self.produced_ids))


class Running(ChRunning):
    """A job started with :meth:`Job.start` (``spark-submit``, in its own session); its
    output collected by the base class's thread. Adds what an operator does to it:
    signals to the JVM, Ctrl-C to the process group."""

    def wait_for(self, predicate: Callable[[str], bool], what: str,
                 timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self.output):
                return
            if self.proc.poll() is not None:
                self._reader.join(5)
                if predicate(self.output):
                    return
                raise AssertionError(f"the job exited {self.proc.returncode} before "
                                     f"{what}:\n{self.output[-6000:]}")
            time.sleep(0.2)
        raise AssertionError(f"no {what} within {timeout}s:\n{self.output[-6000:]}")

    def batches(self) -> int:
        return len(re.findall(r"blockagg\.job: batch ", self.output))

    def signal_jvm(self, sig: signal.Signals) -> None:
        """``kill -SIG <spark-submit pid>`` (spark-submit execs the JVM)."""
        os.kill(self.proc.pid, sig)

    def ctrl_c(self) -> None:
        """What a terminal does on Ctrl-C: SIGINT to the foreground process group."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def wait(self, timeout: float = 180) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError(f"no exit within {timeout}s:\n{self.output[-6000:]}") from None
        self._reader.join(5)
        return code
