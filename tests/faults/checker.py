"""The exactly-once check: what ClickHouse holds against what the producer delivered.

Invariant 1 of the mission, checked from outside the job:

* per table, on **every** replica (after ``SYSTEM SYNC REPLICA``):
  ``count() == uniqExact(id)`` (no duplicate) and the set of ids equals the set the
  producer's delivery reports acknowledged (no loss, nothing foreign);
* dead letters: each deliberately bad message's ``(topic, partition, offset)`` is in
  the dead-letter table exactly once, and nothing else is;
* with two shards (``Workload.other_shards``), each replica is held to what was produced
  to its own shard's topic, and ``arv audit`` runs once per shard (its topic, its
  replica);
* ``arv verify`` over the job's group (every shard's topic) is clean (invariant 5: the
  committed metadata history has no Backward/Overlap/Gap);
* ``arv audit`` is clean when this checkout has it (reported as ``None`` otherwise);
* every partition's last intent under content-hash deduplication pins a structure mark
  (:func:`check_pins`);
* values, for the tables whose schema changed during the run (``Workload.changed``, the
  ``schema_change`` fault): every column of every row equals what its id was written
  with, each added column its ``DEFAULT`` for rows written before its version and the
  written value after (:func:`check_values`, computed by ClickHouse in one pass).

:func:`caught_up` is the bounded wait before checking: every table's row count on
every replica has reached what was produced (or the timeout passes, and the check
then reports the loss).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tests.faults.workload import ADDED_MODULUS, REPO_ROOT, Workload

_ARV = "import sys; sys.argv[0] = 'arv'; from blockagg.verifier.cli import main; main()"


@dataclass
class TableResult:
    table: str
    replica: int
    expected: int
    count: int
    unique: int
    missing: int
    unexpected: int
    wrong: int | None = None  # rows with a wrong value; None: values not checked
    shard: int = 0
    first: bool = True  # the shard's first replica: its rows count once in the totals

    @property
    def duplicates(self) -> int:
        return self.count - self.unique

    @property
    def ok(self) -> bool:
        return (self.duplicates == 0 and self.missing == 0 and self.unexpected == 0
                and not self.wrong)


@dataclass
class Report:
    tables: list[TableResult] = field(default_factory=list)
    dead_expected: int = 0
    dead_stored: dict[int, int] = field(default_factory=dict)
    dead_duplicates: dict[int, int] = field(default_factory=dict)
    dead_missing: dict[int, int] = field(default_factory=dict)
    verify_code: int | None = None
    verify_output: str = ""
    audit_code: int | None = None
    audit_output: str = ""
    unpinned: list[str] = field(default_factory=list)
    """Partitions whose last commit is under content-hash deduplication without a
    structure mark: their re-sends across an ``ALTER`` go unchecked
    (:func:`check_pins`)."""

    @property
    def rows_expected(self) -> int:
        return sum(t.expected for t in self.tables if t.first)

    @property
    def rows_stored(self) -> int:
        return sum(t.count for t in self.tables if t.first)

    def shard_summary(self) -> dict[str, dict[str, int]]:
        """Per shard (``s1``, ``s2``): rows expected and stored (its first replica),
        duplicates and missing rows over its replicas."""
        out: dict[str, dict[str, int]] = {}
        for t in self.tables:
            s = out.setdefault(f"s{t.shard + 1}", {"rows_expected": 0, "rows_stored": 0,
                                                   "duplicates": 0, "missing": 0})
            if t.first:
                s["rows_expected"] += t.expected
                s["rows_stored"] += t.count
            s["duplicates"] += t.duplicates
            s["missing"] += t.missing
        return out

    @property
    def duplicates(self) -> int:
        return sum(t.duplicates for t in self.tables)

    @property
    def missing(self) -> int:
        return sum(t.missing for t in self.tables)

    @property
    def wrong_values(self) -> int:
        return sum(t.wrong or 0 for t in self.tables)

    @property
    def values_checked(self) -> int:
        """Rows whose values were compared (replica r1)."""
        return sum(t.count for t in self.tables if t.first and t.wrong is not None)

    @property
    def ok(self) -> bool:
        return (all(t.ok for t in self.tables)
                and not any(self.dead_duplicates.values())
                and not any(self.dead_missing.values())
                and self.verify_code == 0
                and self.audit_code in (None, 0)
                and not self.unpinned)

    def problems(self) -> list[str]:
        out = [f"{t.table}@r{t.replica + 1}: expected {t.expected}, count {t.count}, "
               f"unique {t.unique}, missing {t.missing}, unexpected {t.unexpected}, "
               f"wrong values {t.wrong}"
               for t in self.tables if not t.ok]
        for replica, n in self.dead_duplicates.items():
            if n:
                out.append(f"dead letters @r{replica + 1}: {n} duplicated")
        for replica, n in self.dead_missing.items():
            if n:
                out.append(f"dead letters @r{replica + 1}: {n} missing or foreign")
        if self.verify_code != 0:
            out.append(f"arv verify exit {self.verify_code}: {self.verify_output[-2000:]}")
        if self.audit_code not in (None, 0):
            out.append(f"arv audit exit {self.audit_code}: {self.audit_output[-2000:]}")
        if self.unpinned:
            out.append(f"content-hash intents without a structure mark: {self.unpinned}")
        return out

    def summary(self) -> dict[str, Any]:
        return {"rows_expected": self.rows_expected, "rows_stored": self.rows_stored,
                "duplicates": self.duplicates, "missing": self.missing,
                "wrong_values": self.wrong_values, "values_checked": self.values_checked,
                "dead_expected": self.dead_expected,
                "dead_stored": self.dead_stored, "verify": self.verify_code,
                "audit": self.audit_code, "unpinned": len(self.unpinned), "ok": self.ok,
                **({"shards": self.shard_summary()}
                   if any(t.shard for t in self.tables) else {})}


def sync_replicas(clients: Sequence[Any], tables: Sequence[str], timeout: float = 120) -> None:
    for client in clients:
        for table in tables:
            client.execute(f"SYSTEM SYNC REPLICA {table}",
                           settings={"receive_timeout": int(timeout)})


def _counts(client: Any, tables: Sequence[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for table in tables:
        out[table] = int(client.execute(f"SELECT count() FROM {table}")[0][0])
    return out


def count_duplicates(workload: Workload) -> int:
    """Rows stored more than once, over every table and replica (``count() -
    uniqExact(id)``): what a check can still say while the job is behind, since a
    duplicate never goes away by waiting."""
    total = 0
    clients = workload.clients()
    try:
        for client in clients:
            for table in workload.table_names():
                total += int(client.execute(
                    f"SELECT count() - uniqExact(id) FROM {table}")[0][0])
    finally:
        for c in clients:
            c.disconnect()
    return total


def produced_counts(workload: Workload) -> list[dict[str, int]]:
    """Per shard: rows produced to its topic per table so far, and dead letters under the
    dead-letter table."""
    out = []
    for shard, topic in enumerate(workload.topics):
        want = {t: workload.produced.count_of(t, shard) for t in workload.table_names()}
        want[workload.dead_letter_table] = workload.produced.dead_count(topic)
        out.append(want)
    return out


def caught_up(workload: Workload, timeout: float, poll: float = 1.0,
              want: list[dict[str, int]] | None = None) -> float | None:
    """Seconds until every replica holds as many rows per table (and dead letters) as
    were produced; ``None`` if the timeout passed first. Never raises on a replica
    that is still restarting: it just polls again.

    With ``want`` (a :func:`produced_counts` snapshot), until every replica holds at
    least that many: for a stream still being produced while faults overlap."""
    started = time.monotonic()
    exact = want is None
    while time.monotonic() - started < timeout:
        # A topic_recreate may have stopped expecting rows of ``want`` (its documented
        # loss): at least the smaller of the two.
        now = produced_counts(workload)
        targets = now if want is None else [
            {t: min(n, shard_now.get(t, n)) for t, n in shard_want.items()}
            for shard_want, shard_now in zip(want, now, strict=True)]
        try:
            clients = workload.clients()
            counts = [(targets[s], _counts(c, list(targets[s])))
                      for s, c in zip(workload.replica_shards, clients, strict=True)]
            for c in clients:
                c.disconnect()
            if all((got == target) if exact else
                   all(got[t] >= n for t, n in target.items()) for target, got in counts):
                return time.monotonic() - started
        except Exception:  # a replica restarting: poll again
            pass
        time.sleep(poll)
    return None


def check_tables(workload: Workload, clients: Sequence[Any]) -> list[TableResult]:
    results = []
    shards = workload.replica_shards
    for replica, client in enumerate(clients):
        shard = shards[replica]
        for table in workload.table_names():
            count, unique = client.execute(f"SELECT count(), uniqExact(id) FROM {table}")[0]
            got = np.asarray(client.execute(f"SELECT id FROM {table}", columnar=True)[0]
                             if count else [], dtype=np.uint64)
            want = workload.produced.ids_of(table, shard)
            got_set = np.unique(got)
            missing = int(np.setdiff1d(want, got_set, assume_unique=False).size)
            unexpected = int(np.setdiff1d(got_set, want, assume_unique=False).size)
            wrong = check_values(workload, client, table) if table in workload.changed \
                else None
            results.append(TableResult(table, replica, int(want.size), int(count), int(unique),
                                       missing, unexpected, wrong, shard,
                                       first=shards.index(shard) == replica))
    return results


def _array(values: Sequence[str]) -> str:
    return "[" + ", ".join(values) + "]"


def _quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def value_conditions(workload: Workload, table: str) -> list[str]:
    """ClickHouse conditions that hold for a row exactly when every value is what its
    id was written with: the ten ``Event`` columns from the row pool (``id % 512``),
    each added column its ``DEFAULT`` before its version's first id, then its value."""
    events = workload.events
    at = f"(id % {len(events)}) + 1"
    kinds = ["KIND_UNSPECIFIED", "KIND_VIEW", "KIND_CLICK", "KIND_BUY"]
    conditions = [
        f"user = {_array([str(e.user) for e in events])}[{at}]",
        f"delta = {_array([str(e.delta) for e in events])}[{at}]",
        f"abs(price - {_array([repr(e.price) for e in events])}[{at}]) <= 1e-9",
        f"abs(toFloat64(score) - {_array([repr(e.score) for e in events])}[{at}]) <= 1e-6",
        f"name = {_array([_quote(e.name) for e in events])}[{at}]",
        f"country = {_array([_quote(e.country) for e in events])}[{at}]",
        f"toUnixTimestamp(time) = 1700000000 + (id % {len(events)})",
        f"toString(kind) = {_array([_quote(kinds[e.kind]) for e in events])}[{at}]",
        "arrayStringConcat(arrayMap(x -> toString(x), tags), ',') = "
        f"{_array([_quote(','.join(str(t) for t in e.tags)) for e in events])}[{at}]",
    ]
    for added, first in workload.added_since(table):
        conditions.append(
            f"{added.column} = if(id >= {first}, id * {added.factor} % {ADDED_MODULUS}, "
            f"{added.default})")
    return conditions


