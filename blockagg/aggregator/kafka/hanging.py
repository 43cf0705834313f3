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
transaction; every stable read of the group fails until it is aborted. These helpers
turn the bare timeout into that diagnosis (:func:`unstable_read`) and plan its cure
(:func:`plan_heal`), which the job runs at start through Kafka's Admin API.

**Why rolling the hanging commit forward is safe.** A blockagg transaction holds one
offset commit of one partition: the intent ``M`` of a batch, or (metadata ``""``) the
probe of ``fencing.FencedAttempt._still_current``, always aborted. While ``M`` hangs, no
attempt at that partition reads its commit, so no later intent of the partition exists:
``M`` is the newest the partition ever had. Whether its coordinator committed it (its
blocks may be in ClickHouse) or aborted it (its blocks were never inserted: an attempt
inserts only after its commit returned), committing ``M`` again and replaying it is
right: the replay re-forms ``M``'s blocks from the same offsets, and ClickHouse drops
those it already holds. Aborting it instead is right only in the second case, and the
coordinator that would tell them apart may have forgotten the transaction. So the plan
re-commits ``M`` (a fresh transaction under the partition's own transactional id, which
also fences every older attempt) *before* it aborts the hanging one: a crash between
the two leaves the same hanging transaction and the same plan for the next start.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeVar

from blockagg import logs
from blockagg.aggregator.core.metadata import is_blockagg
from blockagg.aggregator.kafka.exceptions import MetadataUnstable, OffsetsDecodeError
from blockagg.aggregator.kafka.fencing import TRANSACTION_TIMEOUT_MS
from blockagg.aggregator.kafka.offsets_codec import OffsetCommit, Record, decode_record

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
        "\"Couldn't find leader endpoint ... likely deleted\"). Every batch of this "
        "group is refused until it is ended: the job ends it itself at its next start "
        "(kafka.heal_hanging_transactions, on by default). By hand: "
        f"find it with kafka-transactions.sh find-hanging --broker-id {leader}, and "
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


# -- healing: decisions (pure) ------------------------------------------------------

RUNNING_STATES: Final = frozenset({"Ongoing", "PrepareCommit", "PrepareAbort",
                                   "PrepareEpochFence"})
"""Transaction states in which the coordinator still owes the transaction its markers."""


@dataclass(frozen=True, slots=True)
class OpenTransaction:
    """A producer's transaction open on the group's ``__consumer_offsets`` partition, as
    the partition's leader reports it (DescribeProducers). ``start_offset`` is the
    offset of its first record; ``coordinator_epoch`` is -1 when the leader has none."""

    producer_id: int
    epoch: int
    coordinator_epoch: int
    start_offset: int


@dataclass(frozen=True, slots=True)
class CoordinatorView:
    """What the transaction coordinator holds for a transactional id
    (DescribeTransactions): its state, current producer id and epoch, and the
    partitions of its current transaction."""

    state: str
    producer_id: int
    epoch: int
    partitions: frozenset[tuple[str, int]]


@dataclass(frozen=True, slots=True)
class Recommit:
    """Commit ``offset`` with ``metadata`` for ``topic[partition]`` again, in a new
    transaction of the partition's transactional id: the hanging intent, rolled forward."""

    topic: str
    partition: int
    offset: int
    metadata: str
    start_offset: int


@dataclass(frozen=True, slots=True)
class Abort:
    """Write an abort marker for ``producer_id``/``epoch`` on ``__consumer_offsets``
    partition ``partition`` (Admin ``abortTransaction``), ending its open transaction."""

    partition: int
    producer_id: int
    epoch: int
    coordinator_epoch: int
    start_offset: int


@dataclass(frozen=True, slots=True)
class Left:
    """An open transaction the plan does not touch, and why. ``blocks`` says whether it
    holds an offset commit of this group (so the group's stable reads stay refused)."""

    producer_id: int
    start_offset: int
    reason: str
    blocks: bool


@dataclass(frozen=True, slots=True)
class HealPlan:
    """Every :class:`Recommit` before any :class:`Abort` (see the module doc)."""

    steps: tuple[Recommit | Abort, ...]
    left: tuple[Left, ...]

    @property
    def complete(self) -> bool:
        """Whether the group's stable reads work once the steps ran."""
        return not any(item.blocks for item in self.left)


