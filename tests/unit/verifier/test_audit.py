"""``arv audit`` in-process: the streaming merge, the zones, the plan, and the CLI with fake
Kafka and ClickHouse readers (click's CliRunner)."""

from __future__ import annotations

import json
import random
import tracemalloc
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner

from blockagg.aggregator.core.metadata import BlockRange, Metadata, encode
from blockagg.proto.envelope import Parsed, make_envelope, parse_envelope
from blockagg.verifier import audit_sources
from blockagg.verifier import ownership as verifier_ownership
from blockagg.verifier.audit import (
    AuditPlan,
    Committed,
    Message,
    PartitionAudit,
    audit_partitions,
    make_plan,
)
from blockagg.verifier.cli import cli
from blockagg.verifier.exceptions import AuditError
from blockagg.verifier.ownership import OwnershipConflict

A, B, DLT = "db.a", "db.b", "blockagg.dead_letters"
AUDITED = frozenset({A, B})


def run(messages: list[Message], counts: list[tuple[int, str, int]], resume: int = 100,
        upper: int | None = None, examples: int = 5) -> PartitionAudit:
    audit = PartitionAudit("t", 0, 0, resume, resume if upper is None else upper, AUDITED, DLT,
                           examples)
    audit.run(iter(messages), iter(sorted(counts)))
    return audit


def test_clean_partition() -> None:
    audit = run([Message(0, A, 2), Message(1, B, 1), Message(3, A, 1), Message(4, None, 0)],
                [(0, A, 2), (1, B, 1), (3, A, 1), (4, DLT, 1)])
    a, b, dl = audit.tables[A], audit.tables[B], audit.tables[DLT]
    assert (a.messages, a.expected_rows, a.found_rows, a.discrepancies) == (2, 3, 3, 0)
    assert (b.messages, b.expected_rows, b.found_rows, b.discrepancies) == (1, 1, 1, 0)
    assert (dl.messages, dl.expected_rows, dl.found_rows, dl.discrepancies) == (1, 1, 1, 0)


@pytest.mark.parametrize(("found", "kind"), [
    ([(5, A, 4)], "duplicated"),          # the block inserted twice
    ([(5, A, 3)], "duplicated"),          # more rows than the message has
    ([(5, A, 1)], "missing"),             # part of the message's rows
    ([], "missing"),                      # nothing at all
    ([(5, A, 2), (5, DLT, 1)], "duplicated"),  # in the table and dead-lettered
    ([(5, DLT, 2)], "duplicated"),        # dead-lettered twice
])
def test_one_message_discrepancies(found: list[tuple[int, str, int]], kind: str) -> None:
    audit = run([Message(4, A, 1), Message(5, A, 2), Message(6, A, 1)],
                [(4, A, 1), (6, A, 1), *found])
    a = audit.tables[A]
    assert getattr(a, kind).offsets == [5] and a.discrepancies == 1


def test_dead_lettered_message_of_a_table_is_accounted() -> None:
    audit = run([Message(5, A, 3)], [(5, DLT, 1)])
    a, dl = audit.tables[A], audit.tables[DLT]
    assert (a.messages, a.dead_letters, a.expected_rows, a.found_rows) == (1, 1, 0, 0)
    assert (dl.dead_letters, dl.expected_rows, dl.found_rows) == (1, 1, 1)
    assert a.discrepancies == dl.discrepancies == 0


def test_unexpected_rows() -> None:
    audit = run([Message(1, A, 1), Message(3, B, 1), Message(4, None, 0), Message(120, A, 1)],
                [(1, A, 1), (2, A, 5),        # 2: a hole (transaction marker)
                 (3, B, 1), (3, A, 1),        # 3: B's message, row in A
                 (4, DLT, 1), (4, B, 2),      # 4: a rejected envelope, rows in B
                 (150, A, 1), (99, DLT, 1)],  # past the messages read
                resume=100, upper=100)
    assert audit.tables[A].unexpected.offsets == [2, 3, 150]
    assert audit.tables[A].unexpected.rows == 7
    assert audit.tables[B].unexpected.offsets == [4]
    assert audit.tables[DLT].unexpected.offsets == [99]
    assert audit.tables[A].missing.count == 0  # 120 is not delivered, so not expected


def test_in_flight_zone_checks_duplicates_only() -> None:
    audit = run([Message(9, A, 1), Message(10, A, 2), Message(11, A, 2), Message(12, A, 1),
                 Message(13, A, 1)],
                [(9, A, 1), (10, A, 2), (12, A, 2), (13, A, 1), (13, DLT, 1)],
                resume=10, upper=14)
    a = audit.tables[A]
    assert (a.messages, a.in_flight_messages, a.in_flight_rows) == (1, 4, 5)
    assert a.missing.count == 0  # 11 absent is fine: its block may not be inserted yet
    assert a.duplicated.offsets == [12, 13]