def check_values(workload: Workload, client: Any, table: str) -> int:
    """Rows of ``table`` with at least one wrong value (:func:`value_conditions`)."""
    where = " AND ".join(f"({c})" for c in value_conditions(workload, table))
    return int(client.execute(f"SELECT countIf(NOT ({where})) FROM {table}")[0][0])


def check_dead_letters(workload: Workload, clients: Sequence[Any], report: Report) -> None:
    """Per coordinate, as many dead letters as were expected: one for a bad message of
    the topic, plus one per earlier incarnation whose dead letter there was stored
    before a ``topic_recreate`` (``Produced.kept_dead``). A surplus is a duplicate; a
    shortfall, or a coordinate expected nowhere, is missing or foreign. A replica is
    held to the dead letters of its own shard's topic."""
    every = Counter(workload.produced.dead)
    every.update(workload.produced.kept_dead)
    report.dead_expected = sum(every.values())
    shards = workload.replica_shards
    for replica, client in enumerate(clients):
        topic = workload.topics[shards[replica]]
        want = Counter({c: n for c, n in every.items() if c[0] == topic})
        rows = client.execute(
            f"SELECT topic, partition, offset, count() FROM {workload.dead_letter_table} "
            "GROUP BY topic, partition, offset")
        stored = {(t, int(p), int(o)): int(n) for t, p, o, n in rows}
        report.dead_stored[replica] = sum(stored.values())
        report.dead_duplicates[replica] = sum(max(0, n - max(1, want[c]))
                                              for c, n in stored.items())
        report.dead_missing[replica] = (
            sum(max(0, w - stored.get(c, 0)) for c, w in want.items())
            + sum(1 for c in stored if not want[c]))


