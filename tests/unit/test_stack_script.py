"""Unit tests for the pure parts of ``scripts/stack`` (``scripts/stack_lib.py``): ports and their
environment overrides, generated configs, the Kafka Metadata probe's wire format, jar filtering,
``env`` output, and the docker-compose file parsing."""

from __future__ import annotations

import shlex
import socket
import ssl
import struct
import subprocess
import sys
import threading
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from scripts import stack_lib
from scripts.stack_lib import Ports, StackConfig, StackError

REPO_ROOT = Path(__file__).resolve().parents[2]


def cfg_for(tmp_path: Path, **env: str) -> StackConfig:
    return StackConfig.from_env(
        {"BLOCKAGG_STACK_DIR": str(tmp_path), "BLOCKAGG_SPARK_VERSION": "4.0.0", **env}
    )


def test_default_ports_are_the_documented_ones() -> None:
    p = Ports.from_env({})
    assert (p.kafka, p.kafka_controller, p.zk) == (19092, 19093, 12181)
    assert (p.ch1_tcp, p.ch1_http, p.ch1_interserver) == (19000, 18123, 19009)
    assert (p.ch2_tcp, p.ch2_http, p.ch2_interserver) == (19100, 18223, 19109)
    assert (p.ch1_tcp_secure, p.ch2_tcp_secure) == (19440, 19540)


def test_each_port_is_overridable_by_its_env_var() -> None:
    p = Ports.from_env({"BLOCKAGG_KAFKA_PORT": "29092", "BLOCKAGG_CH2_TCP_PORT": "29100"})
    assert p.kafka == 29092 and p.ch2_tcp == 29100 and p.zk == 12181


@pytest.mark.parametrize("bad", ["abc", "0", "70000", "-1"])
def test_a_port_that_is_not_a_port_is_refused_naming_the_variable(bad: str) -> None:
    with pytest.raises(StackError, match="BLOCKAGG_ZK_PORT"):
        Ports.from_env({"BLOCKAGG_ZK_PORT": bad})


def test_two_services_on_one_port_are_refused() -> None:
    with pytest.raises(StackError, match="used twice"):
        Ports.from_env({"BLOCKAGG_ZK_PORT": "19092"})


def test_stack_dir_and_versions_come_from_env(tmp_path: Path) -> None:
    cfg = cfg_for(tmp_path, BLOCKAGG_KAFKA_VERSION="4.1.0")
    assert cfg.root == tmp_path.resolve()
    assert cfg.kafka_version == "4.1.0"
    assert cfg.spark_jars_dir == tmp_path.resolve() / "spark-jars" / "4.0.0"


def test_kafka_properties_kraft_combined_on_loopback_with_user_defaults(tmp_path: Path) -> None:
    props = dict(
        line.split("=", 1)
        for line in stack_lib.render_kafka_properties(cfg_for(tmp_path)).splitlines()
        if line and not line.startswith("#")
    )
    assert props["process.roles"] == "broker,controller"
    assert props["node.id"] == "1"
    assert props["controller.quorum.voters"] == "1@127.0.0.1:19093"
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:19092,CONTROLLER://127.0.0.1:19093"
    assert props["offset.metadata.max.bytes"] == "4096"
    assert props["offsets.topic.replication.factor"] == "1"
    assert props["transaction.state.log.min.isr"] == "1"
    assert props["group.initial.rebalance.delay.ms"] == "0"
    assert props["log.dirs"].startswith(str(tmp_path.resolve()))


