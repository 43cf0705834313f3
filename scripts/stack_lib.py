"""The local stack behind ``scripts/stack``: Kafka (KRaft), ZooKeeper, two ClickHouse replicas
(``up --brokers 3``: a three-node Kafka cluster; ``--shards 2``: a second shard of two replicas).

Everything lives under the repository's ignored ``.stack/`` folder (or ``$BLOCKAGG_STACK_DIR``):
generated configs, data dirs, logs, pid files, the Maven local repository and the resolved jars.
Only Debian packages (``clickhouse-server``, ``clickhouse-client``, ``zookeeper``, a JDK, Maven)
live outside it. Every service listens on 127.0.0.1 only. Standard library only, so the script runs
before the project is installed; the pure parts (config rendering, port/env handling, the Kafka
wire probe, jar filtering) are unit-tested in ``tests/unit/test_stack_script*.py``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import ipaddress
import os
import re
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
CLUSTER_NAME = "blockagg"
SHARD = "01"

# Apache Kafka: newest 4.x whose full dependency set is on Maven Central as seen from here
# (4.4.0's kafka-tools-api was missing when this was written). Override: BLOCKAGG_KAFKA_VERSION.
DEFAULT_KAFKA_VERSION = "4.3.1"
LOG4J_VERSION = "2.24.3"
DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.6.1"
MAVEN_CENTRAL = "https://repo.maven.apache.org/maven2"

APT_PACKAGES = (
    "clickhouse-server",
    "clickhouse-client",
    "zookeeper",
    "openjdk-17-jre-headless",
    "maven",
)
CLICKHOUSE_SERVER = "/usr/sbin/clickhouse-server"
ZOOKEEPER_JAR = "/usr/share/java/zookeeper.jar"
SLF4J_SIMPLE_JAR = "/usr/share/java/slf4j-simple.jar"

# name -> (environment variable, default)
PORT_DEFAULTS: dict[str, tuple[str, int]] = {
    "kafka": ("BLOCKAGG_KAFKA_PORT", 19092),
    "kafka_controller": ("BLOCKAGG_KAFKA_CONTROLLER_PORT", 19093),
    "zk": ("BLOCKAGG_ZK_PORT", 12181),
    "ch1_tcp": ("BLOCKAGG_CH1_TCP_PORT", 19000),
    "ch1_http": ("BLOCKAGG_CH1_HTTP_PORT", 18123),
    "ch1_interserver": ("BLOCKAGG_CH1_INTERSERVER_PORT", 19009),
    "ch2_tcp": ("BLOCKAGG_CH2_TCP_PORT", 19100),
    "ch2_http": ("BLOCKAGG_CH2_HTTP_PORT", 18223),
    "ch2_interserver": ("BLOCKAGG_CH2_INTERSERVER_PORT", 19109),
    "ch1_tcp_secure": ("BLOCKAGG_CH1_TCP_SECURE_PORT", 19440),
    "ch2_tcp_secure": ("BLOCKAGG_CH2_TCP_SECURE_PORT", 19540),
}

SERVICES = ("zookeeper", "clickhouse-r1", "clickhouse-r2", "kafka")

# The topology (`up --brokers N --shards N`): remembered in the stack dir's TOPOLOGY_FILE
# at `up`, so `status`, `down`, `env` and a later `up` act on the same processes.
# BLOCKAGG_STACK_BROKERS / BLOCKAGG_STACK_SHARDS override it (the fault suite's cluster
# stack sets them); a flag of `up` overrides both.
BROKER_COUNTS = (1, 3)
SHARD_COUNTS = (1, 2)
BROKERS_VAR = "BLOCKAGG_STACK_BROKERS"
SHARDS_VAR = "BLOCKAGG_STACK_SHARDS"
TOPOLOGY_FILE = "topology"
CLUSTER_ID_FILE = "kafka-cluster-id"
# Broker n (node id n) listens on BLOCKAGG_KAFKA_PORT + BROKER_PORT_STEP * (n - 1) and
# its controller on BLOCKAGG_KAFKA_CONTROLLER_PORT + the same: 19092/19093, 19094/19095,
# 19096/19097 by default (the step of 2 keeps a broker's port off the next controller's).
BROKER_PORT_STEP = 2
KAFKA_CLUSTER_HEAP = ["-Xms128m", "-Xmx384m"]  # per broker of a cluster (docs/stack.md)
# Shard 02's replicas r3/r4 use shard 01's r1/r2 ports + SHARD_PORT_STEP (19200, 19300, ...).
SHARD_PORT_STEP = 200
# `up --brokers 3 --isolate-brokers`: each Kafka node in its own network namespace, on a
# private subnet behind a bridge of the root namespace (docs/stack.md#isolated-brokers), so
# `scripts/stack cut N` can take one node off the network both ways. Remembered in the
# topology file; BLOCKAGG_STACK_ISOLATE_BROKERS (1/0) overrides it.
ISOLATE_VAR = "BLOCKAGG_STACK_ISOLATE_BROKERS"
BROKER_NET_FILE = "broker-network"  # what up created, so down removes it even after a crash
BROKER_SUBNET_PREFIX = "10.77"


class StackError(RuntimeError):
    """A failure the user must act on; the message says what and where to look."""


# --------------------------------------------------------------------------------------------
# Configuration


@dataclasses.dataclass(frozen=True)
class Ports:
    kafka: int
    kafka_controller: int
    zk: int
    ch1_tcp: int
    ch1_http: int
    ch1_interserver: int
    ch2_tcp: int
    ch2_http: int
    ch2_interserver: int
    ch1_tcp_secure: int
    ch2_tcp_secure: int

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Ports:
        values: dict[str, int] = {}
        for name, (var, default) in PORT_DEFAULTS.items():
            raw = env.get(var, "").strip()
            if not raw:
                values[name] = default
                continue
            if not raw.isdigit() or not 0 < int(raw) < 65536:
                raise StackError(f"{var}={raw!r} is not a TCP port (1-65535)")
            values[name] = int(raw)
        ports = cls(**values)
        seen: dict[int, str] = {}
        for name, value in dataclasses.asdict(ports).items():
            if value in seen:
                raise StackError(
                    f"port {value} is used twice ({PORT_DEFAULTS[seen[value]][0]} and "
                    f"{PORT_DEFAULTS[name][0]}); give each service its own port"
                )
            seen[value] = name
        return ports


@dataclasses.dataclass(frozen=True)
class Replica:
    name: str  # r1 / r2 (shard 01), r3 / r4 (shard 02)
    tcp: int
    http: int
    interserver: int
    tcp_secure: int  # the native protocol over TLS (certificate: StackConfig.tls_dir)
    shard: str = SHARD


@dataclasses.dataclass(frozen=True)
class Broker:
    """One Kafka node (combined broker + controller) of the stack."""

    node_id: int
    port: int
    controller_port: int
    host: str = HOST  # its own address on the brokers' subnet when isolated

    @property
    def service(self) -> str:
        """Broker 1 keeps the single-broker stack's name and folder (``kafka``)."""
        return "kafka" if self.node_id == 1 else f"kafka-{self.node_id}"


def _count(raw: str, allowed: tuple[int, ...], what: str) -> int:
    if not raw.strip().isdigit() or int(raw) not in allowed:
        raise StackError(f"{what}={raw!r}: the stack runs "
                         f"{' or '.join(str(a) for a in allowed)}")
    return int(raw)


def _remembered(root: Path) -> dict[str, str]:
    remembered: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in (root / TOPOLOGY_FILE).read_text().splitlines():
            key, sep, value = line.partition("=")
            if sep:
                remembered[key.strip()] = value.strip()
    return remembered


def read_topology(root: Path, env: Mapping[str, str]) -> tuple[int, int]:
    """(brokers, shards): the environment's override, else what ``up`` remembered in
    ``root``, else (1, 1)."""
    remembered = _remembered(root)
    brokers = env.get(BROKERS_VAR) or remembered.get("brokers") or "1"
    shards = env.get(SHARDS_VAR) or remembered.get("shards") or "1"
    return (_count(brokers, BROKER_COUNTS, f"brokers ({BROKERS_VAR} or {root / TOPOLOGY_FILE})"),
            _count(shards, SHARD_COUNTS, f"shards ({SHARDS_VAR} or {root / TOPOLOGY_FILE})"))


def read_isolation(root: Path, env: Mapping[str, str]) -> bool:
    """Whether the Kafka nodes run isolated: ``BLOCKAGG_STACK_ISOLATE_BROKERS``, else what
    ``up --isolate-brokers`` remembered in ``root``, else not."""
    raw = env.get(ISOLATE_VAR) or _remembered(root).get("isolate_brokers") or "0"
    if raw not in ("0", "1"):
        raise StackError(f"{ISOLATE_VAR}={raw!r}: give 1 (each Kafka node in its own network "
                         "namespace) or 0")
    return raw == "1"


def render_topology(brokers: int, shards: int, isolate_brokers: bool = False) -> str:
    """The topology file; ``isolate_brokers=1`` only when set, so a stack without the flag
    writes the same file as before it existed."""
    return (f"# written by scripts/stack up\nbrokers={brokers}\nshards={shards}\n"
            + ("isolate_brokers=1\n" if isolate_brokers else ""))


