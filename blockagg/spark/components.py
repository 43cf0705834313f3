"""What a task needs besides its rows: the metadata store, the shard's block sink and
the table registry, built once per Python worker process and reused across batches.

:class:`Components` is the seam between the Spark job and the adapters of the other
packages (``aggregator.kafka`` for the metadata store, ``aggregator.clickhouse`` for
the writer, ``proto`` for the schema registry). It is pickled into every task, so it
holds only configuration; the live clients are cached per worker process in
:data:`_CACHE`. Tests pass their own ``Components`` (e.g. to inject a failure).
"""

from __future__ import annotations

import importlib
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from blockagg.aggregator.core.model import BlockSink, Fence, Lanes, MetadataStore
from blockagg.config import Config, TopicConfig
from blockagg.exceptions import BlockaggError

if TYPE_CHECKING:
    from blockagg.aggregator.clickhouse.dedup_window import DedupWindow


class TableRegistry(Protocol):
    """Table name -> stable table id (>= 1), ``None`` when the table is not registered.
    Implementations re-read the registry when asked for an unknown table."""

    def table_id(self, table: str) -> int | None: ...


class Components(Protocol):
    """The adapters of a task. Optional, read with ``getattr`` by
    :func:`spark.task.current_pins` (a test double may leave them out, which leaves
    those pins 0): ``incarnation(config, topic_name) -> int`` (the topic's
    :func:`~aggregator.core.metadata.incarnation_of`) and ``dedup_mode(config,
    topic) -> DedupMode`` (the shard server's); and, read by
    :func:`spark.task.block_shares`, ``dedup_windows(config, topic, tables) ->
    Mapping[str, DedupWindow]`` (without it a batch's blocks are not bounded by the
    tables' deduplication windows)."""

    def store(self, config: Config) -> MetadataStore: ...

    def sink(self, config: Config, topic: TopicConfig) -> BlockSink: ...

    def registry(self, config: Config) -> TableRegistry: ...


_CACHE: dict[tuple[str, ...], Any] = {}
_CACHE_LOCK = threading.Lock()


def cached(key: tuple[str, ...], make: Callable[[], Any]) -> Any:
    """One instance per worker process per key (Python workers are reused)."""
    with _CACHE_LOCK:
        if key not in _CACHE:
            _CACHE[key] = make()
        return _CACHE[key]