def test_clickhouse_configs_are_xml_with_own_ports_dirs_macros_and_shared_cluster(
    tmp_path: Path,
) -> None:
    cfg = cfg_for(tmp_path)
    roots = [ET.fromstring(stack_lib.render_clickhouse_config(cfg, r)) for r in cfg.replicas]
    for root, replica in zip(roots, ("r1", "r2"), strict=True):
        assert root.findtext("listen_host") == "127.0.0.1"
        assert root.findtext("macros/shard") == "01"
        assert root.findtext("macros/replica") == replica
        assert root.findtext("zookeeper/node/port") == "12181"
        assert (root.findtext("path") or "").startswith(str(tmp_path.resolve()))
        cluster = root.find("remote_servers/blockagg/shard")
        assert cluster is not None
        assert [r.findtext("port") for r in cluster.findall("replica")] == ["19000", "19100"]
    assert {r.findtext("tcp_port") for r in roots} == {"19000", "19100"}
    assert [r.findtext("tcp_port_secure") for r in roots] == ["19440", "19540"]
    tls = cfg.tls_dir
    for root in roots:
        assert root.findtext("openSSL/server/certificateFile") == str(tls / "server.pem")
        assert root.findtext("openSSL/server/privateKeyFile") == str(tls / "server.key")
    assert roots[0].findtext("path") != roots[1].findtext("path")
    ET.fromstring(stack_lib.CLICKHOUSE_USERS)


def test_tls_certificates_verify_for_loopback_and_are_made_once(tmp_path: Path) -> None:
    folder = tmp_path / "tls"
    stack_lib.make_tls_certificates(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["ca.pem", "server.key", "server.pem"]
    assert not list(folder.glob("ca.key")), "the CA's key is not kept"
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(folder / "server.pem", folder / "server.key")
    client = ssl.create_default_context(cafile=str(folder / "ca.pem"))
    for name in ("127.0.0.1", "localhost"):
        a, b = socket.socketpair()
        with a, b:
            tls_server = server.wrap_socket(a, server_side=True, do_handshake_on_connect=False)
            tls_client = client.wrap_socket(b, server_hostname=name,
                                            do_handshake_on_connect=False)
            _handshake(tls_server, tls_client)
            assert tls_client.getpeercert() is not None
    before = (folder / "server.pem").read_bytes()
    stack_lib.make_tls_certificates(folder)
    assert (folder / "server.pem").read_bytes() == before


def _handshake(*sides: ssl.SSLSocket) -> None:
    """Both handshakes on non-blocking socket pairs, stepped in turn until both end."""
    for side in sides:
        side.setblocking(False)
    pending = list(sides)
    for _ in range(1000):
        for side in list(pending):
            try:
                side.do_handshake()
                pending.remove(side)
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                pass
        if not pending:
            return
    raise AssertionError("TLS handshake did not complete")


def test_zoo_cfg_listens_on_loopback_and_allows_srvr(tmp_path: Path) -> None:
    text = stack_lib.render_zoo_cfg(cfg_for(tmp_path, BLOCKAGG_ZK_PORT="22181"))
    assert "clientPort=22181" in text and "clientPortAddress=127.0.0.1" in text
    assert "srvr" in text


def test_pom_lists_the_dependencies() -> None:
    pom = ET.fromstring(stack_lib.render_pom("x", stack_lib.kafka_deps("4.3.1")))
    ns = {"m": "http://maven.apache.org/POM/4.0.0"}
    arts = [d.findtext("m:artifactId", namespaces=ns) for d in pom.iterfind(".//m:dependency", ns)]
    assert arts[0] == "kafka_2.13" and "log4j-core" in arts


@pytest.mark.parametrize(
    ("tool", "main_class"),
    [
        ("kafka-topics", "org.apache.kafka.tools.TopicCommand"),
        ("kafka-consumer-groups", "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand"),
        ("kafka-transactions", "org.apache.kafka.tools.TransactionsCommand"),
        ("kafka-console-consumer", "org.apache.kafka.tools.consumer.ConsoleConsumer"),
        ("kafka-metadata-quorum", "org.apache.kafka.tools.MetadataQuorumCommand"),
        ("kafka-reassign-partitions",
         "org.apache.kafka.tools.reassign.ReassignPartitionsCommand"),
        ("kafka-leader-election", "org.apache.kafka.tools.LeaderElectionCommand"),
    ],
)
def test_kafka_tools_run_their_main_class_on_the_tools_jars_against_the_stack(
        tmp_path: Path, tool: str, main_class: str) -> None:
    """Issue 26: the runbooks' kafka-topics.sh & co. for the local stack, which ships
    no .sh scripts: Kafka 4.x's main classes on .stack/kafka-tools/<v>/ (kept apart
    from the broker's classpath), the stack's broker unless the caller names one."""
    cfg = cfg_for(tmp_path, BLOCKAGG_KAFKA_PORT="29092")
    cmd = stack_lib.kafka_tool_command(cfg, tool, ["--list"])
    at = cmd.index(main_class)
    assert cmd[at + 1:] == ["--bootstrap-server", "127.0.0.1:29092", "--list"]
    assert cmd[cmd.index("-cp") + 1].startswith(f"{tmp_path}/kafka-tools/4.3.1/*")
    own = ["--bootstrap-server", "broker:9092", "--describe"]
    assert stack_lib.kafka_tool_command(cfg, tool, own)[at + 1:] == own
    glued = ["--bootstrap-server=broker:9092", "list"]
    assert stack_lib.kafka_tool_command(cfg, tool, glued)[at + 1:] == glued
    pom = ET.fromstring(stack_lib.render_pom("t", stack_lib.kafka_tools_deps("4.3.1")))
    assert "<artifactId>kafka-tools</artifactId>" in ET.tostring(pom, encoding="unicode").replace(
        "ns0:", "")


def test_a_kafka_tool_is_dispatched_with_its_arguments_untouched(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, list[str]]] = []
    monkeypatch.setenv("BLOCKAGG_STACK_DIR", str(tmp_path))

    def fake(cfg: StackConfig, tool: str, args: list[str]) -> int:
        seen.append((tool, list(args)))
        return 0

    monkeypatch.setattr(stack_lib, "cmd_kafka_tool", fake)
    assert stack_lib.main(["kafka-topics", "--create", "--topic", "t", "--partitions", "4"]) == 0
    assert stack_lib.main(["kafka-transactions", "list"]) == 0
    assert seen == [("kafka-topics", ["--create", "--topic", "t", "--partitions", "4"]),
                    ("kafka-transactions", ["list"])]


