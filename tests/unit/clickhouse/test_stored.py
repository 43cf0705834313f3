"""The topic incarnation under content-hash deduplication (issue 25, paths 2 and 3):
the ``_incarnation`` column the writer fills, the re-send check counting only the
block's incarnation, and the partition-start check of rows already at the coordinates
(aggregator.clickhouse.stored). On the real stack:
tests/integration/test_recreated_topic.py."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from google.protobuf.descriptor import Descriptor

from blockagg.aggregator.clickhouse.exceptions import CoordinatesInUse, ReplayAcrossAlter
from blockagg.aggregator.clickhouse.stored import (
    StoredRange,
    coordinates_in_use_error,
    stored_query,
    stored_ranges,
    unmarked_tables,
)
from blockagg.aggregator.clickhouse.structure import (
    DEAD_LETTER_COORDINATES,
    TABLE_COORDINATES,
    landed_query,
)
from blockagg.aggregator.core.metadata import DEAD_LETTER_TABLE_ID, DedupMode, Pins, encode
from blockagg.aggregator.core.model import Batch, Block, Committed, block_token
from blockagg.proto.descriptors import message_class
from blockagg.rows.columns import (
    Column,
    decode_messages,
    make_plan,
    match_columns,
    with_incarnation,
)
from blockagg.rows.deadletters import make_dead_letter
from tests.unit.clickhouse.test_structure import Replicas, ZooKeeper
from tests.unit.clickhouse.test_writer import make_writer

INCARNATION = 0xF00D_CAFE_0000_0001
COLUMNS = [Column("i64", "Int64"), Column("text", "String"), Column("_topic", "String"),
           Column("_partition", "UInt32"), Column("_offset", "UInt64")]


def marked_batch(sample: Descriptor, incarnation: int = INCARNATION,
                 columns: list[Column] | None = None) -> tuple[Batch, Block]:
    """Offsets 10, 11 of ``db.t`` (rows 3) and a dead letter at 12, pinned to
    ``incarnation`` under content hash, mark 12; the table has ``_incarnation``."""
    cls: Any = message_class(sample)
    plan, _ = make_plan("db.t", 1, 1, sample, columns or [
        *COLUMNS, Column("_incarnation", "UInt64", "DEFAULT", "0")])
    payloads = decode_messages(plan, [
        [cls(i64=1, text="a").SerializeToString(), cls(i64=2).SerializeToString()],
        [cls(i64=3, text="c").SerializeToString()]])
    dead = make_dead_letter("top", 0, 12, 5000, b"\xff", "envelope does not decode")
    batch = Batch("top", 0, 10, 13, np.array([10, 11, 12]), np.array([1, 1, 0]),
                  np.array([2, 1, 1]), np.array([10, 5, 1]), [*payloads, dead],
                  {1: "db.t", 0: "blockagg.dead_letters"},
                  pins=Pins(incarnation=incarnation, dedup=DedupMode.BLOCK_HASH, structure=12))
    block = Block("top", 0, 1, "db.t", 10, 11, np.array([0, 1]), 3, 15,
                  block_token("top", 0, "db.t", 10, 11))
    return batch, block


def test_the_writer_fills_the_incarnation_column_with_the_batch_pin(
        sample: Descriptor) -> None:
    """Path 3: two incarnations' blocks of equal rows at equal offsets differ."""
    batch, block = marked_batch(sample)
    writer = make_writer({}, [])
    listed = writer.block_data(block, batch, numpy=False)
    assert listed.names == ("i64", "text", "_topic", "_partition", "_offset", "_incarnation")
    assert listed.columns[-1] == [INCARNATION] * 3
    arrays = writer.block_data(block, batch, numpy=True)
    assert arrays.numpy and arrays.fresh(lists=True) == listed.fresh(lists=True)
    other = dataclasses.replace(batch, pins=dataclasses.replace(batch.pins, incarnation=7))
    assert writer.block_data(block, other, numpy=False).columns[-1] == [7] * 3
    assert writer.block_data(block, other, numpy=False).columns[:-1] == listed.columns[:-1]


def test_a_dead_letter_block_fills_incarnation_where_the_table_has_it(
        sample: Descriptor) -> None:
    batch, _ = marked_batch(sample)
    dead = Block("top", 0, DEAD_LETTER_TABLE_ID, "blockagg.dead_letters", 12, 12,
                 np.array([2]), 1, 1, block_token("top", 0, "blockagg.dead_letters", 12, 12))
    writer = make_writer({}, [])
    plain = writer.block_data(dead, batch)
    assert "incarnation" not in plain.names
    marked = writer.block_data(dead, batch, dead_letter_incarnation=True)
    assert marked.names == (*plain.names, "incarnation")
    assert marked.columns == [*plain.columns, [INCARNATION]]