@dataclasses.dataclass(frozen=True)
class StackConfig:
    root: Path  # the .stack folder
    ports: Ports
    kafka_version: str
    spark_version: str | None  # None: pyspark not installed and not given
    # How long ZooKeeper keeps a killed ClickHouse's session: a restarted replica
    # cannot rejoin replication (and quorum inserts wait) until that session expires.
    ch_zk_session_timeout_ms: int = 30_000
    brokers: int = 1  # Kafka nodes: 1 or 3
    shards: int = 1  # ClickHouse shards of two replicas: 1 or 2
    isolate_brokers: bool = False  # each Kafka node in its own network namespace

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> StackConfig:
        env = os.environ if env is None else env
        root = Path(env.get("BLOCKAGG_STACK_DIR") or REPO_ROOT / ".stack").resolve()
        brokers, shards = read_topology(root, env)
        cfg = cls(
            root=root,
            ports=Ports.from_env(env),
            kafka_version=env.get("BLOCKAGG_KAFKA_VERSION") or DEFAULT_KAFKA_VERSION,
            spark_version=env.get("BLOCKAGG_SPARK_VERSION") or installed_pyspark_version(),
            ch_zk_session_timeout_ms=_zk_session_timeout_ms(env),
            brokers=brokers,
            shards=shards,
            isolate_brokers=read_isolation(root, env),
        )
        cfg.check_ports()
        return cfg

    def with_topology(self, brokers: int | None, shards: int | None,
                      isolate_brokers: bool | None = None) -> StackConfig:
        cfg = dataclasses.replace(
            self, brokers=brokers or self.brokers, shards=shards or self.shards,
            isolate_brokers=self.isolate_brokers if isolate_brokers is None
            else isolate_brokers)
        cfg.check_ports()
        return cfg

    def check_ports(self) -> None:
        """The derived ports (brokers 2-3, shard 02) collide with no other port."""
        seen: dict[int, str] = {}
        named = [(f"{b.service} broker", b.port) for b in self.kafka_brokers]
        named += [(f"{b.service} controller", b.controller_port) for b in self.kafka_brokers]
        named += [(f"clickhouse-{r.name} {k}", v) for r in self.replicas
                  for k, v in (("tcp", r.tcp), ("http", r.http),
                               ("interserver", r.interserver), ("tcp_secure", r.tcp_secure))]
        named.append(("zookeeper", self.ports.zk))
        for name, port in named:
            if not 0 < port < 65536:
                raise StackError(f"{name}: derived port {port} is not a TCP port; lower the "
                                 "BLOCKAGG_*_PORT it is derived from (docs/stack.md#ports)")
            if port in seen:
                raise StackError(f"port {port} is used twice ({seen[port]} and {name}); "
                                 "move one with its BLOCKAGG_*_PORT (docs/stack.md#ports)")
            seen[port] = name

    @property
    def kafka_brokers(self) -> tuple[Broker, ...]:
        p = self.ports
        net = self.broker_network if self.isolate_brokers else None
        return tuple(Broker(n, p.kafka + BROKER_PORT_STEP * (n - 1),
                            p.kafka_controller + BROKER_PORT_STEP * (n - 1),
                            net.address(n) if net else HOST)
                     for n in range(1, self.brokers + 1))

    @property
    def broker_network(self) -> BrokerNetwork:
        """The names and addresses ``--isolate-brokers`` gives this stack's Kafka nodes."""
        return BrokerNetwork.for_stack(self.ports.kafka, self.brokers)

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(f"{b.host}:{b.port}" for b in self.kafka_brokers)

    @property
    def replicas(self) -> tuple[Replica, ...]:
        p = self.ports
        first = (
            Replica("r1", p.ch1_tcp, p.ch1_http, p.ch1_interserver, p.ch1_tcp_secure),
            Replica("r2", p.ch2_tcp, p.ch2_http, p.ch2_interserver, p.ch2_tcp_secure),
        )
        if self.shards == 1:
            return first
        step = SHARD_PORT_STEP
        return first + tuple(
            Replica(f"r{i + 3}", r.tcp + step, r.http + step, r.interserver + step,
                    r.tcp_secure + step, shard="02")
            for i, r in enumerate(first))

    def shard_replicas(self) -> dict[str, tuple[Replica, ...]]:
        out: dict[str, tuple[Replica, ...]] = {}
        for r in self.replicas:
            out[r.shard] = (*out.get(r.shard, ()), r)
        return out

    def service_dir(self, service: str) -> Path:
        return self.root / service

    @property
    def kafka_lib(self) -> Path:
        return self.root / "kafka-lib" / self.kafka_version

    @property
    def kafka_tools_lib(self) -> Path:
        """Kafka's admin tools (``kafka-tools`` and what it needs), kept apart from the
        broker's jars so that adding them never touches a running broker's classpath."""
        return self.root / "kafka-tools" / self.kafka_version

    @property
    def spark_jars_dir(self) -> Path:
        return self.root / "spark-jars" / (self.spark_version or "none")

    @property
    def maven_repo(self) -> Path:
        return self.root / "m2"

    @property
    def tls_dir(self) -> Path:
        """The stack's own certificate authority and the replicas' server certificate
        (for 127.0.0.1 and localhost): ``ca.pem`` is what a client verifies against."""
        return self.root / "tls"


ZK_SESSION_TIMEOUT_VAR = "BLOCKAGG_CH_ZK_SESSION_TIMEOUT_MS"
# ZooKeeper grants sessions between 2 and 20 ticks (tickTime=2000 in render_zoo_cfg).
ZK_SESSION_TIMEOUT_RANGE = (4_000, 40_000)


def _zk_session_timeout_ms(env: Mapping[str, str]) -> int:
    raw = env.get(ZK_SESSION_TIMEOUT_VAR) or "30000"
    low, high = ZK_SESSION_TIMEOUT_RANGE
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise StackError(
            f"{ZK_SESSION_TIMEOUT_VAR}={raw!r}: give milliseconds between {low} and {high} "
            "(ZooKeeper grants 2 to 20 ticks of 2 s)"
        )
    return int(raw)


def installed_pyspark_version() -> str | None:
    try:
        return importlib.metadata.version("pyspark")
    except importlib.metadata.PackageNotFoundError:
        return None


def pyspark_jars_dir() -> Path | None:
    spec = importlib.util.find_spec("pyspark")
    if spec is None or spec.origin is None:
        return None
    jars = Path(spec.origin).parent / "jars"
    return jars if jars.is_dir() else None


# --------------------------------------------------------------------------------------------
# Rendering (pure)


def kafka_cluster_id() -> str:
    """A random Kafka cluster id: 16 bytes, URL-safe base64 without padding (22 chars)."""
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


def render_kafka_properties(cfg: StackConfig, broker: Broker | None = None) -> str:
    """``server.properties`` of ``broker`` (default: node 1). A single-broker stack keeps
    replication factors 1; a cluster gets Kafka's production durability settings (RF 3,
    min.insync.replicas 2, no unclean election), which blockagg's start-up check wants."""
    if cfg.brokers > 1:
        return render_cluster_kafka_properties(cfg, broker or cfg.kafka_brokers[0])
    p = cfg.ports
    data = cfg.service_dir("kafka") / "data"
    lines = [
        "# generated by scripts/stack: Kafka KRaft combined mode (broker + controller), loopback",
        "process.roles=broker,controller",
        "node.id=1",
        f"controller.quorum.voters=1@{HOST}:{p.kafka_controller}",
        f"listeners=PLAINTEXT://{HOST}:{p.kafka},CONTROLLER://{HOST}:{p.kafka_controller}",
        f"advertised.listeners=PLAINTEXT://{HOST}:{p.kafka}",
        "controller.listener.names=CONTROLLER",
        "inter.broker.listener.name=PLAINTEXT",
        "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        f"log.dirs={data}",
        "num.partitions=1",
        "auto.create.topics.enable=true",
        # the broker default users have; our metadata must fit in it
        "offset.metadata.max.bytes=4096",
        "offsets.topic.num.partitions=3",
        "offsets.topic.replication.factor=1",
        "transaction.state.log.replication.factor=1",
        "transaction.state.log.min.isr=1",
        "share.coordinator.state.topic.replication.factor=1",
        "share.coordinator.state.topic.min.isr=1",
        "group.initial.rebalance.delay.ms=0",
        # A broker restarted after kill -9 cannot register until the controller fences its
        # previous incarnation (DUPLICATE_BROKER_REGISTRATION): 9 s by default, 4 s here.
        "broker.session.timeout.ms=4000",
        "broker.heartbeat.interval.ms=1000",
        "log.retention.hours=168",
        "log.segment.bytes=67108864",
        "num.network.threads=2",
        "num.io.threads=4",
        "",
    ]
    return "\n".join(lines)


def render_cluster_kafka_properties(cfg: StackConfig, broker: Broker) -> str:
    data = cfg.service_dir(broker.service) / "data"
    voters = ",".join(f"{b.node_id}@{b.host}:{b.controller_port}" for b in cfg.kafka_brokers)
    n = len(cfg.kafka_brokers)
    where = (f"network namespace {cfg.broker_network.namespace(broker.node_id)}"
             if cfg.isolate_brokers else "loopback")
    h = broker.host
    lines = [
        f"# generated by scripts/stack: Kafka KRaft combined mode, node {broker.node_id} of "
        f"{n}, {where}",
        "process.roles=broker,controller",
        f"node.id={broker.node_id}",
        f"controller.quorum.voters={voters}",
        f"listeners=PLAINTEXT://{h}:{broker.port},CONTROLLER://{h}:{broker.controller_port}",
        f"advertised.listeners=PLAINTEXT://{h}:{broker.port}",
        "controller.listener.names=CONTROLLER",
        "inter.broker.listener.name=PLAINTEXT",
        "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        f"log.dirs={data}",
        "num.partitions=1",
        "auto.create.topics.enable=true",
        "offset.metadata.max.bytes=4096",
        "offsets.topic.num.partitions=3",
        # what docs/running.md#production-kafka asks of a production cluster
        "default.replication.factor=3",
        "min.insync.replicas=2",
        "unclean.leader.election.enable=false",
        "offsets.topic.replication.factor=3",
        "transaction.state.log.replication.factor=3",
        "transaction.state.log.min.isr=2",
        "share.coordinator.state.topic.replication.factor=3",
        "share.coordinator.state.topic.min.isr=2",
        "group.initial.rebalance.delay.ms=0",
        "broker.session.timeout.ms=4000",
        "broker.heartbeat.interval.ms=1000",
        "log.retention.hours=168",
        "log.segment.bytes=67108864",
        "num.network.threads=2",
        "num.io.threads=2",
        "",
    ]
    return "\n".join(lines)


