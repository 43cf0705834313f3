"""The curves of issue 28 item 4: ``python -m bench.bench_curves``.

Four curves, each point a workload of ``--rows`` rows (``bench.workload.Rows``):

* ``tables``: 10, 100, 500, 1,000 tables per topic (8 partitions);
* ``partitions``: 2, 8, 32 partitions (100 tables);
* ``rows_per_message``: 1, 10, 100 rows per message (100 tables, 8 partitions);
* ``row_width``: narrow rows vs rows whose ``name`` is a 1 KiB string (100 tables,
  8 partitions).

Each point is **one run** against the stack the environment points at: the topic is
produced once, then three contenders are measured ``--repeat`` times, interleaved ABBA
(``job, same, large`` then ``large, same, job``, so no contender always runs first on
a machine whose load drifts), each on fresh tables:

* ``job``: the job, exactly-once, as shipped (``bench_e2e``'s run: ``--until-caught-up``,
  the whole topic one micro-batch, ``--cores`` cores, ``blocks.max_rows`` ``--block-rows``);
* ``same``: **the same-blocks limit**, the very blocks the job forms inserted raw,
  ``--same-blocks-lanes`` at a time, with the job's quorum (``bench_limits``);
* ``large``: **the raw insert of large blocks**, the same rows in blocks of
  ``--large-block-rows`` (``bench_limits``'s raw insert);
* with ``--warm-rows N``, the job (and its variants) measured **warm**: each run first
  works off N rows of its own, then gets the point's rows in one Kafka transaction, which
  it reads whole as one catch-up batch (``bench_e2e.Bench.warm_run``): a streaming job's
  JVM has compiled its code and its Python workers are up, which a fresh job's first
  batch pays for (C1/C2 compiler threads, worker start-up: docs/BENCHMARKS.md);
  ``--settle-warm-up`` (or the variant ``settled``) first waits until the servers are
  done merging the warm-up's parts (``Bench.settle_merges``);
* with ``--variants c8,s4``, also ``job_c8``, ``job_s4``: the job with
  ``clickhouse.insert_concurrency = 8`` or 4 Spark task slots on the same cores
  (``bench_e2e``'s ``exactly_once_cN`` and ``exactly_once_sN`` modes; ``s4c2`` both),
  in the same ABBA,
  so a change of setting is compared within one point's drift (docs/BENCHMARKS.md,
  *The servers' drift*);
* with ``--variants baseline --baseline-root DIR``, also ``job_baseline``: the job of
  another checkout (``git archive REV | tar -x -C DIR``) with the same configuration, so
  a change of code is compared the same way.

Per point (medians of the repeats): rows/s of each, the job's ratio to both limits
(the job's rows/s over ``bench_e2e``'s processing interval, its first visible row to
its last, and also over its batches' own seconds, which include the first wave's
Kafka read and decoding: at 2 partitions, one wave, the first interval leaves out most
of the job's work and flatters it),
the job's CPU seconds per million rows over its processing interval and the cores it
used there, inserts per batch and rows per block (the job's ``batch`` log lines), the
metadata of each partition's commit (characters, as the broker counts them against
``offset.metadata.max.bytes``, and UTF-8 bytes; from the group's committed offsets),
active parts per table right after the run (``system.parts`` on the first replica,
before background merges catch up), and the split of the job's task slots (Spark's event
log, ``bench.spark_tasks``; the batch lines' ``task_seconds`` against ``spark_seconds``).
The verdict: a point whose job runs below 0.8x its same-blocks limit names the figure of
its wall (:func:`verdict`): the job's CPU, the machine's CPU that the job and the servers
share, or where the task slots' time went.

``--json`` keeps every run and the medians; ``--plot`` draws ``docs/bench_curves.png``
(four panels: rows/s of the three contenders, and the job's ratio to its same-blocks
limit with the 0.8x line), from that JSON alone with ``--plot-only JSON``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from bench.workload import REPO_ROOT, PoolEntry, Rows, create_tables, drop_page_cache

CURVES: Final[dict[str, tuple[str, ...]]] = {
    "tables": ("10", "100", "500", "1000"),
    "partitions": ("2", "8", "32"),
    "rows_per_message": ("1", "10", "100"),
    "row_width": ("narrow", "1KiB"),
}
"""Each curve's points, as ``--points`` names them."""
CONTENDERS: Final = ("job", "same", "large")
VARIANT: Final = re.compile(r"(?:s[1-9][0-9]*(?:c[1-9][0-9]*)?|c[1-9][0-9]*)(?:e[1-9][0-9]*)?"
                            r"|baseline|settled")
"""A ``--variants`` name: ``cN`` (N insert lanes a task), ``sN`` (N Spark task slots),
both (``s4c2``), any of these with ``eK`` (``executor_insert_concurrency`` K:
``s4c8e8``), ``baseline`` (the job of ``--baseline-root``), or ``settled`` (the job
measured once its warm-up's merges are done, as ``--settle-warm-up``)."""


