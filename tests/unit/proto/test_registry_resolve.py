"""Deterministic schema resolution: ``schema_version = 0`` resolves by the message's
Kafka timestamp, so a replay decodes alike whatever was registered in between."""

from __future__ import annotations

import pytest

from blockagg.proto.descriptors import compile_proto
from blockagg.proto.exceptions import UnknownTable, UnknownVersion
from blockagg.proto.registry import MemoryStore, Registry, RegistryCache
from blockagg.registration.register import register

T0 = 1_700_000_000_000


@pytest.fixture(scope="module")
def two_fds(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("p") / "v.proto"
    path.write_text('syntax = "proto3"; package vt;\n'
                    "message V1 { int32 a = 1; }\n"
                    "message V2 { int32 a = 1; string b = 2; }\n"
                    "message V3 { int32 a = 1; string b = 2; int64 c = 3; }\n")
    return compile_proto(path)


def test_latest_is_the_version_registered_by_the_message_time(two_fds: bytes) -> None:
    store = MemoryStore()
    register(store, "db.t", "vt.V1", two_fds, now_ms=T0)
    register(store, "db.t", "vt.V2", two_fds, now_ms=T0 + 1000)
    reg = Registry.load(store).get("db.t")
    assert reg.resolve(0, T0).version == 1
    assert reg.resolve(0, T0 + 999).version == 1
    assert reg.resolve(0, T0 + 1000).version == 2
    assert reg.resolve(0, T0 + 10**9).version == 2
    assert reg.resolve(1, T0 + 10**9).version == 1          # pinned: exact
    with pytest.raises(UnknownVersion, match="no version was registered at or before"):
        reg.resolve(0, T0 - 1)
    with pytest.raises(UnknownVersion, match="pin schema_version"):
        reg.resolve(0, -1)                                   # no timestamp
    with pytest.raises(UnknownVersion):
        reg.resolve(7, T0)


def test_a_later_registration_does_not_change_an_earlier_message(two_fds: bytes) -> None:
    store = MemoryStore()
    register(store, "db.t", "vt.V1", two_fds, now_ms=T0)
    first = Registry.load(store).resolve("db.t", 0, T0 + 500)
    register(store, "db.t", "vt.V2", two_fds, now_ms=T0 + 1000)
    replay = Registry.load(store).resolve("db.t", 0, T0 + 500)
    assert first == replay and replay.version == 1


def test_registration_times_grow_with_versions(two_fds: bytes) -> None:
    store = MemoryStore()
    register(store, "db.t", "vt.V1", two_fds, now_ms=T0)
    register(store, "db.t", "vt.V2", two_fds, now_ms=T0 - 5000)   # registrar clock behind
    register(store, "db.t", "vt.V3", two_fds, now_ms=T0 - 9000)
    times = [v.registered_at_ms for v in Registry.load(store).get("db.t").versions]
    assert times == [T0, T0 + 1, T0 + 2]


def test_versions_without_a_time_count_as_always_registered(two_fds: bytes) -> None:
    store = MemoryStore()
    register(store, "db.t", "vt.V1", two_fds, now_ms=0)
    assert Registry.load(store).resolve("db.t", 0, 0).version == 1


def test_tombstone_keeps_the_table_and_a_missing_table_is_unknown(two_fds: bytes) -> None:
    store = MemoryStore()
    register(store, "db.t", "vt.V1", two_fds, now_ms=T0)
    store.records.append((b"db.t", None))
    registry = Registry.load(store)
    assert registry.table_id("db.t") == 1 and registry.resolve("db.t", 0, T0).version == 1
    empty = Registry.from_records([])
    assert empty.table_id("db.t") is None
    with pytest.raises(UnknownTable):
        empty.resolve("db.t", 0, T0)


def test_cache_reloads_only_when_a_message_is_newer_than_the_snapshot(two_fds: bytes) -> None:
    store = MemoryStore()
    register(store, "db.t", "vt.V1", two_fds, now_ms=T0)
    now = [T0 / 1000 + 10]
    cache = RegistryCache(store, clock=lambda: now[0])
    snap = cache.current()
    assert snap.loaded_at_ms == T0 + 10_000 and cache.reloads == 1
    assert cache.for_messages([T0 + 5_000]) is snap                 # covered
    register(store, "db.t", "vt.V2", two_fds, now_ms=T0 + 20_000)
    now[0] = T0 / 1000 + 30
    fresh = cache.for_messages([T0 + 5_000, T0 + 25_000])           # not covered: re-read
    assert cache.reloads == 2 and fresh.resolve("db.t", 0, T0 + 25_000).version == 2
    assert fresh.resolve("db.t", 0, T0 + 5_000).version == 1
    assert cache.table_id("db.nope") is None and cache.reloads == 3
