"""The block writer against a fake driver: identical retries, failover, stop on
non-retriable errors, coordinates, dead letters, and the startup dedup check."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, ClassVar

import numpy as np
import pytest
from clickhouse_driver import errors as ch_errors
from google.protobuf.descriptor import Descriptor

from blockagg.aggregator.clickhouse.blockdata import BUILT_AHEAD_BLOCK_BYTES, BlocksBuiltAhead
from blockagg.aggregator.clickhouse.dedup_window import DedupNeed
from blockagg.aggregator.clickhouse.diagnosis import (
    ReplicaState,
    is_quorum_failure,
    quorum_error,
    replicas_with_part,
)
from blockagg.aggregator.clickhouse.exceptions import (
    AlterNotApplied,
    ClickHouseError,
    CoordinatesMissing,
    DedupNotConfigured,
    DedupWindowTooSmall,
    IncarnationMissing,
    InsertFailed,
    QuorumUnsatisfied,
    TableNotFound,
)
from blockagg.aggregator.clickhouse.writer import ClickHouseBlockWriter, Replica, WriterConfig
from blockagg.aggregator.core.model import Batch, Block, block_token
from blockagg.proto.descriptors import message_class
from blockagg.rows.columns import Column, Rows, decode_messages, make_plan
from blockagg.rows.deadletters import make_dead_letter


class FakeClient:
    def __init__(self, replica: Replica, script: dict[str, list[Any]], log: list[Any],
                 version: str = "18.16.1") -> None:
        self.replica = replica
        self.script = script
        self.log = log
        self.version = version

    def execute(self, query: str, params: Any = None, *, columnar: bool = False,
                settings: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        if query == "SELECT version()":
            return [(self.version,)]
        if query.startswith("INSERT"):
            self.log.append((self.replica.host, query, params, settings))
            outcomes = self.script.setdefault(self.replica.host, [])
            if outcomes:
                outcome = outcomes.pop(0)
                if isinstance(outcome, Exception):
                    raise outcome
            return None
        result = self.script.get(query, [])
        return result(params) if callable(result) else result

    def disconnect(self) -> None:
        pass


def make_writer(script: dict[str, Any], log: list[Any], version: str = "18.16.1",
                **kw: Any) -> ClickHouseBlockWriter:
    config = WriterConfig(replicas=(Replica("a"), Replica("b")), **kw)
    return ClickHouseBlockWriter(
        config, lambda r: FakeClient(r, script, log, version), sleep=lambda s: None)


def sample_batch(sample: Descriptor) -> tuple[Batch, Block]:
    cls: Any = message_class(sample)
    columns = [Column("i64", "Int64"), Column("text", "String"),
               Column("_topic", "String"), Column("_partition", "UInt32"),
               Column("_offset", "UInt64")]
    plan, _ = make_plan("db.t", 1, 1, sample, columns)
    msgs = [[cls(i64=1, text="a").SerializeToString(), cls(i64=2).SerializeToString()],
            [cls(i64=3, text="c").SerializeToString()]]
    payloads = decode_messages(plan, msgs)
    dead = make_dead_letter("top", 0, 12, 5000, b"\xff", "envelope does not decode")
    batch = Batch("top", 0, 10, 13, np.array([10, 11, 12]), np.array([1, 1, 0]),
                  np.array([2, 1, 1]), np.array([10, 5, 1]), [*payloads, dead],
                  {1: "db.t", 0: "blockagg.dead_letters"})
    block = Block("top", 0, 1, "db.t", 10, 11, np.array([0, 1]), 3, 15,
                  block_token("top", 0, "db.t", 10, 11))
    return batch, block


def test_columns_and_coordinates(sample: Descriptor) -> None:
    batch, block = sample_batch(sample)
    assert all(isinstance(p, Rows) for p in batch.payloads[:2])
    writer = make_writer({}, [])
    names, values = writer.block_columns(block, batch)
    assert names == ("i64", "text", "_topic", "_partition", "_offset")
    assert values == [[1, 2, 3], ["a", "", "c"], ["top"] * 3, [0] * 3, [10, 10, 11]]


def test_retry_is_identical_and_fails_over(sample: Descriptor) -> None:
    batch, block = sample_batch(sample)
    log: list[Any] = []
    script: dict[str, Any] = {"a": [ch_errors.NetworkError("boom")],
                              "b": [ch_errors.ServerException("zk", code=999)]}
    make_writer(script, log, insert_quorum=2).insert(block, batch)
    assert [host for host, *_ in log] == ["a", "b", "a"]
    assert len({repr(entry[1:]) for entry in log}) == 1
    assert log[0][3]["insert_quorum"] == 2
    assert "insert_deduplication_token" not in log[0][3]


BAD_COLUMNS_VERSION = (
    "Unexpected logical error while adding block 55 with ID 'all_1352_3517': Bad version, "
    "path /clickhouse/tables/01/fx/t017/columns")
"""18.16 (code 244) when a replica commits a part while an ALTER it has not applied yet
changed the table's columns in ZooKeeper (seen in the long fault run's schema_change)."""


def test_an_insert_racing_an_alter_is_retried_on_the_other_replica(
        sample: Descriptor) -> None:
    batch, block = sample_batch(sample)
    log: list[Any] = []
    script: dict[str, Any] = {"a": [ch_errors.ServerException(BAD_COLUMNS_VERSION, code=244)]}
    make_writer(script, log, insert_quorum=2).insert(block, batch)
    assert [host for host, *_ in log] == ["a", "b"]
    assert log[0][1:] == log[1][1:]


def test_an_alter_never_applied_ends_in_one_line_with_the_remedy(
        sample: Descriptor) -> None:
    """Both replicas' ALTER stalled (18.16): every attempt is refused with 244, and the
    batch fails with AlterNotApplied naming the table, the check and the remedy."""
    batch, block = sample_batch(sample)
    refusals = [ch_errors.ServerException(BAD_COLUMNS_VERSION, code=244) for _ in range(3)]
    script: dict[str, Any] = {"a": list(refusals), "b": list(refusals)}
    with pytest.raises(AlterNotApplied) as info:
        make_writer(script, [], insert_quorum=2, max_attempts=4).insert(block, batch)
    text = str(info.value)
    assert info.value.code == 244 and info.value.attempts == 4
    assert "\n" not in text and "failed after 4 attempt(s)" in text
    assert "have not applied an ALTER of the table's columns" in text
    assert "DETACH TABLE db.t then ATTACH TABLE db.t" in text
    assert "system.replication_queue WHERE table = 't'" in text
    assert isinstance(info.value, InsertFailed)


def test_token_on_modern_server(sample: Descriptor) -> None:
    batch, block = sample_batch(sample)
    log: list[Any] = []
    make_writer({}, log, version="24.8.1.1").insert(block, batch)
    assert log[0][3]["insert_deduplication_token"] == block.token
    assert log[0][3]["insert_deduplicate"] == 1


def test_non_retriable_stops_with_code(sample: Descriptor) -> None:
    batch, block = sample_batch(sample)
    script: dict[str, Any] = {"a": [ch_errors.ServerException("No such column", code=16)]}
    with pytest.raises(InsertFailed) as info:
        make_writer(script, []).insert(block, batch)
    assert info.value.code == 16 and "No such column" in str(info.value)


def test_gives_up_after_max_attempts(sample: Descriptor) -> None:
    batch, block = sample_batch(sample)
    script: dict[str, Any] = {"a": [EOFError()] * 5, "b": [EOFError()] * 5}
    with pytest.raises(InsertFailed) as info:
        make_writer(script, [], max_attempts=4).insert(block, batch)
    assert info.value.attempts == 4


def test_missing_table_after_failovers_past_every_replica_is_table_not_found() -> None:
    """Two failed queries on a shard of two replicas move the preferred replica past
    the last one: the next missing table is still TableNotFound, naming a replica."""
    columns = ("SELECT table, name, type, default_kind, default_expression "
               "FROM system.columns WHERE database = %(db)s AND table IN %(t)s")
    failures = [ch_errors.NetworkError("down"), ch_errors.NetworkError("down")]

    def flaky(params: Any) -> list[Any]:
        if failures:
            raise failures.pop(0)
        return []

    writer = make_writer({columns: flaky}, [])
    for _ in range(2):
        with pytest.raises(TableNotFound, match=r"db\.missing .* on a$"):
            writer.describe("db.missing")
        failures.extend([ch_errors.NetworkError("down")] * 2)


def test_dead_letter_block(sample: Descriptor) -> None:
    batch, _ = sample_batch(sample)
    block = Block("top", 0, 0, "blockagg.dead_letters", 12, 12, np.array([2]), 1, 1,
                  block_token("top", 0, "blockagg.dead_letters", 12, 12))
    log: list[Any] = []
    make_writer({}, log).insert(block, batch)
    _host, sql, values, _ = log[0]
    assert sql.startswith("INSERT INTO blockagg.dead_letters")
    assert values == [[""], ["top"], [0], [12], ["envelope does not decode"], [b"\xff"], [5]]


def test_bad_rows_become_reasons(sample: Descriptor) -> None:
    plan, problems = make_plan("db.t", 1, 1, sample, [Column("i32", "UInt8")])
    cls: Any = message_class(sample)
    out = decode_messages(plan, [[cls(i32=1).SerializeToString()],
                                 [cls(i32=1).SerializeToString(),
                                  cls(i32=999).SerializeToString()],
                                 [b"\xff\xff"]])
    assert isinstance(out[0], Rows)
    assert isinstance(out[1], str) and "row 1" in out[1] and "999" in out[1]
    assert isinstance(out[2], str) and "row 0" in out[2]
    assert any("has no column" in p for p in problems)


COLUMNS = ("SELECT table, name, type, default_kind, default_expression FROM system.columns "
           "WHERE database = %(db)s AND table IN %(t)s")


def _check_script(engine: str, create: str, profile: str = "1") -> dict[str, Any]:
    return {
        "SELECT value FROM system.settings WHERE name = 'insert_deduplicate'": [(profile,)],
        COLUMNS: [("t", "x", "Int64", "", "")],
        "SELECT name, engine, create_table_query FROM system.tables "
        "WHERE database = %(db)s AND name IN %(t)s": [("t", engine, create)],
        "SELECT value FROM system.merge_tree_settings WHERE name = %(n)s":
            lambda p: [("100",)] if p["n"] == "replicated_deduplication_window" else [("0",)],
    }


def test_check_refuses_plain_mergetree() -> None:
    writer = make_writer(_check_script("MergeTree", "CREATE TABLE db.t ... MergeTree"), [])
    with pytest.raises(DedupNotConfigured, match=r"db\.t.*non_replicated_deduplication_window"):
        writer.check_tables(["db.t"])


ALLOWED = frozenset({"db.t"})
"""db.t (no coordinate columns) accepted on 18.16, for tests about something else."""


def test_check_accepts_window_and_warns_about_coordinates() -> None:
    script = _check_script(
        "MergeTree", "CREATE TABLE db.t ... SETTINGS non_replicated_deduplication_window = 5")
    need = DedupNeed(partitions=4)
    with pytest.raises(DedupWindowTooSmall, match=r"table db\.t: "
                       r"non_replicated_deduplication_window = 5 is below the 8 blocks"):
        make_writer(script, [], allow_without_coordinates=ALLOWED).check_tables(["db.t"], need)
    warnings = make_writer(script, [], allow_without_coordinates=ALLOWED).check_tables(
        ["db.t"], need, allow_small_window=True)
    assert any("_topic" in w for w in warnings)
    assert any("= 5 is below the 8 blocks" in w for w in warnings)
    assert make_writer(script, [], allow_without_coordinates=ALLOWED).check_tables(
        ["db.t"], DedupNeed(2))[1:] == []


def test_check_keeps_the_window_it_read_for_the_guard() -> None:
    """The window check_tables reads serves the task's guard (dedup_window) until it
    is older than the refresh interval; a table never checked has none."""
    now = [100.0]
    script = _check_script(
        "ReplicatedMergeTree", "CREATE TABLE db.t ... SETTINGS replicated_deduplication_window = 7")
    writer = ClickHouseBlockWriter(
        WriterConfig(replicas=(Replica("a"),), allow_without_coordinates=ALLOWED),
        lambda r: FakeClient(r, script, []), sleep=lambda s: None, clock=lambda: now[0])
    assert writer.dedup_window("db.t") is None
    writer.check_tables(["db.t"])
    window = writer.dedup_window("db.t", 60)
    assert window is not None and (window.setting, window.blocks) == (
        "replicated_deduplication_window", 7)
    now[0] += 60
    assert writer.dedup_window("db.t", 60) is None and writer.dedup_window("db.t") == window


ZK = ("SELECT zookeeper_path FROM system.replicas WHERE database = %(db)s AND "
      "table = %(t)s")
MACROS = "SELECT macro, substitution FROM system.macros"


def test_the_shard_identity_is_the_dead_letter_tables_zookeeper_path_else_the_macros() -> None:
    """Grouping by shard (issue 25): replicas of one shard share the dead-letter
    table's ZooKeeper path; without a replicated table, the cluster and shard macros;
    without either, nothing (the replica addresses decide)."""
    table = "blockagg.dead_letters"
    zk = {ZK: [("/clickhouse/tables/01/blockagg/dead_letters",)],
          MACROS: [("shard", "02"), ("cluster", "c")]}
    assert make_writer(zk, []).shard_identity(table) == (
        "zookeeper:/clickhouse/tables/01/blockagg/dead_letters")
    assert make_writer({MACROS: zk[MACROS]}, []).shard_identity(table) == "macro:c/02"
    assert make_writer({MACROS: [("replica", "r1")]}, []).shard_identity(table) is None


def test_a_table_without_coordinates_is_refused_on_a_content_hash_server() -> None:
    """Issue 25: on 18.16 two different blocks with equal rows are one block, and the
    second is lost: the table is refused, naming it and the columns to add, unless
    clickhouse.allow_tables_without_coordinates lists it (then a warning). A server
    with insert_deduplication_token keeps them apart by the token: a warning only."""
    script = _check_script("ReplicatedMergeTree", "")
    with pytest.raises(CoordinatesMissing) as info:
        make_writer(script, []).check_tables(["db.t"])
    text = str(info.value)
    assert isinstance(info.value, DedupNotConfigured) and "\n" not in text
    assert text.startswith("table db.t has no _topic, _partition, _offset column(s): "
                           "ClickHouse 18.16.1 deduplicates by content hash"), text
    assert "ADD COLUMN _topic String, ADD COLUMN _partition UInt32, ADD COLUMN _offset " \
        "UInt64" in text
    assert 'clickhouse.allow_tables_without_coordinates = ["db.t"]' in text
    with pytest.raises(CoordinatesMissing):
        make_writer(script, [], allow_without_coordinates=frozenset({"db.other"})
                    ).check_tables(["db.t"])
    [accepted] = make_writer(script, [], allow_without_coordinates=ALLOWED).check_tables(["db.t"])
    assert "accepted by clickhouse.allow_tables_without_coordinates" in accepted
    [token] = make_writer(script, [], version="22.3.1").check_tables(["db.t"])
    assert "insert_deduplication_token" in token and "arv audit" in token
    assert make_writer(script, [], dead_letter_table="db.t").check_tables(["db.t"]) == []
    with_columns = {**script, COLUMNS: [
        ("t", "x", "Int64", "", ""), ("t", "_topic", "String", "", ""),
        ("t", "_partition", "UInt32", "", ""), ("t", "_offset", "UInt64", "", "")]}
    assert make_writer(with_columns, []).check_tables(["db.t"]) == []


COLUMNS_QUERY = COLUMNS
COORDINATE_ROWS = [("t", "x", "Int64", "", ""), ("t", "_topic", "String", "", ""),
                   ("t", "_partition", "UInt32", "", ""), ("t", "_offset", "UInt64", "", "")]


def test_a_table_shared_with_another_kafka_cluster_needs_the_incarnation_on_18_16() -> None:
    """Issue 27 (two data centres into one shard): on a content-hash server only the
    _incarnation column keeps another cluster's block with the same rows at the same
    coordinates from hashing alike (the second would be dropped). With
    clickhouse.shared_with_other_kafka_clusters a table without it (or with it of
    another type, or MATERIALIZED) refuses the start in one line naming the table and
    the column; the dead-letter table needs its ``incarnation`` column. The default
    is unchanged, and a token server needs nothing (the token carries the
    incarnation)."""
    script = {**_check_script("ReplicatedMergeTree", ""), COLUMNS_QUERY: COORDINATE_ROWS}
    assert make_writer(script, []).check_tables(["db.t"]) == []
    with pytest.raises(IncarnationMissing) as info:
        make_writer(script, [], shared_with_other_kafka_clusters=True).check_tables(["db.t"])
    text = str(info.value)
    assert isinstance(info.value, CoordinatesMissing) and "\n" not in text
    assert text.startswith("table db.t has no _incarnation column, but "
                           "clickhouse.shared_with_other_kafka_clusters = true"), text
    assert text.endswith("Fix: ALTER TABLE db.t ADD COLUMN _incarnation UInt64 DEFAULT 0")
    assert make_writer(script, [], version="22.3.1",
                       shared_with_other_kafka_clusters=True).check_tables(["db.t"]) == []
    for kind, typ in (("", "UInt32"), ("MATERIALIZED", "UInt64")):
        wrong = {**script, COLUMNS_QUERY: [*COORDINATE_ROWS, ("t", "_incarnation", typ, kind, "")]}
        with pytest.raises(IncarnationMissing, match=f"has _incarnation {typ}"):
            make_writer(wrong, [], shared_with_other_kafka_clusters=True).check_tables(
                ["db.t"])
    marked = {**script, COLUMNS_QUERY: [*COORDINATE_ROWS, ("t", "_incarnation", "UInt64",
                                                           "DEFAULT", "0")]}
    assert make_writer(marked, [], shared_with_other_kafka_clusters=True).check_tables(
        ["db.t"]) == []
    with pytest.raises(IncarnationMissing, match=r"^table db\.t has no incarnation column.*"
                       r"ADD COLUMN incarnation UInt64 DEFAULT 0$"):
        make_writer(marked, [], dead_letter_table="db.t",
                    shared_with_other_kafka_clusters=True).check_tables(["db.t"])


def test_check_refuses_profile_and_distributed() -> None:
    with pytest.raises(DedupNotConfigured, match="insert_deduplicate"):
        make_writer(_check_script("ReplicatedMergeTree", "", profile="0"), []).check_tables(
            ["db.t"])
    with pytest.raises(DedupNotConfigured, match="Distributed"):
        make_writer(_check_script("Distributed", ""), []).check_tables(["db.t"])
    assert make_writer(_check_script("ReplicatedMergeTree", ""), [],
                       allow_without_coordinates=ALLOWED).check_tables(["db.t"])


QUORUM_286 = ("Quorum for previous write has not been satisfied yet. Status: version: 1\n"
              "part_name: all_48_48_0\nrequired_number_of_replicas: 2\n"
              "actual_number_of_replicas: 1\nreplicas:\nr1\n. Stack trace:\n\n0. /lib/x")


class ReplicaViewClient(FakeClient):
    """Answers system.replicas / system.replication_queue per replica."""

    VIEWS: ClassVar[dict[str, tuple[list[Any], list[Any]]]] = {
        "a": ([("r1", 0, 0, 0, 0)], []),
        "b": ([("r2", 0, 0, 3, 125)],
              [("GET_PART", 14, "Code: 341, e.displayText() = DB::Exception: Metadata on "
                                "replica is not up to date. Stack trace:\n0. x")]),
    }

    def execute(self, query: str, params: Any = None, **kwargs: Any) -> Any:
        if "system.replicas" in query:
            return self.VIEWS[self.replica.host][0]
        if "system.replication_queue" in query:
            return self.VIEWS[self.replica.host][1]
        return super().execute(query, params, **kwargs)


def test_an_unreachable_quorum_names_the_lagging_replica_and_the_remedy(
        sample: Descriptor) -> None:
    """Every attempt refused for the quorum: one error naming the table, the replica
    that does not catch up, what it is stuck on and the 18.16 remedy, not the server's
    raw message."""
    batch, block = sample_batch(sample)
    refusal = [ch_errors.ServerException(QUORUM_286, code=286)] * 3
    script: dict[str, Any] = {"a": list(refusal), "b": list(refusal)}
    writer = ClickHouseBlockWriter(
        WriterConfig(replicas=(Replica("a"), Replica("b", 9100)), insert_quorum=2,
                     max_attempts=4, quorum_pending_wait_s=0),
        lambda r: ReplicaViewClient(r, script, []), sleep=lambda s: None)
    with pytest.raises(QuorumUnsatisfied) as info:
        writer.insert(block, batch)
    text = str(info.value)
    assert isinstance(info.value, InsertFailed) and info.value.code == 286
    assert text.startswith("insert into db.t failed after 4 attempt(s): insert_quorum = 2 "
                           "was not reached (code 286: Quorum for previous write")
    assert "replica r1 at a:9000 has the previous part: queue 0, delay 0 s" in text
    assert ("replica r2 at b:9100 lags: queue 3, delay 125 s; stuck on GET_PART tried 14 "
            "times: Code: 341") in text
    assert "The replica that does not catch up: r2." in text
    assert "DETACH TABLE db.t then ATTACH TABLE db.t on that replica" in text
    assert "Stack trace" not in text and "\n" not in text


QUORUM_TIMEOUT_319 = ("Unknown status, client must retry. Reason: Code: 159, e.displayText() = "
                      "DB::Exception: Timeout while waiting for quorum, e.what() = "
                      "DB::Exception")
"""18.16's answer to an insert whose part is stored on the replica but whose quorum wait
timed out (tests/integration/test_quorum_retry.py)."""


def test_a_retry_after_a_quorum_timeout_is_refused_until_the_quorum_holds_the_block(
        sample: Descriptor) -> None:
    """Issue 25, "also reported": what 18.16 does (tests/integration/test_quorum_retry.py)
    and what the writer makes of it. Attempt 1 times out on the quorum (319); every
    retry, on either replica, is refused with 286 while the lagging replica lacks the
    part, never deduplicated into a success; so the writer fails the block with
    QuorumUnsatisfied and returns only once an attempt is acknowledged."""
    batch, block = sample_batch(sample)
    script: dict[str, Any] = {
        "a": [ch_errors.ServerException(QUORUM_TIMEOUT_319, code=319),
              ch_errors.ServerException(QUORUM_286, code=286)],
        "b": [ch_errors.ServerException(QUORUM_286, code=286)] * 2}
    log: list[Any] = []
    writer = ClickHouseBlockWriter(
        WriterConfig(replicas=(Replica("a"), Replica("b")), insert_quorum=2, max_attempts=4,
                     quorum_pending_wait_s=0),
        lambda r: ReplicaViewClient(r, script, log), sleep=lambda s: None)
    with pytest.raises(QuorumUnsatisfied) as info:
        writer.insert(block, batch)
    assert [host for host, *_ in log] == ["a", "b", "a", "b"]
    assert info.value.code == 286 and "The replica that does not catch up: r2." in str(info.value)
    writer.insert(block, batch)  # the lagging replica caught up: the next attempt is acknowledged
    assert len(log) == 5


class CountingClient(ReplicaViewClient):
    """Counts the connections the writer opens and closes."""

    opened: ClassVar[list[str]] = []
    closed: ClassVar[list[str]] = []

    def __init__(self, replica: Replica, script: dict[str, list[Any]], log: list[Any]) -> None:
        super().__init__(replica, script, log)
        self.opened.append(replica.host)

    def disconnect(self) -> None:
        self.closed.append(self.replica.host)


def test_an_insert_queued_behind_another_quorum_waits_briefly_on_the_same_replica(
        sample: Descriptor) -> None:
    """On 18.16 a table takes one quorum insert at a time: an insert refused because the
    previous one's quorum is pending (286) is nothing failing. It is sent again to the
    same replica after 10 ms, then 20, 40..., counting no attempt, instead of failing
    over and sleeping ``backoff_initial_s`` (1 s by default) as a real failure does."""
    batch, block = sample_batch(sample)
    script: dict[str, Any] = {"a": [ch_errors.ServerException(QUORUM_286, code=286)] * 3}
    log: list[Any] = []
    sleeps: list[float] = []
    CountingClient.opened, CountingClient.closed = [], []
    writer = ClickHouseBlockWriter(
        WriterConfig(replicas=(Replica("a"), Replica("b")), insert_quorum=2, max_attempts=2,
                     backoff_initial_s=1.0),
        lambda r: CountingClient(r, script, log), sleep=sleeps.append)
    writer.insert(block, batch)
    assert [host for host, *_ in log] == ["a"] * 4
    assert CountingClient.opened == ["a"] and CountingClient.closed == []
    assert len(sleeps) == 3 and sum(sleeps) < 0.1, sleeps
    assert sleeps == sorted(sleeps)
    assert writer.quorum_waits == 3  # the batch line's quorum_waits


def test_a_quorum_pending_past_the_budget_fails_over_and_is_diagnosed(
        sample: Descriptor, caplog: pytest.LogCaptureFixture) -> None:
    """A pending quorum that outlasts ``quorum_pending_wait_s`` (in pauses of at most
    0.1 s) is a replica not catching up: each further refusal is an attempt, with
    failover and backoff, each logged as a WARNING, and the last ends in the same
    QuorumUnsatisfied diagnosis."""
    batch, block = sample_batch(sample)
    refusal = ch_errors.ServerException(QUORUM_286, code=286)
    script: dict[str, Any] = {"a": [refusal] * 100, "b": [refusal] * 100}
    log: list[Any] = []
    sleeps: list[float] = []
    writer = ClickHouseBlockWriter(
        WriterConfig(replicas=(Replica("a"), Replica("b")), insert_quorum=2, max_attempts=3,
                     backoff_initial_s=1.0, quorum_pending_wait_s=2.0),
        lambda r: ReplicaViewClient(r, script, log), sleep=sleeps.append)
    with caplog.at_level(logging.DEBUG, logger="blockagg"), \
            pytest.raises(QuorumUnsatisfied) as info:
        writer.insert(block, batch)
    retried = [r for r in caplog.records if "failed (attempt" in r.getMessage()]
    assert [r.levelno for r in retried] == [logging.WARNING] * 3
    waits = [s for s in sleeps if s <= 0.6]
    assert abs(sum(waits) - 2.0) < 1e-9 and max(waits) <= 0.1 * 1.2
    assert [round(s) for s in sleeps if s > 0.6] == [1, 2]  # the attempts' backoff
    hosts = [host for host, *_ in log]
    assert hosts[:len(waits) + 1] == ["a"] * (len(waits) + 1) and hosts[-2:] == ["b", "a"]
    assert "failed after 3 attempt(s)" in str(info.value)


def test_a_quorum_timeout_on_every_attempt_names_the_lagging_replica(
        sample: Descriptor) -> None:
    """A replica that fetches, but slower than ``insert_quorum_timeout``, fails each
    attempt with 319 (the part stored, the quorum wait timed out) rather than 286: still
    a quorum failure, reported with the replicas' state and the remedy."""
    batch, block = sample_batch(sample)
    script: dict[str, Any] = {
        host: [ch_errors.ServerException(QUORUM_TIMEOUT_319, code=319)] * 2 for host in "ab"}
    writer = ClickHouseBlockWriter(
        WriterConfig(replicas=(Replica("a"), Replica("b")), insert_quorum=2, max_attempts=4),
        lambda r: ReplicaViewClient(r, script, []), sleep=lambda s: None)
    with pytest.raises(QuorumUnsatisfied) as info:
        writer.insert(block, batch)
    assert info.value.code == 319
    assert "insert_quorum = 2 was not reached (code 319: Unknown status" in str(info.value)
    assert is_quorum_failure(319, QUORUM_TIMEOUT_319)
    assert not is_quorum_failure(319, "Unknown status, client must retry. Reason: "
                                      "Connection loss")


