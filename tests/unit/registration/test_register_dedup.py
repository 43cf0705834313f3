"""``ba-schema register`` refuses a table that would not drop a retried block (the job
would refuse to start on it), unless ``--allow-no-dedup``: then it registers with a
warning on stderr, and stdout stays the JSON result."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from blockagg.proto.registry import MemoryStore
from blockagg.registration.cli import Context, cli
from blockagg.rows.columns import Column

COLUMNS = [Column("a", "Int32"), Column("_offset", "UInt64")]
REASON = ("table db.t uses MergeTree, which does not deduplicate inserts; use "
          "ReplicatedMergeTree or set non_replicated_deduplication_window = 1000 in its "
          "SETTINGS (ClickHouse 21.2+)")


def register(tmp_path: Path, store: MemoryStore, reason: str | None, *flags: str) -> Any:
    proto = tmp_path / "row.proto"
    proto.write_text('syntax = "proto3";\npackage t;\nmessage Row { int32 a = 1; }\n')
    ctx = Context(False, lambda: store, lambda table: COLUMNS, lambda table: reason)
    head = [f for f in flags if f == "--json"]
    rest = [f for f in flags if f != "--json"]
    return CliRunner().invoke(cli, [*head, "register", "db.t", "--proto", str(proto),
                                    "--message", "t.Row", *rest], obj=ctx)


def test_a_table_that_cannot_deduplicate_is_refused_and_nothing_is_written(
        tmp_path: Path) -> None:
    store = MemoryStore()
    result = register(tmp_path, store, REASON)
    assert result.exit_code == 1
    [line] = [x for x in result.stderr.splitlines() if x.strip()]
    assert REASON in line and "nothing was registered" in line and "--allow-no-dedup" in line
    assert store.records == []


def test_the_json_refusal_names_the_table(tmp_path: Path) -> None:
    result = register(tmp_path, MemoryStore(), REASON, "--json")
    assert result.exit_code == 1
    out = json.loads(result.stdout)
    assert out["ok"] is False and out["table"] == "db.t" and REASON in out["error"]


def test_allow_no_dedup_registers_with_a_warning_on_stderr(tmp_path: Path) -> None:
    store = MemoryStore()
    result = register(tmp_path, store, REASON, "--json", "--allow-no-dedup")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["changed"] is True
    assert "WARNING" in result.stderr and REASON in result.stderr
    assert len(store.records) == 1


def test_a_deduplicating_table_registers_quietly(tmp_path: Path) -> None:
    result = register(tmp_path, MemoryStore(), None)
    assert result.exit_code == 0 and result.stderr == ""


def test_no_check_skips_the_table(tmp_path: Path) -> None:
    assert register(tmp_path, MemoryStore(), REASON, "--no-check").exit_code == 0
