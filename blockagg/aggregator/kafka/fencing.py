"""Fencing of task attempts by Kafka's transactional producer epochs (invariant 6).

Every metadata commit of one partition goes through a transactional producer whose
``transactional.id`` names the metadata group, the topic and the partition
(:func:`transactional_id`). A task attempt opens a :class:`FencedAttempt`:

1. its producer calls ``init_transactions()``: the transaction coordinator bumps the
   id's producer epoch, aborts any transaction an older attempt left open, and from then
   on refuses every request of an older attempt's producer (``PRODUCER_FENCED``);
2. only then does it read the partition's last commit (``isolation.level=read_committed``,
   so the read waits for pending transactional offsets to settle instead of showing them);
3. each metadata commit is one small transaction holding only an offset commit of the
   metadata group (``send_offsets_to_transaction``; the offset carries the metadata
   string, as a plain commit does), so a fenced attempt's commit is refused by the
   broker: :class:`AttemptFenced`;
4. before each insert, :meth:`FencedAttempt.confirm` reads the partition's last commit
   again and refuses unless it is still the intent this attempt wrote: an older attempt
   whose partition moved on inserts nothing. Every commit carries the attempt's own
   nonce (``Metadata.attempt``, :attr:`FencedAttempt.nonce`), because a retry of the
   same task plans a byte-identical intent: without the nonce, an attempt stalled
   before its confirm would take a newer attempt's identical intent for its own.

The metadata group stays member-less: the transactional offset commit carries
generation ``-1`` and no member id, which the group coordinator accepts for a group
without members exactly as it accepts a plain "simple consumer" commit. What lands in
``__consumer_offsets`` is the same offset-commit record, written transactionally and
followed by a commit marker (or dropped by an abort marker), so readers use
``read_committed``. The window this leaves (an attempt paused between its last
confirm and its insert) is covered by ClickHouse's block deduplication:
``docs/protocol.md``, *Fencing*.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol, TypeVar

from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition

from blockagg import logs
from blockagg.aggregator.core.model import Committed
from blockagg.aggregator.kafka.errors import error_of, is_retriable
from blockagg.aggregator.kafka.exceptions import (
    AttemptFenced,
    MetadataCommitError,
    OffsetMetadataTooLarge,
)

log = logs.get("metadata")

TRANSACTION_TIMEOUT_MS: Final = 10_000
"""A commit transaction's ``transaction.timeout.ms``: the longest an attempt stalled in a
commit keeps it open before the coordinator aborts it."""

INIT_TRIES: Final = 4
"""How many ``init_transactions()`` calls an attempt makes while each fails with a
retriable error, each given the store's timeout (30 s by default): a coordinator that
is still loading its partition after that is a broker failure Spark's task retry
waits out better than one call."""

HUNG_CALL_GRACE_S: Final = 15.0
"""How long past the timeout it was given a transactional call of librdkafka may take
before the attempt stops waiting for it (:func:`within`)."""

_ABANDONED: list[Any] = []
"""Producers whose call never returned: kept, not destroyed (destroying one waits for
its threads, which may hang the same way); a newer attempt has fenced each of them."""

R = TypeVar("R")

NONCE_FLOOR: Final = 2**31
"""Nonces lie in ``[2**31, 2**32)``: never 0 ("not recorded"), and always five bytes in
the metadata, so a commit re-encoded with another attempt's nonce keeps its length."""


def new_nonce() -> int:
    """A fresh attempt nonce: unpredictable, so two attempts share one with probability
    2**-31 (each pair), and nothing else can be asked to match."""
    return NONCE_FLOOR + secrets.randbelow(NONCE_FLOOR)


class CallHung(Exception):
    """A librdkafka call did not return in time (see :func:`within`)."""