def test_quorum_error_names_a_replica_that_does_not_answer() -> None:
    states = [ReplicaState("a:9000", "r1"), ReplicaState("b:9000", error="NetworkError: down")]
    text = quorum_error("db.t", 2, 159, "Timeout while waiting for quorum", 6, states)
    assert "replica at b:9000 did not answer (NetworkError: down)" in text
    assert "does not catch up: b:9000." in text and "DETACH" not in text
    assert replicas_with_part(QUORUM_286) == ("r1",)
    assert is_quorum_failure(159, "Timeout while waiting for quorum")
    assert not is_quorum_failure(159, "Timeout exceeded: elapsed 5 seconds")


def test_tls_settings_reach_every_connection_the_job_opens() -> None:
    """``[clickhouse] secure / verify / ca_certs`` were parsed but no connection took
    them; now the writer's clients and the start-up check connect with them."""
    from blockagg.aggregator.clickhouse.startup import driver_check
    from blockagg.aggregator.clickhouse.writer import (
        Replica,
        WriterConfig,
        default_client_factory,
    )
    from blockagg.config import loads
    from blockagg.spark.components import make_writer
    from blockagg.tls import tls_arguments

    assert tls_arguments(False, True, "/ca.pem") == {}
    tls = tls_arguments(True, False, "/ca.pem")
    assert tls == {"secure": True, "verify": False, "ca_certs": "/ca.pem"}

    client = default_client_factory(WriterConfig((Replica("ch", 9440),), tls=tls))(
        Replica("ch", 9440))
    assert client.connection.secure_socket is True  # type: ignore[attr-defined]
    assert client.connection.verify_cert is False  # type: ignore[attr-defined]
    assert client.connection.ssl_options == {"ca_certs": "/ca.pem"}  # type: ignore[attr-defined]

    check = driver_check("ch", 9440, "u", "p", 1.0, tls=tls)
    assert check._connect().connection.secure_socket is True

    config = loads("""
[job]
checkpoint_location = "/tmp/ck"
[kafka]
"bootstrap.servers" = "k:9092"
[[topics]]
name = "t"
replicas = ["ch:9440"]
[clickhouse]
secure = true
ca_certs = "/ca.pem"
""")
    assert make_writer(config, config.topics[0]).config.tls == {
        "secure": True, "verify": True, "ca_certs": "/ca.pem"}


