"""The registry's tables on each shard, checked before any block is written: every
table a message can be routed to must drop a retried block (invariant 3), with a
deduplication window of at least ``2 x P`` blocks (``aggregator.clickhouse.dedup_window``)
and, on a content-hash server, the coordinate columns.

The check needs the registry (Kafka), the topics' partitions (Kafka) and the shards
(ClickHouse), not Spark: the start-up checks (``spark.preflight``) run it before the
Spark session starts, so a table that can't deduplicate is refused in seconds; the
driver runs it again only for a set of partitions it has not judged
(:meth:`TableGuard.check_tables` records the set it judged).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from blockagg import logs
from blockagg.aggregator.clickhouse.dedup_window import (
    DedupNeed,
    expected_blocks,
    replica_keys,
    shard_partitions,
)
from blockagg.config import Config, TopicConfig
from blockagg.spark.components import Components

log = logs.get("job")

TopicPartition = tuple[str, int]


class TableGuard:
    """The table check's state over one run: the shards' keys (asked once) and ``P``
    per shard (:attr:`shard_partitions`, which every task receives)."""

    def __init__(self, config: Config, components: Components) -> None:
        self.config = config
        self.components = components
        self._shard_keys: dict[str, frozenset[str]] | None = None
        self.shard_partitions: dict[str, int] = {}
        """``P`` for each topic configuration's label and each topic name read
        (``aggregator.clickhouse.dedup_window``), counted by :meth:`check_tables`."""
        self.checked: frozenset[TopicPartition] | None = None
        """The partitions the last complete :meth:`check_tables` judged the tables for."""

    def ensure_checked(self, partitions: Sequence[TopicPartition]) -> None:
        """:meth:`check_tables` unless the last check judged exactly ``partitions``
        (the start-up checks did, before Spark: the driver does not ask again)."""
        if self.checked != frozenset(partitions):
            self.check_tables(partitions)

    def shard_keys(self) -> dict[str, frozenset[str]]:
        """What identifies each topic configuration's shard (asked once per run):
        its replicas' addresses, and the identity its servers give
        (``writer.shard_identity``), so two spellings or subsets of one shard's
        replicas are grouped by ``dedup_window.shard_partitions``."""
        if self._shard_keys is None:
            from blockagg.spark.components import make_writer

            keys: dict[str, frozenset[str]] = {}
            for topic in self.config.topics:
                writer = make_writer(self.config, topic)
                try:
                    identity = writer.shard_identity(self.config.dead_letters.table)
                finally:
                    writer.close()
                keys[topic.label] = replica_keys(topic.replicas) | (
                    {identity} if identity else set())
            self._shard_keys = keys
        return self._shard_keys

    def dedup_need(self, topic: TopicConfig) -> DedupNeed:
        """What ``topic``'s shard asks of each table's deduplication window
        (``aggregator.clickhouse.dedup_window``): ``P``, every partition of every topic
        writing the shard (:attr:`shard_partitions`), and the blocks the configuration's
        batches are expected to form per partition (the sizing warning)."""
        return DedupNeed(self.shard_partitions.get(topic.label, 0),
                         expected_blocks(self.config))

    def count_shard_partitions(self, partitions: Iterable[TopicPartition]) -> None:
        """``P`` per topic configuration and per topic (:attr:`shard_partitions`, which
        every task receives in its context) over ``partitions``."""
        per_config: Counter[str] = Counter(
            self.config.topic_for(name).label for name, _ in set(partitions))
        per_shard = shard_partitions(self.shard_keys(), per_config)
        self.shard_partitions = {
            **per_shard,
            **{name: per_shard[self.config.topic_for(name).label]
               for name, _ in set(partitions)}}

    def check_tables(self, partitions: Sequence[TopicPartition]) -> None:
        """The writer's startup check on each shard, over the tables the job can route
        to there: every registered table that exists on the shard (envelopes name
        any of them; one that doesn't exist gets dead letters), and the dead-letter
        table.

        Every such table, and the dead-letter table, must drop a retried block: the
        start is refused otherwise (any envelope may name any registered table, so
        one that exists on the shard is a target). The task checks a table again
        before decoding the first message routed to it
        (:func:`spark.task.live_columns`). A deduplication window below ``2 x P``
        (``P``: the partitions writing the shard, counted here for the tasks' guard,
        :meth:`count_shard_partitions`) refuses the start (``DedupWindowTooSmall``) for
        every table, unless ``clickhouse.allow_small_dedup_window``; one below what the
        configuration's batches are expected to form is warned about. On a
        content-hash server a table without the coordinate columns refuses the start
        (``CoordinatesMissing``) unless ``clickhouse.allow_tables_without_coordinates``
        lists it."""
        registry = self.components.registry(self.config)
        current = getattr(registry, "current", None)
        if current is None:
            return
        from blockagg.aggregator.clickhouse.exceptions import (
            CoordinatesMissing,
            DedupNotConfigured,
            TableNotFound,
        )
        from blockagg.spark.components import make_writer

        dead_letter_table = self.config.dead_letters.table
        names = sorted({*current().tables().values(), dead_letter_table})
        self.count_shard_partitions(partitions)
        for topic in self.config.topics:
            writer = make_writer(self.config, topic)
            need = self.dedup_need(topic)
            try:
                for table in names:
                    try:
                        warnings = writer.check_tables(
                            [table], need, self.config.clickhouse.allow_small_dedup_window)
                    except TableNotFound:
                        continue  # not on this shard; its messages become dead letters
                    except DedupNotConfigured as exc:
                        risk = ("lost" if isinstance(exc, CoordinatesMissing)
                                else "inserted twice")
                        raise type(exc)(
                            f"{exc} (refused at start: a message routed to {table} "
                            f"could be {risk})") from None
                    for warning in warnings:
                        logs.event(log, "table check", level=30, shard=topic.label,
                                   warning=warning)
            finally:
                writer.close()
        self.checked = frozenset(partitions)