def within(call: Callable[[], R], seconds: float, what: str) -> R:
    """``call()`` on a helper thread, waited for at most ``seconds``: its result or its
    exception, or :class:`CallHung`. librdkafka's transactional calls take a timeout but
    can block past it (a commit that began just as the broker restarted hung for
    minutes in a fault run, its transaction rolled back by the coordinator meanwhile);
    a task must not wait on one for ever."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name=f"blockagg-{what}", daemon=True).start()
    if not done.wait(seconds):
        raise CallHung(what)
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]

FENCED_CODES: Final = frozenset(
    {KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH}
)
"""What the broker or librdkafka answers a producer whose epoch is no longer current."""

CONSUMER_ONLY: Final = frozenset(
    {"group.id", "group.instance.id", "enable.auto.commit", "auto.offset.reset",
     "isolation.level", "enable.auto.offset.store", "session.timeout.ms",
     "heartbeat.interval.ms", "partition.assignment.strategy", "max.poll.interval.ms"}
)


class AttemptStore(Protocol):
    """What an attempt uses of its metadata store (``metadata_store.KafkaMetadataStore``,
    which opens attempts: typed by this protocol so the store imports the attempt and
    never the reverse)."""

    group_id: str
    settings: Mapping[str, Any]
    timeout: float
    clock: Callable[[], float]

    def committed(self, topic: str, partition: int) -> Committed | None: ...

    def group_metadata(self) -> Any: ...


class TransactionalProducer(Protocol):
    """The part of ``confluent_kafka.Producer`` an attempt uses."""

    def list_topics(self, topic: str | None = ..., timeout: float = ...) -> Any: ...

    def init_transactions(self, timeout: float = ...) -> None: ...

    def begin_transaction(self) -> None: ...

    def send_offsets_to_transaction(self, positions: list[Any], group_metadata: Any,
                                    timeout: float = ...) -> None: ...

    def commit_transaction(self, timeout: float = ...) -> None: ...

    def abort_transaction(self, timeout: float = ...) -> None: ...


def transactional_id(group: str, topic: str, partition: int) -> str:
    """One id per (metadata group, topic, partition): every attempt at the partition
    shares it, so each new attempt fences all older ones, and nothing else does."""
    return f"blockagg.{group}.{topic}.{partition}"


def producer_settings(store_settings: Mapping[str, Any], tid: str,
                      transaction_timeout_ms: int) -> dict[str, Any]:
    """The store's connection settings (bootstrap, security) for the attempt's
    producer, without the consumer-only keys, with the transactional id."""
    settings = {k: v for k, v in store_settings.items() if k not in CONSUMER_ONLY}
    settings["transactional.id"] = tid
    settings["transaction.timeout.ms"] = transaction_timeout_ms
    return settings


class IdleProducers:
    """Transactional producers kept between the attempts of one process, by
    transactional id: a partition's next task in the same Python worker reuses the
    producer instead of starting one and calling ``init_transactions()`` (about
    60 ms a task, docs/BENCHMARKS.md), once it has shown that the producer still holds
    the id's newest epoch (:meth:`FencedAttempt._still_current`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[str, TransactionalProducer] = {}

    def take(self, tid: str) -> TransactionalProducer | None:
        with self._lock:
            return self._idle.pop(tid, None)

    def keep(self, tid: str, producer: TransactionalProducer) -> None:
        with self._lock:
            self._idle[tid] = producer


