"""The job's CPU split into a per-row and a per-block part: ``python -m bench.bench_block_cost``.

Runs :mod:`bench.bench_task` (one partition through ``spark.task.run_range``, real
inserts) at several block sizes for the same rows: ``--tables`` sets the block count
(the workload spreads the rows over the tables round-robin, and a table's rows of one
batch are one block while they fit ``[blocks] max_rows``), so 500,000 rows over 40,
133 and 400 tables are blocks of 12,500, 3,759 and 1,250 rows. For each checkout the
median of ``--repeat`` runs per size is fitted by least squares to
``cpu = a x rows + b x blocks``: ``a`` is the job's CPU per row (µs), ``b`` its CPU
per block (ms), what a smaller block costs beyond its rows. With ``--baseline DIR``
each size runs ABBA (base, new, new, base, ...) and both fits are reported with
their ratios. The CPU is the task process's (``time.process_time``: the main thread
and the insert lanes), not the servers'.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.bench_task import REPO, run_child


def fit(points: Sequence[tuple[int, int, float]]) -> tuple[float, float]:
    """Least squares ``cpu_s = a x rows + b x blocks`` over (rows, blocks, cpu_s):
    returns (a in µs per row, b in ms per block)."""
    x = np.array([[r, b] for r, b, _ in points], dtype=np.float64)
    y = np.array([c for _, _, c in points], dtype=np.float64)
    (a, b), *_ = np.linalg.lstsq(x, y, rcond=None)
    return float(a) * 1e6, float(b) * 1e3


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=500_000)
    ap.add_argument("--tables", default="40,133,400",
                    help="comma-separated table counts, one block size each")
    ap.add_argument("--rows-per-message", type=int, default=10)
    ap.add_argument("--block-rows", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--string-bytes", type=int, default=0,
                    help="bytes of a 'name' value (bench_task's --string-bytes)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--baseline", type=Path, help="a checkout to compare with (ABBA)")
    args = ap.parse_args(argv)
    load = os.getloadavg()
    print(f"# rows={args.rows:,} tables={args.tables} max_rows={args.block_rows:,}; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start", flush=True)
    codes = [("new", REPO)] if args.baseline is None else [
        ("base", args.baseline.resolve()), ("new", REPO)]
    medians: dict[str, list[tuple[int, int, float]]] = {name: [] for name, _ in codes}
    ok = True
    for tables in (int(t) for t in args.tables.split(",")):
        order: list[tuple[str, Path]] = []
        for i in range(args.repeat):
            order.extend(codes if i % 2 == 0 else codes[::-1])
        results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in codes}
        for name, code in order:
            child_args = argparse.Namespace(**{**vars(args), "tables": tables})
            result = run_child(code, child_args)
            results[name].append(result)
            ok = ok and result["stored"] >= result["rows"]
            print(f"tables {tables:4d} {name:<5} cpu {result['cpu_s']:6.3f} s  "
                  f"{result['cpu_s'] / result['blocks'] * 1e3:6.2f} ms/block  "
                  f"wall {result['wall_s']:6.2f} s  rows {result['rows']:,} "
                  f"blocks {result['blocks']}", flush=True)
        for name, rs in results.items():
            cpu = statistics.median(r["cpu_s"] for r in rs)
            medians[name].append((rs[0]["rows"], rs[0]["blocks"], cpu))
            print(f"median tables {tables:4d} {name:<5} cpu {cpu:6.3f} s  "
                  f"{cpu / rs[0]['blocks'] * 1e3:6.2f} ms/block", flush=True)
        if "base" in results:
            base = medians["base"][-1][2]
            new = medians["new"][-1][2]
            print(f"ratio tables {tables:4d} base/new {base / new:.2f}x", flush=True)
    fits = {name: fit(points) for name, points in medians.items()}
    for name, (a, b) in fits.items():
        print(f"fit {name:<5} cpu = {a:.3f} µs/row x rows + {b:.3f} ms/block x blocks")
    if "base" in fits:
        print(f"fit base/new: per row {fits['base'][0] / fits['new'][0]:.2f}x, "
              f"per block {fits['base'][1] / fits['new'][1]:.2f}x")
    load = os.getloadavg()
    print(f"# load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at end")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
