"""Fencing against the real broker: a newer attempt's ``init_transactions`` fences the
older attempt's commits and inserts, an aborted transactional commit never reaches a
``read_committed`` reader, and ``arv verify`` decodes a history written in
transactions (offset commits followed by commit markers) as it decodes plain ones."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator

import pytest
from click.testing import CliRunner
from confluent_kafka import Producer, TopicPartition

from blockagg.aggregator.core.metadata import BlockRange, Metadata, encode
from blockagg.aggregator.kafka.exceptions import AttemptFenced, MetadataUnstable
from blockagg.aggregator.kafka.fencing import FencedAttempt
from blockagg.aggregator.kafka.hanging import offsets_partition
from blockagg.aggregator.kafka.metadata_store import KafkaMetadataStore
from blockagg.verifier.cli import cli
from blockagg.verifier.history import HistoryReader
from blockagg.verifier.rules import Commit

pytestmark = pytest.mark.integration

B = BlockRange


@pytest.fixture
def store(kafka_bootstrap: str) -> Iterator[KafkaMetadataStore]:
    group = f"blockagg-fence-{uuid.uuid4().hex[:10]}"
    with KafkaMetadataStore({"bootstrap.servers": kafka_bootstrap, "group.id": group},
                            timeout=15.0) as metadata_store:
        yield metadata_store


@pytest.fixture
def data_topic(new_topic: Callable[..., str], kafka_bootstrap: str) -> str:
    topic = new_topic(partitions=1, prefix="fence")
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(400):
        producer.produce(topic, value=b"m%d" % i, partition=0)
    assert producer.flush(30) == 0
    return topic


def test_a_newer_attempt_fences_the_older_one(store: KafkaMetadataStore,
                                              data_topic: str,
                                              capfd: pytest.CaptureFixture[str]) -> None:
    old = store.attempt(data_topic, 0)
    intent = encode(Metadata(7, 0, 100, 200, 100, (B(1, 100, 150),)))
    old.commit(data_topic, 0, 100, intent)
    old.confirm(data_topic, 0)
    newer = store.attempt(data_topic, 0)
    assert newer.committed(data_topic, 0) is not None
    with pytest.raises(AttemptFenced, match="newer attempt"):
        old.commit(data_topic, 0, 150, encode(Metadata(7, 0, 100, 200, 151)))
    old.confirm(data_topic, 0)  # nothing newer committed yet: its intent is still current
    final = encode(Metadata(7, 0, 100, 200, 200))
    newer.commit(data_topic, 0, 200, final)
    with pytest.raises(AttemptFenced, match="no longer this attempt's intent"):
        old.confirm(data_topic, 0)
    last = store.committed(data_topic, 0)
    assert last is not None and (last.offset, last.metadata) == (200, final)
    old.close()
    newer.close()
    # librdkafka's own lines (the fenced producer's FATAL among them) go through the
    # job's logger, never straight to stderr as "%0|...|FATAL|..." (issue 26).
    assert "|FATAL|" not in capfd.readouterr().err


def test_arv_verify_reads_transactional_commits_and_skips_aborted_ones(
    store: KafkaMetadataStore, data_topic: str, kafka_bootstrap: str
) -> None:
    history = [
        Metadata(7, 0, 100, 200, 100, (B(1, 100, 150), B(2, 105, 160))),
        Metadata(7, 0, 100, 200, 105, (B(1, 151, 199), B(2, 105, 160))),
        Metadata(7, 0, 100, 200, 200),
    ]
    first = store.attempt(data_topic, 0)
    for metadata in history:
        first.commit(data_topic, 0, metadata.resume, encode(metadata))
    # A zombie's commit left in an open transaction (Backward if it were ever visible),
    # aborted when the next attempt initialises the transactional id.
    zombie = FencedAttempt(store, data_topic, 0)
    producer = zombie._producer
    producer.begin_transaction()
    backward = Metadata(7, 0, 100, 200, 100, (B(1, 100, 150),))
    producer.send_offsets_to_transaction(
        [TopicPartition(data_topic, 0, 100, metadata=encode(backward))],
        store.group_metadata(), 15)
    later = store.attempt(data_topic, 0)
    after = Metadata(7, 1, 200, 300, 300)
    later.commit(data_topic, 0, 300, encode(after))
    result = CliRunner().invoke(cli, ["verify", "--bootstrap-servers", kafka_bootstrap,
                                      "--group", store.group_id, "--json"])
    findings = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert result.exit_code == 0, (result.stdout, result.stderr)
    assert findings == []
    with HistoryReader(kafka_bootstrap, [store.group_id], [data_topic]) as reader:
        seen = [(e.offset, e.metadata.rstrip("\x00"))
                for e in reader.events() if isinstance(e, Commit)]
    assert seen == [(m.resume, encode(m)) for m in [*history, after]]
    last = store.committed(data_topic, 0)
    assert last is not None and last.offset == 300


def test_a_transaction_on_the_group_that_does_not_end_is_named_with_its_remedy(
        kafka_bootstrap: str, data_topic: str) -> None:
    """A transactional offset commit on the metadata group held open (as a hanging one
    is, forever): a stable read is refused as ``MetadataUnstable`` naming the group's
    ``__consumer_offsets`` partition and the remedy, not a bare "Timed out"; once the
    transaction is aborted, the same store reads again."""
    group = f"blockagg-hang-{uuid.uuid4().hex[:10]}"
    store = KafkaMetadataStore({"bootstrap.servers": kafka_bootstrap, "group.id": group},
                               timeout=5.0, retries=1)
    producer = Producer({"bootstrap.servers": kafka_bootstrap,
                         "transactional.id": f"hang-{uuid.uuid4().hex[:10]}",
                         "transaction.timeout.ms": 120_000})
    try:
        producer.init_transactions(30)
        producer.begin_transaction()
        producer.send_offsets_to_transaction([TopicPartition(data_topic, 0, 5)],
                                             store.group_metadata(), 30)
        with pytest.raises(MetadataUnstable) as info:
            store.committed(data_topic, 0)
        text = str(info.value)
        offsets_topic = Producer({"bootstrap.servers": kafka_bootstrap}).list_topics(
            "__consumer_offsets", timeout=30).topics["__consumer_offsets"]
        where = offsets_partition(group, len(offsets_topic.partitions))
        assert f"hanging transaction in __consumer_offsets-{where}" in text
        assert group in text and "kafka-transactions.sh find-hanging" in text
        producer.abort_transaction(30)
        assert store.committed(data_topic, 0) is None
    finally:
        store.close()
