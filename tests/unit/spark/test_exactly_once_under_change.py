"""Exactly once while the world changes (issue 12): a seeded property test through the
task's real path (``spark.task.run_range``: envelope parsing, the registry as of the
pinned position, vectorised decoding, the core protocol, the real ClickHouse writer)
with in-memory fakes of the registry topic, the offset commits and two ClickHouse
replicas.

Random multi-table streams on two partitions are interleaved with registry changes
(a new table, a compatible new version, a forced incompatible one), ALTER TABLE ADD
COLUMN, replica failovers, a rolling upgrade across the ``insert_deduplication_token``
boundary (where the content hash changes too), worker restarts (a fresh registry
cache) and crashes before or after any commit or insert, retried over the same range
or the driver's recovery range. At the
end every message's rows are in their table exactly once *with their values* (as the
producer wrote them, or the column's DEFAULT for a version without the field), and
every other message is exactly once in the dead letters.

Producers behave as documented: a message uses a registered version (explicitly, or
``schema_version = 0`` with the latest one), except messages to tables not registered
yet, which may go either way but exactly once.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import pytest
from clickhouse_driver import errors as ch_errors
from hypothesis import given, settings
from hypothesis import strategies as st

from blockagg.aggregator.clickhouse.exceptions import ClickHouseError, TableNotFound
from blockagg.aggregator.clickhouse.writer import ClickHouseBlockWriter, Replica, WriterConfig
from blockagg.aggregator.core.metadata import decode, is_blockagg
from blockagg.aggregator.core.model import Batch, Block, Committed
from blockagg.config import loads
from blockagg.proto.descriptors import compile_proto, load_descriptor, message_class
from blockagg.proto.envelope import make_envelope
from blockagg.proto.registry import MemoryStore, Registry, RegistryCache
from blockagg.registration.register import register
from blockagg.rows.columns import Column
from blockagg.spark import components, task
from blockagg.spark.offsets import PlannedRange
from blockagg.spark.task import TaskContext, run_range

TOPIC = "t"
TABLES = ("db.t1", "db.t2", "db.t3")
DEAD = "blockagg.dead_letters"
PROTO = ('syntax = "proto3"; package vt;\n'
         "message V1 { int32 a = 1; }\n"
         "message V2 { int32 a = 1; string b = 2; }\n"
         "message V3 { int32 a = 1; string b = 3; }\n")  # b renumbered: incompatible
BASE = [Column("a", "Int32"), Column("_topic", "String"), Column("_partition", "UInt32"),
        Column("_offset", "UInt64")]
B = Column("b", "String", "DEFAULT", "'none'")
CONFIG = f"""
[job]
checkpoint_location = "/tmp/ck"
[kafka]
"bootstrap.servers" = "x:1"
[[topics]]
name = "{TOPIC}"
replicas = ["a:9000", "b:9000"]
[schemas]
refresh_interval = "1ms"
"""


class Crash(Exception):
    """The process dies here."""


@dataclass
class ClickHouse:
    """Two replicas of every table sharing one deduplication log per table (as
    ReplicatedMergeTree does in ZooKeeper): a block is known by its token when one is
    sent, else by its content; a server older than 22.2 refuses the token setting."""

    live: dict[str, list[Column]] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=lambda: {"a": "18.16.1",
                                                               "b": "18.16.1"})
    down: set[str] = field(default_factory=set)
    seen: dict[str, deque[Any]] = field(default_factory=dict)
    rows: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def client(self, replica: Replica) -> Any:
        return FakeClient(self, replica.host)


@dataclass
class FakeClient:
    server: ClickHouse
    host: str

    def execute(self, query: str, params: Any = None, *, columnar: bool = False,
                settings: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        if self.host in self.server.down:
            raise EOFError(f"{self.host} is down")
        version = self.server.versions[self.host]
        if query == "SELECT version()":
            return [(version,)]
        if query.startswith("SHOW CREATE TABLE "):
            return [(f"CREATE TABLE {query.split()[-1]} (x UInt64) ENGINE = "
                     "ReplicatedMergeTree('/t', '{replica}') ORDER BY x",)]
        if "system.merge_tree_settings" in query:
            return [("604800",)]
        if query.startswith("SELECT count() FROM system.columns"):
            return [(0,)]    # the dead-letter table has no incarnation column
        assert query.startswith("INSERT INTO "), query
        table = query.split()[2]
        names = [n.strip("`") for n in query[query.index("(") + 1:query.index(")")].split(", ")]
        token = (settings or {}).get("insert_deduplication_token")
        if token is not None and tuple(map(int, version.split(".")[:2])) < (22, 2):
            raise ch_errors.ServerException("Unknown setting insert_deduplication_token",
                                            code=115)
        # Servers of either side of the token boundary hash a block differently.
        family = "new" if version.startswith("23") else "old"
        identity = (("token", token) if token is not None
                    else ("hash", family, repr((names, params))))
        seen = self.server.seen.setdefault(table, deque(maxlen=100))
        if identity in seen:
            return None
        seen.append(identity)
        self.server.rows.setdefault(table, []).extend(
            dict(zip(names, values, strict=True)) for values in zip(*params, strict=True))
        return None

    def disconnect(self) -> None:
        pass


class Crasher:
    """Operation ``at`` of a run fails, before it is applied or just after."""

    def __init__(self, store: Any, sink: Any, at: int | None, after: bool) -> None:
        self.store, self.sink, self.at, self.after, self.count = store, sink, at, after, 0

    def _step(self, after: bool) -> None:
        if self.count == self.at and self.after == after:
            raise Crash(f"operation {self.at}")

    def committed(self, topic: str, partition: int) -> Committed | None:
        return self.store.committed(topic, partition)  # type: ignore[no-any-return]

    def commit(self, topic: str, partition: int, offset: int, metadata: str) -> None:
        self._step(False)
        self.store.commit(topic, partition, offset, metadata)
        self._step(True)
        self.count += 1

    def insert(self, block: Block, batch: Batch, confirmed_at: float | None = None) -> None:
        self._step(False)
        self.sink.insert(block, batch, confirmed_at)
        self._step(True)
        self.count += 1


@dataclass
class Commits:
    commits: dict[tuple[str, int], Committed] = field(default_factory=dict)

    def committed(self, topic: str, partition: int) -> Committed | None:
        return self.commits.get((topic, partition))

    def commit(self, topic: str, partition: int, offset: int, metadata: str) -> None:
        self.commits[(topic, partition)] = Committed(offset, metadata)


@dataclass
class Worker:
    """A Python worker's adapters: its registry cache lives until it restarts."""

    world: World
    cache: RegistryCache
    crasher: Crasher | None = None

    def registry(self, config: Any) -> RegistryCache:
        return self.cache

    def store(self, config: Any) -> Any:
        return self.crasher or self.world.commits

    def sink(self, config: Any, topic: Any) -> Any:
        return self.crasher or self.world.writer

    def incarnation(self, config: Any, topic: str) -> int:
        return 0xB10C

    def dedup_mode(self, config: Any, topic: Any) -> int:
        return int(self.world.writer.dedup_mode())