KAFKA_LOG4J2 = """\
# generated by scripts/stack
status = warn
appender.console.type = Console
appender.console.name = STDOUT
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.stdout.ref = STDOUT
logger.state.name = state.change.logger
logger.state.level = WARN
logger.cleaner.name = kafka.log.LogCleaner
logger.cleaner.level = WARN
"""


def render_zoo_cfg(cfg: StackConfig) -> str:
    data = cfg.service_dir("zookeeper") / "data"
    return "\n".join(
        [
            "# generated by scripts/stack: standalone ZooKeeper for the ClickHouse replicas",
            "tickTime=2000",
            "initLimit=10",
            "syncLimit=5",
            f"dataDir={data}",
            f"clientPort={cfg.ports.zk}",
            f"clientPortAddress={HOST}",
            "maxClientCnxns=200",
            "admin.enableServer=false",
            "4lw.commands.whitelist=srvr,ruok,stat,mntr",
            "autopurge.snapRetainCount=3",
            "autopurge.purgeInterval=1",
            "",
        ]
    )


TLS_FILES = ("ca.pem", "server.pem", "server.key")
_SERVER_EXTENSIONS = """basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1, DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer
"""


def make_tls_certificates(folder: Path) -> None:
    """A private certificate authority and a server certificate it signed for
    127.0.0.1 and localhost, made once per stack folder with ``openssl``, so the
    replicas' secure port is exercised with verification on, as users run it. The CA's
    key is deleted once it has signed: nothing else can be issued under it."""
    if all((folder / name).exists() for name in TLS_FILES):
        return
    openssl = shutil.which("openssl")
    if openssl is None:
        raise StackError("openssl not found; run as root: apt-get install -y openssl")
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        t = Path(tmp)
        (t / "server.ext").write_text(_SERVER_EXTENSIONS)
        steps = [
            ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650",
             "-subj", "/CN=blockagg local stack CA", "-keyout", "ca.key", "-out", "ca.pem",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
            ["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
             "-keyout", "server.key", "-out", "server.csr"],
            ["x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "3650", "-extfile", "server.ext", "-out", "server.pem"],
        ]
        for args in steps:
            res = subprocess.run([openssl, *args], cwd=t, capture_output=True, text=True,
                                 check=False)
            if res.returncode != 0:
                raise StackError(f"openssl {args[0]} failed making the stack's TLS "
                                 f"certificates in {folder}: {res.stderr.strip()}")
        for name in TLS_FILES:
            (t / name).replace(folder / name)


def render_clickhouse_config(cfg: StackConfig, replica: Replica) -> str:
    d = cfg.service_dir(f"clickhouse-{replica.name}")
    data = d / "data"
    shards = "\n".join(
        "            <shard>\n"
        "                <internal_replication>true</internal_replication>\n"
        + "\n".join(
            f"""                <replica><host>{HOST}</host><port>{r.tcp}</port></replica>"""
            for r in replicas)
        + "\n            </shard>"
        for replicas in cfg.shard_replicas().values()
    )
    return f"""<?xml version="1.0"?>
<!-- generated by scripts/stack: ClickHouse replica {replica.name} of shard {replica.shard} -->
<yandex>
    <logger>
        <level>information</level>
        <log>{d / "logs" / "server.log"}</log>
        <errorlog>{d / "logs" / "server.err.log"}</errorlog>
        <size>100M</size>
        <count>2</count>
    </logger>
    <listen_host>{HOST}</listen_host>
    <tcp_port>{replica.tcp}</tcp_port>
    <tcp_port_secure>{replica.tcp_secure}</tcp_port_secure>
    <openSSL>
        <server>
            <certificateFile>{cfg.tls_dir / "server.pem"}</certificateFile>
            <privateKeyFile>{cfg.tls_dir / "server.key"}</privateKeyFile>
            <verificationMode>none</verificationMode>
            <loadDefaultCAFile>false</loadDefaultCAFile>
            <cacheSessions>true</cacheSessions>
            <disableProtocols>sslv2,sslv3,tlsv1,tlsv1_1</disableProtocols>
            <preferServerCiphers>true</preferServerCiphers>
        </server>
    </openSSL>
    <http_port>{replica.http}</http_port>
    <interserver_http_port>{replica.interserver}</interserver_http_port>
    <interserver_http_host>{HOST}</interserver_http_host>
    <max_connections>512</max_connections>
    <keep_alive_timeout>3</keep_alive_timeout>
    <max_concurrent_queries>100</max_concurrent_queries>
    <uncompressed_cache_size>134217728</uncompressed_cache_size>
    <mark_cache_size>134217728</mark_cache_size>
    <path>{data}/</path>
    <tmp_path>{data}/tmp/</tmp_path>
    <user_files_path>{data}/user_files/</user_files_path>
    <format_schema_path>{data}/format_schemas/</format_schema_path>
    <users_config>{d / "users.xml"}</users_config>
    <default_profile>default</default_profile>
    <default_database>default</default_database>
    <timezone>UTC</timezone>
    <mlock_executable>false</mlock_executable>
    <builtin_dictionaries_reload_interval>3600</builtin_dictionaries_reload_interval>
    <max_session_timeout>3600</max_session_timeout>
    <default_session_timeout>60</default_session_timeout>
    <zookeeper>
        <node index="1"><host>{HOST}</host><port>{cfg.ports.zk}</port></node>
        <session_timeout_ms>{cfg.ch_zk_session_timeout_ms}</session_timeout_ms>
    </zookeeper>
    <macros>
        <shard>{replica.shard}</shard>
        <replica>{replica.name}</replica>
        <cluster>{CLUSTER_NAME}</cluster>
    </macros>
    <remote_servers>
        <{CLUSTER_NAME}>
{shards}
        </{CLUSTER_NAME}>
    </remote_servers>
    <distributed_ddl>
        <path>/clickhouse/task_queue/ddl</path>
    </distributed_ddl>
    <merge_tree>
        <replicated_deduplication_window>100</replicated_deduplication_window>
    </merge_tree>
</yandex>
"""


CLICKHOUSE_USERS = """<?xml version="1.0"?>
<!-- generated by scripts/stack: user 'default', no password, loopback only -->
<yandex>
    <profiles>
        <default>
            <max_memory_usage>4000000000</max_memory_usage>
            <load_balancing>random</load_balancing>
        </default>
    </profiles>
    <users>
        <default>
            <password></password>
            <networks><ip>127.0.0.1</ip><ip>::1</ip></networks>
            <profile>default</profile>
            <quota>default</quota>
        </default>
    </users>
    <quotas>
        <default>
            <interval>
                <duration>3600</duration>
                <queries>0</queries><errors>0</errors><result_rows>0</result_rows>
                <read_rows>0</read_rows><execution_time>0</execution_time>
            </interval>
        </default>
    </quotas>
</yandex>
"""


def render_pom(artifact_id: str, deps: Iterable[tuple[str, str, str]]) -> str:
    dep_xml = "\n".join(
        f"    <dependency><groupId>{g}</groupId><artifactId>{a}</artifactId>"
        f"<version>{v}</version></dependency>"
        for g, a, v in deps
    )
    return f"""<?xml version="1.0"?>
<!-- generated by scripts/stack: only used to resolve jars from Maven Central -->
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>local.blockagg.stack</groupId>
  <artifactId>{artifact_id}</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
{dep_xml}
  </dependencies>
</project>
"""


# Every repository (including ones declared in third-party poms) goes to Maven Central.
MAVEN_SETTINGS = f"""<?xml version="1.0"?>
<settings>
  <mirrors>
    <mirror><id>central-only</id><mirrorOf>*</mirrorOf><url>{MAVEN_CENTRAL}</url></mirror>
  </mirrors>
</settings>
"""


def kafka_deps(version: str) -> list[tuple[str, str, str]]:
    return [
        ("org.apache.kafka", "kafka_2.13", version),
        # Kafka 4.x logs through slf4j 1.7 + log4j2
        ("org.apache.logging.log4j", "log4j-slf4j-impl", LOG4J_VERSION),
        ("org.apache.logging.log4j", "log4j-core", LOG4J_VERSION),
    ]


def kafka_tools_deps(version: str) -> list[tuple[str, str, str]]:
    return [("org.apache.kafka", "kafka-tools", version)]


# `scripts/stack <tool>`: Kafka's own admin tools, as `kafka-topics.sh` & co. run them.
KAFKA_TOOLS: dict[str, str] = {
    "kafka-topics": "org.apache.kafka.tools.TopicCommand",
    "kafka-consumer-groups": "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand",
    "kafka-transactions": "org.apache.kafka.tools.TransactionsCommand",
    # running.md's hanging-transaction runbook reads the hanging commit with it
    "kafka-console-consumer": "org.apache.kafka.tools.consumer.ConsoleConsumer",
    # the fault suite's cluster kinds: the KRaft quorum's leader, moving leaders
    "kafka-metadata-quorum": "org.apache.kafka.tools.MetadataQuorumCommand",
    "kafka-reassign-partitions": "org.apache.kafka.tools.reassign.ReassignPartitionsCommand",
    "kafka-leader-election": "org.apache.kafka.tools.LeaderElectionCommand",
}


def kafka_tool_command(cfg: StackConfig, tool: str, args: Sequence[str]) -> list[str]:
    """The java command line of ``scripts/stack <tool> <args>``: the tool's main class on
    the tools' classpath, logging (slf4j-simple, when Debian ships it) at WARN on stderr,
    and ``--bootstrap-server`` set to the stack's broker unless ``args`` name one."""
    cp = f"{cfg.kafka_tools_lib}/*"
    if Path(SLF4J_SIMPLE_JAR).exists():
        cp += f":{SLF4J_SIMPLE_JAR}"
    bootstrap = [] if any(a == "--bootstrap-server" or a.startswith("--bootstrap-server=")
                          for a in args) else ["--bootstrap-server", cfg.bootstrap_servers]
    return [
        java(),
        "-Xmx256m",
        "-Djava.awt.headless=true",
        "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn",
        "-Dorg.slf4j.simpleLogger.logFile=System.err",
        "-cp",
        cp,
        KAFKA_TOOLS[tool],
        *bootstrap,
        *args,
    ]


def spark_deps(version: str) -> list[tuple[str, str, str]]:
    return [("org.apache.spark", "spark-sql-kafka-0-10_2.13", version)]


_JAR_RE = re.compile(r"^(?P<artifact>.+?)-(?P<version>\d+(?:\.\d+)+(?:[.-][A-Za-z0-9_]+)*)\.jar$")


def jar_artifact(filename: str) -> str:
    """``kafka-clients-3.9.0.jar`` -> ``kafka-clients``; ``scala-library_2.13-1.2.jar`` ->
    ``scala-library_2.13``; a name without a version is returned without ``.jar``."""
    m = _JAR_RE.match(filename)
    if m:
        return m.group("artifact")
    return filename.removesuffix(".jar")


def jars_not_shipped(resolved: Iterable[str], shipped: Iterable[str]) -> list[str]:
    """The resolved jar names whose artifact pyspark does not already ship (any version)."""
    have = {jar_artifact(j) for j in shipped}
    return sorted(j for j in resolved if jar_artifact(j) not in have)


def env_values(cfg: StackConfig, spark_jars: Sequence[Path]) -> dict[str, str]:
    """What `scripts/stack env` exports, as a dict (the integration fixtures use it too)."""
    p = cfg.ports
    values = {
        "BLOCKAGG_STACK_DIR": str(cfg.root),
        "BLOCKAGG_BOOTSTRAP_SERVERS": cfg.bootstrap_servers,
        "BLOCKAGG_KAFKA_VERSION": cfg.kafka_version,
        "BLOCKAGG_ZK": f"{HOST}:{p.zk}",
        "BLOCKAGG_CH_HOST": HOST,
        "BLOCKAGG_CH_PORTS": f"{p.ch1_tcp},{p.ch2_tcp}",
        "BLOCKAGG_CH_HTTP_PORTS": f"{p.ch1_http},{p.ch2_http}",
        "BLOCKAGG_CH_SECURE_PORTS": f"{p.ch1_tcp_secure},{p.ch2_tcp_secure}",
        "BLOCKAGG_CH_CA_CERTS": str(cfg.tls_dir / "ca.pem"),
        "BLOCKAGG_CH_CLUSTER": CLUSTER_NAME,
        "BLOCKAGG_SPARK_VERSION": cfg.spark_version or "",
        "BLOCKAGG_SPARK_JARS": ",".join(str(j) for j in spark_jars),
    }
    if cfg.brokers > 1 or cfg.shards > 1:
        values[BROKERS_VAR] = str(cfg.brokers)
        values[SHARDS_VAR] = str(cfg.shards)
    if cfg.isolate_brokers:
        values[ISOLATE_VAR] = "1"
    if cfg.shards > 1:
        # shard 02's replicas (BLOCKAGG_CH_PORTS & co. stay shard 01's)
        shard2 = cfg.shard_replicas()["02"]
        values["BLOCKAGG_CH_SHARD2_PORTS"] = ",".join(str(r.tcp) for r in shard2)
        values["BLOCKAGG_CH_SHARD2_HTTP_PORTS"] = ",".join(str(r.http) for r in shard2)
    return values


def env_lines(cfg: StackConfig, spark_jars: Sequence[Path]) -> list[str]:
    return [f"export {k}={shlex.quote(v)}" for k, v in env_values(cfg, spark_jars).items()]


# --------------------------------------------------------------------------------------------
# Probes


def _kafka_string(s: str | None) -> bytes:
    if s is None:
        return struct.pack(">h", -1)
    b = s.encode()
    return struct.pack(">h", len(b)) + b


def kafka_metadata_request(correlation_id: int, client_id: str = "blockagg-stack") -> bytes:
    """A size-prefixed Metadata v4 request for all topics (v4: still supported by Kafka 4.x,
    not yet 'flexible', so no tagged fields)."""
    body = struct.pack(">hhi", 3, 4, correlation_id) + _kafka_string(client_id)
    body += struct.pack(">i", -1)  # topics: null = all
    body += struct.pack(">?", False)  # allow_auto_topic_creation
    return struct.pack(">i", len(body)) + body


def parse_kafka_metadata_brokers(payload: bytes, correlation_id: int) -> list[tuple[int, str, int]]:
    """Brokers (node id, host, port) from a Metadata v4 response payload (after the size)."""
    off = 0

    def take(fmt: str) -> tuple[int, ...]:
        nonlocal off
        vals = struct.unpack_from(fmt, payload, off)
        off += struct.calcsize(fmt)
        return vals

    def take_str() -> str | None:
        nonlocal off
        (n,) = take(">h")
        if n < 0:
            return None
        s = payload[off : off + n].decode()
        off += n
        return s

    (cid,) = take(">i")
    if cid != correlation_id:
        raise ValueError(f"correlation id {cid} != {correlation_id}")
    take(">i")  # throttle_time_ms
    (count,) = take(">i")
    brokers = []
    for _ in range(count):
        (node,) = take(">i")
        host = take_str() or ""
        (port,) = take(">i")
        take_str()  # rack
        brokers.append((node, host, port))
    return brokers


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return buf


def kafka_brokers_seen(port: int, timeout: float = 2.0, host: str = HOST) -> int | None:
    """How many brokers the broker's answer to a Metadata request lists (the live ones:
    a KRaft broker lists only unfenced brokers), or ``None`` when it does not answer."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(kafka_metadata_request(7))
            (size,) = struct.unpack(">i", _recv_exact(s, 4))
            return len(parse_kafka_metadata_brokers(_recv_exact(s, size), 7))
    except (OSError, ValueError, struct.error):
        return None


def probe_kafka(port: int, timeout: float = 2.0, host: str = HOST) -> bool:
    """True when the broker answers a Metadata request listing at least one broker."""
    return (kafka_brokers_seen(port, timeout, host) or 0) >= 1


def wait_cluster_formed(brokers: Sequence[Broker], timeout: float = 60.0,
                        seen: Callable[[Broker], int | None] | None = None) -> None:
    """Wait until each of ``brokers`` lists them all. A node answers Metadata as soon as
    it has registered, before the controller has unfenced the others, so right after a
    start one may name only itself, and a client bootstrapped from it sees a cluster of
    one (a test saw ``[3]`` where it asked for ``[1, 2, 3]``)."""
    ask = seen or (lambda b: kafka_brokers_seen(b.port, host=b.host))
    deadline = time.monotonic() + timeout
    while True:
        counts = {b.service: ask(b) for b in brokers}
        if all((c or 0) >= len(brokers) for c in counts.values()):
            return
        if time.monotonic() >= deadline:
            views = ", ".join(f"{name} lists {c if c is not None else 'nothing'}"
                              for name, c in counts.items())
            raise StackError(f"the Kafka cluster did not form within {timeout:.0f}s: "
                             f"{views} of {len(brokers)} brokers")
        time.sleep(0.3)


def probe_zookeeper(port: int, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(b"srvr")
            data = b""
            while True:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
        return b"Mode:" in data
    except OSError:
        return False


def clickhouse_query(http_port: int, query: str, timeout: float = 5.0) -> str:
    url = f"http://{HOST}:{http_port}/?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        body: bytes = resp.read()
        return body.decode()


def probe_clickhouse(http_port: int, timeout: float = 2.0) -> bool:
    try:
        return clickhouse_query(http_port, "SELECT 1", timeout).strip() == "1"
    except OSError:
        return False


# --------------------------------------------------------------------------------------------
# Processes


def read_pid(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return None


def pid_alive(pid: int, marker: str) -> bool:
    """The process exists, is not a zombie, and its command line contains ``marker`` (so a
    recycled pid is not mistaken for ours)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (OSError, IndexError):
        return False
    return marker in cmdline


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text[-lines:])