def contenders(variants: Sequence[str] = (), same_warm: bool = False) -> tuple[str, ...]:
    """The point's contenders in ABBA order: the job, its variants (``job_c8``), then the
    limits: the same blocks, with ``same_warm`` the same blocks into tables first filled
    as the warm job's are (``same_warm``), and large blocks. Refuses a variant
    ``bench_e2e`` has no mode for."""
    bad = [v for v in variants if not VARIANT.fullmatch(v)]
    if bad:
        raise CurveError(f"unknown variants {bad}: cN (insert lanes), sN (task slots), "
                         "baseline or settled")
    return ("job", *(f"job_{v}" for v in variants), "same",
            *(("same_warm",) if same_warm else ()), "large")


PENDING_QUORUM_LINE: Final = "Quorum for previous write has not been satisfied yet"
"""How the log of a job from before session 22 shows an insert refused because the
table's previous quorum insert is still pending (18.16, code 286), once per refusal;
later jobs wait those out quietly and count them on the batch line (``quorum_waits``,
:func:`quorum_waits`)."""

FLOOR: Final = 0.8
"""A point whose job runs below this fraction of its same-blocks limit must name its wall."""
WIDTHS: Final = {"narrow": 0, "1KiB": 1024}


@dataclass(frozen=True)
class Point:
    """One workload of a curve: the others' defaults (100 tables, 8 partitions, 10 rows a
    message, narrow rows) but for the one the curve varies."""

    curve: str
    label: str
    tables: int = 100
    partitions: int = 8
    rows_per_message: int = 10
    string_bytes: int = 0

    @property
    def x(self) -> int:
        """The point's abscissa on its curve's panel."""
        return {"tables": self.tables, "partitions": self.partitions,
                "rows_per_message": self.rows_per_message,
                "row_width": self.string_bytes}[self.curve]


class CurveError(ValueError):
    """A curve or point the script does not know (the command line's fault)."""


def points(curves: Sequence[str] = tuple(CURVES), selected: Sequence[str] = ()) -> list[Point]:
    """The points of ``curves`` in their order, only those named in ``selected`` when
    it is not empty: a label (``10``: that point of every curve that has it) or
    ``curve=label`` (``rows_per_message=10``: that curve's alone). A numeric curve also
    takes a point of its own between or beyond its labels (``tables=33``: blocks of
    ~3,750 rows at 1M rows and 8 partitions), placed in order among them. Unknown names
    are refused, naming the known ones."""
    out: list[Point] = []
    extra: set[str] = set()
    for curve in curves:
        if curve not in CURVES:
            raise CurveError(f"unknown curve {curve!r}: choose from {', '.join(CURVES)}")
        labels = list(CURVES[curve])
        if curve != "row_width":
            own = {s for s in selected if s.startswith(f"{curve}=")
                   and s.split("=", 1)[1].isdigit() and int(s.split("=", 1)[1]) > 0
                   and s.split("=", 1)[1] not in labels}
            extra |= own
            labels = sorted([*labels, *(s.split("=", 1)[1] for s in own)], key=int)
        for label in labels:
            if selected and label not in selected and f"{curve}={label}" not in selected:
                continue
            if curve == "row_width":
                out.append(Point(curve, label, string_bytes=WIDTHS[label]))
            else:
                key = {"tables": "tables", "partitions": "partitions",
                       "rows_per_message": "rows_per_message"}[curve]
                out.append(Point(curve, label, **{key: int(label)}))
    known = {name for c in curves if c in CURVES for label in CURVES[c]
             for name in (label, f"{c}={label}")} | extra
    unknown = [s for s in selected if s not in known]
    if unknown:
        raise CurveError(f"unknown points {unknown} for curves {list(curves)}: choose from "
                         f"{sorted(known)} or, on a numeric curve, curve=N")
    return out


def abba(contenders: Sequence[str], repeat: int) -> list[tuple[int, str]]:
    """``(repeat, contender)`` in run order: forward on even repeats, backward on odd,
    so over any two repeats each contender has run first and last once."""
    return [(r, c) for r in range(repeat)
            for c in (contenders if r % 2 == 0 else list(reversed(contenders)))]


def median(xs: Iterable[float]) -> float:
    """The median (mean of the middle two for an even count); 0.0 of nothing."""
    values = list(xs)
    return float(statistics.median(values)) if values else 0.0


