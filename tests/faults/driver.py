"""Running the real job under faults, and the long run: ``python -m tests.faults.driver``.

:class:`Job` runs ``spark/job.py`` as a plain Python driver process (pyspark starts
the JVM as its child, in the same session, so ``killpg`` is a kill -9 of the whole
job) against the suite's private stack, with its ClickHouse replicas reached through
one :class:`~tests.faults.proxy.FaultProxy` per replica (of every shard: with two, the
workload writes one topic per shard and the job maps each to its shard's proxies) and
the task hooks of :mod:`tests.faults.hooks` installed. A job that exits (a batch failed, e.g.
because ClickHouse refused inserts for longer than the writer's retries) is restarted by
:meth:`Job.ensure_running`, as a supervisor (systemd, Kubernetes) would.

:func:`inject` applies one named fault (:data:`KINDS`, the issue's list) and recovers
from it (restart what died, restore the network); :func:`run` mixes them at random
(seeded, :func:`plan`) while a producer writes the multi-table stream, one at a time
or, with ``streams > 1``, several in flight on different resources, then waits until
every row is in ClickHouse and runs the checker. The invariant checked at the end, whatever
happened: every delivered row exactly once per table on both replicas (with its values,
for the tables a ``schema_change`` touched), every dead letter exactly once, ``arv
verify`` clean.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scripts import stack_lib
from tests.faults import checker, hooks
from tests.faults.proxy import FaultProxy, Mode
from tests.faults.stack import JOB_PY, REPO_ROOT, StackControl, fault_stack_env
from tests.faults.workload import Workload

KINDS = (
    "driver_kill9",          # 1. kill -9 of the driver at a random moment
    "task_after_commit",     # 2a. task fails after the metadata commit, before the insert
    "task_after_insert",     # 2b. after the insert, before the next commit
    "task_between_blocks",   # 2c. between two blocks of one batch
    "lost_ack",              # 3. insert applied, acknowledgement lost (proxy)
    "replica_kill9",         # 4. a ClickHouse replica killed and restarted
    "zookeeper_down",        # 5. ZooKeeper unreachable for a while
    "broker_kill9",          # 6. the Kafka broker killed and restarted
    "checkpoint_deleted",    # 7. the Spark checkpoint deleted between runs
    "commit_fails",          # 8. a metadata commit fails after some blocks of a batch
    "executor_stall",        # 9. a task stalled (SIGSTOP) across a driver restart, resumed
    "schema_change",         # 10. a column added (ALTER + register), a version or a table
    "alter_during_stall",    # 11. an ALTER while an attempt is stalled after its intent
    "table_added",           # 12. a table created and registered while the job runs
    "topic_recreate",        # 13. the topic deleted and recreated (the operator's procedure)
)

CLUSTER_KINDS = (
    "leader_kill9",             # kill -9 of the leader of a data partition
    "group_coordinator_kill9",  # of the job's group coordinator (__consumer_offsets leader)
    "txn_coordinator_kill9",    # of a partition's transaction coordinator (__transaction_state)
    "controller_kill9",         # of the active controller (the KRaft quorum's leader)
    "broker_pause",             # one node SIGSTOPped for a while, the other two go on
    "broker_cut",               # one node cut off the network both ways for a while
    "txn_coordinator_cut",      # a partition's transaction coordinator cut off, likewise
    "rolling_restart",          # every node in turn: controlled shutdown, back, ISR full
    "leader_move",              # reassignment to a new preferred replica + preferred election
)
"""Kinds drawn only on a three-broker stack (``--brokers 3``), each aimed at the node that
matters at that moment, found from the cluster's own metadata when it is injected."""

BROKER_PAUSE_S = (10.0, 60.0)
"""How long ``broker_pause`` keeps its node stopped and the :data:`CUT_KINDS` their node
cut off, drawn between the two."""

CUT_KINDS = frozenset({"broker_cut", "txn_coordinator_cut"})
"""Kinds that cut a node off the network: they need the stack's nodes isolated."""

_COORDINATOR_WAIT = b"still waiting for the transaction coordinator of "
"""The job's WARN line for each ``init_transactions()`` call the coordinator did not
answer (``FencedAttempt._init_transactions``)."""

WEIGHT = {"topic_recreate": 0.25}
"""How often a kind is drawn after the first of each, relative to 1 for the others:
recreating the topic stops the job, deletes and recreates the topic and restarts the
job from offset 0, so a mixed run draws it a quarter as often."""

_HOOK_STEP = {"task_after_commit": "after_commit", "task_after_insert": "after_insert",
              "task_between_blocks": "between_blocks", "commit_fails": "commit_fails"}


_BATCH_LINE = re.compile(r"(\d\d:\d\d:\d\d) INFO +blockagg\.job: batch kind=")
"""A batch line; often after Spark's progress bar on the same line (``[Stage 0:===> (3 + 1)
/ 4]`` then spaces: the bar is overwritten with a carriage return, not a newline)."""
_STAGE = re.compile(r"\[Stage \d+:[=> ]*\((\d+) \+ (\d+)\) / (\d+)\]")


@dataclass(frozen=True)
class Progress:
    """What the job did over a window, read from its log (``BLOCKAGG_LOG_FORMAT=text``):
    the batches it completed, the time of the last one before or in the window, its
    (re)starts, and, when a batch was still running at the end (Spark's last stage
    progress bar comes after the last batch line), that stage's tasks (done + running /
    total)."""

    batches: int
    last_batch: str | None
    starts: int
    alive: bool
    running_stage: str | None

    @classmethod
    def of(cls, before: str, after: str, alive: bool) -> Progress:
        batches = _BATCH_LINE.findall(after)
        last = batches[-1] if batches else (_BATCH_LINE.findall(before) or [None])[-1]
        text = before + after
        last_batch_end = max((m.end() for m in _BATCH_LINE.finditer(text)), default=-1)
        stages = [m for m in _STAGE.finditer(text) if m.start() > last_batch_end]
        stage = "{} + {} / {}".format(*stages[-1].groups()) if stages else None
        return cls(len(batches), last, after.count("===== start "), alive, stage)

    def why_unfired(self, step: str, window_s: float) -> str:
        """Why a hook armed for ``window_s`` never reached ``step``: the pipeline was
        stuck (a batch in progress that never completed), down, restarted, or idle (no
        new messages), or batches ran and none took that step."""
        if self.batches:
            return (f"{self.batches} batch(es) completed in the {window_s:.0f} s window "
                    f"(last at {self.last_batch}) but no task reached {step}: a bug in the "
                    "hook or batches without that step")
        where = (f"the job was restarted {self.starts} time(s)" if self.starts else
                 "the job was not running" if not self.alive else
                 f"STUCK: a batch was in progress, its stage at {self.running_stage} tasks "
                 "(done + running / total), and a task held it" if self.running_stage else
                 "idle: no new messages reached the job")
        return (f"no batch completed in the {window_s:.0f} s window ({where}; last batch at "
                f"{self.last_batch or 'never'}), so no task reached {step}")


