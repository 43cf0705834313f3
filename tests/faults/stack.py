"""Killing, pausing and restarting the services of a local stack (``scripts/stack``).

The fault suite runs on its **own** stack (:func:`fault_stack_env`: its own
``BLOCKAGG_STACK_DIR`` and ports, default ports + 2000) so that killing ClickHouse or
the broker never disturbs the integration tests of others using the default stack. It
shares the installed jars with the default stack through symlinks.

* :meth:`StackControl.kill9` sends SIGKILL to a service's pid (from its pid file,
  checked against its command line, so a recycled pid is never hit) and waits until
  it is gone: a crash, not a shutdown; nothing is flushed.
* :meth:`StackControl.up` is ``scripts/stack up``: it starts whatever is down and
  waits until every service answers, which is how an operator recovers.
* :meth:`StackControl.paused` SIGSTOPs a service for a while (then SIGCONTs it, even
  on error): its sockets stay open but nothing answers, so clients time out; for
  ZooKeeper this makes the ClickHouse replicas lose their sessions and refuse inserts.

The same stack runs as a Kafka cluster (``fault_stack_env(brokers=3)``: three KRaft
nodes, RF 3, min.insync.replicas 2; see docs/stack.md): :meth:`StackControl.kill9_broker`
and :meth:`StackControl.restart_broker` address one node by its id, and
:meth:`StackControl.leader`, :meth:`StackControl.group_coordinator` and
:meth:`StackControl.transaction_coordinator` ask the cluster's own metadata which node
leads a partition, so a fault can kill the node that matters;
:meth:`StackControl.active_controller` asks the KRaft quorum for its leader,
:meth:`StackControl.stop_broker` is a controlled shutdown (SIGTERM), and
:meth:`StackControl.wait_in_sync` waits until every partition has its full ISR, as an
operator does before touching the next node. :func:`cluster_stack_env` is the private
three-node stack of the cluster tests (``.stack/cluster``, ports + 4000), its nodes
isolated in network namespaces where the machine allows it (root and ``ip``), so that
:meth:`StackControl.cut` takes one node off the network both ways (``scripts/stack cut``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
JOB_PY = REPO_ROOT / "blockagg" / "spark" / "job.py"
STACK = REPO_ROOT / "scripts" / "stack"
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from scripts import stack_lib  # noqa: E402

SERVICES = stack_lib.SERVICES
FAULT_PORT_SHIFT = 2000


def fault_stack_env(base: Mapping[str, str] | None = None, shift: int = FAULT_PORT_SHIFT,
                    root: Path | None = None, brokers: int = 1, shards: int = 1,
                    isolate_brokers: bool = False) -> dict[str, str]:
    """The environment of the fault suite's private stack: every ``BLOCKAGG_*_PORT``
    at its default + ``shift`` and ``BLOCKAGG_STACK_DIR`` under ``.stack/faults``
    (``BLOCKAGG_FAULT_STACK_DIR`` / ``BLOCKAGG_FAULT_PORT_SHIFT`` override); ``brokers``
    Kafka nodes and ``shards`` ClickHouse shards (``scripts/stack up --brokers/--shards``),
    and whether the nodes are isolated (``--isolate-brokers``), always explicit so a
    cluster's exported variables in the caller's shell don't leak in."""
    env = dict(os.environ if base is None else base)
    env[stack_lib.BROKERS_VAR] = str(brokers)
    env[stack_lib.SHARDS_VAR] = str(shards)
    env[stack_lib.ISOLATE_VAR] = "1" if isolate_brokers else "0"
    shift = int(env.get("BLOCKAGG_FAULT_PORT_SHIFT", shift))
    folder = Path(env.get("BLOCKAGG_FAULT_STACK_DIR") or root or REPO_ROOT / ".stack" / "faults")
    env["BLOCKAGG_STACK_DIR"] = str(folder)
    for var, default in stack_lib.PORT_DEFAULTS.values():
        env[var] = str(default + shift)
    return env


CLUSTER_SHIFTS = (4000, 9000)
"""The cluster stack's port shifts, the first free one taken: ``.ci/run`` gives the default
stack 0/1000/5000/7000 and the fault suite 2000/3000/6000/8000."""


