"""ClickHouse adapters of the aggregator: the ``BlockSink`` that inserts one block
per insert over the native protocol, with deduplication checked at startup.
"""