def arv(args: Sequence[str], timeout: float = 300) -> tuple[int, str]:
    """Run ``arv`` (the console entry point, from this checkout) and return its exit code
    and output."""
    res = subprocess.run([sys.executable, "-c", _ARV, *args], capture_output=True, text=True,
                         timeout=timeout, check=False, cwd=REPO_ROOT)
    return res.returncode, (res.stdout + res.stderr)


def has_audit() -> bool:
    code, out = arv(["audit", "--help"], timeout=60)
    return code == 0 and "audit" in out.lower()


def check_pins(workload: Workload) -> list[str]:
    """The partitions whose last committed intent deduplicates by content hash (18.16)
    but pins no structure mark. The job's own adapters always pin one there; a zero
    means something between the task and the writer dropped it, as the fault hook once
    did (b6410fd), and the re-send check was off for the whole run."""
    from confluent_kafka import Consumer

    from blockagg.aggregator.core.metadata import DedupMode, decode
    from blockagg.spark.offsets import read_committed

    consumer = Consumer({"bootstrap.servers": workload.bootstrap, "group.id": workload.group,
                         "enable.auto.commit": False})
    try:
        committed = read_committed(
            consumer, [(t, p) for t in workload.topics for p in range(workload.partitions)])
    finally:
        consumer.close()
    out = []
    for (topic, partition), c in sorted(committed.items()):
        pins = decode(c.metadata).pins
        if pins.dedup == DedupMode.BLOCK_HASH and not pins.structure:
            out.append(f"{topic}[{partition}]")
    return out


