"""The operator's first day, against the real services: each failure path
of ``spark-submit blockagg/spark/job.py``, ``ba-schema`` and ``arv`` ends in one line
naming the thing and the fix, with the documented exit code, no stack trace, and
nothing written (no commit in the metadata group, no row, no dead letter).

Refusals that come from the start-up checks happen before Spark starts: the output
has no ``SparkContext`` line, which is what bounds their time (the checks are single
requests of at most 6 s for Kafka and 5 s for ClickHouse; Spark's session alone took
25-41 s before it refused connector jars, the metrics port, tables that can't
deduplicate and speculation). The elapsed seconds are printed, not asserted: a loaded
machine stretches them (17 s was seen at load average 15), the order does not change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tests.integration.user_job import Job, Run, assert_no_trace, the_error

pytestmark = pytest.mark.integration

@pytest.fixture
def job(tmp_path: Path, stack_env: dict[str, str], new_topic: Callable[..., str],
        ch_database: str, ch_replicas: list[Any]) -> Iterator[Job]:
    user = Job(tmp_path, stack_env, ch_database, new_topic(partitions=2, prefix="fd"),
               ch_replicas)
    user.create_tables()
    user.produce(20)
    yield user


def refused(run: Run, *names: str, code: int = 1, before_spark: bool = True) -> str:
    line = the_error(run.out)
    print(f"\n{run.seconds:.1f}s exit {run.code}: {line}")
    assert run.code == code, run.out[-4000:]
    for name in names:
        assert name in line, f"{name!r} not named in: {line}"
    if before_spark:
        assert "SparkContext: Running Spark" not in run.out, "refused only after Spark started"
        assert "Traceback" not in run.out and "Exception in thread" not in run.out, \
            run.out[-4000:]
    return line


def test_kafka_unreachable(job: Job) -> None:
    run = job.run(job.config(bootstrap="127.0.0.1:1"))
    line = refused(run, "Kafka unreachable", "127.0.0.1:1", "bootstrap.servers")
    assert "within 6s" in line
    assert "Connect to" not in run.out  # librdkafka's own connect failures stay quiet
    job.assert_nothing_written()


def test_missing_topic_is_named(job: Job) -> None:
    run = job.run(job.config(topic="no-such-topic-fd"))
    refused(run, "topic 'no-such-topic-fd' does not exist", "--create --topic no-such-topic-fd")
    job.assert_nothing_written()


def test_clickhouse_unreachable(job: Job) -> None:
    run = job.run(job.config(replicas=[job.replicas[0], "127.0.0.1:1"]))
    line = refused(run, "ClickHouse unreachable at 127.0.0.1:1", "[[topics]] replicas")
    assert "retrying" not in run.out and "attempt" not in line
    job.assert_nothing_written()


def test_wrong_clickhouse_password(job: Job) -> None:
    run = job.run(job.config(clickhouse='password = "not-the-password"'))
    line = refused(run, "refused user 'default'", "password")
    assert "not-the-password" not in run.out
    assert ".so" not in line  # the server's C++ stack trace is cut off
    job.assert_nothing_written()


def test_dead_letter_table_missing(job: Job) -> None:
    run = job.run(job.config(dead_letters=f"{job.database}.missing_dead_letters"))
    refused(run, f"dead-letter table {job.database}.missing_dead_letters does not exist",
            job.replicas[0])
    job.assert_nothing_written()


def test_dead_letter_table_with_wrong_columns_on_one_replica(job: Job) -> None:
    table = f"{job.database}.bad_dead_letters"
    for i, client in enumerate(job.clients):
        raw = "" if i == 1 else ", raw String"
        client.execute(f"CREATE TABLE {table} (`table` String, topic String, partition "
                       f"UInt32, offset UInt64, error String{raw}, time DateTime) "
                       "ENGINE = MergeTree() ORDER BY tuple()")
    run = job.run(job.config(dead_letters=table))
    refused(run, table, job.replicas[1], "no column raw String")
    job.assert_nothing_written()


def test_target_table_without_deduplication_is_refused_at_registration_and_start(
        job: Job) -> None:
    """Issue 26: ``ba-schema register`` refuses a plain ``MergeTree`` table (the job
    would refuse to start on it), registers it with ``--allow-no-dedup`` and a warning,
    and the job then refuses it before Spark starts, within seconds."""
    for client in job.clients:
        client.execute(f"CREATE TABLE {job.database}.plain (id UInt64) "
                       "ENGINE = MergeTree() ORDER BY id")
    res = job.register("plain", "firstday.v1.Plain", code=1)
    _one_line(res.stderr, f"table {job.database}.plain uses MergeTree",
              "non_replicated_deduplication_window", "nothing was registered",
              "--allow-no-dedup")
    res = job.register("plain", "firstday.v1.Plain", "--allow-no-dedup")
    assert "WARNING" in res.stderr and "--allow-no-dedup" in res.stderr
    job.produce(5, table="plain", message="Plain")
    run = job.run(job.config())
    refused(run, f"table {job.database}.plain", "deduplicate")
    job.assert_nothing_written()
    assert job.rows("plain") == 0


def test_missing_connector_jars_are_refused_before_spark(job: Job) -> None:
    """Issue 26: without ``--jars`` Spark failed after 41 s with ``Failed to find data
    source: kafka``; the start-up checks name ``$BLOCKAGG_SPARK_JARS`` in seconds."""
    run = job.run(job.config(), jars=False)
    line = refused(run, "spark-sql-kafka-0-10", '--jars "$BLOCKAGG_SPARK_JARS"')
    assert "Failed to find data source" not in run.out, line
    job.assert_nothing_written()


def test_connector_by_spark_jars_conf_is_accepted(job: Job) -> None:
    """``--conf spark.jars=...`` is as good as ``--jars``: no refusal, the job runs."""
    run = job.run(job.config(), "--until-caught-up", jars=False,
                  spark=["--conf", f"spark.jars={job.stack_env['BLOCKAGG_SPARK_JARS']}"])
    assert run.code == 0, run.out[-4000:]
    assert job.rows("orders") == 20


def test_busy_metrics_port_is_named_before_spark(job: Job) -> None:
    """Issue 26: a taken metrics port was a bare ``OSError: [Errno 98]`` after 26 s."""
    import socket

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = job.run(job.config(), "--metrics-port", str(port))
    refused(run, f"0.0.0.0:{port} is in use", f"[metrics] port = {port}",
            "--set metrics.port=")
    assert "Errno 98" not in run.out
    job.assert_nothing_written()


def test_speculation_is_refused_before_spark(job: Job) -> None:
    """Issue 26: ``--conf spark.speculation=true`` was silently forced off; the docs
    say the job refuses it, and it does, in one line, before Spark (exit 2: a
    configuration refusal)."""
    run = job.run(job.config(), spark=["--conf", "spark.speculation=true"])
    refused(run, "spark.speculation=true", "Remove --conf spark.speculation=true", code=2)
    job.assert_nothing_written()


def test_a_table_without_coordinate_columns_is_refused_on_18_16_unless_allowed(
        job: Job) -> None:
    """Issue 25: on 18.16 (content-hash deduplication) a table without _topic,
    _partition, _offset would lose a block whose rows equal a recent block's. The start
    is refused in one line naming the table, the columns to add and the opt-out,
    nothing written; listed in clickhouse.allow_tables_without_coordinates, the job
    starts (with a warning naming the table) and delivers every row."""
    from tests.integration.conftest import replicated_engine

    bare = f"{job.database}.bare"
    for client in job.clients:
        client.execute(f"CREATE TABLE {bare} (id UInt64) ENGINE = "
                       + replicated_engine(job.database, "bare", "id"))
    job.register("bare", "firstday.v1.Plain")
    job.produce(5, table="bare", message="Plain")
    run = job.run(job.config())
    line = refused(run, f"table {bare} has no _topic, _partition, _offset column(s)",
                   "ADD COLUMN _topic String, ADD COLUMN _partition UInt32, "
                   "ADD COLUMN _offset UInt64",
                   f'clickhouse.allow_tables_without_coordinates = ["{bare}"]')
    assert f"a message routed to {bare} could be lost" in line, line
    job.assert_nothing_written()
    assert job.rows("bare") == 0

    allowed = job.config("allowed.toml",
                         clickhouse=f'allow_tables_without_coordinates = ["{bare}"]')
    run = job.run(allowed, "--until-caught-up")
    assert run.code == 0, run.out[-6000:]
    assert f"table {bare} has no _topic" in run.out
    assert "accepted by clickhouse.allow_tables_without_coordinates" in run.out
    assert job.rows("bare") == 5 and job.rows("orders") == 20


def test_configuration_refused_exit_2(job: Job) -> None:
    run = job.run(job.config(job="no_such_key = 1"))
    refused(run, "no_such_key", code=2)
    job.assert_nothing_written()


# --------------------------------------------------------------------------- ba-schema, arv

def _cli(command: Any, args: list[str]) -> tuple[int, str]:
    res = CliRunner().invoke(command, args)
    return res.exit_code, res.stderr


def _one_line(text: str, *names: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line:\n{text}"
    assert_no_trace(text)
    for name in names:
        assert name in lines[0], f"{name!r} not in {lines[0]}"
    print(f"\n{lines[0]}")
    return lines[0]


def test_ba_schema_with_kafka_or_clickhouse_down(job: Job) -> None:
    from blockagg.registration.cli import cli as ba_schema

    register = ["register", f"{job.database}.orders", "--proto", str(job.proto_file),
                "--message", "firstday.v1.Order"]
    code, err = _cli(ba_schema, ["--bootstrap-servers", "127.0.0.1:1", "--clickhouse",
                                 job.replicas[0], "--topic", job.schema_topic, *register])
    assert code == 2
    _one_line(err, "Kafka unreachable", "127.0.0.1:1", "--bootstrap-servers")
    code, err = _cli(ba_schema, ["--bootstrap-servers", job.bootstrap, "--clickhouse",
                                 "127.0.0.1:1", "--topic", job.schema_topic, *register])
    assert code == 2
    _one_line(err, "ClickHouse unreachable at 127.0.0.1:1", "--clickhouse")
    code, err = _cli(ba_schema, ["--bootstrap-servers", job.bootstrap, "--clickhouse",
                                 job.replicas[0], "--password", "wrong", "--topic",
                                 job.schema_topic, *register])
    assert code == 2
    _one_line(err, "refused user 'default'", "--password")


def test_ba_schema_help_names_the_environment_default() -> None:
    from blockagg.registration.cli import cli as ba_schema

    res = CliRunner().invoke(ba_schema, ["--help"])
    assert "$BLOCKAGG_BOOTSTRAP_SERVERS" in " ".join(res.output.split())


def test_arv_verify_one_line_errors_and_required_commits(job: Job) -> None:
    from blockagg.verifier.cli import cli as arv

    code, err = _cli(arv, ["verify", "--bootstrap-servers", "127.0.0.1:1", "--group",
                           job.group, "--timeout", "5"])
    assert code == 2
    _one_line(err, "127.0.0.1:1", "--bootstrap-servers")
    code, err = _cli(arv, ["verify", "--bootstrap-servers", job.bootstrap, "--group",
                           f"{job.group}-misspelled"])
    assert code == 2
    assert f"no offset commit of group '{job.group}-misspelled'" in err
    code, err = _cli(arv, ["audit", "--bootstrap-servers", job.bootstrap, "--group",
                           job.group, "--topic", job.topic, "--clickhouse", "127.0.0.1:1",
                           "--database", job.database])
    assert code == 2
    _one_line(err, "127.0.0.1:1", "--clickhouse")
