"""The tables of docs/RELIABILITY.md from a fault run's ``--json`` summary:
``python -m tests.faults.report faults-1000.json``.

Works on a run still in progress (the driver rewrites the summary after every fault):
first the faults armed that never fired (not counted as injected) and why, then faults
per kind, job restarts, time to recover (median / p90 / max over the faults that caught
up within the settle time), every check (interim and final; a check made when the run was
resumed is marked so), each shard's rows at every check (two-shard runs), and each resume.
With ``--job-log`` (the run folder's ``job.log``), also how often the job met a hanging
transaction on its metadata group at start and what became of it (issue 27 item 6: does
one occur on three brokers under coordinator kills)."""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from tests.faults.driver import CLUSTER_KINDS, KINDS


def _quantile(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * len(ys)))]


def unfired(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The faults armed that never fired: they tested nothing, so they are not
    counted as injected (each says why in ``unfired``)."""
    return [e for e in events if e.get("fired") is False]


def unfired_lines(events: list[dict[str, Any]]) -> list[str]:
    """The report's first lines: how many faults were armed and never fired, and why."""
    missed = unfired(events)
    if not missed:
        return ["Faults armed but not fired: 0."]
    lines = [f"**Faults armed but not fired: {len(missed)}** (not counted as injected):"]
    lines += [f"- fault {e.get('n', '?')} {e['kind']} {e.get('step', '')}: "
              f"{e.get('unfired', 'no reason recorded')}".replace("  ", " ") for e in missed]
    return lines


def fault_table(events: list[dict[str, Any]]) -> list[str]:
    recover: dict[str, list[float]] = defaultdict(list)
    count: dict[str, int] = defaultdict(int)
    missed: dict[str, int] = defaultdict(int)
    restarts: dict[str, int] = defaultdict(int)
    unsettled: dict[str, int] = defaultdict(int)
    for e in events:
        kind = e["kind"]
        if e.get("fired") is False:
            missed[kind] += 1
            restarts[kind] += int(e.get("job_starts", 0))
            continue
        count[kind] += 1
        restarts[kind] += int(e.get("job_starts", 0))
        if e.get("recover_s") is None:
            unsettled[kind] += 1
        else:
            recover[kind].append(float(e["recover_s"]))
    lines = ["| kind | injected | armed, not fired | job restarts | time to recover, median / "
             "p90 / max (s) | not caught up within the settle time |",
             "| --- | --- | --- | --- | --- | --- |"]
    seen = [k for k in count.keys() | missed.keys() if k not in KINDS + CLUSTER_KINDS]
    for kind in [*KINDS, *CLUSTER_KINDS, *sorted(seen)]:
        xs = recover[kind]
        times = (f"{statistics.median(xs):.1f} / {_quantile(xs, 0.9):.1f} / {max(xs):.1f}"
                 if xs else "-")
        lines.append(f"| {kind} | {count[kind]} | {missed[kind]} | {restarts[kind]} | {times} "
                     f"| {unsettled[kind]} |")
    lines.append(f"| all | {sum(count.values())} | {sum(missed.values())} | "
                 f"{sum(restarts.values())} | | {sum(unsettled.values())} |")
    return lines


def all_checks(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The interim checks, then the final one (``after_faults`` "final")."""
    checks = list(summary.get("interim_checks") or [])
    if summary.get("check"):
        checks.append({"after_faults": "final", **summary["check"]})
    return checks


def check_table(summary: dict[str, Any]) -> list[str]:
    checks = all_checks(summary)
    lines = ["| after faults | messages produced | rows expected | rows stored (r1) | "
             "duplicates | missing | dead letters (r1 / r2 of expected) | verify | audit | ok |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in checks:
        dead = c.get("dead_stored", {})
        produced = c.get("messages_produced")
        after = f"{c['after_faults']} (resumed)" if c.get("resumed") else c["after_faults"]
        if c.get("skipped"):
            duplicates = c.get("duplicates")
            cells = [str(after), "" if produced is None else f"{produced:,}",
                     f"skipped: {c['skipped']}", "", "" if duplicates is None else str(duplicates),
                     "", "", "", "", "False" if duplicates else ""]
            lines.append("|" + "|".join(f" {cell} " if cell else " " for cell in cells) + "|")
            continue
        lines.append(
            f"| {after} | {'' if produced is None else f'{produced:,}'} | "
            f"{c['rows_expected']:,} | {c['rows_stored']:,} | {c['duplicates']} | "
            f"{c['missing']} | {dead.get('0', 0):,} / {dead.get('1', 0):,} of "
            f"{c['dead_expected']:,} | "
            f"{c['verify']} | {c['audit']} | {c['ok']} |")
    return lines


def shard_table(summary: dict[str, Any]) -> list[str]:
    """Per shard at every check that has shards: each shard is held to its own topic,
    so totals over both could hide a shard's loss behind the other's duplicates."""
    checks = [c for c in all_checks(summary) if c.get("shards")]
    if not checks:
        return []
    lines = ["| after faults | shard | rows expected | rows stored (first replica) | "
             "duplicates | missing |", "| --- | --- | --- | --- | --- | --- |"]
    for c in checks:
        for shard, s in sorted(c["shards"].items()):
            lines.append(f"| {c['after_faults']} | {shard} | {s['rows_expected']:,} | "
                         f"{s['rows_stored']:,} | {s['duplicates']} | {s['missing']} |")
    return lines


HANG_EVENTS = {"met": "healing a hanging transaction", "failed": "healing failed",
               "refused": "MetadataUnstable"}
"""What the job logs when a hanging transaction blocks its group's commits at start
(``spark.driver``): it starts healing, the healing fails, or a start is refused."""


def hang_lines(job_log: Path) -> list[str]:
    """How often each :data:`HANG_EVENTS` line occurs in the job's log, and how many
    times the job started."""
    counts = dict.fromkeys(HANG_EVENTS, 0)
    starts = 0
    with job_log.open(errors="replace") as lines:
        for line in lines:
            starts += "blockagg.job: configuration " in line
            for key, text in HANG_EVENTS.items():
                counts[key] += text in line
    return [f"Hanging transactions on the metadata group, over {starts} job starts "
            f"({job_log.name}): met {counts['met']}, healing failed {counts['failed']}, "
            f"start refused as unstable {counts['refused']} (log lines)."]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("summary", type=Path)
    ap.add_argument("--job-log", type=Path, help="the run folder's job.log")
    args = ap.parse_args(argv)
    summary = json.loads(args.summary.read_text())
    events = summary.get("events") or []
    print(f"{len(events)} faults in {summary.get('seconds', 0):,.0f} s\n")
    print("\n".join(unfired_lines(events)))
    print()
    print("\n".join(fault_table(events)))
    print()
    print("\n".join(check_table(summary)))
    if shards := shard_table(summary):
        print()
        print("\n".join(shards))
    if args.job_log is not None:
        print()
        print("\n".join(hang_lines(args.job_log)))
    for r in summary.get("resumes") or []:
        print(f"\nresumed after {r['after_faults']} faults ({r['at_s']:,.0f} s into the run) "
              f"at commit {r['commit']}: {r['messages_in_topic']:,} messages in the topic, "
              f"workload rebuilt in {r['restored_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
