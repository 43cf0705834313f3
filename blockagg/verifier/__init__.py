"""The Aggregator Runtime Verifier (``arv``): reads the history of committed
metadata from Kafka's ``__consumer_offsets``, orders it per group/topic/partition by
commit time, and reports Backward, Overlap and Gap anomalies; ``arv audit`` checks
ClickHouse's rows against the offsets the metadata says were delivered.
"""
