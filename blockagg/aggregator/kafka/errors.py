"""How the Kafka adapters read a confluent-kafka failure: the error it carries and
whether retrying can help. Shared by the metadata store and the fenced attempt, so
both retry the same errors (the coordinator moving or loading, timeouts, transport)
and fail at once on anything else, with the broker's reason."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final, TypeVar

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


T = TypeVar("T")

CONTROLLER_TRIES: Final = 3
"""Tries of a request sent to the named controller (:func:`ask_controller`)."""


def ask_controller(call: Callable[[float], T], timeout: float,
                   drop_client: Callable[[], None] = lambda: None) -> T:
    """``call(seconds)``, tried up to :data:`CONTROLLER_TRIES` times within ``timeout``
    seconds in all, each try given an equal share; raises the last try's error.

    librdkafka sends DescribeCluster, DescribeTopics and CreateTopics to the broker the
    client's last metadata named controller, which in KRaft is a random live broker: a
    broker cut off but not yet fenced (``broker.session.timeout.ms``) may be named, and
    the client keeps asking it. So after a try that gets no answer (:func:`unanswered`)
    ``drop_client()`` discards the client, and the next try's fresh one bootstraps and is
    named a controller afresh (never the cut node once the cluster has fenced it). Any
    other error ends the tries at once."""
    deadline = time.monotonic() + timeout
    for tried in range(1, CONTROLLER_TRIES + 1):
        left = deadline - time.monotonic()
        try:
            return call(min(left, timeout / CONTROLLER_TRIES))
        except Exception as exc:
            if not unanswered(exc) or tried == CONTROLLER_TRIES or left < 0.1:
                raise
            drop_client()
    raise AssertionError("unreachable")
