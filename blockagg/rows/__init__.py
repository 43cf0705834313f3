"""The rows stage: how a Kafka message becomes typed columns and dead-letter decisions.

Pure (no ClickHouse connection, no Kafka client): envelopes and the pinned registry
view in (``blockagg.proto``), per (table, version) columns in ClickHouse's Native
layout and the dead letters with their reasons out, for the core to cut into blocks
and the adapters to send. ``prepare`` is the stage's entry, ``columns`` the decode
plans, ``types`` the ClickHouse type system that converts protobuf values,
``layout`` the columns' in-memory Native layout, ``deadletters`` and
``deadletter_rate`` the dead-letter policy.
"""
