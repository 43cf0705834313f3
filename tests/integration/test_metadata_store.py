"""The Kafka MetadataStore against the real broker: commits carry our metadata and read
back unchanged, a fresh group has no commit, oversized metadata is refused naming
offset.metadata.max.bytes, and a whole batch runs through the protocol, crashing after
its intent and retried, with the real consumer group as the metadata store."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest

from blockagg.aggregator.core.exceptions import MetadataTooLarge
from blockagg.aggregator.core.metadata import (
    DEFAULT_MAX_BYTES,
    BlockRange,
    Metadata,
    decode,
    encode,
    longest_metadata,
)
from blockagg.aggregator.core.model import Thresholds
from blockagg.aggregator.core.protocol import plan_batch, process_batch
from blockagg.aggregator.kafka.exceptions import OffsetMetadataTooLarge
from blockagg.aggregator.kafka.metadata_store import KafkaMetadataStore
from tests.unit.core.fakes import (
    DedupSink,
    expected_rows,
    make_batch,
    metadata_of_length,
    run_crashing,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def store(kafka_bootstrap: str) -> Iterator[KafkaMetadataStore]:
    group = f"blockagg-test-{uuid.uuid4().hex[:10]}"
    with KafkaMetadataStore(
        {"bootstrap.servers": kafka_bootstrap, "group.id": group}, timeout=15.0
    ) as metadata_store:
        yield metadata_store


def test_fresh_group_has_no_commit(store: KafkaMetadataStore,
                                   new_topic: Callable[..., str]) -> None:
    assert store.committed(new_topic(prefix="ms"), 0) is None


def test_commit_round_trips_offset_and_metadata(store: KafkaMetadataStore,
                                                new_topic: Callable[..., str]) -> None:
    topic = new_topic(partitions=2, prefix="ms")
    metadata = Metadata(7, 3, 100, 200, 120, (BlockRange(1, 120, 150), BlockRange(9, 130, 199)))
    store.commit(topic, 1, 120, encode(metadata))
    committed = store.committed(topic, 1)
    assert committed is not None and committed.offset == 120
    assert decode(committed.metadata) == metadata
    assert store.committed(topic, 0) is None


def test_metadata_over_the_broker_limit_is_refused_naming_the_setting(
    store: KafkaMetadataStore, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(prefix="ms")
    with pytest.raises(OffsetMetadataTooLarge, match=r"offset\.metadata\.max\.bytes"):
        store.commit(topic, 0, 1, "x" * 5000)


def test_the_encoders_limit_is_the_brokers_less_the_clients_nul(
    store: KafkaMetadataStore, new_topic: Callable[..., str]
) -> None:
    """offset.metadata.max.bytes = 4096 (the stack's broker runs the default): the
    client's trailing NUL counts, so 4095 characters are accepted and 4096 refused
    by the broker; our encoder refuses what the broker would, before any commit."""
    topic = new_topic(prefix="ms")
    longest = longest_metadata(DEFAULT_MAX_BYTES)
    store.commit(topic, 0, 1, "x" * longest)
    with pytest.raises(OffsetMetadataTooLarge):
        store.commit(topic, 0, 1, "x" * (longest + 1))
    fits = encode(metadata_of_length(longest))
    store.commit(topic, 0, 1_000_000, fits)
    committed = store.committed(topic, 0)
    assert committed is not None and committed.metadata == fits
    with pytest.raises(MetadataTooLarge, match=r"offset\.metadata\.max\.bytes"):
        encode(metadata_of_length(longest + 1))


def test_500_table_metadata_is_accepted_by_the_broker(
    store: KafkaMetadataStore, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(prefix="ms")
    start, end = 1_000_000, 1_100_000
    blocks = tuple(BlockRange(t, start + 100 * t, end - 1 - 30 * t) for t in range(1, 501))
    text = encode(Metadata(1, 1, start, end, start + 100, blocks))
    store.commit(topic, 0, start + 100, text)
    committed = store.committed(topic, 0)
    assert committed is not None and committed.metadata == text


def test_the_broker_counts_characters_so_a_4095_character_version_3_string_fits(
    store: KafkaMetadataStore, new_topic: Callable[..., str]
) -> None:
    """Version 3's characters take 3 bytes in UTF-8, but the broker compares
    String.length() (UTF-16 units) with offset.metadata.max.bytes: 4095 of them pass,
    4096 are refused, and the string reads back unchanged."""
    topic = new_topic(prefix="ms")
    wide = "\u4e00" * longest_metadata(DEFAULT_MAX_BYTES)
    store.commit(topic, 0, 1, wide)
    committed = store.committed(topic, 0)
    assert committed is not None and committed.metadata == wide
    with pytest.raises(OffsetMetadataTooLarge):
        store.commit(topic, 0, 1, wide + "\u4e00")


def test_1000_table_metadata_is_accepted_by_the_broker(
    store: KafkaMetadataStore, new_topic: Callable[..., str]
) -> None:
    """Every block's ends anywhere in a million-offset batch (the worst case)."""
    topic = new_topic(prefix="ms")
    start, end = 1_000_000, 2_000_000
    blocks = tuple(BlockRange(t, start + (t * 7_919**2) % 500_000,
                              end - 1 - (t * 104_729) % 400_000) for t in range(1, 1_001))
    text = encode(Metadata(2**64 - 1, 1, start, end, start, blocks))
    assert len(text) <= 4095 and len(text.encode()) > 4096
    store.commit(topic, 0, start, text)
    committed = store.committed(topic, 0)
    assert committed is not None and decode(committed.metadata) == decode(text)


def test_the_brokers_offset_metadata_max_bytes_is_read_at_start(kafka_bootstrap: str) -> None:
    from blockagg.config import loads
    from blockagg.spark.preflight import broker_metadata_max_bytes

    config = loads(f"""
[job]
checkpoint_location = "/tmp/ck"
[kafka]
"bootstrap.servers" = "{kafka_bootstrap}"
[[topics]]
name = "orders"
replicas = ["ch:9000"]
""")
    assert broker_metadata_max_bytes(config) == DEFAULT_MAX_BYTES


def test_batch_crashed_after_its_intent_is_retried_exactly_once(
    store: KafkaMetadataStore, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(prefix="ms")
    messages = [(o, 1 + o % 4, 1 + o % 3) for o in range(200) if o % 17]
    batch = make_batch(messages, 0, 200, topic=topic)
    thresholds = Thresholds(max_rows=40, max_bytes=10**6)
    sink = DedupSink()
    plan = plan_batch(batch, store.committed(topic, 0), thresholds, run=1, batch_id=0)
    assert not run_crashing(plan, store, sink, at=2, after=True)
    report = process_batch(batch, store, sink, thresholds, run=2, batch_id=0)
    assert report.replayed_blocks > 0
    assert sink.rows == expected_rows(messages)
    committed = store.committed(topic, 0)
    assert committed is not None and committed.offset == 200
    assert decode(committed.metadata).is_final
