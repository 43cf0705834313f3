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
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, Final, Protocol

from google.protobuf.descriptor import Descriptor
from google.protobuf.message import DecodeError

from blockagg.aggregator import logs
from blockagg.proto.blockagg.v1 import registry_pb2
from blockagg.proto.descriptors import load_descriptor
from blockagg.proto.envelope import LATEST, is_table_name
from blockagg.proto.exceptions import (
    CompatibilityError,
    IncompatibleSchema,
    RegistryError,
    UnknownTable,
    UnknownVersion,
)

if TYPE_CHECKING:
    from blockagg.aggregator.clickhouse.rows import Column
    from blockagg.proto.compat import Mode

log = logging.getLogger(__name__)

DEFAULT_TOPIC: Final = "_blockagg_schemas"


@dataclass(frozen=True)
class SchemaVersion:
    version: int
    message_name: str
    file_descriptor_set: bytes
    registered_at_ms: int = 0
    forced_incompatibilities: tuple[str, ...] = ()
    """The compatibility differences overridden with ``--force-incompatible``."""

    @cached_property
    def descriptor(self) -> Descriptor:
        return load_descriptor(self.file_descriptor_set, self.message_name)


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
        raise UnknownVersion(
            f"table {self.table} has no schema version {number}; registered: "
            f"{', '.join(str(v.version) for v in self.versions)}")

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
                             forced_incompatibilities=v.forced_incompatibilities)
        return msg.SerializeToString(deterministic=True)

    @staticmethod
    def decode(key: bytes | None, value: bytes) -> Registration:
        try:
            msg = registry_pb2.Registration.FromString(value)
        except DecodeError as exc:
            raise RegistryError(f"registry record {key!r} is not a Registration: {exc}") from exc
        table = msg.table
        if key is not None and key.decode("utf-8", "replace") != table:
            raise RegistryError(f"registry record key {key!r} does not match table {table!r}")
        versions = tuple(SchemaVersion(v.version, v.message_name, v.file_descriptor_set,
                                       v.registered_at_ms, tuple(v.forced_incompatibilities))
                         for v in msg.versions)
        numbers = [v.version for v in versions]
        if not versions or numbers != sorted(set(numbers)) or numbers[0] < 1:
            raise RegistryError(f"registration of {table} has bad versions {numbers}")
        if msg.table_id < 1:
            raise RegistryError(f"registration of {table} has table id {msg.table_id}; ids "
                                "start at 1")
        return Registration(table, msg.table_id, versions, msg.compatibility)


class Store(Protocol):
    """Where registrations live: ``read`` returns every (key, value) record of the
    topic in order, up to its end at the time of the call; ``write`` returns once
    the record is durably written."""

    def read(self) -> list[tuple[bytes | None, bytes | None]]: ...

    def write(self, key: bytes, value: bytes) -> None: ...


@dataclass
class MemoryStore:
    """A :class:`Store` in memory, for tests."""

    records: list[tuple[bytes | None, bytes | None]] = field(default_factory=list)

    def read(self) -> list[tuple[bytes | None, bytes | None]]:
        return list(self.records)

    def write(self, key: bytes, value: bytes) -> None:
        self.records.append((key, value))


class KafkaStore:
    """The registry topic. ``config`` is librdkafka configuration
    (``bootstrap.servers``, SASL/TLS settings…), passed through unchanged."""

    def __init__(self, config: Mapping[str, Any], topic: str = DEFAULT_TOPIC,
                 timeout_s: float = 30.0) -> None:
        self.config = dict(config)
        self.topic = topic
        self.timeout_s = timeout_s

    def ensure_topic(self, replication_factor: int = -1) -> None:
        """Create the topic (1 partition, ``cleanup.policy=compact``) if missing."""
        from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

        admin = AdminClient(logs.kafka_client_config(self.config))
        md = admin.list_topics(timeout=self.timeout_s)
        if self.topic in md.topics:
            return
        futures = admin.create_topics([NewTopic(
            self.topic, num_partitions=1, replication_factor=replication_factor,
            config={"cleanup.policy": "compact"})])
        for fut in futures.values():
            try:
                fut.result(self.timeout_s)
            except Exception as exc:
                if "TOPIC_ALREADY_EXISTS" not in str(exc):
                    raise RegistryError(f"can't create registry topic {self.topic}: {exc}") from exc

    def read(self) -> list[tuple[bytes | None, bytes | None]]:
        from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

        conf = {**self.config, "group.id": f"blockagg-registry-{uuid.uuid4().hex}",
                "enable.auto.commit": False, "auto.offset.reset": "earliest",
                "enable.partition.eof": True, "isolation.level": "read_committed"}
        consumer = Consumer(logs.kafka_client_config(conf))
        try:
            md = consumer.list_topics(self.topic, timeout=self.timeout_s)
            topic = md.topics.get(self.topic)
            if topic is None or topic.error is not None:
                return []
            ends: dict[int, int] = {}
            parts = []
            for p in sorted(topic.partitions):
                low, high = consumer.get_watermark_offsets(
                    TopicPartition(self.topic, p), timeout=self.timeout_s)
                if high > low:
                    ends[p] = high
                    parts.append(TopicPartition(self.topic, p, low))
            records: list[tuple[bytes | None, bytes | None]] = []
            if not parts:
                return records
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
                records.append((msg.key(), msg.value()))
                if int(msg.offset() or 0) + 1 >= ends.get(partition, 0):
                    ends.pop(partition, None)
            return records
        except KafkaException as exc:
            raise RegistryError(f"can't read registry topic {self.topic}: {exc}") from exc
        finally:
            consumer.close()

    def write(self, key: bytes, value: bytes) -> None:
        from confluent_kafka import KafkaException, Producer

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


