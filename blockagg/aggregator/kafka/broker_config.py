"""A broker's settings from whichever broker answers.

Start-up checks read cluster-wide broker settings (``offset.metadata.max.bytes``,
``offsets.retention.minutes``, the defaults internal topics are created with) from one
broker: the brokers must agree on them. A DescribeConfigs request for a broker's settings
goes to that broker and no other, so asking only the lowest id made a start fail, or
judge without the setting, whenever that one broker was cut off or failing over while
the others served; asking each in turn made every silent broker cost a whole timeout.
Here every broker is asked at once and the first answer is taken (with the topics'
settings in the same request, so that it too goes to a broker named, not to whichever
librdkafka still deems up); a refusal (no DescribeConfigs permission) ends the read at
once, since every broker would refuse alike.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from blockagg.aggregator.kafka.errors import unanswered


def read_broker_config(admin: Any, broker_ids: Iterable[int], timeout: float
                       ) -> tuple[int, dict[str, str]]:
    """``(id, settings)`` of the first broker of ``broker_ids`` to answer within
    ``timeout`` seconds (the lowest id of those answered by then): each setting's value
    as text.

    Waits at most ``timeout`` in all. Raises the refusal of the first broker that
    refuses, or, when none answers, the last no-answer error
    (:func:`blockagg.aggregator.kafka.errors.unanswered` holds of it); a ``ValueError``
    when ``broker_ids`` is empty."""
    broker, settings, _ = read_configs(admin, broker_ids, (), timeout)
    return broker, settings


def read_configs(admin: Any, broker_ids: Iterable[int], topics: Sequence[str],
                 timeout: float) -> tuple[int, dict[str, str], dict[str, dict[str, str]]]:
    """:func:`read_broker_config`, with the settings of ``topics`` in the same request:
    ``(id, the broker's settings, {topic: its settings})``.

    Every broker is asked at once, so a broker that never answers costs nothing while
    another does: the whole read takes at most ``timeout`` seconds, not ``timeout`` a
    silent broker. Of the answers that have arrived, the lowest id's is taken. A request
    without a broker's resource goes to any broker librdkafka deems up, and a broker cut
    off stays "up" to it until its connection times out, so the topics ride with each
    broker's resource: each request goes to the broker it names and no other."""
    from confluent_kafka.admin import ConfigResource  # type: ignore[attr-defined]

    ids = sorted(set(broker_ids))
    if not ids:
        raise ValueError("the cluster listed no broker to read settings from")
    deadline = time.monotonic() + timeout
    pending: dict[int, dict[str, Future[Any]]] = {}
    for broker in ids:
        resource = ConfigResource(ConfigResource.Type.BROKER, str(broker))
        named = {t: ConfigResource(ConfigResource.Type.TOPIC, t) for t in topics}
        futures = admin.describe_configs([resource, *named.values()],
                                         request_timeout=timeout)
        pending[broker] = {key: futures[r] for key, r in [("", resource), *named.items()]}
    last: BaseException = TimeoutError(
        f"no broker of {ids} answered DescribeConfigs within {timeout:g}s")
    while pending:
        for broker in sorted(pending):
            answer = pending[broker]
            if not all(f.done() for f in answer.values()):
                continue
            del pending[broker]
            try:
                text = {key: {name: str(entry.value) for name, entry in f.result().items()}
                        for key, f in answer.items()}
            except Exception as exc:
                if not unanswered(exc):
                    raise
                last = exc
                continue
            broker_settings = text.pop("")
            return broker, broker_settings, text
        left = deadline - time.monotonic()
        if not pending or left <= 0:
            break
        wait([f for answer in pending.values() for f in answer.values()], timeout=left,
             return_when=FIRST_COMPLETED)
    raise last
