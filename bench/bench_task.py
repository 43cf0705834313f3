"""The job's CPU per row in one task, without Spark: ``python -m bench.bench_task``.

One Kafka partition's messages of the end-to-end workload (:class:`bench.workload.Rows`:
``bench/row.proto``'s 10-field ``Event``, 10 rows a message, every table in the
partition, the ``_topic``/``_partition``/``_offset`` columns) go through
:func:`blockagg.spark.task.run_range` exactly as a task runs them after the Arrow
hand-over: envelopes, registry, decode, conversion, block formation, metadata, and a
real insert of every block into ``ReplicatedMergeTree`` tables on the stack the
environment points at. The metadata store is in memory (its Kafka commits are the
I/O side, not CPU per row). The figure is this process's CPU (``time.process_time``)
per million rows, with the kernel's part of it (system time: socket calls, page faults);
the servers' share is not in it.

``--baseline DIR`` runs the same measurement with the code of another checkout (a
``git archive`` of main, say) in child processes, interleaved with this checkout's
(ABBA: base, new, new, base, ...), each child a fresh process on fresh tables, and
reports the medians and their ratio. ``--warm-rows N`` runs a first batch of ``N`` rows
(the same tables) before the measured one, in the same process: a Spark Python worker
is reused from batch to batch (``spark.python.worker.reuse``), so from its second batch
on its heap has already been grown and touched; a fresh child's measured batch also
pays the kernel's first touch of every page it grows into (``faults``, minor page
faults in the measured batch, a few µs each on these VMs). ``--profile FILE`` runs one child of this
checkout under py-spy instead. ``--stages`` splits each child's CPU by stage (thread
CPU time, the insert lanes' threads included): the rows stage, and each insert's parts
(the block's columns, the query packet, the server's sample block, the Data packet,
the end of the insert), without a profiler's per-call cost.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TOPIC = "bench_task"


STAGES: tuple[tuple[str, str, str, str], ...] = (
    ("prepare", "blockagg.spark.task", "", "prepare_partition"),
    ("prepare.envelopes", "blockagg.rows.partition", "", "parse_envelopes"),
    ("prepare.decide", "blockagg.rows.prepare", "", "decide_envelopes_many"),
    ("prepare.gather", "blockagg.proto.decode", "", "_gather_ranges"),
    ("insert", "blockagg.aggregator.clickhouse.writer", "ClickHouseBlockWriter", "insert"),
    ("insert.block_data", "blockagg.aggregator.clickhouse.writer", "ClickHouseBlockWriter",
     "block_data"),
    ("insert.send_query", "clickhouse_driver.connection", "Connection", "send_query"),
    ("insert.send_query", "blockagg.aggregator.clickhouse.native", "NativeClient",
     "send_insert_query"),
    ("insert.sample_block", "clickhouse_driver.client", "Client", "receive_sample_block"),
    ("insert.send_data", "blockagg.aggregator.clickhouse.native", "NativeClient", "send_data"),
    ("insert.end", "clickhouse_driver.client", "Client", "receive_end_of_insert_query"),
)
"""(stage, module, class or "" for a module function, function): what ``--stages``
times. ``insert.*`` run inside ``insert``."""


def time_stages() -> dict[str, float]:
    """Wrap every :data:`STAGES` function so that each call adds its thread's CPU time
    to the returned dict (the caller reads it after the run)."""
    import importlib
    import threading

    from blockagg.aggregator.clickhouse.native import native_client_class

    spent: dict[str, float] = dict.fromkeys((name for name, *_ in STAGES), 0.0)
    lock = threading.Lock()

    def timed(name: str, fn: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            began = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                with lock:
                    spent[name] += time.thread_time() - began
        return call

    for name, module, cls, function in STAGES:
        owner: Any = (native_client_class() if cls == "NativeClient" else
                      getattr(importlib.import_module(module), cls) if cls else
                      importlib.import_module(module))
        if function in vars(owner):  # a checkout without it (--baseline) skips it
            setattr(owner, function, timed(name, getattr(owner, function)))
    return spent


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One measurement with the ``blockagg`` this process imports."""
    import blockagg
    from bench.workload import Rows, ch_client, stack_env
    from blockagg.aggregator.core.model import Committed
    from blockagg.proto.registry import MemoryStore, RegistryCache

    try:
        from blockagg.config import loads
        from blockagg.registration.register import register
    except ImportError:  # a --baseline checkout from before config and registration moved
        from blockagg.aggregator.config import loads  # type: ignore[import-not-found,no-redef]

        from blockagg.proto.registry import register  # type: ignore[attr-defined,no-redef]
    from blockagg.spark.components import DefaultComponents, make_writer
    from blockagg.spark.offsets import PlannedRange
    from blockagg.spark.task import TaskContext, run_range
    from tests.faults.workload import COLUMNS, COORDINATES, ROW_MESSAGE, row_descriptor_set

    env = {**stack_env(), **{k: v for k, v in os.environ.items() if k.startswith("BLOCKAGG_")}}
    host, ports = env["BLOCKAGG_CH_HOST"], env["BLOCKAGG_CH_PORTS"].split(",")
    database = f"bench_task_{uuid.uuid4().hex[:8]}"
    # One partition of the workload: its messages go to the tables round-robin.
    rows = Rows(args.rows + args.warm_rows, args.tables, args.rows_per_message, 1,
                args.seed, database)
    if args.string_bytes:
        from bench.bench_curves import widen

        rows = widen(rows, args.string_bytes)
    admin = [ch_client(host, int(p)) for p in ports]
    names = [f"t{i:03d}" for i in range(args.tables)]
    for c in admin:
        c.execute(f"CREATE DATABASE {database}")
        for name in names:
            c.execute(f"CREATE TABLE {database}.{name} ({COLUMNS}, {COORDINATES}) ENGINE = "
                      f"ReplicatedMergeTree('/clickhouse/tables/{{shard}}/{database}/{name}', "
                      "'{replica}') ORDER BY id")
    store = MemoryStore()
    for name in names:
        register(store, f"{database}.{name}", ROW_MESSAGE, row_descriptor_set(),
                 now_ms=1)
    registry = RegistryCache(store)
    config = loads(f"""
[job]
checkpoint_location = "/tmp/bench_task"
[kafka]
"bootstrap.servers" = "127.0.0.1:1"
[[topics]]
name = "{TOPIC}"
replicas = [{", ".join(f'"{host}:{p}"' for p in ports)}]
[blocks]
max_rows = {args.block_rows}
[dead_letters]
table = "{database}.dead_letters"
""")

    class Metadata:
        def __init__(self) -> None:
            self.commits: dict[tuple[str, int], Committed] = {}

        def committed(self, topic: str, partition: int) -> Committed | None:
            return self.commits.get((topic, partition))

        def commit(self, topic: str, partition: int, offset: int, metadata: str) -> None:
            self.commits[(topic, partition)] = Committed(offset, metadata)

    class Components:
        """The job's writer and a registry in memory; metadata in memory."""

        def __init__(self) -> None:
            self.metadata = Metadata()
            self.inner = DefaultComponents()
            self.writer = make_writer(config, config.topics[0])

        def store(self, config: Any) -> Metadata:
            return self.metadata

        def sink(self, config: Any, topic: Any) -> Any:
            return self.writer

        def registry(self, config: Any) -> RegistryCache:
            return registry

        def dedup_mode(self, config: Any, topic: Any) -> int:
            return int(self.inner.dedup_mode(config, topic))

    components = Components()
    offsets: list[int] = []
    values: list[bytes | None] = []
    for _, value in rows.envelopes():
        offsets.append(len(offsets))
        values.append(value)
    stamps = [1_700_000_000_000] * len(offsets)
    tp = (TOPIC, 0)
    try:
        # Warm-up: one small batch (imports, connections, plans, live columns), or
        # --warm-rows of them (a worker that has served a batch of that size).
        warm = (args.warm_rows // args.rows_per_message if args.warm_rows
                else min(len(offsets), args.tables * 2))
        ctx = TaskContext(config, components, {tp: PlannedRange(TOPIC, 0, 0, warm)}, 1, 1)
        run_range(ctx, tp, offsets[:warm], values[:warm], stamps[:warm])
        ctx = TaskContext(config, components,
                          {tp: PlannedRange(TOPIC, 0, warm, len(offsets))}, 2, 1)
        profiler = None
        profilers: list[Any] = []
        if args.cprofile:
            import cProfile
            import threading

            profiler = cProfile.Profile(time.thread_time)
            local = threading.local()
            insert = components.writer.insert

            def profiled_insert(*a: Any, **k: Any) -> Any:
                # The lanes' threads: cProfile sees only the thread that enables it.
                if not hasattr(local, "p"):
                    local.p = cProfile.Profile(time.thread_time)
                    profilers.append(local.p)
                local.p.enable()
                try:
                    return insert(*a, **k)
                finally:
                    local.p.disable()

            components.writer.insert = profiled_insert
            profiler.enable()
        spent = time_stages() if args.stages else None
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        w0, c0, t0 = time.perf_counter(), time.process_time(), os.times()
        report = run_range(ctx, tp, offsets[warm:], values[warm:], stamps[warm:])
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        kernel = os.times().system - t0.system
        if profiler is not None:
            profiler.disable()
            import pstats

            stats = pstats.Stats(profiler)
            for p in profilers:
                stats.add(p)
            stats.dump_stats(str(args.cprofile))
        stored = sum(int(admin[0].execute(f"SELECT count() FROM {database}.{n}")[0][0])
                     for n in names)
    finally:
        if not args.keep:
            for c in admin:
                c.execute(f"DROP DATABASE IF EXISTS {database}")
    measured = int(report["rows"])
    return {"code": str(Path(blockagg.__file__).parents[1]), "rows": measured,
            "stored": stored, "blocks": report["blocks"], "wall_s": wall, "cpu_s": cpu,
            "cpu_s_per_mrows": cpu / measured * 1e6, "rows_per_cpu_s": measured / cpu,
            "kernel_s": kernel, "faults": faults,
            **({"stages": spent} if spent is not None else {})}