class Registry:
    """A snapshot of every registration, read from a :class:`Store`.

    ``loaded_at_ms`` is when the snapshot was read (wall clock of the reader; 0 when
    unknown): every registration written before it is in the snapshot. A message
    whose resolution could depend on a later registration (:meth:`covers` is False)
    should be resolved on a fresh snapshot (:class:`RegistryCache`).
    """

    def __init__(self, registrations: Mapping[str, Registration],
                 loaded_at_ms: int = 0) -> None:
        self._by_table = dict(registrations)
        self._by_id = {r.table_id: r for r in self._by_table.values()}
        self.loaded_at_ms = loaded_at_ms

    @classmethod
    def from_records(cls, records: Iterable[tuple[bytes | None, bytes | None]],
                     loaded_at_ms: int = 0) -> Registry:
        """Apply records in order; records that break the rules are skipped with a
        warning (so running jobs keep decoding with what they had)."""
        current: dict[str, Registration] = {}
        for key, value in records:
            if value is None:
                log.warning("ignoring tombstone for %r in the registry: table ids are never "
                            "released", key)
                continue
            try:
                reg = Registration.decode(key, value)
                _check_successor(current.get(reg.table), reg, current)
            except RegistryError as exc:
                log.warning("ignoring registry record: %s", exc)
                continue
            current[reg.table] = reg
        return cls(current, loaded_at_ms)

    @classmethod
    def load(cls, store: Store, clock: Callable[[], float] = time.time) -> Registry:
        started = int(clock() * 1000)
        return cls.from_records(store.read(), started)

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
        if old is None:
            table_id = max(self._by_id, default=0) + 1
            mode = "" if compatibility is None else compatibility.value
            return Registration(table, table_id, (SchemaVersion(1, message_name,
                                                                file_descriptor_set, stamp),),
                                mode)
        if compatibility is not None and compatibility != old.mode:
            raise CompatibilityError(
                f"{table} has compatibility mode {old.mode}, not {compatibility}; change it "
                f"first with ba-schema compatibility {table} {compatibility}")
        latest = old.latest
        if (latest.message_name, latest.file_descriptor_set) == (message_name,
                                                                 file_descriptor_set):
            return None
        from blockagg.proto.compat import check

        differences = [str(d) for d in check(
            old.mode, descriptor, [(v.version, v.descriptor) for v in old.versions], columns)]
        if differences and not force:
            raise IncompatibleSchema(table, old.mode.value, differences)
        return Registration(table, old.table_id, (*old.versions, SchemaVersion(
            latest.version + 1, message_name, file_descriptor_set, stamp,
            tuple(differences))), old.compatibility)


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
    _write(store, new)
    return new, True


def set_compatibility(store: Store, table: str, mode: Mode) -> tuple[Registration, bool]:
    """Set the compatibility mode of registered ``table`` (Confluent's per-subject
    config); it applies to the versions registered from now on. Returns the
    registration and whether a record was written."""
    old = Registry.load(store).get(table)
    if old.compatibility == mode.value:
        return old, False
    new = replace(old, compatibility=mode.value)
    _write(store, new)
    return new, True


def _write(store: Store, new: Registration) -> None:
    store.write(new.table.encode(), new.encode())
    after = Registry.load(store).get(new.table)
    if after != new:
        raise RegistryError(
            f"a concurrent registration of {new.table} won (now version "
            f"{after.latest.version}, id {after.table_id}); check with ba-schema show "
            f"{new.table} and retry")


class RegistryCache:
    """The registry as a long-lived process (a Spark worker) sees it: one snapshot,
    re-read from the store only when a decision needs a newer one.

    * :meth:`for_messages` returns a snapshot that is fresh enough for messages with
      the given timestamps: re-read when one of them is not :meth:`Registry.covers`
      by the current snapshot, so version 0 resolves on a snapshot that holds every
      version registered up to the message's time;
    * :meth:`table_id` (``spark.components.TableRegistry``) and :meth:`reload` re-read
      on an unknown table or version, so a fresh registration is seen at once.
    """

    def __init__(self, store: Store, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.clock = clock
        self._snapshot: Registry | None = None
        self.reloads = 0

    def current(self) -> Registry:
        if self._snapshot is None:
            return self.reload()
        return self._snapshot

    def reload(self) -> Registry:
        self._snapshot = Registry.load(self.store, self.clock)
        self.reloads += 1
        return self._snapshot

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
    """The registry of a job configuration (``aggregator.config.Config``): the
    ``[schemas] topic`` read with the job's Kafka client settings."""
    return RegistryCache(KafkaStore(dict(config.kafka.librdkafka_config()),
                                    config.schemas.topic))