def test_unaudited_tables_count_and_their_dead_letters_are_checked() -> None:
    audit = run([Message(1, "db.other", 4), Message(2, "db.other", 1)], [(2, DLT, 2)])
    assert audit.unaudited_messages == 2
    assert audit.tables[DLT].duplicated.offsets == [2]


def test_examples_are_capped_and_counted() -> None:
    audit = run([Message(o, A, 1) for o in range(50)], [], examples=3)
    assert audit.tables[A].missing.count == 50
    assert audit.tables[A].missing.offsets == [0, 1, 2]


def test_misordered_streams_are_errors() -> None:
    with pytest.raises(AuditError, match="not in offset order"):
        PartitionAudit("t", 0, 0, 10, 10, AUDITED, DLT).run(
            iter([Message(1, A, 1)]), iter([(5, A, 1), (2, A, 1)]))
    with pytest.raises(AuditError, match="after"):
        PartitionAudit("t", 0, 0, 10, 10, AUDITED, DLT).run(
            iter([Message(2, A, 1), Message(2, A, 1)]), iter([]))


def oracle(messages: list[Message], counts: list[tuple[int, str, int]], resume: int,
           upper: int) -> dict[str, dict[str, list[int]]]:
    """The audit's rules, written plainly over whole dictionaries."""
    found: dict[int, Counter[str]] = {}
    for offset, table, rows in counts:
        found.setdefault(offset, Counter())[table] += rows
    by_offset = {m.offset: m for m in messages}
    out: dict[str, dict[str, list[int]]] = {}

    def add(table: str, kind: str, offset: int) -> None:
        out.setdefault(table, {"duplicated": [], "missing": [], "unexpected": []})[
            kind].append(offset)

    for offset in sorted(set(by_offset) | set(found)):
        f = found.get(offset, Counter())
        message = by_offset.get(offset)
        if message is None:
            for table in sorted(f):
                add(table, "unexpected", offset)
            continue
        owner = message.table if message.table in AUDITED else None
        dead, n = f[DLT], f[owner] if owner else 0
        if owner is not None:
            if n > message.rows or dead > 1 or (n and dead):
                add(owner, "duplicated", offset)
            elif (offset < resume and n < message.rows and not dead) or 0 < n < message.rows:
                add(owner, "missing", offset)
        elif dead > 1:
            add(DLT, "duplicated", offset)
        elif message.table is None and offset < resume and not dead:
            add(DLT, "missing", offset)
        for table in sorted(set(f) - {DLT, owner}):
            if f[table]:
                add(table, "unexpected", offset)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_merge_agrees_with_a_plain_oracle(seed: int) -> None:
    rng = random.Random(seed)
    resume, upper = rng.randint(0, 60), 0
    upper = resume + rng.randint(0, 20)
    messages, counts = [], []
    for offset in range(upper):
        if rng.random() < 0.1:
            continue  # a hole
        table = rng.choice([A, B, "db.other", None])
        k = 0 if table is None else rng.randint(1, 3)
        messages.append(Message(offset, table, k))
        for name in (A, B, DLT):
            if rng.random() < 0.4:
                counts.append((offset, name, rng.choice([1, k or 1, 2 * (k or 1)])))
    for _ in range(rng.randint(0, 3)):
        counts.append((upper + rng.randint(0, 5), rng.choice([A, B, DLT]), 1))
    counts = sorted(set(counts))
    audit = run(messages, counts, resume, upper, examples=10_000)
    got = {t: {"duplicated": a.duplicated.offsets, "missing": a.missing.offsets,
               "unexpected": sorted(set(a.unexpected.offsets))}
           for t, a in audit.tables.items() if a.discrepancies}
    want = oracle(messages, counts, resume, upper)
    assert got == {t: {k: sorted(set(v)) for k, v in kinds.items()}
                   for t, kinds in want.items()}


def test_memory_is_bounded_by_findings_not_by_partition_size() -> None:
    n = 300_000

    def messages() -> Iterator[Message]:
        for offset in range(n):
            yield Message(offset, A if offset % 2 else B, 2)

    def counts() -> Iterator[tuple[int, str, int]]:
        for offset in range(n):
            yield offset, A if offset % 2 else B, 2

    tracemalloc.start()
    audit = PartitionAudit("t", 0, 0, n, n, AUDITED, DLT)
    audit.run(messages(), counts())
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert audit.tables[A].found_rows == n and audit.tables[A].discrepancies == 0
    assert peak < 256 * 1024, peak


