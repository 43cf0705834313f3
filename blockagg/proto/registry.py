"""The schema registry: table <-> protobuf message type, versioned, stored in Kafka.

Storage: a compacted topic (default ``_blockagg_schemas``). Key: the table name
``database.table`` (UTF-8). Value: a serialized ``blockagg.v1.Registration`` holding
the table's stable id and *every* version, so compaction (which keeps only the last
record per key) never loses history. Readers scan the topic from the beginning to
its end; the last record of a key wins.

Rules, enforced when registering and when reading (a record that breaks them is
refused, so a bad write can't change what running jobs decode):

* a table's id is assigned at its first registration, never changes and is never
  reused; ids start at 1 (0 is the dead-letter table);
* versions start at 1 and only grow; an existing version is never changed;
* registering the same message type and descriptor as the latest version is a no-op;
* a new version must keep the table's compatibility mode (:mod:`proto.compat`;
  ``BACKWARD`` by default) against the registered versions, unless forced, and a
  forced version records the differences it overrode.

Positions: the registry as a job pins it is the topic up to an end offset, its
**position** (:attr:`Registry.position`; :func:`registry_pin` turns it into the
metadata pin). Every version carries the position from which it is visible (1 + the
offset of the record that introduced it, stamped on the version by every later
record of the table), so :meth:`Registry.as_of` gives the registry exactly as it was
at a position, whatever compaction removed since. A version also records the
ClickHouse columns it was checked against, from which its insert plan is made.

Above 500 lines because the record codec, both stores (memory, Kafka) and registration share
the record layout and its version rules.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING, Any, Final, Protocol

from google.protobuf.descriptor import Descriptor
from google.protobuf.message import DecodeError

from blockagg import logs
from blockagg.proto.blockagg.v1 import registry_pb2
from blockagg.proto.descriptors import load_descriptor
from blockagg.proto.envelope import LATEST, is_table_name
from blockagg.proto.exceptions import (
    CompatibilityError,
    IncompatibleSchema,
    RegistryDecodeError,
    RegistryError,
    UnknownTable,
    UnknownVersion,
)

if TYPE_CHECKING:
    from blockagg.proto.compat import Mode
    from blockagg.rows.columns import Column

log = logging.getLogger(__name__)

DEFAULT_TOPIC: Final = "_blockagg_schemas"


@lru_cache(maxsize=4096)
def shared_descriptor(file_descriptor_set: bytes, message_name: str) -> Descriptor:
    """:func:`proto.descriptors.load_descriptor`, one object per distinct input (a
    descriptor is immutable and a pure function of its bytes; an evicted entry only
    loses the sharing, never changes a decode)."""
    return load_descriptor(file_descriptor_set, message_name)


@dataclass(frozen=True)
class SchemaVersion:
    version: int
    message_name: str
    file_descriptor_set: bytes
    registered_at_ms: int = 0
    forced_incompatibilities: tuple[str, ...] = ()
    """The compatibility differences overridden with ``--force-incompatible``."""
    position: int = 0
    """The registry position from which the version is visible (1 + the offset of
    the record that introduced it); 0 only in a record that introduces it."""
    columns: tuple[tuple[str, str, str, str], ...] = ()
    """The ClickHouse columns (name, type, default kind, default expression) the
    version was checked against at registration; empty when not checked."""

    @cached_property
    def descriptor(self) -> Descriptor:
        """The version's message descriptor: one object for every version (of any
        table) registered with the same bytes and message name, so that the rows of
        tables sharing a message type are decoded in one pass
        (:func:`blockagg.rows.columns.decide_envelopes_many`)."""
        return shared_descriptor(self.file_descriptor_set, self.message_name)


@dataclass(frozen=True)
class Registration:
    table: str
    table_id: int
    versions: tuple[SchemaVersion, ...]
    compatibility: str = ""
    """The table's compatibility mode as stored (empty: the default,
    :data:`proto.compat.DEFAULT_MODE`); kept as text so a record naming a mode this
    reader doesn't know still decodes."""

    @property
    def mode(self) -> Mode:
        """The table's compatibility mode; raises :class:`UnknownMode`."""
        from blockagg.proto.compat import parse_mode

        return parse_mode(self.compatibility)

    @property
    def latest(self) -> SchemaVersion:
        return self.versions[-1]

    def version(self, number: int) -> SchemaVersion:
        """Version ``number``; 0 (:data:`proto.envelope.LATEST`) is the latest *now*.

        Not deterministic for 0 across registrations: the job uses :meth:`resolve`."""
        if number == LATEST:
            return self.latest
        for v in self.versions:
            if v.version == number:
                return v
        # The text goes into dead letters: a function of the message alone (no list of
        # what happens to be registered), so a replayed dead letter is identical.
        raise UnknownVersion(
            f"table {self.table} has no schema version {number} in the schema registry; "
            f"register it (ba-schema register {self.table}) or fix the producer's "
            "schema_version")

    def as_of(self, position: int) -> Registration | None:
        """The registration as it was at registry ``position``: the versions visible
        there, None when none was (the table was not registered yet)."""
        visible = tuple(v for v in self.versions if v.position <= position)
        if len(visible) == len(self.versions):
            return self
        return replace(self, versions=visible) if visible else None

    def resolve(self, number: int, timestamp_ms: int) -> SchemaVersion:
        """The version a message with ``schema_version = number`` and Kafka timestamp
        ``timestamp_ms`` decodes with: a pure function of the message and of the
        registration's (append-only) history, so a replay resolves alike whatever was
        registered in between.

        A pinned version (``number`` > 0) is that version. ``0`` (latest) is the
        highest version whose ``registered_at_ms`` is at or before ``timestamp_ms``
        (versions stored without a time, ``registered_at_ms = 0``, count as always
        registered). Raises :class:`UnknownVersion` when there is none, e.g. a
        message without a timestamp (-1) or older than the table's registration.
        """
        if number != LATEST:
            return self.version(number)
        best: SchemaVersion | None = None
        for v in self.versions:
            if v.registered_at_ms <= timestamp_ms and (best is None or v.version > best.version):
                best = v
        if best is None:
            first = min(v.registered_at_ms for v in self.versions)
            raise UnknownVersion(
                f"table {self.table}: schema_version 0 (latest) resolves by the message's "
                f"Kafka timestamp ({timestamp_ms} ms), and no version was registered at or "
                f"before it (first registration at {first} ms); pin schema_version in the "
                "producer, or fix the producer's clock / message timestamp")
        return best

    def encode(self) -> bytes:
        msg = registry_pb2.Registration(table=self.table, table_id=self.table_id,
                                        compatibility=self.compatibility)
        for v in self.versions:
            msg.versions.add(version=v.version, message_name=v.message_name,
                             file_descriptor_set=v.file_descriptor_set,
                             registered_at_ms=v.registered_at_ms,
                             forced_incompatibilities=v.forced_incompatibilities,
                             position=v.position,
                             columns=[registry_pb2.Column(name=n, type=t, default_kind=k,
                                                          default_expression=e)
                                      for n, t, k, e in v.columns])
        return msg.SerializeToString(deterministic=True)

    @staticmethod
    def decode(key: bytes | None, value: bytes) -> Registration:
        try:
            msg = registry_pb2.Registration.FromString(value)
        except (DecodeError, ValueError, TypeError, RuntimeError) as exc:
            raise RegistryDecodeError(
                f"registry record {key!r:.120} is not a Registration: {exc}") from None
        table = msg.table
        if key is not None and key.decode("utf-8", "replace") != table:
            raise RegistryDecodeError(
                f"registry record key {key!r:.120} does not match table {table!r:.120}")
        versions = tuple(SchemaVersion(v.version, v.message_name, v.file_descriptor_set,
                                       v.registered_at_ms, tuple(v.forced_incompatibilities),
                                       v.position,
                                       tuple((c.name, c.type, c.default_kind,
                                              c.default_expression) for c in v.columns))
                         for v in msg.versions)
        numbers = [v.version for v in versions]
        if not versions or numbers != sorted(set(numbers)) or numbers[0] < 1:
            raise RegistryDecodeError(
                f"registration of {table!r:.120} has bad versions {numbers!r:.200}")
        if msg.table_id < 1:
            raise RegistryDecodeError(f"registration of {table!r:.120} has table id "
                                      f"{msg.table_id}; ids start at 1")
        return Registration(table, msg.table_id, versions, msg.compatibility)


