"""The per-block cost of live columns: a batch reads its tables' live columns with one
check, not one per table, keeps its plans when a re-read finds the table unchanged,
and rebuilds them after an ALTER; a failed prefetch changes nothing about which
table refuses the batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from blockagg.aggregator.clickhouse.exceptions import TableNotFound
from blockagg.proto.descriptors import compile_proto
from blockagg.proto.envelope import make_envelope
from blockagg.proto.registry import MemoryStore, Registry
from blockagg.registration.register import register
from blockagg.rows.columns import Column
from blockagg.rows.prepare import Plans, prepare_envelopes
from tests.unit.clickhouse.test_prepare_pins import V1_COLUMNS, Live, encode
from tests.unit.clickhouse.test_writer import COLUMNS, make_writer

T0 = 1_700_000_000_000


@pytest.fixture(scope="module")
def fds(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("p") / "v.proto"
    path.write_text('syntax = "proto3"; package vt;\nmessage V1 { int32 a = 1; }\n')
    return compile_proto(path)


class Many:
    """``columns_many``: every table's live columns in one read, counting reads."""

    def __init__(self, live: Live) -> None:
        self.live = live
        self.calls: list[list[str]] = []

    def __call__(self, tables: Sequence[str]) -> dict[str, list[Column]]:
        self.calls.append(list(tables))
        missing = [t for t in tables if t not in self.live.columns]
        if missing:
            raise TableNotFound(f"table {missing[0]} does not exist on host-a")
        return {t: self.live.columns[t] for t in tables}


def batch(fds: bytes, tables: Sequence[str]) -> list[bytes | None]:
    return [make_envelope(t, [encode(fds, "vt.V1", a=i)], 1) for i, t in enumerate(tables)]


def run(plans: Plans, values: list[bytes | None]) -> Any:
    n = len(values)
    return prepare_envelopes("top", 0, np.arange(n), np.full(n, T0 + 5), values, plans)


def registered(fds: bytes, tables: Sequence[str], columns: bool = True) -> Registry:
    store = MemoryStore()
    for t in tables:
        register(store, t, "vt.V1", fds, now_ms=T0, columns=V1_COLUMNS if columns else None)
    return Registry.load(store)


def test_a_batch_reads_every_tables_live_columns_at_once(fds: bytes) -> None:
    tables = [f"db.t{i}" for i in range(5)]
    live = Live({t: V1_COLUMNS for t in tables})
    many = Many(live)
    now = [0.0]
    plans = Plans(registered(fds, tables), live, columns_ttl_s=10, clock=lambda: now[0],
                  columns_many=many)
    prepared = run(plans, batch(fds, tables * 3))
    assert len(prepared.tables) == 5
    assert many.calls == [tables] and live.reads == 0
    run(plans, batch(fds, tables))                       # cached: no read at all
    assert len(many.calls) == 1
    now[0] = 10
    plans.expire_live()
    run(plans, batch(fds, tables[:2]))                   # only the batch's tables
    assert many.calls[1] == tables[:2] and live.reads == 0


def test_a_failed_prefetch_refuses_only_as_the_table_itself_would(fds: bytes) -> None:
    """db.gone is registered but missing on the server: the prefetch fails, the
    tables are read one by one, and the batch is refused naming db.gone, as
    without a prefetch."""
    live = Live({"db.t": V1_COLUMNS})
    many = Many(live)
    plans = Plans(registered(fds, ["db.t", "db.gone"]), live, columns_many=many)
    with pytest.raises(TableNotFound, match=r"db\.gone"):
        run(plans, batch(fds, ["db.t", "db.gone"]))
    assert len(many.calls) == 1 and live.reads == 2
    assert len(run(plans, batch(fds, ["db.t"])).tables) == 1


def test_an_unchanged_re_read_keeps_the_plan_and_an_alter_rebuilds_it(fds: bytes) -> None:
    """The plan of a version registered without columns is a pure function of the live
    columns: an equal re-read reuses it (no per-block rebuild), a changed one does
    not."""
    live = Live({"db.t": list(V1_COLUMNS)})
    now = [0.0]
    plans = Plans(registered(fds, ["db.t"], columns=False), live, columns_ttl_s=10,
                  clock=lambda: now[0])
    plan, _ = plans.plan("db.t", 1)
    now[0] = 10
    plans.expire_live()
    live.columns["db.t"] = list(V1_COLUMNS)              # re-read: equal, a new object
    assert plans.plan("db.t", 1)[0] is plan and live.reads == 2
    live.columns["db.t"] = [Column("a", "Int64")]        # ALTER ... MODIFY COLUMN
    now[0] = 20
    plans.expire_live()
    altered, _ = plans.plan("db.t", 1)
    assert altered is not plan and altered.types != plan.types


def test_checking_many_tables_costs_a_few_queries_not_several_per_table() -> None:
    """check_tables reads columns and engines of all its tables with one query each
    per database, and the server's default window once."""
    queries: list[str] = []
    names = [f"t{i}" for i in range(4)]

    def counted(result: Any) -> Any:
        def answer(params: Any) -> Any:
            queries.append(str(params))
            return result(params) if callable(result) else result
        return answer

    create = "CREATE TABLE db.x ... ENGINE = ReplicatedMergeTree('/t', '{replica}')"
    script = {
        COLUMNS: counted([(n, c, "UInt64", "", "") for n in names
                          for c in ("x", "_topic", "_partition", "_offset")]),
        "SELECT name, engine, create_table_query FROM system.tables "
        "WHERE database = %(db)s AND name IN %(t)s":
            counted([(n, "ReplicatedMergeTree", create) for n in names]),
        "SELECT value FROM system.merge_tree_settings WHERE name = %(n)s":
            counted([("100",)]),
        "SELECT value FROM system.settings WHERE name = 'insert_deduplicate'":
            counted([("1",)]),
    }
    writer = make_writer(script, [])
    assert writer.check_tables([f"db.{n}" for n in names]) == []
    assert len(queries) == 4, queries
    assert writer.checked("db.t3") is not None
    assert [c.name for c in writer.checked("db.t3").columns] == [  # type: ignore[union-attr]
        "x", "_topic", "_partition", "_offset"]
    assert writer.dedup_window("db.t2") is not None
