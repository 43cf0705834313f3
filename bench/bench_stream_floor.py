"""The streaming floor (issue 28 item 2): ``python -m bench.bench_stream_floor``.

Does a micro-batch take more than its own inserts would take alone on the same servers?
In ONE run, alternating in ABBA order over ``--repeat`` rounds:

* **stream**: ``bench.bench_e2e``'s latency run (``--tables`` tables plus the probe table
  over ``--partitions`` partitions, ``--rate`` rows/s in messages of
  ``--rows-per-message`` rows, ``--trigger``, ``insert_quorum = --quorum``, 2 cores; one
  block per table and partition: ``blocks.max_rows`` is ``--block-rows``). Measured for
  ``--seconds`` after ``--warmup``: the probe's p50/p99/max produce -> visible, the job's
  and the servers' CPU over the window, and the window's ``blockagg.job: batch`` lines
  (the first of the window excluded: it may have begun before it).
  ``--mode exactly_once_s8`` streams with 8 Spark task slots on the same 2 cores (every
  partition's task at once instead of waves of two: the overlap across tasks).
* **alone**: the blocks of the latest stream window's micro-batches, batch by batch (each
  batch's line gives its ``blocks`` and ``rows``: that many blocks of rows/blocks rows,
  to within one row), into fresh tables of the job's shape (``--tables`` + 1, the probe's
  too, blocks spread over them and the partitions as the job's are), ``--lanes`` inserts
  at a time (the job's: 2 task slots x ``clickhouse.insert_concurrency`` 4), the same
  quorum, with nothing of blockagg around them (``bench.bench_limits.LaneInserter``).
  Each batch's blocks are timed from the first send to the last answer.

A round whose alone part runs first inserts the blocks of the previous round's stream
window (the rate is fixed, so a batch's blocks do not change between windows; the table
shows both windows' blocks per batch and rows per block).

Per round: micro-batch seconds (median, p90, max), its inserts alone (median seconds
for one batch's blocks), batch / alone, job CPU and servers' CPU per batch (stream),
client and servers' CPU per batch (alone), probe p99, blocks per batch, rows per block;
then the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from bench.bench_curves import abba, median

ROUND: Final = ("stream", "alone")
"""The two parts of a round; :func:`bench.bench_curves.abba` orders them."""
BATCH_LINE: Final = re.compile(r'blockagg\.job: batch kind="?stream"? batch=(\d+) ([^\n]*)')


@dataclass(frozen=True)
class Batch:
    """One streaming micro-batch as the job's batch line gives it."""

    batch_id: int
    seconds: float
    rows: int
    blocks: int

    @property
    def rows_per_block(self) -> float:
        return self.rows / self.blocks if self.blocks else 0.0


def window_batches(log_text: str) -> list[Batch]:
    """The micro-batches of a streaming window's log text that inserted a block, the
    first one excluded (it may have started before the window did)."""
    out = []
    for m in BATCH_LINE.finditer(log_text):
        fields = dict(re.findall(r"(\w+)=([0-9.]+)(?:\s|$)", m.group(2)))
        if int(fields.get("blocks", 0)):
            out.append(Batch(int(m.group(1)), float(fields["seconds"]), int(fields["rows"]),
                             int(fields["blocks"])))
    return out[1:]


def even_sizes(rows: int, blocks: int) -> list[int]:
    """``rows`` rows in ``blocks`` blocks as evenly as possible (the first ``rows %
    blocks`` one row larger): the job's blocks of one micro-batch at a steady rate are
    one per table and partition, each 1/blocks of the batch, to within a message."""
    if blocks <= 0 or rows < blocks:
        raise ValueError(f"{rows} rows do not fill {blocks} blocks: a batch line with "
                         "blocks needs at least a row per block; check the log's batch lines")
    base, extra = divmod(rows, blocks)
    return [base + 1 if i < extra else base for i in range(blocks)]


