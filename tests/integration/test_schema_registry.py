"""The registry on a real compacted topic and ``ba-schema`` against real ClickHouse."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from blockagg.aggregator.kafka.log_store import KafkaStore
from blockagg.proto.registry import Registry
from blockagg.registration.cli import cli
from tests.integration.conftest import replicated_engine

pytestmark = pytest.mark.integration

SAMPLE = Path(__file__).resolve().parents[1] / "unit" / "proto" / "sample.proto"


def test_ba_schema_end_to_end(stack_env: dict[str, str], new_topic: Callable[..., str],
                              ch_replicas: list[Any], ch_database: str) -> None:
    topic = new_topic(prefix="schemas", config={"cleanup.policy": "compact"})
    table = f"{ch_database}.inner"
    ch_replicas[0].execute(f"CREATE TABLE {table} (a Int32, b String, _offset UInt64) "
                           f"ENGINE = {replicated_engine(ch_database, 'inner')}")
    host = stack_env["BLOCKAGG_CH_HOST"]
    port = stack_env["BLOCKAGG_CH_PORTS"].split(",")[0]
    base = ["--bootstrap-servers", stack_env["BLOCKAGG_BOOTSTRAP_SERVERS"], "--topic", topic,
            "--clickhouse", f"{host}:{port}"]
    runner = CliRunner()

    def run(*args: str) -> Any:
        return runner.invoke(cli, [*base, *args], catch_exceptions=False)

    result = run("register", table, "--proto", str(SAMPLE), "--message",
                 "blockagg.test.Inner", "--dry-run")
    assert result.exit_code == 0, result.output
    assert Registry.load(KafkaStore({"bootstrap.servers": stack_env[
        "BLOCKAGG_BOOTSTRAP_SERVERS"]}, topic)).registrations() == []
    result = run("--json", "register", table, "--proto", str(SAMPLE), "--message",
                 "blockagg.test.Inner")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["table_id"] == 1
    other = run("--json", "register", f"{ch_database}.other", "--proto", str(SAMPLE),
                "--message", "blockagg.test.Inner", "--no-check")
    assert json.loads(other.stdout)["table_id"] == 2
    listed = json.loads(run("--json", "list").stdout)
    assert [r["table_id"] for r in listed] == [1, 2]
    assert run("check", table).exit_code == 0
    ch_replicas[0].execute(f"ALTER TABLE {table} ADD COLUMN c String")
    result = run("--json", "check", table)
    assert result.exit_code == 1
    assert json.loads(result.stdout)["mismatches"] == [
        "version 1: column c String has no field in blockagg.test.Inner and no DEFAULT"]
    bad = runner.invoke(cli, ["--clickhouse", f"{host}:1", "--bootstrap-servers",
                              stack_env["BLOCKAGG_BOOTSTRAP_SERVERS"], "--topic", topic,
                              "check", table])
    assert bad.exit_code == 2


def test_compatibility_on_the_real_registry_topic(
        stack_env: dict[str, str], new_topic: Callable[..., str], ch_replicas: list[Any],
        ch_database: str, tmp_path: Path) -> None:
    """v1 registered; a v2 that swaps field numbers is refused with nothing written to
    the topic; a v2 that adds a field (its column added with a DEFAULT) is registered;
    ``check`` then passes for both versions."""
    topic = new_topic(prefix="schemas", config={"cleanup.policy": "compact"})
    store = KafkaStore({"bootstrap.servers": stack_env["BLOCKAGG_BOOTSTRAP_SERVERS"]}, topic)
    table = f"{ch_database}.rows"
    ch_replicas[0].execute(f"CREATE TABLE {table} (a Int32, b Int32, _offset UInt64) "
                           f"ENGINE = {replicated_engine(ch_database, 'rows')}")
    host = stack_env["BLOCKAGG_CH_HOST"]
    port = stack_env["BLOCKAGG_CH_PORTS"].split(",")[0]
    base = ["--bootstrap-servers", stack_env["BLOCKAGG_BOOTSTRAP_SERVERS"], "--topic", topic,
            "--clickhouse", f"{host}:{port}"]
    runner = CliRunner()
    protos = {}
    for name, body in {"v1": "int32 a = 1; int32 b = 2;",
                       "swapped": "int32 b = 1; int32 a = 2;",
                       "added": "int32 a = 1; int32 b = 2; string c = 3;"}.items():
        path = tmp_path / f"{name}.proto"
        path.write_text(f'syntax = "proto3";\npackage it;\nmessage Row {{ {body} }}\n')
        protos[name] = path

    def register_(name: str) -> Any:
        return runner.invoke(cli, [*base, "register", table, "--proto", str(protos[name]),
                                   "--message", "it.Row"], catch_exceptions=False)

    first = register_("v1")
    assert first.exit_code == 0, first.output
    assert len(store.read()) == 1

    refused = register_("swapped")
    assert refused.exit_code == 1, refused.output
    assert "not BACKWARD compatible" in refused.stderr
    assert "FIELD_NAME_CHANGED at it.Row.b (number 1)" in refused.stderr
    assert "FIELD_NAME_CHANGED at it.Row.a (number 2)" in refused.stderr
    assert len(store.read()) == 1

    ch_replicas[0].execute(f"ALTER TABLE {table} ADD COLUMN c String DEFAULT 'none'")
    added = register_("added")
    assert added.exit_code == 0, added.output
    records = store.read()
    assert len(records) == 2
    latest = Registry.from_records(records).get(table)
    assert [v.version for v in latest.versions] == [1, 2]
    assert latest.latest.forced_incompatibilities == () and latest.mode.value == "BACKWARD"

    check = runner.invoke(cli, [*base, "--json", "check", table], catch_exceptions=False)
    assert check.exit_code == 0, check.output
    assert json.loads(check.stdout)["versions"] == {"1": [], "2": []}
