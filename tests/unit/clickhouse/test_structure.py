"""The re-send guard under content-hash deduplication (aggregator.clickhouse.structure):
the mark, the check of a table's ZooKeeper ``columns`` nodes against it, and the
writer's decision for a block sent again (not sent, sent, refused, retried), against a
scripted ZooKeeper and scripted replicas. The same against real 18.16 servers:
tests/integration/test_replay_across_alter.py."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest
from google.protobuf.descriptor import Descriptor

from blockagg.aggregator.clickhouse.exceptions import (
    InsertFailed,
    ReplayAcrossAlter,
    ReplayBeyondDedupAge,
)
from blockagg.aggregator.clickhouse.structure import (
    StructureCache,
    columns_state,
    resend_risk,
    structure_mark,
)
from blockagg.aggregator.clickhouse.writer import LATE_FIRST_SEND_S
from blockagg.aggregator.core.metadata import DedupMode, Pins
from tests.unit.clickhouse.test_writer import make_writer, sample_batch

ZK = "/clickhouse/tables/01/db/t"


class ZooKeeper:
    """``system.replicas`` and ``system.zookeeper`` as ClickHouse answers them, for one
    table ``db.t`` with replicas r1 and r2; counts every query."""

    def __init__(self, shared: int = 10, r1: int = 11, r2: int = 12,
                 values: tuple[str, str, str] = ("c1", "c1", "c1")) -> None:
        self.zxids = {ZK: shared, f"{ZK}/replicas/r1": r1, f"{ZK}/replicas/r2": r2}
        self.values = dict(zip(self.zxids, values, strict=True))
        self.queries = 0

    def __call__(self, sql: str, params: Any) -> Any:
        self.queries += 1
        if "FROM system.replicas" in sql:
            return [("db", "t", ZK)]
        path = (params or {}).get("p")
        if "name = 'columns'" in sql:
            return [(self.zxids[path], self.values[path])] if path in self.zxids else []
        if path == f"{ZK}/replicas":
            return [("r1",), ("r2",)]
        return []


def test_the_state_is_the_highest_zxid_and_whether_replicas_agree() -> None:
    assert columns_state(ZooKeeper(), ZK).zxid == 12
    assert columns_state(ZooKeeper(), ZK).agreed
    assert not columns_state(ZooKeeper(values=("c2", "c2", "c1")), ZK).agreed


def test_the_mark_covers_replicated_tables_only() -> None:
    assert structure_mark(ZooKeeper(r2=40), ["db.t", "db.plain"]) == 40
    assert structure_mark(ZooKeeper(), ["db.plain"]) == 0


def test_a_table_unchanged_since_the_mark_is_sent_again_unchecked() -> None:
    assert resend_risk(ZooKeeper(), "db.t", 12) is None
    assert resend_risk(ZooKeeper(), "db.t", 50) is None


def test_a_change_after_the_mark_or_replicas_disagreeing_is_a_risk() -> None:
    changed = resend_risk(ZooKeeper(r1=60), "db.t", 12)
    assert changed is not None and "zxid 60" in changed and "mark 12" in changed
    applying = resend_risk(ZooKeeper(values=("c2", "c2", "c1")), "db.t", 12)
    assert applying is not None and "ALTER is applying" in applying


def test_no_mark_or_no_zookeeper_record_leaves_a_resend_unchecked() -> None:
    zk = ZooKeeper(r1=60)
    assert resend_risk(zk, "db.t", 0) is None and zk.queries == 0
    assert resend_risk(zk, "db.plain", 12) is None


def test_the_cache_reads_nodes_again_only_when_a_columns_version_moves() -> None:
    zk, cache = ZooKeeper(), StructureCache()
    assert cache.mark(zk, ["db.t"], {"db.t": [0, 0]}) == 12
    first = zk.queries
    assert cache.mark(zk, ["db.t"], {"db.t": [0, 0]}) == 12 and zk.queries == first
    zk.zxids[f"{ZK}/replicas/r2"] = 70
    assert cache.mark(zk, ["db.t"], {"db.t": [0, 1]}) == 70 and zk.queries > first


class Replicas:
    """The writer's fake clients, answering the guard's queries: ZooKeeper as
    ``zk``, and each replica's count of the block's rows from ``landed``."""

    def __init__(self, zk: ZooKeeper, landed: dict[str, Any],
                 running: dict[str, list[int]] | None = None) -> None:
        self.zk = zk
        self.landed = landed
        self.running = running or {}
        """Per replica, the answers of successive ``system.processes`` queries."""
        self.query_ids: list[Any] = []

    def patch(self, writer: Any) -> None:
        factory = writer._factory

        def make(replica: Any) -> Any:
            client = factory(replica)
            plain = client.execute

            def execute(query: str, params: Any = None, **kw: Any) -> Any:
                if "system.zookeeper" in query or "system.replicas" in query:
                    return self.zk(query, params)
                if "system.processes" in query:
                    assert params == {"id": "blockagg:top:0:db.t:10-11"}
                    answers = self.running.get(replica.host, [])
                    return [(answers.pop(0) if answers else 0,)]
                if query.startswith("INSERT"):
                    self.query_ids.append(kw.get("query_id"))
                if query.startswith("SELECT count() FROM db.t WHERE `_topic`"):
                    assert params == {"topic": "top", "partition": 0, "first": 10, "last": 11}
                    got = self.landed[replica.host]
                    if isinstance(got, Exception):
                        raise got
                    return [(got,)]
                return plain(query, params, **kw)

            client.execute = execute
            return client

        writer._factory = make


def resend(sample: Descriptor, zk: ZooKeeper, landed: dict[str, Any], *, coordinates: bool = True,
           quorum: int = 2, replicas: Replicas | None = None, **kw: Any) -> list[Any]:
    """Replay ``sample_batch``'s block pinned at mark 12 under content hash; the log
    of inserts actually sent."""
    batch, block = sample_batch(sample)
    batch = dataclasses.replace(batch, pins=Pins(dedup=DedupMode.BLOCK_HASH, structure=12))
    block = dataclasses.replace(block, replay=True)
    log: list[Any] = []
    writer = make_writer({}, log, insert_quorum=quorum, max_attempts=3, **kw)
    (replicas or Replicas(zk, landed)).patch(writer)
    if not coordinates:
        real = writer.block_data

        def without(*args: Any, **kwargs: Any) -> Any:
            data = real(*args, **kwargs)
            return dataclasses.replace(data, names=tuple(
                n for n in data.names if not n.startswith("_")))

        writer.block_data = without  # type: ignore[method-assign]
    writer.insert(block, batch)
    return log


def test_a_replay_with_unchanged_columns_is_sent(sample: Descriptor) -> None:
    assert len(resend(sample, ZooKeeper(), {"a": 3, "b": 3})) == 1


def test_a_replay_after_an_alter_is_not_sent_when_its_rows_are_stored(
        sample: Descriptor) -> None:
    assert resend(sample, ZooKeeper(r1=60), {"a": 3, "b": 3}) == []


def test_a_replay_after_an_alter_is_sent_when_no_replica_has_its_rows(
        sample: Descriptor) -> None:
    assert len(resend(sample, ZooKeeper(r1=60), {"a": 0, "b": 0})) == 1


def test_rows_are_counted_only_once_no_earlier_attempt_is_still_running(
        sample: Descriptor) -> None:
    """An earlier attempt still running on a replica would count 0 rows, and if it
    then commits, the re-sent copy (hashed under the new columns) is kept beside it
    (found by review; the long run then met it: a task stopped mid-insert kept its
    query open on the server for 4.5 min). Every attempt carries the block's token
    as its query id, so the check waits for it, in place, up to
    ``earlier_attempt_wait_s``; once it ended and its rows are there, nothing is sent."""
    zk = ZooKeeper(r1=60)
    replicas = Replicas(zk, {"a": 3, "b": 3}, running={"b": [1] * 20})
    assert resend(sample, zk, {}, replicas=replicas) == []
    assert replicas.running["b"] == []  # waited in place, polling, until it ended
    replicas = Replicas(zk, {"a": 3, "b": 3}, running={"b": [1, 1, 1]})
    with pytest.raises(InsertFailed, match="still running on b:9000"):
        resend(sample, zk, {}, replicas=replicas, earlier_attempt_wait_s=0.0)
    replicas = Replicas(zk, {"a": 0, "b": 0})
    assert len(resend(sample, zk, {}, replicas=replicas)) == 1
    assert replicas.query_ids == ["blockagg:top:0:db.t:10-11"]


def test_rows_on_fewer_replicas_than_the_quorum_are_waited_for(sample: Descriptor) -> None:
    with pytest.raises(InsertFailed, match="its rows in each replica"):
        resend(sample, ZooKeeper(r1=60), {"a": 3, "b": 0})
    assert resend(sample, ZooKeeper(r1=60), {"a": 3, "b": 0}, quorum=0) == []
    with pytest.raises(InsertFailed, match="a replica down"):
        resend(sample, ZooKeeper(r1=60), {"a": 0, "b": OSError("down")})


def test_a_block_stored_in_part_on_every_replica_is_refused_with_the_delete_to_run(
        sample: Descriptor) -> None:
    """Its rows span several partitions of the table and an attempt failed between
    their parts: neither sending it whole nor skipping it is right."""
    with pytest.raises(ReplayAcrossAlter) as info:
        resend(sample, ZooKeeper(r1=60), {"a": 2, "b": 2})
    text = str(info.value)
    assert "holds 2 of its 3 rows" in text
    assert ("ALTER TABLE db.t DELETE WHERE _topic = 'top' AND _partition = 0 AND _offset "
            "BETWEEN 10 AND 11") in text


def test_a_table_without_coordinates_is_refused_naming_block_change_and_remedy(
        sample: Descriptor) -> None:
    with pytest.raises(ReplayAcrossAlter) as info:
        resend(sample, ZooKeeper(r1=60), {}, coordinates=False)
    text = str(info.value)
    for part in ("db.t top[0] [10, 11]", "zxid 60", "replay_across_alter", "Nothing was sent",
                 "ADD COLUMN _topic String"):
        assert part in text
    assert len(resend(sample, ZooKeeper(r1=60), {}, coordinates=False,
                      replay_across_alter="insert")) == 1
    assert resend(sample, ZooKeeper(r1=60), {}, coordinates=False,
                  replay_across_alter="skip") == []


def test_the_mark_is_never_zero_because_no_replica_answered() -> None:
    """A fresh worker whose ``system.replicas`` query fails on every replica would pin
    0, which reads as "no mark" and leaves every re-send of the batch unchecked: the
    query is retried instead, and the batch fails once every attempt did (found by
    review)."""
    zk, failures = ZooKeeper(), [2]

    def patch(writer: Any) -> None:
        factory = writer._factory

        def make(replica: Any) -> Any:
            client = factory(replica)

            def execute(query: str, params: Any = None, **kw: Any) -> Any:
                if "columns_version" not in query:
                    return zk(query, params)
                if failures[0] > 0:
                    failures[0] -= 1
                    raise OSError("connection reset")
                return [("db", "t", 0)]

            client.execute = execute
            return client

        writer._factory = make

    writer = make_writer({}, [], max_attempts=3)
    patch(writer)
    assert writer.structure_mark(["db.t"]) == 12  # both replicas failed once, then it answered
    failures[0] = 100
    writer = make_writer({}, [], max_attempts=3)
    patch(writer)
    with pytest.raises(InsertFailed, match="connection reset"):
        writer.structure_mark(["db.t"])


def test_a_late_first_attempt_is_checked_like_a_resend(sample: Descriptor) -> None:
    """An attempt stalls between its confirm and its first send; a newer attempt
    replays the block (stored under the old columns); an ALTER lands; the stalled
    attempt wakes and sends. Its first attempt, more than ``LATE_FIRST_SEND_S`` after
    the insert began, is checked like a re-send: the rows are on both replicas, so it
    is not sent (found by review). One on time goes out unchecked, as before."""
    batch, block = sample_batch(sample)
    batch = dataclasses.replace(batch, pins=Pins(dedup=DedupMode.BLOCK_HASH, structure=12))

    def first_send(elapsed: float) -> list[Any]:
        log: list[Any] = []
        writer = make_writer({}, log, insert_quorum=2, max_attempts=3)
        ticks = itertools.chain([0.0], itertools.repeat(elapsed))
        writer._clock = lambda: next(ticks)
        Replicas(ZooKeeper(r1=60), {"a": 3, "b": 3}).patch(writer)
        writer.insert(block, batch)
        return log

    assert first_send(LATE_FIRST_SEND_S + 60) == []
    assert len(first_send(0.5)) == 1


def test_a_first_send_is_judged_late_from_its_confirm_not_from_the_insert(
        sample: Descriptor) -> None:
    """Issue 25, path 1: lateness counts from the fence's confirming read (the last
    moment the attempt was the partition's only writer), so a stall between the
    confirm and the writer's own start is measured too."""
    batch, block = sample_batch(sample)
    batch = dataclasses.replace(batch, pins=Pins(dedup=DedupMode.BLOCK_HASH, structure=12))

    def first_send(confirmed_ago: float) -> list[Any]:
        log: list[Any] = []
        writer = make_writer({}, log, insert_quorum=2, max_attempts=3)
        writer._clock = lambda: 1_000.0
        Replicas(ZooKeeper(r1=60), {"a": 3, "b": 3}).patch(writer)
        writer.insert(block, batch, 1_000.0 - confirmed_ago)
        return log

    assert first_send(LATE_FIRST_SEND_S + 60) == []
    assert len(first_send(0.5)) == 1