@dataclass
class Job:
    """One job configuration (group, checkpoint) and its current driver process."""

    workload: Workload
    stack: StackControl
    folder: Path
    master: str = "local[2,4]"
    extra_toml: str = ""
    py_files: list[Path] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    exits: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Held across every start/stop and across a fault's kill-then-start, so that an
        # overlapping fault's ensure_running never starts a second driver or restarts one
        # before its checkpoint is gone.
        self.lock = threading.RLock()
        self._starts_here = threading.local()
        self.folder.mkdir(parents=True, exist_ok=True)
        # one proxy per replica of every shard of the workload, in its clients' order
        self.shard_proxies = [[FaultProxy(p) for p in ports]
                              for ports in self.workload.shard_ports]
        self.proxies = [p for shard in self.shard_proxies for p in shard]
        self.hook_dir = self.folder / "hooks"
        self.checkpoint = self.folder / "checkpoint"
        first, *others = [[f"127.0.0.1:{p.port}" for p in shard]
                          for shard in self.shard_proxies]
        self.config = self.workload.job_config(
            self.folder / "blockagg.toml", self.checkpoint, first, extra=self.extra_toml,
            other_replicas=others)
        self.log = self.folder / "job.log"
        self.jars = self.stack.exported().get("BLOCKAGG_SPARK_JARS", "")

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "PYTHONPATH": str(REPO_ROOT),
            "BLOCKAGG_COMPONENTS": "tests.faults.hooks:from_env",
            "BLOCKAGG_FAULT_DIR": str(self.hook_dir),
            "BLOCKAGG_LOG_FORMAT": "text",
            "PYSPARK_SUBMIT_ARGS": (f"--master {self.master} --jars {self.jars} "
                                    "--conf spark.ui.enabled=false "
                                    "--conf spark.driver.host=127.0.0.1 "
                                    "--conf spark.driver.bindAddress=127.0.0.1 pyspark-shell"),
        })
        return env

    def command(self) -> list[str]:
        """``python job.py`` (pyspark starts Spark from PYSPARK_SUBMIT_ARGS) or, for a
        ``spark://`` master, ``spark-submit`` shipping ``py_files`` to the executors."""
        if not self.master.startswith("spark://"):
            return [sys.executable, str(JOB_PY), "--config", str(self.config)]
        from tests.faults.cluster import spark_home

        return [str(spark_home() / "bin" / "spark-submit"), "--master", self.master,
                "--jars", self.jars, "--py-files", ",".join(map(str, self.py_files)),
                "--conf", "spark.ui.enabled=false",
                "--conf", "spark.driver.host=127.0.0.1",
                "--conf", "spark.driver.bindAddress=127.0.0.1",
                "--conf", f"spark.pyspark.python={sys.executable}",
                "--conf", "spark.executor.memory=512m", "--conf", "spark.executor.cores=1",
                "--conf", "spark.cores.max=2",
                str(JOB_PY), "--config", str(self.config)]

    def start(self) -> None:
        with self.lock:
            self._start()

    def _start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None
        with open(self.log, "ab") as out:
            out.write(f"\n===== start {self.starts} {time.strftime('%T')} =====\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                self.command(), stdout=out, stderr=subprocess.STDOUT, env=self.env(),
                cwd=REPO_ROOT, start_new_session=True)
        self.starts += 1
        self._starts_here.n = getattr(self._starts_here, "n", 0) + 1

    def starts_in_this_thread(self) -> int:
        """Driver starts made by the calling thread (a fault's own restarts)."""
        return int(getattr(self._starts_here, "n", 0))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ensure_running(self) -> bool:
        """Restart the job if it exited; True if it had to."""
        with self.lock:
            if self.alive():
                return False
            if self.proc is not None and self.proc.returncode is not None:
                self.exits.append(self.proc.returncode)
            self._start()
            return True

    def kill9(self) -> None:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                return
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(60)
            self.exits.append(-9)

    def stop(self, timeout: float = 120) -> None:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                return
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill9()

    def arm(self, step: str) -> None:
        """Arm a task hook (the running workers see it at their next commit/insert)."""
        hooks.arm(self.hook_dir, step)

    def close(self) -> None:
        self.kill9()
        for proxy in self.proxies:
            proxy.close()

    def log_mark(self) -> int:
        """Where the job's log ends now: :meth:`progress` counts from there."""
        try:
            return self.log.stat().st_size
        except OSError:
            return 0

    def log_since(self, mark: int) -> bytes:
        """The job's log from ``mark`` (:meth:`log_mark`) on."""
        try:
            with open(self.log, "rb") as log:
                log.seek(mark)
                return log.read()
        except OSError:
            return b""

    def progress(self, mark: int) -> Progress:
        """What the pipeline did since ``mark`` (:meth:`log_mark`), from its log."""
        try:
            with open(self.log, "rb") as log:
                before = log.read(mark).decode(errors="replace")
                after = log.read().decode(errors="replace")
        except OSError:
            before = after = ""
        return Progress.of(before, after, self.alive())

    def tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _wait(cond: Any, timeout: float, poll: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(poll)
    return bool(cond())


def inject(kind: str, job: Job, stack: StackControl, rng: random.Random,
           zookeeper_down_s: tuple[float, float] = (10, 25),
           broker_pause_s: tuple[float, float] = BROKER_PAUSE_S,
           produce: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Inject one fault and recover from it; returns what was done and when the
    recovery (restart / network restored) completed, for time-to-recover.
    ``produce(n)`` adds ``n`` messages to the run's stream (a fault that needs
    traffic to fire, such as ``lost_ack``, uses it)."""
    started = time.monotonic()
    info: dict[str, Any] = {"kind": kind}
    if kind in CLUSTER_KINDS:
        info.update(cluster_fault(kind, job, stack, rng, broker_pause_s))
    elif kind == "driver_kill9":
        time.sleep(rng.uniform(0, 3))
        with job.lock:
            job.kill9()
            job.start()
    elif kind in _HOOK_STEP:
        info.update(armed_fault(job, _HOOK_STEP[kind], lambda: hooks.fired(job.hook_dir) >= 1,
                                HOOK_WINDOW_S))
        job.ensure_running()
    elif kind == "executor_stall":
        info.update(stall_across_restart(job, stack, rng))
    elif kind == "lost_ack":
        info.update(lose_an_ack(job, rng, produce))
    elif kind == "replica_kill9":
        replicas = len(job.proxies)
        name = rng.choice(["clickhouse-r1", "clickhouse-r2"] if replicas == 2 else
                          [f"clickhouse-r{r + 1}" for r in range(replicas)])
        info["replica"] = name
        stack.kill9(name)
        time.sleep(rng.uniform(2, 8))
        stack.up()
    elif kind == "zookeeper_down":
        seconds = rng.uniform(*zookeeper_down_s)
        info["seconds"] = round(seconds, 1)
        stack.unreachable_for("zookeeper", seconds)
    elif kind == "broker_kill9":
        if len(stack.broker_ids) > 1:  # a cluster: any node (a single broker: the same draws)
            info.update(_kill9_node(stack, rng.choice(stack.broker_ids), rng))
        else:
            stack.kill9("kafka")
            time.sleep(rng.uniform(1, 5))
            stack.up()
    elif kind == "schema_change":
        info.update(job.workload.schema_change(rng, job.folder / "schemas"))
    elif kind == "alter_during_stall":
        info.update(alter_during_stall(job, stack, rng))
    elif kind == "table_added":
        time.sleep(rng.uniform(0, 3))
        info["table"] = job.workload.add_table(job.folder / "schemas")
    elif kind == "topic_recreate":
        info.update(recreate_topic(job, stack, rng))
    elif kind == "checkpoint_deleted":
        with job.lock:
            job.stop()
            shutil.rmtree(job.checkpoint, ignore_errors=True)
            job.start()
    else:
        raise ValueError(f"unknown fault kind {kind!r}; known: {KINDS + CLUSTER_KINDS}")
    info["inject_s"] = round(time.monotonic() - started, 1)
    return info


LOST_ACK_WINDOW_S = 120.0
"""How long ``lost_ack`` stays armed before it is recorded as not fired."""

LOST_ACK_BURST = 1000
"""Messages added when an armed ``lost_ack`` has seen no block for a while: produced
at once, they make blocks large enough to be told from the insert's query text."""


def lose_an_ack(job: Job, rng: random.Random, produce: Callable[[int], None] | None,
                window_s: float = LOST_ACK_WINDOW_S, burst_every_s: float = 10.0
                ) -> dict[str, Any]:
    """Drop the answer to one block insert on a shard (the insert is applied, its
    acknowledgement never arrives). Every replica of the shard is armed, because after
    any earlier failover the writer stays on the replica it moved to; the first to drop
    one disarms the rest. While nothing has fired, a burst of messages every few seconds
    keeps blocks coming: once the job has caught up it inserts nothing, and a trickle
    forms blocks too small (under 2 KiB) to be told from a query."""
    shard = rng.randrange(len(job.shard_proxies)) if len(job.shard_proxies) > 1 else 0
    proxies = job.shard_proxies[shard]
    before = [p.stats.dropped_responses for p in proxies]
    for proxy in proxies:
        # 2 KiB: more than a handshake or an INSERT's query text, less than a data block
        proxy.drop_responses(count=1, min_request_bytes=2048)
    info: dict[str, Any] = {"shard": shard + 1} if shard else {}
    deadline = time.monotonic() + window_s
    next_burst = time.monotonic() + burst_every_s
    extra = 0
    fired: list[int] = []
    while not fired and time.monotonic() < deadline:
        time.sleep(0.05)
        fired = [i for i, p in enumerate(proxies) if p.stats.dropped_responses > before[i]]
        if not fired and produce is not None and time.monotonic() >= next_burst:
            produce(LOST_ACK_BURST)
            extra += LOST_ACK_BURST
            next_burst = time.monotonic() + burst_every_s
    for proxy in proxies:
        proxy.set_mode(Mode.FORWARD)
    info["fired"] = bool(fired)
    if fired:
        info["replica"] = [i + 1 for i in fired]
    if extra:
        info["extra_messages"] = extra
    return info


def _kill9_node(stack: StackControl, node: int, rng: random.Random) -> dict[str, Any]:
    """kill -9 of Kafka node ``node``, a pause, ``scripts/stack up``, then every partition
    back to its full ISR (the operator's recovery, before anything else is touched)."""
    stack.kill9_broker(node)
    time.sleep(rng.uniform(1, 5))
    stack.up()
    return {"node": node, "isr_s": round(stack.wait_in_sync(), 1)}


def _job_partition(job: Job, rng: random.Random) -> int:
    return rng.randrange(job.workload.partitions)


def cluster_fault(kind: str, job: Job, stack: StackControl, rng: random.Random,
                  pause_s: tuple[float, float] = BROKER_PAUSE_S) -> dict[str, Any]:
    """One of :data:`CLUSTER_KINDS`: its target read from the cluster's metadata now (the
    node leading a data partition, the job's group coordinator, a partition's
    transaction coordinator, the KRaft quorum's leader), the fault, and the operator's
    recovery: the node restarted or resumed, every partition back to its full ISR."""
    if len(stack.broker_ids) < 3:
        raise ValueError(f"{kind} needs a three-broker stack (--brokers 3); this one has "
                         f"{len(stack.broker_ids)}")
    from blockagg.aggregator.kafka.fencing import transactional_id

    time.sleep(rng.uniform(0, 3))  # a random moment of the job's batches
    workload = job.workload
    # a shard's topic (with two shards, either's; one shard: the same draws as before)
    topic = (workload.topics[rng.randrange(workload.shards)] if workload.shards > 1
             else workload.topic)
    on = {"topic": topic} if workload.shards > 1 else {}
    if kind == "leader_kill9":
        partition = _job_partition(job, rng)
        node = stack.leader(topic, partition)
        return {**on, "partition": partition, **_kill9_node(stack, node, rng)}
    if kind == "group_coordinator_kill9":
        return _kill9_node(stack, stack.group_coordinator(workload.group), rng)
    if kind == "txn_coordinator_kill9":
        partition = _job_partition(job, rng)
        tid = transactional_id(workload.group, topic, partition)
        return {**on, "transactional_id": tid,
                **_kill9_node(stack, stack.transaction_coordinator(tid), rng)}
    if kind == "controller_kill9":
        return _kill9_node(stack, stack.active_controller(), rng)
    if kind == "broker_pause":
        node = rng.choice(stack.broker_ids)
        seconds = rng.uniform(*pause_s)
        with stack.paused(stack.broker_service(node)):
            time.sleep(seconds)
        return {"node": node, "seconds": round(seconds, 1),
                "isr_s": round(stack.wait_in_sync(), 1)}
    if kind in CUT_KINDS:
        refused = stack.cut_unavailable()
        if refused:
            raise ValueError(f"{kind} refused: {refused}")
        if kind == "broker_cut":
            target: dict[str, Any] = {"node": rng.choice(stack.broker_ids)}
        else:
            partition = _job_partition(job, rng)
            tid = transactional_id(workload.group, topic, partition)
            target = {**on, "transactional_id": tid,
                      "node": stack.transaction_coordinator(tid)}
        mark = job.log_mark()
        seconds = rng.uniform(*pause_s)
        with stack.cut(target["node"]):
            time.sleep(seconds)
        target.update(seconds=round(seconds, 1), isr_s=round(stack.wait_in_sync(), 1))
        if kind == "txn_coordinator_cut":
            target["coordinator_waits"] = job.log_since(mark).count(_COORDINATOR_WAIT)
        return target
    if kind == "rolling_restart":
        took = {}
        for node in stack.broker_ids:
            started = time.monotonic()
            stack.stop_broker(node)
            stack.up()
            stack.wait_in_sync()
            took[str(node)] = round(time.monotonic() - started, 1)
        return {"node_s": took}
    if kind == "leader_move":
        moved = stack.move_preferred_leaders(topic)
        return {**on, "leaders": {str(p): list(m) for p, m in moved.items()},
                "isr_s": round(stack.wait_in_sync(), 1)}
    raise ValueError(f"unknown cluster fault kind {kind!r}; known: {CLUSTER_KINDS}")


HOOK_WINDOW_S = 120.0
"""How long an armed task hook may take to fire (the fault's messages are produced
meanwhile, so batches run)."""
STALL_WINDOW_S = 180.0


def armed_fault(job: Job, step: str, fired: Any, window_s: float) -> dict[str, Any]:
    """Arm the task hook ``step``, wait up to ``window_s`` for ``fired()``, disarm. A
    hook claimed between the end of the wait and the disarm counts as fired (else a
    stalled worker would be left stopped). A fault that did not fire says why in
    ``unfired`` (:meth:`Progress.why_unfired`, from the job's log over the window).

    Armed at once, not after waiting for a batch: the fault's own messages are being
    produced now, and a batch that consumed them before the arming would leave the
    window without one (with no other fault producing, the pipeline is then idle)."""
    mark = job.log_mark()
    job.arm(step)
    _wait(fired, window_s)
    hooks.disarm(job.hook_dir)
    if hooks.fired(job.hook_dir) and _wait(fired, 10):  # claimed: its record follows
        return {"fired": True}
    return {"fired": False, "unfired": job.progress(mark).why_unfired(step, window_s)}


def _metadata_store(job: Job, stack: StackControl) -> Any:
    from blockagg.aggregator.kafka.metadata_store import KafkaMetadataStore
    from blockagg.config import load

    group = load(job.config, {}).job.metadata_group_id
    return KafkaMetadataStore({"bootstrap.servers": stack.bootstrap, "group.id": group})


def stall_across_restart(job: Job, stack: StackControl, rng: random.Random,
                         step: str | None = None,
                         before_resume: Callable[[dict[str, Any]], dict[str, Any]] | None = None
                         ) -> dict[str, Any]:
    """Fault 9: a task attempt stalls (its Python worker SIGSTOPs itself after an intent,
    after an insert or before a commit, having left the job's session), the driver is
    killed (-9) and restarted, newer attempts commit the partition, then the stalled
    attempt is resumed (SIGCONT). It must be refused (fenced) before it commits or
    inserts anything; what it was told is recorded in ``refused``.

    ``step`` fixes the stall point (else a seeded choice); ``before_resume(record)``
    runs while the attempt is still stopped, after the newer commits (fault 11 ALTERs
    the table there), and what it returns goes into the event."""
    if step is None:
        step = rng.choice(["stall_after_commit", "stall_after_insert", "stall_before_commit"])
    info: dict[str, Any] = {"step": step}
    info.update(armed_fault(job, step, lambda: bool(hooks.stalled(job.hook_dir)),
                            STALL_WINDOW_S))
    if not info["fired"]:
        return info
    record = hooks.stalled(job.hook_dir)[-1]
    pid, topic, partition = int(str(record["pid"])), str(record["topic"]), int(
        str(record["partition"]))
    info.update(pid=pid, partition=f"{topic}[{partition}]",
                blockagg_module=record.get("blockagg"))
    with _metadata_store(job, stack) as store:
        stalled_at = store.committed(topic, partition)
        with job.lock:
            job.kill9()
            job.start()
        # Newer commits: the restarted job's attempts moved the partition past the
        # stalled attempt's last commit (its recovery replays, then commits the end).
        floor = -1 if stalled_at is None else stalled_at.offset

        def moved_on() -> bool:
            now = store.committed(topic, partition)
            return now is not None and now.offset > floor

        info["newer_commits"] = _wait(moved_on, 300, poll=1)
        info["stalled_at"] = None if stalled_at is None else stalled_at.offset
        info["committed_before_resume"] = getattr(store.committed(topic, partition),
                                                  "offset", None)
    try:
        if before_resume is not None:
            info.update(before_resume(record))
        os.kill(pid, signal.SIGCONT)
        info["refused"] = ""
        if _wait(lambda: bool(hooks.refusals(job.hook_dir, pid)), 120):
            info["refused"] = hooks.refusals(job.hook_dir, pid).strip()
        info["zombie_exited"] = _wait(lambda: not _alive(pid), 60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return info


def alter_during_stall(job: Job, stack: StackControl, rng: random.Random) -> dict[str, Any]:
    """Fault 11 (issue 25, path 1): fault 9 with its attempt stalled right after its
    intent (``stall_after_commit``: before its confirm and insert), and, once newer
    attempts replayed that intent and committed past it, while the attempt is still
    stopped, fault 10's ``add_column`` on a table of the intent's blocks (``ALTER TABLE
    ... ADD COLUMN ... DEFAULT`` on every replica, then the version with the field
    registered). On 18.16 the stalled block, sent now, would hash as another part; the
    attempt must be refused before it inserts, and the checker compares every value of
    the table."""
    workload = job.workload

    def alter(record: dict[str, Any]) -> dict[str, Any]:
        table = _intent_table(workload, str(record.get("metadata", "")), rng)
        return {"altered": workload.add_column(table, job.folder / "schemas")}

    return stall_across_restart(job, stack, rng, step="stall_after_commit", before_resume=alter)


def _intent_table(workload: Workload, metadata: str, rng: random.Random) -> str:
    """A table that a block of the intent ``metadata`` goes to (drawn with ``rng``; any
    of the run's tables when the intent lists only dead letters)."""
    from blockagg.aggregator.core.metadata import DEAD_LETTER_TABLE_ID, decode
    from blockagg.aggregator.kafka.log_store import KafkaStore
    from blockagg.proto.registry import Registry

    ids = sorted({b.table_id for b in decode(metadata).blocks} - {DEAD_LETTER_TABLE_ID})
    if not ids:
        return rng.choice(workload.table_names())
    registry = Registry.load(KafkaStore({"bootstrap.servers": workload.bootstrap},
                                        workload.schema_topic))
    return registry.by_id(rng.choice(ids)).table


def recreate_topic(job: Job, stack: StackControl, rng: random.Random) -> dict[str, Any]:
    """Fault 13: the operator deletes and recreates the topic under the job, by the
    procedure of docs/protocol.md (``TopicIncarnationChanged``): stop the job, delete
    the topic and create it again (same name and partitions), reset the metadata
    group's offsets of the topic to the earliest, delete the job's checkpoint, start
    it. Nothing is produced meanwhile.

    Once the job has stored what was produced before the fault, it is stopped at a
    random moment (seeded) while the fault's share is produced, so messages of the old topic may
    still be unread: those go with the topic (the procedure's documented loss), and
    :meth:`Workload.retire_incarnation` stops expecting them; what the job had stored
    of the old topic stays expected exactly once, and every message of the new topic
    is expected exactly once, at the old one's coordinates."""
    workload = job.workload
    # The job first stores what was produced before the fault, so that the new topic's
    # messages meet old rows at their coordinates; this fault's share is being produced
    # meanwhile, some of it still unread when the job stops.
    info: dict[str, Any] = {"old_stored_first": checker.caught_up(
        workload, RECREATE_WARM_S, want=checker.produced_counts(workload)) is not None}
    time.sleep(rng.uniform(0, 3))
    with job.lock, workload.producing():
        started = time.monotonic()
        job.stop()
        time.sleep(1)  # an insert the server had fully received completes
        info.update(workload.retire_incarnation(*_retry_for(
            workload.stored, 180, "reading what is stored", lambda: revive_replicas(stack))))
        workload.save_retired(job.folder / RETIRED)
        workload.recreate_topic()
        info["reset_to"] = workload.reset_group_to_earliest()
        shutil.rmtree(job.checkpoint, ignore_errors=True)
        job.start()
        info["procedure_s"] = round(time.monotonic() - started, 1)
    return info


RECREATE_WARM_S = 300.0
"""How long ``topic_recreate`` waits for the job to store what was produced before it."""

RETIRED = "retired.npz"
"""In the run's folder: what earlier incarnations of the topic left expected, for
``--resume`` (:meth:`Workload.save_retired`)."""


def _retry_for(action: Callable[[], Any], timeout: float, what: str,
               revive: Callable[[], None] | None = None) -> Any:
    """``action()`` until it returns (a replica may be restarting), at most ``timeout`` s;
    after each failure ``revive()`` (e.g. :func:`revive_replicas`)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return action()
        except Exception as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: still failing after {timeout:.0f}s: {exc}") from exc
            if revive is not None:
                revive()
            time.sleep(2)


def revive_replicas(stack: StackControl) -> None:
    """Start again a ClickHouse replica that is down although no fault holds it: 18.16
    aborts by itself now and then on a loaded machine (``std::system_error`` in a query
    thread, then ``Received signal Aborted``), and the long run's harness died waiting
    180 s for one such replica in ``topic_recreate``'s step. An operator restarts it."""
    down = [s for s in stack.replica_services if not stack.is_up(s)]
    if down:
        print(json.dumps({"revived": down}), file=sys.stderr, flush=True)
        stack.up()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return False


@dataclass
class Outcome:
    faults: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Faults injected, per kind: an armed hook that never fired is not one."""
    unfired: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Faults armed that never fired (their events say why): they tested nothing."""
    recover_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    events: list[dict[str, Any]] = field(default_factory=list)
    report: checker.Report | None = None
    interim: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    run: str = ""
    """The workload's run name (its topic is ``fx-<run>``): what ``--resume`` needs."""
    resumes: list[dict[str, Any]] = field(default_factory=list)
    """Each time the run was resumed: after how many faults, by which commit."""

    @classmethod
    def load(cls, path: Path) -> Outcome:
        """A run's outcome as its JSON left it (:meth:`write`), to go on from."""
        data = json.loads(path.read_text())
        out = cls(events=list(data["events"]), interim=list(data.get("interim_checks", [])),
                  seconds=float(data["seconds"]), run=str(data.get("run", "")),
                  resumes=list(data.get("resumes", [])))
        for event in out.events:
            fired = event.get("fired") is not False
            (out.faults if fired else out.unfired)[event["kind"]] += 1
            if fired and event.get("recover_s") is not None:
                out.recover_s[event["kind"]].append(float(event["recover_s"]))
        return out

    def summary(self) -> dict[str, Any]:
        def stats(xs: list[float]) -> dict[str, float]:
            ys = sorted(xs)
            return {"n": len(ys), "median": ys[len(ys) // 2], "max": ys[-1]} if ys else {}

        return {"faults": dict(self.faults),
                "unfired": dict(self.unfired),
                "job_starts": {k: sum(e.get("job_starts", 0) for e in self.events
                                      if e["kind"] == k) for k in self.faults},
                "recover_s": {k: stats(v) for k, v in self.recover_s.items()},
                "check": self.report.summary() if self.report else None,
                "interim_checks": self.interim,
                "events": self.events,
                "seconds": round(self.seconds, 1),
                "run": self.run,
                "resumes": self.resumes}

    def write(self, path: Path | None) -> None:
        """Rewrite the summary (atomically), so a run cut short leaves its figures."""
        if path is None:
            return
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.summary(), indent=1, sort_keys=True))
        tmp.replace(path)


# Faults on the same resource never overlap (two ``scripts/stack up`` at once, two armed
# hooks, a proxy armed while its replica is down, an ALTER while a replica or ZooKeeper
# is down); faults on different ones may (a schema change's registration retries while
# the broker restarts). A kind holds every resource it names (taken in sorted order):
# an ALTER during a stall needs the hooks and the ClickHouse side; recreating the topic
# stops the world (no stalled attempt, no service down while it reads what is stored).
_RESOURCE: dict[str, tuple[str, ...]] = {
    "driver_kill9": ("driver",), "checkpoint_deleted": ("driver",),
    **{kind: ("hooks",) for kind in _HOOK_STEP},
    "executor_stall": ("hooks",),
    "lost_ack": ("clickhouse",), "replica_kill9": ("clickhouse",),
    "zookeeper_down": ("clickhouse",), "schema_change": ("clickhouse",),
    "table_added": ("clickhouse",),
    "alter_during_stall": ("clickhouse", "hooks"),
    "topic_recreate": ("clickhouse", "driver", "hooks", "kafka"),
    "broker_kill9": ("kafka",),
    **{kind: ("kafka",) for kind in CLUSTER_KINDS}}


def resources(kinds: list[str] | tuple[str, ...] | None = None) -> set[str]:
    """Every resource that ``kinds`` (default: all) hold."""
    return {r for k in (KINDS + CLUSTER_KINDS if kinds is None else kinds)
            for r in _RESOURCE[k]}


_SPLIT_SHARE = {"schema_change", "alter_during_stall", "table_added", "topic_recreate"}


def plan(kinds: list[str], faults: int, seed: int) -> list[str]:
    """The run's faults in order: each kind once first, then drawn at random (seeded),
    by :data:`WEIGHT` (uniform, and the same draws as before weights existed, when no
    kind of ``kinds`` has one)."""
    rng = random.Random(seed)
    weights = [WEIGHT.get(k, 1.0) for k in kinds]
    if all(w == 1.0 for w in weights):
        return [kinds[n] if n < len(kinds) else rng.choice(kinds) for n in range(faults)]
    return [kinds[n] if n < len(kinds) else rng.choices(kinds, weights)[0]
            for n in range(faults)]


@dataclass
class _Run:
    """What the fault streams of one run share."""

    workload: Workload
    job: Job
    stack: StackControl
    outcome: Outcome
    seed: int
    per_fault: int
    rate: float
    settle_s: float
    zookeeper_down_s: tuple[float, float]
    started: float
    json_path: Path | None
    broker_pause_s: tuple[float, float] = BROKER_PAUSE_S
    produce_lock: threading.Lock = field(default_factory=threading.Lock)
    record_lock: threading.Lock = field(default_factory=threading.Lock)
    resources: dict[str, threading.Lock] = field(
        default_factory=lambda: {r: threading.Lock() for r in resources()})

    def produce(self, messages: int) -> None:
        with self.produce_lock:
            self.workload.produce(messages, rate=self.rate)

    def fault(self, n: int, kind: str) -> dict[str, Any]:
        """Inject fault ``n`` while its share of the stream is produced, recover, and
        wait until everything produced by then is stored (its time to recover)."""
        rng = random.Random(self.seed * 1_000_003 + n)
        job = self.job
        starts_before = job.starts_in_this_thread()
        # A schema change gets half its share while it is made (written with the old
        # schema, much of it still unread when the change lands) and half after it
        # (written with the new one); so do the kinds that change a table, add one or
        # recreate the topic (half to the old topic, half to the new).
        during = self.per_fault // 2 if kind in _SPLIT_SHARE else self.per_fault
        with contextlib.ExitStack() as held:
            for resource in sorted(_RESOURCE[kind]):
                held.enter_context(self.resources[resource])
            producer = threading.Thread(target=self.produce, args=(during,), daemon=True)
            producer.start()
            info = {"n": n, **inject(kind, job, self.stack, rng, self.zookeeper_down_s,
                                     self.broker_pause_s, produce=self.produce)}
            producer.join(timeout=600)
            if during < self.per_fault:
                self.produce(self.per_fault - during)
        job.ensure_running()
        recovered = time.monotonic()
        with self.produce_lock:
            want = checker.produced_counts(self.workload)
        took = _wait_caught_up(self.workload, job, self.settle_s, want=want)
        info["recover_s"] = None if took is None else round(time.monotonic() - recovered, 1)
        info["job_starts"] = job.starts_in_this_thread() - starts_before
        info["stream"] = threading.current_thread().name
        with self.record_lock:
            if info.get("fired") is False:
                self.outcome.unfired[kind] += 1
            else:
                self.outcome.faults[kind] += 1
            if took is not None and info.get("fired") is not False:
                self.outcome.recover_s[kind].append(time.monotonic() - recovered)
            info["at_s"] = round(time.monotonic() - self.started, 1)
            self.outcome.events.append(info)
            self.outcome.seconds = time.monotonic() - self.started
            self.outcome.write(self.json_path)
        print(json.dumps(info), file=sys.stderr, flush=True)
        return info

    def phase(self, faults: list[tuple[int, str]], streams: int) -> None:
        """Run ``faults`` on ``streams`` threads, each taking the next fault when its
        previous one has recovered; the first error stops every stream and is raised."""
        queue = iter(faults)
        take = threading.Lock()
        errors: list[BaseException] = []

        def stream() -> None:
            while not errors:
                with take:
                    item = next(queue, None)
                if item is None:
                    return
                try:
                    self.fault(*item)
                except BaseException as exc:
                    errors.append(exc)

        threads = [threading.Thread(target=stream, name=f"stream-{i}", daemon=True)
                   for i in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]


def run(stack: StackControl, kinds: list[str], faults: int, messages: int, seed: int,
        folder: Path, tables: int = 20, partitions: int = 4, rows_per_message: int = 10,
        dead_every: int = 97, settle_s: float = 180, catch_up_s: float = 900,
        rate: float = 0.0, check_every: int = 0, streams: int = 1,
        zookeeper_down_s: tuple[float, float] = (10, 25),
        json_path: Path | None = None, master: str = "local[2,4]",
        py_files: list[Path] | None = None,
        resume: Outcome | None = None,
        broker_pause_s: tuple[float, float] = BROKER_PAUSE_S,
        shards: int | None = None
        ) -> tuple[Outcome, Workload, Job]:
    """``faults`` faults (:func:`plan`) while ``messages`` are produced; after each
    fault the job is kept running and must have stored everything produced up to the
    fault's recovery within ``settle_s`` (that wait is the time to recover).

    ``streams`` faults are in flight at once (one per stream), never two on the same
    resource (:data:`_RESOURCE`): a later fault can then strike while an earlier one is
    still being recovered from, and an earlier fault's time to recover includes any
    overlapping one's. ``streams = 1`` injects strictly one after another.

    With ``check_every = N``, the full check (:func:`checker.check`) also runs after
    every Nth fault once every stream is idle and the job has caught up: nothing is
    produced meanwhile, so every row produced so far must already be stored exactly
    once. Those interim checks and every fault's event go into ``json_path``,
    rewritten after each fault. ``master`` is Spark's (``spark://...``: the job is
    submitted with ``spark-submit``, shipping ``py_files``).

    With ``resume`` (:meth:`Outcome.load` of a run whose harness died, e.g. with its
    whole stack), the run goes on where it stopped: the same workload
    (:meth:`Workload.resume`, rebuilt from its topics), job folder and checkpoint, the
    faults of :func:`plan` it had not recorded, and first a full check, which then
    also covers the kill of everything at once.

    :data:`CLUSTER_KINDS` need a three-broker ``stack``; ``broker_pause_s`` bounds how
    long ``broker_pause`` stops its node.

    ``shards`` (default: every shard of ``stack``): with 2, the workload writes one topic
    per shard and the one job delivers each into its shard; each shard is checked
    against its own topic."""
    cluster_only = [k for k in kinds if k in CLUSTER_KINDS]
    if cluster_only and len(stack.broker_ids) < 3:
        raise ValueError(f"{', '.join(cluster_only)} need a three-broker stack (--brokers 3); "
                         f"this one has {len(stack.broker_ids)}")
    cuts = sorted(CUT_KINDS.intersection(kinds))
    if cuts and (refused := stack.cut_unavailable()):
        raise ValueError(f"{' and '.join(cuts)} refused before the run: {refused}; drop "
                         f"{'them' if len(cuts) > 1 else 'it'} from the kinds or run where "
                         "the stack can isolate its brokers")
    shard_ports = stack.shard_ch_ports
    shards = len(shard_ports) if shards is None else shards
    if not 1 <= shards <= len(shard_ports):
        raise ValueError(f"shards={shards}: this stack has {len(shard_ports)} ClickHouse "
                         "shard(s); start it with scripts/stack up --shards 2")
    other_shards = shard_ports[1:shards]
    if resume is None:
        workload = Workload(stack.bootstrap, "127.0.0.1", stack.ch_ports, tables=tables,
                            partitions=partitions, rows_per_message=rows_per_message,
                            dead_every=dead_every, seed=seed, other_shards=other_shards)
        workload.setup()
        outcome = Outcome(run=workload.run)
    else:
        outcome = resume
        restoring = time.monotonic()
        workload = Workload.resume(outcome.run, stack.bootstrap, "127.0.0.1", stack.ch_ports,
                                   initial_tables=tables, retired=folder / RETIRED,
                                   partitions=partitions,
                                   rows_per_message=rows_per_message, dead_every=dead_every,
                                   seed=seed, other_shards=other_shards)
        _set_aside(folder / "hooks", f"before-resume-{len(outcome.resumes) + 1}")
        outcome.resumes.append({"after_faults": len(outcome.events),
                                "at_s": round(outcome.seconds, 1),
                                "commit": _commit(),
                                "messages_in_topic": workload.produced.messages,
                                "restored_s": round(time.monotonic() - restoring, 1)})
    job = Job(workload, stack, folder, master=master, py_files=list(py_files or []))
    started = time.monotonic() - outcome.seconds
    per_fault = max(1, messages // max(1, faults + 1))
    shared = _Run(workload, job, stack, outcome, seed, per_fault, rate, settle_s,
                  zookeeper_down_s, started, json_path, broker_pause_s)
    recorded = {int(e["n"]) for e in outcome.events}
    order = list(enumerate(plan(kinds, faults, seed)))
    step = check_every or faults or 1

    def full_check(after: int, **extra: Any) -> None:
        """Waits as long as the final check does (a slow recovery, e.g. 18.16's stalled
        ALTER, must not cost the run its evidence); one that still finds the job behind is
        recorded as skipped, with the reason and the duplicates stored so far (waiting
        never removes one), rather than left out."""
        if _wait_caught_up(workload, job, catch_up_s) is None:
            reason = f"not caught up within {catch_up_s:.0f} s"
            print(f"{reason} for the check after {after} faults", file=sys.stderr, flush=True)
            try:
                duplicates: int | None = checker.count_duplicates(workload)
            except Exception as exc:  # a replica still down: the skip says enough
                print(f"duplicates not counted: {exc}", file=sys.stderr, flush=True)
                duplicates = None
            interim = {"after_faults": after, **extra,
                       "messages_produced": workload.produced.messages, "skipped": reason,
                       "duplicates": duplicates, "ok": False if duplicates else None}
        else:
            interim = {"after_faults": after, **extra,
                       "messages_produced": workload.produced.messages,
                       **checker.check(workload).summary()}
        outcome.interim.append(interim)
        outcome.write(json_path)
        print(json.dumps({"interim_check": interim}), file=sys.stderr, flush=True)

    try:
        if resume is None:
            workload.produce(per_fault, rate=rate)
        job.start()
        if resume is not None:
            full_check(len(recorded), resumed=True)
        for first in range(0, faults, step):
            todo = [f for f in order[first:first + step] if f[0] not in recorded]
            if not todo:
                continue
            shared.phase(todo, streams)
            done = min(faults, first + step)
            if check_every and done % check_every == 0:
                full_check(done)
        workload.produce(messages - per_fault * (faults + 1) if
                         messages > per_fault * (faults + 1) else 0)
        if _wait_caught_up(workload, job, catch_up_s) is None:
            print(f"not caught up after {catch_up_s}s; job log:\n{job.tail()}", file=sys.stderr)
        job.stop()
        outcome.report = checker.check(workload)
    finally:
        job.close()
        outcome.seconds = time.monotonic() - started
    return outcome, workload, job


def _set_aside(folder: Path, suffix: str) -> None:
    """Move a folder of the run's past (e.g. hook records naming pids) out of the way."""
    if folder.exists():
        folder.rename(folder.with_name(f"{folder.name}-{suffix}"))
    folder.mkdir(parents=True)


def _commit() -> str:
    res = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                         capture_output=True, text=True, check=False)
    return res.stdout.strip() or "unknown"


def unfired_line(outcome: Outcome) -> str:
    """The summary's line on faults armed that never fired (not counted as injected)."""
    total = sum(outcome.unfired.values())
    if not total:
        return f"faults injected: {sum(outcome.faults.values())}; armed but not fired: 0"
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(outcome.unfired.items()))
    return (f"faults injected: {sum(outcome.faults.values())}; ARMED BUT NOT FIRED: {total} "
            f"({kinds}), not counted as injected; each event's 'unfired' says why")


def _wait_caught_up(workload: Workload, job: Job, timeout: float,
                    want: list[dict[str, int]] | None = None) -> float | None:
    """Poll until caught up (with ``want``: at least that much stored), restarting
    the job whenever it exited."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        job.ensure_running()
        if checker.caught_up(workload, timeout=5, poll=1, want=want) is not None:
            return time.monotonic() - started
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="The long fault run (docs/RELIABILITY.md).")
    ap.add_argument("--faults", type=int, default=1000)
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--rows-per-message", type=int, default=10)
    ap.add_argument("--tables", type=int, default=20)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--dead-every", type=int, default=97,
                    help="every Nth message is a bad envelope (a dead letter); 0 = none")
    ap.add_argument("--kinds", default=None,
                    help="comma-separated fault kinds (default: every kind of KINDS, and "
                         "CLUSTER_KINDS with --brokers 3)")
    ap.add_argument("--brokers", type=int, choices=(1, 3), default=1,
                    help="Kafka nodes of the private stack (3: RF 3, min.insync 2, and the "
                         "cluster kinds)")
    ap.add_argument("--shards", type=int, choices=(1, 2), default=1,
                    help="ClickHouse shards of the private stack")
    ap.add_argument("--broker-pause", default="10,60", metavar="MIN,MAX",
                    help="seconds broker_pause keeps its node stopped and broker_cut and "
                         "txn_coordinator_cut their node cut off")
    ap.add_argument("--isolate-brokers", action=argparse.BooleanOptionalAction, default=None,
                    help="with --brokers 3: each node in its own network namespace (needs "
                         "root and ip; default: where possible), which broker_cut and "
                         "txn_coordinator_cut need")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--folder", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None,
                    help="summary file, rewritten after every fault")
    ap.add_argument("--check-every", type=int, default=0,
                    help="also run the full check after every Nth fault (0 = only at the end)")
    ap.add_argument("--streams", type=int, default=1,
                    help="faults in flight at once, never two on one resource (1 = one by one)")
    ap.add_argument("--zookeeper-down", default="10,25", metavar="MIN,MAX",
                    help="seconds ZooKeeper stays unreachable, drawn between MIN and MAX")
    ap.add_argument("--resume", action="store_true",
                    help="go on with the run whose summary is --json (same --folder and "
                         "arguments): its harness or whole stack was killed")
    ap.add_argument("--run", default="",
                    help="with --resume: the run's name (fx-<run>), for a summary without it")
    args = ap.parse_args(argv)
    resume = None
    if args.resume:
        if args.json is None or not args.json.exists() or args.folder is None:
            ap.error("--resume needs the run's --json summary and its --folder")
        resume = Outcome.load(args.json)
        resume.run = args.run or resume.run
        if not resume.run:
            ap.error(f"--resume: {args.json} does not name its run; give --run")
    low, _, high = args.zookeeper_down.partition(",")
    if args.streams < 1:
        ap.error(f"--streams {args.streams}: give 1 or more")
    try:
        zookeeper_down_s = (float(low), float(high or low))
    except ValueError:
        ap.error(f"--zookeeper-down {args.zookeeper_down!r}: give MIN,MAX in seconds")
    plow, _, phigh = args.broker_pause.partition(",")
    try:
        broker_pause_s = (float(plow), float(phigh or plow))
    except ValueError:
        ap.error(f"--broker-pause {args.broker_pause!r}: give MIN,MAX in seconds")
    default_kinds = KINDS + (CLUSTER_KINDS if args.brokers == 3 else ())
    kinds = [k for k in (args.kinds or ",".join(default_kinds)).split(",") if k]
    unknown = [k for k in kinds if k not in KINDS + CLUSTER_KINDS]
    if unknown:
        ap.error(f"--kinds: unknown {unknown}; known: {', '.join(KINDS + CLUSTER_KINDS)}")
    if args.brokers < 3 and any(k in CLUSTER_KINDS for k in kinds):
        ap.error(f"--kinds {','.join(k for k in kinds if k in CLUSTER_KINDS)}: "
                 "cluster kinds need --brokers 3")
    isolate = args.isolate_brokers
    if isolate is None:
        isolate = args.brokers == 3 and stack_lib.isolation_problem() is None
    stack = StackControl(fault_stack_env(brokers=args.brokers, shards=args.shards,
                                         isolate_brokers=isolate))
    stack.up()
    folder = args.folder or Path(tempfile.mkdtemp(prefix="blockagg-faults-"))
    outcome, _, _ = run(stack, kinds, args.faults, args.messages, args.seed, folder,
                               tables=args.tables, partitions=args.partitions,
                               rows_per_message=args.rows_per_message,
                               dead_every=args.dead_every,
                               check_every=args.check_every, streams=args.streams,
                               zookeeper_down_s=zookeeper_down_s, json_path=args.json,
                               resume=resume, broker_pause_s=broker_pause_s)
    summary = outcome.summary()
    summary.pop("events")
    print(json.dumps(summary, indent=1, sort_keys=True))
    outcome.write(args.json)
    print(unfired_line(outcome), file=sys.stderr)
    report = outcome.report
    if report is not None and not report.ok:
        print("\n".join(report.problems()), file=sys.stderr)
    return 0 if report is not None and report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
