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


def test_isolated_brokers_listen_advertise_and_vote_on_their_own_subnet_addresses(
        tmp_path: Path) -> None:
    """``--isolate-brokers``: each node on its own address of the stack's private subnet
    (broker and controller listeners, advertised listener, every node's voters), started
    in its own network namespace; without the flag nothing changes."""
    cfg = cfg_for(tmp_path, BLOCKAGG_STACK_BROKERS="3", BLOCKAGG_STACK_ISOLATE_BROKERS="1")
    net = cfg.broker_network
    assert (net.subnet, net.gateway, net.bridge) == (
        "10.77.148.0/24", "10.77.148.1", "bagg19092")  # 19092 mod 256 = 148
    hosts = [b.host for b in cfg.kafka_brokers]
    assert hosts == ["10.77.148.11", "10.77.148.12", "10.77.148.13"]
    voters = "1@10.77.148.11:19093,2@10.77.148.12:19095,3@10.77.148.13:19097"
    for b in cfg.kafka_brokers:
        p = props(stack_lib.render_kafka_properties(cfg, b))
        assert p["controller.quorum.voters"] == voters
        assert p["listeners"] == (f"PLAINTEXT://{b.host}:{b.port},"
                                  f"CONTROLLER://{b.host}:{b.controller_port}")
        assert p["advertised.listeners"] == f"PLAINTEXT://{b.host}:{b.port}"
    services = stack_lib.build_services(cfg)
    assert services["kafka-2"].command()[:4] == ["ip", "netns", "exec", "blockagg-19092-n2"]
    assert services["kafka-2"].host == "10.77.148.12"
    assert services["zookeeper"].host == "127.0.0.1"
    env = stack_lib.env_values(cfg, [])
    assert env["BLOCKAGG_BOOTSTRAP_SERVERS"] == ",".join(f"{h}:{p}" for h, p in zip(
        hosts, (19092, 19094, 19096), strict=True))
    assert env[stack_lib.ISOLATE_VAR] == "1"
    loopback = cfg_for(tmp_path, BLOCKAGG_STACK_BROKERS="3")
    assert not loopback.isolate_brokers
    assert {b.host for b in loopback.kafka_brokers} == {"127.0.0.1"}
    assert stack_lib.ISOLATE_VAR not in stack_lib.env_values(loopback, [])
    assert "ip" not in stack_lib.build_services(loopback)["kafka-2"].command()


def test_the_broker_network_names_fit_and_differ_per_stack_and_ci_shift() -> None:
    """Interface names fit Linux's 15 characters; every port shift of a multiple of 1000
    CI uses (0-9000) gets its own subnet, and each stack its own names."""
    nets = [stack_lib.BrokerNetwork.for_stack(19092 + shift, 3)
            for shift in range(0, 10_000, 1000)]
    assert len({n.subnet for n in nets}) == len(nets)
    for net in nets:
        names = [net.bridge, *(f(n) for n in (1, 2, 3) for f in (net.veth, net.peer))]
        assert all(len(name) <= 15 for name in names), names
        assert len(set(names)) == len(names)
    record = stack_lib.parse_network_record(nets[4].record())
    assert record == {"subnet": ["10.77.52.0/24"], "bridge": ["bagg23092"],
                      "namespace": [f"blockagg-23092-n{n}" for n in (1, 2, 3)],
                      "veth": [f"bagg23092n{n}" for n in (1, 2, 3)]}


def test_a_subnet_already_on_the_machine_is_found() -> None:
    assert stack_lib.subnet_clash("10.77.52.0/24", ["127.0.0.1/8", "192.0.2.2/24"]) is None
    assert stack_lib.subnet_clash("10.77.52.0/24", ["10.0.0.5/8"]) == "10.0.0.5/8"
    assert stack_lib.subnet_clash("10.77.52.0/24", ["10.77.52.1/24"]) == "10.77.52.1/24"


