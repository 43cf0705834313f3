"""Prometheus metrics of the job, exposed by the driver (``[metrics] port``).

Tasks run in executors, so they never touch these objects: each task returns a report
dict (see ``spark.task``) and the driver folds the reports of a batch into the
metrics here. Every name has the ``blockagg_`` prefix; counters end in ``_total``,
durations are in seconds and sizes in bytes, as Prometheus names them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_BATCH_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)


class JobMetrics:
    """The job's metrics on their own registry (tests make several)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry or CollectorRegistry()
        self.registry = r
        self.rows_consumed = Counter(
            "blockagg_rows_consumed_total", "Rows read from Kafka, per table.",
            ["topic", "table"], registry=r)
        self.bytes_consumed = Counter(
            "blockagg_bytes_consumed_total", "Encoded message bytes read from Kafka, per table.",
            ["topic", "table"], registry=r)
        self.messages_consumed = Counter(
            "blockagg_messages_consumed_total", "Kafka messages read, per topic.",
            ["topic"], registry=r)
        self.rows_inserted = Counter(
            "blockagg_rows_inserted_total",
            "Rows in blocks acknowledged by ClickHouse (replays included), per table.",
            ["topic", "table"], registry=r)
        self.bytes_inserted = Counter(
            "blockagg_bytes_inserted_total", "Encoded bytes of acknowledged blocks, per table.",
            ["topic", "table"], registry=r)
        self.blocks_inserted = Counter(
            "blockagg_blocks_inserted_total", "Blocks acknowledged by ClickHouse, per table.",
            ["topic", "table"], registry=r)
        self.blocks_replayed = Counter(
            "blockagg_blocks_replayed_total",
            "Blocks rebuilt from committed metadata and inserted again (REPLAY), per table.",
            ["topic", "table"], registry=r)
        self.block_rows = Histogram(
            "blockagg_block_rows", "Rows per inserted block.", ["topic"],
            buckets=(10, 100, 1e3, 1e4, 1e5, 1e6, 1e7), registry=r)
        self.dead_letters = Counter(
            "blockagg_dead_letters_total", "Messages sent to the dead-letter table, by reason.",
            ["topic", "reason"], registry=r)
        self.commit_latency = Histogram(
            "blockagg_metadata_commit_duration_seconds",
            "Latency of one metadata commit to Kafka.", ["topic"],
            buckets=_LATENCY_BUCKETS, registry=r)
        self.commit_failures = Counter(
            "blockagg_metadata_commit_failures_total",
            "Metadata commits that raised (retried or failed the task).", ["topic"],
            registry=r)
        self.insert_latency = Histogram(
            "blockagg_insert_duration_seconds", "Latency of one block insert, per table.",
            ["topic", "table"], buckets=_LATENCY_BUCKETS, registry=r)
        self.clickhouse_errors = Counter(
            "blockagg_clickhouse_errors_total", "ClickHouse errors by server error code.",
            ["code"], registry=r)
        self.lag = Gauge(
            "blockagg_consumer_lag_offsets",
            "Offsets between the partition's latest (read_committed) offset and the end of "
            "the last completed micro-batch.", ["topic", "partition"], registry=r)
        self.resume_offset = Gauge(
            "blockagg_resume_offset", "Resume offset committed after the last batch.",
            ["topic", "partition"], registry=r)
        self.batch_duration = Histogram(
            "blockagg_batch_duration_seconds", "Wall time of one micro-batch in foreachBatch.",
            buckets=_BATCH_BUCKETS, registry=r)
        self.batches = Counter(
            "blockagg_batches_total", "Micro-batches by outcome (ok, failed).", ["outcome"],
            registry=r)
        self.last_batch_id = Gauge(
            "blockagg_last_batch_id", "Id of the last completed micro-batch.", registry=r)
        self.last_batch_timestamp = Gauge(
            "blockagg_last_batch_timestamp_seconds",
            "Unix time the last micro-batch completed.", registry=r)
        self.partitions_refused = Counter(
            "blockagg_batches_refused_total",
            "Batches the protocol refused (gap, metadata ahead, ...), by reason.",
            ["reason"], registry=r)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Expose ``/metrics`` on ``host:port`` (no-op for port 0)."""
        if port:
            start_http_server(port, addr=host, registry=self.registry)

    def observe_reports(self, reports: Iterable[Mapping[str, Any]]) -> None:
        """Fold task reports (``spark.task.report``) into the metrics."""
        for rep in reports:
            topic = str(rep["topic"])
            self.messages_consumed.labels(topic).inc(rep["messages"])
            for table, figures in rep["consumed"].items():
                self.rows_consumed.labels(topic, table).inc(figures[0])
                self.bytes_consumed.labels(topic, table).inc(figures[1])
            for table, figures in rep["inserted"].items():
                rows, size, blocks, replayed = figures
                self.rows_inserted.labels(topic, table).inc(rows)
                self.bytes_inserted.labels(topic, table).inc(size)
                self.blocks_inserted.labels(topic, table).inc(blocks)
                if replayed:
                    self.blocks_replayed.labels(topic, table).inc(replayed)
            for rows in rep["block_rows"]:
                self.block_rows.labels(topic).observe(rows)
            for table, seconds in rep["insert_seconds"]:
                self.insert_latency.labels(topic, table).observe(seconds)
            for seconds in rep["commit_seconds"]:
                self.commit_latency.labels(topic).observe(seconds)
            if rep["commit_failures"]:
                self.commit_failures.labels(topic).inc(rep["commit_failures"])
            for reason, count in rep["dead_letters"].items():
                self.dead_letters.labels(topic, reason).inc(count)
            for code, count in rep["clickhouse_errors"].items():
                self.clickhouse_errors.labels(str(code)).inc(count)
            self.resume_offset.labels(topic, str(rep["partition"])).set(rep["end"])
