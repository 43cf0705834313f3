"""The task's wiring of the pins (no Spark): the last commit is read first, a new batch
is pinned to the current registry position, topic incarnation and deduplication mode,
and a replay is prepared under its intent's pins whatever changed in between."""

from __future__ import annotations

from typing import Any

import pytest

from blockagg import logs
from blockagg.aggregator.core.exceptions import TopicIncarnationChanged
from blockagg.aggregator.core.metadata import DedupMode, Pins, decode
from blockagg.aggregator.core.model import Batch, Block, Committed
from blockagg.config import loads
from blockagg.proto.descriptors import compile_proto, load_descriptor, message_class
from blockagg.proto.envelope import make_envelope
from blockagg.proto.registry import MemoryStore, RegistryCache, registry_pin
from blockagg.registration.register import register
from blockagg.rows.columns import Column, Rows
from blockagg.rows.deadletters import DeadLetter
from blockagg.spark import components, task
from blockagg.spark.offsets import PlannedRange
from blockagg.spark.task import TaskContext, run_range

T0 = 1_700_000_000_000
CONFIG = """
[job]
checkpoint_location = "/tmp/ck"
[kafka]
"bootstrap.servers" = "x:1"
[[topics]]
name = "t"
replicas = ["ch:9000"]
[blocks]
max_rows = 2
"""
V1 = [Column("a", "Int32")]
V2 = [Column("a", "Int32"), Column("b", "String", "DEFAULT", "''")]


class Crash(Exception):
    pass


class Store:
    def __init__(self) -> None:
        self.commits: dict[tuple[str, int], Committed] = {}
        self.crash_after = -1

    def committed(self, topic: str, partition: int) -> Committed | None:
        return self.commits.get((topic, partition))

    def commit(self, topic: str, partition: int, offset: int, metadata: str) -> None:
        self.commits[(topic, partition)] = Committed(offset, metadata)
        self.crash_after -= 1
        if self.crash_after == 0:
            raise Crash("after the commit")


class Sink:
    """What reached ClickHouse, per block token: (pins, rows with their values)."""

    def __init__(self) -> None:
        self.blocks: dict[str, tuple[Pins, list[Any]]] = {}

    def insert(self, block: Block, batch: Batch, confirmed_at: float | None = None) -> None:
        rows: list[Any] = []
        for p in block.positions.tolist():
            payload = batch.payloads[p]
            if isinstance(payload, DeadLetter):
                rows.append(payload.row())
            else:
                assert isinstance(payload, Rows)
                rows.append([list(v[payload.start:payload.stop])
                             for v in payload.columns.values])
        self.blocks.setdefault(block.token, (batch.pins, rows))
        assert self.blocks[block.token] == (batch.pins, rows), "a replay differs"


class Components:
    def __init__(self, registry: RegistryCache) -> None:
        self._store = Store()
        self._sink = Sink()
        self._registry = registry
        self.topic_incarnation = 11
        self.mode = DedupMode.BLOCK_HASH

    def store(self, config: Any) -> Store:
        return self._store

    def sink(self, config: Any, topic: Any) -> Sink:
        return self._sink

    def registry(self, config: Any) -> RegistryCache:
        return self._registry

    def incarnation(self, config: Any, topic: str) -> int:
        return self.topic_incarnation

    def dedup_mode(self, config: Any, topic: Any) -> int:
        return self.mode


@pytest.fixture(scope="module")
def fds(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("p") / "v.proto"
    path.write_text('syntax = "proto3"; package vt;\n'
                    "message V1 { int32 a = 1; }\n"
                    "message V2 { int32 a = 1; string b = 2; }\n")
    return compile_proto(path)


@pytest.fixture(autouse=True)
def live(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Column]]:
    columns = {"db.a": V2, "db.b": V1}
    monkeypatch.setattr(components, "_CACHE", {})
    monkeypatch.setattr(task, "live_columns", lambda config, topic, table: columns[table])
    monkeypatch.setattr(task, "live_columns_many",
                        lambda config, topic, tables: {t: columns[t] for t in tables})
    return columns


def envelope(fds: bytes, table: str, a: int, version: int = 0) -> bytes:
    cls: Any = message_class(load_descriptor(fds, "vt.V1"))
    return make_envelope(table, [cls(a=a).SerializeToString()], version)