class FencedAttempt:
    """One task attempt's hold on one partition; a :class:`MetadataStore` for it.

    Creating it fences every older attempt at the partition (see the module doc), so
    create it before reading anything the batch depends on. ``close()`` when done.
    Plan the attempt's commits with :attr:`nonce` (``plan_batch(..., attempt=nonce)``):
    :meth:`confirm` accepts only a last commit that is this attempt's own, by its text,
    which the nonce makes unique to the attempt.
    ``transaction_timeout_ms`` bounds how long an attempt stalled inside a commit's
    transaction keeps it open (a read of the partition's commit waits for it until the
    coordinator aborts it, or a newer attempt does): a commit takes milliseconds.
    """

    def __init__(
        self,
        store: AttemptStore,
        topic: str,
        partition: int,
        *,
        transaction_timeout_ms: int = TRANSACTION_TIMEOUT_MS,
        producer_factory: Callable[[dict[str, Any]], TransactionalProducer] = Producer,
        retries: int = 8,
        backoff: float = 0.1,
        sleep: Callable[[float], None] = time.sleep,
        hang_grace_s: float = HUNG_CALL_GRACE_S,
        idle: IdleProducers | None = None,
        nonce: int | None = None,
    ) -> None:
        self.store = store
        self.nonce = new_nonce() if nonce is None else nonce
        self.topic = topic
        self.partition = partition
        self.transactional_id = transactional_id(store.group_id, topic, partition)
        self._retries = retries
        self._backoff = backoff
        self._sleep = sleep
        self._timeout = store.timeout
        self._hang_after = store.timeout + hang_grace_s
        self._hung = False
        self._written: Committed | None = None
        self._confirm_lock = threading.Lock()
        self._reads_begun = 0
        self._confirmed_by = 0
        self._confirmed_at = 0.0
        self._idle = idle
        self._reusable = True
        self.reused = False
        kept = idle.take(self.transactional_id) if idle is not None else None
        if kept is not None and self._still_current(kept):
            self._producer = kept
            self.reused = True
            return
        self._producer = producer_factory(logs.kafka_client_config(producer_settings(
            store.settings, self.transactional_id, transaction_timeout_ms)))
        try:
            # Two metadata requests first: the first learns the brokers through the
            # bootstrap connection, the second brings up a connection to a learned one.
            # Without them librdkafka often looks for the transaction coordinator before
            # any connection is up and waits its fixed 500 ms timer (docs/BENCHMARKS.md).
            for _ in range(2):
                self._bounded(lambda: self._producer.list_topics(topic, self._timeout),
                              "list_topics")
            self._init_transactions()
        except KafkaException as exc:
            self._reusable = False
            raise MetadataCommitError(
                f"{self._where}: could not initialise the transactional id "
                f"{self.transactional_id!r} that fences older attempts: {exc}. The brokers "
                "must allow transactions (transaction.state.log.* settings) and, with ACLs, "
                "grant Write and Describe on the TransactionalId prefix "
                f"'blockagg.{store.group_id}.' and IdempotentWrite on the cluster."
            ) from exc

    def _init_transactions(self) -> None:
        """``init_transactions()``, called again while it fails with a retriable error,
        as librdkafka documents: after a broker failure the transaction coordinator
        moves, and its new leader answers ``COORDINATOR_LOAD_IN_PROGRESS`` until it has
        read the id's partition of ``__transaction_state``. librdkafka retries inside
        one call and, at its timeout, reports the last error it saw; the next call
        resumes the same request. Fencing holds throughout: no epoch is ours until a
        call returns."""
        delay = self._backoff
        wait = logs.SlowWait(log, f"the transaction coordinator of {self._where}",
                             clock=self.store.clock)
        for tries in range(INIT_TRIES):
            try:
                self._bounded(lambda: self._producer.init_transactions(self._timeout),
                              "init_transactions")
                return
            except KafkaException as exc:
                error = error_of(exc)
                if error is None or error.fatal() or not is_retriable(error):
                    raise
                if tries == INIT_TRIES - 1:
                    self._reusable = False
                    raise MetadataCommitError(
                        f"{self._where}: the transaction coordinator of "
                        f"{self.transactional_id!r} did not answer within {INIT_TRIES} "
                        f"calls of {self._timeout:g}s: {exc}. Its __transaction_state "
                        "partition has no leader that has finished loading it (a broker "
                        "failing over); this attempt stops and Spark's retry tries again. "
                        "Nothing was written.") from exc
                wait.note(attempt=tries + 1, attempts=INIT_TRIES, error=str(exc))
                self._sleep(delay)
                delay = min(delay * 2, 5.0)

    def _bounded(self, call: Callable[[], R], what: str) -> R:
        """``call()`` through :func:`within`; a call that hangs ends this attempt with
        :class:`MetadataCommitError` (Spark retries the task: the next attempt fences
        this one's producer, which is abandoned, never destroyed)."""
        try:
            return within(call, self._hang_after, what)
        except CallHung:
            self._hung = True
            error = MetadataCommitError(
                f"{self._where}: librdkafka's {what} of the transactional id "
                f"{self.transactional_id!r} did not return within {self._hang_after:g}s "
                f"although given {self._timeout:g}s (a transaction left hanging, e.g. by a "
                "broker restart); this attempt stops and the next one fences it. The batch "
                "is safe to run again.")
            logs.event(log, "transactional call hung", level=30, error=str(error))
            raise error from None

    def _still_current(self, producer: TransactionalProducer) -> bool:
        """Whether a producer kept from an earlier attempt still holds the id's newest
        epoch: one transaction carrying an offset commit of the partition, aborted (so
        nothing of it is ever visible to ``read_committed`` readers), which the
        transaction coordinator refuses if any producer initialised the id since. If
        it went through, every older attempt is fenced exactly as by
        ``init_transactions()``; else the caller starts a fresh producer."""
        probe = [TopicPartition(self.topic, self.partition, 0, metadata="")]
        try:
            producer.begin_transaction()
            self._bounded(lambda: producer.send_offsets_to_transaction(
                probe, self.store.group_metadata(), self._timeout),
                "send_offsets_to_transaction")
            self._bounded(lambda: producer.abort_transaction(self._timeout),
                          "abort_transaction")
        except MetadataCommitError:
            _ABANDONED.append(producer)
            self._hung = False
            return False
        except KafkaException:
            return False
        return True

    @property
    def _where(self) -> str:
        return f"{self.topic}[{self.partition}] in group {self.store.group_id!r}"

    def _check(self, topic: str, partition: int) -> None:
        if (topic, partition) != (self.topic, self.partition):
            raise ValueError(f"an attempt at {self.topic}[{self.partition}] was asked about "
                             f"{topic}[{partition}]")

    def committed(self, topic: str, partition: int) -> Committed | None:
        self._check(topic, partition)
        return self.store.committed(topic, partition)

    def _fenced(self, what: str) -> AttemptFenced:
        return AttemptFenced(
            f"{self._where}: {what}. A newer attempt at this partition has started (a task "
            "retry, or a restarted driver); this attempt stops without retrying and the newer "
            "one replays what it left unfinished."
        )

    def commit(self, topic: str, partition: int, offset: int, metadata: str) -> None:
        """Commit ``offset`` with ``metadata`` in a transaction of this attempt's
        producer; :class:`AttemptFenced` if a newer attempt has initialised it since."""
        self._check(topic, partition)
        position = [TopicPartition(topic, partition, offset, metadata=metadata)]
        group = self.store.group_metadata()
        delay = self._backoff
        wait = logs.SlowWait(log, f"the commit of offset {offset} of {self._where} (Kafka "
                                  "does not answer the transaction)",
                              clock=self.store.clock)
        for tries in range(self._retries + 1):
            try:
                self._reusable = False  # until the transaction has ended
                self._producer.begin_transaction()
                self._bounded(lambda: self._producer.send_offsets_to_transaction(
                    position, group, self._timeout), "send_offsets_to_transaction")
                self._bounded(lambda: self._producer.commit_transaction(self._timeout),
                              "commit_transaction")
                self._written = Committed(offset=offset, metadata=metadata)
                self._reusable = True
                return
            except KafkaException as exc:
                error = error_of(exc)
                if error is not None and error.code() in FENCED_CODES:
                    raise self._fenced(f"the commit of offset {offset} was refused: "
                                       f"{error.str()}") from exc
                if error is not None and error.code() == KafkaError.OFFSET_METADATA_TOO_LARGE:
                    raise OffsetMetadataTooLarge(
                        f"the broker rejected the metadata of {topic}[{partition}] "
                        f"({len(metadata)} bytes) as larger than its "
                        "offset.metadata.max.bytes. Raise offset.metadata.max.bytes on the "
                        "brokers and the matching max_metadata_bytes here, or lower "
                        "maxOffsetsPerTrigger."
                    ) from exc
                again = error is not None and not error.fatal() and (
                    error.txn_requires_abort() or is_retriable(error))
                if not again or tries == self._retries:
                    raise MetadataCommitError(
                        f"could not commit offset {offset} of {self._where} in a transaction "
                        f"of {self.transactional_id!r}: {exc}. The commit may or may not have "
                        "been applied; the batch is safe to run again."
                    ) from exc
                wait.note(attempt=tries + 1, attempts=self._retries + 1, error=str(exc))
                self._abort_quietly()
                self._sleep(delay)
                delay = min(delay * 2, 5.0)
        raise AssertionError("unreachable")

    def _abort_quietly(self) -> None:
        try:
            self._bounded(lambda: self._producer.abort_transaction(self._timeout),
                          "abort_transaction")
        except KafkaException as exc:
            error = error_of(exc)
            if error is not None and error.code() in FENCED_CODES:
                raise self._fenced(f"aborting a failed commit was refused: {error.str()}") \
                    from exc
            # No transaction in progress (it failed before beginning): nothing to abort.

    def confirm(self, topic: str, partition: int) -> float:
        """Raise :class:`AttemptFenced` unless the partition's last commit is still the
        one this attempt wrote: called before each insert, so an attempt whose partition
        has moved on (a newer attempt committed since, identical text or not: each
        commit carries its attempt's nonce) inserts nothing.

        Returns when (``store.clock``) the read that confirmed began: the last moment
        this attempt is known to have been the partition's only writer, from which the
        writer judges how late its send is (``docs/protocol.md``, *The residual window*).

        Safe from several insert lanes at once: callers that arrive while a read is in
        flight share the next read, which begins after they asked, so every insert is
        still preceded by a read of the partition taken after the insert was ready."""
        self._check(topic, partition)
        asked = self._reads_begun
        with self._confirm_lock:
            if self._confirmed_by > asked:
                return self._confirmed_at
            self._reads_begun += 1
            read = self._reads_begun
            began = self.store.clock()
            self._read_and_compare(topic, partition)
            self._confirmed_by = read
            self._confirmed_at = began
            return began

    def _read_and_compare(self, topic: str, partition: int) -> None:
        last = self.store.committed(topic, partition)
        written = self._written
        if (written is None or last is None or last.offset != written.offset
                or last.metadata.rstrip("\x00") != written.metadata.rstrip("\x00")):
            shown = "no commit" if last is None else f"offset {last.offset}"
            raise self._fenced(
                "the partition's last commit is no longer this attempt's intent "
                f"({shown} now); the block was not inserted")

    def close(self) -> None:
        """Keep the producer for the partition's next attempt in this process (with
        ``idle``), unless a Kafka error touched it; one whose call hung is abandoned,
        never destroyed (:data:`_ABANDONED`); else drop it (it holds no messages: only
        offset commits, each one a finished transaction)."""
        producer = self.__dict__.pop("_producer", None)
        if producer is None:
            return
        if self._hung:
            _ABANDONED.append(producer)
        elif self._idle is not None and self._reusable:
            self._idle.keep(self.transactional_id, producer)

    def __enter__(self) -> FencedAttempt:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