class FakeKafka:
    def __init__(self, messages: list[Message], commits: list[Committed | None],
                 low: int = 0, topics: tuple[str, ...] = ("t",)) -> None:
        self._messages = messages
        self._commits = commits  # one per call of committed(); the last one repeats
        self.low = low
        self.topics = list(topics)
        self.reads: list[tuple[int, int]] = []

    def group_topics(self) -> list[str]:
        return self.topics

    def partitions(self, topic: str) -> list[int]:
        return [0]

    def watermarks(self, topic: str, partition: int) -> tuple[int, int]:
        return self.low, max((m.offset + 1 for m in self._messages), default=0)

    def committed(self, topic: str, partitions: list[int]) -> dict[int, Committed]:
        commit = self._commits.pop(0) if len(self._commits) > 1 else self._commits[0]
        return {} if commit is None else {0: commit}

    def messages(self, topic: str, partition: int, start: int, end: int) -> Iterator[Message]:
        self.reads.append((start, end))
        return iter([m for m in self._messages if start <= m.offset < end])

    def incarnation(self, topic: str) -> int | None:
        return None

    def close(self) -> None:
        pass


class FakeClickHouse:
    def __init__(self, counts: list[tuple[int, str, int]],
                 tables: dict[str, list[str]] | None = None) -> None:
        self._counts = counts
        self.tables = tables if tables is not None else {
            A: ["_topic", "_partition", "_offset"], B: ["_topic", "_partition", "_offset"],
            DLT: [], "db.plain": ["x"]}

    def coordinate_tables(self, databases: list[str]) -> list[str]:
        return sorted(t for t, cols in self.tables.items() if len(cols) == 3
                      and (not databases or t.split(".")[0] in databases))

    def missing_coordinates(self, table: str) -> list[str]:
        cols = self.tables.get(table, [])
        return [c for c in ("_topic", "_partition", "_offset") if c not in cols]

    def table_exists(self, table: str) -> bool:
        return table in self.tables

    def counts(self, tables: list[str], dead_letter_table: str | None, topic: str,
               partition: int, start: int, incarnation: int | None = None
               ) -> Iterator[tuple[int, str, int]]:
        wanted = {*tables, dead_letter_table}
        return iter(sorted(c for c in self._counts if c[0] >= start and c[1] in wanted))

    def close(self) -> None:
        pass


def final(resume: int) -> Committed:
    return Committed(resume, encode(Metadata(1, 0, 0, resume, resume)))


def plan(**kwargs: Any) -> AuditPlan:
    values: dict[str, Any] = {"topics": ["t"], "tables": [A, B], "dead_letter_table": DLT,
                              "from_offsets": {}}
    values.update(kwargs)
    return AuditPlan(**values)


def test_partition_zones_from_commits() -> None:
    intent = encode(Metadata(1, 1, 10, 20, 12, (BlockRange(3, 14, 15),)))
    kafka = FakeKafka([Message(o, A, 1) for o in range(20)], [Committed(12, intent)])
    [audit] = audit_partitions(kafka, FakeClickHouse([]), plan())
    assert (audit.resume, audit.upper) == (12, 16)
    assert kafka.reads == [(0, 16)]
    # A commit made while ClickHouse was read widens the in-flight zone.
    kafka = FakeKafka([Message(o, A, 1) for o in range(20)], [final(10), final(18)])
    [audit] = audit_partitions(kafka, FakeClickHouse([(o, A, 1) for o in range(18)]), plan())
    assert (audit.resume, audit.upper) == (10, 18)
    assert audit.tables[A].discrepancies == 0 and audit.tables[A].in_flight_rows == 8


def test_no_commit_means_nothing_delivered() -> None:
    kafka = FakeKafka([Message(0, A, 1)], [None])
    [audit] = audit_partitions(kafka, FakeClickHouse([(0, A, 1)]), plan())
    assert audit.tables[A].unexpected.offsets == [0]
    assert "no committed offset" in audit.notes[0]


def test_from_offset_and_retention() -> None:
    kafka = FakeKafka([Message(o, A, 1) for o in range(5, 10)], [final(10)], low=5)
    [audit] = audit_partitions(kafka, FakeClickHouse([(o, A, 1) for o in range(10)]), plan())
    assert audit.from_offset == 5 and audit.tables[A].discrepancies == 0
    assert "removed by retention" in audit.notes[0]
    with pytest.raises(AuditError, match="below the partition's first offset 5"):
        list(audit_partitions(kafka, FakeClickHouse([]), plan(from_offsets={("t", 0): 2})))
    [audit] = audit_partitions(kafka, FakeClickHouse([]), plan(from_offsets={(None, 0): 8}))
    assert audit.from_offset == 8 and audit.tables[A].missing.offsets == [8, 9]


