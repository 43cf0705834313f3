"""The schema registry's read side: table <-> protobuf message type, versioned.

Storage: a :class:`Store`; in production a compacted Kafka topic (default
``_blockagg_schemas``, :class:`aggregator.kafka.log_store.KafkaStore`). Key: the table name
``database.table`` (UTF-8). Value: a serialized ``blockagg.v1.Registration`` holding
the table's stable id and *every* version, so compaction (which keeps only the last
record per key) never loses history. Readers scan the topic from the beginning to
its end; the last record of a key wins.

Rules, enforced when registering (:mod:`registration.register`) and when reading (a
record that breaks them is refused, so a bad write can't change what running jobs
decode):

* a table's id is assigned at its first registration, never changes and is never
  reused; ids start at 1 (0 is the dead-letter table);
* versions start at 1 and only grow; an existing version is never changed;
* registering the same message type and descriptor as the latest version is a no-op;
* a new version must keep the table's compatibility mode (:mod:`registration.compat`;
  ``BACKWARD`` by default) against the registered versions, unless forced, and a
  forced version records the differences it overrode.

Positions: the registry as a job pins it is the topic up to an end offset, its
**position** (:attr:`Registry.position`; :func:`registry_pin` turns it into the
metadata pin). Every version carries the position from which it is visible (1 + the
offset of the record that introduced it, stamped on the version by every later
record of the table), so :meth:`Registry.as_of` gives the registry exactly as it was
at a position, whatever compaction removed since. A version also records the
ClickHouse columns it was checked against, from which its insert plan is made.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from typing import Final, Protocol

from google.protobuf.descriptor import Descriptor
from google.protobuf.message import DecodeError

from blockagg.proto.blockagg.v1 import registry_pb2
from blockagg.proto.descriptors import load_descriptor
from blockagg.proto.envelope import LATEST
from blockagg.proto.exceptions import (
    RegistryDecodeError,
    RegistryError,
    UnknownTable,
    UnknownVersion,
)
from blockagg.proto.modes import Mode, parse_mode

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
    :data:`proto.modes.DEFAULT_MODE`); kept as text so a record naming a mode this
    reader doesn't know still decodes."""

    @property
    def mode(self) -> Mode:
        """The table's compatibility mode; raises :class:`UnknownMode`."""
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
    end offset, cheaply) give positions: :class:`aggregator.kafka.log_store.KafkaStore`,
    :class:`MemoryStore`."""

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