def stage_lines(results: Sequence[dict[str, Any]]) -> list[str]:
    """Median CPU seconds per stage over ``results`` (and per block), the insert's own
    remainder (retries, checks, settings) after its timed parts, and the rest of the
    task (plan, metadata, lanes) after the rows stage and the inserts."""
    blocks = statistics.median(r["blocks"] for r in results)
    median = {name: statistics.median(r["stages"][name] for r in results)
              for name, *_ in STAGES}
    cpu = statistics.median(r["cpu_s"] for r in results)
    parts = sum(v for k, v in median.items() if k.startswith("insert."))
    rows = [*median.items(), ("insert.other", median["insert"] - parts),
            ("rest of the task", cpu - median["prepare"] - median["insert"])]
    return [f"stage {name:<20} {value:6.3f} s  {value / blocks * 1e3:6.3f} ms/block"
            for name, value in rows]


def top_functions(path: Path, n: int) -> list[str]:
    """Self time per leaf function inside ``run_range`` (py-spy's raw stacks), as %
    of those samples."""
    from collections import Counter

    leaf: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if "run_range (" not in stack or not count.isdigit():
            continue
        frame = stack.split(";")[-1]
        name = frame.split(" (")[0] + " (" + frame.split(" (")[-1].split(":")[0].split("/")[-1]
        leaf[name + ")"] += int(count)
        total += int(count)
    return [f"  {100 * c / total:5.1f}%  {name}" for name, c in leaf.most_common(n)]


