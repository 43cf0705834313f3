"""Live schema evolution under kill -9, on the real stack (issue 12, item 5).

The job (``blockagg/spark/job.py``, continuous, ``local[2]``) reads a three-table
stream from a 3-partition topic into two ClickHouse 18.16 replicas
(``ReplicatedMergeTree``, ``insert_quorum = 2``) while:

* v1 producers write ``orders``, ``clicks`` and ``metrics`` envelopes, some pinned
  (``schema_version = 1``), some not (``0`` = latest), plus deliberately bad messages
  (bytes that are no envelope, an unregistered table, an unknown pinned version);
* mid-stream, with the job running and its workers warm, and with v1 messages still
  unread in the topic, the documented evolution (``docs/schemas.md``, "Evolving a
  table while the job runs") is performed: ``ALTER TABLE ... ADD COLUMN`` with a
  ``DEFAULT`` on every replica, ``[schemas] refresh_interval`` (2 s here) allowed to
  pass, then ``ba-schema register`` of v2 (the row type with the new field) for
  ``orders`` and ``clicks``; ``metrics`` stays at v1;
* v2 producers write the new field (pinned to 2 or unpinned), while v1 producers keep
  writing (pinned to 1, and unpinned: v1 bytes that ``0`` now decodes with v2);
* the job's whole process group is killed with ``SIGKILL`` at seeded random moments
  (0-4 s after it took the lock: during its recovery and first batches; or 0-2.5 s
  after a batch) and started again each time.

Then, on **both** replicas, every row of every table is compared value by value with
what the producer's delivery reports acknowledged (id, Kafka coordinates, every
column, the new column included), every dead letter is checked to be stored exactly
once, and ``arv verify`` and ``arv audit`` must be clean.

The expected value of the new column is what the version the message resolves to
says (``docs/schemas.md``): a message pinned to 1, or unpinned and stamped before
v2's ``registered_at_ms``, decodes with v1, which has no such field, so the row gets
the column's ``DEFAULT``; a message that decodes with v2 gets its field's value, and
v1 bytes decoded with v2 (unpinned, stamped after the registration) the protobuf
default of the field (``""`` / ``0``), not the column's ``DEFAULT``. The test keeps
every unpinned message at least a second away from the registration, so the
comparison does not hinge on the millisecond.

``test_live_evolution_with_kills`` (5 kills) is in the default suite;
``test_live_evolution_with_20_kills`` is ``slow`` (its figures are in
docs/RELIABILITY.md).
"""

from __future__ import annotations

import os
import random
import re
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import replicated_engine
from tests.integration.test_job_clickhouse import JOB_PY, Running, batch_lines

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PARTITIONS = 3

PROTO_V1 = """
syntax = "proto3";
package evo.v1;

message Order { uint64 id = 1; string customer = 2; int64 amount = 3; }
message Click { uint64 id = 1; string url = 2; uint32 status = 3; }
message Metric { uint64 id = 1; string name = 2; double value = 3; }
"""

# v2 adds one field to Order and to Click (compatible: BACKWARD, the default mode).
PROTO_V2 = """
syntax = "proto3";
package evo.v1;

message Order { uint64 id = 1; string customer = 2; int64 amount = 3; string note = 4; }
message Click { uint64 id = 1; string url = 2; uint32 status = 3; int32 score = 4; }
message Metric { uint64 id = 1; string name = 2; double value = 3; }
"""

COORDINATES = "_topic String, _partition UInt32, _offset UInt64"
REFRESH_INTERVAL_S = 2.0  # [schemas] refresh_interval of the job (default 10 s)


@dataclass(frozen=True)
class Table:
    columns: str
    message: str
    values: Callable[[int], tuple[Any, ...]]  # the v1 columns' values of row ``i``
    added: tuple[str, str, Any, Callable[[int], Any], Any] | None = None
    # (column, its ClickHouse type and DEFAULT, the DEFAULT's value, the v2 field's value
    #  of row ``i``, the protobuf default of the field)


