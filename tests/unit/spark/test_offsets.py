"""blockagg.spark.offsets: the offset-log parsers and the startingOffsets JSON (pure parts)."""

from __future__ import annotations

import json

import pytest

from blockagg.spark.exceptions import OffsetLogError
from blockagg.spark.offsets import (
    PlannedRange,
    assign_json,
    offsets_json,
    parse_initial_offsets,
    parse_offset_log_entry,
    plan_ranges,
    starting_offsets_json,
)

ENTRY = (
    'v1\n{"batchWatermarkMs":0,"batchTimestampMs":1,"conf":{"a":"b"}}\n'
    '{"events":{"0":6,"1":0},"logs":{"2":17}}'
)


def test_parse_offset_log_entry() -> None:
    assert parse_offset_log_entry(ENTRY) == {("events", 0): 6, ("events", 1): 0, ("logs", 2): 17}


def test_parse_refuses_other_versions_and_shapes() -> None:
    with pytest.raises(OffsetLogError, match="version 'v9'"):
        parse_offset_log_entry(ENTRY.replace("v1", "v9", 1))
    with pytest.raises(OffsetLogError, match="exactly one source"):
        parse_offset_log_entry(ENTRY + '\n{"x":{"0":1}}')
    with pytest.raises(OffsetLogError, match="not JSON"):
        parse_offset_log_entry("v1\n{}\nnope")
    with pytest.raises(OffsetLogError, match="bad offset"):
        parse_offset_log_entry('v1\n{}\n{"t":{"0":"x"}}')


def test_parse_initial_offsets() -> None:
    assert parse_initial_offsets('\x00v1\n{"t":{"0":0,"1":5}}') == {("t", 0): 0, ("t", 1): 5}
    with pytest.raises(OffsetLogError):
        parse_initial_offsets("garbage")


def test_plan_ranges() -> None:
    end = {("t", 0): 10, ("t", 1): 4, ("t", 2): 7}
    ranges = plan_ranges(end, {("t", 0): 6, ("t", 1): 4}, earliest={("t", 2): 3})
    assert ranges[("t", 0)] == PlannedRange("t", 0, 6, 10)
    assert ranges[("t", 1)].empty
    assert ranges[("t", 2)] == PlannedRange("t", 2, 3, 7, exact_start=False)
    with pytest.raises(OffsetLogError, match="goes backwards"):
        plan_ranges({("t", 0): 3}, {("t", 0): 5})


def test_starting_offsets_json() -> None:
    parts = [("b", 1), ("a", 0), ("b", 0)]
    got = json.loads(starting_offsets_json(parts, {("b", 1): 42}, "earliest"))
    assert got == {"a": {"0": -2}, "b": {"0": -2, "1": 42}}
    got = json.loads(starting_offsets_json(parts, {}, "latest"))
    assert got == {"a": {"0": -1}, "b": {"0": -1, "1": -1}}


def test_offsets_and_assign_json() -> None:
    assert json.loads(offsets_json({("t", 1): 5, ("t", 0): 2})) == {"t": {"0": 2, "1": 5}}
    assert json.loads(assign_json([("t", 1), ("u", 0), ("t", 0)])) == {"t": [0, 1], "u": [0]}
