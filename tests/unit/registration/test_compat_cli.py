"""``ba-schema`` compatibility in-process (click's CliRunner): refusals, the override,
the per-table mode, and ``check`` over every version; in-memory store, fake columns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from blockagg.proto.exceptions import CompatibilityError
from blockagg.proto.modes import Mode
from blockagg.proto.registry import MemoryStore, Registration, Registry
from blockagg.registration.cli import Context, cli
from blockagg.registration.exceptions import IncompatibleSchema
from blockagg.registration.register import register, set_compatibility
from blockagg.rows.columns import Column

COLUMNS = [Column("a", "Int32"), Column("b", "Int32"), Column("_offset", "UInt64")]
WITH_C = [*COLUMNS, Column("c", "String", "DEFAULT", "''")]


@pytest.fixture
def protos(tmp_path: Path) -> dict[str, Path]:
    sources = {
        "v1": "message Row { int32 a = 1; int32 b = 2; }",
        "swapped": "message Row { int32 b = 1; int32 a = 2; }",
        "added": "message Row { int32 a = 1; int32 b = 2; string c = 3; }",
        "zigzag": "message Row { sint32 a = 1; int32 b = 2; }",
    }
    out = {}
    for name, body in sources.items():
        path = tmp_path / f"{name}.proto"
        path.write_text(f'syntax = "proto3";\npackage t;\n{body}\n')
        out[name] = path
    return out


def run(store: MemoryStore, *args: str, columns: list[Column] | None = None) -> Any:
    ctx = Context(False, lambda: store, lambda table: COLUMNS if columns is None else columns)
    return CliRunner().invoke(cli, list(args), obj=ctx)


def reg(store: MemoryStore, proto: Path, *extra: str, columns: list[Column] | None = None
        ) -> Any:
    """``ba-schema [--json] register db.t --proto PROTO --message t.Row [extra...]``."""
    head = ["--json"] if "--json" in extra else []
    rest = [e for e in extra if e != "--json"]
    return run(store, *head, "register", "db.t", "--proto", str(proto), "--message", "t.Row",
               *rest, columns=columns)


def test_swapped_numbers_are_refused_and_nothing_is_written(protos: dict[str, Path]) -> None:
    store = MemoryStore()
    assert reg(store, protos["v1"]).exit_code == 0
    before = list(store.records)
    result = reg(store, protos["swapped"])
    assert result.exit_code == 1
    assert "not BACKWARD compatible" in result.stderr
    assert "FIELD_NAME_CHANGED at t.Row.b (number 1)" in result.stderr
    assert "--force-incompatible" in result.stderr
    assert store.records == before
    dry = reg(store, protos["swapped"], "--dry-run")
    assert dry.exit_code == 1 and store.records == before
    as_json = reg(store, protos["zigzag"], "--json")
    assert as_json.exit_code == 1
    doc = json.loads(as_json.stdout)
    assert doc["compatibility"] == "BACKWARD" and not doc["ok"]
    assert any(d.startswith("FIELD_SCALAR_KIND_CHANGED at t.Row.a") for d in doc["differences"])


def test_compatible_version_is_registered(protos: dict[str, Path]) -> None:
    store = MemoryStore()
    assert reg(store, protos["v1"]).exit_code == 0
    cols = WITH_C
    result = reg(store, protos["added"], "--json", columns=cols)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["latest"] == 2 and doc["forced_incompatibilities"] == []
    assert result.stderr == ""


def test_force_incompatible_warns_and_is_recorded(protos: dict[str, Path]) -> None:
    store = MemoryStore()
    assert reg(store, protos["v1"]).exit_code == 0
    result = reg(store, protos["swapped"], "--force-incompatible")
    assert result.exit_code == 0, result.output
    assert "WARNING" in result.stderr and "NOT BACKWARD compatible" in result.stderr
    assert "FIELD_NAME_CHANGED" in result.stderr
    latest = Registry.load(store).get("db.t").latest
    assert latest.version == 2
    assert any("FIELD_NAME_CHANGED" in d for d in latest.forced_incompatibilities)
    shown = json.loads(run(store, "--json", "show", "db.t").stdout)
    assert shown["forced_incompatibilities"] == list(latest.forced_incompatibilities)
    assert "--force-incompatible" in run(store, "show", "db.t").stdout
    v1 = json.loads(run(store, "--json", "show", "db.t", "--version", "1").stdout)
    assert v1["forced_incompatibilities"] == []


def test_compatibility_command_and_option(protos: dict[str, Path]) -> None:
    store = MemoryStore()
    assert run(store, "compatibility", "db.t").exit_code == 2          # not registered
    assert reg(store, protos["v1"], "--compatibility", "full").exit_code == 0
    assert run(store, "compatibility", "db.t").stdout.strip() == "db.t: FULL"
    other = reg(store, protos["added"], "--compatibility", "NONE", columns=WITH_C)
    assert other.exit_code == 2 and "ba-schema compatibility db.t NONE" in other.stderr
    assert run(store, "compatibility", "db.t", "SIDEWAYS").exit_code == 2
    result = run(store, "--json", "compatibility", "db.t", "none")
    assert result.exit_code == 0
    assert json.loads(result.stdout) == {"ok": True, "table": "db.t", "compatibility": "NONE",
                                         "changed": True}
    again = run(store, "compatibility", "db.t", "NONE")
    assert again.exit_code == 0 and "unchanged" in again.stdout
    assert reg(store, protos["swapped"]).exit_code == 0                  # NONE: no check
    assert Registry.load(store).get("db.t").latest.forced_incompatibilities == ()
    listed = json.loads(run(store, "--json", "list").stdout)
    assert listed[0]["compatibility"] == "NONE"


def test_check_covers_every_version(protos: dict[str, Path]) -> None:
    store = MemoryStore()
    assert reg(store, protos["v1"]).exit_code == 0
    cols = WITH_C
    assert reg(store, protos["added"], columns=cols).exit_code == 0
    ok = run(store, "check", "db.t", columns=cols)
    assert ok.exit_code == 0 and "version 1" in ok.stdout and "version 2" in ok.stdout
    no_default = [*COLUMNS, Column("c", "String")]
    result = run(store, "--json", "check", "db.t", columns=no_default)
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["mismatches"] == [
        "version 1: column c String has no field in t.Row and no DEFAULT"]
    assert doc["versions"] == {"1": ["column c String has no field in t.Row and no DEFAULT"],
                               "2": []}
    assert "version 1: column c String" in result.stderr
    assert run(store, "check", "db.t", "--version", "2", columns=no_default).exit_code == 0
    assert run(store, "check", "db.t", "--version", "9").exit_code == 2


def test_register_api_modes(protos: dict[str, Path]) -> None:
    from blockagg.proto.descriptors import compile_proto

    fds = {name: compile_proto(path) for name, path in protos.items()}
    store = MemoryStore()
    register(store, "db.t", "t.Row", fds["v1"], compatibility=Mode.FORWARD)
    with pytest.raises(IncompatibleSchema) as info:
        register(store, "db.t", "t.Row", fds["swapped"], columns=COLUMNS)
    assert info.value.mode == "FORWARD" and len(info.value.differences) == 2
    with pytest.raises(CompatibilityError):
        register(store, "db.t", "t.Row", fds["added"], compatibility=Mode.FULL)
    reg_, changed = set_compatibility(store, "db.t", Mode.FULL)
    assert changed and reg_.mode is Mode.FULL
    assert set_compatibility(store, "db.t", Mode.FULL)[1] is False
    new, _ = register(store, "db.t", "t.Row", fds["added"])
    assert new.latest.version == 2 and new.compatibility == "FULL"
    decoded = Registration.decode(b"db.t", new.encode())
    assert decoded == new


def test_a_record_with_an_unknown_mode_still_decodes(protos: dict[str, Path]) -> None:
    from blockagg.proto.descriptors import compile_proto

    store = MemoryStore()
    first, _ = register(store, "db.t", "t.Row", compile_proto(protos["v1"]))
    future = Registration(first.table, first.table_id, first.versions, "SOMEDAY")
    store.write(b"db.t", future.encode())
    registry = Registry.load(store)
    assert registry.get("db.t").compatibility == "SOMEDAY"
    result = reg(store, protos["added"], columns=WITH_C)
    assert result.exit_code == 2 and "unknown compatibility mode 'SOMEDAY'" in result.stderr


def test_check_names_a_recorded_column_the_table_lost(protos: dict[str, Path]) -> None:
    """A version records the columns it was registered against; ``check`` says when the
    live table no longer has one as recorded (the job would refuse the version's
    batches with ColumnsChanged)."""
    store = MemoryStore()
    assert reg(store, protos["v1"]).exit_code == 0
    retyped = [Column("a", "Int64"), *COLUMNS[1:]]
    result = run(store, "--json", "check", "db.t", columns=retyped)
    assert result.exit_code == 1
    assert json.loads(result.stdout)["versions"]["1"] == [
        "column a is Int64, registered as Int32 since registration (the job refuses this "
        "version's batches)"]


def test_a_field_named_like_a_coordinate_column_is_refused(tmp_path: Path) -> None:
    """A producer's ``_offset`` would make two different blocks hash alike (18.16
    drops the second) and let a re-send count rows that are not the block's."""
    proto = tmp_path / "coord.proto"
    proto.write_text('syntax = "proto3";\npackage t;\n'
                     "message Row { int32 a = 1; int32 b = 2; uint64 _OFFSET = 3; }\n")
    store = MemoryStore()
    result = reg(store, proto)
    assert result.exit_code == 1, result.output
    assert ("field _OFFSET (number 3) of t.Row would fill column _offset, which blockagg "
            "fills with the message's Kafka coordinates") in result.stderr
    assert "rename the field" in result.stderr
    assert "has no column" not in result.stderr
    assert store.records == []