def layout(sizes: Sequence[int], tables: int, partitions: int, first_row: int = 0
           ) -> list[tuple[int, int, int, int]]:
    """``(table, partition, first row, rows)`` of each block: block i goes to table
    ``i % tables`` and partition ``(i // tables) % partitions`` (so each table receives
    its share of the batch's blocks, one per partition, as the job's blocks are), and
    the blocks hold consecutive, distinct rows from ``first_row`` on."""
    out, row = [], first_row
    for i, n in enumerate(sizes):
        out.append((i % tables, (i // tables) % partitions, row, n))
        row += n
    return out


def percentile(xs: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1); 0.0 of nothing."""
    values = sorted(xs)
    if not values:
        return 0.0
    return values[min(len(values), max(1, math.ceil(q * len(values)))) - 1]


def ratio(batch_seconds: Sequence[float], alone_seconds: Sequence[float]) -> float:
    """Median micro-batch seconds over the median seconds of one batch's inserts alone
    (0.0 when either is missing): the issue's ``<= 1.3``."""
    a, b = median(batch_seconds), median(alone_seconds)
    return a / b if a and b else 0.0


@dataclass
class Round:
    """One round's figures (both parts)."""

    round: int
    order: str
    batches: int = 0
    batch_s_median: float = 0.0
    batch_s_p90: float = 0.0
    batch_s_max: float = 0.0
    blocks_per_batch: float = 0.0
    rows_per_block: float = 0.0
    job_cpu_s_per_batch: float = 0.0
    server_cpu_s_per_batch: float = 0.0
    p50_s: float = 0.0
    p99_s: float = 0.0
    max_s: float = 0.0
    probes_seen: str = ""
    alone_batches: int = 0
    alone_s_median: float = 0.0
    alone_s_max: float = 0.0
    alone_blocks_per_batch: float = 0.0
    alone_rows_per_block: float = 0.0
    alone_client_cpu_s_per_batch: float = 0.0
    alone_server_cpu_s_per_batch: float = 0.0
    alone_quorum_waits: int = 0
    ratio: float = 0.0


def table(rounds: Sequence[Round]) -> str:
    """The rounds as a Markdown table, then the median ratio."""
    head = ("| round | order | batches | batch s median / p90 / max | alone s (median) | "
            "batch / alone | job CPU-s / batch | servers CPU-s / batch (stream, alone) | "
            "probe p50 / p99 / max s | blocks / batch (stream, alone) | rows / block |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rounds:
        lines.append(
            f"| {r.round} | {r.order} | {r.batches} | {r.batch_s_median:.2f} / "
            f"{r.batch_s_p90:.2f} / {r.batch_s_max:.2f} | {r.alone_s_median:.2f} | "
            f"{r.ratio:.2f} | {r.job_cpu_s_per_batch:.2f} | {r.server_cpu_s_per_batch:.2f}, "
            f"{r.alone_server_cpu_s_per_batch:.2f} | {r.p50_s:.1f} / {r.p99_s:.1f} / "
            f"{r.max_s:.1f} | {r.blocks_per_batch:.0f}, {r.alone_blocks_per_batch:.0f} | "
            f"{r.rows_per_block:.1f} |")
    ratios = [r.ratio for r in rounds if r.ratio]
    lines.append("")
    lines.append(f"batch / its inserts alone, median of {len(ratios)} rounds: "
                 f"{median(ratios):.2f} (target <= 1.3); probe p99, median: "
                 f"{median(r.p99_s for r in rounds if r.p99_s):.1f} s")
    return "\n".join(lines)


def stream_figures(r: Round, lat: dict[str, Any], batches: Sequence[Batch]) -> None:
    """Fill ``r``'s stream part from a latency run and its window's batches."""
    seconds = [b.seconds for b in batches]
    n = len(batches)
    r.batches = n
    r.batch_s_median, r.batch_s_p90 = median(seconds), percentile(seconds, 0.9)
    r.batch_s_max = max(seconds, default=0.0)
    r.blocks_per_batch = median(b.blocks for b in batches)
    r.rows_per_block = (sum(b.rows for b in batches) / sum(b.blocks for b in batches)
                        if batches else 0.0)
    # the window's CPU over the batches whose lines it holds (+1: the excluded first)
    r.job_cpu_s_per_batch = float(lat.get("job_cpu_s", 0.0)) / (n + 1)
    r.server_cpu_s_per_batch = float(lat.get("server_cpu_s", 0.0)) / (n + 1)
    r.p50_s, r.p99_s = float(lat.get("p50_s", 0.0)), float(lat.get("p99_s", 0.0))
    r.max_s = float(lat.get("max_s", 0.0))
    r.probes_seen = f"{lat.get('seen', 0)}/{lat.get('probes', 0)}"


class FloorBench:
    """The two parts against the stack, on one ``bench_e2e.Bench`` (its database)."""

    def __init__(self, args: argparse.Namespace) -> None:
        from bench.bench_e2e import Bench
        from bench.bench_limits import PoolColumns
        from bench.workload import Rows

        self.args = args
        # the Enum8 and Array columns take clickhouse-driver's generic path under numpy
        # inserts, as in the job: one warning per insert otherwise
        logging.getLogger("clickhouse_driver.columns.service").setLevel(logging.ERROR)
        self.bench = Bench(args)
        self.bench.fresh_tables()
        self.bench.register()
        # rows of one per message, so a block of n rows is n pool rows
        self.pool = PoolColumns(Rows(10**9, args.tables + 1, 1, args.partitions, args.seed))
        self.alone_runs = 0

    def stream(self) -> tuple[dict[str, Any], list[Batch]]:
        lat = self.bench.latency(self.args.block_rows, self.args.mode)
        text = ""
        if "log" in lat:
            with Path(str(lat["log"])).open("rb") as f:
                f.seek(int(lat["log_offset"]))
                text = f.read(max(0, int(lat["log_end"]) - int(lat["log_offset"]))).decode(
                    errors="replace")
        return lat, window_batches(text)

    def alone(self, batches: Sequence[Batch]) -> tuple[list[float], list[Any], int]:
        """Each batch's blocks into fresh tables, batch after batch: seconds per batch,
        the :class:`~bench.bench_limits.Inserted` of each, and the blocks per batch."""
        import numpy as np

        from bench.bench_limits import JobBlock, LaneInserter, create_job_tables

        b, a = self.bench, self.args
        self.alone_runs += 1
        names = [f"a{self.alone_runs}_t{t:03d}" for t in range(a.tables + 1)]
        create_job_tables(b.host, b.ports, b.database, names)
        chosen = list(batches)[:a.alone_batches] if a.alone_batches else list(batches)
        done, row, blocks = [], 0, 0
        with LaneInserter(self.pool, b.host, b.ports, b.database, names, a.lanes, a.quorum,
                          b.servers) as lanes:
            for batch in chosen:
                placed = layout(even_sizes(batch.rows, batch.blocks), a.tables + 1,
                                a.partitions, row)
                row += batch.rows
                blocks += len(placed)
                done.append(lanes.insert([
                    JobBlock(t, p, np.arange(first, first + n, dtype=np.int64))
                    for t, p, first, n in placed]))
        for c in b.clients:
            for name in names:
                c.execute(f"DROP TABLE IF EXISTS {b.database}.{name}")
        return [d.seconds for d in done], done, blocks

    def run(self) -> list[Round]:
        a = self.args
        rounds: dict[int, Round] = {}
        last: list[Batch] = []
        for repeat, part in abba(ROUND, a.repeat):
            r = rounds.setdefault(repeat, Round(repeat, "stream first" if repeat % 2 == 0
                                                else "alone first"))
            if part == "stream":
                lat, last = self.stream()
                stream_figures(r, lat, last)
                r.ratio = ratio([r.batch_s_median], [r.alone_s_median] if r.alone_s_median
                                else [])
                print(f"round {repeat} stream: {json.dumps(asdict(r))}", file=sys.stderr,
                      flush=True)
            else:
                if not last:
                    print(f"round {repeat}: no stream window's batches to insert alone",
                          file=sys.stderr, flush=True)
                    continue
                seconds, done, blocks = self.alone(last)
                n = max(1, len(done))
                r.alone_batches = len(done)
                r.alone_s_median, r.alone_s_max = median(seconds), max(seconds, default=0.0)
                r.alone_blocks_per_batch = blocks / n
                chosen = last[:len(done)]
                r.alone_rows_per_block = (sum(x.rows for x in chosen)
                                          / max(1, sum(x.blocks for x in chosen)))
                r.alone_client_cpu_s_per_batch = sum(d.client_cpu_s for d in done) / n
                r.alone_server_cpu_s_per_batch = sum(d.server_cpu_s for d in done) / n
                r.alone_quorum_waits = sum(d.quorum_waits for d in done)
                r.ratio = ratio([r.batch_s_median] if r.batch_s_median else [],
                                [r.alone_s_median])
                print(f"round {repeat} alone: {len(done)} batches, median "
                      f"{r.alone_s_median:.2f} s", file=sys.stderr, flush=True)
        return [rounds[k] for k in sorted(rounds)]

    def close(self) -> None:
        self.bench.drop_database()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rate", type=float, default=10_000, help="rows/s")
    ap.add_argument("--tables", type=int, default=100)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--rows-per-message", type=int, default=10)
    ap.add_argument("--trigger", default="10s")
    ap.add_argument("--quorum", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=120, help="measured stream window")
    ap.add_argument("--warmup", type=float, default=30)
    ap.add_argument("--repeat", type=int, default=3, help="rounds (stream + alone), ABBA")
    ap.add_argument("--lanes", type=int, default=8,
                    help="inserts at a time alone: the job's 2 task slots x "
                    "clickhouse.insert_concurrency 4")
    ap.add_argument("--block-rows", type=int, default=1_000_000,
                    help="the job's blocks.max_rows (large: one block per table and partition)")
    ap.add_argument("--mode", default="exactly_once",
                    help="bench_e2e's streaming mode: exactly_once_s8 runs the job with 8 "
                    "task slots on its 2 cores (a task decodes while another waits on its "
                    "inserts; give --lanes 32 for its inserts alone)")
    ap.add_argument("--alone-batches", type=int, default=0,
                    help="insert only the first N batches of a window alone (0: all)")
    ap.add_argument("--max-offsets", type=int, default=0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--folder")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--append", action="store_true",
                    help="append the table to docs/BENCHMARKS.md")
    args = ap.parse_args(argv)
    from bench.bench_e2e import streaming_only

    streaming_only(args)
    bench = FloorBench(args)
    try:
        rounds = bench.run()
    finally:
        bench.close()
    text = table(rounds)
    print(text, flush=True)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "rounds": [asdict(r) for r in rounds]}, indent=1))
    if args.append:
        from bench.bench_limits import append_section

        command = "python -m bench.bench_stream_floor " + " ".join(
            a for a in (argv if argv is not None else sys.argv[1:]) if a != "--append")
        append_section("The streaming floor: a micro-batch against its own inserts alone",
                       command, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