def test_a_block_built_ahead_is_sent_as_its_insert_would_build_it(
        sample: Descriptor, monkeypatch: pytest.MonkeyPatch) -> None:
    batch, block = sample_batch(sample)
    alone: list[Any] = []
    make_writer({}, alone).insert(block, batch)
    ahead: list[Any] = []
    writer = make_writer({}, ahead)
    writer.build_ahead([block], batch)
    built: list[str] = []
    build = writer.block_data

    def counted(b: Block, *a: Any, **k: Any) -> Any:
        built.append(b.token)
        return build(b, *a, **k)

    monkeypatch.setattr(writer, "block_data", counted)
    writer.insert(block, batch)
    assert built == [] and repr(ahead) == repr(alone)
    writer.insert(block, batch)  # a block built ahead is taken once: a retry builds it
    assert built == [block.token] and repr(ahead[1]) == repr(alone[0])


def test_only_this_batchs_blocks_within_the_budget_are_built_ahead(sample: Descriptor) -> None:
    batch, block = sample_batch(sample)
    writer = make_writer({}, [])
    later = dataclasses.replace(block, token="later")
    ahead = BlocksBuiltAhead(budget=block.size + later.size - 1)
    assert ahead.fill([block, later], batch, lambda b: writer.block_data(b, batch)) == 1
    assert ahead.take(later, batch) is None
    assert ahead.take(block, dataclasses.replace(batch)) is None  # another batch
    assert ahead.take(block, batch) is not None and ahead.take(block, batch) is None
    ahead.fill([], batch, lambda b: writer.block_data(b, batch))
    assert ahead.take(block, batch) is None  # the next event drops what was left


