"""Errors of the pure core: metadata that can't be encoded or decoded, and batches
the protocol refuses to process because processing them would lose or duplicate.
"""

from blockagg.exceptions import BlockaggError


class CoreError(BlockaggError):
    """Base of the core's errors."""


class MetadataError(CoreError):
    """Metadata can't be encoded or decoded."""


class MetadataDecodeError(MetadataError):
    """A committed metadata string is not blockagg metadata, or is corrupt."""


class MetadataTooLarge(MetadataError):
    """The encoded metadata exceeds the broker's ``offset.metadata.max.bytes``."""


class BatchRefused(CoreError):
    """The protocol refuses a batch because processing it would lose or duplicate
    messages. Nothing was committed or inserted for the batch; the message says what
    happened and what to do."""


class OffsetGap(BatchRefused):
    """The batch starts after the resume offset: the messages in between would be lost."""


class MetadataAheadOfPartition(BatchRefused):
    """The resume offset is beyond the partition's end: the offsets were reset or the
    topic was recreated since the metadata was committed."""


class BatchEndsInsideReplayBlock(BatchRefused):
    """A block of the committed metadata ends at or after the batch's end, so the
    batch can't rebuild it identically."""


class ReplayBlockMissing(BatchRefused):
    """A block of the committed metadata can't be rebuilt because its first or last
    message is not in the batch (deleted by retention or compaction, or the topic was
    recreated)."""


class MetadataContractViolation(BatchRefused):
    """The committed metadata is well-formed but breaks a protocol invariant (see
    ``docs/metadata.md``), so resuming from it could lose or duplicate messages."""


class TopicIncarnationChanged(BatchRefused):
    """The partition's last commit was written for another incarnation of the topic
    (deleted and recreated, or the same name on another Kafka cluster): its offsets
    and blocks do not describe this topic's messages."""


class PinsMismatch(BatchRefused):
    """The batch was prepared under other pins (registry position, topic incarnation,
    deduplication mode) than the intent it replays, so its blocks could differ from
    the first attempt's."""


class TooManyBlocks(BatchRefused):
    """The batch forms more blocks of a table than the partition's share of the table's
    deduplication window (``Thresholds.max_blocks_per_table``): a replay of one of them
    could find its first attempt gone from the window and land twice."""
