"""Errors of the Kafka adapters: a commit or a read of committed offsets that failed
for good (after retrying the retriable errors), with what to change."""

from blockagg.aggregator.core.exceptions import MetadataTooLarge
from blockagg.exceptions import BlockaggError


class KafkaAdapterError(BlockaggError):
    """Base of the Kafka adapters' errors."""


class MetadataCommitError(KafkaAdapterError):
    """The broker refused the offset commit, or kept failing until retries ran out.
    The commit may or may not have been applied: run the batch again."""


class CommittedReadError(KafkaAdapterError):
    """The committed offset and metadata of a partition could not be read."""


class MetadataUnstable(CommittedReadError):
    """A transactional offset commit on the metadata group never ended (a hanging
    transaction, ``kafka.hanging``): no read of the group's stable offsets succeeds until
    an operator aborts it."""


class OffsetMetadataTooLarge(MetadataCommitError, MetadataTooLarge):
    """The broker rejected the metadata as longer than its ``offset.metadata.max.bytes``."""


class AttemptFenced(MetadataCommitError):
    """A newer attempt holds the partition: this attempt's producer was fenced by Kafka
    (its transactional id was initialised again), or the partition's last commit is no
    longer the intent this attempt wrote. The attempt must stop without retrying: the
    newer attempt replays whatever this one left unfinished."""


class OffsetsDecodeError(KafkaAdapterError):
    """A ``__consumer_offsets`` record's key or value is not a record Kafka writes.

    The decoder raises only this error on malformed input, never an ``IndexError``,
    ``struct.error`` or ``UnicodeDecodeError``.
    """


class KafkaUnreachable(KafkaAdapterError):
    """No broker of ``bootstrap.servers`` answered a metadata request in time."""


class TopicMissing(KafkaAdapterError):
    """A configured topic (or every topic of a pattern) does not exist on the cluster."""


class OwnershipStoreError(KafkaAdapterError):
    """The ownership topic (``aggregator.kafka.ownership``) could not be read or
    written, or holds a record blockagg did not write."""


class TopicOwned(KafkaAdapterError):
    """Another metadata group delivers the topic into the shard (invariant 8): refused
    at start, naming the owner and the ways on."""


class ClaimRaced(KafkaAdapterError):
    """An ownership record changed between the start's decision and its write."""


class UnsafeKafkaDurability(KafkaAdapterError):
    """A topic the job depends on is configured so that Kafka itself could lose an
    acknowledged record (``kafka.durability``): refused at start unless
    ``kafka.allow_unsafe_durability``."""


class MetadataBudgetTooSmall(KafkaAdapterError, MetadataTooLarge):
    """Refused at start, before anything is committed: an intent for the registered
    tables at the configured batch range could exceed ``offset.metadata.max.bytes``,
    or the brokers' ``offset.metadata.max.bytes`` is below the job's
    ``offset_metadata_max_bytes``. The message names the value to set."""


class DeadLetterPublishFailed(KafkaAdapterError):
    """The dead-letter topic did not acknowledge a copy of a dead letter."""