def verdict(ratio: float, job_cores_used: float, cores: int,
            floor: float = FLOOR, servers_cores_used: float | None = None,
            machine_cores: int = 0, python_share: float | None = None) -> str:
    """``ok`` at or above ``floor`` x the same-blocks limit; below it, the wall the
    figures show, first that holds: the job's processes busy on (nearly) every core it
    has (its own CPU); the job and the servers together busy on (nearly) every core of
    the machine (the machine's CPU, when they share it); otherwise waiting, with where
    the task slots' time went: the job's Python functions (decoding, inserts, commits)
    or Spark around them (the Kafka read in the JVM, the hand-over, scheduling)."""
    if ratio >= floor:
        return f"ok ({ratio:.2f}x >= {floor}x)"
    below = f"BELOW {floor}x ({ratio:.2f}x)"
    if job_cores_used >= 0.85 * cores:
        return (f"{below}: wall = the job's own CPU "
                f"({job_cores_used:.2f} of {cores} cores busy while processing)")
    if (servers_cores_used is not None and machine_cores
            and job_cores_used + servers_cores_used >= 0.85 * machine_cores):
        return (f"{below}: wall = the machine's CPU (job {job_cores_used:.2f} + servers "
                f"{servers_cores_used:.2f} of {machine_cores} cores while processing)")
    slots = ("" if python_share is None else
             f"; task slots {python_share:.0%} in the job's Python, "
             f"{1 - python_share:.0%} in Spark around it")
    servers = ("" if servers_cores_used is None else
               f", servers {servers_cores_used:.2f}")
    return (f"{below}: wall = waiting, not CPU (job used {job_cores_used:.2f} of {cores} "
            f"cores while processing{servers}{slots})")


BATCH_LINE: Final = re.compile(r"blockagg\.job: batch kind=\S+ batch=(\d+) ([^\n]*)")


def batch_seconds(log_text: str) -> float:
    """The batches' own seconds summed (each ``batch`` line's ``seconds``: the Spark job
    from submission to the last final commit, the Kafka read and decoding included,
    the JVM's start-up not)."""
    return sum(float(dict(re.findall(r"(\w+)=([0-9.]+)(?:\s|$)", m.group(2))).get("seconds", 0))
               for m in BATCH_LINE.finditer(log_text))


def python_share(log_text: str, slots: int) -> float | None:
    """The share of the batches' task-slot seconds (``spark_seconds`` x slots) that the
    job's Python functions took (``task_seconds``); None without a batch line."""
    task = spark = 0.0
    for m in BATCH_LINE.finditer(log_text):
        fields = dict(re.findall(r"(\w+)=([0-9.]+)(?:\s|$)", m.group(2)))
        task += float(fields.get("task_seconds", 0))
        spark += float(fields.get("spark_seconds", 0))
    return task / (spark * slots) if spark else None


def batch_figures(log_text: str) -> tuple[list[int], list[int]]:
    """``(blocks, rows)`` of each batch line that inserted a block: one insert per
    block, so ``blocks`` is the inserts of each batch."""
    blocks, rows = [], []
    for m in BATCH_LINE.finditer(log_text):
        fields = dict(re.findall(r"(\w+)=([0-9.]+)(?:\s|$)", m.group(2)))
        if int(fields.get("blocks", 0)):
            blocks.append(int(fields["blocks"]))
            rows.append(int(fields.get("rows", 0)))
    return blocks, rows


def quorum_waits(log_text: str) -> int:
    """Inserts refused behind another insert's pending quorum and sent again: the batch
    lines' ``quorum_waits`` plus the refusals an older job logged one line each."""
    waits = sum(int(m) for m in re.findall(r"\bquorum_waits=(\d+)", log_text))
    return waits + log_text.count(PENDING_QUORUM_LINE)


def metadata_figures(commits: Sequence[str]) -> dict[str, float]:
    """Metadata per commit: characters (what the broker counts against
    ``offset.metadata.max.bytes``) and UTF-8 bytes, largest and median, and how many
    commits the run made."""
    chars = [len(m) for m in commits]
    return {"commits": len(commits), "metadata_chars_max": max(chars, default=0),
            "metadata_chars_median": median(chars),
            "metadata_bytes_max": max((len(m.encode()) for m in commits), default=0)}