def run(comps: Components, values: list[bytes], end: int | None = None) -> dict[str, Any]:
    ctx = TaskContext(loads(CONFIG), comps, {("t", 0): PlannedRange("t", 0, 0, end or
                                                                     len(values))}, 1, 2)
    return run_range(ctx, ("t", 0), list(range(len(values))), values, [T0 + 50] * len(values))


def test_every_commit_carries_the_current_pins(fds: bytes) -> None:
    store = MemoryStore()
    register(store, "db.a", "vt.V1", fds, now_ms=T0, columns=V1)
    comps = Components(RegistryCache(store))
    run(comps, [envelope(fds, "db.a", i) for i in range(3)])
    metadata = decode(comps._store.commits[("t", 0)].metadata)
    assert metadata.pins == Pins(registry_pin(1), 11, DedupMode.BLOCK_HASH)
    assert all(token.startswith("blockagg:000000000000000b:t:0:db.a:")
               for token in comps._sink.blocks)


def test_a_replay_after_registry_and_server_changes_decides_as_the_first_attempt(
        fds: bytes) -> None:
    store = MemoryStore()
    register(store, "db.a", "vt.V1", fds, now_ms=T0, columns=V1)
    cache = RegistryCache(store, refresh_interval_s=0)
    comps = Components(cache)
    values = [envelope(fds, "db.a", 1), envelope(fds, "db.b", 2), envelope(fds, "db.a", 3),
              envelope(fds, "db.a", 4, version=2), envelope(fds, "db.b", 5)]
    comps._store.crash_after = 2   # dies after the second intent, blocks maybe inserted
    with pytest.raises(Crash):
        run(comps, values)
    first = dict(comps._sink.blocks)
    intent = decode(comps._store.commits[("t", 0)].metadata)
    assert intent.blocks and intent.pins.registry == registry_pin(1)
    # Between the attempt and the replay: db.b registered, db.a v2 registered (and its
    # producers' version 0 would now resolve to it), the server upgraded to tokens.
    register(store, "db.b", "vt.V1", fds, now_ms=T0, columns=V1)
    register(store, "db.a", "vt.V2", fds, now_ms=T0 + 1, columns=V2)
    comps.mode = DedupMode.TOKEN
    report = run(comps, values)
    assert report["replayed_blocks"] >= 1
    for token, block in first.items():
        assert comps._sink.blocks[token] == block       # same rows, values, pins
    assert all(pins == intent.pins for pins, _ in comps._sink.blocks.values())
    dead = [row for _, rows in comps._sink.blocks.values() for row in rows
            if isinstance(row, tuple)]
    assert sorted(r[3] for r in dead) == [1, 3, 4]       # db.b x2 and v2: as first decided
    # The next batch takes the current pins: db.b is a table now, v2 is known.
    report = run(comps, [*values, envelope(fds, "db.b", 6), envelope(fds, "db.a", 7, 2)])
    final = decode(comps._store.commits[("t", 0)].metadata)
    assert final.pins == Pins(registry_pin(3), 11, DedupMode.TOKEN)
    assert report["dead_letters"] == {}


def test_a_recreated_topic_is_refused_before_anything_is_done(fds: bytes) -> None:
    store = MemoryStore()
    register(store, "db.a", "vt.V1", fds, now_ms=T0, columns=V1)
    comps = Components(RegistryCache(store))
    run(comps, [envelope(fds, "db.a", i) for i in range(3)])
    before = dict(comps._store.commits)
    comps.topic_incarnation = 12
    with pytest.raises(TopicIncarnationChanged, match="reset-offsets --to-earliest"):
        run(comps, [envelope(fds, "db.a", i) for i in range(5)])
    assert comps._store.commits == before


def test_a_worker_that_never_saw_the_pinned_position_reads_up_to_it(fds: bytes) -> None:
    store = MemoryStore()
    register(store, "db.a", "vt.V1", fds, now_ms=T0, columns=V1)
    writer = Components(RegistryCache(store, refresh_interval_s=0))
    writer._store.crash_after = 1
    register(store, "db.b", "vt.V1", fds, now_ms=T0, columns=V1)
    with pytest.raises(Crash):
        run(writer, [envelope(fds, "db.b", 1), envelope(fds, "db.a", 2)])
    stale = RegistryCache(MemoryStore(store.records[:1]), refresh_interval_s=3600)
    stale.current()
    stale.store = store           # the topic moved on; this worker's snapshot did not
    other = Components(stale)
    other._store, other._sink = writer._store, writer._sink
    run(other, [envelope(fds, "db.b", 1), envelope(fds, "db.a", 2)])
    assert stale.current().position == 2