@pytest.mark.parametrize(
    ("jar", "artifact"),
    [
        ("kafka-clients-3.9.0.jar", "kafka-clients"),
        ("spark-sql-kafka-0-10_2.13-4.0.0.jar", "spark-sql-kafka-0-10_2.13"),
        ("scala-library-2.13.16.jar", "scala-library"),
        ("zstd-jni-1.5.6-9.jar", "zstd-jni"),
        ("jackson-core-2.21.2.jar", "jackson-core"),
        ("netty-common-4.1.48.Final.jar", "netty-common"),
        ("jsr305-3.0.0.jar", "jsr305"),
        ("noversion.jar", "noversion"),
    ],
)
def test_jar_artifact_strips_the_version(jar: str, artifact: str) -> None:
    assert stack_lib.jar_artifact(jar) == artifact


def test_jars_pyspark_already_ships_are_dropped_whatever_their_version() -> None:
    resolved = [
        "spark-sql-kafka-0-10_2.13-4.0.0.jar",
        "kafka-clients-3.9.0.jar",
        "commons-pool2-2.12.0.jar",
        "slf4j-api-1.7.36.jar",
        "scala-library-2.13.15.jar",
        "commons-pool-1.5.4.jar",
    ]
    shipped = ["slf4j-api-2.0.16.jar", "scala-library-2.13.16.jar", "commons-pool-1.5.4.jar"]
    assert stack_lib.jars_not_shipped(resolved, shipped) == [
        "commons-pool2-2.12.0.jar",
        "kafka-clients-3.9.0.jar",
        "spark-sql-kafka-0-10_2.13-4.0.0.jar",
    ]


