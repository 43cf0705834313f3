"""Preparation under pins: a version with recorded columns plans from them (the live
table is only checked, and a mismatch refuses), versions without take the live columns
re-read on ``refresh_interval``, dead-letter texts never depend on live state, and the
writer sends the token exactly as the batch's pinned deduplication mode says."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from blockagg.aggregator.clickhouse.exceptions import (
    ClickHouseError,
    TableNotFound,
)
from blockagg.aggregator.clickhouse.writer import ClickHouseBlockWriter, Replica, WriterConfig
from blockagg.aggregator.core.metadata import DedupMode, Pins
from blockagg.aggregator.core.model import Batch, Block
from blockagg.proto.descriptors import compile_proto, load_descriptor, message_class
from blockagg.proto.envelope import make_envelope
from blockagg.proto.registry import MemoryStore, Registry
from blockagg.registration.register import register
from blockagg.rows.columns import Column, Rows
from blockagg.rows.deadletters import DeadLetter
from blockagg.rows.exceptions import ColumnsChanged
from blockagg.rows.prepare import Message, Plans, needs_newer, prepare
from tests.unit.clickhouse.test_writer import make_writer

T0 = 1_700_000_000_000
V1_COLUMNS = [Column("a", "Int32")]
V2_COLUMNS = [Column("a", "Int32"), Column("b", "String", "DEFAULT", "'none'")]


@pytest.fixture(scope="module")
def fds(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("p") / "v.proto"
    path.write_text('syntax = "proto3"; package vt;\n'
                    "message V1 { int32 a = 1; }\n"
                    "message V2 { int32 a = 1; string b = 2; }\n")
    return compile_proto(path)


def encode(fds: bytes, name: str, **values: Any) -> bytes:
    cls: Any = message_class(load_descriptor(fds, name))
    return bytes(cls(**values).SerializeToString())


class Live:
    """The live columns of every table, changeable, counting reads."""

    def __init__(self, columns: dict[str, list[Column]]) -> None:
        self.columns = columns
        self.reads = 0

    def __call__(self, table: str) -> list[Column]:
        self.reads += 1
        if table not in self.columns:
            raise TableNotFound(f"table {table} does not exist on host-a")
        return self.columns[table]


def test_recorded_columns_decide_the_plan_whatever_the_live_table_adds(fds: bytes) -> None:
    store = MemoryStore()
    register(store, "db.t", "vt.V1", fds, now_ms=T0, columns=V1_COLUMNS)
    live = Live({"db.t": [*V1_COLUMNS, Column("extra", "UInt8")]})
    plans = Plans(Registry.load(store), live)
    plan, problems = plans.plan("db.t", 1)
    assert plan.columns == ("a",) and problems == []     # 'extra' gets its default
    live.columns["db.t"] = [Column("a", "Int64")]
    plans.expire_live()                                  # ttl inf: still the cached read
    assert plans.plan("db.t", 1)[0] is plan


def test_a_live_column_that_changed_refuses_naming_it(fds: bytes) -> None:
    store = MemoryStore()
    register(store, "db.t", "vt.V1", fds, now_ms=T0, columns=V1_COLUMNS)
    live = Live({"db.t": [Column("a", "Int64")]})
    plans = Plans(Registry.load(store), live)
    with pytest.raises(ColumnsChanged, match=r"column a is Int64, registered as Int32"):
        plans.plan("db.t", 1)
    live.columns = {}
    plans = Plans(Registry.load(store), live)
    with pytest.raises(TableNotFound):
        prepare("top", 0, [Message(0, T0, make_envelope("db.t", [b""], 1))], plans)


def test_live_columns_are_re_read_after_the_refresh_interval(fds: bytes) -> None:
    """A version registered without columns follows ALTER TABLE once the cached read
    is ``columns_ttl_s`` old."""
    store = MemoryStore()
    register(store, "db.t", "vt.V2", fds, now_ms=T0)                   # --no-check
    now = [0.0]
    live = Live({"db.t": V1_COLUMNS})
    plans = Plans(Registry.load(store), live, columns_ttl_s=10, clock=lambda: now[0])
    assert plans.plan("db.t", 1)[1]                                    # b has no column
    live.columns["db.t"] = V2_COLUMNS                                  # ALTER ADD COLUMN
    now[0] = 9
    plans.expire_live()
    assert plans.plan("db.t", 1)[1]
    now[0] = 10
    plans.expire_live()
    plan, problems = plans.plan("db.t", 1)
    assert problems == [] and plan.columns == ("a", "b") and live.reads == 2


def test_a_replay_under_the_pinned_view_decides_as_the_first_attempt(fds: bytes) -> None:
    """Table registered and new version added after the first attempt: the view as of
    the pinned position gives the same table ids, payload values and dead letters."""
    store = MemoryStore()
    register(store, "db.t", "vt.V1", fds, now_ms=T0, columns=V1_COLUMNS)
    pinned = Registry.load(store).position
    live = Live({"db.t": V2_COLUMNS, "db.u": V1_COLUMNS})
    messages = [Message(0, T0 + 5, make_envelope("db.t", [encode(fds, "vt.V1", a=1)])),
                Message(1, T0 + 5, make_envelope("db.u", [encode(fds, "vt.V1", a=2)])),
                Message(2, T0 + 5, make_envelope("db.t", [encode(fds, "vt.V2", a=3, b="x")],
                                                 2))]

    def decided(registry: Registry) -> list[Any]:
        prepared = prepare("top", 0, messages, Plans(registry, live))
        out: list[Any] = []
        for table_id, payload in zip(prepared.table_ids.tolist(), prepared.payloads,
                                     strict=True):
            if isinstance(payload, DeadLetter):
                out.append((table_id, payload.row()))
            else:
                assert isinstance(payload, Rows)
                out.append((table_id, payload.columns.plan.columns,
                            [list(v[payload.start:payload.stop])
                             for v in payload.columns.values]))
        return out

    first = decided(Registry.load(store))
    register(store, "db.u", "vt.V1", fds, now_ms=T0, columns=V1_COLUMNS)
    register(store, "db.t", "vt.V2", fds, now_ms=T0 + 1, columns=V2_COLUMNS)
    now = Registry.load(store)
    assert decided(now.as_of(pinned)) == first
    assert [d[0] for d in first] == [1, 0, 0] and [d[0] for d in decided(now)] == [1, 2, 1]
    assert first[1][1][4] == ("table db.u is not registered; register it with ba-schema "
                              "register db.u --proto FILE --message NAME")


def test_needs_newer_names_what_a_snapshot_cannot_decide(fds: bytes) -> None:
    store = MemoryStore()
    register(store, "db.t", "vt.V1", fds, now_ms=T0)
    registry = Registry.from_log(*store.scan(), loaded_at_ms=T0 + 100)
    assert needs_newer(registry, "db.u", 1, T0)
    assert needs_newer(registry, "db.t", 2, T0) and not needs_newer(registry, "db.t", 1, T0)
    assert needs_newer(registry, "db.t", 0, T0 + 100)
    assert not needs_newer(registry, "db.t", 0, T0 + 99)


def dedup_batch(mode: int) -> tuple[Batch, Block]:
    from blockagg.rows.deadletters import make_dead_letter

    dead = make_dead_letter("top", 0, 5, T0, b"x", "envelope does not decode")
    batch = Batch("top", 0, 5, 6, np.array([5]), np.array([0]), np.array([1]), np.array([1]),
                  [dead], {0: "blockagg.dead_letters"}, pins=Pins(1, 7, mode))
    block = Block("top", 0, 0, "blockagg.dead_letters", 5, 5, np.array([0]), 1, 1, "tok")
    return batch, block


@pytest.mark.parametrize(("version", "mode", "token"), [
    ("23.8.1", DedupMode.TOKEN, True),
    ("23.8.1", DedupMode.UNPINNED, True),        # an intent from before pins: as before
    ("18.16.1", DedupMode.BLOCK_HASH, False),
    ("18.16.1", DedupMode.UNPINNED, False),
])
def test_the_token_is_sent_exactly_as_the_pinned_mode_says(version: str, mode: int,
                                                           token: bool) -> None:
    log: list[Any] = []
    writer = make_writer({}, log, version=version)
    batch, block = dedup_batch(mode)
    writer.insert(block, batch)
    (_, _, _, settings), = log
    assert ("insert_deduplication_token" in settings) is token
    assert writer.dedup_mode() == (DedupMode.TOKEN if version.startswith("23")
                                   else DedupMode.BLOCK_HASH)


@pytest.mark.parametrize(("version", "mode", "match"), [
    ("18.16.1", DedupMode.TOKEN, "has no such setting"),
    ("23.8.1", DedupMode.BLOCK_HASH, "compute a block's hash differently"),
])
def test_a_replay_on_a_server_of_the_other_side_of_the_token_boundary_is_refused(
        version: str, mode: int, match: str) -> None:
    log: list[Any] = []
    writer = make_writer({}, log, version=version)
    batch, block = dedup_batch(mode)
    with pytest.raises(ClickHouseError, match=match):
        writer.insert(block, batch)
    assert log == []


def test_a_replay_moves_to_a_replica_on_its_pinned_side_of_the_token_boundary() -> None:
    """A rolling upgrade: replica a is upgraded, b not yet. A content-hash replay goes
    to b, a token batch to a; a failover to the wrong side is refused, not sent."""
    from clickhouse_driver import errors as ch_errors

    from blockagg.aggregator.clickhouse.exceptions import DedupModeMismatch
    from tests.unit.clickhouse.test_writer import FakeClient

    log: list[Any] = []
    script: dict[str, Any] = {}
    versions = {"a": "23.8.1", "b": "18.16.1"}
    writer = ClickHouseBlockWriter(
        WriterConfig(replicas=(Replica("a"), Replica("b"))),
        lambda r: FakeClient(r, script, log, versions[r.host]), sleep=lambda s: None)
    for mode, host, token in ((DedupMode.BLOCK_HASH, "b", False), (DedupMode.TOKEN, "a", True)):
        batch, block = dedup_batch(mode)
        writer.insert(block, batch)
        assert log[-1][0] == host and ("insert_deduplication_token" in log[-1][3]) is token
    script["a"] = [ch_errors.NetworkError("a went away")]   # token batch fails over to b
    batch, block = dedup_batch(DedupMode.TOKEN)
    with pytest.raises(DedupModeMismatch, match="other side"):
        writer.insert(block, batch)
    assert len(log) == 3 and log[-1][0] == "a"       # the failed attempt on a only


def test_a_stale_copy_of_the_live_columns_is_read_again_before_refusing(fds: bytes) -> None:
    """ALTER ADD COLUMN, then v2 registered against it, reach a worker whose copy of the
    live columns is older than both: the check reads the table again instead of
    refusing v2's batch, without waiting for ``refresh_interval``."""
    store = MemoryStore()
    register(store, "db.t", "vt.V1", fds, now_ms=T0, columns=V1_COLUMNS)
    register(store, "db.t", "vt.V2", fds, now_ms=T0 + 1, columns=V2_COLUMNS)
    live = Live({"db.t": V1_COLUMNS})
    plans = Plans(Registry.load(store), live, columns_ttl_s=3600, clock=lambda: 0.0)
    assert plans.plan("db.t", 1)[1] == []                 # caches the pre-ALTER columns
    live.columns["db.t"] = V2_COLUMNS                     # ALTER ADD COLUMN on every replica
    plan, problems = plans.plan("db.t", 2)
    assert plan.columns == tuple(c.name for c in V2_COLUMNS) and problems == []