@dataclass
class PointResult:
    """A point's runs (one dict per contender and repeat, in run order) and medians."""

    point: Point
    rows: int
    row_bytes: float
    cores: int
    runs: list[dict[str, Any]] = field(default_factory=list)
    machine_cores: int = 0
    """The CPUs of the machine the job and the servers shared (0: not recorded)."""

    def of(self, contender: str, key: str) -> list[float]:
        return [float(r[key]) for r in self.runs if r["contender"] == contender
                and r.get(key) is not None and r.get("complete", True)]

    def median_of(self, contender: str, key: str) -> float | None:
        """The median of ``key`` over the contender's runs; None where no run has it."""
        values = self.of(contender, key)
        return median(values) if values else None

    def variants(self) -> list[str]:
        """The job's variants among the runs (``job_c8``), first run first."""
        return list(dict.fromkeys(r["contender"] for r in self.runs
                                  if r["contender"].startswith("job_")))

    def summary(self) -> dict[str, Any]:
        job, same, large = (median(self.of(c, "rows_per_s")) for c in CONTENDERS)
        cores_used = median(self.of("job", "cores_used"))
        ratio = job / same if same else 0.0
        in_batches = median(self.of("job", "batch_rows_per_s"))
        more: dict[str, Any] = {}
        for v in self.variants():
            rate = median(self.of(v, "rows_per_s"))
            in_its_batches = median(self.of(v, "batch_rows_per_s"))
            more.update({f"{v}_rows_per_s": rate, f"{v}_over_same": rate / same if same else 0.0,
                         f"{v}_over_job": rate / job if job else 0.0,
                         f"{v}_batch_rows_per_s": in_its_batches,
                         f"{v}_batch_over_job": in_its_batches / in_batches
                         if in_batches else 0.0,
                         f"{v}_cores_used": median(self.of(v, "cores_used")),
                         f"{v}_quorum_waits": median(self.of(v, "quorum_waits"))})
        return {
            "job_rows_per_s": job, "same_rows_per_s": same, "large_rows_per_s": large,
            "job_batch_rows_per_s": in_batches,
            "job_batch_over_same": in_batches / same if same else 0.0,
            "job_over_same": ratio, "job_over_large": job / large if large else 0.0,
            "job_cpu_s_per_mrows": median(self.of("job", "cpu_s_per_mrows")),
            "job_cores_used": cores_used,
            "job_quorum_waits": median(self.of("job", "quorum_waits")),
            "inserts_per_batch": median(self.of("job", "inserts_per_batch")),
            "rows_per_block": median(self.of("job", "rows_per_block")),
            "metadata_chars": median(self.of("job", "metadata_chars_max")),
            "metadata_bytes": median(self.of("job", "metadata_bytes_max")),
            "parts_per_table": median(self.of("job", "parts_per_table_mean")),
            "parts_per_table_max": median(self.of("job", "parts_per_table_max")),
            "verdict": verdict(ratio, cores_used, self.cores,
                               servers_cores_used=self.median_of("job", "servers_cores_used"),
                               machine_cores=self.machine_cores,
                               python_share=self.median_of("job", "python_share")),
            **more, **self.warm_limit(job),
        }

    def warm_limit(self, job: float) -> dict[str, float]:
        """With ``same_warm`` runs: that limit's median, and the job against it."""
        rates = self.of("same_warm", "rows_per_s")
        if not rates:
            return {}
        same_warm = median(rates)
        return {"same_warm_rows_per_s": same_warm,
                "job_over_same_warm": job / same_warm if same_warm else 0.0,
                "same_warm_server_cpu_s_per_mrows":
                    median(self.of("same_warm", "server_cpu_s_per_mrows"))}

    def line(self) -> str:
        s = self.summary()
        p = self.point
        return (f"{p.curve}={p.label:<6} tables={p.tables} partitions={p.partitions} "
                f"rows/message={p.rows_per_message} row_bytes={self.row_bytes:.0f}: job "
                f"{s['job_rows_per_s']:,.0f} rows/s, same blocks {s['same_rows_per_s']:,.0f}, "
                f"large blocks {s['large_rows_per_s']:,.0f}; job/same {s['job_over_same']:.2f} "
                f"(over its batches' own seconds {s['job_batch_over_same']:.2f}) "
                f"job/large {s['job_over_large']:.2f}; job cpu {s['job_cpu_s_per_mrows']:.2f} "
                f"s/Mrows ({s['job_cores_used']:.2f} cores); {s['inserts_per_batch']:,.0f} "
                f"inserts/batch, {s['rows_per_block']:,.0f} rows/block; metadata "
                f"{s['metadata_chars']:,.0f} chars ({s['metadata_bytes']:,.0f} B) per commit; "
                f"{s['parts_per_table']:.1f} active parts/table (max "
                f"{s['parts_per_table_max']:.0f}); {s['verdict']}" + "".join(
                    f"; {v} {s[f'{v}_rows_per_s']:,.0f} rows/s = {s[f'{v}_over_job']:.2f}x "
                    f"the job ({s[f'{v}_batch_over_job']:.2f}x over the batches), "
                    f"{s[f'{v}_over_same']:.2f}x same" for v in self.variants())
                + (f"; same blocks into warm tables {s['same_warm_rows_per_s']:,.0f} rows/s, "
                   f"job/same_warm {s['job_over_same_warm']:.2f}"
                   if "same_warm_rows_per_s" in s else ""))