def test_env_lines_are_shell_exports_that_round_trip(tmp_path: Path) -> None:
    cfg = cfg_for(tmp_path, BLOCKAGG_CH1_TCP_PORT="29000")
    jars = [tmp_path / "a b.jar", tmp_path / "c.jar"]
    parsed = {}
    for line in stack_lib.env_lines(cfg, jars):
        word, assignment = shlex.split(line)
        assert word == "export"
        key, value = assignment.split("=", 1)
        parsed[key] = value
    assert parsed["BLOCKAGG_BOOTSTRAP_SERVERS"] == "127.0.0.1:19092"
    assert parsed["BLOCKAGG_CH_PORTS"] == "29000,19100"
    assert parsed["BLOCKAGG_CH_HTTP_PORTS"] == "18123,18223"
    assert parsed["BLOCKAGG_ZK"] == "127.0.0.1:12181"
    assert parsed["BLOCKAGG_CH_SECURE_PORTS"] == "19440,19540"
    assert parsed["BLOCKAGG_CH_CA_CERTS"] == str(cfg.tls_dir / "ca.pem")
    assert parsed["BLOCKAGG_SPARK_JARS"].split(",") == [str(j) for j in jars]


def test_kafka_cluster_id_is_22_url_safe_chars() -> None:
    cid = stack_lib.kafka_cluster_id()
    assert len(cid) == 22 and set(cid) <= set(
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    )


def _kstr(s: str) -> bytes:
    return struct.pack(">h", len(s)) + s.encode()


def _metadata_response(correlation_id: int, brokers: list[tuple[int, str, int]]) -> bytes:
    out = struct.pack(">ii", correlation_id, 0) + struct.pack(">i", len(brokers))
    for node, host, port in brokers:
        out += struct.pack(">i", node) + _kstr(host) + struct.pack(">i", port)
        out += struct.pack(">h", -1)  # rack: null
    out += struct.pack(">h", -1) + struct.pack(">i", 1) + struct.pack(">i", 0)  # rest
    return out


def test_kafka_metadata_request_is_v4_for_all_topics() -> None:
    req = stack_lib.kafka_metadata_request(99, "cid")
    (size,) = struct.unpack_from(">i", req)
    assert size == len(req) - 4
    api_key, version, corr = struct.unpack_from(">hhi", req, 4)
    assert (api_key, version, corr) == (3, 4, 99)
    assert req[12:17] == _kstr("cid")
    assert struct.unpack_from(">i?", req, 17) == (-1, False)


def test_kafka_metadata_response_brokers_are_parsed() -> None:
    payload = _metadata_response(5, [(1, "127.0.0.1", 19092), (2, "h", 1)])
    assert stack_lib.parse_kafka_metadata_brokers(payload, 5) == [
        (1, "127.0.0.1", 19092),
        (2, "h", 1),
    ]
    with pytest.raises(ValueError, match="correlation"):
        stack_lib.parse_kafka_metadata_brokers(payload, 6)


def _serve_once(respond: bytes) -> int:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def run() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(respond)
        srv.close()

    threading.Thread(target=run, daemon=True).start()
    port: int = srv.getsockname()[1]
    return port


def test_probe_kafka_against_a_fake_broker() -> None:
    payload = _metadata_response(7, [(1, "127.0.0.1", 1)])
    port = _serve_once(struct.pack(">i", len(payload)) + payload)
    assert stack_lib.probe_kafka(port)
    empty = _metadata_response(7, [])
    port = _serve_once(struct.pack(">i", len(empty)) + empty)
    assert not stack_lib.probe_kafka(port)


def test_a_cluster_is_up_only_once_every_node_lists_every_node() -> None:
    """Right after a start a node may answer Metadata naming only itself (the others not
    unfenced yet): ``scripts/stack up`` waits for each node to list all of them."""
    nodes = [stack_lib.Broker(i, 9090 + i, 9190 + i) for i in (1, 2, 3)]
    views = {"kafka": [3], "kafka-2": [3], "kafka-3": [1, 1, 2, 3]}
    asked: list[str] = []

    def seen(b: stack_lib.Broker) -> int | None:
        asked.append(b.service)
        left = views[b.service]
        return left.pop(0) if len(left) > 1 else left[0]

    stack_lib.wait_cluster_formed(nodes, timeout=10, seen=seen)
    assert asked.count("kafka-3") == 4
    with pytest.raises(stack_lib.StackError,
                       match=r"did not form within 0s: kafka lists 3, kafka-2 lists "
                             r"nothing, kafka-3 lists 1 of 3 brokers"):
        stack_lib.wait_cluster_formed(nodes, timeout=0, seen=lambda b: {
            "kafka": 3, "kafka-2": None, "kafka-3": 1}[b.service])