def test_a_block_that_fails_to_build_ahead_fails_in_its_insert(sample: Descriptor) -> None:
    batch, block = sample_batch(sample)
    broken = dataclasses.replace(batch, payloads=[object(), *batch.payloads[1:]])
    log: list[Any] = []
    writer = make_writer({}, log)
    writer.build_ahead([block], broken)
    with pytest.raises(ClickHouseError, match="holds a object payload"):
        writer.insert(block, broken)
    assert log == []


def test_a_large_block_is_left_to_its_lane_and_the_next_small_one_built(
        sample: Descriptor) -> None:
    batch, block = sample_batch(sample)
    writer = make_writer({}, [])
    large = dataclasses.replace(block, token="large", size=BUILT_AHEAD_BLOCK_BYTES + 1)
    ahead = BlocksBuiltAhead()
    assert ahead.fill([large, block], batch, lambda b: writer.block_data(b, batch)) == 1
    assert ahead.take(large, batch) is None and ahead.take(block, batch) is not None


def test_the_last_block_taken_lets_go_of_the_batch(sample: Descriptor) -> None:
    batch, block = sample_batch(sample)
    writer = make_writer({}, [])
    ahead = BlocksBuiltAhead()
    ahead.fill([block], batch, lambda b: writer.block_data(b, batch))
    assert ahead._slot[0] is batch
    assert ahead.take(block, batch) is not None
    assert ahead._slot == (None, {})
