"""Protobuf on the wire: the envelope producers write (``blockagg/v1/envelope.proto``),
the schema registry that maps ClickHouse tables to protobuf message types (stored in
a compacted Kafka topic and checked against the live table's columns), the
``ba-schema`` CLI, and the decoder that turns a block's encoded rows into columns.
"""
