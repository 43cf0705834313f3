"""The Kafka :class:`~aggregator.core.model.MetadataStore`: the metadata group's
offset commits, through confluent-kafka.

The consumer never subscribes and never polls: it is used only for
``committed()`` and a synchronous ``commit()``, as a "simple consumer" of its own
group (the ``metadata_group_id``, distinct from the group Spark's source uses), so
the commit history in ``__consumer_offsets`` is blockagg's alone and the verifier can
read it. Per-partition errors are checked on every result; retriable errors (the
coordinator moving or loading, timeouts, transport) are retried with exponential
backoff, anything else fails at once with the broker's reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol, TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from blockagg import logs
from blockagg.aggregator.core.model import Committed
from blockagg.aggregator.kafka.errors import error_of, is_retriable
from blockagg.aggregator.kafka.exceptions import (
    CommittedReadError,
    MetadataCommitError,
    OffsetMetadataTooLarge,
)
from blockagg.aggregator.kafka.fencing import FencedAttempt, IdleProducers
from blockagg.aggregator.kafka.hanging import Diagnose, read_or_diagnose
from blockagg.exceptions import ConfigError

_NO_OFFSET: Final = 0

log = logs.get("metadata")

R = TypeVar("R")


class OffsetsConsumer(Protocol):
    """The part of ``confluent_kafka.Consumer`` the store uses."""

    def committed(self, partitions: list[Any], timeout: float = ...) -> list[Any]: ...

    def commit(self, *args: Any, **kwargs: Any) -> Any: ...

    def close(self) -> None: ...

    def consumer_group_metadata(self) -> Any: ...


class KafkaMetadataStore:
    """Commits metadata with the consumer-group offset and reads the last commit back.

    ``config`` is passed to the consumer as is (``bootstrap.servers``, ``security.*``,
    ``sasl.*``, ``ssl.*``...), and must name ``group.id``; ``enable.auto.commit`` is
    forced off (refused if set on), since only the protocol may commit. A read that
    times out is looked at by ``diagnose`` (``hanging.unstable_read`` unless given): a
    transaction on the group that never ends is refused at once as
    :class:`~.exceptions.MetadataUnstable` instead of being retried.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        retries: int = 8,
        backoff: float = 0.1,
        max_backoff: float = 5.0,
        timeout: float = 30.0,
        consumer_factory: Callable[[dict[str, Any]], OffsetsConsumer] = Consumer,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        diagnose: Diagnose | None = None,
    ) -> None:
        if not config.get("group.id"):
            raise ConfigError(
                "the Kafka metadata store needs group.id: the consumer group whose offset "
                "commits carry blockagg's metadata ([job] metadata_group_id)"
            )
        auto_commit = str(config.get("enable.auto.commit", "false")).lower()
        if auto_commit not in ("false", "0"):
            raise ConfigError(
                "enable.auto.commit must be false for the metadata group: only the "
                "protocol commits, each commit carrying its metadata"
            )
        settings = dict(config)
        settings["enable.auto.commit"] = False
        # A read right after a transactional commit waits for its markers (the broker
        # answers UNSTABLE_OFFSET_COMMIT until then): retry that in milliseconds.
        settings.setdefault("retry.backoff.ms", 10)
        self.group_id = str(config["group.id"])
        self.settings: Mapping[str, Any] = settings
        self._consumer = consumer_factory(logs.kafka_client_config(settings))
        self._retries = retries
        self._backoff = backoff
        self._max_backoff = max_backoff
        self.timeout = timeout
        self._sleep = sleep
        self.clock = clock
        self._diagnose = diagnose
        self._idle_producers: IdleProducers | None = None

    def _retrying(self, attempt: Callable[[], R], what: str) -> R:
        """``attempt()`` until it succeeds, a non-retriable error or the last retry;
        a wait longer than a few seconds logs ``what`` it waits for (WARN, rate-limited)."""
        delay = self._backoff
        wait = logs.SlowWait(log, what, clock=self.clock)
        for tries in range(self._retries + 1):
            try:
                return attempt()
            except KafkaException as exc:
                error = error_of(exc)
                if error is None or not is_retriable(error) or tries == self._retries:
                    raise
                wait.note(attempt=tries + 1, attempts=self._retries + 1, error=error.str())
                self._sleep(delay)
                delay = min(delay * 2, self._max_backoff)
        raise AssertionError("unreachable")

    def committed(self, topic: str, partition: int) -> Committed | None:
        """The partition's last commit in the group, or ``None`` if there is none."""

        def attempt() -> Committed | None:
            (result,) = read_or_diagnose(
                lambda: self._consumer.committed(
                    [TopicPartition(topic, partition)], timeout=self.timeout),
                self.settings, self.group_id, [(topic, partition)], diagnose=self._diagnose)
            if result.error is not None:
                raise KafkaException(result.error)
            if result.offset < _NO_OFFSET:
                return None
            return Committed(offset=int(result.offset), metadata=result.metadata or "")

        try:
            return self._retrying(attempt, f"the last commit of {topic}[{partition}] in group "
                                           f"{self.group_id!r} (Kafka does not answer)")
        except KafkaException as exc:
            raise CommittedReadError(
                f"could not read the committed offset of {topic}[{partition}] in group "
                f"{self.group_id!r}: {exc}. Check bootstrap.servers, the security settings "
                "and the group's ACLs (Describe on the group, Describe on the topic)."
            ) from exc

    def commit(self, topic: str, partition: int, offset: int, metadata: str) -> None:
        """Commit ``offset`` with ``metadata``; returns once the broker accepted it."""

        def attempt() -> None:
            results = self._consumer.commit(
                offsets=[TopicPartition(topic, partition, offset, metadata=metadata)],
                asynchronous=False,
            )
            for result in results or ():
                if result.error is not None:
                    raise KafkaException(result.error)

        try:
            self._retrying(attempt, f"the commit of offset {offset} of {topic}[{partition}] in "
                                    f"group {self.group_id!r} (Kafka does not answer)")
        except KafkaException as exc:
            error = error_of(exc)
            if error is not None and error.code() == KafkaError.OFFSET_METADATA_TOO_LARGE:
                raise OffsetMetadataTooLarge(
                    f"the broker rejected the metadata of {topic}[{partition}] "
                    f"({len(metadata)} bytes) as larger than its offset.metadata.max.bytes. "
                    "Raise offset.metadata.max.bytes on the brokers and the matching "
                    "max_metadata_bytes here, or lower maxOffsetsPerTrigger."
                ) from exc
            raise MetadataCommitError(
                f"could not commit offset {offset} of {topic}[{partition}] in group "
                f"{self.group_id!r}: {exc}. The commit may or may not have been applied; "
                "the batch is safe to run again."
            ) from exc

    def group_metadata(self) -> Any:
        """The metadata group as a transactional offset commit names it: no member,
        generation -1, which the coordinator accepts for a group without members."""
        return self._consumer.consumer_group_metadata()

    def attempt(self, topic: str, partition: int) -> FencedAttempt:
        """Open a fenced attempt at the partition (``fencing.FencedAttempt``): every
        older attempt's commits and inserts are refused from now on. The partition's
        producer is kept between attempts in this process (``fencing.IdleProducers``)."""
        if self._idle_producers is None:
            self._idle_producers = IdleProducers()
        return FencedAttempt(self, topic, partition, idle=self._idle_producers)

    def close(self) -> None:
        """Leave the broker connection; the store is unusable afterwards."""
        self._consumer.close()

    def __enter__(self) -> KafkaMetadataStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