Entry = tuple[int, bytes | None, bytes | None]
"""One registry record: (offset, key, value)."""


class Store(Protocol):
    """Where registrations live: ``read`` returns every (key, value) record of the
    topic in order, up to its end at the time of the call; ``write`` returns once
    the record is durably written. Stores that also have ``scan()`` (the records
    with their offsets, and the end offset read up to) and ``end()`` (the current
    end offset, cheaply) give positions: :class:`KafkaStore`, :class:`MemoryStore`."""

    def read(self) -> list[tuple[bytes | None, bytes | None]]: ...

    def write(self, key: bytes, value: bytes) -> None: ...


@dataclass
class MemoryStore:
    """A :class:`Store` in memory, for tests; a record's offset is its index."""

    records: list[tuple[bytes | None, bytes | None]] = field(default_factory=list)

    def read(self) -> list[tuple[bytes | None, bytes | None]]:
        return list(self.records)

    def scan(self) -> tuple[list[Entry], int]:
        return [(i, k, v) for i, (k, v) in enumerate(self.records)], len(self.records)

    def end(self) -> int:
        return len(self.records)

    def write(self, key: bytes, value: bytes) -> None:
        self.records.append((key, value))


def scan(store: Store) -> tuple[list[Entry], int]:
    """The store's records with their offsets and the end offset read up to (a
    store without ``scan`` numbers its records)."""
    method = getattr(store, "scan", None)
    if method is not None:
        entries, end = method()
        return list(entries), int(end)
    records = store.read()
    return [(i, k, v) for i, (k, v) in enumerate(records)], len(records)