class DefaultComponents:
    """The production adapters."""

    def store(self, config: Config) -> MetadataStore:
        def make() -> MetadataStore:
            from blockagg.aggregator.kafka.metadata_store import KafkaMetadataStore

            settings: dict[str, Any] = dict(config.kafka.librdkafka_config())
            settings["group.id"] = config.job.metadata_group_id
            settings["enable.auto.commit"] = False
            return KafkaMetadataStore(settings)

        result: MetadataStore = cached(("store", config.job.metadata_group_id,
                                        config.kafka.bootstrap_servers), make)
        return result

    def sink(self, config: Config, topic: TopicConfig) -> BlockSink:
        def make() -> BlockSink:
            sink: BlockSink = make_writer(config, topic)
            if config.dead_letters.topic:
                from blockagg.aggregator.kafka.dlq_topic import (
                    DeadLetterTopic,
                    DeadLetterTopicSink,
                )

                sink = DeadLetterTopicSink(
                    sink, DeadLetterTopic(config.kafka.librdkafka_config(),
                                          config.dead_letters.topic))
            return sink

        result: BlockSink = cached(("sink", topic.label, *map(str, topic.replicas)), make)
        return result

    def registry(self, config: Config) -> TableRegistry:
        def make() -> TableRegistry:
            from blockagg.aggregator.kafka.log_store import from_config

            registry: TableRegistry = from_config(config)
            return registry

        result: TableRegistry = cached(("registry", config.schemas.topic), make)
        return result

    def incarnation(self, config: Config, topic: str) -> int:
        """The topic's current incarnation, read from Kafka at every batch (a
        recreated topic must be noticed by the next one)."""
        def make() -> Any:
            from blockagg.aggregator.kafka.incarnation import TopicIncarnations

            return TopicIncarnations(config.kafka.librdkafka_config())

        reader = cached(("incarnations", config.kafka.bootstrap_servers), make)
        return int(reader.of(topic))

    def dedup_mode(self, config: Config, topic: TopicConfig) -> int:
        """How the shard's server recognises a retried block now (asked per batch)."""
        return int(describer(config, topic).dedup_mode())

    def structure_mark(self, config: Config, topic: TopicConfig, tables: Sequence[str]) -> int:
        """The ZooKeeper mark of ``tables``' columns, read before a batch's first
        attempts (``Pins.structure``, ``aggregator.clickhouse.structure``)."""
        return int(describer(config, topic).structure_mark(tables))

    def dedup_windows(self, config: Config, topic: TopicConfig, tables: Sequence[str]
                      ) -> dict[str, DedupWindow]:
        """The deduplication window of each of ``tables`` on the shard, as the worker's
        :func:`describer` last checked it (``spark.task.live_columns`` checks every
        registered table a batch routes to), checked now when older than ``[schemas]
        refresh_interval`` or never checked (the dead-letter table): a lowered window
        reaches long-lived workers. A table that isn't on the shard has none."""
        from blockagg.aggregator.clickhouse.exceptions import TableNotFound

        writer = describer(config, topic)
        ttl = config.schemas.refresh_interval
        found: dict[str, DedupWindow] = {}
        for table in tables:
            window = writer.dedup_window(table, ttl)
            if window is None:
                try:
                    writer.check_tables([table])
                except TableNotFound:
                    continue
                window = writer.dedup_window(table)
            if window is not None:
                found[table] = window
        return found


    def stored_coordinates(self, config: Config, topic: TopicConfig, tables: Sequence[str],
                           name: str, partition: int, start: int) -> list[Any]:
        """The rows of ``name[partition]`` from offset ``start`` on in those of
        ``tables`` that can't tell topic incarnations apart
        (``aggregator.clickhouse.stored``): asked when a partition starts without a
        blockagg commit, under content-hash deduplication."""
        return list(describer(config, topic).stored_coordinates(tables, name, partition,
                                                                start))


def insert_lanes(config: Config) -> Lanes:
    """How many inserts of one seal event run at once (``clickhouse.insert_concurrency``):
    threads kept per worker process, so each lane's connections stay warm. With
    ``clickhouse.executor_insert_concurrency``, every insert also holds one of the
    executor's permits (:func:`executor_permits_dir`)."""
    from blockagg.aggregator.core.protocol import SERIAL
    from blockagg.aggregator.lanes import SharedPermits, ThreadLanes

    width = config.clickhouse.insert_concurrency
    shared = config.clickhouse.executor_insert_concurrency
    if width == 1 and not shared:
        return SERIAL
    if not shared:
        lanes: Lanes = cached(("lanes", str(width)), lambda: ThreadLanes(width))
        return lanes
    directory = executor_permits_dir(shared)
    lanes = cached(("lanes", str(width), str(directory)),
                   lambda: ThreadLanes(width, SharedPermits(directory, shared)))
    return lanes


def executor_permits_dir(count: int) -> Path:
    """Where this executor's insert permits live: in its Spark files directory, which
    every Python worker of one executor shares and no other executor or application
    does (``SparkFiles.getRootDirectory``; the system's temporary directory outside a
    Spark task). The count is in the name, so a job restarted with another count
    never shares permits with one still running the old."""
    root: str | None = None
    try:
        from pyspark import SparkFiles

        root = SparkFiles.getRootDirectory()
    except Exception:  # not in a Spark worker (tests, the driver's own ranges)
        root = None
    base = Path(root) if root else Path(tempfile.gettempdir()) / f"blockagg-{os.getuid()}"
    return base / f"insert-permits-{count}"