TABLES: dict[str, Table] = {
    "orders": Table("id UInt64, customer String, amount Int64", "evo.v1.Order",
                    lambda i: (f"c{i}", i * 3 - 500),
                    ("note", "String DEFAULT 'none'", "none", lambda i: f"n{i}", "")),
    "clicks": Table("id UInt64, url String, status UInt16", "evo.v1.Click",
                    lambda i: (f"/p/{i}", 200 + i % 300),
                    # every 5th v2 row sends 0: an explicit zero is not the DEFAULT
                    ("score", "Int32 DEFAULT -1", -1, lambda i: 0 if i % 5 == 0 else i % 97,
                     0)),
    "metrics": Table("id UInt64, name String, value Float64", "evo.v1.Metric",
                     lambda i: (f"m{i}", i * 0.5)),
}


@dataclass(frozen=True)
class Sent:
    """One acknowledged message with ids: how it was encoded and where it landed."""

    table: str
    ids: tuple[int, ...]
    writer: int           # 1: v1 bytes, 2: v2 bytes (the new field set)
    envelope_version: int  # schema_version in the envelope (0 = latest)
    partition: int
    offset: int
    timestamp_ms: int


@dataclass
class Producer:
    """The multi-table stream with ids unique over the test, recorded from delivery
    reports (only acknowledged messages count; the producer is idempotent)."""

    bootstrap: str
    topic: str
    database: str
    rng: random.Random
    sent: list[Sent] = field(default_factory=list)
    # (partition, offset) -> (table in the dead letter, error regex)
    dead: dict[tuple[int, int], tuple[str, str]] = field(default_factory=dict)
    next_id: int = 1
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        from confluent_kafka import Producer as KafkaProducer

        self.kafka = KafkaProducer({"bootstrap.servers": self.bootstrap,
                                    "enable.idempotence": True, "linger.ms": 5})
        self.classes: dict[int, dict[str, Any]] = {}

    def load(self, writer: int, proto: Path) -> None:
        from blockagg.proto.descriptors import compile_proto, load_descriptor, message_class

        fds = compile_proto(proto)
        self.classes[writer] = {t: message_class(load_descriptor(fds, spec.message))
                                for t, spec in TABLES.items()}

    def row(self, short: str, i: int, writer: int) -> bytes:
        msg = self.classes[writer][short](id=i)
        if short == "orders":
            msg.customer, msg.amount = TABLES[short].values(i)
        elif short == "clicks":
            msg.url, msg.status = TABLES[short].values(i)
        else:
            msg.name, msg.value = TABLES[short].values(i)
        added = TABLES[short].added
        if writer == 2 and added is not None:
            setattr(msg, added[0], added[3](i))
        data: bytes = msg.SerializeToString()
        return data

    def good(self, messages: int, writers: tuple[int, ...], versions: tuple[int, ...]) -> None:
        """``messages`` envelopes over the three tables and the partitions; each draws
        its writer (1 or 2; ``metrics`` has only v1) and envelope version from the
        given ones (a v1 writer never pins 2, a v2 writer never pins 1)."""
        from blockagg.proto.envelope import make_envelope

        for _ in range(messages):
            short = self.rng.choice(list(TABLES))
            writer = 1 if TABLES[short].added is None else self.rng.choice(writers)
            version = self.rng.choice([v for v in versions if v in (0, writer)])
            ids = tuple(range(self.next_id, self.next_id + 1 + self.rng.randrange(3)))
            self.next_id += len(ids)
            value = make_envelope(f"{self.database}.{short}",
                                  [self.row(short, i, writer) for i in ids], version=version)
            self.kafka.produce(self.topic, value=value,
                               partition=self.rng.randrange(PARTITIONS),
                               on_delivery=self._delivered(short, ids, writer, version))
            self.kafka.poll(0)
        self.flush()

    def _delivered(self, short: str, ids: tuple[int, ...], writer: int,
                   version: int) -> Callable[[Any, Any], None]:
        def done(err: Any, msg: Any) -> None:
            if err is not None:
                self.errors.append(str(err))
                return
            self.sent.append(Sent(short, ids, writer, version, msg.partition(), msg.offset(),
                                  msg.timestamp()[1]))
        return done

    def bad(self, value: bytes, table: str, reason: str) -> None:
        """A message that must be one dead letter naming ``table`` ("" when the value
        has none), its error matching ``reason``."""
        def done(err: Any, msg: Any) -> None:
            if err is not None:
                self.errors.append(str(err))
            else:
                self.dead[(msg.partition(), msg.offset())] = (table, reason)

        self.kafka.produce(self.topic, value=value, partition=self.rng.randrange(PARTITIONS),
                           on_delivery=done)
        self.flush()

    def bad_ones(self, label: str) -> None:
        """Three kinds of dead letter: no envelope, an unregistered table, an unknown
        pinned version of a registered table."""
        from blockagg.proto.envelope import make_envelope

        orders, nope = f"{self.database}.orders", f"{self.database}.nope"
        self.bad(b"\xff\xfe not an envelope " + label.encode(), "", r"envelope")
        self.bad(make_envelope(nope, [self.row("metrics", 10**9, 1)], version=1), nope,
                 r"not registered")
        self.bad(make_envelope(orders, [self.row("orders", 10**9, 1)], version=7), orders,
                 r"version 7")

    def flush(self) -> None:
        left = self.kafka.flush(30)
        assert left == 0 and not self.errors, f"produce failed: {self.errors[:3]}, {left} left"

    def rows(self) -> int:
        return sum(len(s.ids) for s in self.sent)