def plan_heal(
    group: str,
    partition: int,
    open_transactions: Sequence[OpenTransaction],
    records: Mapping[int, Record | None],
    coordinator: Mapping[str, CoordinatorView | None],
    transactional_id: Callable[[str, str, int], str],
) -> HealPlan:
    """The steps that end the hanging transactions of ``group`` on ``__consumer_offsets``
    partition ``partition``.

    ``records`` holds the record at each open transaction's ``start_offset`` (``None``:
    unreadable); ``coordinator`` the coordinator's view of each transactional id named
    by those records (``None``: the coordinator does not know the id). A transaction
    that the coordinator still runs on this partition is left to it (it ends within its
    timeout), and so is every one that is not this group's blockagg commit or probe.
    Several hanging intents of one topic-partition roll forward only the newest (the
    group would have shown the last one in the log)."""
    latest: dict[tuple[str, int], Recommit] = {}
    aborts: list[tuple[tuple[str, int], Abort]] = []
    left: list[Left] = []
    running: set[tuple[str, int]] = set()
    for txn in sorted(open_transactions, key=lambda t: t.start_offset):
        record = records.get(txn.start_offset)
        if not isinstance(record, OffsetCommit):
            what = ("its first record could not be read" if record is None
                    else "its first record is not an offset commit")
            left.append(Left(txn.producer_id, txn.start_offset, what, blocks=False))
            continue
        key, value = record.key, record.value
        tp = (key.topic, key.partition)
        if key.group != group:
            left.append(Left(txn.producer_id, txn.start_offset,
                             f"an offset commit of another group ({key.group!r})",
                             blocks=False))
            continue
        view = coordinator.get(transactional_id(group, key.topic, key.partition))
        if (view is not None and view.producer_id == txn.producer_id
                and view.epoch == txn.epoch and view.state in RUNNING_STATES
                and (OFFSETS_TOPIC, partition) in view.partitions):
            running.add(tp)
            left.append(Left(txn.producer_id, txn.start_offset,
                             f"{key.topic}[{key.partition}]: its coordinator still runs it "
                             f"({view.state}); it ends within its transaction timeout",
                             blocks=True))
            continue
        text = value.metadata.rstrip("\x00")
        if is_blockagg(text):
            # without librdkafka's trailing NUL, which the commit adds again
            latest[tp] = Recommit(key.topic, key.partition, value.offset, text,
                                  txn.start_offset)
        elif text or value.offset != 0:  # neither an intent nor an attempt's probe
            left.append(Left(txn.producer_id, txn.start_offset,
                             f"{key.topic}[{key.partition}]: its metadata is not "
                             f"blockagg's ({text[:40]!r}); end it by hand", blocks=True))
            continue
        aborts.append((tp, Abort(partition, txn.producer_id, txn.epoch,
                                 txn.coordinator_epoch, txn.start_offset)))
    # a partition whose newest attempt is still in a transaction is left to it whole
    recommits = tuple(r for tp, r in sorted(latest.items()) if tp not in running)
    ends = tuple(a for tp, a in aborts if tp not in running)
    return HealPlan((*recommits, *ends), tuple(left))


# -- healing: reading the hanging commits (I/O) ------------------------------------

def read_records(config: Mapping[str, Any], partition: int, offsets: Iterable[int], *,
                 timeout: float = 10.0) -> dict[int, Record | None]:
    """The ``__consumer_offsets`` records at ``offsets`` of ``partition``, read without
    asking for stable offsets (the records of an open transaction are what is wanted);
    ``None`` for one that could not be read or decoded."""
    from confluent_kafka import Consumer, TopicPartition

    wanted = sorted(set(offsets))
    found: dict[int, Record | None] = dict.fromkeys(wanted)
    if not wanted:
        return found
    settings = {k: v for k, v in config.items()
                if k not in ("isolation.level", "group.id", "enable.auto.commit")}
    settings.update({"group.id": "blockagg-heal-reader", "enable.auto.commit": False,
                     "isolation.level": "read_uncommitted"})
    consumer = Consumer(logs.kafka_client_config(settings))
    try:
        for offset in wanted:
            consumer.assign([TopicPartition(OFFSETS_TOPIC, partition, offset)])
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                message = consumer.poll(0.5)
                if message is None or message.error() is not None:
                    continue
                if message.offset() == offset:
                    try:
                        found[offset] = decode_record(message.key(), message.value())
                    except OffsetsDecodeError:
                        found[offset] = None
                break
    finally:
        consumer.close()
    return found
