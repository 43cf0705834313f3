"""End-to-end benchmark of the job: ``python -m bench.bench_e2e``.

One topic holds ``--rows`` rows (``bench.workload.Rows``: 10 columns, ``--tables``
tables, ``--partitions`` partitions). Each *run* starts the real job
(``spark/job.py --until-caught-up``) on a fresh consumer group, fresh checkpoint and
freshly created tables (the 10 columns plus the ``_topic``, ``_partition``, ``_offset``
columns the writer fills and recommends on servers without deduplication tokens; new
ZooKeeper paths, so ClickHouse's deduplication memory of an
earlier run can never drop a block and flatter the figures), and drains the topic:

* ``exactly_once``: the job as shipped;
* ``at_least_once``: the same job with ``BLOCKAGG_COMPONENTS=bench.e2e_components:at_least_once``
  (no metadata commits, no replay; see that module);
* ``exactly_once_rows``: the job as shipped but with ``job.handover = "rows"`` (tasks
  receive pickled Spark rows instead of Arrow record batches): the baseline of the
  Arrow hand-over;
* ``exactly_once_serial``: the job as shipped with ``clickhouse.insert_concurrency = 1``
  and ``clickhouse.ping_after_idle = "0s"`` (one insert at a time, a ping before each
  query): the baseline of the concurrent inserts within this checkout;
* ``exactly_once_cN``: the job as shipped with ``clickhouse.insert_concurrency = N``;
* ``exactly_once_sN``: the job as shipped with N Spark task slots (``local[N]``) on the
  same ``--cores`` CPUs: more partition tasks at once than cores, for tasks that mostly
  wait on the servers; ``exactly_once_sNcM``: both (``s4c2``: 4 slots of 2 lanes, the
  same 8 inserts in flight as 2 slots of 4);
* ``baseline``: the job of another checkout (``--baseline-root``, e.g. ``git archive
  main``), run with the same configuration: a whole earlier version side by side;

over block sizes (``--block-rows``) and cores (``--cores``: ``local[N]`` and the job's
process tree pinned to N CPUs with ``taskset``; ClickHouse and Kafka are not pinned).
Every run starts from a dropped page cache (``--keep-page-cache`` keeps it): on the VMs
these run on, the kernel's cost of the parts' files grows with use, and a later run
paid for the earlier (docs/BENCHMARKS.md, *What the servers' drift is*).

Figures per run: rows/s and MB/s over the **processing** interval (first row visible
in ClickHouse -> all rows visible; JVM start-up excluded, reported apart), CPU seconds
per million rows of the job's process tree (driver, JVM, Python workers; sampled from
``/proc`` every 0.5 s), over the whole run and over the processing interval alone
(start-up excluded), and of the servers, peak RSS of the job's process tree. Then a
latency run: the job streaming, a producer at ``--latency-rate`` rows/s, measured for
``--latency-seconds`` once the job has streamed ``--latency-warmup`` seconds past its
first visible probe (so the backlog of its start-up is not what is measured), and a
probe row per 100 ms whose produce time is compared with
the moment a poller (every 50 ms) first sees it in ClickHouse: p50/p99; with
``--latency-modes`` and ``--latency-repeat``, each mode's streaming run repeated in ABBA
order and compared by the median of its p99s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from bench.bench_limits import Servers, append_section
from bench.workload import (
    COLUMNS,
    JOB_PY,
    REPO_ROOT,
    Rows,
    ch_client,
    create_topic,
    drop_page_cache,
    produce,
    session_processes,
    stack_addresses,
)
from blockagg.proto.envelope import make_envelope
from blockagg.rows.deadletters import dead_letter_ddl
from tests.faults.workload import COORDINATES, ROW_MESSAGE, row_descriptor_set, varint

VARIANT_MODE: Final = re.compile(r"exactly_once_(?:s(?P<slots>[1-9][0-9]*))?"
                                 r"(?:c(?P<lanes>[1-9][0-9]*))?"
                                 r"(?:e(?P<shared>[1-9][0-9]*))?")
"""``exactly_once_sN``, ``exactly_once_cM`` or both (``exactly_once_s4c2``), optionally
with ``eK``: ``executor_insert_concurrency = K`` (``exactly_once_s4c8e8``)."""


def variant(mode: str) -> tuple[int | None, int | None]:
    """(task slots, insert lanes a task) a mode sets; None where it keeps the job's."""
    m = VARIANT_MODE.fullmatch(mode)
    if m is None:
        return None, None
    slots, lanes = m["slots"], m["lanes"]
    return (int(slots) if slots else None), (int(lanes) if lanes else None)


def shared_lanes(mode: str) -> int | None:
    """The ``executor_insert_concurrency`` a mode sets (``…eK``); None where it keeps
    the job's."""
    m = VARIANT_MODE.fullmatch(mode)
    return int(m["shared"]) if m is not None and m["shared"] else None


def task_slots(mode: str, cores: int) -> int:
    """Spark task slots of a run: N for an ``…_sN`` mode, else one per core."""
    return variant(mode)[0] or cores


@dataclass(frozen=True)
class Watched:
    """What :meth:`Bench.watch` saw of a run: the rows visible at the end, when the
    first became visible (``perf_counter``; the end when none did), the processing
    interval's seconds and the job's CPU over it, and the servers' CPU at its start."""

    rows: int
    start: float
    seconds: float
    job_cpu_s: float
    servers_at_first: float