class Attempt(MetadataStore, Fence, Protocol):
    """A metadata store bound to one task attempt at one partition, which fenced every
    older attempt when it opened (``aggregator.kafka.fencing.FencedAttempt``).
    ``nonce`` is written into each of its commits (``plan_batch(..., attempt=nonce)``)
    so its confirms recognise its own commits only."""

    nonce: int

    def close(self) -> None: ...


def open_attempt(store: MetadataStore, topic: str, partition: int) -> Attempt | None:
    """Open this task's fenced attempt at the partition, when ``store`` fences
    (``attempt(topic, partition)``, as the Kafka store does); ``None`` for a store that
    does not (test fakes). Called before the task reads anything the batch depends on."""
    opener = getattr(store, "attempt", None)
    if opener is None:
        return None
    attempt: Attempt = opener(topic, partition)
    return attempt


def make_writer(config: Config, topic: TopicConfig) -> Any:
    """The ClickHouse writer of ``topic``'s shard (``aggregator.clickhouse.writer``)."""
    from blockagg.aggregator.clickhouse.writer import (
        ClickHouseBlockWriter,
        Replica,
        WriterConfig,
    )
    from blockagg.tls import tls_arguments

    ch = config.clickhouse
    quorum = config.insert_quorum_for(topic)
    return ClickHouseBlockWriter(WriterConfig(
        replicas=tuple(Replica(r.host, r.port) for r in topic.replicas),
        user=ch.user,
        password=ch.password.reveal(),
        insert_quorum=quorum,
        insert_quorum_timeout_ms=int(ch.insert_quorum_timeout * 1000),
        max_attempts=ch.retries + 1,
        backoff_initial_s=ch.retry_backoff,
        connect_timeout_s=ch.connect_timeout,
        send_receive_timeout_s=ch.send_receive_timeout,
        ping_after_idle_s=ch.ping_after_idle,
        tls=tls_arguments(ch.secure, ch.verify, ch.ca_certs),
        dead_letter_table=config.dead_letters.table,
        extra_settings=dict(ch.settings),
        replay_across_alter=ch.replay_across_alter,
        expired_replay=ch.expired_replay,
        allow_without_coordinates=frozenset(ch.allow_tables_without_coordinates),


        allow_stored_coordinates=ch.allow_stored_coordinates,
        shared_with_other_kafka_clusters=ch.shared_with_other_kafka_clusters,
    ))


def describer(config: Config, topic: TopicConfig) -> Any:
    """A writer used only to read live table columns (cached per worker)."""
    return cached(("describer", topic.label, *map(str, topic.replicas)),
                  lambda: make_writer(config, topic))


class StaticRegistry:
    """A fixed table -> id map (tests, and a registry-less dry run)."""

    def __init__(self, tables: dict[str, int]) -> None:
        self.tables = dict(tables)

    def table_id(self, table: str) -> int | None:
        return self.tables.get(table)


PIN_CAPABILITIES: tuple[str, ...] = ("incarnation", "dedup_mode", "structure_mark",
                                     "dedup_windows")
"""What the task asks of its components to pin a batch (``spark.task.current_pins``)
and to bound its blocks by the deduplication windows (``spark.task.block_shares``);
components without one pin or bound nothing there, silently: a hook must forward
them."""


def missing_pins(components: object) -> list[str]:
    """The pin capabilities ``components`` lacks (a custom ``BLOCKAGG_COMPONENTS``)."""
    return [name for name in PIN_CAPABILITIES if not callable(getattr(components, name, None))]


def load_components(spec: str) -> Components:
    """``"module:attr"`` -> the Components it names (an instance, or a class/factory
    called without arguments). The ``BLOCKAGG_COMPONENTS`` environment variable of
    ``spark/job.py`` uses it: a hook for tests and custom adapters."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        raise BlockaggError(f"BLOCKAGG_COMPONENTS: expected module:attr, got {spec!r}")
    target = getattr(importlib.import_module(module_name), attr)
    made = target() if callable(target) else target
    return made  # type: ignore[no-any-return]