def cluster_shift(env: Mapping[str, str] | None = None) -> int:
    """``BLOCKAGG_CLUSTER_PORT_SHIFT``, else the first of :data:`CLUSTER_SHIFTS` whose ports
    (every service's and the two extra brokers') are all free and whose isolated brokers'
    network, if any, has nothing running in it (its nodes listen off loopback)."""
    env = os.environ if env is None else env
    if env.get("BLOCKAGG_CLUSTER_PORT_SHIFT"):
        return int(env["BLOCKAGG_CLUSTER_PORT_SHIFT"])
    for shift in CLUSTER_SHIFTS:
        ports = [d + shift for _, d in stack_lib.PORT_DEFAULTS.values()]
        ports += [stack_lib.PORT_DEFAULTS["kafka"][1] + shift + step for step in (2, 3, 4, 5)]
        kafka = stack_lib.PORT_DEFAULTS["kafka"][1] + shift
        net = stack_lib.BrokerNetwork.for_stack(kafka, 3)
        if (not any(stack_lib.port_in_use(p) for p in ports)
                and not stack_lib.network_in_use(net, kafka)):
            return shift
    raise RuntimeError(f"no free port shift among {CLUSTER_SHIFTS} for the cluster stack; "
                       "set BLOCKAGG_CLUSTER_PORT_SHIFT")


def cluster_stack_env(shift: int | None = None) -> dict[str, str]:
    """The private three-broker, two-shard stack of the cluster tests: ports at default +
    :func:`cluster_shift`, ``BLOCKAGG_CLUSTER_STACK_DIR`` else ``.stack/cluster`` (at shift
    4000; ``.stack/cluster-<shift>`` at another, so two never share a folder); its nodes
    isolated (``--isolate-brokers``) unless :func:`stack_lib.isolation_problem` says why
    not here, in which case ``broker_cut`` is refused, naming that reason."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("BLOCKAGG_FAULT_PORT_SHIFT", "BLOCKAGG_FAULT_STACK_DIR")}
    shift = cluster_shift(base) if shift is None else shift
    default = REPO_ROOT / ".stack" / ("cluster" if shift == 4000 else f"cluster-{shift}")
    return fault_stack_env(base, shift=shift, brokers=3, shards=2,
                           root=Path(os.environ.get("BLOCKAGG_CLUSTER_STACK_DIR") or default),
                           isolate_brokers=stack_lib.isolation_problem() is None)


def link_installed_jars(env: Mapping[str, str]) -> None:
    """Let a private stack dir reuse the default stack's resolved jars (no Maven run)."""
    folder = Path(env["BLOCKAGG_STACK_DIR"])
    folder.mkdir(parents=True, exist_ok=True)
    # the checkout's own stack, else the one this process was pointed at (a worktree
    # working against another checkout's stack)
    shared = REPO_ROOT / ".stack"
    if not (shared / "kafka-lib").is_dir() and os.environ.get("BLOCKAGG_STACK_DIR"):
        shared = Path(os.environ["BLOCKAGG_STACK_DIR"])
    for name in ("kafka-lib", "kafka-tools", "spark-jars"):
        link = folder / name
        if not link.exists() and (shared / name).is_dir() and folder != shared:
            link.symlink_to(shared / name)


