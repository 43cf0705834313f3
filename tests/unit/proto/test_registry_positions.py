"""Registry positions: the registry as of a pinned position is a pure function of the
append-only history, whatever was registered or compacted since; the worker's cache
checks the topic's end on ``refresh_interval`` and re-reads up to a pinned position."""

from __future__ import annotations

import pytest

from blockagg.proto.descriptors import compile_proto
from blockagg.proto.exceptions import RegistryError, UnknownVersion
from blockagg.proto.modes import Mode
from blockagg.proto.registry import (
    MemoryStore,
    Registration,
    Registry,
    RegistryCache,
    pinned_position,
    registry_pin,
)
from blockagg.registration.register import register, set_compatibility
from blockagg.rows.columns import Column

T0 = 1_700_000_000_000
COLUMNS = [Column("a", "Int32"), Column("b", "String", "DEFAULT", "''")]


@pytest.fixture(scope="module")
def fds(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("p") / "v.proto"
    path.write_text('syntax = "proto3"; package vt;\n'
                    "message V1 { int32 a = 1; }\n"
                    "message V2 { int32 a = 1; string b = 2; }\n")
    return compile_proto(path)


def compacted(store: MemoryStore) -> MemoryStore:
    """What log compaction leaves: each key's last record, at its offset (a removed
    record leaves an offset hole, kept here as a None key and value that the registry
    skips like any tombstone)."""
    last = {key: i for i, (key, _) in enumerate(store.records)}
    return MemoryStore([(k, v) if last.get(k) == i else (None, None)
                        for i, (k, v) in enumerate(store.records)])


def history(fds: bytes) -> MemoryStore:
    store = MemoryStore()
    register(store, "db.a", "vt.V1", fds, now_ms=T0, columns=COLUMNS[:1])      # offset 0
    register(store, "db.b", "vt.V1", fds, now_ms=T0)                           # offset 1
    register(store, "db.a", "vt.V2", fds, now_ms=T0 + 10, columns=COLUMNS)      # offset 2
    return store


def test_as_of_shows_exactly_what_was_registered_at_a_position(fds: bytes) -> None:
    registry = Registry.load(history(fds))
    assert registry.position == 3
    versions = {t: [v.version for v in registry.as_of(p).get(t).versions]
                for p in (1, 2, 3) for t in ("db.a",)}
    assert versions == {"db.a": [1, 2]}
    assert [v.position for v in registry.get("db.a").versions] == [1, 3]
    assert "db.a" not in registry.as_of(0) and "db.b" not in registry.as_of(1)
    assert registry.as_of(1).get("db.a").latest.version == 1
    assert registry.as_of(2).table_id("db.b") == 2
    assert registry.as_of(3) is registry
    with pytest.raises(RegistryError, match="re-read"):
        registry.as_of(4)


def test_version_zero_resolves_among_the_versions_visible_at_the_position(fds: bytes) -> None:
    registry = Registry.load(history(fds))
    assert registry.as_of(2).resolve("db.a", 0, T0 + 10).version == 1
    assert registry.as_of(3).resolve("db.a", 0, T0 + 10).version == 2
    with pytest.raises(UnknownVersion) as first:
        registry.as_of(2).resolve("db.a", 2, T0)
    with pytest.raises(UnknownVersion) as later:
        registry.as_of(3).resolve("db.a", 3, T0)
    # A dead letter's text names the message's version, never what is registered now.
    assert "registered:" not in str(first.value) and "registered:" not in str(later.value)


def test_positions_survive_compaction(fds: bytes) -> None:
    store = history(fds)
    set_compatibility(store, "db.a", Mode.NONE)                  # offset 3
    before = Registry.load(store)
    after = Registry.load(compacted(store))
    assert after.position == before.position == 4
    for position in range(5):
        assert (after.as_of(position).registrations()
                == before.as_of(position).registrations()), position


def test_a_record_written_before_positions_existed_resolves_to_its_offset(fds: bytes) -> None:
    store = MemoryStore()
    register(store, "db.a", "vt.V1", fds, now_ms=T0)
    legacy = Registration.decode(b"db.a", store.records[0][1])  # type: ignore[arg-type]
    assert legacy.versions[0].position == 0  # the introducing record leaves it unstamped
    registry = Registry.load(store)
    assert registry.get("db.a").versions[0].position == 1


def test_a_claimed_position_after_its_own_record_is_ignored(fds: bytes) -> None:
    store = MemoryStore()
    register(store, "db.a", "vt.V1", fds, now_ms=T0)
    reg = Registry.load(store).get("db.a")
    forged = reg.__class__(reg.table, reg.table_id, tuple(
        v.__class__(v.version, v.message_name, v.file_descriptor_set, v.registered_at_ms,
                    position=9) for v in reg.versions))
    registry = Registry.from_records([(b"db.a", forged.encode())])
    assert "db.a" not in registry


def test_register_records_the_checked_columns_and_can_add_them_later(fds: bytes) -> None:
    store = MemoryStore()
    reg, written = register(store, "db.a", "vt.V1", fds, now_ms=T0)
    assert written and reg.latest.columns == ()
    assert register(store, "db.a", "vt.V1", fds) == (reg, False)      # identical: no-op
    again, written = register(store, "db.a", "vt.V1", fds, columns=COLUMNS[:1])
    assert written and again.latest.version == 2
    assert again.latest.columns == (("a", "Int32", "", ""),)
    assert Registry.load(store).get("db.a") == again                 # round trip
    assert register(store, "db.a", "vt.V1", fds, columns=COLUMNS[:1])[1] is False


def test_pins_keep_zero_for_not_pinned() -> None:
    assert registry_pin(0) == 1 and pinned_position(registry_pin(7)) == 7


class CountingStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.scans = 0
        self.ends = 0

    def scan(self) -> tuple[list[tuple[int, bytes | None, bytes | None]], int]:
        self.scans += 1
        return super().scan()

    def end(self) -> int:
        self.ends += 1
        return super().end()


def test_cache_checks_the_end_on_refresh_interval_and_reads_only_when_it_moved(
        fds: bytes) -> None:
    store = CountingStore()
    register(store, "db.a", "vt.V1", fds, now_ms=T0)
    now = [1000.0]
    cache = RegistryCache(store, clock=lambda: now[0], refresh_interval_s=10)
    scans = store.scans
    assert cache.position() == 1 and store.scans == scans + 1          # first read
    now[0] += 5
    assert cache.position() == 1 and store.ends == 0                   # not due
    now[0] += 5
    assert cache.position() == 1 and (store.ends, store.scans) == (1, scans + 1)
    assert cache.checked_at_ms == 1_010_000 and cache.current().covers(1_009_999)
    register(store, "db.a", "vt.V2", fds, now_ms=T0 + 1)
    assert cache.position() == 1                                       # not due yet
    assert cache.position(newer=True) == 2                             # a message needs it
    assert cache.current().get("db.a").latest.version == 2


def test_cache_reads_up_to_a_pinned_position_it_has_not_seen(fds: bytes) -> None:
    store = MemoryStore()
    register(store, "db.a", "vt.V1", fds, now_ms=T0)
    cache = RegistryCache(store, refresh_interval_s=3600)
    assert cache.position() == 1
    register(store, "db.b", "vt.V1", fds, now_ms=T0)          # another worker pinned 2
    assert "db.b" in cache.at(2) and "db.b" not in cache.at(1)
    assert cache.at(1) is cache.at(1)                          # views are kept
    with pytest.raises(RegistryError, match="recreated or truncated"):
        cache.at(5)
