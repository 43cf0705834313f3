"""Reading the commit history from ``__consumer_offsets`` and ordering it by commit time.

:class:`HistoryReader` assigns every partition of ``__consumer_offsets`` explicitly (no
group membership, nothing committed: ``enable.auto.commit=false``), reads with
``isolation.level=read_committed`` so aborted transactional offset commits never show,
decodes each record with :mod:`aggregator.kafka.offsets_codec`, keeps the requested groups (and
topics), and yields commits through a :class:`CommitMerger`.

Ordering guarantee: a group's commits all live in one ``__consumer_offsets`` partition
(the group's coordinator partition), whose log order is the order the coordinator
accepted them; the merger keeps each partition's log order and interleaves partitions by
commit timestamp (the seed's min-heap), so every group/topic/partition history comes out
in commit order even when broker clocks disagree.

One pass stops at the high watermarks read when the reader opened (or earlier at the
last committed record, since ``read_committed`` stops at the last stable offset).
"""

from __future__ import annotations

import heapq
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    TopicPartition,
)

from blockagg import logs
from blockagg.aggregator.kafka.offsets_codec import OffsetCommitKey, decode_key, decode_value
from blockagg.verifier.exceptions import HistoryReadError, OffsetsDecodeError
from blockagg.verifier.rules import Commit

OFFSETS_TOPIC: Final = "__consumer_offsets"

RESERVED_SETTINGS: Final = {
    "enable.auto.commit": "false",
    "enable.auto.offset.store": "false",
    "isolation.level": "read_committed",
    "enable.partition.eof": "true",
    "auto.offset.reset": "earliest",
}
"""Settings the reader owns; a ``-X`` passthrough may repeat them but not change them."""

T = TypeVar("T")


class CommitMerger(Generic[T]):
    """A streaming k-way merge of per-partition streams by timestamp.

    Each partition's items come out in the order they were pushed. Across partitions,
    items come out by ``(timestamp, partition)``, and only when no *live* partition (one
    that may still deliver older items, i.e. has not reached its end) has an empty queue.
    """

    def __init__(self) -> None:
        self._queues: dict[int, deque[tuple[int, T]]] = {}
        self._heap: list[tuple[int, int]] = []
        self._live: set[int] = set()

    def push(self, partition: int, timestamp: int, item: T) -> None:
        """Append ``item`` to ``partition``'s stream."""
        queue = self._queues.setdefault(partition, deque())
        if not queue:
            heapq.heappush(self._heap, (timestamp, partition))
        queue.append((timestamp, item))

    def set_live(self, partition: int, live: bool) -> None:
        """Mark whether ``partition`` may still deliver items (it is behind its end)."""
        if live:
            self._live.add(partition)
        else:
            self._live.discard(partition)

    def _blocked(self) -> bool:
        return any(not self._queues.get(p) for p in self._live)

    def pop_ready(self) -> Iterator[T]:
        """Yield every item that can be emitted without breaking the order."""
        while self._heap and not self._blocked():
            _, partition = heapq.heappop(self._heap)
            queue = self._queues[partition]
            _, item = queue.popleft()
            if queue:
                heapq.heappush(self._heap, (queue[0][0], partition))
            yield item

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())


@dataclass(frozen=True, slots=True)
class Tombstone:
    """``group``'s committed offset for ``topic``/``partition`` was deleted."""

    group: str
    topic: str
    partition: int
    coordinator_partition: int
    coordinator_offset: int


@dataclass(frozen=True, slots=True)
class DecodeFailure:
    """A record of ``__consumer_offsets`` that did not decode (reported, then skipped)."""

    error: OffsetsDecodeError
    coordinator_partition: int
    coordinator_offset: int


Event = Commit | Tombstone | DecodeFailure


def parse_settings(pairs: Iterable[str]) -> dict[str, str]:
    """Parse ``key=value`` passthrough settings; refuse changes to :data:`RESERVED_SETTINGS`."""
    settings: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise HistoryReadError(f"setting {pair!r} is not of the form key=value")
        reserved = RESERVED_SETTINGS.get(key)
        if reserved is not None and value.strip().lower() != reserved:
            raise HistoryReadError(
                f"setting {key}={value} would change how arv reads __consumer_offsets; "
                f"arv always uses {key}={reserved}"
            )
        if key in ("bootstrap.servers", "group.id"):
            raise HistoryReadError(
                f"setting {key} is set by arv itself; use --bootstrap-servers, not -X {key}"
            )
        settings[key] = value
    return settings