@dataclass
class Evolution:
    tmp: Path
    stack_env: dict[str, str]
    database: str
    topic: str
    group: str
    schema_topic: str
    clients: list[Any]
    producer: Producer
    config: Path
    env: dict[str, str]
    registered_at_ms: dict[str, int] = field(default_factory=dict)  # v2's, per table
    kills: list[tuple[str, float]] = field(default_factory=list)  # (moment, seconds)
    starts: int = 0

    @property
    def bootstrap(self) -> str:
        return self.stack_env["BLOCKAGG_BOOTSTRAP_SERVERS"]

    @property
    def clickhouse(self) -> str:
        env = self.stack_env
        return f"{env['BLOCKAGG_CH_HOST']}:{env['BLOCKAGG_CH_PORTS'].split(',')[0]}"

    def ba_schema(self, *args: str) -> str:
        from click.testing import CliRunner

        from blockagg.registration.cli import cli as ba_schema

        res = CliRunner().invoke(ba_schema, ["--bootstrap-servers", self.bootstrap,
                                             "--topic", self.schema_topic,
                                             "--clickhouse", self.clickhouse, *args])
        assert res.exit_code == 0, f"ba-schema {' '.join(args)}: exit {res.exit_code}\n" \
                                   f"{res.output}\n{res.exception!r}"
        return str(res.stdout)

    def start(self) -> Running:
        """The job without ``--until-caught-up``, in its own session (process group)."""
        import subprocess
        import sys

        jars = self.stack_env["BLOCKAGG_SPARK_JARS"]
        submit = (f"--master local[2] --jars {jars} --conf spark.ui.enabled=false "
                  "--conf spark.driver.host=127.0.0.1 --conf spark.driver.bindAddress=127.0.0.1 "
                  "--conf spark.sql.shuffle.partitions=2 pyspark-shell")
        proc = subprocess.Popen([sys.executable, str(JOB_PY), "--config", str(self.config)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**self.env, "PYSPARK_SUBMIT_ARGS": submit}, cwd=REPO,
                                start_new_session=True)
        self.starts += 1
        return Running(proc)

    def save(self, job: Running) -> None:
        (self.tmp / f"job-{self.starts - 1}.log").write_text(job.output)

    def kill_at_random(self, job: Running, rng: random.Random) -> Running:
        """Let the job run a random (seeded) while, kill -9 its process group, start it
        again. The moment: 0-4 s after the job took the lock (its recovery, the replay
        of an interrupted batch, its first batches), or 0-2.5 s after a batch."""
        started = time.monotonic()
        if rng.random() < 0.4:
            moment = "recovery"
            deadline = time.monotonic() + 180
            while not any(mark in job.output for mark in ("lock acquired", "recovery:",
                                                              "blockagg.job: batch ")):
                assert time.monotonic() < deadline, f"no lock after 180 s:\n{job.output}"
                job.check_alive("taking the lock")
                time.sleep(0.1)
            time.sleep(rng.uniform(0.0, 4.0))
        else:
            moment = "batches"
            seen = len(batch_lines(job.output))
            job.wait_batches(seen + 1, timeout=180)
            time.sleep(rng.uniform(0.0, 2.5))
        job.check_alive("its kill")
        job.kill()
        self.save(job)
        self.kills.append((moment, round(time.monotonic() - started, 1)))
        return self.start()

    # -- the documented evolution -------------------------------------------------

    def add_column_everywhere(self, short: str) -> None:
        """``ALTER TABLE ... ADD COLUMN`` on every replica where the column is missing
        (a ReplicatedMergeTree ALTER replicates through ZooKeeper, so the later ones find
        it there), then wait until every replica lists it."""
        added = TABLES[short].added
        assert added is not None
        column, ddl = added[0], added[1]
        table = f"{self.database}.{short}"

        def has(client: Any) -> bool:
            return bool(client.execute(
                "SELECT count() FROM system.columns WHERE database = %(d)s AND table = %(t)s "
                "AND name = %(c)s", {"d": self.database, "t": short, "c": column})[0][0])

        for client in self.clients:
            if not has(client):
                try:
                    client.execute(f"ALTER TABLE {table} ADD COLUMN {column} {ddl}")
                except Exception as exc:  # added meanwhile by the replicated ALTER
                    if "already exists" not in str(exc):
                        raise
        deadline = time.monotonic() + 60
        while not all(has(c) for c in self.clients):
            assert time.monotonic() < deadline, f"{table}.{column} not on every replica"
            time.sleep(0.2)

    def register_v2(self, short: str) -> None:
        """``ba-schema check`` (every version still fits the altered table), then
        ``ba-schema register`` of v2; records v2's ``registered_at_ms``."""
        import json

        self.ba_schema("check", f"{self.database}.{short}")
        self.ba_schema("register", f"{self.database}.{short}", "--proto",
                       str(self.tmp / "evo_v2.proto"), "--message", TABLES[short].message)
        shown = json.loads(self.ba_schema("--json", "show", f"{self.database}.{short}",
                                          "--version", "2"))
        self.registered_at_ms[short] = int(_find_key(shown, "registered_at_ms"))

    # -- the check ---------------------------------------------------------------

    def decodes_with(self, sent: Sent) -> int:
        """The version a message's rows decode with (docs/schemas.md)."""
        if sent.envelope_version:
            return sent.envelope_version
        at = self.registered_at_ms.get(sent.table)
        if at is None:
            return 1
        assert abs(sent.timestamp_ms - at) > 500, (
            f"an unpinned message stamped {sent.timestamp_ms} within 0.5 s of v2's "
            f"registration ({at}): the test must keep them apart")
        return 2 if sent.timestamp_ms >= at else 1

    def expected(self) -> dict[str, dict[int, tuple[Any, ...]]]:
        out: dict[str, dict[int, tuple[Any, ...]]] = {t: {} for t in TABLES}
        for sent in self.producer.sent:
            spec = TABLES[sent.table]
            reader = self.decodes_with(sent)
            for i in sent.ids:
                row: tuple[Any, ...] = (self.topic, sent.partition, sent.offset,
                                        *spec.values(i))
                if spec.added is not None:
                    _, _, default, value, proto_default = spec.added
                    if reader == 1:
                        row += (default,)
                    else:
                        row += (value(i) if sent.writer == 2 else proto_default,)
                out[sent.table][i] = row
        return out

    def stored_rows(self) -> int:
        return sum(int(self.clients[0].execute(
            f"SELECT count() FROM {self.database}.{t}")[0][0]) for t in TABLES)

    def stored_dead(self) -> int:
        return int(self.clients[0].execute(
            f"SELECT count() FROM {self.database}.dead_letters")[0][0])

    def wait_caught_up(self, job: Running, quiet_s: float = 30, timeout: float = 300) -> bool:
        """Until replica r1 holds every row and dead letter produced (True), or the job
        has stored nothing new and run no batch for ``quiet_s`` (False: it has read
        everything it will; rows it turned into unexpected dead letters never arrive,
        and the check then names them)."""
        want_rows, want_dead = self.producer.rows(), len(self.producer.dead)
        deadline = time.monotonic() + timeout
        last: tuple[int, int, int] | None = None
        quiet_since = time.monotonic()
        while time.monotonic() < deadline:
            rows, dead = self.stored_rows(), self.stored_dead()
            if rows >= want_rows and dead >= want_dead:
                return True
            now = (rows, dead, len(batch_lines(job.output)))
            if now != last:
                last, quiet_since = now, time.monotonic()
            elif time.monotonic() - quiet_since > quiet_s:
                return False
            job.check_alive(f"catching up ({rows}/{want_rows} rows, {dead}/{want_dead} "
                            "dead letters)")
            time.sleep(0.5)
        raise AssertionError(f"not caught up after {timeout}s: {last} (rows, dead letters, "
                             f"batches) of {want_rows} rows, {want_dead} dead letters\n"
                             f"{job.output[-6000:]}")

    def assert_exact(self) -> list[str]:
        """Row by row, value by value, on both replicas; dead letters once; arv."""
        problems: list[str] = []
        expected = self.expected()
        for client in self.clients:
            for short in [*TABLES, "dead_letters"]:
                client.execute(f"SYSTEM SYNC REPLICA {self.database}.{short}")
        for replica, client in enumerate(self.clients):
            where = f"r{replica + 1}"
            for short, spec in TABLES.items():
                table = f"{self.database}.{short}"
                names = [c.split()[0] for c in spec.columns.split(", ")][1:]
                if spec.added is not None:
                    names.append(spec.added[0])
                rows = client.execute(
                    f"SELECT id, _topic, _partition, _offset, {', '.join(names)} FROM {table}")
                want = expected[short]
                have: dict[int, list[tuple[Any, ...]]] = {}
                for r in rows:
                    have.setdefault(int(r[0]), []).append(tuple(r[1:]))
                twice = sorted(i for i, rs in have.items() if len(rs) > 1)
                missing = sorted(set(want) - set(have))
                extra = sorted(set(have) - set(want))
                wrong = sorted(i for i in set(want) & set(have) if have[i][0] != want[i])
                if twice or missing or extra or wrong:
                    problems.append(
                        f"{table}@{where}: {len(rows)} rows for {len(want)} ids; duplicated "
                        f"{len(twice)} {twice[:5]}, missing {len(missing)} {missing[:5]}, "
                        f"unexpected {len(extra)} {extra[:5]}, wrong values {len(wrong)} "
                        + "; ".join(f"id {i}: {have[i][0]} != {want[i]}" for i in wrong[:3]))
            dead = client.execute(
                f"SELECT topic, partition, offset, count(), any(table), any(error) "
                f"FROM {self.database}.dead_letters GROUP BY topic, partition, offset")
            stored = {(int(p), int(o)): (t, int(n), str(tb), str(err))
                      for t, p, o, n, tb, err in dead}
            want_dead = self.producer.dead
            if set(stored) != set(want_dead):
                missing_dead = sorted(set(want_dead) - set(stored))
                extra_dead = sorted(set(stored) - set(want_dead))
                problems.append(
                    f"dead letters@{where}: missing {len(missing_dead)} {missing_dead[:5]}, "
                    f"unexpected {len(extra_dead)} "
                    + "; ".join(f"{k}: {stored[k][2]} {stored[k][3][:160]!r}"
                                for k in extra_dead[:4]))
            for key, (table_name, reason) in want_dead.items():
                if key not in stored:
                    continue
                topic, n, table_stored, error = stored[key]
                if (topic, n, table_stored) != (self.topic, 1, table_name) or \
                        not re.search(reason, error):
                    problems.append(
                        f"dead letter {key}@{where}: stored {n} times, table "
                        f"{table_stored!r}, error {error[:160]!r} (expected once, "
                        f"{table_name!r}, matching {reason!r})")
        problems.extend(self.arv())
        return problems

    def arv(self) -> list[str]:
        from click.testing import CliRunner

        from blockagg.verifier.cli import cli

        runner = CliRunner()
        out = []
        verify = runner.invoke(cli, ["verify", "--bootstrap-servers", self.bootstrap,
                                     "--group", self.group, "--topic", self.topic])
        if verify.exit_code != 0:
            out.append(f"arv verify exit {verify.exit_code}: {verify.output[-3000:]}")
        audit = runner.invoke(cli, [
            "audit", "--bootstrap-servers", self.bootstrap, "--group", self.group,
            "--topic", self.topic, "--clickhouse", self.clickhouse,
            "--database", self.database, "--dead-letter-table",
            f"{self.database}.dead_letters"])
        if audit.exit_code != 0:
            out.append(f"arv audit exit {audit.exit_code}: {audit.output[-3000:]}")
        return out