def test_no_field_may_fill_the_incarnation_column_and_it_must_be_uint64(
        sample: Descriptor) -> None:
    def about(columns: list[Column]) -> list[str]:
        return [p for p in match_columns(sample, columns)[1] if "_incarnation" in p]

    assert about([*COLUMNS, Column("_incarnation", "UInt64")]) == [], (
        "filled by blockagg: no field and no DEFAULT needed")
    wrong = about([*COLUMNS, Column("_incarnation", "Int64")])
    assert len(wrong) == 1 and "is Int64" in wrong[0] and "MODIFY COLUMN" in wrong[0]


def test_a_version_registered_before_the_column_fills_it_once_the_table_has_it(
        sample: Descriptor) -> None:
    """The column is blockagg's, not the producer's: no new version is needed."""
    plan, _ = make_plan("db.t", 1, 1, sample, COLUMNS)
    assert not plan.incarnation
    assert with_incarnation(plan, COLUMNS) is plan
    live = [*COLUMNS, Column("_incarnation", "UInt64", "DEFAULT", "0")]
    augmented = with_incarnation(plan, live)
    assert augmented.incarnation and augmented.columns[-1] == "_incarnation"
    assert augmented.fields[-1] is None and augmented.live[-1].name == "_incarnation"
    assert with_incarnation(augmented, live) is augmented
    assert with_incarnation(plan, [*COLUMNS, Column("_incarnation", "String")]) is plan


def test_the_landed_count_is_by_incarnation_when_the_block_carries_it() -> None:
    assert landed_query("db.t", TABLE_COORDINATES) == (
        "SELECT count() FROM db.t WHERE `_topic` = %(topic)s AND `_partition` = "
        "%(partition)s AND `_offset` BETWEEN %(first)s AND %(last)s")
    marked = landed_query("db.t", TABLE_COORDINATES, incarnation=True)
    assert marked.startswith("SELECT countIf(`_incarnation` = %(incarnation)s), "
                             "countIf(`_incarnation` = 0) FROM db.t WHERE `_topic`")
    assert "countIf(`incarnation` = %(incarnation)s)" in landed_query(
        "d.dl", DEAD_LETTER_COORDINATES, incarnation=True)


class MarkedReplicas(Replicas):
    """:class:`Replicas` whose table has ``_incarnation``: each replica answers the
    marked count with ``(rows of the block's incarnation, rows of incarnation 0)``."""

    def patch(self, writer: Any) -> None:
        super().patch(writer)
        factory = writer._factory

        def make(replica: Any) -> Any:
            client = factory(replica)
            inner = client.execute

            def execute(query: str, params: Any = None, **kw: Any) -> Any:
                if query.startswith("SELECT countIf(`_incarnation` = %(incarnation)s)"):
                    assert params == {"topic": "top", "partition": 0, "first": 10,
                                      "last": 11, "incarnation": INCARNATION}
                    return [self.landed[replica.host]]
                return inner(query, params, **kw)

            client.execute = execute
            return client

        writer._factory = make


def replay(sample: Descriptor, landed: dict[str, Any], marked: bool = True,
           **kw: Any) -> list[Any]:
    """Replay the block after an ALTER (ZooKeeper moved past the mark); the inserts
    actually sent."""
    batch, block = marked_batch(sample, columns=None if marked else COLUMNS)
    log: list[Any] = []
    writer = make_writer({}, log, insert_quorum=2, max_attempts=3, **kw)
    (MarkedReplicas if marked else Replicas)(ZooKeeper(r1=60), landed).patch(writer)
    writer.insert(dataclasses.replace(block, replay=True), batch)
    return log


def test_another_incarnations_rows_at_the_coordinates_are_not_the_blocks(
        sample: Descriptor) -> None:
    """Path 2: the old topic's 3 rows sit at the block's coordinates with another
    incarnation; the block's own count is 0, so it is sent (it was never stored)."""
    assert len(replay(sample, {"a": (0, 0), "b": (0, 0)})) == 1
    assert replay(sample, {"a": (3, 0), "b": (3, 0)}) == [], "its own rows: not sent"
    with pytest.raises(ReplayAcrossAlter) as partly:
        replay(sample, {"a": (1, 2), "b": (1, 2)})
    assert (f"_offset BETWEEN 10 AND 11 AND _incarnation = {INCARNATION})"
            in str(partly.value)), "the DELETE spares the other incarnation's rows"