class HistoryReader:
    """Reads offset commits of ``groups`` (and ``topics``, when given) from the cluster.

    ``start`` maps ``__consumer_offsets`` partitions to the offset to read from; the others
    are read from the beginning. Errors (connection, authorization, bad settings) raise
    :class:`HistoryReadError` naming what to change.
    """

    def __init__(
        self,
        bootstrap_servers: str,
        groups: Iterable[str],
        topics: Iterable[str] = (),
        settings: Mapping[str, str] | None = None,
        start: Mapping[int, int] | None = None,
        timeout: float = 10.0,
    ) -> None:
        self.groups = frozenset(groups)
        self.topics = frozenset(topics)
        self.timeout = timeout
        self.bootstrap_servers = bootstrap_servers
        config: dict[str, Any] = {
            **(settings or {}),
            **RESERVED_SETTINGS,
            "bootstrap.servers": bootstrap_servers,
            "group.id": f"blockagg-arv-{uuid.uuid4().hex}",
        }
        try:
            self._consumer = Consumer(logs.kafka_client_config(config))
        except (KafkaException, ValueError) as exc:
            raise HistoryReadError(f"cannot create the Kafka consumer: {_reason(exc)}") from exc
        self.partitions: tuple[int, ...] = ()
        self._ends: dict[int, int] = {}
        self._positions: dict[int, int] = {}
        self._done: set[int] = set()
        self._watermarks: dict[tuple[str, int], int] = {}
        self._incarnations: dict[str, int] = {}
        self._incarnation_settings = dict(settings or {})
        self.records_read = 0
        try:
            self._open(start or {})
        except BaseException:
            self._consumer.close()
            raise

    def _open(self, start: Mapping[int, int]) -> None:
        try:
            meta = self._consumer.list_topics(OFFSETS_TOPIC, timeout=self.timeout)
        except KafkaException as exc:
            raise HistoryReadError(
                f"cannot reach the Kafka cluster {self.bootstrap_servers!r} to read "
                f"{OFFSETS_TOPIC}: {_reason(exc)}; check "
                "--bootstrap-servers and the security settings (-X security.protocol=...)"
            ) from exc
        topic = meta.topics.get(OFFSETS_TOPIC)
        if topic is None or topic.error is not None:
            error = topic.error if topic is not None else "not in the metadata"
            if topic is not None and topic.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                return
            raise HistoryReadError(f"cannot read topic {OFFSETS_TOPIC}: {error}")
        self.partitions = tuple(sorted(topic.partitions))
        unknown = sorted(set(start) - set(self.partitions))
        if unknown:
            raise HistoryReadError(
                f"start offsets given for partitions {unknown} that {OFFSETS_TOPIC} lacks "
                f"(it has {len(self.partitions)} partitions)"
            )
        assignment = []
        for partition in self.partitions:
            low, high = self._watermarks_of(OFFSETS_TOPIC, partition)
            self._ends[partition] = high
            first = start.get(partition, OFFSET_BEGINNING)
            self._positions[partition] = low if first == OFFSET_BEGINNING else first
            if self._positions[partition] >= high:
                self._done.add(partition)
            assignment.append(TopicPartition(OFFSETS_TOPIC, partition, first))
        self._consumer.assign(assignment)

    def _watermarks_of(self, topic: str, partition: int) -> tuple[int, int]:
        try:
            low, high = self._consumer.get_watermark_offsets(
                TopicPartition(topic, partition), timeout=self.timeout, cached=False
            )
        except KafkaException as exc:
            raise HistoryReadError(
                f"cannot read the watermarks of {topic}[{partition}]: {_reason(exc)}"
            ) from exc
        return int(low), int(high)

    def incarnation(self, topic: str, seen: int) -> int | None:
        """The topic's current incarnation (``aggregator.kafka.incarnation``), read once
        and again when a commit names another (``seen``); ``None`` when the cluster
        does not say."""
        from blockagg.aggregator.kafka.incarnation import IncarnationError, TopicIncarnations

        cached = self._incarnations.get(topic)
        if cached is not None and cached == seen:
            return cached
        try:
            now = TopicIncarnations({**self._incarnation_settings,
                                     "bootstrap.servers": self.bootstrap_servers},
                                    self.timeout).of(topic)
        except IncarnationError:
            return cached
        self._incarnations[topic] = now
        return now

    def high_watermark(self, topic: str, partition: int, claimed: int) -> int | None:
        """The data partition's high watermark, refreshed when ``claimed`` exceeds it.

        ``None`` when the partition is unknown to the cluster (e.g. the topic was deleted).
        """
        cached = self._watermarks.get((topic, partition))
        if cached is not None and cached >= claimed:
            return cached
        try:
            _, high = self._watermarks_of(topic, partition)
        except HistoryReadError:
            return cached
        if high < 0:
            return cached
        self._watermarks[(topic, partition)] = high
        return high

    def lag(self) -> int:
        """Records of ``__consumer_offsets`` not yet read, summed over its partitions."""
        total = 0
        for partition in self.partitions:
            _, high = self._watermarks_of(OFFSETS_TOPIC, partition)
            total += max(0, high - self._positions.get(partition, 0))
        return total

    def events(
        self,
        follow: bool = False,
        stop: Callable[[], bool] | None = None,
        tick: Callable[[], None] | None = None,
        poll_timeout: float = 0.5,
    ) -> Iterator[Event]:
        """Commits, tombstones and decode failures of the requested groups, merged.

        Without ``follow`` the iterator ends once every partition reached the end it had
        when the reader opened; with ``follow`` it ends when ``stop()`` returns true.
        ``stop`` and ``tick`` are called after every poll, at least every ``poll_timeout``
        seconds.
        """
        merger: CommitMerger[Event] = CommitMerger()
        for partition in self.partitions:
            merger.set_live(partition, partition not in self._done)
        while (not (stop and stop()) if follow
               else len(self._done) < len(self.partitions)):
            messages = self._consumer.consume(num_messages=1000, timeout=poll_timeout)
            for message in messages:
                self._take(message, merger)
            yield from merger.pop_ready()
            if tick is not None:
                tick()
        for partition in self.partitions:
            merger.set_live(partition, False)
        yield from merger.pop_ready()

    def _take(self, message: Any, merger: CommitMerger[Event]) -> None:
        error = message.error()
        partition = message.partition()
        if error is not None:
            if error.code() == KafkaError._PARTITION_EOF:
                self._positions[partition] = message.offset()
                self._done.add(partition)
                merger.set_live(partition, False)
                return
            if error.fatal() or not error.retriable():
                raise HistoryReadError(f"reading {OFFSETS_TOPIC}[{partition}] failed: {error}")
            return
        offset = message.offset()
        self.records_read += 1
        self._positions[partition] = offset + 1
        if offset + 1 >= self._ends.get(partition, 0):
            self._done.add(partition)
        merger.set_live(partition, partition not in self._done)
        event = self._decode(message.key(), message.value(), partition, offset)
        if event is not None:
            if isinstance(event, Commit):
                timestamp = event.commit_timestamp
            else:
                _, timestamp = message.timestamp()
            merger.push(partition, timestamp, event)

    def _decode(self, key: bytes | None, value: bytes | None, partition: int,
                offset: int) -> Event | None:
        """Decode only what matters: values of other groups are never parsed."""
        try:
            record_key = decode_key(key) if key is not None else None
            if not isinstance(record_key, OffsetCommitKey):
                if record_key is None:
                    raise OffsetsDecodeError("__consumer_offsets record without a key")
                return None
            if not self._wanted(record_key.group, record_key.topic):
                return None
            if value is None:
                return Tombstone(record_key.group, record_key.topic, record_key.partition,
                                 partition, offset)
            decoded = decode_value(value)
        except OffsetsDecodeError as exc:
            return DecodeFailure(exc, partition, offset)
        return Commit(record_key.group, record_key.topic, record_key.partition, decoded.offset,
                      decoded.metadata, decoded.commit_timestamp, partition, offset)

    def _wanted(self, group: str, topic: str) -> bool:
        return group in self.groups and (not self.topics or topic in self.topics)

    def close(self) -> None:
        """Leave the cluster; commits nothing."""
        self._consumer.close()

    def __enter__(self) -> HistoryReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _reason(exc: BaseException) -> str:
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        return str(exc.args[0].str())
    return str(exc)


def now_ms() -> int:
    """Wall-clock milliseconds, for lag and freshness figures."""
    return int(time.time() * 1000)