def _find_key(obj: Any, key: str) -> Any:
    """The first value of ``key`` anywhere in a JSON document."""
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        items: list[Any] = list(obj.values())
    elif isinstance(obj, list):
        items = obj
    else:
        return None
    for item in items:
        found = _find_key(item, key)
        if found is not None:
            return found
    return None


def make_evolution(tmp: Path, stack_env: dict[str, str], topic: str, database: str,
                   clients: list[Any], seed: int) -> Evolution:
    """v1 tables on both replicas, v1 registered with ``ba-schema``, the job TOML."""
    from blockagg.rows.deadletters import dead_letter_ddl

    for client in clients:
        for short, spec in TABLES.items():
            client.execute(
                f"CREATE TABLE {database}.{short} ({spec.columns}, {COORDINATES}) ENGINE = "
                + replicated_engine(database, short, "(_topic, _partition, _offset)"))
        client.execute(dead_letter_ddl(f"{database}.dead_letters"))
    (tmp / "evo_v1.proto").write_text(PROTO_V1)
    (tmp / "evo_v2.proto").write_text(PROTO_V2)
    bootstrap = stack_env["BLOCKAGG_BOOTSTRAP_SERVERS"]
    group = f"it-evo-{uuid.uuid4().hex[:8]}"
    replicas = ", ".join(f'"{stack_env["BLOCKAGG_CH_HOST"]}:{p}"'
                         for p in stack_env["BLOCKAGG_CH_PORTS"].split(","))
    config = tmp / "blockagg.toml"
    schema_topic = f"_blockagg_schemas_evo_{uuid.uuid4().hex[:10]}"
    config.write_text(f"""
[job]
name = "it-evo"
metadata_group_id = "{group}"
checkpoint_location = "{tmp / 'checkpoint'}"
trigger_interval = "300ms"
max_offsets_per_trigger = 40
lock_timeout = "30s"
lock_session_timeout = "6s"
stop_timeout = "60s"

[[topics]]
name = "{topic}"
replicas = [{replicas}]

[blocks]
max_rows = 20

[clickhouse]
database = "{database}"
insert_quorum = 2

[kafka]
"bootstrap.servers" = "{bootstrap}"

[schemas]
topic = "{schema_topic}"
refresh_interval = "{REFRESH_INTERVAL_S:g}s"

[dead_letters]
table = "{database}.dead_letters"
max_rate = 1.0

[metrics]
port = 0
""")
    env = dict(os.environ)
    env.update({"PYTHONPATH": str(REPO), "BLOCKAGG_LOG_FORMAT": "text"})
    env.pop("BLOCKAGG_COMPONENTS", None)
    producer = Producer(bootstrap, topic, database, random.Random(seed))
    producer.load(1, tmp / "evo_v1.proto")
    producer.load(2, tmp / "evo_v2.proto")
    evo = Evolution(tmp, stack_env, database, topic, group, schema_topic, clients, producer,
                    config, env)
    for short, spec in TABLES.items():
        evo.ba_schema("register", f"{database}.{short}", "--proto", str(tmp / "evo_v1.proto"),
                      "--message", spec.message)
    return evo


