"""A broker's settings from whichever broker answers.

Start-up checks read cluster-wide broker settings (``offset.metadata.max.bytes``,
``offsets.retention.minutes``, the defaults internal topics are created with) from one
broker: the brokers must agree on them. A DescribeConfigs request for a broker's settings
goes to that broker and no other, so asking only the lowest id made a start fail, or
judge without the setting, whenever that one broker was cut off or failing over while
the others served. Here each broker is asked in turn, lowest id first, until one
answers (with the topics' settings in the same request, so that it too goes to a broker
chosen, not to whichever librdkafka still deems up); a refusal (no DescribeConfigs
permission) ends the search at once, since every broker would refuse alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from blockagg.aggregator.kafka.errors import unanswered


def read_broker_config(admin: Any, broker_ids: Iterable[int], timeout: float
                       ) -> tuple[int, dict[str, str]]:
    """``(id, settings)`` of the first broker of ``broker_ids``, lowest id first, that
    answers within ``timeout`` seconds: each setting's value as text.

    Waits at most ``timeout`` per broker that does not answer. Raises the refusal of the
    first broker that refuses, or, when none answers, the last broker's no-answer error
    (:func:`blockagg.aggregator.kafka.errors.unanswered` holds of it); a ``ValueError``
    when ``broker_ids`` is empty."""
    broker, settings, _ = read_configs(admin, broker_ids, (), timeout)
    return broker, settings


def read_configs(admin: Any, broker_ids: Iterable[int], topics: Sequence[str],
                 timeout: float) -> tuple[int, dict[str, str], dict[str, dict[str, str]]]:
    """:func:`read_broker_config`, with the settings of ``topics`` in the same request:
    ``(id, the broker's settings, {topic: its settings})``.

    A request without a broker's resource goes to any broker librdkafka deems up, and a
    broker cut off stays "up" to it until its connection times out, so the topics ride
    with the broker's resource: the whole request goes to the broker tried, and the next
    one is tried when it does not answer."""
    from confluent_kafka.admin import ConfigResource  # type: ignore[attr-defined]

    ids = sorted(set(broker_ids))
    if not ids:
        raise ValueError("the cluster listed no broker to read settings from")
    last: BaseException | None = None
    for broker in ids:
        resource = ConfigResource(ConfigResource.Type.BROKER, str(broker))
        named = {t: ConfigResource(ConfigResource.Type.TOPIC, t) for t in topics}
        try:
            futures = admin.describe_configs([resource, *named.values()],
                                             request_timeout=timeout)
            answers = {key: futures[r].result(timeout=timeout)
                       for key, r in [("", resource), *named.items()]}
        except Exception as exc:
            if not unanswered(exc):
                raise
            last = exc
            continue
        text = {key: {name: str(entry.value) for name, entry in entries.items()}
                for key, entries in answers.items()}
        broker_settings = text.pop("")
        return broker, broker_settings, text
    assert last is not None
    raise last