def test_isolation_is_refused_in_one_line_without_root_or_ip_or_three_brokers(
        tmp_path: Path) -> None:
    assert stack_lib.isolation_problem(euid=0, ip="/usr/sbin/ip") is None
    no_root = stack_lib.isolation_problem(euid=1000, ip="/usr/sbin/ip")
    assert no_root is not None and "needs root (uid 1000)" in no_root
    assert "\n" not in no_root
    no_ip = stack_lib.isolation_problem(euid=0, ip=None)
    assert no_ip is not None and "iproute2" in no_ip
    one = cfg_for(tmp_path, BLOCKAGG_STACK_ISOLATE_BROKERS="1")
    with pytest.raises(StackError, match="give --brokers 3"):
        stack_lib.check_isolation(one)
    with pytest.raises(StackError, match="Kafka node 1 is not isolated"):
        stack_lib.cut_broker(cfg_for(tmp_path, BLOCKAGG_STACK_BROKERS="3"), 1)
    with pytest.raises(StackError, match="BLOCKAGG_STACK_ISOLATE_BROKERS='yes'"):
        cfg_for(tmp_path, BLOCKAGG_STACK_ISOLATE_BROKERS="yes")


def test_the_isolation_is_remembered_only_when_set(tmp_path: Path) -> None:
    assert stack_lib.render_topology(3, 2) == (
        "# written by scripts/stack up\nbrokers=3\nshards=2\n")
    (tmp_path / stack_lib.TOPOLOGY_FILE).write_text(stack_lib.render_topology(3, 2, True))
    assert cfg_for(tmp_path).isolate_brokers
    assert not cfg_for(tmp_path, BLOCKAGG_STACK_ISOLATE_BROKERS="0").isolate_brokers
    assert not cfg_for(tmp_path).with_topology(None, None, False).isolate_brokers
    with pytest.raises(SystemExit):
        stack_lib.main(["cut"])  # a node id is required


def test_down_of_a_stack_that_never_isolated_touches_no_network(tmp_path: Path) -> None:
    assert stack_lib.teardown_broker_network(cfg_for(tmp_path)) == []


def test_a_leftover_bridge_is_taken_over_only_when_nothing_runs_in_it_and_no_stack_keeps_it(
        tmp_path: Path) -> None:
    """``up`` finds the bridge of its name but no record of it: a killed stack's leftover
    (the kernel outlives a re-cloned folder) is taken over; a running or a stopped stack's
    network elsewhere is refused, naming who has it and what to do."""
    mine, other = tmp_path / "mine", tmp_path / "other"
    verdict = stack_lib.leftover_verdict
    assert verdict(mine, "bagg23092", None, False, []) is None
    assert verdict(mine, "bagg23092", mine.resolve(), False, []) is None
    assert verdict(mine, "bagg23092", other, False, []) is None  # its folder is gone
    running = verdict(mine, "bagg23092", other, True, ["pid 17", "pid 4242"])
    assert running is not None and "pid 17, pid 4242" in running and str(other) in running
    unnamed = verdict(mine, "bagg23092", None, False, ["a Kafka node at 10.77.52.11:23092"])
    assert unnamed is not None and "another folder (a Kafka node at 10.77.52.11" in unnamed
    stopped = verdict(mine, "bagg23092", other, True, [])
    assert stopped is not None
    assert f"BLOCKAGG_STACK_DIR={other} scripts/stack down" in stopped


def test_the_owner_alias_names_the_folder_and_fits_the_kernel(tmp_path: Path) -> None:
    alias = stack_lib.owner_alias(tmp_path)
    assert alias is not None and stack_lib.alias_owner(alias) == tmp_path.resolve()
    assert stack_lib.alias_owner("") is None
    assert stack_lib.alias_owner("uplink to the rack") is None
    assert stack_lib.owner_alias(tmp_path / ("x" * 300)) is None