def test_an_intent_written_before_pins_replays_as_before(fds: bytes) -> None:
    """A ``ba1:`` intent (no pins): the replay takes the current registry and the
    server's mode and keeps the token format without incarnation, so its blocks are
    the ones the earlier version sent; the commits after it carry pins again."""
    from blockagg.aggregator.core.metadata import BlockRange, Metadata, encode_base85

    store = MemoryStore()
    register(store, "db.a", "vt.V1", fds, now_ms=T0, columns=V1)
    comps = Components(RegistryCache(store))
    legacy = Metadata(9, 3, 0, 3, 0, (BlockRange(1, 0, 1),))
    assert encode_base85(legacy).startswith("ba1:")
    comps._store.commits[("t", 0)] = Committed(0, encode_base85(legacy))
    report = run(comps, [envelope(fds, "db.a", i) for i in range(3)])
    assert report["replayed_blocks"] == 1
    assert "blockagg:t:0:db.a:0-1" in comps._sink.blocks           # the old token format
    replayed = comps._sink.blocks["blockagg:t:0:db.a:0-1"][0]
    assert replayed == Pins(registry_pin(1), 0, DedupMode.BLOCK_HASH)
    final = decode(comps._store.commits[("t", 0)].metadata)
    assert final.is_final and final.pins == replayed
    run(comps, [envelope(fds, "db.a", i) for i in range(5)])
    assert decode(comps._store.commits[("t", 0)].metadata).pins.incarnation == 11


class Marked(Components):
    """Components whose shard deduplicates by content hash and reads a structure mark
    (``aggregator.clickhouse.structure``): ``marks`` says what each batch asked for."""

    def __init__(self, registry: RegistryCache) -> None:
        super().__init__(registry)
        self.mark = 500
        self.marks: list[tuple[str, ...]] = []

    def structure_mark(self, config: Any, topic: Any, tables: Any) -> int:
        self.marks.append(tuple(tables))
        return self.mark


def test_a_content_hash_batch_pins_the_mark_of_every_registered_table_and_a_replay_keeps_it(
        fds: bytes) -> None:
    store = MemoryStore()
    register(store, "db.a", "vt.V1", fds, now_ms=T0, columns=V1)
    register(store, "db.b", "vt.V1", fds, now_ms=T0, columns=V1)
    comps = Marked(RegistryCache(store))
    values = [envelope(fds, "db.a", 1), envelope(fds, "db.b", 2), envelope(fds, "db.a", 3)]
    comps._store.crash_after = 1
    with pytest.raises(Crash):
        run(comps, values)
    assert comps.marks == [("blockagg.dead_letters", "db.a", "db.b")]
    assert decode(comps._store.commits[("t", 0)].metadata).pins.structure == 500
    comps.mark = 900                         # an ALTER since: the replay must not take it
    run(comps, values)
    assert {pins.structure for pins, _ in comps._sink.blocks.values()} == {500}
    comps.mode = DedupMode.TOKEN             # token deduplication: no mark, none asked
    asked = len(comps.marks)
    run(comps, [*values, envelope(fds, "db.a", 4)])
    assert decode(comps._store.commits[("t", 0)].metadata).pins.structure == 0
    assert len(comps.marks) == asked


def run_marked(comps: Components, values: list[bytes], marks: dict[str, int]) -> None:
    ctx = TaskContext(loads(CONFIG), comps, {("t", 0): PlannedRange("t", 0, 0, len(values))},
                      1, 2, structure_marks=marks)
    run_range(ctx, ("t", 0), list(range(len(values))), values, [T0 + 50] * len(values))


def test_a_mark_the_driver_read_for_the_batch_is_pinned_and_the_task_reads_none(
        fds: bytes) -> None:
    store = MemoryStore()
    register(store, "db.a", "vt.V1", fds, now_ms=T0, columns=V1)
    comps = Marked(RegistryCache(store))
    run_marked(comps, [envelope(fds, "db.a", 1), envelope(fds, "db.a", 2)], {"t": 300})
    assert comps.marks == []
    assert decode(comps._store.commits[("t", 0)].metadata).pins.structure == 300
    assert {pins.structure for pins, _ in comps._sink.blocks.values()} == {300}


