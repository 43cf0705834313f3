"""The registry on a real compacted topic and ``ba-schema`` against real ClickHouse."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from proto.cli import cli
from proto.registry import KafkaStore, Registry
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
        "column c String has no field in blockagg.test.Inner and no DEFAULT"]
    bad = runner.invoke(cli, ["--clickhouse", f"{host}:1", "--bootstrap-servers",
                              stack_env["BLOCKAGG_BOOTSTRAP_SERVERS"], "--topic", topic,
                              "check", table])
    assert bad.exit_code == 2