def test_rows_of_unknown_incarnation_at_the_coordinates_refuse_the_resend(
        sample: Descriptor) -> None:
    """Rows written before the table had ``_incarnation`` may be the block's first
    attempt (the column added by the ALTER) or an older incarnation's."""
    with pytest.raises(ReplayAcrossAlter) as info:
        replay(sample, {"a": (0, 3), "b": (0, 3)})
    text = str(info.value)
    assert "\n" not in text and "db.t top[0] [10, 11]" in text and "_incarnation" in text
    assert "Nothing was sent" in text and "replay_across_alter" in text
    assert len(replay(sample, {"a": (0, 3), "b": (0, 3)}, replay_across_alter="insert")) == 1


def test_without_the_column_rows_are_trusted_only_when_the_start_check_ran(
        sample: Descriptor) -> None:
    assert replay(sample, {"a": 3, "b": 3}, marked=False) == [], "proved by the start check"
    with pytest.raises(ReplayAcrossAlter, match="allow_stored_coordinates"):
        replay(sample, {"a": 3, "b": 3}, marked=False, allow_stored_coordinates=True)
    assert len(replay(sample, {"a": 0, "b": 0}, marked=False,
                      allow_stored_coordinates=True)) == 1


def test_only_tables_with_coordinates_and_without_incarnation_are_asked() -> None:
    columns = {
        "db.plain": {"a"},
        "db.coords": {"a", "_topic", "_partition", "_offset"},
        "db.marked": {"_topic", "_partition", "_offset", "_incarnation"},
        "bl.dead": {"topic", "partition", "offset", "error"},
        "bl.dead_marked": {"topic", "partition", "offset", "incarnation"},
        "db.lookalike": {"topic", "partition", "offset"},
    }
    assert unmarked_tables(columns, "bl.dead") == {
        "db.coords": TABLE_COORDINATES, "bl.dead": DEAD_LETTER_COORDINATES}
    assert unmarked_tables(columns, "bl.dead_marked") == {"db.coords": TABLE_COORDINATES}


def test_stored_ranges_ask_each_table_from_the_start_offset() -> None:
    asked: list[tuple[str, Any]] = []

    def query(sql: str, params: Any) -> Any:
        asked.append((sql, params))
        return [(3, 0, 2)] if " FROM db.coords " in sql else [(0, 0, 0)]

    found = stored_ranges(query, {"db.coords": TABLE_COORDINATES,
                                  "bl.dead": DEAD_LETTER_COORDINATES}, "top", 4, 0)
    assert found == [StoredRange("db.coords", 3, 0, 2)]
    assert [p for _, p in asked] == [{"topic": "top", "partition": 4, "start": 0}] * 2
    assert asked[1][0] == stored_query("db.coords", TABLE_COORDINATES) == (
        "SELECT count(), min(`_offset`), max(`_offset`) FROM db.coords WHERE `_topic` = "
        "%(topic)s AND `_partition` = %(partition)s AND `_offset` >= %(start)s")
    asked.clear()
    stored_ranges(query, {"db.coords": TABLE_COORDINATES}, "top", 4, 9, incarnation=5)
    assert asked[0][0].endswith("AND `_incarnation` = %(incarnation)s")
    assert asked[0][1]["incarnation"] == 5


def test_the_refusal_is_one_line_naming_table_partition_range_and_ways_on() -> None:
    text = coordinates_in_use_error("top", 4, 0, [StoredRange("db.coords", 3, 0, 2),
                                                  StoredRange("bl.dead", 1, 7, 7)])
    assert "\n" not in text
    for part in ("top[4]", "offset 0", "db.coords holds 3 rows of top[4] at offsets 0-2",
                 "bl.dead holds 1 rows of top[4] at offsets 7-7", "Nothing was committed",
                 "ADD COLUMN _incarnation UInt64", "incarnation UInt64", "22.2",
                 "clickhouse.allow_stored_coordinates = true"):
        assert part in text, part


class Components:
    """Task components answering the start check from ``stored``; records the asks."""

    def __init__(self, stored: list[StoredRange]) -> None:
        self.stored = stored
        self.asked: list[tuple[Any, ...]] = []

    def stored_coordinates(self, config: Any, topic: Any, tables: Any, name: str,
                           partition: int, start: int) -> list[StoredRange]:
        self.asked.append((tuple(tables), name, partition, start))
        return self.stored


