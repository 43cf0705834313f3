"""The operator-facing messages and stops, the pure parts: the one-line texts, the JSON
configuration line, the librdkafka log routing, the dead-letter table's columns, and the
stop logic of the driver (a batch that starts after a stop request runs in full; a
second signal of one origin means now)."""

from __future__ import annotations

import json
import logging
from typing import Any
from unittest.mock import MagicMock

import pytest

from blockagg import logs
from blockagg.aggregator.clickhouse.startup import (
    DEAD_LETTER_TYPES,
    ReplicaCheck,
    dead_letter_problems,
    server_message,
)
from blockagg.config import loads
from blockagg.exceptions import BlockaggError
from blockagg.spark.driver import (
    BatchSummary,
    Driver,
    refusal_reasons,
    root_cause,
    short_error,
)
from blockagg.spark.exceptions import refusal_in
from blockagg.spark.job import plain

CONFIG = """
[job]
checkpoint_location = "/tmp/ck"
[kafka]
"bootstrap.servers" = "x:1"
"sasl.password" = "kafka-secret"
[[topics]]
name = "t"
replicas = ["ch:9000"]
[clickhouse]
password = "ch-secret"
"""


def test_configuration_line_is_json_all_the_way_down_with_secrets_masked() -> None:
    config = loads(CONFIG)
    text = json.dumps(plain(config.summary()))
    parsed = json.loads(text)
    assert parsed["job"]["checkpoint_location"] == "/tmp/ck"
    assert parsed["topics"][0]["replicas"] == ["ch:9000"]
    assert parsed["clickhouse"]["password"] == "***"
    assert parsed["kafka"]["common"]["sasl.password"] == "***"
    assert "secret" not in text and "ClickHouseConfig(" not in text


def test_server_stack_trace_is_cut_off() -> None:
    message = ("Code: 193.\nDB::Exception: Wrong password for user default. Stack trace:\n\n"
               "0. /usr/lib/libclickhouse.so.18(StackTrace::StackTrace()+0x16) [0x7f]\n"
               "1. /usr/lib/libclickhouse.so.18(DB::Exception::Exception()+0x2f) [0x7f]\n")
    assert server_message(Exception(message)) == (
        "Code: 193. DB::Exception: Wrong password for user default")


def test_short_error_keeps_the_first_line_of_a_java_trace() -> None:
    exc = RuntimeError("An error occurred while calling o42.awaitTermination.\n"
                       ": org.apache.spark.SparkException: boom\n\tat org.apache.X(X.java:1)\n")
    assert short_error(exc) == ("An error occurred while calling o42.awaitTermination. : "
                                "org.apache.spark.SparkException: boom")


ERROR_LINE = ("blockagg.aggregator.clickhouse.exceptions.InsertFailed: insert into db.dl failed "
              "after 1 attempt(s) (code 60): DB::Exception: Table db.dl doesn't exist.. Stack "
              "trace:")
SPARK_WRAPPED = f"""An error occurred while calling o97.collectToPython.
: org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 in stage 1.0 failed
org.apache.spark.api.python.PythonException: Traceback (most recent call last):
  File "/x/blockagg/spark/task.py", line 407, in run_arrow_partition
    report = run_range(ctx, records.tp, records.offsets, records.values,
  File "/x/blockagg/aggregator/clickhouse/writer.py", line 555, in _with_retries
    raise InsertFailed(what, last_code, last_message, attempt) from exc
{ERROR_LINE}

0. /lib/x86_64-linux-gnu/libclickhouse.so.18.16(StackTrace::StackTrace()+0x16) [0x7f9]
\tat org.apache.spark.api.python.BasePythonRunner$ReaderIterator.handlePythonException(X:581)
"""


def test_root_cause_is_the_innermost_blockagg_error_on_one_line() -> None:
    assert root_cause(RuntimeError(SPARK_WRAPPED)) == (
        "InsertFailed: insert into db.dl failed after 1 attempt(s) (code 60): "
        "DB::Exception: Table db.dl doesn't exist.")
    assert root_cause(ValueError("plain")) == "ValueError: plain"