def expired_replay(sample: Descriptor, landed: dict[str, Any], *, age_s: int,
                   window_s: int | None = 3_600, version: str = "18.16.1",
                   coordinates: bool = True, **kw: Any) -> list[Any]:
    """Replay ``sample_batch``'s block, first sent ``age_s`` ago, into ``db.t`` whose
    ``replicated_deduplication_window_seconds`` is ``window_s`` (``None``: the server's
    default, 7 days), its columns unchanged; the log of inserts actually sent."""
    batch, block = sample_batch(sample)
    dedup = DedupMode.TOKEN if version.startswith("24") else DedupMode.BLOCK_HASH
    batch = dataclasses.replace(batch, pins=Pins(dedup=dedup, structure=12))
    block = dataclasses.replace(block, replay=True, since_s=1_000_000 - age_s)
    settings = "" if window_s is None else (
        f" SETTINGS replicated_deduplication_window_seconds = {window_s}")
    script: dict[str, Any] = {
        "SHOW CREATE TABLE db.t": [(
            "CREATE TABLE db.t (i64 Int64) ENGINE = ReplicatedMergeTree('/t', '{replica}') "
            f"ORDER BY i64{settings}",)],
        "SELECT value FROM system.merge_tree_settings WHERE name = %(n)s": [("604800",)]}
    log: list[Any] = []
    writer = make_writer(script, log, version=version, insert_quorum=2, max_attempts=3, **kw)
    writer._wall_clock = lambda: 1_000_000.0
    Replicas(ZooKeeper(), landed).patch(writer)
    if not coordinates:
        real = writer.block_data

        def without(*args: Any, **kwargs: Any) -> Any:
            data = real(*args, **kwargs)
            return dataclasses.replace(data, names=tuple(
                n for n in data.names if not n.startswith("_")))

        writer.block_data = without  # type: ignore[method-assign]
    writer.insert(block, batch)
    return log


