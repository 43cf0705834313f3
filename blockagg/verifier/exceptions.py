"""Errors of the verifier. Each message carries the offending value."""

from blockagg.aggregator.kafka.exceptions import OffsetsDecodeError
from blockagg.exceptions import BlockaggError

__all__ = ["AuditError", "HistoryReadError", "OffsetsDecodeError", "VerifierError"]


class VerifierError(BlockaggError):
    """Base of the verifier's errors: ``arv`` could not do what was asked."""


class HistoryReadError(VerifierError):
    """``__consumer_offsets`` could not be read: connection, authorization, config."""


class AuditError(VerifierError):
    """``arv audit`` could not run: a reader failed, or an option names what isn't there."""