def test_a_batch_cancelled_by_the_stop_is_not_a_failure() -> None:
    from blockagg.spark.driver import _cancelled

    assert _cancelled(RuntimeError("Job 7 cancelled part of cancelled job group 1c"))
    assert _cancelled(RuntimeError(
        "An error occurred while calling z:org.apache.commons.io.IOUtils.toString. : "
        "java.nio.channels.ClosedByInterruptException"))
    assert not _cancelled(RuntimeError("InsertFailed: insert into db.t failed"))


def test_refusal_reasons_name_the_protocol_refusal() -> None:
    text = "PythonException: blockagg.aggregator.core.exceptions.OffsetGap: t[0] gap"
    assert refusal_reasons(text) == ["gap"]
    assert refusal_reasons("ConnectionRefusedError") == []
    text = ("PythonException: Traceback ...\n"
            "blockagg.aggregator.clickhouse.exceptions.ReplayAcrossAlter: "
            "block db.t t[0] [4, 9] (6 rows) must be sent again (replay), but ...")
    assert refusal_reasons(text) == ["replay_across_alter"]
    assert (refusal_in(text) or "").startswith("ReplayAcrossAlter: block db.t t[0] [4, 9]")


def test_dead_letter_columns() -> None:
    assert dead_letter_problems(DEAD_LETTER_TYPES) == []
    lowcard = {**DEAD_LETTER_TYPES, "topic": "LowCardinality(String)"}
    assert dead_letter_problems(lowcard) == []
    broken = {k: v for k, v in DEAD_LETTER_TYPES.items() if k != "raw"}
    broken["offset"] = "UInt32"
    assert dead_letter_problems(broken) == [
        "column offset is UInt32, expected UInt64", "no column raw String"]


class _Refusing:
    def execute(self, sql: str, params: Any = None) -> Any:
        from clickhouse_driver.errors import ServerException

        raise ServerException("DB::Exception: Wrong password for user default. Stack "
                              "trace:\n0. /lib/libclickhouse.so", 193)

    def disconnect(self) -> None:
        pass


def test_a_refused_user_is_one_line_naming_user_and_replica() -> None:
    check = ReplicaCheck("ch1", 9000, "default", _Refusing)
    with pytest.raises(BlockaggError) as caught:
        check.version()
    text = str(caught.value)
    assert "ch1:9000" in text and "'default'" in text and "code 193" in text
    assert "\n" not in text and ".so" not in text


class _Unverifiable:
    def execute(self, sql: str, params: Any = None) -> Any:
        from clickhouse_driver.errors import NetworkError

        raise NetworkError("[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: "
                           "unable to get local issuer certificate (_ssl.c:1006) (ch1:9440)")

    def disconnect(self) -> None:
        pass


def test_a_failed_tls_handshake_is_one_line_naming_the_tls_settings() -> None:
    from blockagg.aggregator.clickhouse.exceptions import ClickHouseTlsFailed

    check = ReplicaCheck("ch1", 9440, "default", _Unverifiable)
    with pytest.raises(ClickHouseTlsFailed) as caught:
        check.version()
    text = str(caught.value)
    assert text.startswith("TLS with ClickHouse at ch1:9440 failed (")
    assert "certificate verify failed" in text and "[clickhouse] ca_certs" in text
    assert "\n" not in text


def _record(level: int, fac: str, msg: str) -> logging.LogRecord:
    return logging.LogRecord("blockagg.librdkafka", level, __file__, 1, "%s [%s] %s",
                             (fac, "rdkafka#consumer-1", msg), None)


def test_librdkafka_lines_are_rate_limited_per_kind() -> None:
    now = [0.0]
    limit = logs.RateLimit(interval=30, clock=lambda: now[0])
    line = "127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: Connection refused"
    assert limit.filter(_record(logging.ERROR, "FAIL", line))
    for _ in range(99):
        now[0] += 0.1
        assert not limit.filter(_record(logging.ERROR, "FAIL", line.replace(":1", ":2")))
    assert limit.filter(_record(logging.WARNING, "OTHER", "something else"))
    now[0] += 30
    passed = _record(logging.ERROR, "FAIL", line)
    assert limit.filter(passed)
    assert passed.getMessage().endswith("(and 99 more like it)")