def test_make_plan() -> None:
    warnings: list[str] = []
    p = make_plan(FakeKafka([], [None]), FakeClickHouse([]), [], [], [], DLT, {}, 5, warnings)
    assert (p.topics, p.tables, p.dead_letter_table) == (["t"], [A, B], DLT)
    p = make_plan(FakeKafka([], [None]), FakeClickHouse([]), ["t"], [], [], "db.none", {}, 5,
                  warnings)
    assert p.dead_letter_table is None and "does not exist" in warnings[-1]
    for tables, message in (([ "db.plain"], "has no _topic"), (["db.none"], "does not exist")):
        with pytest.raises(AuditError, match=message):
            make_plan(FakeKafka([], [None]), FakeClickHouse([]), ["t"], tables, [], DLT, {},
                      5, [])
    with pytest.raises(AuditError, match="no committed offset for any topic"):
        make_plan(FakeKafka([], [None], topics=()), FakeClickHouse([]), [], [], [], DLT, {},
                  5, [])
    with pytest.raises(AuditError, match="not audited: u"):
        make_plan(FakeKafka([], [None]), FakeClickHouse([]), ["t"], [], [], DLT,
                  {("u", 0): 1}, 5, [])


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    holder: dict[str, Any] = {
        "kafka": FakeKafka([Message(0, A, 2), Message(1, B, 1), Message(2, None, 0)],
                           [final(3)]),
        "clickhouse": FakeClickHouse([(0, A, 2), (1, B, 1), (2, DLT, 1)]),
        "args": {},
    }

    def kafka(*args: Any) -> Any:
        holder["args"]["kafka"] = args
        return _Ctx(holder["kafka"])

    def clickhouse(*args: Any) -> Any:
        holder["args"]["clickhouse"] = args
        return _Ctx(holder["clickhouse"])

    monkeypatch.setattr(audit_sources, "KafkaAuditReader", kafka)
    monkeypatch.setattr(audit_sources, "ClickHouseAuditReader", clickhouse)

    def conflicts(bootstrap: str, settings: Any, owners_topic: str, pairs: Any,
                  timeout: float) -> list[Any]:
        holder["args"]["ownership"] = (owners_topic, list(pairs))
        return list(holder.get("conflicts", []))

    monkeypatch.setattr(verifier_ownership, "read_conflicts", conflicts)
    return holder


class _Ctx:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __enter__(self) -> Any:
        return self.inner

    def __exit__(self, *exc: object) -> None:
        pass


BASE = ["audit", "--bootstrap-servers", "k:9092", "--group", "g", "--clickhouse", "ch:9000"]


