"""Session fixtures for the integration tests: the real local stack (``scripts/stack``).

The first fixture that needs the stack runs ``scripts/stack up`` (a fast no-op when it is already
up; it installs jars on first use) and fails the test with the script's output if a service does
not come up. The stack is left running after the session; ``scripts/stack down`` stops it (CI's
``.ci/run`` does so in a trap). Addresses come from ``scripts/stack_lib.py``, so the
``BLOCKAGG_*_PORT`` overrides that ``scripts/stack`` honours apply here too.

Mark tests that use these fixtures ``@pytest.mark.integration`` (or ``pytestmark``).

Fixtures (all names stable; other test modules reuse them):

``stack_env`` (session) -> ``dict[str, str]``
    What ``scripts/stack env`` exports: ``BLOCKAGG_BOOTSTRAP_SERVERS``, ``BLOCKAGG_CH_HOST``,
    ``BLOCKAGG_CH_PORTS`` ("19000,19100"), ``BLOCKAGG_CH_HTTP_PORTS``, ``BLOCKAGG_CH_CLUSTER``,
    ``BLOCKAGG_ZK``, ``BLOCKAGG_SPARK_JARS`` (comma list), ``BLOCKAGG_SPARK_VERSION``, ...
``kafka_bootstrap`` (session) -> ``str``
    ``"127.0.0.1:19092"``: the ``bootstrap.servers`` of the KRaft broker.
``kafka_admin`` (session) -> ``confluent_kafka.admin.AdminClient``
``new_topic`` (session) -> ``Callable[..., str]``
    ``new_topic(partitions=1, prefix="t", config=None)`` creates a fresh, uniquely named topic,
    waits until its leaders are known, and returns its name. Topics are not deleted.
``produced_topic`` (session) -> ``ProducedTopic``
    A 3-partition topic with 30 messages already produced (keys ``k0``..., values ``v0``...),
    each with the partition and offset its delivery report gave.
``ch_replicas`` (session) -> ``list[clickhouse_driver.Client]``
    Clients for replica r1 and r2 (same shard ``01``), in that order, on the native TCP ports.
``ch_database`` (function) -> ``str``
    A fresh database created on both replicas, dropped (with its tables) after the test. Use
    ``replicated_engine(database, table)`` for a matching ``ReplicatedMergeTree`` engine clause.
``spark_jars`` (session) -> ``list[str]``
    Absolute paths of the ``spark-sql-kafka-0-10`` jars (matching the installed pyspark) and
    their dependencies that pyspark does not already ship; pass as ``spark.jars`` / ``--jars``.
``spark_session`` (session) -> ``pyspark.sql.SparkSession``
    ``local[2]`` with those jars, UI off, 2 shuffle partitions; stopped at the end of the session.
    ``spark_builder(jars)`` returns the same builder for tests that need their own options.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
STACK = REPO_ROOT / "scripts" / "stack"
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from scripts import stack_lib  # noqa: E402


def unique_name(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


def replicated_engine(database: str, table: str, order_by: str = "tuple()") -> str:
    """``ReplicatedMergeTree`` with a ZooKeeper path unique to ``database.table``."""
    return (
        f"ReplicatedMergeTree('/clickhouse/tables/{{shard}}/{database}/{table}', '{{replica}}') "
        f"ORDER BY {order_by}"
    )


@pytest.fixture(scope="session")
def stack_env() -> dict[str, str]:
    cfg = stack_lib.StackConfig.from_env()
    if not all(s.is_up() for s in stack_lib.build_services(cfg).values()):
        res = subprocess.run(
            [str(STACK), "up"], capture_output=True, text=True, check=False, timeout=1800
        )
        if res.returncode != 0:
            pytest.fail(
                f"`scripts/stack up` failed (exit {res.returncode}):\n{res.stdout}\n{res.stderr}",
                pytrace=False,
            )
    values: dict[str, str] = stack_lib.env_values(cfg, stack_lib.spark_jars(cfg))
    return values


@pytest.fixture(scope="session")
def kafka_bootstrap(stack_env: dict[str, str]) -> str:
    return stack_env["BLOCKAGG_BOOTSTRAP_SERVERS"]


@pytest.fixture(scope="session")
def kafka_admin(kafka_bootstrap: str) -> Any:
    from confluent_kafka.admin import AdminClient

    return AdminClient({"bootstrap.servers": kafka_bootstrap})


@pytest.fixture(scope="session")
def new_topic(kafka_admin: Any) -> Callable[..., str]:
    from confluent_kafka.admin import NewTopic  # type: ignore[attr-defined]

    def make(partitions: int = 1, prefix: str = "t", config: dict[str, str] | None = None) -> str:
        name = unique_name(prefix)
        futures = kafka_admin.create_topics(
            [NewTopic(name, num_partitions=partitions, replication_factor=1, config=config or {})]
        )
        futures[name].result(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            md = kafka_admin.list_topics(topic=name, timeout=10).topics.get(name)
            if (
                md is not None
                and md.error is None
                and len(md.partitions) == partitions
                and all(p.leader >= 0 for p in md.partitions.values())
            ):
                return name
            time.sleep(0.2)
        raise TimeoutError(f"topic {name} has no leaders after 30s")

    return make


@dataclasses.dataclass(frozen=True)
class Produced:
    key: bytes
    value: bytes
    partition: int
    offset: int


@dataclasses.dataclass(frozen=True)
class ProducedTopic:
    topic: str
    partitions: int
    messages: list[Produced]


@pytest.fixture(scope="session")
def produced_topic(kafka_bootstrap: str, new_topic: Callable[..., str]) -> ProducedTopic:
    from confluent_kafka import Producer

    from blockagg.logs import kafka_client_config

    topic = new_topic(partitions=3, prefix="produced")
    producer = Producer(kafka_client_config({"bootstrap.servers": kafka_bootstrap,
                                             "enable.idempotence": True}))
    delivered: list[Produced] = []
    errors: list[str] = []

    def on_delivery(err: Any, msg: Any) -> None:
        if err is not None:
            errors.append(str(err))
        else:
            delivered.append(Produced(msg.key(), msg.value(), msg.partition(), msg.offset()))

    for i in range(30):
        producer.produce(
            topic, key=f"k{i}".encode(), value=f"v{i}".encode(), on_delivery=on_delivery
        )
    remaining = producer.flush(30)
    assert remaining == 0 and not errors, f"produce failed: {errors}, {remaining} undelivered"
    return ProducedTopic(topic, 3, sorted(delivered, key=lambda m: (m.partition, m.offset)))


@pytest.fixture(scope="session")
def ch_replicas(stack_env: dict[str, str]) -> Iterator[list[Any]]:
    from clickhouse_driver import Client

    host = stack_env["BLOCKAGG_CH_HOST"]
    clients = [
        Client(host=host, port=int(port), connect_timeout=5, send_receive_timeout=60)
        for port in stack_env["BLOCKAGG_CH_PORTS"].split(",")
    ]
    yield clients
    for c in clients:
        c.disconnect()


@pytest.fixture
def ch_database(ch_replicas: list[Any]) -> Iterator[str]:
    db = unique_name("it")
    for c in ch_replicas:
        c.execute(f"CREATE DATABASE {db}")
    yield db
    for c in ch_replicas:
        c.execute(f"DROP DATABASE IF EXISTS {db}")


@pytest.fixture(scope="session")
def spark_jars(stack_env: dict[str, str]) -> list[str]:
    jars = [j for j in stack_env["BLOCKAGG_SPARK_JARS"].split(",") if j]
    assert jars, "no Spark connector jars: run `scripts/stack install`"
    return jars


def spark_builder(jars: list[str], app_name: str = "blockagg-tests") -> Any:
    from pyspark.sql import SparkSession

    return (
        SparkSession.builder.master("local[2]")
        .appName(app_name)
        .config("spark.jars", ",".join(jars))
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.memory", "1g")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.session.timeZone", "UTC")
    )


@pytest.fixture(scope="session")
def spark_session(spark_jars: list[str]) -> Iterator[Any]:
    spark = spark_builder(spark_jars).getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    yield spark
    spark.stop()
