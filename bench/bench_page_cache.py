"""The kernel's cost of small files, round after round: ``python -m bench.bench_page_cache``.

A round creates ``--parts`` directories of ``--files`` files of ``--file-bytes`` each
(about what a ClickHouse part of the job's tables is on disk), then deletes them all,
and reports the round's user and system CPU seconds. ``--plan run,run,drop,run``:
``drop`` drops the kernel's page cache between rounds (``bench.workload.drop_page_cache``,
root only). No stack is needed: it shows, without ClickHouse, the growth of system
time that makes identical benchmark runs on these machines slower one after another
(docs/BENCHMARKS.md, *What the servers' drift is*).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

from bench.workload import drop_page_cache


def one_round(folder: Path, parts: int, files: int, payload: bytes) -> tuple[float, float]:
    """Create and delete the round's files; its (user, system) CPU seconds."""
    before = os.times()
    for p in range(parts):
        part = folder / f"part_{p}"
        part.mkdir(parents=True, exist_ok=True)
        for f in range(files):
            (part / f"c{f}.bin").write_bytes(payload)
    shutil.rmtree(folder)
    after = os.times()
    return after.user - before.user, after.system - before.system


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", default="run,run,run,run,drop,run,run,run")
    ap.add_argument("--parts", type=int, default=300)
    ap.add_argument("--files", type=int, default=30)
    ap.add_argument("--file-bytes", type=int, default=8192)
    ap.add_argument("--dir", type=Path, default=None,
                    help="where the files go (default: a temporary folder on the disk of "
                    "the current directory, as the stack's data)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    steps = [s for s in args.plan.split(",") if s]
    if any(s not in ("run", "drop") for s in steps):
        ap.error("--plan takes run and drop")
    payload = random.Random(args.seed).randbytes(args.file_bytes)
    base = Path(tempfile.mkdtemp(prefix="bench-page-cache-", dir=args.dir or Path.cwd()))
    try:
        for n, step in enumerate(steps):
            if step == "drop":
                print("drop: page cache " + ("dropped" if drop_page_cache() else
                                             "NOT dropped (not root?)"), flush=True)
                continue
            user, system = one_round(base / f"round{n}", args.parts, args.files, payload)
            print(f"round {n}: {args.parts * args.files:,} files, user {user:.2f} s, "
                  f"system {system:.2f} s", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