def dump(results: Sequence[PointResult], header: dict[str, Any]) -> str:
    """The JSON of a run: its header (command, options), each point's runs and medians."""
    return json.dumps({"header": header, "points": [
        {"point": asdict(r.point), "rows": r.rows, "row_bytes": r.row_bytes,
         "cores": r.cores, "machine_cores": r.machine_cores, "runs": r.runs,
         "summary": r.summary()} for r in results]},
        indent=1)


def load(text: str) -> tuple[list[PointResult], dict[str, Any]]:
    """Inverse of :func:`dump` (the summaries are recomputed from the runs)."""
    data = json.loads(text)
    return [PointResult(Point(**p["point"]), p["rows"], p["row_bytes"], p["cores"], p["runs"],
                        p.get("machine_cores", 0))
            for p in data["points"]], data.get("header", {})


def widen(rows: Rows, string_bytes: int) -> Rows:
    """``rows`` with each pool entry's ``name`` replaced by ``string_bytes`` seeded
    printable characters (random, so neither LZ4 nor Kafka's compression makes the
    width free): the 1 KiB point of the row-width curve. Ids and every other field
    stay as they were."""
    if not string_bytes:
        return rows
    from tests.faults.workload import random_events

    message_type = type(random_events(1, rows.seed)[0])
    rng = random.Random(rows.seed * 7919 + string_bytes)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    pool = []
    for entry in rows.pool:
        m = message_type.FromString(entry.tail)
        m.name = "".join(rng.choice(alphabet) for _ in range(string_bytes))
        values = (*entry.values[:4], m.name, *entry.values[5:])
        pool.append(PoolEntry(m.SerializeToString(), values))
    rows.pool = pool
    return rows


# ------------------------------------------------------------------- the shell


def slot_figures(events: Path, slots: int) -> dict[str, float]:
    """The split of the job run's task slots over the Spark job that read the most
    records (the measured batch's tasks), from Spark's event log in ``events``
    (``bench.spark_tasks``); empty when there is none."""
    from bench.spark_tasks import read_jobs

    jobs = [j for path in sorted(events.rglob("*")) if path.is_file()
            and not path.name.startswith(".") for j in read_jobs(path)]
    if not jobs:
        return {}
    return max(jobs, key=lambda j: sum(t.records for t in j.tasks)).slot_split(slots)


