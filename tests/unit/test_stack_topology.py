"""Unit tests of ``scripts/stack up --brokers 3 --shards 2`` (issue 27 item 1): the
single-broker, single-shard rendering is byte-identical to the one before the flags
existed (``golden/``, rendered by that version for ``BLOCKAGG_STACK_DIR=/stack``), a
cluster's nodes get their own ids, ports, folders and the production durability
settings, the second shard its own replicas and macros in one ``remote_servers``
cluster, and the topology is remembered by the stack dir."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from scripts import stack_lib
from scripts.stack_lib import StackConfig, StackError

GOLDEN = Path(__file__).resolve().parent / "golden"


def cfg_for(root: Path | str, **env: str) -> StackConfig:
    return StackConfig.from_env(
        {"BLOCKAGG_STACK_DIR": str(root), "BLOCKAGG_SPARK_VERSION": "4.0.0", **env})


def props(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines()
                if line and not line.startswith("#"))


def test_the_default_rendering_is_byte_identical_to_before_the_topology_flags() -> None:
    cfg = cfg_for("/stack")
    assert (cfg.brokers, cfg.shards) == (1, 1)
    assert stack_lib.render_kafka_properties(cfg) == (
        GOLDEN / "stack_server.properties").read_text()
    for r in cfg.replicas:
        assert stack_lib.render_clickhouse_config(cfg, r) == (
            GOLDEN / f"stack_clickhouse_{r.name}.xml").read_text()
    assert list(stack_lib.build_services(cfg)) == [
        "zookeeper", "clickhouse-r1", "clickhouse-r2", "kafka"]
    assert stack_lib.env_values(cfg, [])["BLOCKAGG_BOOTSTRAP_SERVERS"] == "127.0.0.1:19092"
    assert stack_lib.BROKERS_VAR not in stack_lib.env_values(cfg, [])


def test_three_brokers_each_with_own_id_ports_folder_and_all_voters(tmp_path: Path) -> None:
    cfg = cfg_for(tmp_path, BLOCKAGG_STACK_BROKERS="3")
    brokers = cfg.kafka_brokers
    assert [(b.node_id, b.port, b.controller_port, b.service) for b in brokers] == [
        (1, 19092, 19093, "kafka"), (2, 19094, 19095, "kafka-2"), (3, 19096, 19097, "kafka-3")]
    rendered = [props(stack_lib.render_kafka_properties(cfg, b)) for b in brokers]
    voters = "1@127.0.0.1:19093,2@127.0.0.1:19095,3@127.0.0.1:19097"
    for b, p in zip(brokers, rendered, strict=True):
        assert p["node.id"] == str(b.node_id)
        assert p["controller.quorum.voters"] == voters
        assert p["listeners"] == (f"PLAINTEXT://127.0.0.1:{b.port},"
                                  f"CONTROLLER://127.0.0.1:{b.controller_port}")
        assert p["advertised.listeners"] == f"PLAINTEXT://127.0.0.1:{b.port}"
        assert p["log.dirs"] == str(tmp_path.resolve() / b.service / "data")
        assert {k: p[k] for k in (
            "default.replication.factor", "min.insync.replicas",
            "offsets.topic.replication.factor", "transaction.state.log.replication.factor",
            "transaction.state.log.min.isr", "unclean.leader.election.enable")} == {
            "default.replication.factor": "3", "min.insync.replicas": "2",
            "offsets.topic.replication.factor": "3",
            "transaction.state.log.replication.factor": "3",
            "transaction.state.log.min.isr": "2", "unclean.leader.election.enable": "false"}
        assert p["offset.metadata.max.bytes"] == "4096"
    services = stack_lib.build_services(cfg)
    assert [n for n in services if n.startswith("kafka")] == ["kafka", "kafka-2", "kafka-3"]
    markers = [services[b.service].marker for b in brokers]
    assert not any(a in b for a in markers for b in markers if a != b), "markers overlap"
    env = stack_lib.env_values(cfg, [])
    assert env["BLOCKAGG_BOOTSTRAP_SERVERS"] == (
        "127.0.0.1:19092,127.0.0.1:19094,127.0.0.1:19096")
    assert env[stack_lib.BROKERS_VAR] == "3"
    tool = stack_lib.kafka_tool_command(cfg, "kafka-topics", ["--list"])
    assert tool[tool.index("--bootstrap-server") + 1] == env["BLOCKAGG_BOOTSTRAP_SERVERS"]


def test_a_second_shard_has_two_replicas_own_ports_and_macros_in_one_cluster(
        tmp_path: Path) -> None:
    cfg = cfg_for(tmp_path, BLOCKAGG_STACK_SHARDS="2")
    assert [(r.name, r.shard, r.tcp, r.http, r.interserver, r.tcp_secure)
            for r in cfg.replicas] == [
        ("r1", "01", 19000, 18123, 19009, 19440), ("r2", "01", 19100, 18223, 19109, 19540),
        ("r3", "02", 19200, 18323, 19209, 19640), ("r4", "02", 19300, 18423, 19309, 19740)]
    for r in cfg.replicas:
        root = ET.fromstring(stack_lib.render_clickhouse_config(cfg, r))
        assert root.findtext("macros/shard") == r.shard
        assert root.findtext("macros/replica") == r.name
        assert root.findtext("tcp_port") == str(r.tcp)
        assert root.findtext("zookeeper/node/port") == "12181"
        assert (root.findtext("path") or "").startswith(
            str(tmp_path.resolve() / f"clickhouse-{r.name}"))
        shards = root.findall("remote_servers/blockagg/shard")
        assert [[x.findtext("port") for x in s.findall("replica")] for s in shards] == [
            ["19000", "19100"], ["19200", "19300"]]
        assert all(s.findtext("internal_replication") == "true" for s in shards)
    assert [n for n in stack_lib.build_services(cfg) if n.startswith("clickhouse")] == [
        "clickhouse-r1", "clickhouse-r2", "clickhouse-r3", "clickhouse-r4"]
    env = stack_lib.env_values(cfg, [])
    assert env["BLOCKAGG_CH_PORTS"] == "19000,19100"
    assert env["BLOCKAGG_CH_SHARD2_PORTS"] == "19200,19300"


def test_the_topology_is_remembered_by_the_stack_dir_and_env_overrides_it(
        tmp_path: Path) -> None:
    (tmp_path / stack_lib.TOPOLOGY_FILE).write_text(stack_lib.render_topology(3, 2))
    cfg = cfg_for(tmp_path)
    assert (cfg.brokers, cfg.shards) == (3, 2)
    assert cfg_for(tmp_path, BLOCKAGG_STACK_BROKERS="1").brokers == 1
    assert cfg.with_topology(1, None).brokers == 1 and cfg.with_topology(None, None) == cfg


@pytest.mark.parametrize(("var", "value"), [("BLOCKAGG_STACK_BROKERS", "2"),
                                            ("BLOCKAGG_STACK_SHARDS", "x")])
def test_an_unsupported_count_is_refused_naming_it(tmp_path: Path, var: str,
                                                   value: str) -> None:
    with pytest.raises(StackError, match=f"{value!r}: the stack runs"):
        cfg_for(tmp_path, **{var: value})


def test_a_derived_port_colliding_with_another_is_refused(tmp_path: Path) -> None:
    cfg_for(tmp_path, BLOCKAGG_ZK_PORT="19094")  # one broker: 19094 is free
    with pytest.raises(StackError, match="port 19094 is used twice"):
        cfg_for(tmp_path, BLOCKAGG_ZK_PORT="19094", BLOCKAGG_STACK_BROKERS="3")
    with pytest.raises(StackError, match="port 19200 is used twice"):
        cfg_for(tmp_path, BLOCKAGG_ZK_PORT="19200", BLOCKAGG_STACK_SHARDS="2")


def test_up_refuses_to_change_the_broker_count_of_a_formatted_stack(tmp_path: Path) -> None:
    (tmp_path / "kafka" / "data").mkdir(parents=True)
    (tmp_path / "kafka" / "data" / "meta.properties").write_text("node.id=1\n")
    with pytest.raises(StackError, match=r"holds a Kafka of 1 broker.*down --wipe"):
        stack_lib.check_topology_change(cfg_for(tmp_path, BLOCKAGG_STACK_BROKERS="3"))
    stack_lib.check_topology_change(cfg_for(tmp_path))  # the same count: fine


def test_up_accepts_the_topology_flags_and_nothing_else() -> None:
    with pytest.raises(SystemExit):
        stack_lib.main(["up", "--brokers", "2"])