def registry_pin(position: int) -> int:
    """The metadata pin (``Pins.registry``) of registry ``position``: 1 + it, so
    that 0 keeps meaning "not pinned" even for an empty registry."""
    return position + 1


def pinned_position(pin: int) -> int:
    """The registry position a non-zero ``Pins.registry`` names."""
    return pin - 1


def _watermarks(consumer: Any, partition: Any, timeout_s: float) -> tuple[int, int]:
    """The partition's low and high watermarks, asked again while the broker answers
    with a retriable error (``NOT_LEADER_FOR_PARTITION`` while a restarted broker takes
    its partitions back) until ``timeout_s`` passed."""
    from confluent_kafka import KafkaError, KafkaException

    transient = {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
                 KafkaError._TRANSPORT, KafkaError._TIMED_OUT}
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            low, high = consumer.get_watermark_offsets(
                partition, timeout=max(1.0, deadline - time.monotonic()))
            return int(low), int(high)
        except KafkaException as exc:
            error = exc.args[0] if exc.args else None
            retriable = isinstance(error, KafkaError) and (
                error.retriable() or error.code() in transient)
            if not retriable or time.monotonic() + 0.5 > deadline:
                raise
            time.sleep(0.5)


class KafkaStore:
    """The registry topic. ``config`` is librdkafka configuration
    (``bootstrap.servers``, SASL/TLS settings…), passed through unchanged."""

    def __init__(self, config: Mapping[str, Any], topic: str = DEFAULT_TOPIC,
                 timeout_s: float = 30.0) -> None:
        self.config = dict(config)
        self.topic = topic
        self.timeout_s = timeout_s
        self._watcher: Any = None

    def ensure_topic(self, replication_factor: int | None = None) -> None:
        """Create the topic (1 partition, ``cleanup.policy=compact``) if missing. By
        default with the durability ``kafka.durability.creation_settings`` gives for the
        cluster's broker count (RF 3 and ``min.insync.replicas=2`` on three brokers or
        more, not the broker's default of 1), so the start-up check accepts it."""
        from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

        from blockagg.aggregator.kafka.durability import creation_settings

        admin = AdminClient(logs.kafka_client_config(self.config))
        md = admin.list_topics(timeout=self.timeout_s)
        if self.topic in md.topics:
            return
        settings = {"cleanup.policy": "compact"}
        if replication_factor is None:
            replication_factor, extra = creation_settings(len(md.brokers))
            settings.update(extra)
        futures = admin.create_topics([NewTopic(
            self.topic, num_partitions=1, replication_factor=replication_factor,
            config=settings)])
        for fut in futures.values():
            try:
                fut.result(self.timeout_s)
            except Exception as exc:
                if "TOPIC_ALREADY_EXISTS" not in str(exc):
                    raise RegistryError(f"can't create registry topic {self.topic}: {exc}") from exc

    def read(self) -> list[tuple[bytes | None, bytes | None]]:
        return [(k, v) for _, k, v in self.scan()[0]]

    def end(self) -> int:
        """The topic's end offset now (one watermark request on a kept consumer):
        whether a snapshot is current, without reading the topic."""
        from confluent_kafka import Consumer, KafkaException, TopicPartition

        try:
            if self._watcher is None:
                self._watcher = Consumer(logs.kafka_client_config({
                    **self.config, "group.id": f"blockagg-registry-{uuid.uuid4().hex}",
                    "enable.auto.commit": False}))
            md = self._watcher.list_topics(self.topic, timeout=self.timeout_s)
            topic = md.topics.get(self.topic)
            if topic is None or topic.error is not None:
                return 0
            _single_partition(self.topic, len(topic.partitions))
            _, high = _watermarks(self._watcher, TopicPartition(self.topic, 0), self.timeout_s)
            return int(high)
        except KafkaException as exc:
            raise RegistryError(f"can't read the end of registry topic {self.topic}: "
                                f"{exc}") from exc

    def scan(self) -> tuple[list[Entry], int]:
        """Every record with its offset, up to the end offset at the time of the call,
        and that end offset (the registry position the records cover)."""
        from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

        conf = {**self.config, "group.id": f"blockagg-registry-{uuid.uuid4().hex}",
                "enable.auto.commit": False, "auto.offset.reset": "earliest",
                "enable.partition.eof": True, "isolation.level": "read_committed"}
        consumer = Consumer(logs.kafka_client_config(conf))
        try:
            md = consumer.list_topics(self.topic, timeout=self.timeout_s)
            topic = md.topics.get(self.topic)
            if topic is None or topic.error is not None:
                return [], 0
            _single_partition(self.topic, len(topic.partitions))
            ends: dict[int, int] = {}
            parts = []
            low, high = _watermarks(consumer, TopicPartition(self.topic, 0), self.timeout_s)
            if high > low:
                ends[0] = high
                parts.append(TopicPartition(self.topic, 0, low))
            records: list[Entry] = []
            if not parts:
                return records, int(high)
            consumer.assign(parts)
            deadline = time.monotonic() + self.timeout_s
            while ends:
                if time.monotonic() > deadline:
                    raise RegistryError(
                        f"timed out reading registry topic {self.topic} to its end")
                msg = consumer.poll(1.0)
                if msg is None:
                    continue
                error = msg.error()
                partition = int(msg.partition() or 0)
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        ends.pop(partition, None)
                        continue
                    raise RegistryError(f"reading {self.topic}: {error}")
                offset = int(msg.offset() or 0)
                records.append((offset, msg.key(), msg.value()))
                if offset + 1 >= ends.get(partition, 0):
                    ends.pop(partition, None)
            return records, int(high)
        except KafkaException as exc:
            raise RegistryError(f"can't read registry topic {self.topic}: {exc}") from exc
        finally:
            consumer.close()

    def write(self, key: bytes, value: bytes) -> None:
        """Write one record, creating the topic first if it is missing (compacted, with
        the durability :meth:`ensure_topic` gives it), never by the broker's
        ``auto.create.topics.enable`` (its defaults: ``cleanup.policy=delete``, which
        drops registrations after the retention, and ``default.replication.factor``)."""
        from confluent_kafka import KafkaException, Producer

        try:
            self.ensure_topic()
        except KafkaException as exc:
            raise RegistryError(f"can't read the topics of the cluster to write to registry "
                                f"topic {self.topic}: {exc}") from exc
        producer = Producer(logs.kafka_client_config(
            {**self.config, "enable.idempotence": True, "acks": "all"}))
        errors: list[str] = []

        def done(err: Any, msg: Any) -> None:
            if err is not None:
                errors.append(str(err))
        try:
            producer.produce(self.topic, key=key, value=value, on_delivery=done)
            left = producer.flush(self.timeout_s)
        except KafkaException as exc:
            raise RegistryError(f"can't write to registry topic {self.topic}: {exc}") from exc
        if left or errors:
            raise RegistryError(f"registration for {key.decode()} was not acknowledged by "
                                f"{self.topic}: {errors or 'timeout'}")