class Runner:
    """Runs one point against the stack: produce once, then the ABBA plan."""

    def __init__(self, args: argparse.Namespace, point: Point) -> None:
        from bench.bench_e2e import Bench

        self.args, self.point = args, point
        self.bench = Bench(argparse.Namespace(
            rows=args.rows, tables=point.tables, partitions=point.partitions,
            rows_per_message=point.rows_per_message, seed=args.seed, folder=None,
            quorum=args.quorum, trigger="1s", max_offsets=0, timeout=args.timeout,
            profile=False, baseline_root=getattr(args, "baseline_root", None),
            spark_event_log=True, jfr=getattr(args, "jfr", False),
            jvm_options=getattr(args, "jvm_options", "")))
        widen(self.bench.rows, point.string_bytes)

    def prepare(self) -> None:
        from bench.workload import create_topic, produce

        b = self.bench
        b.fresh_tables()
        b.register()
        create_topic(b.bootstrap, b.topic, self.point.partitions)
        print(f"{self.point.curve}={self.point.label}: producing {b.rows.rows:,} rows "
              f"({b.rows.messages:,} messages) ...", file=sys.stderr, flush=True)
        produce(b.bootstrap, b.topic, b.rows.envelopes())

    def parts(self, like: str) -> tuple[float, int]:
        """Mean and max active parts per table of the point's database whose name is
        ``LIKE like``, on the first replica."""
        rows = self.bench.clients[0].execute(
            "SELECT table, count() FROM system.parts WHERE database = %(db)s AND active "
            "AND table LIKE %(like)s GROUP BY table", {"db": self.bench.database, "like": like})
        counts = [int(n) for _, n in rows]
        return (sum(counts) / len(counts) if counts else 0.0), max(counts, default=0)

    def commit_metadata(self, group: str, topic: str) -> list[str]:
        """The metadata of every commit of ``group`` on the point's topic, intents and
        final commits, read back from ``__consumer_offsets`` (the verifier's reader):
        the committed offset alone keeps only the last, final commit, which lists no
        block."""
        from blockagg.verifier.history import HistoryReader
        from blockagg.verifier.rules import Commit

        with HistoryReader(self.bench.bootstrap, [group], [topic]) as reader:
            return [e.metadata for e in reader.events() if isinstance(e, Commit)]

    def job(self, mode: str = "exactly_once", settle: bool | None = None) -> dict[str, Any]:
        from bench.bench_e2e import task_slots

        b = self.bench
        cores = self.args.cores
        warm_rows = getattr(self.args, "warm_rows", 0)
        if settle is None:
            settle = getattr(self.args, "settle_warm_up", False)
        r = (b.warm_run(mode, cores, self.args.block_rows, warm_rows,
                        not getattr(self.args, "keep_page_cache", True),
                        getattr(self.args, "warm_batches", 1), settle) if warm_rows
             else b.one_run(mode, cores, self.args.block_rows))
        tag = f"{mode}-{cores}-{self.args.block_rows}-{b.generation}"
        log = b.folder / f"{tag}.log"
        text = (log.read_bytes()[r.log_offset:].decode(errors="replace") if log.exists()
                else "")
        blocks, rows = batch_figures(text)
        in_batches = batch_seconds(text)
        topic = f"{b.topic}-w{b.generation}" if warm_rows else b.topic
        metadata = metadata_figures(self.commit_metadata(f"e2e-{b.run_id}-{tag}", topic))
        mean, most = self.parts("t%")
        # Dropped now, as the limits drop theirs after their runs: left to the next job
        # run's set-up, their deletion came after that run's page-cache drop, and only
        # a job run that followed a job run paid it (docs/BENCHMARKS.md).
        self.drop("t%")
        busy = r.processing_cpu_s / r.seconds if r.seconds else 0.0
        slots = task_slots(mode, cores)
        return {
            "rows_per_s": r.rows_per_s, "seconds": r.seconds, "startup_s": r.startup_s,
            "batch_seconds": in_batches,
            "batch_rows_per_s": r.rows / in_batches if in_batches else 0.0,
            "rows_stored": r.rows, "complete": r.rows == b.rows.rows and r.exit_code == 0,
            "exit_code": r.exit_code,
            "cpu_s_per_mrows": r.processing_cpu_s / r.rows * 1e6 if r.rows else 0.0,
            "job_cpu_s_per_mrows_whole_run": r.job_cpu_s / r.rows * 1e6 if r.rows else 0.0,
            "server_cpu_s_per_mrows": r.server_cpu_s / r.rows * 1e6 if r.rows else 0.0,
            "cores_used": busy, "batches": len(blocks),
            "servers_cores_used": (r.processing_server_cpu_s / r.seconds
                                   if r.seconds else 0.0),
            "python_share": python_share(text, slots),
            "quorum_waits": quorum_waits(text),
            **({"settle_s": r.settle_s} if r.settle_s is not None else {}),
            **({"servers": r.servers} if r.servers is not None else {}),
            **({"warm_gap_s": r.warm_gap_s} if r.warm_gap_s is not None else {}),
            **({"warm_up_blocks": batch_figures(log.read_bytes()[:r.log_offset].decode(
                errors="replace"))[0]} if warm_rows and log.exists() else {}),
            "inserts_per_batch": median(blocks),
            "rows_per_block": sum(rows) / sum(blocks) if blocks else 0.0,
            **metadata,
            "parts_per_table_mean": mean, "parts_per_table_max": most, "log": str(log),
            "slots": slot_figures(log.with_suffix(".events"), slots),
            **({"jvm": r.jvm} if r.jvm is not None else {}),
            **({"job_cpu_s_per_mrows_by_process": {
                k: v / r.rows * 1e6 for k, v in r.job_cpu_by_kind.items()}}
               if r.job_cpu_by_kind and r.rows else {}),
            **({"jvm_threads_cpu_s": dict(sorted(r.jvm_threads_cpu.items(),
                                                 key=lambda kv: -kv[1]))}
               if r.jvm_threads_cpu else {}),
        }

    def same(self, repeat: int, warm: bool = False) -> dict[str, Any]:
        """The same-blocks limit: the job's blocks inserted alone. ``warm``: into tables
        first filled with the blocks of the job's warm-up batches (``--warm-rows`` in
        ``--warm-batches``), as the warm job's are, after the last warm job's gap between
        its warm-up and its measured rows; otherwise into fresh tables."""
        from bench.bench_limits import raw_insert_job_blocks

        b = self.bench
        generation = (200 if warm else 100) + repeat
        warm_rows = (b.warm_batches(self.args.warm_rows, self.args.warm_batches) if warm
                     else [])
        r = raw_insert_job_blocks(b.rows, b.host, b.ports, b.database, self.args.block_rows,
                                  self.args.same_blocks_lanes, self.args.quorum, b.servers,
                                  generation, warm_rows, b.clients,
                                  b.warm_gap_s if b.warm_gap_s is not None else 2.0)
        mean, most = self.parts(f"j{generation}\\_%")
        self.drop(f"j{generation}\\_%")
        return {"rows_per_s": r.rows_per_s, "seconds": r.seconds,
                "client_cpu_s": r.client_cpu_s, "server_cpu_s_per_mrows":
                r.server_cpu_s / r.rows * 1e6, "parts_per_table_mean": mean,
                "parts_per_table_max": most, "note": r.note,
                **({"servers": r.servers} if r.servers is not None else {})}

    def large(self, repeat: int) -> dict[str, Any]:
        from bench.bench_limits import raw_insert

        b = self.bench
        name = f"raw{repeat}"
        create_tables(b.clients, b.database, [name])
        r = raw_insert(b.rows, b.clients[0], f"{b.database}.{name}", self.args.large_block_rows,
                       b.servers)
        self.drop(name)
        return {"rows_per_s": r.rows_per_s, "seconds": r.seconds,
                "client_cpu_s": r.client_cpu_s,
                "server_cpu_s_per_mrows": r.server_cpu_s / r.rows * 1e6, "note": r.note}

    def drop(self, like: str) -> None:
        """Drop the point's tables ``LIKE like``, so a 1,000-table point does not leave
        thousands of tables loading the next one's servers."""
        self.bench.drop_tables(like)

    def run(self) -> PointResult:
        self.prepare()
        b = self.bench
        result = PointResult(self.point, b.rows.rows, b.rows.encoded_row_bytes, self.args.cores,
                             machine_cores=os.cpu_count() or 0)
        plan = contenders(getattr(self.args, "variants", ()),
                          getattr(self.args, "same_into_warm", False))
        for repeat, contender in abba(plan, self.args.repeat):
            if not getattr(self.args, "keep_page_cache", True) and not drop_page_cache():
                print("  cannot drop the page cache (not root?): the servers' drift stays "
                      "in the comparison", file=sys.stderr, flush=True)
            started = time.monotonic()
            figures = (self.job() if contender == "job" else
                       self.job("baseline") if contender == "job_baseline" else
                       self.job(settle=True) if contender == "job_settled" else
                       self.job(f"exactly_once_{contender[len('job_'):]}")
                       if contender.startswith("job_") else
                       self.same(repeat) if contender == "same" else
                       self.same(repeat, warm=True) if contender == "same_warm" else
                       self.large(repeat))
            figures.update(contender=contender, repeat=repeat,
                           wall_s=round(time.monotonic() - started, 1))
            result.runs.append(figures)
            print(f"  {contender:<5} #{repeat}: {figures['rows_per_s']:>10,.0f} rows/s",
                  file=sys.stderr, flush=True)
        return result

    def close(self) -> None:
        self.bench.drop_database()


