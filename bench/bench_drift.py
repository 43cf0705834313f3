"""The servers' drift across identical runs: ``python -m bench.bench_drift``.

Runs a sequence of contenders of one ``bench_curves`` point back to back on the stack
the environment points at and prints, per run, its rows/s and the CPU seconds each
server process (both ClickHouse replicas, the broker) spent in it, and the first
replica's open ZooKeeper watches after it. ``--sequence same,same,restart,job``:
``same`` is the same-blocks limit, ``job`` the job (its run includes creating its
tables), ``restart`` restarts both replicas (``Servers.restart_replicas``), ``drop``
drops the kernel's page cache (``bench.workload.drop_page_cache``). What it
showed (docs/BENCHMARKS.md, *The servers' drift*): identical runs cost the servers more
one after another, and the job costs the replica it inserts into ~2.7x what the limit
does.

``--events FILE`` also writes, per run, what each replica's ``system.events`` moved by
(queries by kind, ZooKeeper operations, merges, fetches, CPU microseconds: what the
server did, whoever asked) to ``FILE`` as JSON, and prints the events whose totals differ
most between the job's runs and the limit's: where the job's extra server CPU goes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.bench_curves import Point, Runner
from bench.workload import drop_page_cache, events_delta, proc_cpu_seconds, server_events

STEPS = ("same", "job", "restart", "drop")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequence", default="same,same,same,restart,same,same")
    ap.add_argument("--tables", type=int, default=100)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--quorum", type=int, default=2)
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--block-rows", type=int, default=100_000)
    ap.add_argument("--same-blocks-lanes", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--events", type=Path, default=None,
                    help="write each run's system.events deltas per replica here (JSON)")
    args = ap.parse_args(argv)
    steps = [s for s in args.sequence.split(",") if s]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        ap.error(f"unknown steps {unknown}: choose from {', '.join(STEPS)}")
    args.large_block_rows, args.repeat, args.variants = 100_000, 1, []
    runner = Runner(args, Point("tables", str(args.tables), tables=args.tables))
    bench = runner.bench
    runs: list[dict[str, Any]] = []
    try:
        if "job" in steps:
            runner.prepare()
        else:
            bench.fresh_tables()
        for n, step in enumerate(steps):
            if step == "restart":
                print(f"restart {bench.servers.restart_replicas():.1f} s", flush=True)
                continue
            if step == "drop":
                print("drop: page cache " + ("dropped" if drop_page_cache() else
                                             "NOT dropped (not root?)"), flush=True)
                continue
            before = {k: proc_cpu_seconds(p) for k, p in bench.servers.pids.items() if p}
            events = [server_events(c) for c in bench.clients]
            out: dict[str, Any] = runner.job() if step == "job" else runner.same(100 + n)
            spent = {k: proc_cpu_seconds(p) - before[k]
                     for k, p in bench.servers.pids.items() if p and k in before}
            runs.append({"step": step, "rows_per_s": out["rows_per_s"], "cpu_s": spent,
                         "events": [events_delta(e, server_events(c))
                                    for e, c in zip(events, bench.clients, strict=True)]})
            watches = bench.clients[0].execute(
                "SELECT value FROM system.metrics WHERE metric = 'ZooKeeperWatch'")[0][0]
            print(f"{step:<4} #{n}: {out['rows_per_s']:>9,.0f} rows/s  " + "  ".join(
                f"{k} {v:5.1f} CPU-s" for k, v in spent.items()) + f"  watches {watches}",
                flush=True)
    finally:
        runner.close()
        if args.events is not None:
            args.events.write_text(json.dumps(runs, indent=1))
    if args.events is not None:
        for replica, lines in enumerate(compare_events(runs)):
            print(f"replica {replica + 1}: events, median per run (job / same)")
            for line in lines:
                print(f"  {line}")
    return 0


def compare_events(runs: list[dict[str, Any]], top: int = 25) -> list[list[str]]:
    """Per replica, the ``top`` events whose median per run differs most between the
    job's runs and the limit's (by absolute difference), as printable lines. Pure."""
    out: list[list[str]] = []
    replicas = max((len(r["events"]) for r in runs), default=0)
    for i in range(replicas):
        medians: dict[str, dict[str, float]] = {}
        for step in ("job", "same"):
            deltas = [r["events"][i] for r in runs if r["step"] == step]
            names = {k for d in deltas for k in d}
            medians[step] = {k: statistics.median(d.get(k, 0) for d in deltas)
                             for k in names} if deltas else {}
        names = set(medians["job"]) | set(medians["same"])
        ranked = sorted(names, key=lambda k: -abs(medians["job"].get(k, 0)
                                                  - medians["same"].get(k, 0)))
        out.append([f"{k:<44} {medians['job'].get(k, 0):>16,.0f} "
                    f"{medians['same'].get(k, 0):>16,.0f}" for k in ranked[:top]])
    return out


if __name__ == "__main__":
    sys.exit(main())
