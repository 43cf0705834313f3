"""The start-up checks that need no service (``spark.preflight``): speculation is
refused, not forced off; the Kafka connector must be on the session's classpath (by
``--jars``, ``--packages``, the driver's classpath or Spark's own jar folders); a
taken metrics address is one line naming it; the partitions the tables are judged
for are the configured topics'."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from pathlib import Path

import pytest

from blockagg.config import loads
from blockagg.exceptions import ConfigError
from blockagg.spark.metrics import JobMetrics
from blockagg.spark.preflight import (
    ConnectorMissing,
    MetricsPortBusy,
    check_connector,
    check_speculation,
    defaults_conf,
    serve_metrics,
    submit_args_conf,
    topic_partitions,
)

JAR = "/opt/jars/spark-sql-kafka-0-10_2.13-4.0.1.jar"

CONFIG = """
[job]
checkpoint_location = "/tmp/ck"
[kafka]
"bootstrap.servers" = "x:1"
[[topics]]
name = "orders"
replicas = ["ch:9000"]
[[topics]]
pattern = "clicks-.*"
replicas = ["ch2:9000"]
[metrics]
host = "127.0.0.1"
port = {port}
"""


@pytest.mark.parametrize("value", ["true", "True", " TRUE "])
def test_speculation_true_is_refused_naming_the_fix(value: str) -> None:
    with pytest.raises(ConfigError) as err:
        check_speculation({"spark.speculation": value})
    line = str(err.value)
    assert "spark.speculation=" in line and "Remove --conf spark.speculation=true" in line
    assert "spark-defaults.conf" in line and "\n" not in line


@pytest.mark.parametrize("conf", [{}, {"spark.speculation": "false"}])
def test_speculation_off_or_unset_passes(conf: dict[str, str]) -> None:
    check_speculation(conf)


@pytest.mark.parametrize("conf", [
    {"spark.jars": f"/opt/jars/kafka-clients-3.9.jar,{JAR}"},
    {"spark.jars": "file:" + JAR},
    {"spark.jars.packages": "org.apache.spark:spark-sql-kafka-0-10_2.13:4.0.1"},
    {"spark.driver.extraClassPath": f"/x.jar:{JAR}"},
])
def test_connector_named_in_the_configuration_passes(conf: dict[str, str]) -> None:
    check_connector(conf, [])


def test_connector_in_sparks_jar_folder_passes(tmp_path: Path) -> None:
    (tmp_path / "spark-sql-kafka-0-10_2.13-4.0.1.jar").touch()
    check_connector({}, [tmp_path / "missing", tmp_path])


def test_a_connector_the_jvm_loads_passes() -> None:
    check_connector({}, [], loadable=True)


def test_missing_connector_is_one_line_naming_blockagg_spark_jars(tmp_path: Path) -> None:
    (tmp_path / "kafka-clients-3.9.jar").touch()
    with pytest.raises(ConnectorMissing) as err:
        check_connector({"spark.jars": "/opt/jars/kafka-clients-3.9.jar"}, [tmp_path])
    line = str(err.value)
    assert '--jars "$BLOCKAGG_SPARK_JARS"' in line and "spark-sql-kafka-0-10" in line
    assert "\n" not in line


def test_pyspark_submit_args_are_read_as_keys() -> None:
    conf = submit_args_conf(f"--master local[2] --jars {JAR} --conf spark.speculation=true "
                            "--packages=a:b:1 --driver-class-path /c.jar pyspark-shell")
    assert conf == {"spark.jars": JAR, "spark.speculation": "true",
                    "spark.jars.packages": "a:b:1", "spark.driver.extraClassPath": "/c.jar"}


def test_spark_defaults_conf_is_read(tmp_path: Path) -> None:
    path = tmp_path / "spark-defaults.conf"
    path.write_text(f"# comment\nspark.speculation   true\nspark.jars={JAR}\n\n")
    assert defaults_conf(path) == {"spark.speculation": "true", "spark.jars": JAR}
    assert defaults_conf(tmp_path / "none") == {}


def test_a_taken_metrics_port_is_one_line_naming_address_setting_and_flag() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(MetricsPortBusy) as err:
            serve_metrics(JobMetrics(), loads(CONFIG.format(port=port)))
    line = str(err.value)
    assert f"127.0.0.1:{port} is in use" in line and f"[metrics] port = {port}" in line
    assert "--set metrics.port=" in line and "\n" not in line


def test_a_free_metrics_port_is_bound_and_kept() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    serve_metrics(JobMetrics(), loads(CONFIG.format(port=port)))
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", port))


def test_metrics_port_zero_binds_nothing() -> None:
    serve_metrics(JobMetrics(), loads(CONFIG.format(port=0)))


def test_the_tables_are_judged_for_the_configured_topics_partitions() -> None:
    config = loads(CONFIG.format(port=0))
    found = {"orders": 2, "clicks-a": 1, "other": 3, "__consumer_offsets": 50}
    assert topic_partitions(config, found) == [("clicks-a", 0), ("orders", 0), ("orders", 1)]


def test_the_driver_does_not_judge_the_tables_twice_for_the_same_partitions() -> None:
    from unittest.mock import MagicMock

    from blockagg.spark.tables import TableGuard

    class Counting(TableGuard):
        calls = 0

        def check_tables(self, partitions: Sequence[tuple[str, int]]) -> None:
            Counting.calls += 1
            self.checked = frozenset(partitions)

    guard = Counting(loads(CONFIG.format(port=0)), MagicMock())
    guard.check_tables([("orders", 0), ("orders", 1)])  # the start-up checks
    guard.ensure_checked([("orders", 1), ("orders", 0)])  # the driver, same partitions
    assert Counting.calls == 1
    guard.ensure_checked([("orders", 0), ("orders", 1), ("orders", 2)])  # one was added
    assert Counting.calls == 2


def test_the_session_never_forces_speculation_off_and_refuses_it_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The builder does not set ``spark.speculation`` (an operator's ``true`` would be
    silently overridden); a session that has it on is refused."""
    from unittest.mock import MagicMock

    from blockagg.spark import driver
    from blockagg.spark.driver import make_spark

    monkeypatch.setattr(driver, "spark_log_level", lambda: None)  # no JVM here

    builder = MagicMock()
    builder.appName.return_value = builder
    builder.config.return_value = builder
    session = builder.getOrCreate.return_value
    session.sparkContext.getConf.return_value = {"spark.speculation": "true"}
    with pytest.raises(ConfigError):
        make_spark(loads(CONFIG.format(port=0)), builder=builder)
    assert all(c.args[0] != "spark.speculation" for c in builder.config.call_args_list)