@dataclass(frozen=True)
class Expect:
    """What a message must become: ``row`` (its rows in ``table``), ``dead``, or
    ``either`` (a table registered after it was produced); ``rows`` are (a, b)."""

    kind: str
    table: str
    rows: tuple[tuple[int, str], ...] = ()


@dataclass
class World:
    fds: bytes
    max_rows: int
    store: MemoryStore = field(default_factory=MemoryStore)
    clickhouse: ClickHouse = field(default_factory=ClickHouse)
    commits: Commits = field(default_factory=Commits)
    logs: dict[int, list[tuple[bytes | None, int, Expect]]] = field(
        default_factory=lambda: {0: [], 1: []})
    next_start: dict[int, int] = field(default_factory=lambda: {0: 0, 1: 0})
    pending: dict[int, tuple[int, int] | None] = field(default_factory=lambda: {0: None,
                                                                               1: None})
    now: int = 1_700_000_000_000
    batch_id: int = 0

    def __post_init__(self) -> None:
        self.writer = ClickHouseBlockWriter(
            WriterConfig(replicas=(Replica("a"), Replica("b")), dead_letter_table=DEAD,
                         use_numpy=False),
            self.clickhouse.client, sleep=lambda s: None)
        self.worker = Worker(self, self.cache())

    def cache(self) -> RegistryCache:
        return RegistryCache(self.store, clock=lambda: self.now / 1000, refresh_interval_s=0)

    def tick(self) -> int:
        self.now += 1
        return self.now

    def registered(self) -> Registry:
        return Registry.load(self.store)

    # --- changes ---------------------------------------------------------------
    def register_table(self, table: str) -> None:
        if table not in self.registered():
            self.clickhouse.live[table] = list(BASE)
            register(self.store, table, "vt.V1", self.fds, now_ms=self.tick(),
                     columns=self.clickhouse.live[table])

    def alter(self, table: str) -> None:
        live = self.clickhouse.live.get(table)
        if live is not None and B not in live:
            live.append(B)

    def register_next(self, table: str) -> None:
        registry = self.registered()
        if table not in registry or B not in self.clickhouse.live[table]:
            return
        latest = registry.get(table).latest.version
        if latest < 3:
            register(self.store, table, f"vt.V{latest + 1}", self.fds, now_ms=self.tick(),
                     columns=self.clickhouse.live[table], force=True)

    # --- producers -------------------------------------------------------------
    def produce(self, partition: int, table: int, pick: int, rows: int) -> None:
        ts = self.tick()
        offset = len(self.logs[partition])
        if table == len(TABLES):
            self.logs[partition].append((b"\xffnot an envelope", ts, Expect("dead", "")))
            return
        name = TABLES[table]
        registry = self.registered()
        values = [(offset * 10 + i, f"b{offset}.{i}") for i in range(rows)]
        if name not in registry:
            explicit = pick % 2
            value = self.encode(name, 1, values, 1 if explicit else 0)
            self.logs[partition].append(
                (value, ts, Expect("either" if explicit else "dead", name,
                                   tuple((a, "none") for a, _ in values))))
            return
        versions = [v.version for v in registry.get(name).versions]
        used = versions[pick % len(versions)]
        zero = used == versions[-1] and pick % 3 == 0
        value = self.encode(name, used, values, 0 if zero else used)
        expected = tuple((a, b if used >= 2 else "none") for a, b in values)
        self.logs[partition].append((value, ts, Expect("row", name, expected)))

    def encode(self, table: str, version: int, values: list[tuple[int, str]],
               schema_version: int) -> bytes:
        cls: Any = message_class(load_descriptor(self.fds, f"vt.V{version}"))
        rows = [cls(a=a, **({"b": b} if version >= 2 else {})).SerializeToString()
                for a, b in values]
        return make_envelope(table, rows, schema_version)

    # --- the job ---------------------------------------------------------------
    def batch(self, partition: int, grow: int, crash: int | None, after: bool,
              recovery: bool) -> None:
        pending = self.pending[partition]
        if pending is not None:
            start, end = pending
            committed = self.commits.committed(TOPIC, partition)
            if recovery and committed is not None and is_blockagg(committed.metadata):
                metadata = decode(committed.metadata)
                if metadata.blocks:   # the driver's recovery range
                    start = metadata.resume
                    end = max(b.last for b in metadata.blocks) + 1
        else:
            start = self.next_start[partition]
            end = min(len(self.logs[partition]), start + grow)
        if end <= start:
            return
        self.batch_id += 1
        entries = self.logs[partition][start:end]
        self.worker.crasher = Crasher(self.commits, self.writer, crash, after)
        ctx = TaskContext(loads(CONFIG + f"[blocks]\nmax_rows = {self.max_rows}\n"),
                          self.worker, {(TOPIC, partition): PlannedRange(TOPIC, partition,
                                                                         start, end)},
                          self.batch_id, 7)
        try:
            run_range(ctx, (TOPIC, partition), list(range(start, end)),
                      [e[0] for e in entries], [e[1] for e in entries])
        except (Crash, ClickHouseError):
            self.pending[partition] = (start, end)
            return
        finally:
            self.worker.crasher = None
        self.pending[partition] = None
        self.next_start[partition] = max(self.next_start[partition], end)

    def restart_worker(self) -> None:
        components._CACHE.clear()
        self.worker = Worker(self, self.cache())

    def heal(self) -> None:
        """The operator's recovery: every replica up; a replay refused for its pinned
        deduplication mode runs through replicas of the version that first inserted
        it (as the error says); then the upgrade is finished."""
        self.clickhouse.down.clear()
        upgraded = any(v.startswith("23") for v in self.clickhouse.versions.values())
        for version in ("18.16.1", "23.8.1"):
            self.clickhouse.versions = {"a": version, "b": version}
            for partition in (0, 1):
                if self.pending[partition] is not None:
                    self.batch(partition, 50, None, False, True)
        if not upgraded:
            self.clickhouse.versions = {"a": "18.16.1", "b": "18.16.1"}
        for partition in (0, 1):
            while self.pending[partition] is not None or (
                    self.next_start[partition] < len(self.logs[partition])):
                self.batch(partition, 50, None, False, True)

    # --- the oracle ------------------------------------------------------------
    def check(self) -> None:
        stored: Counter[tuple[int, int]] = Counter()
        values: dict[tuple[int, int], list[tuple[str, int, str]]] = {}
        for table in TABLES:
            for row in self.clickhouse.rows.get(table, []):
                key = (row["_partition"], row["_offset"])
                values.setdefault(key, []).append((table, row["a"], row.get("b", "none")))
        dead = Counter((r["partition"], r["offset"]) for r in self.clickhouse.rows.get(DEAD, []))
        for partition, log in self.logs.items():
            for offset, (_, _, expect) in enumerate(log):
                key = (partition, offset)
                got = values.get(key, [])
                want = [(expect.table, a, b) for a, b in expect.rows]
                kind = expect.kind
                if kind == "either":
                    kind = "row" if got else "dead"
                if kind == "row":
                    assert got == want and dead[key] == 0, (key, got, want, dead[key])
                else:
                    assert got == [] and dead[key] == 1, (key, got, dead[key])
                stored[key] += 1
        assert set(values) <= set(stored) and set(dead) <= set(stored)