@dataclasses.dataclass
class Service:
    name: str
    ports: dict[str, int]
    workdir: Path
    command: Callable[[], list[str]]
    probe: Callable[[], bool]
    marker: str  # substring of the command line identifying our process
    logs: list[Path]
    prepare: Callable[[], None] = lambda: None
    startup_timeout: float = 90.0
    host: str = HOST  # the address its ports are on (an isolated broker's own)

    @property
    def pidfile(self) -> Path:
        return self.workdir / "pid"

    @property
    def logfile(self) -> Path:
        return self.workdir / "stdout.log"

    def pid(self) -> int | None:
        pid = read_pid(self.pidfile)
        return pid if pid is not None and pid_alive(pid, self.marker) else None

    def is_up(self) -> bool:
        return self.pid() is not None and self.probe()

    def answers_within(self, grace: float) -> bool:
        """Whether a running service that missed one probe answers within ``grace``
        seconds: on a loaded machine (a CI run beside benchmarks) a JVM can miss a 2 s
        probe, and restarting it would break whatever is using it."""
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if self.pid() is None:
                return False
            if self.probe():
                return True
            time.sleep(1.0)
        return False

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.prepare()
        with open(self.logfile, "ab") as log:
            log.write(f"\n===== scripts/stack up {time.strftime('%F %T')} =====\n".encode())
            log.flush()
            proc = subprocess.Popen(
                self.command(),
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pidfile.write_text(f"{proc.pid}\n")

    def wait_up(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.pid() is None:
                # Between fork and exec the child still shows our own command line, so
                # only a process that is gone (or a zombie) has exited.
                started = read_pid(self.pidfile)
                if started is None or not pid_alive(started, ""):
                    raise StackError(self.failure("exited during startup"))
            if self.probe():
                return
            time.sleep(0.3)
        raise StackError(self.failure(f"did not answer within {self.startup_timeout:.0f}s"))

    def failure(self, what: str) -> str:
        parts = [f"{self.name} {what} (ports {self.ports}); its logs:"]
        for log in [self.logfile, *self.logs]:
            parts.append(f"--- tail of {log} ---\n{tail(log)}")
        return "\n".join(parts)

    def terminate(self) -> None:
        """SIGTERM without waiting (``stop`` waits)."""
        pid = self.pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    def stop(self, timeout: float = 20.0) -> bool:
        pid = self.pid()
        if pid is None:
            self.pidfile.unlink(missing_ok=True)
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and pid_alive(pid, self.marker):
            time.sleep(0.2)
        if pid_alive(pid, self.marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            while pid_alive(pid, self.marker):
                time.sleep(0.1)
        self.pidfile.unlink(missing_ok=True)
        return True


def java() -> str:
    home = os.environ.get("JAVA_HOME")
    if home and Path(home, "bin", "java").exists():
        return str(Path(home, "bin", "java"))
    return shutil.which("java") or "java"


def build_services(cfg: StackConfig) -> dict[str, Service]:
    p = cfg.ports
    zk_dir = cfg.service_dir("zookeeper")

    def zk_prepare() -> None:
        (zk_dir / "data").mkdir(parents=True, exist_ok=True)
        (zk_dir / "zoo.cfg").write_text(render_zoo_cfg(cfg))

    def zk_command() -> list[str]:
        cp = ":".join(j for j in (ZOOKEEPER_JAR, SLF4J_SIMPLE_JAR) if Path(j).exists())
        return [
            java(),
            "-Xms64m",
            "-Xmx256m",
            "-Dzookeeper.jmx.log4j.disable=true",
            "-Dblockagg.stack=zookeeper",
            "-cp",
            cp,
            "org.apache.zookeeper.server.ZooKeeperServerMain",
            str(zk_dir / "zoo.cfg"),
        ]

    def kafka_cluster_id_for() -> str:
        """One random id per stack; a cluster's nodes are formatted with the same one,
        kept in CLUSTER_ID_FILE so a wiped or added node joins the same cluster."""
        if cfg.brokers == 1:
            return kafka_cluster_id()
        path = cfg.root / CLUSTER_ID_FILE
        if not path.exists():
            cfg.root.mkdir(parents=True, exist_ok=True)
            path.write_text(kafka_cluster_id() + "\n")
        return path.read_text().strip()

    def kafka_prepare(b: Broker) -> None:
        kafka_dir = cfg.service_dir(b.service)
        kafka_dir.mkdir(parents=True, exist_ok=True)
        (kafka_dir / "server.properties").write_text(render_kafka_properties(cfg, b))
        (kafka_dir / "log4j2.properties").write_text(KAFKA_LOG4J2)
        if not (kafka_dir / "data" / "meta.properties").exists():
            cmd = [
                *kafka_java(b),
                "kafka.tools.StorageTool",
                "format",
                f"--cluster-id={kafka_cluster_id_for()}",  # an id may start with "-"
                "--config",
                str(kafka_dir / "server.properties"),
                "--ignore-formatted",
            ]
            res = subprocess.run(cmd, cwd=kafka_dir, capture_output=True, text=True, check=False)
            if res.returncode != 0:
                raise StackError(
                    f"kafka storage format failed ({shlex.join(cmd)}):\n{res.stdout}\n{res.stderr}"
                )

    def kafka_java(b: Broker) -> list[str]:
        kafka_dir = cfg.service_dir(b.service)
        # A cluster's three JVMs share the machine: a smaller heap each.
        heap = ["-Xms256m", "-Xmx512m"] if cfg.brokers == 1 else KAFKA_CLUSTER_HEAP
        return [
            java(),
            *heap,
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-Djava.awt.headless=true",
            f"-Dblockagg.stack={b.service}",
            f"-Dlog4j2.configurationFile={kafka_dir / 'log4j2.properties'}",
            f"-Dkafka.logs.dir={kafka_dir / 'logs'}",
            "-cp",
            f"{cfg.kafka_lib}/*",
        ]

    services: dict[str, Service] = {
        "zookeeper": Service(
            name="zookeeper",
            ports={"client": p.zk},
            workdir=zk_dir,
            command=zk_command,
            probe=lambda: probe_zookeeper(p.zk),
            marker=str(zk_dir / "zoo.cfg"),
            logs=[],
            prepare=zk_prepare,
            startup_timeout=60,
        ),
    }
    for r in cfg.replicas:
        d = cfg.service_dir(f"clickhouse-{r.name}")

        def ch_prepare(r: Replica = r, d: Path = d) -> None:
            (d / "data").mkdir(parents=True, exist_ok=True)
            (d / "logs").mkdir(parents=True, exist_ok=True)
            (d / "config.xml").write_text(render_clickhouse_config(cfg, r))
            (d / "users.xml").write_text(CLICKHOUSE_USERS)
            make_tls_certificates(cfg.tls_dir)

        def ch_command(d: Path = d) -> list[str]:
            return [CLICKHOUSE_SERVER, f"--config-file={d / 'config.xml'}"]

        services[f"clickhouse-{r.name}"] = Service(
            name=f"clickhouse-{r.name}",
            ports={"tcp": r.tcp, "http": r.http, "interserver": r.interserver,
                   "tcp_secure": r.tcp_secure},
            workdir=d,
            command=ch_command,
            probe=lambda r=r: probe_clickhouse(r.http),  # type: ignore[misc]
            marker=str(d / "config.xml"),
            logs=[d / "logs" / "server.err.log", d / "logs" / "server.log"],
            prepare=ch_prepare,
            startup_timeout=90,
        )
    for b in cfg.kafka_brokers:
        kafka_dir = cfg.service_dir(b.service)
        # isolated: `ip netns exec` enters the node's namespace and execs java (same pid)
        netns = (["ip", "netns", "exec", cfg.broker_network.namespace(b.node_id)]
                 if cfg.isolate_brokers else [])
        services[b.service] = Service(
            name=b.service,
            ports={"broker": b.port, "controller": b.controller_port},
            workdir=kafka_dir,
            command=lambda b=b, d=kafka_dir, netns=netns: [  # type: ignore[misc]
                *netns, *kafka_java(b), "kafka.Kafka", str(d / "server.properties")],
            probe=lambda b=b: probe_kafka(b.port, host=b.host),  # type: ignore[misc]
            marker=str(kafka_dir / "server.properties"),
            logs=[],
            prepare=lambda b=b: kafka_prepare(b),  # type: ignore[misc]
            startup_timeout=120,
            host=b.host,
        )
    return services


# --------------------------------------------------------------------------------------------
# Installation


def log(msg: str) -> None:
    print(f"[stack] {msg}", file=sys.stderr, flush=True)


def missing_system_packages() -> list[str]:
    missing = []
    if not Path(CLICKHOUSE_SERVER).exists():
        missing.append("clickhouse-server")
    if not shutil.which("clickhouse-client"):
        missing.append("clickhouse-client")
    if not Path(ZOOKEEPER_JAR).exists():
        missing.append("zookeeper")
    if not shutil.which("java"):
        missing.append("openjdk-17-jre-headless")
    if not shutil.which("mvn"):
        missing.append("maven")
    if not shutil.which("openssl"):
        missing.append("openssl")
    return missing


def install_system_packages() -> None:
    missing = missing_system_packages()
    if not missing:
        return
    if os.geteuid() != 0:
        raise StackError(
            f"missing Debian packages: {' '.join(missing)}; run as root: "
            f"apt-get install -y {' '.join(missing)}"
        )
    log(f"apt-get install {' '.join(missing)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    res = subprocess.run(
        ["apt-get", "install", "-y", "--no-install-recommends", *missing], env=env, check=False
    )
    if res.returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, check=True)
        subprocess.run(
            ["apt-get", "install", "-y", "--no-install-recommends", *missing], env=env, check=True
        )
    # The Debian packages enable system services on ports 9000/2181; we don't use them.


def maven_copy_dependencies(
    cfg: StackConfig, name: str, deps: list[tuple[str, str, str]], out: Path
) -> list[str]:
    work = cfg.root / "maven" / name
    work.mkdir(parents=True, exist_ok=True)
    (work / "pom.xml").write_text(render_pom(name, deps))
    (work / "settings.xml").write_text(MAVEN_SETTINGS)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [
        "mvn",
        "-B",
        "-q",
        "-s",
        str(work / "settings.xml"),
        "-f",
        str(work / "pom.xml"),
        f"-Dmaven.repo.local={cfg.maven_repo}",
        f"{DEPENDENCY_PLUGIN}:copy-dependencies",
        f"-DoutputDirectory={tmp}",
        "-DincludeScope=runtime",
    ]
    log(f"resolving {name} from Maven Central: {', '.join(':'.join(d) for d in deps)}")
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        errors = "\n".join(line for line in res.stdout.splitlines() if "ERROR" in line)
        raise StackError(f"Maven could not resolve {name} ({shlex.join(cmd)}):\n{errors}")
    return sorted(p.name for p in tmp.glob("*.jar"))


def install_kafka(cfg: StackConfig) -> None:
    if (cfg.kafka_lib / "COMPLETE").exists():
        return
    jars = maven_copy_dependencies(cfg, "kafka", kafka_deps(cfg.kafka_version), cfg.kafka_lib)
    tmp = cfg.kafka_lib.with_name(cfg.kafka_lib.name + ".partial")
    (tmp / "COMPLETE").write_text("\n".join(jars) + "\n")
    shutil.rmtree(cfg.kafka_lib, ignore_errors=True)
    tmp.rename(cfg.kafka_lib)


def install_kafka_tools(cfg: StackConfig) -> None:
    """Resolve Kafka's admin tools into ``.stack/kafka-tools/<version>/`` (once; the
    first ``scripts/stack kafka-topics`` & co. or ``install`` does it)."""
    out = cfg.kafka_tools_lib
    if (out / "COMPLETE").exists():
        return
    jars = maven_copy_dependencies(cfg, "kafka-tools", kafka_tools_deps(cfg.kafka_version), out)
    tmp = out.with_name(out.name + ".partial")
    (tmp / "COMPLETE").write_text("\n".join(jars) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def install_spark_jars(cfg: StackConfig) -> None:
    if cfg.spark_version is None:
        log(
            "pyspark is not installed for this python, so no Spark connector jars yet: "
            "pip install -e '.[dev]' then run `scripts/stack install` (or set "
            "BLOCKAGG_SPARK_VERSION)"
        )
        return
    out = cfg.spark_jars_dir
    if (out / "COMPLETE").exists():
        return
    try:
        resolved = maven_copy_dependencies(cfg, "spark", spark_deps(cfg.spark_version), out)
    except StackError as e:
        raise StackError(
            f"{e}\nThe Kafka connector must match pyspark exactly ({cfg.spark_version}); "
            "if Maven Central lacks that version, install a pyspark version it has "
            "(see pyproject.toml)."
        ) from e
    tmp = out.with_name(out.name + ".partial")
    shipped_dir = pyspark_jars_dir()
    shipped = [p.name for p in shipped_dir.glob("*.jar")] if shipped_dir else []
    keep = jars_not_shipped(resolved, shipped)
    for name in resolved:
        if name not in keep:
            (tmp / name).unlink()
    (tmp / "COMPLETE").write_text("\n".join(keep) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def spark_jars(cfg: StackConfig) -> list[Path]:
    marker = cfg.spark_jars_dir / "COMPLETE"
    if not marker.exists():
        return []
    return [cfg.spark_jars_dir / n for n in marker.read_text().split()]


def install(cfg: StackConfig) -> None:
    install_system_packages()
    cfg.root.mkdir(parents=True, exist_ok=True)
    install_kafka(cfg)
    install_kafka_tools(cfg)
    install_spark_jars(cfg)


def installed(cfg: StackConfig) -> bool:
    return (
        not missing_system_packages()
        and (cfg.kafka_lib / "COMPLETE").exists()
        and (cfg.spark_version is None or (cfg.spark_jars_dir / "COMPLETE").exists())
    )



# --------------------------------------------------------------------------------------------
# Isolated brokers (`up --brokers 3 --isolate-brokers`, `cut`, `heal`)


@dataclasses.dataclass(frozen=True)
class BrokerNetwork:
    """Where ``--isolate-brokers`` puts a stack's Kafka nodes: node n in network namespace
    ``blockagg-<port>-n<n>``, joined by a veth pair (``bagg<port>n<n>`` in the root
    namespace, ``...p`` in the node's) to the bridge ``bagg<port>`` on the private subnet
    ``10.77.<port mod 256>.0/24`` (bridge .1, node n .1n), ``<port>`` being the stack's
    ``BLOCKAGG_KAFKA_PORT``. Two stacks on one machine never share a port, so never a name;
    their port shifts of a multiple of 1000 (CI's 0-9000) never share a subnet either, and
    ``up`` refuses a subnet already on the machine. Pure: names and addresses only."""

    tag: int  # the stack's BLOCKAGG_KAFKA_PORT
    nodes: int

    @classmethod
    def for_stack(cls, kafka_port: int, brokers: int) -> BrokerNetwork:
        return cls(kafka_port, brokers)

    @property
    def octet(self) -> int:
        return self.tag % 256

    @property
    def subnet(self) -> str:
        return f"{BROKER_SUBNET_PREFIX}.{self.octet}.0/24"

    @property
    def gateway(self) -> str:
        """The bridge's address: what the root namespace reaches the nodes from."""
        return f"{BROKER_SUBNET_PREFIX}.{self.octet}.1"

    @property
    def bridge(self) -> str:
        return f"bagg{self.tag}"

    def address(self, node: int) -> str:
        return f"{BROKER_SUBNET_PREFIX}.{self.octet}.{10 + node}"

    def namespace(self, node: int) -> str:
        return f"blockagg-{self.tag}-n{node}"

    def veth(self, node: int) -> str:
        """The root-namespace end of node ``node``'s veth pair: a cut sets it down."""
        return f"bagg{self.tag}n{node}"

    def peer(self, node: int) -> str:
        return f"bagg{self.tag}n{node}p"

    def record(self) -> str:
        """What ``up`` writes to BROKER_NET_FILE before creating anything, so ``down``
        removes exactly this stack's namespaces, veths and bridge, even after a crash."""
        lines = [f"subnet {self.subnet}", f"bridge {self.bridge}"]
        for n in range(1, self.nodes + 1):
            lines += [f"namespace {self.namespace(n)}", f"veth {self.veth(n)}"]
        return "# written by scripts/stack up --isolate-brokers\n" + "\n".join(lines) + "\n"


def parse_network_record(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        kind, _, name = line.partition(" ")
        if line and not line.startswith("#") and name:
            out.setdefault(kind, []).append(name.strip())
    return out


def isolation_problem(euid: int | None = None, ip: str | None = "") -> str | None:
    """Why ``--isolate-brokers`` cannot run here (one line), or None: it needs root and
    iproute2's ``ip`` to create network namespaces, veth pairs and a bridge."""
    euid = os.geteuid() if euid is None else euid
    ip = shutil.which("ip") if ip == "" else ip
    if euid != 0:
        return (f"--isolate-brokers needs root (uid {euid}): it creates network namespaces, "
                "veth pairs and a bridge; run as root or drop the flag")
    if ip is None:
        return ("--isolate-brokers needs iproute2's `ip` command, not found on PATH: "
                "apt-get install -y iproute2, or drop the flag")
    return None


def check_isolation(cfg: StackConfig) -> None:
    """Refuse ``--isolate-brokers`` in one line where it cannot work."""
    if cfg.brokers != 3:
        raise StackError(f"--isolate-brokers isolates the nodes of a cluster: give --brokers 3 "
                         f"(this stack has {cfg.brokers})")
    problem = isolation_problem()
    if problem:
        raise StackError(problem)


NETNS_DIR = Path("/var/run/netns")


def _link_exists(name: str) -> bool:
    """A network interface of the root namespace (this process's) by that name."""
    return Path("/sys/class/net", name).exists()


def _netns_exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


def _ip(*args: str) -> None:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise StackError(f"`ip {' '.join(args)}` failed: {res.stderr.strip()} "
                         "(docs/stack.md#isolated-brokers)")


def subnet_clash(subnet: str, addresses: Iterable[str]) -> str | None:
    """The first of ``addresses`` (``a.b.c.d/len``, as ``ip -o -4 addr`` lists them) whose
    network overlaps ``subnet``, or None."""
    net = ipaddress.ip_network(subnet)
    for a in addresses:
        with contextlib.suppress(ValueError):
            if ipaddress.ip_interface(a).network.overlaps(net):
                return a
    return None


def _root_addresses() -> list[str]:
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True,
                         check=False).stdout
    return [f.split()[3] for f in out.splitlines() if len(f.split()) > 3]


OWNER_ALIAS_PREFIX = "blockagg stack "
"""The bridge's alias (``ip link ... alias``, /sys/class/net/<bridge>/ifalias) is this
prefix + the folder of the stack that created it: the kernel keeps it while the folder may
go (a fresh clone, a deleted checkout), so ``up`` and ``down`` can tell whose it is."""


def owner_alias(root: Path) -> str | None:
    """The alias naming ``root`` as the bridge's owner, or None if it does not fit the
    kernel's 255 bytes (the network then works, only unnamed)."""
    alias = f"{OWNER_ALIAS_PREFIX}{root.resolve()}"
    return alias if len(alias.encode()) <= 255 else None


def alias_owner(alias: str) -> Path | None:
    """The stack folder an alias names, or None (no alias: a stack from before it)."""
    return Path(alias[len(OWNER_ALIAS_PREFIX):]) if alias.startswith(OWNER_ALIAS_PREFIX) else None


def leftover_verdict(root: Path, bridge: str, owner: Path | None, owner_has_record: bool,
                     live: Sequence[str]) -> str | None:
    """Whether ``up`` of the stack in ``root`` may take over the existing ``bridge`` it has
    no record of: None if so, else why not (one line). Pure.

    Any sign of life (``live``: a process in one of the network's namespaces, a node that
    answers) means a stack is running there: never touched. A stopped stack elsewhere that
    still records the network keeps it (its ``down`` removes it). Otherwise the network is
    a leftover of a stack that was killed and whose folder is gone or re-cloned (the kernel
    outlives both), and is taken over."""
    if live:
        return (f"bridge {bridge} is in use by the stack in {owner or 'another folder'} "
                f"({', '.join(live[:3])}): stop that stack or give this one other ports")
    if owner is not None and owner != root.resolve() and owner_has_record:
        return (f"bridge {bridge} belongs to the stopped stack in {owner}: "
                f"`BLOCKAGG_STACK_DIR={owner} scripts/stack down` removes it; or give this "
                "stack other ports")
    return None


def _bridge_alias(bridge: str) -> str:
    try:
        return Path("/sys/class/net", bridge, "ifalias").read_text().strip()
    except OSError:
        return ""


def _netns_pids(name: str) -> list[int]:
    if not _netns_exists(name):
        return []
    out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True,
                         check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _remove_links(names: Mapping[str, list[str]]) -> list[str]:
    """Delete the veths, namespaces and bridge listed (those that exist); what it removed.
    Veths first: deleting one end deletes the pair at once, whereas a deleted namespace's
    veths go when the kernel gets to it, racing a later ``ip link del``."""
    removed = []
    for link in names.get("veth", []):
        if _link_exists(link):
            _ip("link", "del", link)
            removed.append(link)
    for ns in names.get("namespace", []):
        if _netns_exists(ns):
            _ip("netns", "del", ns)
            removed.append(ns)
    for link in names.get("bridge", []):
        if _link_exists(link):
            _ip("link", "del", link)
            removed.append(link)
    return removed


def network_pids(net: BrokerNetwork) -> list[int]:
    """The processes running in ``net``'s namespaces: a live stack's nodes, whatever its
    ports look like from the root namespace (its nodes listen on their own addresses)."""
    return [p for n in range(1, net.nodes + 1) for p in _netns_pids(net.namespace(n))]


def answering_nodes(net: BrokerNetwork, kafka_port: int) -> list[str]:
    """The node addresses of ``net`` whose Kafka port accepts a connection (``host:port``):
    a live stack seen from this network namespace alone, for a process that does not see
    the namespaces' mounts under /var/run/netns (another mount namespace on this kernel)."""
    if not _link_exists(net.bridge):
        return []
    found = []
    for n in range(1, net.nodes + 1):
        host, port = net.address(n), kafka_port + BROKER_PORT_STEP * (n - 1)
        if port_in_use(port, host):
            found.append(f"{host}:{port}")
    return found


def network_in_use(net: BrokerNetwork, kafka_port: int) -> list[str]:
    """What shows ``net`` belongs to a running stack (pids, answering nodes); empty if none."""
    return ([f"pid {p}" for p in sorted(network_pids(net))]
            or [f"a Kafka node at {a}" for a in answering_nodes(net, kafka_port)])


def take_over_leftover(cfg: StackConfig) -> None:
    """The existing bridge of ``cfg``'s tag, which ``cfg.root`` has no record of: removed
    with its namespaces and veths if :func:`leftover_verdict` allows, else refused."""
    net = cfg.broker_network
    owner = alias_owner(_bridge_alias(net.bridge))
    live = network_in_use(net, cfg.ports.kafka)
    owner_has_record = owner is not None and (owner / BROKER_NET_FILE).exists()
    problem = leftover_verdict(cfg.root, net.bridge, owner, owner_has_record, live)
    if problem:
        raise StackError(problem)
    removed = _remove_links(parse_network_record(net.record()))
    log(f"removed the brokers' network left by a stack that no longer runs "
        f"({owner or 'folder unknown'}): {' '.join(removed)}")


def ensure_broker_network(cfg: StackConfig) -> None:
    """Create whatever of the stack's broker network is missing (idempotent: after a crash
    it completes what is there). An existing veth keeps its state: a cut node stays cut
    until ``heal``. A network of the same name this folder has no record of is taken over
    only when nothing runs in it (:func:`leftover_verdict`)."""
    check_isolation(cfg)
    net = cfg.broker_network
    record = cfg.root / BROKER_NET_FILE
    if _link_exists(net.bridge) and not record.exists():
        take_over_leftover(cfg)
    if not _link_exists(net.bridge):
        clash = subnet_clash(net.subnet, _root_addresses())
        if clash:
            raise StackError(f"the brokers' subnet {net.subnet} overlaps {clash} on this "
                             "machine; move BLOCKAGG_KAFKA_PORT (the third number is it mod 256)")
    cfg.root.mkdir(parents=True, exist_ok=True)
    record.write_text(net.record())
    if not _link_exists(net.bridge):
        _ip("link", "add", net.bridge, "type", "bridge", "forward_delay", "0")
        _ip("addr", "add", f"{net.gateway}/24", "dev", net.bridge)
        alias = owner_alias(cfg.root)
        if alias:
            _ip("link", "set", "dev", net.bridge, "alias", alias)
    _ip("link", "set", net.bridge, "up")
    for n in range(1, net.nodes + 1):
        ns, veth, peer = net.namespace(n), net.veth(n), net.peer(n)
        if not _netns_exists(ns):
            _ip("netns", "add", ns)
        if not _link_exists(veth):
            _ip("link", "add", veth, "type", "veth", "peer", "name", peer, "netns", ns)
            _ip("link", "set", veth, "master", net.bridge)
            _ip("link", "set", veth, "up")
        _ip("-n", ns, "addr", "replace", f"{net.address(n)}/24", "dev", peer)
        _ip("-n", ns, "link", "set", peer, "up")
        _ip("-n", ns, "link", "set", "lo", "up")


def teardown_broker_network(cfg: StackConfig) -> list[str]:
    """Remove the namespaces, veths and bridge that ``up`` recorded for this stack
    (whatever of them exists: idempotent, also after a crash); returns what it removed."""
    record = cfg.root / BROKER_NET_FILE
    if not record.exists():
        return []
    names = parse_network_record(record.read_text())
    problem = isolation_problem()
    if problem:
        raise StackError(f"cannot remove the brokers' network of {cfg.root}: {problem}")
    removed = []
    owners = {alias_owner(_bridge_alias(b)) for b in names.get("bridge", []) if _link_exists(b)}
    taken = {o for o in owners if o is not None and o != cfg.root.resolve()}
    if taken:
        log(f"the brokers' network recorded here is now the stack's in {taken.pop()}; "
            "left to it")
    else:
        removed = _remove_links(names)
    record.unlink()
    return removed


def _net_node(cfg: StackConfig, node: int) -> BrokerNetwork:
    if not cfg.isolate_brokers:
        raise StackError(f"Kafka node {node} is not isolated: a cut needs the stack started "
                         "with `scripts/stack up --brokers 3 --isolate-brokers`")
    if not 1 <= node <= cfg.brokers:
        raise StackError(f"no Kafka node {node} in this stack (nodes 1-{cfg.brokers})")
    return cfg.broker_network


def broker_is_cut(cfg: StackConfig, node: int) -> bool:
    """Node ``node``'s veth is administratively down (``cut``); False if it does not exist."""
    try:
        flags = int(Path("/sys/class/net", cfg.broker_network.veth(node), "flags")
                    .read_text(), 16)
    except (OSError, ValueError):
        return False
    return not flags & 0x1  # IFF_UP


def cut_broker(cfg: StackConfig, node: int) -> None:
    """Take node ``node`` off the network both ways: its veth down, so no client, peer,
    controller or its own fetch and heartbeat gets through; the process keeps running."""
    _ip("link", "set", _net_node(cfg, node).veth(node), "down")


def heal_broker(cfg: StackConfig, node: int) -> None:
    _ip("link", "set", _net_node(cfg, node).veth(node), "up")


# --------------------------------------------------------------------------------------------
# Commands


def port_in_use(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


UNANSWERED_GRACE = 30.0


def check_topology_change(cfg: StackConfig) -> None:
    """Refuse to turn a formatted single-broker stack into a cluster or back: a KRaft
    node's metadata log names its voters, so the other count would not start."""
    remembered, _ = read_topology(cfg.root, {})
    formatted = (cfg.service_dir("kafka") / "data" / "meta.properties").exists()
    if formatted and remembered != cfg.brokers:
        raise StackError(
            f"the stack in {cfg.root} holds a Kafka of {remembered} broker(s), not "
            f"{cfg.brokers}; `scripts/stack down --wipe` first, or use another "
            "BLOCKAGG_STACK_DIR (and ports)")
    # Isolating (or not) moves the nodes' addresses: only while they are stopped.
    if read_isolation(cfg.root, {}) != cfg.isolate_brokers:
        was = dataclasses.replace(cfg, isolate_brokers=not cfg.isolate_brokers)
        running = [s.name for s in build_services(was).values()
                   if s.name.startswith("kafka") and s.pid() is not None]
        if running:
            raise StackError(
                f"{', '.join(running)} run {'isolated' if was.isolate_brokers else 'on loopback'}; "
                "`scripts/stack down` first to change --isolate-brokers")


def cmd_up(cfg: StackConfig) -> int:
    t0 = time.monotonic()
    if cfg.isolate_brokers:
        check_isolation(cfg)
    check_topology_change(cfg)
    cfg.root.mkdir(parents=True, exist_ok=True)
    (cfg.root / TOPOLOGY_FILE).write_text(
        render_topology(cfg.brokers, cfg.shards, cfg.isolate_brokers))
    services = build_services(cfg)
    cut: set[str] = set()
    if cfg.isolate_brokers:
        ensure_broker_network(cfg)
        # a node cut on purpose does not answer: neither restart it nor wait for it
        cut = {b.service for b in cfg.kafka_brokers if broker_is_cut(cfg, b.node_id)}
        for name in sorted(cut):
            log(f"{name} is cut off the network (`scripts/stack heal` it); left as it is")
    if all(s.is_up() for s in services.values() if s.name not in cut):
        log(f"already up ({time.monotonic() - t0:.1f}s)")
        return 0
    if not installed(cfg):
        install(cfg)
    down = [s for s in services.values()
            if s.name not in cut and not s.is_up()
            and not (s.pid() is not None and s.answers_within(UNANSWERED_GRACE))]
    if not down:
        log(f"already up ({time.monotonic() - t0:.1f}s)")
        return 0
    for s in down:
        if s.pid() is not None:  # running but not answering for UNANSWERED_GRACE: restart it
            log(f"{s.name} runs but has not answered for {UNANSWERED_GRACE:.0f}s; restarting it")
            s.stop()
        for port in s.ports.values():
            if port_in_use(port, s.host):
                raise StackError(
                    f"{s.name}: port {port} is already in use by another process; "
                    f"free it or override the port (see scripts/stack --help)"
                )
    names = {s.name for s in down}

    def start_and_wait(group: list[str]) -> None:
        todo = [services[n] for n in group if n in names]
        for s in todo:
            log(f"starting {s.name} on {s.ports}")
            s.start()
        for s in todo:
            s.wait_up()
            log(f"{s.name} is up ({time.monotonic() - t0:.1f}s)")

    # Kafka is independent: start it first so its JVM warms up while ZK and ClickHouse start
    # (a cluster's nodes all at once: none answers before a quorum of controllers runs).
    kafkas = [b.service for b in cfg.kafka_brokers if b.service in names]
    for name in kafkas:
        log(f"starting {name} on {services[name].ports}")
        services[name].start()
    start_and_wait(["zookeeper"])
    start_and_wait([f"clickhouse-{r.name}" for r in cfg.replicas])
    for name in kafkas:
        services[name].wait_up()
        log(f"{name} is up ({time.monotonic() - t0:.1f}s)")
    if kafkas and cfg.brokers > 1:
        wait_cluster_formed([b for b in cfg.kafka_brokers if b.service not in cut])
        log(f"the Kafka cluster lists every node ({time.monotonic() - t0:.1f}s)")
    log(
        f'stack up in {time.monotonic() - t0:.1f}s; `eval "$(scripts/stack env)"` for its addresses'
    )
    return 0


def cmd_down(cfg: StackConfig, wipe: bool) -> int:
    services = build_services(cfg)
    # A cluster's nodes are told together: stopped one by one, the last ones lose their
    # controller quorum and wait out the stop timeout in their controlled shutdown.
    for b in cfg.kafka_brokers[1:]:
        services[b.service].terminate()
    if cfg.brokers > 1:
        services["kafka"].terminate()
    # Kafka and ClickHouse first, ZooKeeper last (ClickHouse wants it while shutting down).
    for name in [*(b.service for b in cfg.kafka_brokers),
                 *(f"clickhouse-{r.name}" for r in cfg.replicas), "zookeeper"]:
        s = services[name]
        if s.stop():
            log(f"stopped {name}")
        else:
            log(f"{name} was not running (under this stack)")
    if wipe:
        for s in services.values():
            if s.workdir.exists():
                shutil.rmtree(s.workdir)
        (cfg.root / CLUSTER_ID_FILE).unlink(missing_ok=True)
        log(f"wiped service data under {cfg.root} (installed jars kept)")
    removed = teardown_broker_network(cfg)
    if removed:
        log(f"removed the brokers' network: {' '.join(removed)}")
    return 0


def status_rows(cfg: StackConfig) -> list[tuple[str, bool, str, int | None, int]]:
    rows = []
    for s in build_services(cfg).values():
        pid = s.pid()
        up = pid is not None and s.probe()
        ports = " ".join(f"{k}={s.host}:{v}" for k, v in s.ports.items())
        rows.append((s.name, up, ports, pid, rss_kib(pid) if pid else 0))
    return rows


def network_rows(cfg: StackConfig) -> list[tuple[str, str, str]]:
    """``status``'s rows on an isolated stack's network (name, state, what): the bridge,
    and per node its address, namespace and veth (state ``cut`` while cut)."""
    if not cfg.isolate_brokers:
        return []
    net = cfg.broker_network
    rows = [("network", "up" if _link_exists(net.bridge) else "down",
             f"bridge {net.bridge} {net.gateway} on {net.subnet}")]
    for b in cfg.kafka_brokers:
        n = b.node_id
        state = ("down" if not _link_exists(net.veth(n))
                 else "cut" if broker_is_cut(cfg, n) else "up")
        rows.append((f"{b.service} link", state,
                     f"{b.host} in namespace {net.namespace(n)}, veth {net.veth(n)}"))
    return rows


def cmd_status(cfg: StackConfig) -> int:
    rows = status_rows(cfg)
    total = 0
    for name, up, ports, pid, rss in rows:
        total += rss
        state = "up" if up else "down"
        extra = f"pid {pid}, rss {rss // 1024} MiB" if pid else "not running"
        print(f"{name:14} {state:5} {ports}  ({extra})")
    print(f"{'total rss':14} {total // 1024} MiB")
    network = network_rows(cfg)
    for name, state, what in network:
        print(f"{name:14} {state:5} {what}")
    return 0 if all(up for _, up, *_ in rows) and all(
        state == "up" for _, state, _ in network) else 1


def cmd_link(cfg: StackConfig, node: int, up: bool) -> int:
    (heal_broker if up else cut_broker)(cfg, node)
    log(f"node {node} ({cfg.broker_network.address(node)}) "
        f"{'back on' if up else 'cut off'} the network")
    return 0


def cmd_env(cfg: StackConfig) -> int:
    for line in env_lines(cfg, spark_jars(cfg)):
        print(line)
    return 0


def cmd_kafka_tool(cfg: StackConfig, tool: str, args: Sequence[str]) -> int:
    install_kafka_tools(cfg)
    return subprocess.run(kafka_tool_command(cfg, tool, args), check=False).returncode


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/stack",
        description="Local blockagg stack on 127.0.0.1: Kafka (KRaft; 1 or 3 brokers), ZooKeeper, "
        "two ClickHouse replicas per shard (1 or 2 shards), Spark Kafka connector jars. "
        "State in .stack/.",
        epilog="Ports (env override, default): "
        + ", ".join(f"{var}={default}" for var, default in PORT_DEFAULTS.values())
        + ". Also BLOCKAGG_STACK_DIR, BLOCKAGG_KAFKA_VERSION, BLOCKAGG_SPARK_VERSION, "
        f"{BROKERS_VAR}, {SHARDS_VAR} (docs/stack.md).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("install", help="install Debian packages, resolve jars (up does it if needed)")
    up = sub.add_parser("up", help="start whatever is not running and wait until it answers")
    up.add_argument("--brokers", type=int, choices=BROKER_COUNTS,
                    help="Kafka nodes (KRaft, broker+controller each); remembered in the "
                    "stack dir (default: as remembered, else 1)")
    up.add_argument("--shards", type=int, choices=SHARD_COUNTS,
                    help="ClickHouse shards of two replicas; remembered likewise")
    up.add_argument("--isolate-brokers", action="store_true", default=None,
                    help="with --brokers 3: each Kafka node in its own network namespace on "
                    "a private subnet, so `cut N` can take it off the network (needs root "
                    "and ip; remembered likewise)")
    for verb, what in (("cut", "take Kafka node N off the network both ways (its veth "
                                "down; the process keeps running)"),
                       ("heal", "put Kafka node N back on the network")):
        link = sub.add_parser(verb, help=f"{what}; --isolate-brokers stacks only")
        link.add_argument("node", type=int, help="the node id (1-3)")
    down = sub.add_parser("down", help="stop the processes up started")
    down.add_argument("--wipe", action="store_true", help="also delete their data and logs")
    sub.add_parser("status", help="per service: up/down and port; non-zero if anything is down")
    sub.add_parser("env", help="print export lines for eval")
    for tool, main_class in KAFKA_TOOLS.items():
        sub.add_parser(  # dispatched below before parsing: its arguments are the tool's
            tool, help=f"Kafka's {tool}.sh ({main_class}) against the stack's broker "
            "(--bootstrap-server defaults to it); arguments as for the .sh tool")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in KAFKA_TOOLS:
        try:
            return cmd_kafka_tool(StackConfig.from_env(), argv[0], argv[1:])
        except StackError as e:
            print(f"scripts/stack {argv[0]}: {e}", file=sys.stderr)
            return 1
    args = parser.parse_args(argv)
    try:
        cfg = StackConfig.from_env()
        if args.command == "install":
            install(cfg)
            return 0
        if args.command == "up":
            return cmd_up(cfg.with_topology(args.brokers, args.shards, args.isolate_brokers))
        if args.command in ("cut", "heal"):
            return cmd_link(cfg, args.node, up=args.command == "heal")
        if args.command == "down":
            return cmd_down(cfg, args.wipe)
        if args.command == "status":
            return cmd_status(cfg)
        return cmd_env(cfg)
    except StackError as e:
        print(f"scripts/stack {args.command}: {e}", file=sys.stderr)
        return 1