def workload(point: Point) -> tuple[int, int, int, int]:
    return point.tables, point.partitions, point.rows_per_message, point.string_bytes


def on_curve(results: Sequence[PointResult], curve: str) -> list[PointResult]:
    """The results that are points of ``curve``, in its order: measured as its points,
    or as another curve's point of the same workload (the centre, 100 tables, 8
    partitions, 10 rows a message, narrow rows, is a point of every curve), relabelled
    as ``curve``'s; a point measured as ``curve``'s own wins, and of two alike the later
    in ``results`` (a newer run's file given after an older one's)."""
    chosen: dict[tuple[int, int, int, int], PointResult] = {}
    measured_here: set[tuple[int, int, int, int]] = set()
    for wanted in points([curve]):
        key = workload(wanted)
        for r in results:
            if workload(r.point) != key:
                continue
            if r.point.curve == curve:
                chosen[key] = r
                measured_here.add(key)
            elif key not in measured_here:
                chosen[key] = dataclasses.replace(r, point=wanted)
    own: dict[tuple[int, int, int, int], PointResult] = {}
    for r in results:
        if r.point.curve == curve and workload(r.point) not in chosen:
            own[workload(r.point)] = r
    return sorted([*chosen.values(), *own.values()], key=lambda r: r.point.x)


