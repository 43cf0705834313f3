"""Errors of the verifier. Each message carries the offending value."""

from blockagg.aggregator.exceptions import BlockaggError


class VerifierError(BlockaggError):
    """Base of the verifier's errors: ``arv`` could not do what was asked."""


class OffsetsDecodeError(VerifierError):
    """A ``__consumer_offsets`` record's key or value is not a record Kafka writes.

    The decoder raises only this error on malformed input, never an ``IndexError``,
    ``struct.error`` or ``UnicodeDecodeError``.
    """


class HistoryReadError(VerifierError):
    """``__consumer_offsets`` could not be read: connection, authorization, config."""


class AuditError(VerifierError):
    """``arv audit`` could not run: a reader failed, or an option names what isn't there."""