def invoke(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    result = CliRunner(env=env).invoke(cli, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_cli_clean_json(fakes: dict[str, Any]) -> None:
    code, stdout, stderr = invoke(*BASE, "--json", env={"BLOCKAGG_CH_PASSWORD": "s3cret"})
    assert code == 0, stderr
    lines = [json.loads(line) for line in stdout.splitlines()]
    assert [(x["table"], x["found_rows"], x["clean"]) for x in lines] == [
        (DLT, 1, True), (A, 2, True), (B, 1, True)]
    assert "0 discrepancies" in stderr and "s3cret" not in stderr + stdout
    host, port, user, password, _, _, tls = fakes["args"]["clickhouse"]
    assert (host, port, user, password, tls) == ("ch", 9000, "default", "s3cret", {})


def test_cli_an_ownership_conflict_exits_1(fakes: dict[str, Any]) -> None:
    """The group committed offsets of a topic another group owns (issue 26): the rows
    may all be there once for this group, and the topic is still stored twice."""
    fakes["conflicts"] = [OwnershipConflict("g", "t", "owner", "ch:9000", 0)]
    code, stdout, stderr = invoke(*BASE, "--owners-topic", "_owners")
    assert code == 1, stderr
    assert "ownership conflict: group g committed offsets of topic t, which group owner" \
        in stdout
    assert "0 discrepancies, 1 ownership conflicts" in stderr
    assert fakes["args"]["ownership"][0] == "_owners"


def test_cli_discrepancies_human_table(fakes: dict[str, Any]) -> None:
    fakes["clickhouse"] = FakeClickHouse([(0, A, 4), (1, B, 1), (7, B, 1)])
    code, stdout, stderr = invoke(*BASE, "--table", A, "--table", B)
    assert code == 1
    header, *rows = stdout.splitlines()
    assert header.split("\t")[:3] == ["PARTITION", "TABLE", "FROM"]
    cells = {r.split("\t")[1]: r.split("\t") for r in rows}
    assert cells[A][9] == "1 (0)"                    # duplicated
    assert cells[B][11] == "1 (7)"                   # unexpected
    assert cells[f"{DLT} (dead letters)"][10] == "1 (2)"  # missing dead letter
    assert "3 discrepancies" in stderr


@pytest.mark.parametrize(("args", "message"), [
    (["audit", "--group", "g"], "Missing option '--bootstrap-servers'"),
    (BASE[:3], "Missing option '--group'"),
    ([*BASE, "--from-offset", "3"], "[TOPIC:]PARTITION=OFFSET"),
    ([*BASE, "--from-offset", ":3=1"], "[TOPIC:]PARTITION=OFFSET"),
    ([*BASE, "--from-offset", "t:3=-1"], "negative"),
    ([*BASE, "--table", "nodot"], "is not database.table"),
    ([*BASE, "--dead-letter-table", "a.b;drop"], "is not database.table"),
    ([*BASE, "--clickhouse", "ch"], "is not HOST:PORT"),
    ([*BASE, "-X", "isolation.level=read_uncommitted"], "read_committed"),
    ([*BASE, "--clickhouse-setting", "novalue"], "is not KEY=VALUE"),
])
def test_cli_usage_errors_exit_2(fakes: dict[str, Any], args: list[str], message: str) -> None:
    code, stdout, stderr = invoke(*args)
    assert code == 2 and message in stderr and stdout == ""


def test_cli_cannot_run_exits_2(fakes: dict[str, Any]) -> None:
    code, stdout, stderr = invoke(*BASE, "--table", "db.plain")
    assert code == 2 and stdout == ""
    assert stderr.startswith("arv: error: table db.plain has no _topic")


def test_cli_from_offset_parsing(fakes: dict[str, Any]) -> None:
    code, stdout, _ = invoke(*BASE, "--json", "--from-offset", "t:0=1")
    assert code == 0
    assert {json.loads(line)["from_offset"] for line in stdout.splitlines()} == {1}


def test_real_readers_report_unreachable_services() -> None:
    code, stdout, stderr = invoke("audit", "--bootstrap-servers", "127.0.0.1:1", "--group",
                                  "g", "--topic", "t", "--clickhouse", "127.0.0.1:1",
                                  "--timeout", "1")
    assert code == 2 and stdout == ""
    assert stderr.startswith("arv: error: cannot reach")


def test_counts_query_shape() -> None:
    query = audit_sources.ClickHouseAuditReader.counts_query([A], DLT)
    assert "GROUP BY o" in query and query.endswith("ORDER BY o, t")
    assert "`blockagg`.`dead_letters`" in query and "UNION ALL" in query


@pytest.mark.parametrize("value", [
    None, b"", b"\xff\xff garbage", make_envelope("db.a", [b"x", b"y"]),
    make_envelope("db.a", []), make_envelope("nodot", [b"x"]), make_envelope("db.a.b", [b"x"]),
    make_envelope("db.1a", [b"x"]), make_envelope("db.a", [b""], version=3),
    make_envelope("db.a", [b"x"])[:-1],
])
def test_classify_agrees_with_the_jobs_parse_envelope(value: bytes | None) -> None:
    parsed = parse_envelope(value)
    message = audit_sources.classify(7, value)
    if isinstance(parsed, Parsed):
        assert message == Message(7, parsed.table, len(parsed.rows))
    else:
        assert message == Message(7, None, 0)


def test_a_recreated_topics_earlier_rows_are_not_counted_where_the_table_marks_them() -> None:
    """Issue 25 (the fault suite's topic_recreate): after a topic is deleted and
    recreated, the old topic's rows sit at the new topic's coordinates. A table with the
    incarnation column counts only rows of the topic's current incarnation (or 0:
    written before it had the column); one without it counts every row, as before."""
    from blockagg.verifier.audit_sources import ClickHouseAuditReader

    query = ClickHouseAuditReader.counts_query([A, B], DLT, frozenset({A, DLT}))
    part_a, part_b, part_dlt = query.split(" UNION ALL ")
    assert "`_incarnation` IN (%(incarnation)s, 0)" in part_a
    assert "incarnation" not in part_b
    assert "`incarnation` IN (%(incarnation)s, 0)" in part_dlt
    assert "incarnation" not in ClickHouseAuditReader.counts_query([A, B], DLT)