@pytest.mark.parametrize("version", ["18.16.1", "24.8.1.1"])
def test_a_replay_older_than_the_dedup_age_is_sent_only_if_none_of_its_rows_is_stored(
        sample: Descriptor, version: str) -> None:
    """Issue 25, path 6: after downtime longer than the table's
    ``replicated_deduplication_window_seconds`` the server no longer recognises a
    landed block (by hash or by token), so the replay is settled by its rows."""
    assert expired_replay(sample, {"a": 3, "b": 3}, age_s=7_200, version=version) == []
    assert len(expired_replay(sample, {"a": 0, "b": 0}, age_s=7_200, version=version)) == 1
    # Within the age (less the clocks' margin) the server still knows it: sent unchecked.
    assert len(expired_replay(sample, {"a": 3, "b": 3}, age_s=3_000, version=version)) == 1
    # The server's default age (7 days) applies when the table sets none.
    assert len(expired_replay(sample, {"a": 3, "b": 3}, age_s=86_400, window_s=None,
                              version=version)) == 1
    assert expired_replay(sample, {"a": 3, "b": 3}, age_s=8 * 86_400, window_s=None,
                          version=version) == []


def test_an_expired_replay_without_coordinates_is_refused_in_one_line(
        sample: Descriptor) -> None:
    with pytest.raises(ReplayBeyondDedupAge) as info:
        expired_replay(sample, {}, age_s=7_200, coordinates=False)
    text = str(info.value)
    for part in ("db.t top[0] [10, 11]", "7200 s old",
                 "replicated_deduplication_window_seconds = 3600", "Nothing was sent",
                 "arv audit", "clickhouse.expired_replay"):
        assert part in text, part
    assert "\n" not in text
    assert len(expired_replay(sample, {}, age_s=7_200, coordinates=False,
                              expired_replay="insert")) == 1
    assert expired_replay(sample, {}, age_s=7_200, coordinates=False,
                          expired_replay="skip") == []


def test_a_replay_whose_intent_has_no_time_is_not_judged_by_age(sample: Descriptor) -> None:
    """Intents written before they recorded a time (``since_s = 0``) replay as before."""
    assert len(expired_replay(sample, {"a": 3, "b": 3}, age_s=1_000_000)) == 1
