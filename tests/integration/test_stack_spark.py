"""Spark (local[2]) with the resolved spark-sql-kafka-0-10 jars reads our Kafka broker."""

from __future__ import annotations

from typing import Any

import pytest

from blockagg.spark.zip_imports import eagerly_reread
from tests.integration.conftest import ProducedTopic

pytestmark = pytest.mark.integration


def test_spark_batch_kafka_read_sees_every_message_with_partition_and_offset(
    spark_session: Any, kafka_bootstrap: str, produced_topic: ProducedTopic
) -> None:
    df = (
        spark_session.read.format("kafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("subscribe", produced_topic.topic)
        .option("startingOffsets", "earliest")
        .option("endingOffsets", "latest")
        .load()
    )
    rows = df.select("key", "value", "topic", "partition", "offset").collect()
    seen = sorted((bytes(r.key), bytes(r.value), r.partition, r.offset) for r in rows)
    want = sorted((m.key, m.value, m.partition, m.offset) for m in produced_topic.messages)
    assert seen == want
    assert {r.topic for r in rows} == {produced_topic.topic}


def zip_reads_at_task_start(rows: Any) -> Any:
    """In a Spark Python worker: on its first task, count every zip directory read from
    then on and keep the archives' directories (as a batch's task does); on every task,
    report (worker pid, reads so far, the zip importers on its import path)."""
    import os
    import sys
    import zipimport

    for _ in rows:  # a worker whose input is left unread is not reused
        pass
    from blockagg.spark.zip_imports import keep_zip_directories

    reads: list[int] | None = getattr(zipimport, "_test_reads", None)
    if reads is None:
        reads = [0]
        inner = zipimport._read_directory  # type: ignore[attr-defined]

        def counted(path: str) -> Any:
            reads[0] += 1
            return inner(path)

        zipimport._read_directory = counted  # type: ignore[attr-defined]
        setattr(zipimport, "_test_reads", reads)  # noqa: B010
        keep_zip_directories()
    importers = sum(isinstance(f, zipimport.zipimporter)
                    for f in sys.path_importer_cache.values())
    yield (os.getpid(), reads[0], importers)


@pytest.mark.skipif(not eagerly_reread(), reason="this interpreter reads zip directories lazily")
def test_a_reused_python_worker_does_not_read_sparks_zip_archives_again_at_each_task(
        spark_session: Any) -> None:
    """PySpark's worker calls ``importlib.invalidate_caches()`` before every task, which
    on CPython 3.10/3.11 re-reads pyspark.zip, py4j's zip and the spark-core jar
    (docs/BENCHMARKS.md, *Each task's start*). From a worker's third task on (its first
    installs the change, its second reads each archive once more to know its state),
    no task start reads an archive again."""
    sc = spark_session.sparkContext
    by_worker: dict[int, list[tuple[int, int]]] = {}
    for _ in range(6):
        for pid, reads, importers in sc.parallelize([0, 1], 2).mapPartitions(
                zip_reads_at_task_start).collect():
            by_worker.setdefault(pid, []).append((reads, importers))
    seen = {pid: runs for pid, runs in by_worker.items() if len(runs) >= 3}
    assert seen, f"no Python worker served 3 tasks: {by_worker}"
    for pid, runs in seen.items():
        assert all(importers > 0 for _, importers in runs), (pid, runs)
        assert [reads for reads, _ in runs[2:]] == [runs[1][0]] * len(runs[2:]), (pid, runs)