ACTIONS = st.one_of(
    st.tuples(st.just("produce"), st.integers(0, 1), st.integers(0, len(TABLES)),
              st.integers(0, 5), st.integers(1, 3), st.integers(1, 8)),
    st.tuples(st.just("batch"), st.integers(0, 1), st.integers(1, 12),
              st.one_of(st.none(), st.integers(0, 8)), st.booleans(), st.booleans()),
    st.tuples(st.just("register_table"), st.sampled_from(TABLES)),
    st.tuples(st.just("alter"), st.sampled_from(TABLES)),
    st.tuples(st.just("register_next"), st.sampled_from(TABLES)),
    st.tuples(st.just("failover"), st.sampled_from(["a", "b"])),
    st.tuples(st.just("upgrade"), st.sampled_from(["a", "b"])),
    st.tuples(st.just("restart_worker")),
)


@pytest.fixture(scope="module")
def fds(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("p") / "v.proto"
    path.write_text(PROTO)
    return compile_proto(path)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.integers(1, 4), st.lists(ACTIONS, min_size=10, max_size=60))
def test_every_message_exactly_once_with_its_values_while_everything_changes(
        fds: bytes, max_rows: int, actions: list[tuple[Any, ...]]) -> None:
    world = World(fds, max_rows)
    live = world.clickhouse.live

    def columns(config: Any, topic: Any, table: str) -> list[Column]:
        if table not in live:
            raise TableNotFound(f"{table} does not exist")
        return list(live[table])

    def columns_many(config: Any, topic: Any, tables: Any) -> dict[str, list[Column]]:
        return {t: columns(config, topic, t) for t in tables}

    saved = task.live_columns, task.live_columns_many
    task.live_columns = columns
    task.live_columns_many = columns_many
    components._CACHE.clear()
    try:
        world.register_table(TABLES[0])
        for action in actions:
            kind, *args = action
            if kind == "produce":
                for i in range(args[4]):
                    table = (args[1] + i * args[2]) % (len(TABLES) + 1)
                    world.produce(args[0], table, args[2] + i, args[3])
            elif kind == "batch":
                world.batch(*args)
            elif kind == "failover":
                world.clickhouse.down = {args[0]}
            elif kind == "upgrade":
                world.clickhouse.versions[args[0]] = "23.8.1"
            elif kind == "restart_worker":
                world.restart_worker()
            else:
                getattr(world, kind)(*args)
        world.heal()
        world.check()
    finally:
        task.live_columns, task.live_columns_many = saved
        components._CACHE.clear()