@dataclass
class RunResult:
    mode: str
    cores: int
    block_rows: int
    rows: int
    startup_s: float
    seconds: float
    job_cpu_s: float
    server_cpu_s: float
    peak_rss_mib: float
    row_bytes: float
    exit_code: int
    processing_cpu_s: float = 0.0
    log_offset: int = 0
    """Where the measured batches' lines start in the run's log (after a warm run's
    warm-up batch, :meth:`Bench.warm_run`)."""
    processing_server_cpu_s: float = 0.0
    """The servers' CPU over the processing interval (first row visible to all)."""
    job_cpu_by_kind: dict[str, float] | None = None
    """A warm run's ``job_cpu_s`` split by process (:meth:`TreeSampler.by_kind`)."""
    jvm_threads_cpu: dict[str, float] | None = None
    """A warm run's JVM CPU by thread name (:meth:`TreeSampler.jvm_threads`)."""
    jvm: dict[str, Any] | None = None
    """With ``--jfr``, a warm run's JVM samples over its measured interval
    (:func:`bench.jvm_samples.summarize`)."""
    servers: dict[str, Any] | None = None
    """A warm run's servers over ``server_cpu_s``'s interval, split by process and by
    ``system.events`` (:meth:`bench.bench_limits.ServerSample.since`); the events include
    the run's own polls of the row count, one ``SELECT`` every 0.25 s."""
    warm_gap_s: float | None = None
    """A warm run's seconds from its warm-up's last row visible to the measured interval's
    start (the wait for final commits, any settling, producing the measured rows)."""
    settle_s: float | None = None
    """A warm run's seconds waited for the warm-up's merges to end on every replica
    (:meth:`Bench.settle_merges`); ``None`` when not waited for."""

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.rows_per_s * self.row_bytes / 1e6

    def line(self) -> str:
        if not self.rows:
            return f"{self.mode:<14} cores={self.cores} no rows (exit {self.exit_code})"
        return (f"{self.mode:<14} cores={self.cores} block_rows={self.block_rows:>9,} "
                f"{self.rows_per_s:>10,.0f} rows/s {self.mb_per_s:>6.1f} MB/s "
                f"job cpu {self.job_cpu_s / self.rows * 1e6:>6.1f} s/Mrows "
                f"(processing {self.processing_cpu_s / self.rows * 1e6:>4.1f}) "
                f"servers {self.server_cpu_s / self.rows * 1e6:>5.1f} s/Mrows "
                f"peak rss {self.peak_rss_mib:>6.0f} MiB  ({self.seconds:.1f} s + start-up "
                f"{self.startup_s:.1f} s, exit {self.exit_code})")