def test_without_a_driver_mark_for_its_topic_the_task_reads_its_own(fds: bytes) -> None:
    """No mark for the topic (the driver's read failed, or found no replicated table in
    its view of the registry): the task reads one, as before the driver read any."""
    store = MemoryStore()
    register(store, "db.a", "vt.V1", fds, now_ms=T0, columns=V1)
    comps = Marked(RegistryCache(store))
    run_marked(comps, [envelope(fds, "db.a", 1)], {"other": 300})
    assert comps.marks == [("blockagg.dead_letters", "db.a")]
    assert decode(comps._store.commits[("t", 0)].metadata).pins.structure == 500


def test_a_driver_mark_is_ignored_once_the_shard_deduplicates_by_token(fds: bytes) -> None:
    """The shard crossed the token boundary between the driver's read and the task's
    (a rolling upgrade): the batch is pinned to token deduplication, without a mark."""
    store = MemoryStore()
    register(store, "db.a", "vt.V1", fds, now_ms=T0, columns=V1)
    comps = Marked(RegistryCache(store))
    comps.mode = DedupMode.TOKEN
    run_marked(comps, [envelope(fds, "db.a", 1)], {"t": 300})
    assert decode(comps._store.commits[("t", 0)].metadata).pins == Pins(
        registry_pin(1), 11, DedupMode.TOKEN, 0)


def test_a_replay_keeps_its_intents_mark_whatever_the_driver_read(fds: bytes) -> None:
    store = MemoryStore()
    register(store, "db.a", "vt.V1", fds, now_ms=T0, columns=V1)
    comps = Marked(RegistryCache(store))
    values = [envelope(fds, "db.a", 1), envelope(fds, "db.a", 2), envelope(fds, "db.a", 3)]
    comps._store.crash_after = 1
    with pytest.raises(Crash):
        run_marked(comps, values, {"t": 300})
    run_marked(comps, values, {"t": 800})     # an ALTER since the intent
    assert {pins.structure for pins, _ in comps._sink.blocks.values()} == {300}


class Shard(Marked):
    """A double of the driver's view of each topic's shard for :func:`task.structure_marks`."""

    def __init__(self, registry: RegistryCache, modes: dict[str, int],
                 marks: dict[str, int | Exception]) -> None:
        super().__init__(registry)
        self.modes = modes
        self.by_topic = marks

    def dedup_mode(self, config: Any, topic: Any) -> int:
        return self.modes[topic.name]

    def structure_mark(self, config: Any, topic: Any, tables: Any) -> int:
        self.marks.append(tuple(tables))
        value = self.by_topic[topic.name]
        if isinstance(value, Exception):
            raise value
        return value


THREE_TOPICS = CONFIG + "".join(f'[[topics]]\nname = "{t}"\nreplicas = ["ch:9000"]\n'
                                for t in ("u", "v", "w"))


def test_the_driver_reads_one_mark_per_content_hash_topic(
        fds: bytes, caplog: pytest.LogCaptureFixture) -> None:
    """Token topics have none; a topic whose mark is 0 (nothing replicated) or unreadable
    is left to its tasks, the latter with a WARNING naming the topic and the error."""
    store = MemoryStore()
    register(store, "db.a", "vt.V1", fds, now_ms=T0, columns=V1)
    hash_, token = DedupMode.BLOCK_HASH, DedupMode.TOKEN
    shard = Shard(RegistryCache(store), {"t": hash_, "u": token, "v": hash_, "w": hash_},
                  {"t": 41, "u": 99, "v": 0, "w": ConnectionError("ch:9000 refused")})
    marks = task.structure_marks(shard, loads(THREE_TOPICS), ["w", "t", "u", "v", "t"])
    assert marks == {"t": 41}
    assert shard.marks == [("blockagg.dead_letters", "db.a")] * 3
    [fields] = [getattr(r, logs._FIELDS_ATTR) for r in caplog.records
                if r.getMessage().startswith("structure mark not read by the driver")]
    assert fields == {"topic": "w", "error": "ConnectionError: ch:9000 refused"}


def test_components_without_marks_give_the_driver_none(fds: bytes) -> None:
    comps = Components(RegistryCache(MemoryStore()))
    assert task.structure_marks(comps, loads(CONFIG), ["t"]) == {}