def test_retried_connect_failures_are_info() -> None:
    logger = logging.getLogger("blockagg.test-librdkafka")
    logger.setLevel(logging.WARNING)
    retried = logs.RetriedAsInfo(logger)
    fail = _record(logging.ERROR, "FAIL", "Connect failed")
    assert not retried.filter(fail)
    assert fail.levelno == logging.INFO
    assert retried.filter(_record(logging.ERROR, "AUTH", "SASL authentication failed"))
    logger.setLevel(logging.INFO)
    assert retried.filter(_record(logging.ERROR, "FAIL", "Connect failed"))


def test_an_expected_fencing_and_a_moving_coordinator_are_debug() -> None:
    """Issue 26: a healthy run logged librdkafka's FATAL "fenced by a newer instance"
    for every abandoned producer and a burst of "Not coordinator: retrying" on start."""
    logger = logging.getLogger("blockagg.test-librdkafka-expected")
    logger.setLevel(logging.WARNING)
    expected = logs.ExpectedAsDebug(logger)
    fenced = _record(logging.CRITICAL, "FATAL", "Fatal error: Broker: Producer attempted "
                     "an operation with an old epoch: This instance has been fenced by a "
                     "newer instance")
    assert not expected.filter(fenced) and fenced.levelno == logging.DEBUG
    assert not expected.filter(_record(logging.WARNING, "GETPID", "Failed to acquire "
                                       "transactional PID from broker TxnCoordinator/1: "
                                       "Broker: Not coordinator: retrying"))
    assert expected.filter(_record(logging.ERROR, "AUTH", "SASL authentication failed"))
    logger.setLevel(logging.DEBUG)
    assert expected.filter(_record(logging.CRITICAL, "FATAL", "fenced by a newer instance"))


def test_every_kafka_client_of_the_job_routes_its_log() -> None:
    """The attempt's producer and the metadata store's consumer got their settings
    without the logger, so librdkafka wrote their lines straight to stderr."""
    from blockagg.aggregator.kafka.fencing import FencedAttempt
    from blockagg.aggregator.kafka.metadata_store import KafkaMetadataStore

    seen: list[dict[str, object]] = []

    def consumer(settings: dict[str, object]) -> MagicMock:
        seen.append(settings)
        return MagicMock()

    store = KafkaMetadataStore({"bootstrap.servers": "x:1", "group.id": "g"},
                               consumer_factory=consumer)

    def producer(settings: dict[str, object]) -> MagicMock:
        seen.append(settings)
        return MagicMock()

    FencedAttempt(store, "t", 0, producer_factory=producer)
    assert [s.get("logger") for s in seen] == [logging.getLogger("blockagg.librdkafka")] * 2


def test_kafka_client_config_routes_the_log() -> None:
    conf = logs.kafka_client_config({"bootstrap.servers": "x:1"})
    assert conf["logger"] is logging.getLogger("blockagg.librdkafka")
    assert conf["bootstrap.servers"] == "x:1"


def _driver() -> Driver:
    return Driver(loads(CONFIG), MagicMock(), components=MagicMock(), run_id=1)


def test_a_batch_started_after_the_stop_request_is_refused_before_any_io() -> None:
    from blockagg.spark.driver import _stop_ended
    from blockagg.spark.exceptions import StoppedBeforeBatch

    d = _driver()
    d._planned = MagicMock(return_value={})  # type: ignore[method-assign]
    d.run_ranges = MagicMock(  # type: ignore[method-assign]
        side_effect=lambda df, ranges, batch_id: BatchSummary(batch_id))
    d.on_batch(MagicMock(), 6)
    d.request_stop("SIGTERM")
    with pytest.raises(StoppedBeforeBatch) as refused:
        d.on_batch(MagicMock(), 7)
    assert [b.batch_id for b in d.batches] == [6]
    assert d._planned.call_count == 1 and not d._in_batch
    # the query's error, as Spark wraps it, is the stop, not a failure
    wrapped = RuntimeError("FOREACH_BATCH_USER_FUNCTION_ERROR ... "
                           f"blockagg.spark.exceptions.StoppedBeforeBatch: {refused.value}")
    assert _stop_ended(wrapped) and not _stop_ended(RuntimeError("OffsetGap: t[0]"))


