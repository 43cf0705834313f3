"""The pure parts of one group per topic and shard (issue 26 item 1): the decision of a
start, the record's codec, the shard's identity, the first offset a start delivers
anew, the stored-rows overlap, and the verifier's conflicts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockagg.aggregator.clickhouse.stored import overlaps, stored_top, stored_top_query
from blockagg.aggregator.core.metadata import BlockRange, Metadata, encode
from blockagg.aggregator.core.model import Committed
from blockagg.aggregator.kafka.exceptions import OwnershipStoreError, TopicOwned
from blockagg.aggregator.kafka.ownership import (
    HISTORY_KEPT,
    Claim,
    ClaimKey,
    Handover,
    decide,
    shard_identity,
)
from blockagg.config import loads
from blockagg.exceptions import ConfigError
from blockagg.spark.ownership import delivers_from
from blockagg.verifier.ownership import conflicts

KEY = ClaimKey("cluster-1", "shop.orders", "ch1:9000,ch2:9000")


def _owned(owner: str) -> Claim:
    return Claim(KEY, owner, (Handover(owner, "", 1_700_000_000_000),))


def test_shard_identity_ignores_order_case_and_repeats() -> None:
    assert shard_identity(["CH2:9000", "ch1:9000 ", "ch2:9000"]) == "ch1:9000,ch2:9000"


def test_no_record_is_claimed_by_the_starting_group() -> None:
    d = decide(KEY, None, "a", "", 5)
    assert d.kind == "claim" and d.record == Claim(KEY, "a", (Handover("a", "", 5),))


def test_the_owner_goes_on_and_writes_nothing_even_with_a_kept_take_over_flag() -> None:
    for take in ("", "old-owner"):
        d = decide(KEY, _owned("a"), "a", take, 5)
        assert d.kind == "owner" and d.record is None


def test_another_group_is_refused_naming_owner_offsets_and_ways_on() -> None:
    with pytest.raises(TopicOwned) as err:
        decide(KEY, _owned("a"), "b", "", 5, owner_offsets={0: 66011, 1: 65990})
    text = str(err.value)
    assert "\n" not in text
    for part in ("shop.orders", "ch1:9000,ch2:9000", "group 'a'", "not by group 'b'",
                 "[0]=66011, [1]=65990", "--group a", "--take-over a",
                 "2023-11-14T22:13:20Z"):
        assert part in text, part


def test_a_take_over_naming_another_group_than_the_owner_is_refused() -> None:
    with pytest.raises(TopicOwned, match=r"job\.take_over_from names 'c', not the owner"):
        decide(KEY, _owned("a"), "b", "c", 5)


def test_a_take_over_records_who_from_whom_and_from_which_offsets() -> None:
    d = decide(KEY, _owned("a"), "b", "a", 9, run="00ff", owner_offsets={1: 7, 0: 3})
    assert d.kind == "take_over" and d.from_group == "a" and d.current == _owned("a")
    assert d.record is not None and d.record.owner == "b"
    assert d.record.history[-1] == Handover("b", "a", 9, ((0, 3), (1, 7)), "00ff")
    assert d.record.history[0] == _owned("a").history[0]


def test_a_take_over_without_record_names_the_group_that_delivered_before() -> None:
    d = decide(KEY, None, "b", "a", 9, owner_offsets={0: 4})
    assert d.kind == "take_over" and d.record is not None
    assert d.record.history == (Handover("b", "a", 9, ((0, 4),)),)


def test_history_is_bounded() -> None:
    claim = _owned("g0")
    for i in range(1, HISTORY_KEPT + 5):
        d = decide(KEY, claim, f"g{i}", f"g{i - 1}", i)
        assert d.record is not None
        claim = d.record
    assert len(claim.history) == HISTORY_KEPT and claim.owner == f"g{HISTORY_KEPT + 4}"


names = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=20)


@settings(derandomize=True, max_examples=200)
@given(cluster=names, topic=names, shard=names, owner=names,
       history=st.lists(st.tuples(names, st.text(max_size=5), st.integers(0, 2**53),
                                  st.dictionaries(st.integers(0, 1000),
                                                  st.integers(0, 2**62), max_size=4)),
                        max_size=4))
def test_record_round_trips(cluster: str, topic: str, shard: str, owner: str,
                            history: list[tuple[str, str, int, dict[int, int]]]) -> None:
    key = ClaimKey(cluster, topic, shard)
    claim = Claim(key, owner, tuple(Handover(g, f, at, tuple(sorted(o.items())))
                                    for g, f, at, o in history))
    assert Claim.decode(key.encode(), claim.encode()) == claim


def test_a_record_blockagg_did_not_write_is_refused() -> None:
    with pytest.raises(OwnershipStoreError, match="does not decode"):
        Claim.decode(b"not json", b"{}")
    with pytest.raises(OwnershipStoreError, match="does not decode"):
        Claim.decode(KEY.encode(), b'{"history": []}')


def test_delivers_from_is_after_the_listed_blocks() -> None:
    meta = encode(Metadata(1, 0, 10, 40, 10, (BlockRange(1, 12, 30), BlockRange(2, 10, 35))))
    assert delivers_from(Committed(10, meta), 0) == 36
    assert delivers_from(Committed(40, encode(Metadata(1, 0, 40, 40, 40, ()))), 0) == 40
    assert delivers_from(Committed(17, ""), 0) == 17  # foreign commit: its offset
    assert delivers_from(Committed(12, meta), 0) == 12  # moved by a tool: its offset
    assert delivers_from(None, 5) == 5  # no commit: the default start


def test_overlaps_are_stored_offsets_at_or_above_the_start() -> None:
    stored = {0: (99, "db.a"), 1: (10, "db.b"), 2: (4, "db.dl")}
    assert overlaps({0: 0, 1: 11, 2: 4, 3: 0}, stored) == {0: (99, "db.a"), 2: (4, "db.dl")}
    assert overlaps({0: 100, 1: 11, 2: 5}, stored) == {}


def test_the_stored_offsets_query_is_one_union_over_tables_and_dead_letters() -> None:
    q = stored_top_query(["db.a", "db.b"], "blockagg.dead_letters")
    assert q.count("UNION ALL") == 2 and "`db`.`a`" in q and "max(toUInt64(`offset`))" in q
    assert q.count("%(topic)s") == 3


def test_with_another_cluster_feeding_the_tables_only_this_incarnations_rows_conflict(
        ) -> None:
    """Issue 27 (two data centres into one shard): the other cluster's job stores rows
    of the same topic name at the same offsets; with
    clickhouse.shared_with_other_kafka_clusters a table carrying the incarnation
    counts only this incarnation's rows (and unknown ones, 0), so the second job's
    first start is not refused by the first job's rows. A table without the column
    still counts every row (its start is refused anyway by the table check)."""
    q = stored_top_query(["db.a", "db.b"], "db.dl", marked={"db.a", "db.dl"})
    a, b, dl = q.split(" UNION ALL ")
    assert "`_incarnation` IN (%(incarnation)s, 0)" in a
    assert "incarnation" not in b
    assert "`incarnation` IN (%(incarnation)s, 0)" in dl
    assert "incarnation" not in stored_top_query(["db.a"], "db.dl")

    class Client:
        def __init__(self) -> None:
            self.params: list[object] = []

        def execute(self, query: str, params: dict[str, object]) -> list[tuple[object, ...]]:
            self.params.append(params)
            if "system.columns" in query:
                return [("db", "a", "_incarnation"), ("db", "b", "incarnation"),
                        ("db", "dl", "incarnation")]
            assert "`db`.`a` WHERE _topic = %(topic)s AND `_incarnation`" in query
            assert "`db`.`b` WHERE _topic = %(topic)s GROUP BY" in query
            assert "`db`.`dl` WHERE topic = %(topic)s AND `incarnation`" in query
            return [(0, 7, "db.a")]

    client = Client()
    assert stored_top(client, "t", ["db.a", "db.b"], "db.dl", incarnation=42) == {
        0: (7, "db.a")}
    assert client.params[-1] == {"topic": "t", "incarnation": 42}

    records = {KEY: _owned("a")}
    took = decide(KEY, _owned("a"), "b", "a", 9).record
    assert took is not None
    assert [c.owner for c in conflicts(records, "cluster-1", [("b", "shop.orders")])] == ["a"]
    assert conflicts(records, "cluster-1", [("a", "shop.orders")]) == []
    assert conflicts(records, "other-cluster", [("b", "shop.orders")]) == []
    assert conflicts(records, "cluster-1", [("b", "other.topic")]) == []
    # the group taken over from is not in conflict: its commits are older
    assert conflicts({KEY: took}, "cluster-1", [("a", "shop.orders")]) == []
    [c] = conflicts({KEY: took}, "cluster-1", [("c", "shop.orders")])
    assert "--take-over b" in c.detail and c.as_dict()["kind"] == "ownership"


BASE = """
[job]
checkpoint_location = "/tmp/cp"
{job}
[[topics]]
name = "t"
replicas = ["ch1:9000"]
[kafka]
"bootstrap.servers" = "k:9092"
"""


def test_config_take_over_and_owners_topic() -> None:
    config = loads(BASE.format(job='take_over_from = "old"'))
    assert config.job.take_over_from == "old" and config.job.owners_topic == "_blockagg_owners"
    assert loads(BASE.format(job="")).job.take_over_from == ""
    with pytest.raises(ConfigError, match="job's own metadata_group_id"):
        loads(BASE.format(job='take_over_from = "blockagg"'))
    with pytest.raises(ConfigError, match=r"job\.take_over_from: must not contain whitespace"):
        loads(BASE.format(job='take_over_from = "a b"'))
    with pytest.raises(ConfigError, match="ownership topic must be separate"):
        loads(BASE.format(job='owners_topic = "t"'))
