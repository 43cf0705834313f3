"""Kafka adapters of the aggregator: the ``MetadataStore`` that commits metadata
strings together with the consumer-group offset, and reads the last one back.
"""

from blockagg.aggregator.kafka.metadata_store import KafkaMetadataStore

__all__ = ["KafkaMetadataStore"]
