"""Errors of the pure core: metadata that can't be encoded or decoded, and batches
the protocol refuses to process because processing them would lose or duplicate.
"""

from aggregator.exceptions import BlockaggError


class CoreError(BlockaggError):
    """Base of the core's errors."""


class MetadataError(CoreError):
    """Metadata can't be encoded or decoded."""


class MetadataDecodeError(MetadataError):
    """A committed metadata string is not blockagg metadata, or is corrupt."""


class MetadataTooLarge(MetadataError):
    """The encoded metadata exceeds the broker's ``offset.metadata.max.bytes``."""