def _single_partition(topic: str, partitions: int) -> None:
    if partitions != 1:
        raise RegistryError(
            f"registry topic {topic} has {partitions} partitions; it must have exactly one "
            "(positions and the order of registrations are per partition): point "
            "[schemas] topic at a topic with one partition and cleanup.policy=compact")


class Registry:
    """A snapshot of every registration, read from a :class:`Store`.

    ``loaded_at_ms`` is when the snapshot was read (wall clock of the reader; 0 when
    unknown): every registration written before it is in the snapshot. A message
    whose resolution could depend on a later registration (:meth:`covers` is False)
    should be resolved on a fresh snapshot (:class:`RegistryCache`). ``position`` is
    the end offset of the registry topic the snapshot covers; :meth:`as_of` gives the
    registry at an earlier position.
    """

    def __init__(self, registrations: Mapping[str, Registration],
                 loaded_at_ms: int = 0, position: int = 0) -> None:
        self._by_table = dict(registrations)
        self._by_id = {r.table_id: r for r in self._by_table.values()}
        self.loaded_at_ms = loaded_at_ms
        self.position = position

    @classmethod
    def from_records(cls, records: Iterable[tuple[bytes | None, bytes | None]],
                     loaded_at_ms: int = 0) -> Registry:
        """:meth:`from_log` of records numbered from offset 0."""
        entries = [(i, k, v) for i, (k, v) in enumerate(records)]
        return cls.from_log(entries, len(entries), loaded_at_ms)

    @classmethod
    def from_log(cls, entries: Iterable[Entry], position: int,
                 loaded_at_ms: int = 0) -> Registry:
        """Apply records in offset order, up to ``position``; records that break the
        rules are skipped with a warning (so running jobs keep decoding with what they
        had). A version's visibility position is the one stamped on it, or for the
        version a record introduces, 1 + that record's offset."""
        current: dict[str, Registration] = {}
        for offset, key, value in entries:
            if value is None:
                log.warning("ignoring tombstone for %r in the registry: table ids are never "
                            "released", key)
                continue
            try:
                reg = _positioned(Registration.decode(key, value), offset, current)
                _check_successor(current.get(reg.table), reg, current)
            except RegistryError as exc:
                log.warning("ignoring registry record at offset %d: %s", offset, exc)
                continue
            current[reg.table] = reg
        return cls(current, loaded_at_ms, position)

    @classmethod
    def load(cls, store: Store, clock: Callable[[], float] = time.time) -> Registry:
        started = int(clock() * 1000)
        entries, end = scan(store)
        return cls.from_log(entries, end, started)

    def as_of(self, position: int) -> Registry:
        """The registry exactly as it was at ``position`` (at most :attr:`position`):
        only the versions visible there, whatever was registered since. A pure
        function of the append-only history, so a replay pinned to a position decides
        as its first attempt did."""
        if position > self.position:
            raise RegistryError(
                f"registry snapshot at position {self.position} can't show position "
                f"{position}; re-read the registry topic first")
        if position == self.position:
            return self
        visible = {}
        for table, reg in self._by_table.items():
            seen = reg.as_of(position)
            if seen is not None:
                visible[table] = seen
        return Registry(visible, self.loaded_at_ms, position)

    def covers(self, timestamp_ms: int) -> bool:
        """True when no registration made after this snapshot can change how a
        message stamped ``timestamp_ms`` resolves: the snapshot was read after that
        time (a later registration gets a later ``registered_at_ms``, up to clock
        skew between the registering host and this one)."""
        return timestamp_ms < self.loaded_at_ms

    def table_id(self, table: str) -> int | None:
        """The table's stable id, None when not registered (``spark.components.
        TableRegistry``)."""
        reg = self._by_table.get(table)
        return reg.table_id if reg is not None else None

    def resolve(self, table: str, version: int, timestamp_ms: int) -> SchemaVersion:
        """:meth:`Registration.resolve` of ``table``; raises :class:`UnknownTable`
        or :class:`UnknownVersion`."""
        return self.get(table).resolve(version, timestamp_ms)

    def __contains__(self, table: object) -> bool:
        return table in self._by_table

    def registrations(self) -> list[Registration]:
        return sorted(self._by_table.values(), key=lambda r: r.table_id)

    def get(self, table: str) -> Registration:
        reg = self._by_table.get(table)
        if reg is None:
            raise UnknownTable(f"table {table} is not registered; register it with "
                               f"ba-schema register {table} --proto FILE --message NAME")
        return reg

    def by_id(self, table_id: int) -> Registration:
        reg = self._by_id.get(table_id)
        if reg is None:
            raise UnknownTable(f"no table has id {table_id}")
        return reg

    def tables(self) -> dict[int, str]:
        """Table id -> name, for :attr:`aggregator.core.model.Batch.tables`."""
        return {r.table_id: r.table for r in self._by_table.values()}

    def descriptor(self, table: str, version: int = LATEST) -> tuple[int, Descriptor]:
        """The resolved version number and message descriptor for ``table``."""
        v = self.get(table).version(version)
        return v.version, v.descriptor

    def next_registration(self, table: str, message_name: str, file_descriptor_set: bytes,
                          now_ms: int | None = None, *,
                          compatibility: Mode | None = None,
                          columns: Sequence[Column] | None = None,
                          force: bool = False) -> Registration | None:
        """The registration that adds this message type as a new version of
        ``table``, or None when the latest version is identical.

        The new version must keep the table's compatibility mode against the
        registered versions, judged with the live ``columns`` when given
        (:func:`proto.compat.check`); otherwise :class:`IncompatibleSchema` is raised,
        unless ``force``, which records the differences in the new version.
        ``compatibility`` sets the mode of a new table; for a registered table it
        must be the table's mode (change it with :func:`set_compatibility`)."""
        if not is_table_name(table):
            raise RegistryError(f"table {table!r} is not 'database.table'")
        descriptor = load_descriptor(file_descriptor_set, message_name)
        stamp = int(time.time() * 1000) if now_ms is None else now_ms
        old = self._by_table.get(table)
        if old is not None:
            # Registration times grow with versions, so "latest at time T" is the
            # highest version registered by T, and a new version never takes effect
            # for messages stamped before an existing one did.
            stamp = max(stamp, max(v.registered_at_ms for v in old.versions) + 1)
        recorded = () if columns is None else tuple(
            (c.name, c.type, c.default_kind, c.default_expression) for c in columns)
        if old is None:
            table_id = max(self._by_id, default=0) + 1
            mode = "" if compatibility is None else compatibility.value
            return Registration(table, table_id, (SchemaVersion(
                1, message_name, file_descriptor_set, stamp, columns=recorded),), mode)
        if compatibility is not None and compatibility != old.mode:
            raise CompatibilityError(
                f"{table} has compatibility mode {old.mode}, not {compatibility}; change it "
                f"first with ba-schema compatibility {table} {compatibility}")
        latest = old.latest
        if (latest.message_name, latest.file_descriptor_set) == (message_name,
                                                                 file_descriptor_set) and (
                latest.columns or not recorded):
            # Identical: a no-op, unless it records the columns the latest version was
            # registered without (a new version, so its plan is pinned from now on).
            return None
        from blockagg.proto.compat import check

        differences = [str(d) for d in check(
            old.mode, descriptor, [(v.version, v.descriptor) for v in old.versions], columns)]
        if differences and not force:
            raise IncompatibleSchema(table, old.mode.value, differences)
        return Registration(table, old.table_id, (*old.versions, SchemaVersion(
            latest.version + 1, message_name, file_descriptor_set, stamp,
            tuple(differences), columns=recorded)), old.compatibility)


