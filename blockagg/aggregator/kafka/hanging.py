"""A transactional offset commit on the metadata group that never resolves.

Every metadata commit is a transaction (``fencing``), and every read of the group's
committed offsets asks for stable offsets (``isolation.level=read_committed``): while a
transaction holding offsets for the group is open, the broker answers
``UNSTABLE_OFFSET_COMMIT`` and librdkafka retries until its timeout ("Failed to get
committed offsets: Local: Timed out"). A transaction of this job's ends within its
``transaction.timeout.ms`` (``fencing.TRANSACTION_TIMEOUT_MS``), by its commit, its
abort or the coordinator's abort.

One that does not end is a *hanging* transaction: its transactional offset commit sits
in ``__consumer_offsets`` with no marker after it, while its coordinator holds it
finished. Kafka leaves one behind when the coordinator completes a transaction without
writing the marker, as it does when, loading its state after a restart, it does not yet
know the leader of the group's ``__consumer_offsets`` partition and takes it for deleted
(the broker logs "Couldn't find leader endpoint for partitions ... likely deleted"). The
seed-3 long run met it after a ``kill -9`` of its only broker. No client can end such a
transaction; every stable read of the group fails until an operator aborts it with
``kafka-transactions.sh``. These helpers turn the bare timeout into that diagnosis.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final, Protocol, TypeVar

from blockagg.aggregator import logs
from blockagg.aggregator.kafka.exceptions import MetadataUnstable

OFFSETS_TOPIC: Final = "__consumer_offsets"

R = TypeVar("R")


class Diagnose(Protocol):
    """:func:`unstable_read`'s signature (tests script it)."""

    def __call__(self, config: Mapping[str, Any], group: str,
                 partitions: Iterable[tuple[str, int]], *,
                 waited: float) -> MetadataUnstable | None: ...


def offsets_partition(group: str, partitions: int) -> int:
    """The ``__consumer_offsets`` partition that holds ``group``'s commits: Kafka's
    ``Utils.abs(groupId.hashCode()) % offsets.topic.num.partitions``, with Java's
    ``String.hashCode`` over UTF-16 code units (a signed int: ``Utils.abs`` negates a
    negative one, and maps ``Integer.MIN_VALUE`` to 0; masking the sign bit instead
    names another partition for half of all groups)."""
    h = 0
    units = group.encode("utf-16-be")
    for i in range(0, len(units), 2):
        h = (31 * h + int.from_bytes(units[i:i + 2], "big")) & 0xFFFFFFFF
    signed = h - (1 << 32) if h & 0x80000000 else h
    return (0 if signed == -(1 << 31) else abs(signed)) % partitions


def unstable_read(
    config: Mapping[str, Any],
    group: str,
    partitions: Iterable[tuple[str, int]],
    *,
    waited: float,
    timeout: float = 10.0,
) -> MetadataUnstable | None:
    """After a stable read of ``group``'s committed offsets timed out (after ``waited``
    seconds): read them once without asking for stable offsets. If the broker answers
    that, the group has a transaction that does not end: the error to raise, naming the
    ``__consumer_offsets`` partition and the remedy. ``None`` if the plain read fails
    too (Kafka is unreachable or slow: a different problem, reported as it was)."""
    from confluent_kafka import Consumer, KafkaException, TopicPartition

    from blockagg.aggregator.kafka.fencing import TRANSACTION_TIMEOUT_MS

    settings = {k: v for k, v in config.items() if k != "isolation.level"}
    settings.update({"group.id": group, "enable.auto.commit": False,
                     "isolation.level": "read_uncommitted"})
    wanted = [TopicPartition(t, p) for t, p in partitions]
    consumer = Consumer(logs.kafka_client_config(settings))
    try:
        try:
            answered = consumer.committed(wanted, timeout=timeout)
        except KafkaException:
            return None
        if any(tp.error is not None for tp in answered):
            return None
        where = f"the {OFFSETS_TOPIC} partition that holds the group"
        leader = "<the partition's leader>"
        try:
            topic = consumer.list_topics(OFFSETS_TOPIC, timeout=timeout).topics.get(
                OFFSETS_TOPIC)
            if topic is not None and topic.partitions:
                partition = offsets_partition(group, len(topic.partitions))
                where = f"{OFFSETS_TOPIC}-{partition}"
                leader = str(topic.partitions[partition].leader)
        except KafkaException:
            pass
    finally:
        consumer.close()
    return MetadataUnstable(
        f"the committed offsets of metadata group {group!r} cannot be read as stable: "
        f"a read with isolation.level=read_committed timed out after {waited:.0f} s while "
        "a plain read answers at once, so a transactional offset commit on the group has "
        f"not ended. blockagg's own transactions end within {TRANSACTION_TIMEOUT_MS / 1000:g} "
        "s; one that does not is a "
        f"hanging transaction in {where}, which Kafka leaves when it completes a "
        "transaction without writing its marker (after a broker restart its log says "
        "\"Couldn't find leader endpoint ... likely deleted\"). No client can end it; "
        "every start and every batch of this group is refused until it is aborted. "
        f"Find it with kafka-transactions.sh find-hanging --broker-id {leader}, and "
        "abort it only if kafka-transactions.sh describe shows it finished as "
        "CompleteAbort: docs/running.md, 'A hanging transaction on the metadata group', "
        "has every step, and what to do if it shows CompleteCommit."
    )


def read_or_diagnose(
    read: Callable[[], R],
    config: Mapping[str, Any],
    group: str,
    partitions: Iterable[tuple[str, int]],
    *,
    diagnose: Diagnose | None = None,
) -> R:
    """``read()`` (a stable read of ``group``'s committed offsets for ``partitions``);
    if it times out, raise :class:`MetadataUnstable` when ``diagnose`` (by default
    :func:`unstable_read`) finds a transaction that does not end, else the timeout as
    it was."""
    from confluent_kafka import KafkaError, KafkaException

    began = time.monotonic()
    try:
        return read()
    except KafkaException as exc:
        error = exc.args[0] if exc.args else None
        if not isinstance(error, KafkaError) or error.code() != KafkaError._TIMED_OUT:
            raise
        hang = (diagnose or unstable_read)(config, group, list(partitions),
                                           waited=time.monotonic() - began)
        if hang is None:
            raise
        raise hang from exc