class TreeSampler:
    """CPU and RSS of every process in a session (the job's), sampled from /proc."""

    def __init__(self, sid: int) -> None:
        self.sid = sid
        self.cpu: dict[int, float] = {}
        self.kinds: dict[int, str] = {}
        self.peak_rss = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(0.5)

    def sample(self) -> None:
        rss = 0
        for pid, (cpu, resident) in session_processes(self.sid).items():
            self.cpu[pid] = max(self.cpu.get(pid, 0.0), cpu)
            rss += resident
        self.peak_rss = max(self.peak_rss, rss)

    def total(self) -> float:
        """CPU seconds of the session so far (a fresh sample)."""
        self.sample()
        return sum(self.cpu.values())

    def by_kind(self) -> dict[str, float]:
        """:meth:`total` split into the JVM (Spark's driver and, in local mode, its
        executor), the Python workers (``pyspark.daemon`` and the workers it forks,
        the tasks' Python) and the rest (the job's driver process)."""
        self.sample()
        out = dict.fromkeys(("jvm", "python_workers", "driver"), 0.0)
        for pid, cpu in self.cpu.items():
            out[self._kind(pid)] += cpu
        return out

    def jvm_threads(self) -> dict[str, float]:
        """The JVM's CPU seconds so far by thread name, numbers dropped (``C2
        CompilerThre``, ``GC Thread#``, ``Executor task launch worker for task``...:
        Linux keeps 15 characters of a name), from ``/proc/PID/task``."""
        ticks = os.sysconf("SC_CLK_TCK")
        out: dict[str, float] = {}
        for pid in [p for p in self.cpu if self._kind(p) == "jvm"]:
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    name = (task / "comm").read_text().strip()
                    fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                key = re.sub(r"[\d.]+$", "", name).rstrip("#-_ ") or name
                out[key] = out.get(key, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
        return out

    def _kind(self, pid: int) -> str:
        kind = self.kinds.get(pid)
        if kind is None:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                cmdline = []
            kind = ("jvm" if cmdline and cmdline[0].endswith(b"java") else
                    "python_workers" if b"pyspark.daemon" in cmdline
                    or b"pyspark.worker" in cmdline else "driver")
            self.kinds[pid] = kind
        return kind

    def finish(self) -> tuple[float, float]:
        self.stop.set()
        self.thread.join(timeout=5)
        return sum(self.cpu.values()), self.peak_rss / 2**20


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        stack = stack_addresses()
        self.bootstrap = stack["BLOCKAGG_BOOTSTRAP_SERVERS"]
        self.host = stack.get("BLOCKAGG_CH_HOST", "127.0.0.1")
        self.ports = [int(p) for p in stack["BLOCKAGG_CH_PORTS"].split(",")]
        self.jars = stack["BLOCKAGG_SPARK_JARS"]
        self.run_id = uuid.uuid4().hex[:6]
        self.database = f"e2e_{self.run_id}"
        self.rows = Rows(args.rows, args.tables, args.rows_per_message, args.partitions,
                         args.seed, self.database)
        self.topic = f"e2e-{self.run_id}"
        self.schema_topic = f"_blockagg_schemas_e2e_{self.run_id}"
        self.folder = Path(args.folder or f"/tmp/blockagg-e2e-{self.run_id}")
        self.folder.mkdir(parents=True, exist_ok=True)
        self.clients = [ch_client(self.host, p) for p in self.ports]
        self.servers = Servers(("clickhouse-r1", "clickhouse-r2", "kafka"))
        self.generation = 0
        self.profiled = False
        self.warm_gap_s: float | None = None
        """The last :meth:`warm_run`'s ``warm_gap_s``."""

    def table_names(self) -> list[str]:
        return [f"t{i:03d}" for i in range(self.args.tables)] + ["probe"]

    def register(self) -> None:
        from blockagg.aggregator.kafka.log_store import KafkaStore
        from blockagg.proto.registry import MemoryStore
        from blockagg.registration.register import register

        fds = row_descriptor_set()
        memory = MemoryStore()
        for name in self.table_names():
            register(memory, f"{self.database}.{name}", ROW_MESSAGE, fds)
        from confluent_kafka import Producer

        store = KafkaStore({"bootstrap.servers": self.bootstrap}, self.schema_topic)
        store.ensure_topic()
        # One producer for every registration: KafkaStore.write makes one a record
        # (about 0.5 s each, 8 minutes at 1,000 tables).
        producer = Producer({"bootstrap.servers": self.bootstrap, "enable.idempotence": True,
                             "acks": "all"})
        failed: list[str] = []
        for key, value in memory.read():
            assert key is not None and value is not None
            producer.produce(self.schema_topic, key=key, value=value, on_delivery=(
                lambda err, _msg: failed.append(str(err)) if err is not None else None))
        left = producer.flush(60)
        if left or failed:
            raise RuntimeError(f"registrations not acknowledged: {left} left, {failed[:3]}")

    def fresh_tables(self) -> None:
        """Drop and re-create every table on new ZooKeeper paths, many at a time (at 1,000
        tables one at a time this was 12 minutes of set-up a run)."""
        from bench.workload import execute_everywhere

        self.generation += 1
        g = self.generation
        names = self.table_names()
        for c in self.clients:
            c.execute(f"CREATE DATABASE IF NOT EXISTS {self.database}")
        execute_everywhere(self.host, self.ports, [
            f"DROP TABLE IF EXISTS {self.database}.{name}"
            for name in [*names, "dead_letters"]])
        execute_everywhere(self.host, self.ports, [
            f"CREATE TABLE {self.database}.{name} ({COLUMNS}, {COORDINATES}) ENGINE = "
            f"ReplicatedMergeTree('/clickhouse/tables/{{shard}}/{self.database}/g{g}/"
            f"{name}', '{{replica}}') ORDER BY id" for name in names] + [dead_letter_ddl(
                f"{self.database}.dead_letters",
                zk_path=f"/clickhouse/tables/{{shard}}/{self.database}/g{g}/dead_letters")])

    def settle_merges(self, timeout: float = 300.0) -> float:
        """Wait until the servers are done with a warm-up's parts: on every replica no
        merge running, no replication task queued and the count of active parts
        unchanged, four looks in a row half a second apart; returns the seconds waited.

        For ``--settle-warm-up`` (``bench_curves``): whether the job's measured batch
        pays for merges its warm-up left running. It does not (docs/BENCHMARKS.md, *Item
        1's three sizes again*: at 1,250 rows a block the servers were quiet 2.6 s after
        the warm-up, and the settled job ran 0.89x the unsettled). A small merge is
        over within milliseconds, so a look at ``system.merges`` alone misses most of
        them; the part count does not. Waited out, not forced: ``OPTIMIZE ... FINAL``
        on 18.16 failed here with ``Unknown log entry type: 0`` while merges ran."""
        started = time.monotonic()
        quiet, last = 0, None
        while quiet < 4:
            looks = [c.execute(
                "SELECT (SELECT count() FROM system.merges WHERE database = %(db)s) + "
                "(SELECT count() FROM system.replication_queue WHERE database = %(db)s), "
                "(SELECT count() FROM system.parts WHERE database = %(db)s AND active)",
                {"db": self.database})[0] for c in self.clients]
            busy = sum(int(b) for b, _ in looks)
            parts = [int(n) for _, n in looks]
            quiet = quiet + 1 if not busy and parts == last else 0
            last = parts
            if time.monotonic() - started > timeout:
                raise RuntimeError(f"the warm-up's parts still merging after {timeout:g}s "
                                   f"({busy} merges and replication tasks, parts {parts})")
            time.sleep(0.5)
        return time.monotonic() - started

    def drop_tables(self, like: str = "%") -> None:
        """Drop the run's tables whose name is ``LIKE like``, many at a time on each
        replica: tables left behind keep loading the servers (load average 21 on 2
        cores after ``bench_min_rows`` at 1,000 tables)."""
        from bench.workload import execute_everywhere

        names = [n for (n,) in self.clients[0].execute(
            "SELECT name FROM system.tables WHERE database = %(db)s AND name LIKE %(like)s",
            {"db": self.database, "like": like})]
        execute_everywhere(self.host, self.ports,
                           [f"DROP TABLE IF EXISTS {self.database}.{n}" for n in names])

    def drop_database(self) -> None:
        """Every table (:meth:`drop_tables`), then the database: 18.16 drops a
        database's tables one by one (79 s for 2,000 replicated tables)."""
        self.drop_tables()
        for c in self.clients:
            c.execute(f"DROP DATABASE IF EXISTS {self.database}")

    def config(self, block_rows: int, tag: str, mode: str = "exactly_once") -> tuple[Path, str]:
        group = f"e2e-{self.run_id}-{tag}"
        handover = "rows" if mode == "exactly_once_rows" else "arrow"
        serial = ('insert_concurrency = 1\nping_after_idle = "0s"'
                  if mode == "exactly_once_serial" else "")
        lanes = variant(mode)[1]
        if lanes is not None:
            serial = f"insert_concurrency = {lanes}"
        shared = shared_lanes(mode)
        if shared is not None:
            serial += f"\nexecutor_insert_concurrency = {shared}"
        path = self.folder / f"{tag}.toml"
        replicas = ", ".join(f'"127.0.0.1:{p}"' for p in self.ports)
        path.write_text(f"""
[job]
name = "{group}"
metadata_group_id = "{group}"
checkpoint_location = "{self.folder / ('cp-' + tag)}"
# each measured mode re-delivers the one topic into fresh tables under its own group,
# on purpose: its own ownership records (docs/running.md, One group per topic)
owners_topic = "_blockagg_owners_{group}"
trigger_interval = "{self.args.trigger}"
starting_offsets = "earliest"
handover = "{handover}"
{f'max_offsets_per_trigger = {self.args.max_offsets}' if self.args.max_offsets else ''}

[[topics]]
name = "{self.topic}"
replicas = [{replicas}]

[blocks]
max_rows = {block_rows}
max_bytes = "256MiB"

[clickhouse]
database = "{self.database}"
insert_quorum = {self.args.quorum}
{serial}

[kafka]
"bootstrap.servers" = "{self.bootstrap}"

[schemas]
topic = "{self.schema_topic}"

[dead_letters]
table = "{self.database}.dead_letters"

[metrics]
port = 0
""")
        return path, group

    def start_job(self, config: Path, mode: str, cores: int, until_caught_up: bool,
                  log: Path) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        root = self.args.baseline_root if mode == "baseline" else REPO_ROOT
        events = ""
        if getattr(self.args, "spark_event_log", False):
            folder = log.with_suffix(".events")
            folder.mkdir(exist_ok=True)
            events = (f"--conf spark.eventLog.enabled=true "
                      f"--conf spark.eventLog.dir=file://{folder} "
                      "--conf spark.eventLog.compress=false "
                      "--conf spark.eventLog.rolling.enabled=false ")
        java_options = getattr(self.args, "jvm_options", "") or ""
        if getattr(self.args, "jfr", False):
            java_options += (" -XX:StartFlightRecording="
                             f"filename={log.with_suffix('.jfr')},settings=profile,"
                             "dumponexit=true")
        if java_options.strip():
            events += f"--driver-java-options {shlex.quote(java_options.strip())} "
        env.update({
            "PYTHONPATH": str(root), "BLOCKAGG_LOG_FORMAT": "text",
            "PYSPARK_SUBMIT_ARGS": (f"--master local[{task_slots(mode, cores)}] --driver-memory 2g "
                                    f"--jars {self.jars} --conf spark.ui.enabled=false "
                                    "--conf spark.driver.host=127.0.0.1 "
                                    "--conf spark.driver.bindAddress=127.0.0.1 "
                                    f"{events}pyspark-shell"),
        })
        if mode == "at_least_once":
            env["BLOCKAGG_COMPONENTS"] = "bench.e2e_components:at_least_once"
        else:
            env.pop("BLOCKAGG_COMPONENTS", None)
        cpus = ",".join(str(i) for i in range(cores))
        job = root / JOB_PY.relative_to(REPO_ROOT)
        cmd = ["taskset", "-c", cpus, sys.executable, str(job), "--config", str(config)]
        if self.args.profile and mode == "exactly_once" and not self.profiled:
            self.profiled = True  # py-spy samples the driver and every Python worker
            cmd[3:3] = ["py-spy", "record", "--subprocesses", "--nonblocking", "--rate",
                        "50", "--format", "raw", "-o", str(self.folder / "profile.txt"), "--"]
        if until_caught_up:
            cmd.append("--until-caught-up")
        with open(log, "wb") as out:
            return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    cwd=root, start_new_session=True)

    def count(self) -> int:
        """Rows stored in the run's tables: the active parts' row counts, one query on
        ``system.parts`` (no table is read). A ``count()`` of every table each poll was
        11,000 SELECTs on the first replica in a 100-table run, ~12 CPU-s on the 2 cores
        the job and the servers share, charged to the job (docs/BENCHMARKS.md)."""
        names = tuple(self.table_names())
        return int(self.clients[0].execute(
            "SELECT sum(rows) FROM system.parts WHERE database = %(db)s AND active "
            "AND table IN %(t)s", {"db": self.database, "t": names})[0][0] or 0)

    def one_run(self, mode: str, cores: int, block_rows: int) -> RunResult:
        self.fresh_tables()
        tag = f"{mode}-{cores}-{block_rows}-{self.generation}"
        config, _ = self.config(block_rows, tag, mode)
        log = self.folder / f"{tag}.log"
        s0 = self.servers.cpu()
        t0 = time.perf_counter()
        proc = self.start_job(config, mode, cores, True, log)
        sampler = TreeSampler(proc.pid)
        w = self.watch(proc, sampler, self.count, time.monotonic() + self.args.timeout)
        s1 = self.servers.cpu()
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait(30)
        cpu, rss = sampler.finish()
        if w.rows != self.rows.rows:
            print(f"{tag}: {w.rows} of {self.rows.rows} rows (exit {proc.returncode}); "
                  f"log {log}", file=sys.stderr)
        return RunResult(mode, cores, block_rows, w.rows, w.start - t0, w.seconds, cpu,
                         s1 - s0, rss, self.rows.encoded_row_bytes, code, w.job_cpu_s, 0,
                         s1 - w.servers_at_first)

    def watch(self, proc: subprocess.Popen[bytes], sampler: TreeSampler,
              count: Callable[[], int], deadline: float) -> Watched:
        """Poll ``count()`` (the run's rows visible) every 0.25 s until it reaches the
        run's rows, the deadline passes or the job exits (then once more, a second
        later); the processing interval runs from the first visible row to the last."""
        first = None
        cpu_at_first = servers_at_first = 0.0
        n = 0
        while n < self.rows.rows and time.monotonic() < deadline:
            time.sleep(0.25)
            n = count()
            if n and first is None:
                first = time.perf_counter()
                cpu_at_first = sampler.total()
                servers_at_first = self.servers.cpu()
            if proc.poll() is not None and n < self.rows.rows:
                time.sleep(1)
                n = count()
                break
        done = time.perf_counter()
        if first is None:
            return Watched(n, done, 0.0, 0.0, self.servers.cpu())
        return Watched(n, first, done - first, sampler.total() - cpu_at_first,
                       servers_at_first)

    def warm_batches(self, warm_rows: int, batches: int = 1) -> list[Rows]:
        """The warm-up's rows of :meth:`warm_run`, in its ``batches`` batches."""
        batches = max(1, batches)
        return [Rows(warm_rows // batches, self.args.tables, self.args.rows_per_message,
                     self.args.partitions, self.args.seed + 1000 + k, self.database)
                for k in range(batches)]

    def warm_run(self, mode: str, cores: int, block_rows: int, warm_rows: int,
                 drop_cache: bool = True, warm_batches: int = 1,
                 settle: bool = False) -> RunResult:
        """:meth:`one_run`'s measurement on a job that has already run a batch: the
        job's JVM compiled, its Python workers started, its connections open, as a
        job streaming for a while has them. Each run gets a topic of its own: first
        ``warm_rows`` rows of another seed (the warm-up batch, not measured), then,
        once they are all visible, the measured rows in one Kafka transaction, which the
        job (``read_committed``) sees whole at its commit: one catch-up batch of the
        same blocks as :meth:`one_run`'s. ``warm_batches``: the warm-up rows come in
        that many batches, each produced once the one before is visible: Spark's JVM
        compiles its per-batch paths (planning, task set-up, the Kafka read) with C2
        over the first batches, not the first rows (docs/BENCHMARKS.md, "1 KiB rows, the
        driver's progress poll, and the JVM's share of a warm batch"). Measured from
        that commit, the page cache dropped just before the measured rows are produced
        (``drop_cache``), with ``settle`` once the warm-up's merges are done
        (:meth:`settle_merges`); the job is stopped (SIGTERM) once every row is visible."""
        from bench.workload import drop_page_cache, produce

        self.fresh_tables()
        tag = f"{mode}-{cores}-{block_rows}-{self.generation}"
        topic = f"{self.topic}-w{self.generation}"
        create_topic(self.bootstrap, topic, self.args.partitions)
        warm = self.warm_batches(warm_rows, warm_batches)
        warm_total = sum(w.rows for w in warm)
        # Each warm-up batch in one transaction, as the measured rows: produced plainly,
        # a batch the job planned while it was being produced came in two, and the warm
        # tables held 800 more small parts than the limit's (docs/BENCHMARKS.md).
        produce(self.bootstrap, topic, warm[0].envelopes(),
                transactional_id=f"bench-{self.run_id}-{self.generation}-w0")
        saved, self.topic = self.topic, topic
        config, _ = self.config(block_rows, tag, mode)
        self.topic = saved
        log = self.folder / f"{tag}.log"
        proc = self.start_job(config, mode, cores, False, log)
        sampler = TreeSampler(proc.pid)
        deadline = time.monotonic() + self.args.timeout
        landed = 0
        for k, rows in enumerate(warm):
            if k:
                produce(self.bootstrap, topic, rows.envelopes(),
                        transactional_id=f"bench-{self.run_id}-{self.generation}-w{k}")
            landed += rows.rows
            while self.count() < landed:
                if proc.poll() is not None or time.monotonic() > deadline:
                    if proc.poll() is None:
                        os.killpg(proc.pid, signal.SIGKILL)
                    raise RuntimeError(f"{tag}: warm-up batch {k + 1} did not land; log {log}")
                time.sleep(0.25)
        landed_at = time.monotonic()
        time.sleep(2)  # the warm-up batch's final commits, after its last insert
        settle_s = self.settle_merges() if settle else None
        log_offset = log.stat().st_size
        if drop_cache:
            drop_page_cache()
        produce(self.bootstrap, topic, self.rows.envelopes(),
                transactional_id=f"bench-{self.run_id}-{self.generation}")
        before = self.servers.sample(self.clients)
        s0 = sum(before.cpu.get(n, 0.0) for n in self.servers.names)
        self.warm_gap_s = time.monotonic() - landed_at
        t0 = time.perf_counter()
        epoch_from = time.time()
        kinds_at_start = sampler.by_kind()
        threads_at_start = sampler.jvm_threads()
        cpu_at_start = sum(kinds_at_start.values())
        w = self.watch(proc, sampler, lambda: self.count() - warm_total, deadline)
        kinds_at_done = sampler.by_kind()
        threads_at_done = sampler.jvm_threads()
        cpu_at_done = sum(kinds_at_done.values())
        epoch_to = time.time()
        split = self.servers.sample(self.clients).since(before)
        s1 = s0 + self.servers.summed(split)
        if proc.poll() is None:
            time.sleep(2)  # the measured batch's final commits
            os.kill(proc.pid, signal.SIGTERM)
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait(30)
        sampler.finish()
        if w.rows != self.rows.rows:
            print(f"{tag}: {w.rows} of {self.rows.rows} measured rows (exit {code}); "
                  f"log {log}", file=sys.stderr)
        jvm = None
        if getattr(self.args, "jfr", False) and log.with_suffix(".jfr").exists():
            from bench.jvm_samples import read_samples, summarize

            jvm = summarize(read_samples(log.with_suffix(".jfr")), epoch_from, epoch_to)
        return RunResult(mode, cores, block_rows, w.rows, w.start - t0, w.seconds,
                         cpu_at_done - cpu_at_start, s1 - s0, 0.0,
                         self.rows.encoded_row_bytes, code, w.job_cpu_s, log_offset,
                         s1 - w.servers_at_first, jvm=jvm,
                         job_cpu_by_kind={k: kinds_at_done[k] - kinds_at_start[k]
                                          for k in kinds_at_done},
                         jvm_threads_cpu={k: v - threads_at_start.get(k, 0.0)
                                          for k, v in threads_at_done.items()
                                          if v - threads_at_start.get(k, 0.0) > 0},
                         settle_s=settle_s, servers=split, warm_gap_s=self.warm_gap_s)

    def latency(self, block_rows: int, mode: str = "exactly_once") -> dict[str, float]:
        """Streaming: rows at a fixed rate plus probes; p50/p99 produce -> visible."""
        self.fresh_tables()
        tag = f"latency-{mode}-{self.generation}"
        topic = f"{self.topic}-lat{self.generation}"
        create_topic(self.bootstrap, topic, self.args.partitions)
        saved, self.topic = self.topic, topic
        config, _ = self.config(block_rows, tag, mode)
        self.topic = saved
        proc = self.start_job(config, mode, 2, False, self.folder / f"{tag}.log")
        sampler = TreeSampler(proc.pid)
        cpu_from = servers_from = cpu_to = servers_to = 0.0
        log_end = 0
        from confluent_kafka import Producer

        producer = Producer({"bootstrap.servers": self.bootstrap, "linger.ms": 5,
                             "enable.idempotence": True})
        sent: dict[int, float] = {}
        seen: dict[int, float] = {}
        stop = threading.Event()

        def poll() -> None:
            client = ch_client(self.host, self.ports[0])
            while not stop.is_set():
                # list(): one step under the GIL, while the producing thread adds to sent
                low = min((i for i in list(sent) if i not in seen), default=None)
                if low is not None:
                    for (i,) in client.execute(
                            f"SELECT id FROM {self.database}.probe WHERE id >= {low}"):
                        seen.setdefault(int(i), time.time())
                stop.wait(0.05)

        # the job runs once its first probe is visible; it has worked off its start-up
        # backlog --latency-warmup seconds later; then measure
        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        tail = self.rows.pool[0].tail
        next_id = 10**12
        probe = 0
        warm_deadline = time.monotonic() + 300
        running_from: float | None = None
        measured_from = None
        log = self.folder / f"{tag}.log"
        log_offset = 0
        started = time.monotonic()
        rate = self.args.latency_rate
        per_tick = max(1, int(rate * 0.1 / self.args.rows_per_message))
        m = 0
        while True:
            now = time.monotonic()
            if running_from is None and (seen or now > warm_deadline):
                running_from = now
            if measured_from is None:
                if running_from is not None and now - running_from >= self.args.latency_warmup:
                    measured_from = now
                    log_offset = log.stat().st_size if log.exists() else 0
                    cpu_from, servers_from = sampler.total(), self.servers.cpu()
                    sent.clear()
                    seen.clear()
            elif now - measured_from > self.args.latency_seconds:
                # the window's CPU and the end of its batch lines: what a window's
                # micro-batches cost (bench.bench_stream_floor divides by them)
                cpu_to, servers_to = sampler.total(), self.servers.cpu()
                log_end = log.stat().st_size if log.exists() else 0
                break
            for _ in range(per_tick):
                rows = [b"\x08" + varint(next_id + k) + tail
                        for k in range(self.args.rows_per_message)]
                next_id += self.args.rows_per_message
                producer.produce(topic, value=make_envelope(self.rows.table(m), rows, 1),
                                 partition=self.rows.partition(m))
                m += 1
            probe += 1
            producer.produce(topic, value=make_envelope(
                f"{self.database}.probe", [b"\x08" + varint(probe) + tail], 1),
                partition=probe % self.args.partitions)
            sent[probe] = time.time()
            producer.poll(0)
            time.sleep(max(0.0, 0.1 - (time.monotonic() - now)))
        producer.flush(60)
        wait_end = time.monotonic() + 60
        while time.monotonic() < wait_end and len(seen) < len(sent):
            time.sleep(0.2)
        stop.set()
        poller.join(5)
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        sampler.finish()
        lat = sorted(seen[i] - sent[i] for i in sent if i in seen)
        if not lat:
            return {"probes": len(sent), "seen": 0}
        return {"mode": mode, "probes": len(sent), "seen": len(lat), "rate_rows_s": rate,
                "p50_s": lat[len(lat) // 2], "p99_s": lat[min(len(lat) - 1,
                                                              int(len(lat) * 0.99))],
                "max_s": lat[-1], "seconds": round(time.monotonic() - started, 1),
                "warmup_s": self.args.latency_warmup, "batches": batch_times(log, log_offset),
                "log": str(log), "log_offset": log_offset, "log_end": log_end,
                "job_cpu_s": round(cpu_to - cpu_from, 2),
                "server_cpu_s": round(servers_to - servers_from, 2)}


