"""``blocks.min_rows`` at a streaming rate into many tables: ``python -m bench.bench_min_rows``.

The workload and the streaming run are ``bench.bench_e2e``'s latency run (``--tables``
tables over ``--partitions`` partitions, ``--rate`` rows/s in messages of
``--rows-per-message`` rows, a probe row every 100 ms whose produce -> visible time is
measured by a poller), run twice into fresh tables: without ``blocks.min_rows`` and
with ``--min-rows`` and ``--max-latency``. Figures of each run over its measured
window (after ``--warmup`` seconds of streaming, which include the calibration batches
and the query's restart with the sizing): batches, blocks per batch, rows per block
(median of the batches' rows/blocks, and overall), rows/s inserted, probe p50/p99/max
latency, and at the end of the window the active parts per table (``system.parts``,
median and max over the tables) and any ``Too many parts`` refusal in the job's log.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.bench_e2e import Bench, streaming_only
from bench.bench_limits import append_section


class MinRowsBench(Bench):
    min_rows = 0

    def config(self, block_rows: int, tag: str, mode: str = "exactly_once") -> tuple[Path, str]:
        path, group = super().config(block_rows, tag, mode)
        if self.min_rows:
            text = path.read_text().replace(
                "[blocks]\n", f'[blocks]\nmin_rows = {self.min_rows}\n'
                f'max_latency = "{self.args.max_latency}"\n', 1)
            path.write_text(text)
        return path, group

    def parts(self) -> list[int]:
        rows = self.clients[0].execute(
            "SELECT table, count() FROM system.parts WHERE database = %(db)s AND active "
            "AND table LIKE 't%%' GROUP BY table", {"db": self.database})
        counts = {name: 0 for name in self.table_names() if name != "probe"}
        counts.update({str(t): int(n) for t, n in rows})
        return list(counts.values())


def batches(log: Path, offset: int) -> list[dict[str, float]]:
    """The streaming batch lines of the job's log from byte ``offset`` on."""
    with log.open("rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    out = []
    for m in re.finditer(r'blockagg\.job: batch kind="?stream"? batch=\d+ ([^\n]*)', text):
        fields = dict(re.findall(r"(\w+)=([0-9.]+)(?:\s|$)", m.group(1)))
        out.append({k: float(v) for k, v in fields.items()})
    return out


def summarize(log: Path, offset: int, lat: dict[str, Any], parts: list[int],
              min_rows: int) -> dict[str, Any]:
    """The figures of one streaming run from its job log (batch lines from byte
    ``offset``, the measured window), its latency dict and its parts per table."""
    text = log.read_text(errors="replace")
    lines = [b for b in batches(log, offset) if b.get("blocks")]
    rows = sum(b["rows"] for b in lines)
    blocks = sum(b["blocks"] for b in lines)
    span = sum(b["seconds"] for b in lines)
    return {
        "min_rows": min_rows,
        "batches": len(lines),
        "blocks_per_batch": round(blocks / max(1, len(lines)), 1),
        "rows_per_block_median": round(statistics.median(
            b["rows"] / b["blocks"] for b in lines), 1) if lines else 0,
        "rows_per_block": round(rows / max(1, blocks), 1),
        "rows_per_s_produced": round(float(lat.get("rate_rows_s", 0))),
        "rows_per_batch_second": round(rows / span) if span else 0,
        "batch_seconds_median": round(statistics.median(b["seconds"] for b in lines), 1)
        if lines else 0,
        "active_parts_per_table": [statistics.median(parts), max(parts)] if parts else [],
        "p50_s": round(float(lat.get("p50_s", 0)), 2),
        "p99_s": round(float(lat.get("p99_s", 0)), 2),
        "max_s": round(float(lat.get("max_s", 0)), 2), "probes": lat.get("probes"),
        "seen": lat.get("seen"), "run_seconds": lat.get("seconds"),
        "restarts": text.count("sizing: restarting the query"),
        "too_many_parts": len(re.findall(r"Too many parts|Code: 252", text)),
    }


def run(bench: MinRowsBench, min_rows: int) -> dict[str, Any]:
    bench.min_rows = min_rows
    lat = bench.latency(bench.args.max_rows)
    parts = bench.parts()  # right after the stop: merges have had little time since
    return summarize(Path(str(lat["log"])), int(lat["log_offset"]), lat, parts, min_rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", type=int, default=100)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--rows-per-message", type=int, default=10)
    ap.add_argument("--rate", type=float, default=10_000, help="rows/s")
    ap.add_argument("--seconds", type=float, default=120, help="measured window")
    ap.add_argument("--warmup", type=float, default=45)
    ap.add_argument("--trigger", default="1s")
    ap.add_argument("--max-rows", type=int, default=1_000_000)
    ap.add_argument("--min-rows", type=int, default=1_000)
    ap.add_argument("--max-latency", default="30s")
    ap.add_argument("--quorum", type=int, default=0)
    ap.add_argument("--max-offsets", type=int, default=0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--folder")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--append", action="store_true",
                    help="append the figures to docs/BENCHMARKS.md")
    args = ap.parse_args(argv)
    streaming_only(args)
    bench = MinRowsBench(args)
    results = []
    try:
        bench.fresh_tables()
        bench.register()
        for min_rows in (0, args.min_rows):
            r = run(bench, min_rows)
            print(json.dumps(r), file=sys.stderr, flush=True)
            results.append(r)
    finally:
        bench.drop_database()
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": None, "append": None},
                                         "results": results}, indent=2, default=str))
    if args.append:
        append_section("blocks.min_rows: blocks per batch, parts, latency",
                       "python -m bench.bench_min_rows " + " ".join(argv or sys.argv[1:]),
                       "\n".join(json.dumps(r) for r in results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