def test_one_signal_per_process_asks_a_second_one_of_the_same_process_exits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    exits: list[int] = []
    monkeypatch.setattr("os._exit", exits.append)
    d = _driver()
    d.query = MagicMock()
    d.on_signal("SIGINT", "python")  # Ctrl-C reaches both processes
    d.on_signal("SIGINT", "jvm")
    assert d._stop_requested.is_set() and exits == []
    d.on_signal("SIGINT", "jvm")
    assert exits == [130]


def test_a_signal_before_the_query_stops_at_once_with_exit_0(
        monkeypatch: pytest.MonkeyPatch) -> None:
    exits: list[int] = []
    monkeypatch.setattr("os._exit", exits.append)
    d = _driver()
    d.on_signal("SIGTERM", "jvm")
    assert exits == [0]


def test_py4j_callback_traces_only_at_debug() -> None:
    """py4j logs each exception a foreachBatch raises with its Python and Java traces;
    the driver's one line says it, so py4j's record passes only at DEBUG."""
    logs.setup()
    record = logging.LogRecord("py4j.clientserver", logging.ERROR, __file__, 1,
                               "There was an exception while executing the Python Proxy",
                               None, None)
    callback_log = logging.getLogger("py4j.clientserver")
    root = logging.getLogger()
    before = root.level
    try:
        root.setLevel(logging.INFO)
        assert not callback_log.filter(record)
        root.setLevel(logging.DEBUG)
        assert callback_log.filter(record)
    finally:
        root.setLevel(before)


def test_the_batch_line_splits_the_batch_into_its_driver_phases(
        caplog: pytest.LogCaptureFixture) -> None:
    """Where a batch's time goes beyond its tasks: the plan (offset log), the checks
    (new partitions, idle re-commits), the partitions' ends, Spark's job and, within
    it, the wait for the last task to start and for a task's rows."""
    import time

    d = _driver()
    empty = MagicMock(empty=True)

    def planned(batch_id: int) -> dict[Any, Any]:
        time.sleep(0.1)
        return {("t", 0): empty}

    def run(df: Any, ranges: Any, batch_id: int) -> BatchSummary:
        time.sleep(0.05)
        summary = BatchSummary(batch_id)
        summary.spark_seconds, summary.ends_seconds = 0.05, 0.01
        summary.add({"messages": 1, "rows": 1, "bytes": 1, "blocks": 1,
                     "replayed_blocks": 0, "dead_letters": {}, "skipped": False,
                     "commits": 1, "seconds": 0.02, "partition": 0, "topic": "t",
                     "entered": 5.0, "read_seconds": 0.03, "fresh_worker": True,
                     "prepare_seconds": 0.01})
        return summary

    d.partitions.add(("t", 0))
    d._planned = planned  # type: ignore[method-assign]
    d.run_ranges = run  # type: ignore[method-assign,assignment]
    with caplog.at_level(logging.INFO, logger="blockagg.job"):
        d.on_batch(MagicMock(), 3)
    [summary] = d.batches
    assert 0.1 <= summary.plan_seconds < summary.seconds
    assert 0.0 <= summary.checks_seconds < 0.05
    assert summary.read_seconds == 0.03 and summary.task_starts == [5.0]
    assert summary.fresh_workers == 1
    [fields] = [getattr(r, logs._FIELDS_ATTR) for r in caplog.records
                if r.getMessage() == "batch"]
    assert {k: fields[k] for k in ("plan_seconds", "spark_seconds", "ends_seconds",
                                   "read_seconds", "prepare_seconds")} == {
        "plan_seconds": round(summary.plan_seconds, 3), "spark_seconds": 0.05,
        "ends_seconds": 0.01, "read_seconds": 0.03, "prepare_seconds": 0.01}
    assert {"checks_seconds", "build_seconds", "start_seconds", "last_start_seconds",
            "submit_seconds", "launch_seconds", "fresh_workers"} <= set(fields)