def plot(results: Sequence[PointResult], path: Path) -> None:
    """Four panels, one per curve: rows/s of the job and of both limits (left axis), the
    job's ratio to its same-blocks limit (right axis) with the 0.8x line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, curve in zip(axes.ravel(), CURVES, strict=True):
        mine = on_curve(results, curve)
        ax.set_title(curve.replace("_", " "), fontsize=10)
        if not mine:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center",
                    transform=ax.transAxes)
            continue
        xs = list(range(len(mine)))
        sums = [r.summary() for r in mine]
        for key, label, style in (("large_rows_per_s", "raw insert, large blocks", "s--"),
                                  ("same_rows_per_s", "same-blocks limit", "^--"),
                                  ("job_rows_per_s", "job, exactly-once", "o-")):
            ax.plot(xs, [s[key] for s in sums], style, label=label)
        ax.set_xticks(xs, [r.point.label for r in mine])
        ax.set_ylabel("rows/s (log)")
        ax.set_yscale("log")  # large blocks run 10-50x the small blocks' figures
        ax.set_xlim(-0.6, len(mine) - 0.4)
        twin = ax.twinx()
        twin.bar(xs, [s["job_over_same"] for s in sums], width=0.3, alpha=0.25,
                 color="tab:green", label="job / same-blocks limit")
        twin.axhline(FLOOR, color="tab:red", linestyle=":", linewidth=1, label=f"{FLOOR}x")
        twin.set_ylim(0, max(1.2, *(s["job_over_same"] * 1.1 for s in sums)))
        twin.set_ylabel("job / same-blocks limit")
        if curve == "tables":
            lines, labels = ax.get_legend_handles_labels()
            more, more_labels = twin.get_legend_handles_labels()
            ax.legend(lines + more, labels + more_labels, fontsize=7, loc="upper right")
    fig.suptitle(f"The curves (median of the repeats; {results[0].rows:,} rows a point)"
                 if results else "The curves", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--curve", action="append", choices=list(CURVES),
                    help="a curve to run (repeatable; default: all four)")
    ap.add_argument("--points", default="",
                    help="comma list of points to keep: labels (10,1000,1KiB) or "
                    "curve=label (rows_per_message=10); curve=N adds a point to a "
                    "numeric curve (tables=33)")
    ap.add_argument("--rows", type=int, default=1_000_000,
                    help="rows per point (about 1-3 min a point on a quiet 2-core machine "
                    "but for the 1,000-table point)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--variants", default="",
                    help="comma list of job variants run beside it: cN (insert_concurrency "
                    "N), sN (N Spark task slots on --cores CPUs)")
    ap.add_argument("--baseline-root", type=Path,
                    help="another checkout whose job the 'baseline' variant runs")
    ap.add_argument("--jvm-options", default="",
                    help="more options for the job's JVM (every job run and variant)")
    ap.add_argument("--jfr", action="store_true",
                    help="warm job runs record Java Flight Recorder samples; each run's "
                         "JSON gets their split over its measured interval (bench.jvm_samples)")
    ap.add_argument("--warm-batches", type=int, default=1,
                    help="with --warm-rows: in this many batches, each produced once the "
                         "one before is visible (the JVM compiles per batch, not per row)")
    ap.add_argument("--warm-rows", type=int, default=0,
                    help="measure the job warm: each job run first works off this many "
                         "rows of its own (not measured), then gets the point's rows in "
                         "one Kafka transaction (bench_e2e.Bench.warm_run)")
    ap.add_argument("--keep-page-cache", action="store_true",
                    help="do not drop the kernel's page cache before each run (by default "
                    "every run starts from a dropped cache: bench.workload.drop_page_cache)")
    ap.add_argument("--settle-warm-up", action="store_true",
                    help="with --warm-rows: produce the measured rows once the servers are "
                         "done merging the warm-up's parts (bench_e2e.Bench.settle_merges)")
    ap.add_argument("--same-into-warm", action="store_true",
                    help="with --warm-rows: one more limit, the same blocks into tables "
                         "first filled with the warm-up's blocks, as the warm job's are")
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--block-rows", type=int, default=100_000, help="the job's blocks.max_rows")
    ap.add_argument("--large-block-rows", type=int, default=100_000)
    ap.add_argument("--same-blocks-lanes", type=int, default=8)
    ap.add_argument("--quorum", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path, help="draw the four panels here (docs/bench_curves.png)")
    ap.add_argument("--plot-only", type=Path, metavar="JSON", nargs="+",
                    help="only draw --plot (default docs/bench_curves.png) from these --json "
                    "files (runs of different curves or points, drawn together)")
    args = ap.parse_args(argv)
    if args.plot_only:
        loaded = [r for path in args.plot_only for r in load(path.read_text())[0]]
        plot(loaded, args.plot or REPO_ROOT / "docs" / "bench_curves.png")
        return 0
    args.variants = [v for v in args.variants.split(",") if v]
    try:
        plan = points(args.curve or list(CURVES),
                      [p for p in args.points.split(",") if p])
        contenders(args.variants)
        if "baseline" in args.variants and not args.baseline_root:
            raise CurveError("the baseline variant needs --baseline-root DIR")
        if args.same_into_warm and not args.warm_rows:
            raise CurveError("--same-into-warm needs --warm-rows: it fills the tables as "
                             "the warm job's warm-up does")
    except CurveError as exc:
        ap.error(str(exc))
    command = "python -m bench.bench_curves " + " ".join(
        argv if argv is not None else sys.argv[1:])
    header = {"command": command, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                           time.gmtime()),
              **{k: str(v) for k, v in vars(args).items()}}
    results: list[PointResult] = []
    for point in plan:
        runner = Runner(args, point)
        try:
            results.append(runner.run())
        finally:
            runner.close()
        print(results[-1].line(), flush=True)
        if args.json:  # after each point: a long run killed half-way keeps what it measured
            args.json.write_text(dump(results, header))
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