def _positioned(reg: Registration, offset: int,
                current: Mapping[str, Registration]) -> Registration:
    """``reg`` (read at ``offset``) with every version's visibility position: as
    stamped, else as the table's earlier record resolved it, else ``offset + 1`` (the
    version this record introduces, or one of a record written before positions were
    stamped)."""
    old = current.get(reg.table)
    known = {v.version: v.position for v in old.versions} if old is not None else {}
    versions = []
    for v in reg.versions:
        if v.position > offset + 1:
            raise RegistryError(f"{reg.table} version {v.version} claims position "
                                f"{v.position}, after its own record at offset {offset}")
        position = v.position or known.get(v.version, offset + 1)
        versions.append(v if v.position == position else replace(v, position=position))
    return replace(reg, versions=tuple(versions))


def _check_successor(old: Registration | None, new: Registration,
                     current: Mapping[str, Registration]) -> None:
    if old is None:
        for other in current.values():
            if other.table_id == new.table_id:
                raise RegistryError(f"table id {new.table_id} of {new.table} is already used "
                                    f"by {other.table}")
        return
    if new.table_id != old.table_id:
        raise RegistryError(f"{new.table} changes table id {old.table_id} -> {new.table_id}")
    if new.versions[: len(old.versions)] != old.versions:
        raise RegistryError(f"{new.table} rewrites existing versions")


