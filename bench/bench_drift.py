"""The servers' drift across identical runs: ``python -m bench.bench_drift``.

Runs a sequence of contenders of one ``bench_curves`` point back to back on the stack
the environment points at and prints, per run, its rows/s and the CPU seconds each
server process (both ClickHouse replicas, the broker) spent in it, and the first
replica's open ZooKeeper watches after it. ``--sequence same,same,restart,job``:
``same`` is the same-blocks limit, ``job`` the job (its run includes creating its
tables), ``restart`` restarts both replicas (``Servers.restart_replicas``). What it
showed (docs/BENCHMARKS.md, *The servers' drift*): identical runs cost the servers more
one after another, and the job costs the replica it inserts into ~2.7x what the limit
does.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from bench.bench_curves import Point, Runner
from bench.workload import proc_cpu_seconds

STEPS = ("same", "job", "restart")


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
    args = ap.parse_args(argv)
    steps = [s for s in args.sequence.split(",") if s]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        ap.error(f"unknown steps {unknown}: choose from {', '.join(STEPS)}")
    args.large_block_rows, args.repeat, args.variants = 100_000, 1, []
    runner = Runner(args, Point("tables", str(args.tables), tables=args.tables))
    bench = runner.bench
    try:
        if "job" in steps:
            runner.prepare()
        else:
            bench.fresh_tables()
        for n, step in enumerate(steps):
            if step == "restart":
                print(f"restart {bench.servers.restart_replicas():.1f} s", flush=True)
                continue
            before = {k: proc_cpu_seconds(p) for k, p in bench.servers.pids.items() if p}
            out: dict[str, Any] = runner.job() if step == "job" else runner.same(100 + n)
            spent = {k: proc_cpu_seconds(p) - before[k]
                     for k, p in bench.servers.pids.items() if p and k in before}
            watches = bench.clients[0].execute(
                "SELECT value FROM system.metrics WHERE metric = 'ZooKeeperWatch'")[0][0]
            print(f"{step:<4} #{n}: {out['rows_per_s']:>9,.0f} rows/s  " + "  ".join(
                f"{k} {v:5.1f} CPU-s" for k, v in spent.items()) + f"  watches {watches}",
                flush=True)
    finally:
        runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
