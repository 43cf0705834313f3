"""blockagg.spark.task: batch building and the one-partition-per-task contract (no Spark)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

import pytest

from blockagg.aggregator.core.model import Batch, Block, Committed
from blockagg.config import loads
from blockagg.proto.envelope import make_envelope
from blockagg.rows.deadletters import DeadLetter
from blockagg.rows.partition import Message, build_batch
from blockagg.spark.components import StaticRegistry
from blockagg.spark.exceptions import TaskContractError
from blockagg.spark.offsets import PlannedRange
from blockagg.spark.task import TaskContext, reason_label, run_partition

CONFIG = """
[job]
checkpoint_location = "/tmp/ck"
[kafka]
"bootstrap.servers" = "x:1"
[[topics]]
name = "t"
replicas = ["ch:9000"]
[blocks]
max_rows = 3
"""


class MemoryStore:
    def __init__(self) -> None:
        self.commits: dict[tuple[str, int], Committed] = {}
        self.history: list[tuple[int, str]] = []

    def committed(self, topic: str, partition: int) -> Committed | None:
        return self.commits.get((topic, partition))

    def commit(self, topic: str, partition: int, offset: int, metadata: str) -> None:
        self.commits[(topic, partition)] = Committed(offset, metadata)
        self.history.append((offset, metadata))


class MemorySink:
    def __init__(self) -> None:
        self.blocks: list[tuple[str, list[int]]] = []

    def insert(self, block: Block, batch: Batch, confirmed_at: float | None = None) -> None:
        self.blocks.append((block.table, [int(batch.offsets[p]) for p in block.positions]))


class Components:
    def __init__(self) -> None:
        self._store = MemoryStore()
        self._sink = MemorySink()

    def store(self, config: Any) -> MemoryStore:
        return self._store

    def sink(self, config: Any, topic: Any) -> MemorySink:
        return self._sink

    def registry(self, config: Any) -> StaticRegistry:
        return StaticRegistry({"db.a": 1, "db.b": 2})


def rows(offsets: Sequence[int], values: Sequence[bytes | None], partition: int = 0,
         topic: str = "t") -> list[tuple[Any, ...]]:
    stamp = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
    return [(topic, partition, o, v, stamp) for o, v in zip(offsets, values, strict=True)]


def ctx(components: Components, ranges: dict[tuple[str, int], PlannedRange],
        extra: str = "") -> TaskContext:
    return TaskContext(loads(CONFIG + extra), components, ranges, batch_id=7, run_id=42)


def test_build_batch_routes_and_dead_letters() -> None:
    values = [make_envelope("db.a", [b"1", b"2"]), b"\xff garbage",
              make_envelope("db.zz", [b"x"]), None, make_envelope("db.b", [b"3"])]
    batch = build_batch(PlannedRange("t", 0, 10, 20), [10, 11, 12, 13, 15], values,
                        [0] * 5, StaticRegistry({"db.a": 1, "db.b": 2}), "bl.dead")
    assert batch.table_ids.tolist() == [1, 0, 0, 0, 2]
    assert batch.row_counts.tolist() == [2, 1, 1, 1, 1]
    assert batch.tables == {1: "db.a", 0: "bl.dead", 2: "db.b"}
    assert (batch.start, batch.end) == (10, 20)
    assert isinstance(batch.payloads[0], Message)
    dead = batch.payloads[2]
    assert isinstance(dead, DeadLetter) and "not registered" in dead.error
    assert reason_label(dead.error) == "unregistered_table"


def test_inexact_start_lowered_to_first_row() -> None:
    batch = build_batch(PlannedRange("t", 0, 5, 9, exact_start=False), [3, 4],
                        [make_envelope("db.a", [b"1"])] * 2, [0, 0], StaticRegistry({"db.a": 1}),
                        "bl.dead")
    assert batch.start == 3


def test_run_partition_reports_and_commits_final() -> None:
    comps = Components()
    values = [make_envelope("db.a" if i % 2 else "db.b", [b"r"]) for i in range(6)]
    ranges = {("t", 0): PlannedRange("t", 0, 0, 8)}  # ends in invisible offsets 6, 7
    [report] = list(run_partition(ctx(comps, ranges), rows(range(6), values)))
    assert report["end"] == 8 and report["messages"] == 6 and report["rows"] == 6
    assert report["consumed"] == {"db.a": [3, sum(len(v) for v in values[1::2])],
                                  "db.b": [3, sum(len(v) for v in values[::2])]}
    assert comps._store.commits[("t", 0)].offset == 8  # final commit at the planned end
    delivered = sorted(o for _, offs in comps._sink.blocks for o in offs)
    assert delivered == list(range(6))


def test_empty_iterator_yields_nothing() -> None:
    assert list(run_partition(ctx(Components(), {}), [])) == []


def test_two_partitions_in_one_task_refused() -> None:
    comps = Components()
    ranges = {("t", 0): PlannedRange("t", 0, 0, 5), ("t", 1): PlannedRange("t", 1, 0, 5)}
    data = rows([0], [make_envelope("db.a", [b"r"])]) + rows([0], [b"x"], partition=1)
    with pytest.raises(TaskContractError, match="one Spark partition holds rows"):
        list(run_partition(ctx(comps, ranges), data))


def test_out_of_order_and_out_of_range_refused() -> None:
    comps = Components()
    ranges = {("t", 0): PlannedRange("t", 0, 0, 5)}
    v = make_envelope("db.a", [b"r"])
    with pytest.raises(TaskContractError, match="out of order"):
        list(run_partition(ctx(comps, ranges), rows([2, 1], [v, v])))
    with pytest.raises(TaskContractError, match="outside the planned range"):
        list(run_partition(ctx(comps, ranges), rows([4, 5], [v, v])))
    with pytest.raises(TaskContractError, match="without a planned range"):
        list(run_partition(ctx(comps, {}), rows([1], [v])))


def test_dead_letters_are_delivered_whatever_the_rate() -> None:
    """The task never judges the rate (the driver does, over whole batches, after
    delivery): a partition of mostly bad messages is delivered and reported."""
    comps = Components()
    ranges = {("t", 0): PlannedRange("t", 0, 0, 4)}
    data = rows(range(4), [b"bad", b"bad", b"bad", make_envelope("db.a", [b"r"])])
    (rep,) = run_partition(ctx(comps, ranges, "[dead_letters]\nmax_rate = 0.0\n"), data)
    assert rep["dead_letters"] == {"bad_envelope": 3} and rep["messages"] == 4
    assert sorted(offsets for _, offsets in comps._sink.blocks) == [[0, 1, 2], [3]]


def test_live_columns_refuses_a_table_that_would_not_drop_a_retried_block(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from blockagg.aggregator.clickhouse.exceptions import DedupNotConfigured, TableNotFound
    from blockagg.spark import task

    class Writer:
        def check_tables(self, tables: Sequence[str], writers: int = 1) -> list[str]:
            if tables[0] == "db.missing":
                raise TableNotFound("db.missing does not exist")
            if tables[0] == "db.plain":
                raise DedupNotConfigured("table db.plain uses MergeTree")
            return []

        def checked(self, table: str) -> Any:
            return type("Info", (), {"columns": ["c"]})()

    monkeypatch.setattr(task, "describer", lambda config, topic: Writer())
    config = loads(CONFIG)
    topic = config.topics[0]
    assert task.live_columns(config, topic, "db.ok") == ["c"]
    with pytest.raises(DedupNotConfigured, match=r"db\.plain"):
        task.live_columns(config, topic, "db.plain")
    with pytest.raises(TableNotFound):  # refuses the batch: no dead letter from live state
        task.live_columns(config, topic, "db.missing")


def test_commit_beyond_the_partitions_end_refuses_the_batch() -> None:
    """A final commit at 1000 on a partition whose log ends at 8 (offsets reset, topic
    recreated): without the partition's end the batch [0, 8) would be skipped as
    delivered and its messages lost; with it the task refuses, committing nothing."""
    from blockagg.aggregator.core.exceptions import MetadataAheadOfPartition
    from blockagg.aggregator.core.metadata import Metadata, encode

    comps = Components()
    comps._store.commit("t", 0, 1000, encode(Metadata(1, 3, 900, 1000, 1000)))
    ranges = {("t", 0): PlannedRange("t", 0, 0, 8)}
    values = [make_envelope("db.a", [b"r"])] * 8
    context = TaskContext(loads(CONFIG), comps, ranges, batch_id=7, run_id=42,
                          partition_ends={("t", 0): 8})
    with pytest.raises(MetadataAheadOfPartition, match=r"resume offset 1000 is beyond the "
                       r"partition's end 8"):
        list(run_partition(context, rows(range(8), values)))
    assert len(comps._store.history) == 1 and comps._sink.blocks == []
    [report] = list(run_partition(ctx(comps, ranges), rows(range(8), values)))
    assert report["skipped"]  # what happened before: the batch silently dropped


def test_dead_letter_missing_blocks_routes_the_blocks_survivors() -> None:
    """job.dead_letter_missing_blocks: the surviving messages of the abandoned block of
    db.b go to the dead-letter table with the reason; db.a, not listed, is consumed
    from the resume offset; nothing of db.b up to the block's last offset reaches db.b."""
    from blockagg.aggregator.core.metadata import BlockRange, Metadata, encode

    comps = Components()
    # db.a at even offsets, db.b at odd ones; db.b's block [1, 9] lost offset 1.
    comps._store.commit("t", 0, 1, encode(Metadata(1, 3, 0, 12, 1, (BlockRange(2, 1, 9),))))
    offsets = [o for o in range(1, 12) if o != 1]
    values = [make_envelope("db.a" if o % 2 == 0 else "db.b", [b"r"]) for o in offsets]
    ranges = {("t", 0): PlannedRange("t", 0, 1, 12)}
    setting = 'dead_letter_missing_blocks = ["t:0:2:1-9"]\n'
    config = loads(CONFIG.replace("[kafka]", setting + "[kafka]"))
    context = TaskContext(config, comps, ranges, batch_id=7, run_id=42)
    [report] = list(run_partition(context, rows(offsets, values)))
    by_table: dict[str, list[int]] = {}
    for table, offs in comps._sink.blocks:
        by_table.setdefault(table, []).extend(offs)
    assert sorted(by_table["blockagg.dead_letters"]) == [3, 5, 7, 9]
    assert sorted(by_table["db.a"]) == [2, 4, 6, 8, 10]
    assert sorted(by_table["db.b"]) == [11]
    assert report["dead_letters"] and comps._store.commits[("t", 0)].offset == 12


def test_refusal_in_finds_the_blockagg_error_in_sparks_wrapping() -> None:
    from blockagg.spark.exceptions import refusal_in

    wrapped = (
        "An error occurred while calling o123.collectToPython.\n"
        ": org.apache.spark.SparkException: Job aborted due to stage failure: ...\n"
        "Traceback (most recent call last):\n"
        '  File "/x/task.py", line 290, in run_range\n'
        "blockagg.aggregator.core.exceptions.MetadataDecodeError: events[3]: the last "
        "commit does not decode\n"
        "\tat org.apache.spark.api.python.BasePythonRunner...\n")
    assert refusal_in(wrapped) == ("MetadataDecodeError: events[3]: the last commit does "
                                   "not decode")
    assert refusal_in(RuntimeError("py4j: connection reset")) is None
