"""Errors of the protobuf side: envelopes, the schema registry, decoding and the
``ba-schema`` checks. Messages carry the offending value and say what to change."""

from __future__ import annotations

from blockagg.exceptions import BlockaggError


class ProtoError(BlockaggError):
    """Base of the protobuf side's errors."""


class EnvelopeDecodeError(ProtoError):
    """A Kafka message value is not a usable ``blockagg.v1.Envelope`` (the job turns it
    into a dead letter with this reason); ``table`` is the table it names when that
    much was readable."""

    table: str = ""


class SchemaError(ProtoError):
    """A message type or descriptor can't be used for a table (unsupported field
    type, missing message, unreadable FileDescriptorSet, .proto that won't compile)."""


class RegistryError(ProtoError):
    """The schema registry topic can't be read or written, or holds a registration
    that contradicts the registry's rules (ids never change, versions only grow)."""


class RegistryDecodeError(RegistryError):
    """A record of the registry topic is not a valid ``blockagg.v1.Registration``
    (skipped with a warning, so running jobs keep what they had)."""


class UnknownTable(RegistryError):
    """No registration for the table."""


class UnknownVersion(RegistryError):
    """The table has no registration with the requested schema version."""


class CompatibilityError(ProtoError):
    """A compatibility mode or check can't be applied as asked."""


class UnknownMode(CompatibilityError):
    """A compatibility mode name that is not one of :class:`proto.modes.Mode`."""
