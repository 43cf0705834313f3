"""The planned ``[from, until)`` of each micro-batch, read from Spark's real offset log.

Proves on Spark + Kafka that:
* the first batch of a new checkpoint starts at the ``startingOffsets`` JSON computed
  from the metadata group's commits (committed partitions at their resume offset, the
  others at the default), and its start is read back from ``sources/0/0``;
* a range that ends in a transaction marker, and one that holds only an aborted
  transaction (no visible row at all), get their true planned end;
* a restarted query (same checkpoint) plans from the previous batch's end.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from blockagg.spark.offsets import (
    OffsetLog,
    PlannedRange,
    list_partitions,
    make_consumer,
    read_committed,
    starting_offsets_json,
)

pytestmark = pytest.mark.integration


def _transactional(bootstrap: str) -> Any:
    from confluent_kafka import Producer

    producer = Producer(
        {"bootstrap.servers": bootstrap, "transactional.id": f"it-{uuid.uuid4().hex[:8]}"}
    )
    producer.init_transactions(30)
    return producer


def _txn(producer: Any, topic: str, partition: int, n: int, commit: bool) -> None:
    producer.begin_transaction()
    for i in range(n):
        producer.produce(topic, value=f"m{i}".encode(), partition=partition)
    producer.flush(30)
    if commit:
        producer.commit_transaction(30)
    else:
        producer.abort_transaction(30)


def _commit(bootstrap: str, group: str, topic: str, partition: int, offset: int) -> None:
    from confluent_kafka import TopicPartition

    consumer = make_consumer({"bootstrap.servers": bootstrap}, group)
    try:
        consumer.commit(offsets=[TopicPartition(topic, partition, offset, "ba1:test")],
                        asynchronous=False)
    finally:
        consumer.close()


def _run_query(
    spark: Any, bootstrap: str, topic: str, checkpoint: str, starting: str,
    until: Callable[[list[tuple[int, dict[tuple[str, int], PlannedRange], list[Any]]]], bool],
    between: Callable[[int], None] | None = None,
) -> list[tuple[int, dict[tuple[str, int], PlannedRange], list[Any]]]:
    """Run a query until ``until(seen)``; record (batch id, planned ranges, rows)."""
    seen: list[tuple[int, dict[tuple[str, int], PlannedRange], list[Any]]] = []
    log = OffsetLog(spark, checkpoint)
    done = threading.Event()

    def on_batch(df: Any, batch_id: int) -> None:
        ranges = log.planned_ranges(batch_id)
        rows = df.select("partition", "offset").collect()
        seen.append((batch_id, ranges, sorted((r.partition, r.offset) for r in rows)))
        if between is not None:
            between(batch_id)
        if until(seen):
            done.set()

    df = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", starting)
        .option("kafka.isolation.level", "read_committed")
        .option("failOnDataLoss", "true")
        .load()
    )
    query = (
        df.writeStream.foreachBatch(on_batch)
        .option("checkpointLocation", checkpoint)
        .trigger(processingTime="500 milliseconds")
        .start()
    )
    try:
        deadline = time.monotonic() + 120
        while not done.is_set() and time.monotonic() < deadline:
            if query.exception() is not None:
                raise AssertionError(f"query failed: {query.exception()}")
            time.sleep(0.2)
        assert done.is_set(), f"timed out; batches seen: {seen}"
        # Stop only once Spark has committed the last batch seen (commits/<id>), or a
        # restart on this checkpoint re-runs that batch, which is correct but not what
        # the caller asserts on.
        committed = Path(checkpoint) / "commits" / str(seen[-1][0])
        while not committed.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert committed.exists(), f"Spark did not commit batch {seen[-1][0]} in time"
    finally:
        query.stop()
    return seen


def _covered(seen: list[Any], tp: tuple[str, int]) -> int:
    ends = [ranges[tp].end for _, ranges, _ in seen if tp in ranges]
    return max(ends) if ends else -1


def test_planned_ranges_with_markers_and_restart(
    spark_session: Any, kafka_bootstrap: str, new_topic: Callable[..., str], tmp_path: Path
) -> None:
    topic = new_topic(partitions=3, prefix="offsets")
    group = f"it-offsets-{uuid.uuid4().hex[:8]}"
    producer = _transactional(kafka_bootstrap)
    # p0: 5 committed records + marker: offsets 0..4 visible, 5 is the marker -> end 6.
    _txn(producer, topic, 0, 5, commit=True)
    # p1: aborted transaction of 3 + abort marker: offsets 0..3, nothing visible -> end 4.
    _txn(producer, topic, 1, 3, commit=False)
    # p2: 4 committed + marker (end 6? no: 4 records + marker = end 5); committed offset 2.
    _txn(producer, topic, 2, 4, commit=True)
    _commit(kafka_bootstrap, group, topic, 2, 2)

    consumer = make_consumer({"bootstrap.servers": kafka_bootstrap}, group)
    try:
        partitions = list_partitions(consumer, lambda name: name == topic)
        committed = read_committed(consumer, partitions)
    finally:
        consumer.close()
    assert partitions == [(topic, 0), (topic, 1), (topic, 2)]
    assert committed[(topic, 2)].offset == 2
    assert committed[(topic, 2)].metadata == "ba1:test"
    starting = starting_offsets_json(
        partitions, {tp: c.offset for tp, c in committed.items()}, "earliest"
    )
    assert json.loads(starting) == {topic: {"0": -2, "1": -2, "2": 2}}

    checkpoint = str(tmp_path / "ck")
    seen = _run_query(
        spark_session, kafka_bootstrap, topic, checkpoint, starting,
        until=lambda s: all(_covered(s, (topic, p)) == e for p, e in ((0, 6), (1, 4), (2, 5))),
    )
    first_id, first, rows = seen[0]
    assert first_id == 0
    assert first[(topic, 0)] == PlannedRange(topic, 0, 0, 6)
    assert first[(topic, 1)] == PlannedRange(topic, 1, 0, 4)  # only an aborted txn: no rows
    assert first[(topic, 2)] == PlannedRange(topic, 2, 2, 5)  # from the committed offset
    assert rows == [(0, o) for o in range(5)] + [(2, 2), (2, 3)]

    # Restart on the same checkpoint: the next batch starts at the previous ends, and a
    # range that ends in a commit marker after an aborted transaction is planned whole.
    _txn(producer, topic, 0, 2, commit=True)   # p0: 6,7 + marker 8 -> end 9
    _txn(producer, topic, 1, 2, commit=False)  # p1: 4,5 + marker 6 -> end 7, no rows
    seen2 = _run_query(
        spark_session, kafka_bootstrap, topic, checkpoint, starting,
        until=lambda s: _covered(s, (topic, 0)) == 9 and _covered(s, (topic, 1)) == 7,
    )
    batch_id, ranges, rows = seen2[0]
    assert batch_id >= 1
    assert ranges[(topic, 0)].start == 6 and ranges[(topic, 1)].start == 4
    all_rows = sorted(r for _, _, rs in seen2 for r in rs)
    assert all_rows == [(0, 6), (0, 7)]
    # Contiguity: every batch starts where the previous one ended, per partition.
    previous: dict[tuple[str, int], int] = {}
    for _, ranges, _ in seen + seen2:
        for tp, rng in ranges.items():
            if tp in previous:
                assert rng.start == previous[tp], (tp, rng, previous[tp])
            previous[tp] = rng.end
    log = OffsetLog(spark_session, checkpoint)
    assert log.has_offsets()
    assert log.initial_offsets() == {(topic, 0): 0, (topic, 1): 0, (topic, 2): 2}