BATCH_TIMES: Final = ("seconds", "max_task_seconds", "task_seconds", "commit_seconds",
                      "insert_seconds")


def streaming_only(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` of a bench that runs only :class:`Bench`'s streaming window
    (``--rate``, ``--seconds``, ``--warmup``), completed with what :class:`Bench` reads."""
    args.rows, args.latency_rate = 1000, args.rate
    args.latency_seconds, args.latency_warmup = args.seconds, args.warmup
    args.baseline_root, args.profile, args.timeout = None, False, 900
    return args


def batch_times(log: Path, offset: int = 0) -> dict[str, list[float]]:
    """Per field of the job's batch line (:data:`BATCH_TIMES`), median and max over the
    micro-batches logged from byte ``offset`` of the job's log on (where the measured
    window began), the first micro-batch (which starts the workers) never counted:
    where a streaming batch's time went."""
    runs: dict[str, list[float]] = {k: [] for k in BATCH_TIMES}
    text = ""
    if log.exists():
        with log.open("rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    for m in re.finditer(r"blockagg\.job: batch kind=\S+ batch=(\d+) ([^\n]*)", text):
        if int(m.group(1)) == 0:
            continue
        fields = dict(re.findall(r"(\w+)=([0-9.]+)(?:\s|$)", m.group(2)))
        for key in BATCH_TIMES:
            if key in fields:
                runs[key].append(float(fields[key]))
    return {k: [round(statistics.median(v), 2), round(max(v), 2)] for k, v in runs.items() if v}


def top_functions(path: Path, n: int) -> list[str]:
    """Self time per leaf function from py-spy's collapsed stacks, as % of samples."""
    from collections import Counter

    leaf: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frame = stack.split(";")[-1]
        name = frame.split(" (")[0] + " (" + frame.split(" (")[-1].split(":")[0].split("/")[-1]
        leaf[name + ")"] += int(count)
        total += int(count)
    return [f"  {100 * c / total:5.1f}%  {name}" for name, c in leaf.most_common(n)]


def plot(results: list[RunResult], limits: dict[str, Any] | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels, values = [], []
    seen: set[str] = set()
    ordered = sorted(results, key=lambda r: -r.rows_per_s)  # best run of each mode
    if limits:
        for r in limits["results"]:
            labels.append(r["name"].replace("ClickHouse ", "CH "))
            values.append(r["rows_per_s"])
    for r in ordered:
        if r.cores == 2 and r.block_rows == results[0].block_rows and r.mode not in seen:
            seen.add(r.mode)
            labels.append(f"blockagg {r.mode.replace('_', '-')}")
            values.append(r.rows_per_s)
    ax1.barh(labels, values, color="tab:blue")
    ax1.axvline(200_000, color="tab:red", linestyle="--", linewidth=1,
                label="target: 200,000 rows/s end to end")
    ax1.set_xlim(0, max(values) * 1.25)
    ax1.legend(fontsize=8, loc="lower right")
    ax1.set_xlabel("rows/s")
    ax1.set_title("Same row shape, same machine (best run of each)", fontsize=10)
    for y, v in enumerate(values):
        ax1.text(v, y, f" {v:,.0f}", va="center", fontsize=8)
    for mode in ("exactly_once", "at_least_once"):
        by_size: dict[int, float] = {}
        for r in results:
            if r.mode == mode and r.cores == 2:
                by_size[r.block_rows] = max(by_size.get(r.block_rows, 0.0), r.rows_per_s)
        pts = sorted(by_size.items())
        if len(pts) > 1:
            ax2.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
    ones = [r for r in results if r.cores == 1]
    for r in ones:
        ax2.scatter([r.block_rows], [r.rows_per_s], marker="x", color="k",
                    label=f"{r.mode}, 1 core")
    ax2.set_xscale("log")
    ax2.set_ylim(bottom=0)
    ax2.set_xlabel("blocks.max_rows")
    ax2.set_ylabel("rows/s")
    ax2.set_title("blockagg throughput vs block size (2 cores)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--tables", type=int, default=100)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--rows-per-message", type=int, default=10)
    ap.add_argument("--block-rows", default="100000", help="comma list; the first is the "
                    "size of the mode and cores comparison")
    ap.add_argument("--cores", default="2,1")
    ap.add_argument("--modes", default="exactly_once,at_least_once",
                    help="comma list of exactly_once, at_least_once, exactly_once_rows")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs of each mode at the first block size and core count")
    ap.add_argument("--quorum", type=int, default=0)
    ap.add_argument("--trigger", default="1s")
    ap.add_argument("--max-offsets", type=int, default=0)
    ap.add_argument("--latency-rate", type=float, default=20_000)
    ap.add_argument("--latency-seconds", type=float, default=30)
    ap.add_argument("--latency-warmup", type=float, default=30,
                    help="seconds the producer runs after the job's first probe is visible "
                         "before the measured window starts (the start-up backlog drains)")
    ap.add_argument("--latency-modes", default="exactly_once",
                    help="comma list of modes whose streaming latency is measured")
    ap.add_argument("--latency-repeat", type=int, default=1,
                    help="streaming runs of each latency mode, interleaved ABBA")
    ap.add_argument("--baseline-root", type=Path,
                    help="another checkout whose job the 'baseline' mode runs")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep-page-cache", action="store_true",
                    help="do not drop the kernel's page cache before each run (by default "
                    "every run starts from a dropped cache: bench.workload.drop_page_cache)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--folder")
    ap.add_argument("--spark-event-log", action="store_true",
                    help="each job run writes Spark's event log beside its log "
                         "(`python -m bench.spark_tasks` splits its slots' time)")
    ap.add_argument("--jvm-options", default="",
                    help="more options for the job's JVM (e.g. -XX:+PrintCompilation)")
    ap.add_argument("--jfr", action="store_true",
                    help="each job run records Java Flight Recorder samples beside its log "
                         "(`python -m bench.jvm_samples` splits them)")
    ap.add_argument("--profile", action="store_true",
                    help="run the first exactly-once run under py-spy and print where the "
                    "Python time goes (self time by function)")
    ap.add_argument("--limits-json", type=Path, help="bench_limits --json output to plot along")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--append", action="store_true")
    ap.add_argument("--replot", type=Path, help="only redraw --plot from this --json output")
    args = ap.parse_args(argv)
    if args.replot:
        data = json.loads(args.replot.read_text())
        fields = set(RunResult.__dataclass_fields__)
        runs = [RunResult(**{k: v for k, v in r.items() if k in fields}) for r in data["results"]]
        plot(runs, data.get("limits"), args.plot)
        return 0

    bench = Bench(args)
    bench.fresh_tables()
    bench.register()
    create_topic(bench.bootstrap, bench.topic, args.partitions)
    print(f"producing {args.rows:,} rows ...", file=sys.stderr)
    _, size, _ = produce(bench.bootstrap, bench.topic, bench.rows.envelopes())
    sizes = [int(b) for b in args.block_rows.split(",")]
    modes = args.modes.split(",")
    cores = [int(c) for c in args.cores.split(",")]
    # the mode comparison is repeated, interleaved in ABBA order (whichever mode runs first
    # in a pair never always runs first), and compared best-of (a shared machine's noise
    # only ever slows a run down)
    plan = [(m, cores[0], sizes[0]) for r in range(args.repeat)
            for m in (modes if r % 2 == 0 else modes[::-1])]
    plan += [("exactly_once", cores[0], b) for b in sizes[1:]]
    plan += [(m, c, sizes[0]) for c in cores[1:] for m in modes[:1]]
    results = []
    for mode, c, b in plan:
        if not args.keep_page_cache and not drop_page_cache():
            print("cannot drop the page cache (not root?): the servers' drift stays in the "
                  "comparison", file=sys.stderr, flush=True)
        r = bench.one_run(mode, c, b)
        print(r.line(), file=sys.stderr, flush=True)
        results.append(r)
    latency_modes = args.latency_modes.split(",")
    latencies = [bench.latency(sizes[0], m) for r in range(args.latency_repeat)
                 for m in (latency_modes if r % 2 == 0 else latency_modes[::-1])
                 ] if args.latency_seconds > 0 else []
    latency = latencies[0] if len(latencies) == 1 else {}
    def best(mode: str) -> RunResult | None:
        runs = [r for r in results if r.mode == mode and r.cores == cores[0]
                and r.block_rows == sizes[0] and r.rows == args.rows]
        return max(runs, key=lambda r: r.rows_per_s, default=None)

    eo, alo, rows = best("exactly_once"), best("at_least_once"), best("exactly_once_rows")
    lines = [f"rows={args.rows:,} tables={args.tables} partitions={args.partitions} "
             f"rows/message={args.rows_per_message} row_bytes={bench.rows.encoded_row_bytes:.1f}"
             f" topic_MB={size / 1e6:,.0f} quorum={args.quorum} trigger={args.trigger}",
             *(r.line() for r in results)]
    if eo and alo and alo.rows_per_s:
        lines.append(f"best of {args.repeat}: exactly-once {eo.rows_per_s:,.0f} rows/s "
                     f"(wall incl. start-up {eo.rows / (eo.seconds + eo.startup_s):,.0f}), "
                     f"at-least-once {alo.rows_per_s:,.0f} rows/s (wall incl. start-up "
                     f"{alo.rows / (alo.seconds + alo.startup_s):,.0f}); exactly-once / "
                     f"at-least-once: {eo.rows_per_s / alo.rows_per_s:.2f}")

        def median_cpu(mode: str) -> float:
            xs = sorted(r.processing_cpu_s / r.rows * 1e6 for r in results
                        if r.mode == mode and r.cores == cores[0] and r.block_rows == sizes[0]
                        and r.rows == args.rows)
            return xs[len(xs) // 2] if xs else 0.0

        e_cpu, a_cpu = median_cpu("exactly_once"), median_cpu("at_least_once")
        if a_cpu:
            lines.append(f"job CPU over the processing interval, median of {args.repeat}: "
                         f"exactly-once {e_cpu:.2f}, at-least-once {a_cpu:.2f} s/Mrows; "
                         f"exactly-once / at-least-once: {e_cpu / a_cpu:.2f}")
    def median_rate(mode: str) -> float:
        xs = sorted(r.rows_per_s for r in results if r.mode == mode and r.cores == cores[0]
                    and r.block_rows == sizes[0] and r.rows == args.rows)
        return xs[len(xs) // 2] if xs else 0.0

    medians = {m: median_rate(m) for m in modes}
    lines.append(f"median of {args.repeat}: " + ", ".join(
        f"{m} {v:,.0f} rows/s" for m, v in medians.items()))
    if len(modes) > 1 and medians[modes[0]]:
        lines.append(", ".join(f"{m} / {modes[0]}: {medians[m] / medians[modes[0]]:.2f}"
                               for m in modes[1:]) + f" (median of {args.repeat}, ABBA)")
    if eo and rows and rows.rows_per_s:
        lines.append(f"best of {args.repeat}: exactly-once with the Arrow hand-over "
                     f"{eo.rows_per_s:,.0f} rows/s, with the row hand-over "
                     f"{rows.rows_per_s:,.0f} rows/s; Arrow / rows: "
                     f"{eo.rows_per_s / rows.rows_per_s:.2f} (job CPU "
                     f"{eo.job_cpu_s / eo.rows * 1e6:.1f} vs "
                     f"{rows.job_cpu_s / rows.rows * 1e6:.1f} s/Mrows, processing "
                     f"{eo.processing_cpu_s / eo.rows * 1e6:.1f} vs "
                     f"{rows.processing_cpu_s / rows.rows * 1e6:.1f})")
    limits = json.loads(args.limits_json.read_text()) if args.limits_json else None
    if limits and eo:
        for r in limits["results"]:
            lines.append(f"exactly-once / {r['name']}: {eo.rows_per_s / r['rows_per_s']:.2f}"
                         + (f" (best), {medians['exactly_once'] / r['rows_per_s']:.2f} "
                            "(median)" if medians.get("exactly_once") else ""))
    if latency:
        lines.append("latency (exactly-once, streaming): " + json.dumps(
            {k: round(v, 3) if isinstance(v, float) else v for k, v in latency.items()}))
    elif latencies:
        for one in latencies:
            lines.append("latency (streaming): " + json.dumps(
                {k: round(v, 3) if isinstance(v, float) else v for k, v in one.items()}))
        p99s = {m: sorted(x["p99_s"] for x in latencies if x.get("mode") == m
                          and x.get("seen") == x.get("probes")) for m in latency_modes}
        medians = {m: xs[len(xs) // 2] for m, xs in p99s.items() if xs}
        lines.append("latency p99, median of " + ", ".join(
            f"{m} {medians[m]:.1f} s ({len(p99s[m])} complete)" for m in medians))
        if len(medians) == 2:
            a, b = latency_modes
            if a in medians and b in medians and medians[a]:
                lines.append(f"latency p99 {b} / {a}: {medians[b] / medians[a]:.2f}")
    if args.profile and (bench.folder / "profile.txt").exists():
        lines.append("profile (py-spy, self time of the job's Python processes, top 15):")
        lines.extend(top_functions(bench.folder / "profile.txt", 15))
    text = "\n".join(lines)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"results": [
            {**asdict(r), "rows_per_s": r.rows_per_s, "mb_per_s": r.mb_per_s}
            for r in results], "latency": latency or latencies, "limits": limits},
            indent=1))
    if args.plot:
        plot(results, limits, args.plot)
    if args.append:
        command = "python -m bench.bench_e2e " + " ".join(
            a for a in (argv if argv is not None else sys.argv[1:]) if a != "--append")
        append_section("blockagg end to end", command, text)
    bench.drop_database()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
