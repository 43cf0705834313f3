"""spark.task.run_arrow_partition: the Arrow hand-over gives the aggregator exactly what
the row hand-over gives it (same reports, same commits, same blocks), however Spark
cuts the partition into record batches, and refuses what breaks the task contract."""

from __future__ import annotations

import datetime as dt
import itertools
import pickle
from collections.abc import Sequence
from typing import Any
from unittest.mock import patch

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockagg.aggregator.core.model import Batch, Block
from blockagg.proto.envelope import make_envelope
from blockagg.rows.deadletters import DeadLetter
from blockagg.spark.exceptions import TaskContractError
from blockagg.spark.offsets import PlannedRange
from blockagg.spark.task import REPORT_SCHEMA, run_arrow_partition, run_partition
from tests.unit.spark.test_task import Components, ctx

SCHEMA = pa.schema([("topic", pa.string()), ("partition", pa.int32()),
                    ("offset", pa.int64()), ("value", pa.binary()),
                    ("timestamp", pa.timestamp("us", tz="UTC"))])
"""The columns Spark's Kafka source hands to ``mapInArrow`` (``ROW_COLUMNS``)."""

TIMING = ("seconds", "insert_seconds", "commit_seconds", "entered", "read_seconds",
          "fresh_worker", "prepare_seconds")


def records(offsets: Sequence[int], values: Sequence[bytes | None], partition: int = 0,
            stamps_ms: Sequence[int | None] | None = None) -> list[tuple[Any, ...]]:
    stamps = stamps_ms or [1_704_067_200_123 + 7 * o for o in offsets]
    return [("t", partition, o, v,
             None if s is None else dt.datetime.fromtimestamp(s / 1000, tz=dt.UTC))
            for o, v, s in zip(offsets, values, stamps, strict=True)]


def batches(data: list[tuple[Any, ...]], cuts: Sequence[int]) -> list[pa.RecordBatch]:
    bounds = [0, *sorted(set(cuts)), len(data)]
    out = []
    for a, b in itertools.pairwise(bounds):
        cols: list[Sequence[Any]] = list(zip(*data[a:b], strict=True)) if b > a else [[]] * 5
        out.append(pa.RecordBatch.from_arrays(
            [pa.array(list(c), type=f.type) for c, f in zip(cols, SCHEMA, strict=True)],
            schema=SCHEMA))
    return out


def arrow_report(comps: Components, ranges: Any, data: list[tuple[Any, ...]],
                 cuts: Sequence[int] = ()) -> dict[str, Any] | None:
    out = list(run_arrow_partition(ctx(comps, ranges), batches(data, cuts)))
    if not out:
        return None
    (batch,) = out
    assert batch.schema.names == [REPORT_SCHEMA.split()[0]] and batch.num_rows == 1
    report: dict[str, Any] = pickle.loads(batch.column(0)[0].as_py())
    return report


def untimed(report: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in report.items() if k not in TIMING}


VALUES = [make_envelope("db.a", [b"r1", b"r2"]), b"\xff garbage", None,
          make_envelope("db.b", [b"r3"]), make_envelope("db.zz", [b"x"]),
          make_envelope("db.a", [b"r4"]), make_envelope("db.b", [b"r5", b"r6", b"r7"])]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(gaps=st.lists(st.integers(1, 3), min_size=len(VALUES), max_size=len(VALUES)),
       cuts=st.lists(st.integers(0, len(VALUES)), max_size=4),
       null_stamp=st.integers(-1, len(VALUES) - 1))
def test_same_as_the_row_hand_over(gaps: list[int], cuts: list[int], null_stamp: int) -> None:
    offsets = [100 + sum(gaps[: i + 1]) for i in range(len(VALUES))]
    stamps: list[int | None] = [1_704_067_200_001 + 13 * i for i in range(len(VALUES))]
    if null_stamp >= 0:
        stamps[null_stamp] = None
    data = records(offsets, VALUES, stamps_ms=stamps)
    ranges = {("t", 0): PlannedRange("t", 0, 100, offsets[-1] + 2)}
    by_rows, by_arrow = Components(), Components()
    with patch("blockagg.spark.task.now_s", lambda: 1_790_000_000):
        (expected,) = run_partition(ctx(by_rows, ranges), data)
        got = arrow_report(by_arrow, ranges, data, cuts)
    assert got is not None and untimed(got) == untimed(expected)
    assert by_arrow._store.history == by_rows._store.history
    assert by_arrow._sink.blocks == by_rows._sink.blocks


