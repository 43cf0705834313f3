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
leads a partition, so a fault can kill the node that matters.
"""

from __future__ import annotations

import contextlib
import os
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
                    root: Path | None = None, brokers: int = 1, shards: int = 1
                    ) -> dict[str, str]:
    """The environment of the fault suite's private stack: every ``BLOCKAGG_*_PORT``
    at its default + ``shift`` and ``BLOCKAGG_STACK_DIR`` under ``.stack/faults``
    (``BLOCKAGG_FAULT_STACK_DIR`` / ``BLOCKAGG_FAULT_PORT_SHIFT`` override); ``brokers``
    Kafka nodes and ``shards`` ClickHouse shards (``scripts/stack up --brokers/--shards``),
    always explicit so a cluster's exported variables in the caller's shell don't leak in."""
    env = dict(os.environ if base is None else base)
    env[stack_lib.BROKERS_VAR] = str(brokers)
    env[stack_lib.SHARDS_VAR] = str(shards)
    shift = int(env.get("BLOCKAGG_FAULT_PORT_SHIFT", shift))
    folder = Path(env.get("BLOCKAGG_FAULT_STACK_DIR") or root or REPO_ROOT / ".stack" / "faults")
    env["BLOCKAGG_STACK_DIR"] = str(folder)
    for var, default in stack_lib.PORT_DEFAULTS.values():
        env[var] = str(default + shift)
    return env


def link_installed_jars(env: Mapping[str, str]) -> None:
    """Let a private stack dir reuse the default stack's resolved jars (no Maven run)."""
    folder = Path(env["BLOCKAGG_STACK_DIR"])
    folder.mkdir(parents=True, exist_ok=True)
    # the checkout's own stack, else the one this process was pointed at (a worktree
    # working against another checkout's stack)
    shared = REPO_ROOT / ".stack"
    if not (shared / "kafka-lib").is_dir() and os.environ.get("BLOCKAGG_STACK_DIR"):
        shared = Path(os.environ["BLOCKAGG_STACK_DIR"])
    for name in ("kafka-lib", "spark-jars"):
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

    @property
    def ch_ports(self) -> tuple[int, int]:
        return (self.cfg.ports.ch1_tcp, self.cfg.ports.ch2_tcp)

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
            for port in self.ch_ports:
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
        for port in self.ch_ports:
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
                stack_lib.port_in_use(port) for port in svc.ports.values()):
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

    def unreachable_for(self, service: str, seconds: float) -> None:
        """Make ``service`` unreachable (stopped) for ``seconds``, then resume it."""
        with self.paused(service):
            time.sleep(seconds)


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
