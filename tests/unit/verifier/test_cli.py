"""``arv`` in-process with click's CliRunner: usage errors, connection errors, the report."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from blockagg.aggregator.core.metadata import BlockRange, Metadata, encode
from blockagg.verifier.cli import Report, cli
from blockagg.verifier.exceptions import HistoryReadError
from blockagg.verifier.history import CommitMerger, parse_settings
from blockagg.verifier.rules import Anomaly, Commit, Verifier

BASE = ["verify", "--bootstrap-servers", "127.0.0.1:1"]


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["verify", "--group", "g"], "Missing option '--bootstrap-servers'"),
    ([*BASE], "Missing option '--group'"),
    ([*BASE, "--group", "g", "-X", "novalue"], "not of the form key=value"),
    ([*BASE, "--group", "g", "-X", "enable.auto.commit=true"], "arv always uses"),
    ([*BASE, "--group", "g", "-X", "isolation.level=read_uncommitted"], "read_committed"),
    ([*BASE, "--group", "g", "-X", "group.id=mine"], "set by arv itself"),
    ([*BASE, "--group", "g", "--metrics-port", "9100"], "need --follow"),
    ([*BASE, "--group", "g", "--from", "3:10"], "PARTITION=OFFSET"),
    ([*BASE, "--group", "g", "--from", "3=-1"], "negative"),
    ([*BASE, "--group", "g", "--metrics-port", "99999", "--follow"], "99999"),
])
def test_usage_errors_exit_2(args: list[str], message: str) -> None:
    code, stdout, stderr = invoke(*args)
    assert code == 2
    assert message in stderr
    assert stdout == ""


def test_metrics_port_without_a_value_is_not_the_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 26: ``arv verify --follow --metrics-port`` beside the job on one host must
    not take the job's default metrics port (``[metrics] port`` = 9464)."""
    from blockagg.config import MetricsConfig
    from blockagg.verifier import cli as cli_module

    ports: list[object] = []

    def fake(*args: object) -> int:
        ports.append(args[6])
        return 0

    monkeypatch.setattr(cli_module, "_verify", fake)
    assert invoke(*BASE, "--group", "g", "--follow", "--metrics-port")[0] == 0
    assert invoke(*BASE, "--group", "g", "--metrics-port", "--follow")[0] == 0
    assert invoke(*BASE, "--group", "g", "--follow", "--metrics-port", "9100")[0] == 0
    assert invoke(*BASE, "--group", "g", "--follow")[0] == 0
    assert ports == [9465, 9465, 9100, None]
    assert MetricsConfig().port != cli_module.DEFAULT_METRICS_PORT


def test_unknown_kafka_setting_exits_2_naming_it() -> None:
    code, _, stderr = invoke(*BASE, "--group", "g", "-X", "no.such.setting=1")
    assert code == 2
    assert "no.such.setting" in stderr and stderr.startswith("arv: error:")


def test_unreachable_cluster_exits_2() -> None:
    code, stdout, stderr = invoke(*BASE, "--group", "g", "--timeout", "1")
    assert code == 2
    assert "cannot reach the Kafka cluster '127.0.0.1:1'" in stderr
    assert "--bootstrap-servers" in stderr
    assert stdout == ""


def test_reserved_settings_may_be_repeated_unchanged() -> None:
    assert parse_settings(["isolation.level=read_committed", "client.id=arv1"]) == {
        "isolation.level": "read_committed", "client.id": "arv1"}
    with pytest.raises(HistoryReadError, match=r"auto\.offset\.reset=latest"):
        parse_settings(["auto.offset.reset=latest"])


def test_help_lists_exit_codes() -> None:
    code, stdout, _ = invoke("verify", "--help")
    assert code == 0
    assert "0 clean, 1 anomalies found, 2 could not run" in stdout


def _gap_anomalies() -> list[Anomaly]:
    verifier = Verifier()
    first = Metadata(1, 0, 100, 200, 200)
    second = Metadata(1, 1, 210, 300, 210, (BlockRange(3, 210, 250),))
    verifier.observe(Commit("g", "t", 4, 200, encode(first), 1_700_000_000_000))
    return verifier.observe(Commit("g", "t", 4, 210, encode(second), 1_700_000_001_000))


def test_report_json_lines() -> None:
    out = io.StringIO()
    report = Report(out, as_json=True, strict=False)
    for anomaly in _gap_anomalies():
        report.add(anomaly)
    [line] = out.getvalue().splitlines()
    record = json.loads(line)
    assert record["kind"] == "gap" and record["severity"] == "anomaly"
    assert record["previous"]["resume"] == 200
    assert record["current"]["blocks"] == [[3, 210, 250]]
    assert record["commit_timestamp_ms"] == 1_700_000_001_000
    assert report.anomalies == 1


def test_report_human_table() -> None:
    out = io.StringIO()
    report = Report(out, as_json=False, strict=False)
    for anomaly in _gap_anomalies():
        report.add(anomaly)
    header, row = out.getvalue().splitlines()
    assert header.startswith("PARTITION\tCOMMIT TIME\tANOMALY\tPREVIOUS (M)\tCURRENT (M')")
    cells = row.split("\t")
    assert cells[:3] == ["g/t[4]", "2023-11-14T22:13:21.000+00:00", "gap"]
    assert cells[3] == "run=1 batch=0 [100,200) resume=200 blocks=0"
    assert cells[4] == "run=1 batch=1 [210,300) resume=210 blocks=1"


def test_merger_keeps_partition_order_and_interleaves_by_time() -> None:
    merger: CommitMerger[str] = CommitMerger()
    merger.set_live(0, True)
    merger.set_live(1, True)
    merger.push(0, 50, "p0-a")
    merger.push(0, 10, "p0-b")
    assert list(merger.pop_ready()) == []
    merger.push(1, 20, "p1-a")
    assert list(merger.pop_ready()) == ["p1-a"]
    merger.push(1, 60, "p1-b")
    assert list(merger.pop_ready()) == ["p0-a", "p0-b"]
    merger.set_live(1, False)
    assert list(merger.pop_ready()) == []
    merger.set_live(0, False)
    assert list(merger.pop_ready()) == ["p1-b"]
    assert len(merger) == 0


def test_audit_refuses_a_ca_file_that_is_not_there(tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, [
        "audit", "--bootstrap-servers", "k:9092", "--group", "g", "--clickhouse", "ch:9440",
        "--clickhouse-secure", "--clickhouse-ca-certs", str(tmp_path / "nope.pem")])
    assert res.exit_code == 2
    assert "--clickhouse-ca-certs" in res.output and "is not a file" in res.output