def test_the_start_check_runs_only_when_a_partition_starts_without_a_commit(
        sample: Descriptor) -> None:
    from blockagg.aggregator.core.metadata import Metadata
    from blockagg.config import loads
    from blockagg.spark.components import StaticRegistry
    from blockagg.spark.task import refuse_stored_coordinates

    config = loads('[job]\nmetadata_group_id = "g"\ncheckpoint_location = "/tmp/ck"\n'
                   '[[topics]]\nname = "top"\nreplicas = ["h:9000"]\n'
                   '[kafka]\n"bootstrap.servers" = "k:9092"\n')
    batch, _ = marked_batch(sample)
    registry = StaticRegistry({"db.t": 1})
    found = [StoredRange("db.t", 3, 10, 12)]

    def check(committed: Committed | None, comps: Components, b: Batch = batch,
              cfg: Any = config) -> None:
        refuse_stored_coordinates(comps, cfg, cfg.topics[0], registry, b, committed)

    comps = Components(found)
    with pytest.raises(CoordinatesInUse, match=r"db\.t holds 3 rows of top\[0\] at offsets"):
        check(None, comps)
    assert comps.asked == [(("blockagg.dead_letters", "db.t"), "top", 0, 10)]
    with pytest.raises(CoordinatesInUse, match="starts at offset 11"):
        check(Committed(11, ""), comps)   # an operator's reset: from its offset
    ours = encode(Metadata(run=1, batch=1, start=0, end=10, resume=10, blocks=(),
                           pins=batch.pins))
    quiet = Components(found)
    check(Committed(10, ours), quiet)      # the partition's own commit: never asked
    check(None, quiet, dataclasses.replace(batch, pins=dataclasses.replace(
        batch.pins, dedup=DedupMode.TOKEN)))  # tokens carry the incarnation
    check(Committed(13, ""), quiet)        # nothing left to deliver
    opted = loads(config_text := (
        '[job]\nmetadata_group_id = "g"\ncheckpoint_location = "/tmp/ck"\n'
        '[[topics]]\nname = "top"\nreplicas = ["h:9000"]\n'
        '[kafka]\n"bootstrap.servers" = "k:9092"\n'
        '[clickhouse]\nallow_stored_coordinates = true\n'))
    assert "allow_stored_coordinates = true" in config_text
    check(None, quiet, cfg=opted)
    assert quiet.asked == []
    check(None, Components([]))            # nothing stored there: delivered


def test_plans_of_a_recorded_version_fill_the_column_the_live_table_gained(
        tmp_path: Any) -> None:
    """Through :class:`Plans` and :func:`prepare`: a version recorded without
    ``_incarnation`` inserts it once the live table has it, and not after it is gone."""
    from blockagg.proto.descriptors import compile_proto, load_descriptor
    from blockagg.proto.envelope import make_envelope
    from blockagg.proto.registry import MemoryStore, Registry
    from blockagg.registration.register import register
    from blockagg.rows.prepare import Message, Plans, prepare

    path = tmp_path / "v.proto"
    path.write_text('syntax = "proto3"; package inc;\nmessage V1 { int32 a = 1; }\n')
    fds = compile_proto(path)
    recorded = [Column("a", "Int32"), Column("_topic", "String"),
                Column("_partition", "UInt32"), Column("_offset", "UInt64")]
    store = MemoryStore()
    register(store, "db.t", "inc.V1", fds, columns=recorded)
    live = {"db.t": [*recorded, Column("_incarnation", "UInt64", "DEFAULT", "0")]}
    plans = Plans(Registry.load(store), lambda t: live[t], columns_ttl_s=0)
    cls: Any = message_class(load_descriptor(fds, "inc.V1"))
    messages = [Message(o, 1_700_000_000_000, make_envelope(
        "db.t", [cls(a=o).SerializeToString()], 1)) for o in (5, 6)]

    def names_and_last() -> tuple[tuple[str, ...], list[Any]]:
        plans.expire_live()
        prepared = prepare("top", 0, messages, plans)
        batch = Batch("top", 0, 5, 7, prepared.offsets, prepared.table_ids,
                      prepared.row_counts, prepared.sizes, prepared.payloads,
                      prepared.tables, pins=Pins(incarnation=INCARNATION))
        block = Block("top", 0, int(prepared.table_ids[0]), "db.t", 5, 6, np.array([0, 1]),
                      2, 10, block_token("top", 0, "db.t", 5, 6))
        data = make_writer({}, []).block_data(block, batch, numpy=False)
        return data.names, data.columns[-1]

    assert names_and_last() == (("a", "_topic", "_partition", "_offset", "_incarnation"),
                                [INCARNATION] * 2)
    live["db.t"] = recorded
    assert names_and_last() == (("a", "_topic", "_partition", "_offset"), [5, 6])
