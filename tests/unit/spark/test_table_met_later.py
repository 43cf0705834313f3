"""blockagg.spark.task.live_columns: a table the job meets after its start (registered
while it runs) is judged for its deduplication window before its first insert, with
the driver's need and refusal (issue 25, path 4)."""

from __future__ import annotations

from typing import Any

import pytest

from blockagg.aggregator.clickhouse.exceptions import DedupWindowTooSmall
from blockagg.aggregator.config import loads
from blockagg.spark import task
from tests.unit.clickhouse.test_writer import ALLOWED, _check_script, make_writer

CONFIG = """
[job]
checkpoint_location = "/tmp/ck"
max_offsets_per_trigger = 4
[kafka]
"bootstrap.servers" = "x:1"
[[topics]]
name = "t"
replicas = ["ch:9000"]
"""


def _script(window: int) -> dict[str, Any]:
    return _check_script("ReplicatedMergeTree", "CREATE TABLE db.t (x Int64) ENGINE = "
                         "ReplicatedMergeTree('/t', 'r') ORDER BY x SETTINGS "
                         f"replicated_deduplication_window = {window}, index_granularity = 8192")


@pytest.mark.parametrize("extra", ["", "[clickhouse]\nallow_small_dedup_window = true\n"])
def test_a_table_met_after_the_start_is_judged_before_its_first_insert(
        monkeypatch: pytest.MonkeyPatch, extra: str) -> None:
    """A window of 2 where 2 x max_offsets_per_trigger 4 = 8 blocks are needed: the
    task refuses before anything of the batch is committed or inserted (a warning with
    allow_small_dedup_window); a window of 8 is taken."""
    config = loads(CONFIG + extra)
    topic = config.topics[0]
    inserts: list[Any] = []
    monkeypatch.setattr(task, "describer", lambda c, t: make_writer(
        _script(2), inserts, allow_without_coordinates=ALLOWED))
    if extra:
        assert [c.name for c in task.live_columns(config, topic, "db.t")] == ["x"]
    else:
        with pytest.raises(DedupWindowTooSmall,
                           match=r"table db\.t: replicated_deduplication_window = 2 is "
                                 r"below the 8 blocks"):
            task.live_columns(config, topic, "db.t")
    monkeypatch.setattr(task, "describer", lambda c, t: make_writer(
        _script(8), inserts, allow_without_coordinates=ALLOWED))
    assert [c.name for c in task.live_columns(config, topic, "db.t")] == ["x"]
    assert inserts == []