def check(workload: Workload, audit_args: Sequence[str] | None = None) -> Report:
    """The full check; call after :func:`caught_up`."""
    report = Report()
    clients = workload.clients()
    try:
        sync_replicas(clients, [*workload.table_names(), workload.dead_letter_table])
        report.tables = check_tables(workload, clients)
        check_dead_letters(workload, clients, report)
    finally:
        for c in clients:
            c.disconnect()
    report.verify_code, report.verify_output = arv(
        ["verify", "--bootstrap-servers", workload.bootstrap, "--group", workload.group,
         *(a for t in workload.topics for a in ("--topic", t)), "--json"])
    report.unpinned = check_pins(workload)
    if has_audit():
        # one audit per shard: its topic against its first replica
        audits = [arv(
            ["audit", "--bootstrap-servers", workload.bootstrap, "--group", workload.group,
             "--topic", topic, "--clickhouse", f"{workload.ch_host}:{ports[0]}",
             "--database", workload.database,
             "--dead-letter-table", workload.dead_letter_table, "--json",
             *(audit_args or [])])
            for topic, ports in zip(workload.topics, workload.shard_ports, strict=True)]
        report.audit_code = next((code for code, _ in audits if code != 0), 0)
        report.audit_output = "\n".join(out for _, out in audits)
    return report


def dump(report: Report) -> str:
    return json.dumps(report.summary(), sort_keys=True)
