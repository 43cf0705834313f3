"""The Block Aggregator: per Kafka partition, route messages into per-table blocks,
commit the intent to flush (metadata with the resume offset) to Kafka, then insert
the blocks into ClickHouse, replaying the last committed blocks identically after a
crash. ``aggregator.core`` is the pure protocol (no I/O); ``aggregator.kafka`` and
``aggregator.clickhouse`` are the thin adapters that execute its operations.
"""