def test_probe_zookeeper_reads_srvr_mode() -> None:
    port = _serve_once(b"Zookeeper version: 3.8.0\nMode: standalone\n")
    assert stack_lib.probe_zookeeper(port)
    port = _serve_once(b"srvr is not executed because it is not in the whitelist.\n")
    assert not stack_lib.probe_zookeeper(port)


def test_probes_are_false_when_nothing_listens() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    assert not stack_lib.probe_kafka(port, timeout=0.5)
    assert not stack_lib.probe_zookeeper(port, timeout=0.5)
    assert not stack_lib.probe_clickhouse(port, timeout=0.5)


def test_a_recycled_pid_is_not_taken_for_ours(tmp_path: Path) -> None:
    import os

    assert stack_lib.pid_alive(os.getpid(), "python") or stack_lib.pid_alive(os.getpid(), "")
    assert not stack_lib.pid_alive(os.getpid(), "/no/such/config.xml")
    (tmp_path / "pid").write_text("not a pid")
    assert stack_lib.read_pid(tmp_path / "pid") is None


def test_status_of_an_empty_stack_dir_is_down_and_nonzero(tmp_path: Path) -> None:
    env = {
        "BLOCKAGG_STACK_DIR": str(tmp_path),
        "BLOCKAGG_SPARK_VERSION": "4.0.0",
        # ports nothing listens on, so a running real stack does not count
        **{var: str(41000 + i) for i, (var, _) in enumerate(stack_lib.PORT_DEFAULTS.values())},
        "PATH": "/usr/bin:/bin",
    }
    res = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "stack"), "status"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 1
    for name in stack_lib.SERVICES:
        assert any(line.startswith(name) and " down " in line for line in res.stdout.splitlines())
    assert "127.0.0.1:41000" in res.stdout


def test_down_without_anything_running_is_a_no_op(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "stack"), "down", "--wipe"],
        env={"BLOCKAGG_STACK_DIR": str(tmp_path), "BLOCKAGG_SPARK_VERSION": "4.0.0"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stderr


def test_docker_compose_file_parses_and_has_the_topology() -> None:
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
    services = doc["services"]
    assert {"kafka", "zookeeper", "clickhouse-r1", "clickhouse-r2"} <= set(services)
    for name in ("clickhouse-r1", "clickhouse-r2"):
        for vol in services[name].get("volumes", []):
            src = str(vol).split(":", 1)[0]
            if src.startswith("./"):
                assert (REPO_ROOT / src).exists(), f"{name} mounts missing {src}"
    env = services["kafka"]["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"


def test_docker_clickhouse_configs_are_xml_with_macros_per_replica() -> None:
    for replica in ("r1", "r2"):
        root = ET.parse(REPO_ROOT / "docker" / "clickhouse" / f"{replica}.xml").getroot()
        assert root.findtext("macros/replica") == replica
        assert root.findtext("macros/shard") == "01"
    cluster = ET.parse(REPO_ROOT / "docker" / "clickhouse" / "cluster.xml").getroot()
    hosts = [r.findtext("host") for r in cluster.iterfind("remote_servers/blockagg/shard/replica")]
    assert hosts == ["clickhouse-r1", "clickhouse-r2"]


def test_docker_compose_config_validates_when_a_compose_client_is_installed() -> None:
    import shutil

    compose = shutil.which("docker-compose")
    if compose is None:
        pytest.skip("docker-compose (Debian package) not installed")
    res = subprocess.run(
        [compose, "-f", str(REPO_ROOT / "docker-compose.yml"), "config", "-q"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stderr
