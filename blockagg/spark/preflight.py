"""What the job checks before it starts Spark: its Spark options and the services it
needs, each in one bounded request, each failure one line naming the thing and the
fix, within seconds (Spark's session takes tens of seconds to start, then fails with
a trace that names neither).

* ``spark.speculation`` is not true (two attempts of one task would commit and
  insert concurrently: refused, never silently overridden);
* the Kafka connector (``spark-sql-kafka-0-10``) is on the classpath the session gets;
* the metrics port is free (the server is bound here and kept: ``serve_metrics``);
* Kafka answers and every configured topic exists (a pattern matches a topic);
* Kafka keeps what it acknowledges on every topic the job depends on (data topics,
  ``__consumer_offsets``, ``__transaction_state``, the ownership and registry topics:
  ``kafka.durability``), unless ``kafka.allow_unsafe_durability``;
* every ClickHouse replica of every shard answers and accepts the user;
* the dead-letter table exists with the expected columns on every replica;
* every registered table on every shard drops a retried block, with the coordinate
  columns where the server needs them (``spark.tables``; the driver does not run it
  again for the same partitions);
* the job's group may deliver each topic into its shard (``spark.ownership``: one
  group per topic and shard; this check writes the ownership record of a first
  claim or a take-over, after every other check passed).

Nothing else is written: a refused start leaves no commit and no row.
"""

from __future__ import annotations

import errno
import os
import shlex
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from blockagg import logs
from blockagg.aggregator.clickhouse.startup import check_replicas, driver_check
from blockagg.aggregator.kafka import durability
from blockagg.aggregator.kafka.exceptions import MetadataBudgetTooSmall, UnsafeKafkaDurability
from blockagg.aggregator.kafka.startup import DEFAULT_TIMEOUT, check_topics
from blockagg.config import Config
from blockagg.exceptions import ConfigError
from blockagg.spark import ownership
from blockagg.spark.exceptions import JobError
from blockagg.tls import tls_arguments

if TYPE_CHECKING:
    from blockagg.spark.metrics import JobMetrics
    from blockagg.spark.tables import TableGuard

log = logs.get("job")

CLICKHOUSE_TIMEOUT = 5.0


KAFKA_CONNECTOR = "spark-sql-kafka-0-10"
KAFKA_PROVIDER = "org.apache.spark.sql.kafka010.KafkaSourceProvider"
CLASSPATH_KEYS = ("spark.jars", "spark.jars.packages", "spark.driver.extraClassPath")


class ConnectorMissing(JobError):
    """The Kafka connector is not on the Spark session's classpath."""


class MetricsPortBusy(JobError):
    """The metrics server's address is taken."""


def check_speculation(conf: Mapping[str, str]) -> None:
    """Refuse ``spark.speculation=true``: a speculative second attempt of a task would
    commit metadata and insert concurrently with the first (invariant 6 would rest
    on fencing alone). Refused rather than forced off, so an operator who set it
    learns that it is not honoured."""
    value = str(conf.get("spark.speculation", "false")).strip()
    if value.lower() == "true":
        raise ConfigError(
            f"spark.speculation={value}: two attempts of one task would commit and insert "
            "concurrently. Remove --conf spark.speculation=true, or pass --conf "
            "spark.speculation=false where spark-defaults.conf sets it (the job needs it off)")


def connector_on_classpath(conf: Mapping[str, str], jar_dirs: Iterable[Path]) -> bool:
    """Whether the session will load the Kafka connector: named in ``spark.jars``
    (``--jars``), ``spark.jars.packages`` (``--packages``) or the driver's extra
    classpath, or a jar in Spark's own jar directories (``$SPARK_HOME/jars``,
    pyspark's ``jars``)."""
    if any(KAFKA_CONNECTOR in str(conf.get(key, "")) for key in CLASSPATH_KEYS):
        return True
    for folder in jar_dirs:
        try:
            if any(p.name.startswith(KAFKA_CONNECTOR) for p in folder.iterdir()):
                return True
        except OSError:
            continue
    return False


def check_connector(conf: Mapping[str, str], jar_dirs: Iterable[Path],
                    loadable: bool = False) -> None:
    """Refuse a start whose session could not read Kafka (Spark would fail after its
    whole start-up with ``Failed to find data source: kafka``). ``loadable``: the
    running JVM already loads the connector's class (then nothing is refused)."""
    if loadable or connector_on_classpath(conf, jar_dirs):
        return
    raise ConnectorMissing(
        f"the Kafka connector ({KAFKA_CONNECTOR}) is not on Spark's classpath: no "
        f"{KAFKA_CONNECTOR} jar in --jars/spark.jars, --packages/spark.jars.packages or "
        "$SPARK_HOME/jars. Pass --jars \"$BLOCKAGG_SPARK_JARS\" (the connector and its "
        "dependencies, see README) or --packages "
        "org.apache.spark:spark-sql-kafka-0-10_2.13:<spark version>")


