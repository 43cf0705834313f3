"""The registry rules and ``ba-schema`` in-process (click's CliRunner), with an
in-memory store and a fake ``system.columns``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from blockagg.proto.exceptions import UnknownTable, UnknownVersion
from blockagg.proto.modes import Mode
from blockagg.proto.registry import MemoryStore, Registration, Registry, SchemaVersion
from blockagg.registration.cli import Context, cli
from blockagg.registration.register import register
from blockagg.rows.columns import Column

SAMPLE = Path(__file__).parents[1] / "proto" / "sample.proto"

COLUMNS = [Column("a", "Int32"), Column("b", "LowCardinality(String)"),
           Column("_topic", "String"), Column("_partition", "UInt32"),
           Column("_offset", "UInt64"), Column("inserted", "DateTime", "DEFAULT")]


def run(store: MemoryStore, *args: str, columns: list[Column] | None = None) -> Any:
    ctx = Context(False, lambda: store, lambda table: columns if columns is not None
                  else COLUMNS)
    return CliRunner().invoke(cli, list(args), obj=ctx)


def test_ids_and_versions(sample_fds: bytes) -> None:
    store = MemoryStore()
    r1, changed = register(store, "db.a", "blockagg.test.Inner", sample_fds,
                           compatibility=Mode.NONE)
    assert changed and (r1.table_id, r1.latest.version) == (1, 1)
    assert register(store, "db.a", "blockagg.test.Inner", sample_fds) == (r1, False)
    r2, _ = register(store, "db.b", "blockagg.test.Inner", sample_fds)
    r3, _ = register(store, "db.a", "blockagg.test.Sample", sample_fds)
    assert (r2.table_id, r3.table_id, r3.latest.version) == (2, 1, 2)
    registry = Registry.load(store)
    assert registry.tables() == {1: "db.a", 2: "db.b"}
    assert registry.descriptor("db.a")[0] == 2
    assert registry.descriptor("db.a", 1)[1].full_name == "blockagg.test.Inner"
    with pytest.raises(UnknownVersion):
        registry.descriptor("db.a", 7)
    with pytest.raises(UnknownTable):
        registry.get("db.zz")


def test_bad_records_are_ignored(sample_fds: bytes) -> None:
    store = MemoryStore()
    good, _ = register(store, "db.a", "blockagg.test.Inner", sample_fds)
    moved = Registration("db.a", 9, good.versions)
    thief = Registration("db.c", 1, good.versions)
    rewritten = Registration("db.a", 1, (SchemaVersion(1, "blockagg.test.Sample",
                                                       sample_fds),))
    store.records += [(b"db.a", moved.encode()), (b"db.c", thief.encode()),
                      (b"db.a", rewritten.encode()), (b"db.a", b"garbage"), (b"db.a", None)]
    registry = Registry.load(store)
    assert registry.get("db.a") == good
    assert "db.c" not in registry


def test_cli_register_list_show_check(tmp_path: Path) -> None:
    store = MemoryStore()
    result = run(store, "register", "db.t", "--proto", str(SAMPLE), "--message",
                 "blockagg.test.Inner", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "would register" in result.output and not store.records
    result = run(store, "register", "db.t", "--proto", str(SAMPLE), "--message",
                 "blockagg.test.Inner")
    assert result.exit_code == 0, result.output
    result = run(store, "--json", "list")
    assert json.loads(result.output)[0]["table_id"] == 1
    result = run(store, "show", "db.t")
    assert result.exit_code == 0 and "a" in result.output
    result = run(store, "--json", "check", "db.t")
    assert result.exit_code == 0 and json.loads(result.output)["ok"]


def test_cli_check_failure_lists_mismatches() -> None:
    store = MemoryStore()
    assert run(store, "register", "db.t", "--proto", str(SAMPLE), "--message",
               "blockagg.test.Inner").exit_code == 0
    altered = [Column("a", "UUID"), Column("c", "String")]
    result = run(store, "--json", "check", "db.t", columns=altered)
    assert result.exit_code == 1
    mismatches = json.loads(result.stdout)["mismatches"]
    assert any("column a UUID" in m for m in mismatches)
    assert any("column c" in m for m in mismatches)
    assert any("field b" in m for m in mismatches)
    # Against the columns recorded at registration: each change the job would refuse.
    assert any("column a is UUID, registered as Int32" in m for m in mismatches)
    gone = {m.split()[3] for m in mismatches if "is gone since registration" in m}
    assert gone == {"b", "_topic", "_partition", "_offset"}
    assert len(mismatches) == 8
    result = run(store, "register", "db.u", "--proto", str(SAMPLE), "--message",
                 "blockagg.test.Inner", columns=altered)
    assert result.exit_code == 1 and not any(k == b"db.u" for k, _ in store.records)


def test_cli_usage_errors(tmp_path: Path) -> None:
    store = MemoryStore()
    assert run(store, "show", "db.none").exit_code == 2
    assert run(store, "register", "db.t", "--message", "x").exit_code == 2
    result = run(store, "register", "db.t", "--proto", str(SAMPLE), "--message", "no.Such")
    assert result.exit_code == 2 and "no.Such" in result.stderr
    assert run(store, "frobnicate").exit_code == 2
    fds = tmp_path / "set.pb"
    fds.write_bytes(b"\xff\xff")
    assert run(store, "register", "db.t", "--descriptor-set", str(fds), "--message",
               "x.Y").exit_code == 2


def test_a_ca_file_that_is_not_there_is_a_usage_error_naming_the_option(tmp_path: Path) -> None:
    missing = tmp_path / "nope.pem"
    res = CliRunner().invoke(cli, ["--clickhouse-secure", "--clickhouse-ca-certs", str(missing),
                                   "list"])
    assert res.exit_code == 2
    assert "--clickhouse-ca-certs" in res.output and "is not a file" in res.output


def test_the_default_endpoint_follows_tls(monkeypatch: pytest.MonkeyPatch) -> None:
    from blockagg.cli_tls import default_endpoint

    monkeypatch.setenv("BLOCKAGG_CH_HOST", "ch")
    monkeypatch.setenv("BLOCKAGG_CH_PORTS", "19000,19100")
    monkeypatch.setenv("BLOCKAGG_CH_SECURE_PORTS", "19440,19540")
    assert default_endpoint(False) == "ch:19000"
    assert default_endpoint(True) == "ch:19440"
    monkeypatch.delenv("BLOCKAGG_CH_SECURE_PORTS")
    assert default_endpoint(True) == "ch:9440"