def register(store: Store, table: str, message_name: str, file_descriptor_set: bytes,
             now_ms: int | None = None, *, compatibility: Mode | None = None,
             columns: Sequence[Column] | None = None,
             force: bool = False) -> tuple[Registration, bool]:
    """Write a new version of ``table`` (re-reading the topic first and after, so a
    concurrent registration is detected). Returns the registration and whether a
    record was written (False: identical to the latest version).

    The version's ``registered_at_ms`` is ``now_ms`` (default: this host's clock),
    raised if needed above every earlier version's: messages with
    ``schema_version = 0`` stamped at or after it decode with the new version.
    A version that breaks the table's compatibility mode raises
    :class:`IncompatibleSchema` before anything is written, unless ``force``
    (see :meth:`Registry.next_registration`)."""
    registry = Registry.load(store)
    new = registry.next_registration(table, message_name, file_descriptor_set, now_ms,
                                     compatibility=compatibility, columns=columns,
                                     force=force)
    if new is None:
        return registry.get(table), False
    if new.latest.forced_incompatibilities:
        log.warning("registering %s version %d against its %s compatibility mode "
                    "(--force-incompatible): %s", table, new.latest.version, new.mode.value,
                    "; ".join(new.latest.forced_incompatibilities))
    return _write(store, new), True