def submit_args_conf(args: str) -> dict[str, str]:
    """The Spark options of ``PYSPARK_SUBMIT_ARGS`` (pyspark starts Spark from them
    when the job runs as ``python job.py``) as configuration keys."""
    flags = {"--jars": "spark.jars", "--packages": "spark.jars.packages",
             "--driver-class-path": "spark.driver.extraClassPath"}
    words = shlex.split(args)
    out: dict[str, str] = {}
    for i, word in enumerate(words):
        name, eq, inline = word.partition("=")
        value = inline if eq else (words[i + 1] if i + 1 < len(words) else "")
        if name in flags:
            out[flags[name]] = value
        elif word == "--conf" and "=" in value:
            key, _, v = value.partition("=")
            out[key.strip()] = v.strip()
    return out


def defaults_conf(path: Path) -> dict[str, str]:
    """``spark-defaults.conf``'s keys (whitespace- or ``=``-separated)."""
    out: dict[str, str] = {}
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.replace("=", " ", 1).split(None, 1)
        if len(parts) == 2:
            out[parts[0]] = parts[1].strip()
    return out


def spark_jar_dirs() -> list[Path]:
    dirs = []
    if home := os.environ.get("SPARK_HOME"):
        dirs.append(Path(home) / "jars")
    try:
        import pyspark

        dirs.append(Path(pyspark.__file__).parent / "jars")
    except ImportError:
        pass
    return dirs


def spark_conf() -> tuple[dict[str, str], bool]:
    """The configuration the Spark session will start with, and whether the running
    JVM loads the Kafka connector. Under ``spark-submit`` the JVM runs already and
    holds every ``--conf``/``--jars``/``--packages`` and ``spark-defaults.conf`` key;
    under ``python job.py`` pyspark will start it from ``PYSPARK_SUBMIT_ARGS`` and
    ``spark-defaults.conf``."""
    if os.environ.get("PYSPARK_GATEWAY_PORT"):
        from pyspark import SparkConf, SparkContext

        SparkContext._ensure_initialized()
        conf = dict(SparkConf().getAll())
        loadable = False
        try:
            jvm: Any = SparkContext._jvm
            loader = jvm.java.lang.Thread.currentThread().getContextClassLoader()
            loader.loadClass(KAFKA_PROVIDER)
            loadable = True
        except Exception:  # not loadable here: the configuration decides
            pass
        return conf, loadable
    conf_dir = os.environ.get("SPARK_CONF_DIR") or (
        str(Path(os.environ["SPARK_HOME"]) / "conf") if os.environ.get("SPARK_HOME") else "")
    conf = defaults_conf(Path(conf_dir) / "spark-defaults.conf") if conf_dir else {}
    conf.update(submit_args_conf(os.environ.get("PYSPARK_SUBMIT_ARGS", "")))
    return conf, False


def check_spark() -> None:
    """Speculation off and the Kafka connector on the classpath, before the session."""
    conf, loadable = spark_conf()
    check_speculation(conf)
    check_connector(conf, spark_jar_dirs(), loadable)


def serve_metrics(metrics: JobMetrics, config: Config) -> None:
    """Bind ``/metrics`` on ``[metrics] host:port`` now and keep it (no race with
    another process between a test and the bind); a taken address is one line."""
    host, port = config.metrics.host, config.metrics.port
    try:
        metrics.serve(port, host)
    except OSError as exc:
        what = ("is in use" if exc.errno == errno.EADDRINUSE
                else f"cannot be bound ({exc.strerror or exc})")
        raise MetricsPortBusy(
            f"metrics address {host}:{port} {what} ([metrics] port = {port}): "
            "stop what listens there, or choose another port with --set "
            "metrics.port=<port> (--metrics-port, 0 turns the server off)") from None


def topic_partitions(config: Config, found: Mapping[str, int]) -> list[tuple[str, int]]:
    """Every partition of every topic the job reads, from the topics found."""
    return sorted((name, p) for name, count in found.items()
                  if not name.startswith("__") and any(t.matches(name) for t in config.topics)
                  for p in range(count))


def check_durability(config: Config, found: Mapping[str, int],
                     timeout: float = DEFAULT_TIMEOUT) -> durability.Assessment:
    """Refuse a cluster where Kafka itself could lose an acknowledged intent or message
    (``kafka.durability``'s rule): each refusal is one ERROR line, then
    :class:`UnsafeKafkaDurability`; with ``kafka.allow_unsafe_durability`` each is a
    WARNING line and the start goes on. A single-broker cluster is one INFO notice (a healthy
    development run prints no warning)."""
    data = sorted({name for name, _ in topic_partitions(config, found)})
    own = {config.job.owners_topic: "ownership records",
           config.schemas.topic: "schema registry"}
    try:
        brokers, topics = durability.read(config.kafka.librdkafka_config(), data, own,
                                          timeout)
    except UnsafeKafkaDurability as exc:
        if not config.kafka.allow_unsafe_durability:
            raise
        logs.event(log, str(exc), level=30)
        return durability.Assessment(0, ())
    result = durability.assess(brokers, topics)
    if result.dev_stack:
        logs.event(log, durability.DEV_NOTICE, brokers=brokers)
        return result
    allowed = config.kafka.allow_unsafe_durability
    for finding in result.findings:
        unsafe = finding.refuse and not allowed
        logs.event(log, finding.line(), level=40 if unsafe else 30)
    if result.refusals and not allowed:
        first, more = result.refusals[0].line(), len(result.refusals) - 1
        raise UnsafeKafkaDurability(first + (f" (and {more} more, logged above)" if more
                                             else ""))
    return result


