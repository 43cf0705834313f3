"""The job's adapters with exactly-once switched off, for the end-to-end benchmark.

``BLOCKAGG_COMPONENTS=bench.e2e_components:at_least_once`` keeps the real ClickHouse
writer and schema registry but replaces the metadata store by one that never commits
and never returns a previous commit: no metadata, no intent before flush, no REPLAY.
Progress then lives only in Spark's checkpoint, committed after ``foreachBatch``
returns, which is what a plain Spark ``foreachBatch`` sink into ClickHouse does: at
least once (a crash between the inserts and the checkpoint commit re-inserts the
batch; blocks are still deterministic here, so ClickHouse would often drop them, but
nothing guarantees it). The difference between the two runs is the cost of the
guarantee: the synchronous metadata commits to Kafka and the replay check.
"""

from __future__ import annotations

from dataclasses import dataclass

from blockagg.aggregator.core.model import BlockSink, Committed, MetadataStore
from blockagg.config import Config, TopicConfig
from blockagg.spark.components import DefaultComponents, TableRegistry


class NoMetadataStore:
    """Commits nothing; has never committed anything."""

    def committed(self, topic: str, partition: int) -> Committed | None:
        return None

    def commit(self, topic: str, partition: int, offset: int, metadata: str) -> None:
        return None


@dataclass(frozen=True)
class AtLeastOnce:
    inner: DefaultComponents

    def store(self, config: Config) -> MetadataStore:
        return NoMetadataStore()

    def sink(self, config: Config, topic: TopicConfig) -> BlockSink:
        return self.inner.sink(config, topic)

    def registry(self, config: Config) -> TableRegistry:
        return self.inner.registry(config)


def at_least_once() -> AtLeastOnce:
    return AtLeastOnce(DefaultComponents())
