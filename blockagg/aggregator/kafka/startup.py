"""Start-up checks of Kafka: the brokers answer, and every topic the caller needs exists.

One metadata request, bounded by ``timeout``, before anything else is started: an
unreachable cluster or a misspelled topic is refused in seconds with one line naming
the bootstrap servers or the topic, instead of surfacing later as a lock or a read
that waits and guesses. The request lists every topic (no topic name is asked for, so
a broker with ``auto.create.topics.enable`` creates nothing).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from blockagg import logs
from blockagg.aggregator.kafka.exceptions import KafkaUnreachable, TopicMissing

DEFAULT_TIMEOUT = 6.0
FIX = '[kafka] "bootstrap.servers" (or --bootstrap-servers)'


def list_topics(config: Mapping[str, Any], timeout: float = DEFAULT_TIMEOUT,
                fix: str = FIX) -> dict[str, int]:
    """Every topic of the cluster and its partition count.

    Raises :class:`KafkaUnreachable` (naming ``bootstrap.servers``) when no broker
    answers within ``timeout`` seconds."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    servers = str(config.get("bootstrap.servers", ""))
    admin = AdminClient(logs.kafka_client_config(config))
    try:
        metadata = admin.list_topics(timeout=timeout)
    except KafkaException as exc:
        reason = exc.args[0].str() if exc.args and hasattr(exc.args[0], "str") else str(exc)
        raise KafkaUnreachable(
            f"Kafka unreachable: no broker of bootstrap.servers {servers!r} answered within "
            f"{timeout:.0f}s ({reason}). Start the brokers or fix {fix}"
        ) from None
    return {name: len(t.partitions) for name, t in metadata.topics.items() if t.error is None}


def missing_topic_message(servers: str, name: str) -> str:
    return (
        f"topic {name!r} does not exist on {servers}: create it (kafka-topics.sh "
        f"--bootstrap-server {servers} --create --topic {name} --partitions N; on "
        "blockagg's local stack `scripts/stack kafka-topics` takes the same arguments) or "
        "fix the topic's name"
    )


def check_topics(config: Mapping[str, Any], names: Sequence[str],
                 patterns: Sequence[str] = (), timeout: float = DEFAULT_TIMEOUT,
                 fix: str = FIX) -> dict[str, int]:
    """Refuse unless every topic in ``names`` exists and every pattern matches one.

    Returns the topics found (name -> partitions), for the caller's own checks."""
    servers = str(config.get("bootstrap.servers", ""))
    topics = list_topics(config, timeout, fix)
    for name in names:
        if name not in topics:
            raise TopicMissing(missing_topic_message(servers, name) + " in [[topics]]")
    for pattern in patterns:
        if not any(re.fullmatch(pattern, t) for t in topics):
            raise TopicMissing(
                f"no topic on {servers} matches the pattern {pattern!r} of [[topics]]: "
                "create one, or fix the pattern")
    return topics