UNBOUNDED_SPAN = 2**31
"""The batch range the metadata budget is judged at without ``max_offsets_per_trigger``
(then only warned about: Spark's batches have no bound)."""


def broker_metadata_max_bytes(config: Config, timeout: float = DEFAULT_TIMEOUT) -> int | None:
    """The brokers' ``offset.metadata.max.bytes`` (the first answering broker's: they
    must agree), or ``None`` when the cluster does not say (no DescribeConfigs
    permission, or no broker answered)."""
    from confluent_kafka.admin import AdminClient

    from blockagg.aggregator.kafka.broker_config import read_broker_config

    admin = AdminClient(logs.kafka_client_config(config.kafka.librdkafka_config()))
    try:
        brokers = admin.list_topics(timeout=timeout).brokers
        _, settings = read_broker_config(admin, brokers, timeout)
        return int(settings["offset.metadata.max.bytes"])
    except Exception:
        return None


def check_metadata_budget(config: Config, table_ids: Iterable[int],
                          broker_max_bytes: int | None) -> None:
    """Refuse the start (:class:`MetadataBudgetTooSmall`) when an intent listing every
    registered table and the dead-letter table, in a batch range of
    ``job.max_offsets_per_trigger`` offsets per partition, could exceed
    ``offset.metadata.max.bytes``, or when the brokers' limit is below the job's:
    before anything is committed, instead of a ``MetadataTooLarge`` at the first
    large intent (``core.metadata.budget_refusal``)."""
    from blockagg.aggregator.core.metadata import DEAD_LETTER_TABLE_ID, budget_refusal

    ids = sorted({DEAD_LETTER_TABLE_ID, *table_ids})
    span = config.job.max_offsets_per_trigger
    refusal = budget_refusal(ids, span or UNBOUNDED_SPAN,
                             config.job.offset_metadata_max_bytes, broker_max_bytes)
    if refusal is None:
        return
    broker_short = (broker_max_bytes is not None
                    and broker_max_bytes < config.job.offset_metadata_max_bytes)
    if span is None and not broker_short:
        logs.event(log, refusal + " (no max_offsets_per_trigger: judged at "
                   f"{UNBOUNDED_SPAN} offsets)", level=30)
        return
    raise MetadataBudgetTooSmall(refusal)


def run(config: Config, clickhouse: bool = True, run_id: str = "",
        tables: TableGuard | None = None, spark: bool = False,
        metrics: JobMetrics | None = None) -> None:
    """All start-up checks; raises the first failure (a ``BlockaggError``).
    ``clickhouse=False`` when the sinks are not ClickHouse (the
    ``BLOCKAGG_COMPONENTS`` testing hook): only Kafka is checked. ``tables``: the
    registry's tables are checked with it (and it keeps what it judged for the
    driver). ``spark``: Spark's options are checked (speculation, connector).
    ``metrics``: served from here on (``serve_metrics``)."""
    started = time.monotonic()
    if spark:
        check_spark()
    if metrics is not None:
        serve_metrics(metrics, config)
    names = [t.name for t in config.topics if t.name is not None]
    patterns = [t.pattern for t in config.topics if t.pattern is not None]
    found = check_topics(config.kafka.librdkafka_config(), names, patterns)
    check_durability(config, found)
    timeout = min(CLICKHOUSE_TIMEOUT, config.clickhouse.connect_timeout)
    seen: set[tuple[str, int]] = set()
    ch = config.clickhouse
    tls = tls_arguments(ch.secure, ch.verify, ch.ca_certs)
    for topic in config.topics if clickhouse else ():
        replicas = [r for r in topic.replicas if (r.host, r.port) not in seen]
        seen.update((r.host, r.port) for r in replicas)
        check_replicas(
            (driver_check(r.host, r.port, config.clickhouse.user,
                          config.clickhouse.password.reveal(), timeout, tls=tls)
             for r in replicas),
            config.dead_letters.table)
    if tables is not None:
        current = getattr(tables.components.registry(config), "current", None)
        if current is not None:
            check_metadata_budget(config, current().tables(), broker_metadata_max_bytes(config))
    if clickhouse and tables is not None:
        tables.check_tables(topic_partitions(config, found))
    ownership.check(config, found, clickhouse, run_id)
    logs.event(log, "start-up checks passed", seconds=round(time.monotonic() - started, 3),
               topics=len(config.topics), replicas=len(seen))