def run_child(code: Path, args: argparse.Namespace, extra: Sequence[str] = ()
              ) -> dict[str, Any]:
    cmd = [*extra, sys.executable, str(Path(__file__).resolve()), "--child",
           "--rows", str(args.rows), "--tables", str(args.tables),
           "--rows-per-message",
           str(args.rows_per_message), "--block-rows", str(args.block_rows),
           "--seed", str(args.seed), "--string-bytes", str(args.string_bytes),
           "--warm-rows", str(args.warm_rows),
           *(["--stages"] if getattr(args, "stages", False) else [])]
    env = {**os.environ, "PYTHONPATH": str(code)}
    out = subprocess.run(cmd, env=env, cwd=code, check=True, capture_output=True, text=True)
    last = [line for line in out.stdout.splitlines() if line.startswith("{")][-1]
    return dict(json.loads(last))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=300_000, help="rows in the measured partition")
    ap.add_argument("--tables", type=int, default=100)
    ap.add_argument("--rows-per-message", type=int, default=10)
    ap.add_argument("--block-rows", type=int, default=100_000, help="[blocks] max_rows")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--string-bytes", type=int, default=0,
                    help="each row's name a string of this many bytes (bench_curves' "
                         "row_width point: 1024)")
    ap.add_argument("--warm-rows", type=int, default=0,
                    help="rows of a first batch in the same process before the measured "
                         "one (default: a small batch of two messages a table)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--baseline", type=Path, help="a checkout to compare with (ABBA)")
    ap.add_argument("--profile", type=Path, help="py-spy one run of this checkout into FILE")
    ap.add_argument("--cprofile", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--keep", action="store_true", help="keep the benchmark database")
    ap.add_argument("--stages", action="store_true",
                    help="split each run's CPU by stage (this checkout's medians)")
    args = ap.parse_args(argv)
    if args.child:
        sys.path.insert(0, os.getcwd())
        # Only the checkout's own modules: an editable install's finder would fill in,
        # from another checkout, a module this one does not have.
        sys.meta_path[:] = [f for f in sys.meta_path
                            if not getattr(f, "__module__", "").startswith("__editable__")]
        print(json.dumps(child(args)))
        return 0
    load = os.getloadavg()
    warm = (f"a first batch of {args.warm_rows:,}" if args.warm_rows
            else "a warm-up of two messages a table")
    print(f"# rows={args.rows:,} in one partition after {warm}, tables={args.tables} "
          f"rows/message={args.rows_per_message} max_rows={args.block_rows:,} "
          f"string_bytes={args.string_bytes}; load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start")
    if args.profile:
        result = run_child(REPO, args, ["py-spy", "record", "-r", "200", "-f", "raw", "-o",
                                        str(args.profile), "--"])
        print(json.dumps(result))
        print("\n".join(top_functions(args.profile, 30)))
        return 0
    codes = [("new", REPO)] if args.baseline is None else [
        ("base", args.baseline.resolve()), ("new", REPO)]
    order: list[tuple[str, Path]] = []
    for i in range(args.repeat):
        order.extend(codes if i % 2 == 0 else codes[::-1])
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in codes}
    for name, code in order:
        result = run_child(code, args)
        results[name].append(result)
        kernel = result.get("kernel_s")  # a baseline's older child may not say
        share = "" if kernel is None else f" ({100 * kernel / result['cpu_s']:.0f}% in the kernel)"
        faults = result.get("faults")
        share += "" if faults is None else f" {faults:,} page faults"
        print(f"{name:<5} {result['cpu_s_per_mrows']:6.2f} CPU-s/Mrows{share}  "
              f"wall {result['wall_s']:6.2f} s  rows {result['rows']:,} "
              f"stored {result['stored']:,} blocks {result['blocks']}  ({result['code']})",
              flush=True)
    medians = {name: statistics.median(r["cpu_s_per_mrows"] for r in rs)
               for name, rs in results.items()}
    for name, value in medians.items():
        print(f"median {name:<5} {value:6.2f} CPU-s/Mrows")
    if args.stages:
        print("\n".join(stage_lines(results["new"])))
    if "base" in medians:
        print(f"base/new: {medians['base'] / medians['new']:.2f}x less CPU per row")
    load = os.getloadavg()
    print(f"# load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at end")
    ok = all(r["stored"] >= r["rows"] for rs in results.values() for r in rs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
