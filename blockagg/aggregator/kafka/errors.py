"""How the Kafka adapters read a confluent-kafka failure: the error it carries and
whether retrying can help. Shared by the metadata store and the fenced attempt, so
both retry the same errors (the coordinator moving or loading, timeouts, transport)
and fail at once on anything else, with the broker's reason."""

from __future__ import annotations

from typing import Final

from confluent_kafka import KafkaError, KafkaException

RETRIABLE_CODES: Final = frozenset(
    {
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.NOT_COORDINATOR,
        KafkaError._TIMED_OUT,
        KafkaError._TRANSPORT,
        KafkaError._WAIT_COORD,
    }
)
"""Codes retried even when librdkafka does not flag them retriable."""


def is_retriable(error: KafkaError) -> bool:
    """Whether a commit or read failing with ``error`` is worth retrying: librdkafka's
    flag, or one of :data:`RETRIABLE_CODES`."""
    return bool(error.retriable()) or error.code() in RETRIABLE_CODES


def error_of(exc: BaseException) -> KafkaError | None:
    """The ``KafkaError`` a confluent-kafka exception carries; ``None`` for any other."""
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        return exc.args[0]
    return None


UNANSWERED_CODES: Final = frozenset(
    {
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError._TIMED_OUT,
        KafkaError._TRANSPORT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError._DESTROY_BROKER,
    }
)
"""Codes that mean no answer came (a timeout, a connection lost or dropped), as opposed
to a broker's refusal."""


def unanswered(exc: BaseException) -> bool:
    """Whether ``exc`` says Kafka did not answer: a future that timed out, or a
    :data:`UNANSWERED_CODES` error. Then the fix is the cluster's reachability, never a
    permission or a setting, and an error message must not suggest one."""
    if isinstance(exc, TimeoutError):
        return True
    error = error_of(exc)
    return error is not None and error.code() in UNANSWERED_CODES


def describe(exc: BaseException) -> str:
    """``exc`` in words: its text, or its type's name when it has none (a future that
    timed out raises a ``TimeoutError`` without text)."""
    return str(exc) or type(exc).__name__
