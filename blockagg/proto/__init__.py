"""Protobuf on the wire: the envelope producers write (``blockagg/v1/envelope.proto``),
the schema registry's read side that maps ClickHouse tables to protobuf message types
(records of a store, pinned by position; writing them is :mod:`blockagg.registration`),
and the decoder that turns a block's encoded rows into columns.
"""