def test_partitions_added_while_running_have_the_tables_judged_again() -> None:
    """A topic grown from 2 to 3 partitions raises the shard's deduplication need: the
    batch that first sees the new one checks every table again, before any I/O."""
    d = _driver()
    d.partitions.update({("t", 0), ("t", 1)})
    d.check_tables = MagicMock()  # type: ignore[method-assign]
    d.run_ranges = MagicMock(  # type: ignore[method-assign]
        side_effect=lambda df, ranges, batch_id: BatchSummary(batch_id))
    empty = MagicMock(empty=True)
    d._planned = MagicMock(return_value={("t", 0): empty, ("t", 1): empty})  # type: ignore
    d.on_batch(MagicMock(), 1)
    assert d.check_tables.call_count == 0
    d._planned = MagicMock(  # type: ignore[method-assign]
        return_value={("t", 0): empty, ("t", 1): empty, ("t", 2): empty})
    d.on_batch(MagicMock(), 2)
    d.check_tables.assert_called_once_with([("t", 0), ("t", 1), ("t", 2)])
    d.on_batch(MagicMock(), 3)
    assert d.check_tables.call_count == 1


def test_quorum_contention_and_first_retries_are_info_persisting_ones_warn() -> None:
    """A healthy cluster's retries are no warning (issue 26, item 2): the first failure
    of a block, and 18.16's one-quorum-insert-per-table contention until the last
    attempt. A failure that persists warns."""
    from blockagg.aggregator.clickhouse.diagnosis import retry_level

    pending = "Quorum for previous write has not been satisfied yet. Status: version: 1"
    assert retry_level(1, 6, 210, "Connection refused") == logging.INFO
    assert retry_level(2, 6, 210, "Connection refused") == logging.WARNING
    assert retry_level(5, 6, 286, pending) == logging.INFO
    assert retry_level(6, 6, 286, pending) == logging.WARNING
    assert retry_level(1, 6, 286, pending, waited=True) == logging.WARNING
    assert retry_level(2, 6, 285, "Number of alive replicas (1) is less than requested "
                       "quorum (2)") == logging.WARNING


def test_executors_log_in_the_drivers_format_and_level() -> None:
    """``--log-format text --log-level DEBUG`` reaches the Python workers through
    ``spark.executorEnv.*``: one format across driver and executors."""
    from blockagg.spark.driver import session_defaults

    logs.setup()
    root = logging.getLogger()
    ours = next(h for h in root.handlers if getattr(h, "_blockagg", False))
    before = (root.level, ours.formatter)
    try:
        root.setLevel(logging.DEBUG)
        ours.setFormatter(logs.TextFormatter())
        assert logs.worker_env() == {"BLOCKAGG_LOG_LEVEL": "DEBUG",
                                     "BLOCKAGG_LOG_FORMAT": "text"}
        conf = session_defaults("INFO")
        assert conf["spark.executorEnv.BLOCKAGG_LOG_FORMAT"] == "text"
        assert conf["spark.executorEnv.BLOCKAGG_LOG_LEVEL"] == "DEBUG"
        assert conf["spark.ui.showConsoleProgress"] == "false"
        assert conf["spark.log.level"] == "INFO"
        ours.setFormatter(logs.JsonFormatter())
        root.setLevel(logging.INFO)
        assert logs.worker_env()["BLOCKAGG_LOG_FORMAT"] == "json"
        assert "spark.log.level" not in session_defaults(None)
    finally:
        root.setLevel(before[0])
        ours.setFormatter(before[1])


def test_a_task_that_succeeded_after_failed_attempts_is_named_in_the_batch_line() -> None:
    summary = BatchSummary(batch_id=4)
    base = {"messages": 1, "rows": 1, "bytes": 1, "blocks": 1, "replayed_blocks": 0,
            "dead_letters": {}, "skipped": False, "commits": 2, "seconds": 0.1,
            "partition": 0, "topic": "t"}
    summary.add({**base, "attempt": 1})
    summary.add({**base, "partition": 1, "attempt": 3})
    summary.add({k: v for k, v in base.items() if k != "attempt"} | {"partition": 2})
    assert summary.retried == {"t[1]": 3}