class RecordingSink:
    """Records every inserted block's payloads (offset, timestamp, value) as delivered."""

    def __init__(self) -> None:
        self.payloads: list[tuple[str, list[tuple[int, int, Any]]]] = []

    def insert(self, block: Block, batch: Batch, confirmed_at: float | None = None) -> None:
        out = []
        for p in block.positions:
            payload = batch.payloads[p]
            value = payload.raw if isinstance(payload, DeadLetter) else payload.parsed.rows
            out.append((int(batch.offsets[p]), payload.timestamp_ms, value))
        self.payloads.append((block.table, out))


def test_payloads_carry_the_same_timestamps_and_values() -> None:
    stamps: list[int | None] = [1_795_314_129_017 + i for i in range(len(VALUES))]
    stamps[3] = None
    data = records(list(range(len(VALUES))), VALUES, stamps_ms=stamps)
    ranges = {("t", 0): PlannedRange("t", 0, 0, len(VALUES))}
    sinks = []
    for hand_over in ("rows", "arrow"):
        comps = Components()
        comps._sink = RecordingSink()  # type: ignore[assignment]
        if hand_over == "rows":
            list(run_partition(ctx(comps, ranges), data))
        else:
            arrow_report(comps, ranges, data, cuts=[2, 5])
        sinks.append(comps._sink.payloads)  # type: ignore[attr-defined]
    assert sinks[0] == sinks[1]
    delivered = {o: (ts, v) for _, rows in sinks[1] for o, ts, v in rows}
    assert delivered[1] == (1_795_314_129_018, b"\xff garbage")
    assert delivered[3][0] == 0  # no timestamp


def test_the_wait_for_rows_is_read_seconds_apart_from_the_protocols_seconds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A task's rows arrive as Spark fetches them: the time before the protocol runs
    is the report's ``read_seconds`` (Spark's part), not its ``seconds`` (ours), and
    ``entered`` says when the task's Python function started, for the batch line's
    ``start_seconds``."""
    import time

    data = records(list(range(len(VALUES))), VALUES)
    ranges = {("t", 0): PlannedRange("t", 0, 0, len(VALUES))}

    def slow_rows() -> Any:
        time.sleep(0.2)
        yield from data

    def slow_batches() -> Any:
        time.sleep(0.2)
        yield from batches(data, [3])

    monkeypatch.setattr("blockagg.spark.task._WORKER_TASKS", [0])  # a new Python worker
    before = time.time()
    reports = [*run_partition(ctx(Components(), ranges), slow_rows()),
               pickle.loads(next(iter(run_arrow_partition(
                   ctx(Components(), ranges), slow_batches()))).column(0)[0].as_py())]
    for report in reports:
        assert before <= report["entered"] <= time.time()
        assert 0.2 <= report["read_seconds"] < 0.2 + 1.0
        assert report["seconds"] < 0.2
        assert 0.0 < report["prepare_seconds"] <= report["seconds"]
    # the worker's first task is the one that imported the job's code
    assert [r["fresh_worker"] for r in reports] == [True, False]


def test_empty_batches_yield_nothing() -> None:
    assert arrow_report(Components(), {}, [], cuts=[0]) is None


@pytest.mark.parametrize("cuts", [(), (1,), (2,)])
def test_out_of_order_or_repeated_offsets_refused(cuts: tuple[int, ...]) -> None:
    v = make_envelope("db.a", [b"r"])
    ranges = {("t", 0): PlannedRange("t", 0, 0, 9)}
    with pytest.raises(TaskContractError, match=r"out of order \(4 then 3\)"):
        arrow_report(Components(), ranges, records([1, 4, 3], [v, v, v]), cuts)
    with pytest.raises(TaskContractError, match=r"out of order \(4 then 4\)"):
        arrow_report(Components(), ranges, records([1, 4, 4], [v, v, v]), cuts)


@pytest.mark.parametrize("cuts", [(), (1,)])
def test_two_partitions_in_one_task_refused(cuts: tuple[int, ...]) -> None:
    v = make_envelope("db.a", [b"r"])
    ranges = {("t", 0): PlannedRange("t", 0, 0, 5), ("t", 1): PlannedRange("t", 1, 0, 5)}
    data = records([0], [v]) + records([1], [v], partition=1)
    with pytest.raises(TaskContractError, match="one Spark partition holds rows"):
        arrow_report(Components(), ranges, data, cuts)
