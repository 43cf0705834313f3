"""The pure core of the aggregator: block formation, the metadata codec, and the
REPLAY -> CONSUME protocol for one topic-partition. Nothing here performs I/O: the
protocol yields small frozen operations (commit this metadata, insert this block)
that a runner executes against a ``MetadataStore`` and a ``BlockSink``.
"""
