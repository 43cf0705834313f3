"""``bench.bench_drift``'s comparison of the servers' event counters between the job's
runs and the limit's (pure; the runs themselves are measured by hand)."""

from __future__ import annotations

from pathlib import Path

from bench.bench_drift import compare_events
from bench.workload import drop_page_cache, events_delta


def test_events_delta_keeps_what_moved() -> None:
    assert events_delta({"Query": 10, "Merge": 3}, {"Query": 15, "Merge": 3, "Insert": 2}) == {
        "Query": 5, "Insert": 2}


def test_compare_ranks_by_the_difference_of_medians_per_replica() -> None:
    runs = [
        {"step": "job", "events": [{"SelectQuery": 600, "InsertQuery": 800}, {"Fetch": 790}]},
        {"step": "same", "events": [{"InsertQuery": 800}, {"Fetch": 800}]},
        {"step": "job", "events": [{"SelectQuery": 620, "InsertQuery": 801}, {"Fetch": 800}]},
        {"step": "same", "events": [{"InsertQuery": 800, "SelectQuery": 2}, {"Fetch": 800}]},
    ]
    first, second = compare_events(runs, top=2)
    assert first[0].split() == ["SelectQuery", "610", "1"]
    assert first[1].split() == ["InsertQuery", "800", "800"]
    assert second[0].split() == ["Fetch", "795", "800"]


def test_the_page_cache_is_dropped_through_the_control_file(tmp_path: Path) -> None:
    control = tmp_path / "drop_caches"
    assert drop_page_cache(control) is True
    assert control.read_text() == "1\n"
    assert drop_page_cache(tmp_path / "absent" / "drop_caches") is False