def set_compatibility(store: Store, table: str, mode: Mode) -> tuple[Registration, bool]:
    """Set the compatibility mode of registered ``table`` (Confluent's per-subject
    config); it applies to the versions registered from now on. Returns the
    registration and whether a record was written."""
    old = Registry.load(store).get(table)
    if old.compatibility == mode.value:
        return old, False
    new = replace(old, compatibility=mode.value)
    return _write(store, new), True


def _write(store: Store, new: Registration) -> Registration:
    """Write ``new``; return it as read back (with the new version's position)."""
    store.write(new.table.encode(), new.encode())
    after = Registry.load(store).get(new.table)
    stamped = {v.version for v in new.versions if v.position}
    if replace(after, versions=tuple(v if v.version in stamped else replace(v, position=0)
                                     for v in after.versions)) != new:
        raise RegistryError(
            f"a concurrent registration of {new.table} won (now version "
            f"{after.latest.version}, id {after.table_id}); check with ba-schema show "
            f"{new.table} and retry")
    return after


class RegistryCache:
    """The registry as a long-lived process (a Spark worker) sees it: one snapshot,
    re-read from the store only when a decision needs a newer one.

    * :meth:`position` is the registry position a new batch is pinned to: the
      snapshot's, after checking the topic's end (:meth:`refresh`) when
      ``refresh_interval_s`` has passed since the last check or the caller knows the
      snapshot is too old (a message names a table or version it lacks, or is
      stamped after the last check); the check reads the topic again only when its
      end moved;
    * :meth:`at` is the registry as of a pinned position (a replay's): re-read when
      the snapshot is behind it, so a worker that never saw a table or version
      another worker pinned reads up to it first;
    * :meth:`for_messages`, :meth:`table_id` and :meth:`reload` as before.
    """

    def __init__(self, store: Store, clock: Callable[[], float] = time.time,
                 refresh_interval_s: float = 10.0) -> None:
        self.store = store
        self.clock = clock
        self.refresh_interval_s = refresh_interval_s
        self._snapshot: Registry | None = None
        self._views: dict[int, Registry] = {}
        self.checked_at_ms = 0
        """Wall clock (ms) of the last check: every record acknowledged before it is in
        the snapshot."""
        self.reloads = 0

    def current(self) -> Registry:
        if self._snapshot is None:
            return self.reload()
        return self._snapshot

    def reload(self) -> Registry:
        self.checked_at_ms = int(self.clock() * 1000)
        self._snapshot = Registry.load(self.store, lambda: self.checked_at_ms / 1000)
        self._views.clear()
        self.reloads += 1
        return self._snapshot

    def refresh(self) -> Registry:
        """Check the topic's end; re-read it only when it moved past the snapshot."""
        if self._snapshot is None:
            return self.reload()
        end = getattr(self.store, "end", None)
        if end is None:
            return self.reload()
        checked = int(self.clock() * 1000)
        if int(end()) != self._snapshot.position:
            return self.reload()
        self.checked_at_ms = self._snapshot.loaded_at_ms = checked
        return self._snapshot

    def position(self, newer: bool = False) -> int:
        """The registry position to pin a new batch to (see the class doc)."""
        due = self.clock() * 1000 - self.checked_at_ms >= self.refresh_interval_s * 1000
        snapshot = self.refresh() if newer or due or self._snapshot is None else self._snapshot
        return snapshot.position

    def at(self, position: int) -> Registry:
        """The registry as of ``position``; raises :class:`RegistryError` when the
        topic no longer reaches it (recreated or truncated)."""
        snapshot = self.current()
        if snapshot.position < position:
            snapshot = self.reload()
        if snapshot.position < position:
            raise RegistryError(
                f"the committed metadata pins the schema registry at position {position}, "
                f"but the registry topic ends at {snapshot.position}: it was recreated or "
                "truncated, so the blocks of the last intent can't be rebuilt as they were "
                "first decided. Restore the registry topic (same records, same order), or "
                "acknowledge with kafka-consumer-groups.sh --reset-offsets (see "
                "docs/protocol.md, 'What a replay depends on')")
        view = self._views.get(position)
        if view is None:
            view = self._views[position] = snapshot.as_of(position)
        return view

    def for_messages(self, timestamps_ms: Iterable[int]) -> Registry:
        snapshot = self.current()
        newest = max(timestamps_ms, default=None)
        if newest is not None and not snapshot.covers(newest):
            snapshot = self.reload()
        return snapshot

    def table_id(self, table: str) -> int | None:
        found = self.current().table_id(table)
        if found is None:
            found = self.reload().table_id(table)
        return found


def from_config(config: Any) -> RegistryCache:
    """The registry of a job configuration (``blockagg.config.Config``): the
    ``[schemas] topic`` read with the job's Kafka client settings."""
    return RegistryCache(KafkaStore(dict(config.kafka.librdkafka_config()),
                                    config.schemas.topic),
                         refresh_interval_s=config.schemas.refresh_interval)