class StackControl:
    """Control of one stack, addressed by its environment (``scripts/stack`` vars)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self.cfg = stack_lib.StackConfig.from_env(self.env)
        self.services = stack_lib.build_services(self.cfg)
        self._up_lock = threading.Lock()  # overlapping faults: one `scripts/stack up` at a time

    # -- addresses -----------------------------------------------------------------

    @property
    def bootstrap(self) -> str:
        """Every broker's address (``bootstrap.servers``)."""
        return self.cfg.bootstrap_servers

    @property
    def broker_ids(self) -> tuple[int, ...]:
        return tuple(b.node_id for b in self.cfg.kafka_brokers)

    def broker_address(self, node_id: int) -> str:
        """``host:port`` of node ``node_id`` alone (its own address when isolated)."""
        for b in self.cfg.kafka_brokers:
            if b.node_id == node_id:
                return f"{b.host}:{b.port}"
        raise KeyError(f"no Kafka node {node_id} in this stack (nodes {self.broker_ids})")

    def cut_unavailable(self) -> str | None:
        """Why :meth:`cut` cannot run on this stack (one line), or None."""
        if self.cfg.isolate_brokers:
            return None
        problem = stack_lib.isolation_problem()
        return ("its Kafka nodes are not isolated in network namespaces (scripts/stack up "
                "--brokers 3 --isolate-brokers)" + (f": {problem}" if problem else ""))

    def broker_service(self, node_id: int) -> str:
        """The service name of Kafka node ``node_id`` (``kafka``, ``kafka-2``, ...)."""
        for b in self.cfg.kafka_brokers:
            if b.node_id == node_id:
                return b.service
        raise KeyError(f"no Kafka node {node_id} in this stack (nodes {self.broker_ids})")

    def leader(self, topic: str, partition: int, timeout: float = 10.0) -> int:
        """The node id leading ``topic``'s ``partition``, from the cluster's metadata
        (-1 while it has none, e.g. right after its leader died)."""
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        meta = admin.list_topics(topic, timeout=timeout)
        t = meta.topics[topic]
        if t.error is not None:
            raise RuntimeError(f"topic {topic}: {t.error}")
        return int(t.partitions[partition].leader)

    def _coordinator(self, internal: str, key: str, timeout: float) -> int:
        from confluent_kafka.admin import AdminClient

        from blockagg.aggregator.kafka.hanging import offsets_partition

        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        t = admin.list_topics(internal, timeout=timeout).topics[internal]
        if t.error is not None or not t.partitions:
            raise RuntimeError(f"{internal} does not exist yet ({t.error}); "
                               "a first commit or transaction creates it")
        # Kafka places a group or a transactional id with the same hash (Utils.abs of
        # Java's String.hashCode) modulo the internal topic's partition count.
        return self.leader(internal, offsets_partition(key, len(t.partitions)), timeout)

    def group_coordinator(self, group: str, timeout: float = 10.0) -> int:
        """The node coordinating ``group``: leader of its ``__consumer_offsets`` partition."""
        return self._coordinator("__consumer_offsets", group, timeout)

    def transaction_coordinator(self, transactional_id: str, timeout: float = 10.0) -> int:
        """The node coordinating ``transactional_id``: leader of its
        ``__transaction_state`` partition."""
        return self._coordinator("__transaction_state", transactional_id, timeout)

    def kafka_tool(self, tool: str, *args: str, timeout: float = 120.0) -> str:
        """``scripts/stack <tool> <args>`` (Kafka's admin tools, ``--bootstrap-server``
        this stack's brokers); its stdout. Raises with its output if it failed."""
        link_installed_jars(self.env)
        stack_lib.install_kafka_tools(self.cfg)
        res = subprocess.run(stack_lib.kafka_tool_command(self.cfg, tool, args), env=self.env,
                             capture_output=True, text=True, timeout=timeout, check=False)
        if res.returncode != 0:
            raise RuntimeError(f"{tool} {' '.join(args)} failed ({res.returncode}): "
                               f"{res.stdout[-2000:]} {res.stderr[-2000:]}")
        return res.stdout

    def active_controller(self, timeout: float = 60.0) -> int:
        """The node id leading the KRaft quorum (the active controller), as
        ``kafka-metadata-quorum describe --status`` reports it. Not AdminClient's
        ``describe_cluster().controller``: a KRaft broker answers that with a random live
        broker."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                out = self.kafka_tool("kafka-metadata-quorum", "describe", "--status")
                found = re.search(r"^LeaderId:\s*(-?\d+)", out, re.M)
                if found and int(found.group(1)) >= 0:
                    return int(found.group(1))
                problem = f"no leader in: {out[-500:]}"
            except RuntimeError as exc:
                problem = str(exc)
            if time.monotonic() > deadline:
                raise RuntimeError(f"the KRaft quorum has no leader after {timeout:.0f}s: "
                                   f"{problem}")
            time.sleep(1)

    def leaders(self, topic: str, timeout: float = 10.0) -> dict[int, tuple[int, list[int]]]:
        """Per partition of ``topic``: its leader and its replicas (preferred first)."""
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        t = admin.list_topics(topic, timeout=timeout).topics[topic]
        if t.error is not None:
            raise RuntimeError(f"topic {topic}: {t.error}")
        return {p: (int(m.leader), [int(r) for r in m.replicas])
                for p, m in t.partitions.items()}

    def out_of_sync(self, timeout: float = 10.0) -> list[str]:
        """Every partition (of every topic) without a leader or with fewer in-sync
        replicas than replicas in **any** node's view, as ``topic[p] leader L isr I/R
        (node N)``. Each node is asked alone: a node just back from a cut answers from
        the metadata it had before the cut (every ISR full, itself a leader) until the
        controller's updates reach it, so one node's view, whichever the client picks,
        may call a cluster in sync that is not."""
        from confluent_kafka.admin import AdminClient

        out = []
        for node in self.broker_ids:
            admin = AdminClient({"bootstrap.servers": self.broker_address(node),
                                 "log_level": 0})
            for name, t in admin.list_topics(timeout=timeout).topics.items():
                for p, m in t.partitions.items():
                    if m.leader < 0 or len(m.isrs) < len(m.replicas):
                        out.append(f"{name}[{p}] leader {m.leader} isr "
                                   f"{len(m.isrs)}/{len(m.replicas)} (node {node})")
        return out

    def wait_in_sync(self, timeout: float = 180.0) -> float:
        """Wait until every partition has a leader and its full ISR (a restarted node has
        caught up), as an operator does before the next node of a rolling restart;
        returns the seconds it took."""
        started = time.monotonic()
        pending: list[str] = []
        while time.monotonic() - started < timeout:
            try:
                pending = self.out_of_sync()
            except Exception as exc:  # a node restarting: its metadata request may fail
                pending = [repr(exc)]
            if not pending:
                return time.monotonic() - started
            time.sleep(0.5)
        raise RuntimeError(f"partitions not fully in sync after {timeout:.0f}s: "
                           f"{', '.join(pending[:10])}")

    def stop_broker(self, node_id: int, timeout: float = 180.0) -> int:
        """A controlled shutdown of Kafka node ``node_id`` (SIGTERM, as ``kafka-server-
        stop.sh`` sends: it moves its leaderships away before it exits); waits until it
        is gone and its ports are free; returns the pid it had."""
        svc = self.services[self.broker_service(node_id)]
        pid = svc.pid()
        if pid is None:
            raise RuntimeError(f"Kafka node {node_id} is not running; nothing to stop")
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while stack_lib.pid_alive(pid, svc.marker) or any(
                stack_lib.port_in_use(port, svc.host) for port in svc.ports.values()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"Kafka node {node_id} (pid {pid}) still running "
                                   f"{timeout:.0f}s after SIGTERM")
            time.sleep(0.1)
        return pid

    def move_preferred_leaders(self, topic: str) -> dict[int, tuple[int, int]]:
        """Move the leaders of ``topic`` under its readers, by the operator's tools: a
        reassignment that keeps each partition's replicas but rotates their order (a
        preferred replica other than its leader now; nothing is copied), then a
        preferred-leader election. Returns per partition (leader before, leader after)."""
        before = self.leaders(topic)
        plan = {"version": 1, "partitions": [
            {"topic": topic, "partition": p, "replicas": _rotated_away(replicas, leader)}
            for p, (leader, replicas) in sorted(before.items())]}
        folder = Path(self.env["BLOCKAGG_STACK_DIR"])
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"reassign-{topic}.json"
        path.write_text(json.dumps(plan))
        self.kafka_tool("kafka-reassign-partitions", "--reassignment-json-file", str(path),
                        "--execute")
        deadline = time.monotonic() + 120
        while "is complete" not in (out := self.kafka_tool(
                "kafka-reassign-partitions", "--reassignment-json-file", str(path),
                "--verify")) or "still in progress" in out:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the reassignment of {topic} did not complete: {out}")
            time.sleep(1)
        elect = folder / f"elect-{topic}.json"
        elect.write_text(json.dumps({"partitions": [{"topic": topic, "partition": p}
                                                    for p in sorted(before)]}))
        self.kafka_tool("kafka-leader-election", "--election-type", "PREFERRED",
                        "--path-to-json-file", str(elect))
        after = self.leaders(topic)
        return {p: (before[p][0], after[p][0]) for p in before}

    @property
    def ch_ports(self) -> tuple[int, int]:
        """Shard 01's replicas (r1, r2)."""
        return (self.cfg.ports.ch1_tcp, self.cfg.ports.ch2_tcp)

    @property
    def shard_ch_ports(self) -> list[tuple[int, ...]]:
        """Every shard's replicas' native ports, shard 01 first."""
        return [tuple(r.tcp for r in replicas)
                for _, replicas in sorted(self.cfg.shard_replicas().items())]

    @property
    def replica_services(self) -> list[str]:
        """Every ClickHouse replica's service name (``clickhouse-r1`` ...), shard order."""
        return [f"clickhouse-{r.name}" for r in self.cfg.replicas]

    @property
    def zk_port(self) -> int:
        return self.cfg.ports.zk

    def exported(self) -> dict[str, str]:
        """What ``scripts/stack env`` prints, as a dict."""
        out = subprocess.run([sys.executable, str(STACK), "env"], env=self.env,
                             capture_output=True, text=True, timeout=60, check=True).stdout
        values: dict[str, str] = {}
        for line in out.splitlines():
            if line.startswith("export ") and "=" in line:
                key, _, value = line[len("export "):].partition("=")
                values[key] = value.strip("'\"")
        return values

    # -- processes -----------------------------------------------------------------

    def pid(self, service: str) -> int | None:
        return self.services[service].pid()

    def is_up(self, service: str) -> bool:
        return self.services[service].is_up()

    def up(self, timeout: float = 300.0) -> float:
        """``scripts/stack up`` (starts what is down); returns the seconds it took."""
        link_installed_jars(self.env)
        started = time.monotonic()
        with self._up_lock:
            res = subprocess.run([sys.executable, str(STACK), "up"], env=self.env,
                                 capture_output=True, text=True, timeout=timeout, check=False)
        if res.returncode != 0:
            raise RuntimeError(f"scripts/stack up failed ({res.returncode}):\n"
                               f"{res.stdout[-4000:]}\n{res.stderr[-4000:]}")
        return time.monotonic() - started

    def wait_replicas_writable(self, timeout: float = 180.0) -> float:
        """Wait until every replicated table on both replicas is writable (not read-only,
        its ZooKeeper session live); returns the seconds it took.

        After ZooKeeper itself was killed, its restart brings back the dead servers'
        sessions, and their ``is_active`` nodes with them, until each session times out:
        meanwhile a restarted replica can't activate, and the other one counts it as
        alive for a quorum. An operator who restarted everything waits for this."""
        from clickhouse_driver import Client

        started = time.monotonic()
        deadline = started + timeout
        pending: list[str] = []
        while True:
            pending = []
            for port in (p for ports in self.shard_ch_ports for p in ports):
                try:
                    client = Client(stack_lib.HOST, port=port, connect_timeout=3,
                                    send_receive_timeout=10)
                    rows = client.execute(
                        "SELECT database, table FROM system.replicas "
                        "WHERE is_readonly OR is_session_expired")
                    client.disconnect()
                    pending += [f"{d}.{t}@{port}" for d, t in rows]
                except Exception as exc:
                    pending.append(f"{port}: {exc.__class__.__name__}")
            if not pending:
                return time.monotonic() - started
            if time.monotonic() > deadline:
                raise RuntimeError(f"replicas not writable after {timeout:.0f} s: "
                                   f"{', '.join(pending[:10])}")
            time.sleep(0.5)

    def replication_report(self) -> str:
        """Each replica's unhealthy replicated tables and stuck queue entries, for a
        failed test's message (what ``system.replicas`` and ``replication_queue`` say)."""
        from clickhouse_driver import Client

        lines: list[str] = []
        for port in (p for ports in self.shard_ch_ports for p in ports):
            try:
                client = Client(stack_lib.HOST, port=port, connect_timeout=3,
                                send_receive_timeout=10)
                for row in client.execute(
                        "SELECT database, table, is_readonly, is_session_expired, "
                        "queue_size, inserts_in_queue, absolute_delay, active_replicas, "
                        "total_replicas FROM system.replicas WHERE is_readonly "
                        "OR is_session_expired OR queue_size > 0 "
                        "OR active_replicas < total_replicas"):
                    lines.append(f"replica {port}: {row}")
                for row in client.execute(
                        "SELECT database, table, type, new_part_name, num_tries, "
                        "last_exception FROM system.replication_queue "
                        "WHERE num_tries > 1 LIMIT 10"):
                    lines.append(f"queue {port}: {row}")
                client.disconnect()
            except Exception as exc:
                lines.append(f"replica {port}: {exc!r}")
        return "\n".join(lines) or "replication: every replica healthy"

    def down(self, timeout: float = 120.0) -> None:
        subprocess.run([sys.executable, str(STACK), "down"], env=self.env,
                       capture_output=True, text=True, timeout=timeout, check=False)

    def kill9(self, service: str, timeout: float = 30.0) -> int:
        """SIGKILL the service; returns the pid it had. Raises if it was not running."""
        svc = self.services[service]
        pid = svc.pid()
        if pid is None:
            raise RuntimeError(f"{service} is not running; nothing to kill")
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        # A dying process loses its command line (the marker) before its sockets: wait
        # for its ports too, or an immediate ``up`` finds them "in use by another
        # process" (CI met it once after a kill -9 of the broker).
        while stack_lib.pid_alive(pid, svc.marker) or any(
                stack_lib.port_in_use(port, svc.host) for port in svc.ports.values()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{service} (pid {pid}) survived SIGKILL for {timeout}s")
            time.sleep(0.05)
        return pid

    def kill9_broker(self, node_id: int, timeout: float = 30.0) -> int:
        """SIGKILL Kafka node ``node_id`` alone; returns the pid it had."""
        return self.kill9(self.broker_service(node_id), timeout)

    def restart_broker(self, node_id: int) -> float:
        """kill -9 of node ``node_id`` then ``scripts/stack up``: seconds until it answers."""
        return self.restart(self.broker_service(node_id))

    def restart(self, service: str) -> float:
        """kill -9 then ``scripts/stack up``: seconds until the service answers again."""
        self.kill9(service)
        return self.up()

    def pause(self, service: str) -> int:
        pid = self.pid(service)
        if pid is None:
            raise RuntimeError(f"{service} is not running; nothing to pause")
        os.kill(pid, signal.SIGSTOP)
        return pid

    def resume(self, service: str, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)

    @contextlib.contextmanager
    def paused(self, service: str) -> Iterator[int]:
        """SIGSTOP ``service`` for the ``with`` body; always SIGCONT afterwards."""
        pid = self.pause(service)
        try:
            yield pid
        finally:
            self.resume(service, pid)

    def cut_broker(self, node_id: int) -> None:
        """Take Kafka node ``node_id`` off the network both ways (``scripts/stack cut``:
        its veth down): clients, peers' fetches, its own fetches and heartbeats and the
        KRaft quorum's traffic all stop; the process runs on, unaware."""
        stack_lib.cut_broker(self.cfg, node_id)

    def heal_broker(self, node_id: int) -> None:
        stack_lib.heal_broker(self.cfg, node_id)

    def is_cut(self, node_id: int) -> bool:
        return stack_lib.broker_is_cut(self.cfg, node_id)

    @contextlib.contextmanager
    def cut(self, node_id: int) -> Iterator[None]:
        """Node ``node_id`` cut off for the ``with`` body; always healed afterwards."""
        self.cut_broker(node_id)
        try:
            yield
        finally:
            self.heal_broker(node_id)

    def unreachable_for(self, service: str, seconds: float) -> None:
        """Make ``service`` unreachable (stopped) for ``seconds``, then resume it."""
        with self.paused(service):
            time.sleep(seconds)


def _rotated_away(replicas: list[int], leader: int) -> list[int]:
    """``replicas`` rotated by one, or by two if that would make ``leader`` the preferred
    replica again: the same set, a preferred replica other than the current leader."""
    once = replicas[1:] + replicas[:1]
    return once[1:] + once[:1] if once[0] == leader and len(replicas) > 2 else once


def restart_times(control: StackControl, services: tuple[str, ...], repeat: int
                  ) -> dict[str, list[float]]:
    """Seconds from kill -9 to the service answering again after ``scripts/stack up``."""
    out: dict[str, list[float]] = {s: [] for s in services}
    for _ in range(repeat):
        for service in services:
            started = time.monotonic()
            control.kill9(service)
            control.up()
            out[service].append(round(time.monotonic() - started, 2))
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.faults.stack restart-times [--repeat N]`` on the private stack."""
    import argparse
    import json

    ap = argparse.ArgumentParser(description="kill -9 / restart timings of the fault stack")
    ap.add_argument("command", choices=["restart-times", "up", "down", "env"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--brokers", type=int, choices=stack_lib.BROKER_COUNTS, default=1)
    ap.add_argument("--shards", type=int, choices=stack_lib.SHARD_COUNTS, default=1)
    args = ap.parse_args(argv)
    control = StackControl(fault_stack_env(brokers=args.brokers, shards=args.shards))
    if args.command == "up":
        control.up()
    elif args.command == "down":
        control.down()
    elif args.command == "env":
        for key, value in sorted(control.exported().items()):
            print(f"export {key}={value}")
    else:
        control.up()
        print(json.dumps(restart_times(control, tuple(control.services), args.repeat)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