def run_evolution(evo: Evolution, kills: int, seed: int, chunk: int = 60) -> str:
    """The scenario of the module docstring; returns its figures."""
    rng = random.Random(seed)
    producer = evo.producer
    started = time.monotonic()
    before = kills // 2
    producer.good(chunk, writers=(1,), versions=(0, 1))
    producer.bad_ones("v1")
    job = evo.start()
    try:
        # v1 only, killed `before` times
        for _ in range(before):
            producer.good(chunk, writers=(1,), versions=(0, 1))
            job = evo.kill_at_random(job, rng)
        # the job warm (its workers have decoded v1 rows) ...
        seen = len(batch_lines(job.output))
        producer.good(chunk, writers=(1,), versions=(0, 1))
        job.wait_batches(seen + 1, timeout=180)
        # ... and v1 messages unread in the topic (max_offsets_per_trigger = 40)
        producer.good(4 * chunk, writers=(1,), versions=(0, 1))
        time.sleep(1.0)  # unpinned v1 messages stay clear of the registration
        evolving = [short for short, spec in TABLES.items() if spec.added is not None]
        for short in evolving:
            evo.add_column_everywhere(short)
        # Every worker's copy of the columns read before the ALTER expires within
        # [schemas] refresh_interval: register only then (docs/schemas.md, step 2).
        time.sleep(REFRESH_INTERVAL_S + 0.5)
        for short in evolving:
            evo.register_v2(short)
        unread = producer.rows() - evo.stored_rows()  # v1 rows in flight at the switch
        time.sleep(1.0)
        # v2 producers (pinned and not), v1 producers still writing (pinned and not),
        # all read by the same, long-lived job (workers that knew the table before the
        # ALTER) before the next kill
        producer.good(chunk, writers=(1, 2), versions=(0, 1, 2))
        producer.bad_ones("v2")
        warm_stored_v2 = evo.wait_caught_up(job, quiet_s=30)
        for _ in range(kills - before):
            producer.good(chunk, writers=(1, 2), versions=(0, 1, 2))
            job = evo.kill_at_random(job, rng)
        producer.good(chunk, writers=(2,), versions=(0, 2))
        evo.wait_caught_up(job, quiet_s=90)
        code = job.terminate()
        evo.save(job)
        assert code == 0, job.output[-4000:]
    finally:
        job.kill()
        evo.save(job)
    problems = evo.assert_exact()
    moments = {m: sum(1 for k, _ in evo.kills if k == m) for m in ("recovery", "batches")}
    logs = "".join(p.read_text() for p in evo.tmp.glob("job-*.log"))
    replayed = sum(int(n) for n in re.findall(r"replayed_blocks=(\d+)", logs))
    figures = (f"{producer.rows()} rows in {len(producer.sent)} messages "
               f"({sum(1 for s in producer.sent if s.writer == 2)} v2), "
               f"{unread} v1 rows not yet stored when v2 was registered, the job running "
               f"at the switch stored all of v2's first messages: {warm_stored_v2}, "
               f"{len(producer.dead)} dead letters, {len(evo.kills)} kills "
               f"({moments['recovery']} after taking the lock, {moments['batches']} after "
               f"a batch), {evo.starts} job starts, {len(batch_lines(logs))} batches, "
               f"{replayed} blocks replayed, {time.monotonic() - started:.0f} s")
    assert not problems, figures + "\n" + "\n".join(problems)
    return figures


@pytest.fixture
def evolution(tmp_path: Path, stack_env: dict[str, str], new_topic: Callable[..., str],
              ch_database: str, ch_replicas: list[Any]) -> Iterator[Callable[[int], Evolution]]:
    def make(seed: int) -> Evolution:
        return make_evolution(tmp_path, stack_env, new_topic(partitions=PARTITIONS,
                                                             prefix="itevo"),
                              ch_database, ch_replicas, seed)
    yield make


def test_live_evolution_with_kills(evolution: Callable[[int], Evolution]) -> None:
    figures = run_evolution(evolution(5), kills=5, seed=5)
    print(f"\n{figures}")


@pytest.mark.slow
def test_live_evolution_with_20_kills(evolution: Callable[[int], Evolution]) -> None:
    figures = run_evolution(evolution(20), kills=20, seed=20)
    print(f"\n{figures}")
