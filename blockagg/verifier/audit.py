"""``arv audit``: a row-level proof that ClickHouse holds every delivered message once.

For tables with the Kafka-coordinate columns ``_topic``, ``_partition``, ``_offset``
(filled by the block writer), one topic-partition is audited by merging two streams in
offset order, so memory stays bounded whatever the size of the tables:

* ClickHouse's per-offset row counts, aggregated by the server
  (``SELECT _offset, count() ... GROUP BY _offset ORDER BY _offset`` over every audited
  table and the dead-letter table at once, streamed in blocks);
* the partition's messages read from Kafka, of which only the envelope's table name and
  row count are kept (:func:`proto.envelope.parse_envelope`, the job's own
  classification; rows are never decoded).

Zones of one partition (``docs/metadata.md``): offsets in ``[from, resume)`` are
**delivered**: each message for an audited table with ``k`` rows must have exactly ``k``
rows with its offset in that table and none in the dead-letter table, or none in the
table and exactly one dead letter; a message whose envelope is rejected must have exactly
one dead letter. Offsets in ``[resume, upper)`` are **in flight**: the committed metadata
lists blocks there that may or may not have been inserted yet, so they are checked for
duplicates only. ``upper`` is the highest offset the committed metadata accounts for
(its resume offset and the end of each listed block, read before and after the
ClickHouse snapshot, so a running job's new inserts are covered). Every row at an offset
with no message of its table (a hole, another table's message, ``>= upper``) is
**unexpected**.

The two readers are protocols (:class:`KafkaSide`, :class:`ClickHouseSide`); the real
ones live in :mod:`verifier.audit_sources`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, TextIO

from blockagg.aggregator.core.exceptions import MetadataDecodeError
from blockagg.aggregator.core.metadata import decode
from blockagg.verifier.exceptions import AuditError

DEFAULT_EXAMPLES: Final = 5
_COORDINATES: Final = ("_topic", "_partition", "_offset")


@dataclass(frozen=True, slots=True)
class Message:
    """One Kafka message as the audit sees it: ``table`` is None for a rejected envelope."""

    offset: int
    table: str | None
    rows: int


@dataclass(frozen=True, slots=True)
class Committed:
    """The group's committed offset of one partition and the metadata string with it."""

    offset: int
    metadata: str = ""

    def accounts_up_to(self) -> int:
        """The end of what this commit accounts for: its offset, or past the last offset
        of a listed block (blocks of an intent may be inserted already)."""
        try:
            metadata = decode(self.metadata)
        except MetadataDecodeError:
            return self.offset
        return max([self.offset, *(b.last + 1 for b in metadata.blocks)])


class KafkaSide(Protocol):
    """What the audit reads from Kafka."""

    def group_topics(self) -> list[str]:
        """Topics the group has committed offsets for."""
        ...

    def partitions(self, topic: str) -> list[int]: ...

    def watermarks(self, topic: str, partition: int) -> tuple[int, int]:
        """``(low, high)``: the first offset retention kept and the next offset."""
        ...

    def committed(self, topic: str, partitions: list[int]) -> dict[int, Committed]:
        """The group's commits; partitions without one are left out."""
        ...

    def messages(self, topic: str, partition: int, start: int, end: int) -> Iterator[Message]:
        """The partition's messages with offsets in ``[start, end)``, in offset order."""
        ...

    def incarnation(self, topic: str) -> int | None:
        """The topic's current incarnation, ``None`` when unknown."""
        ...


class ClickHouseSide(Protocol):
    """What the audit reads from ClickHouse."""

    def coordinate_tables(self, databases: list[str]) -> list[str]:
        """``database.table`` names of tables with the three coordinate columns."""
        ...

    def missing_coordinates(self, table: str) -> list[str]:
        """The coordinate columns ``table`` lacks (all three if it does not exist)."""
        ...

    def table_exists(self, table: str) -> bool: ...

    def counts(self, tables: list[str], dead_letter_table: str | None, topic: str,
               partition: int, start: int, incarnation: int | None = None
               ) -> Iterator[tuple[int, str, int]]:
        """``(offset, table, rows)`` for offsets ``>= start`` of the partition, ordered by
        offset; the dead-letter table's entries come with its own name. With
        ``incarnation``, a table with the incarnation column counts only rows of that
        topic incarnation (or of none recorded)."""
        ...


@dataclass
class Examples:
    """A count of offsets and the first few of them."""

    limit: int
    count: int = 0
    rows: int = 0
    offsets: list[int] = field(default_factory=list)

    def add(self, offset: int, rows: int = 0) -> None:
        self.count += 1
        self.rows += rows
        if len(self.offsets) < self.limit:
            self.offsets.append(offset)


@dataclass
class TableAudit:
    """The findings for one topic/partition/table."""

    topic: str
    partition: int
    table: str
    from_offset: int
    resume: int
    upper: int
    examples: int = DEFAULT_EXAMPLES
    dead_letter_table: bool = False
    messages: int = 0
    expected_rows: int = 0
    found_rows: int = 0
    dead_letters: int = 0
    in_flight_messages: int = 0
    in_flight_rows: int = 0
    duplicated: Examples = field(init=False)
    missing: Examples = field(init=False)
    unexpected: Examples = field(init=False)

    def __post_init__(self) -> None:
        self.duplicated = Examples(self.examples)
        self.missing = Examples(self.examples)
        self.unexpected = Examples(self.examples)

    @property
    def discrepancies(self) -> int:
        return self.duplicated.count + self.missing.count + self.unexpected.count

    @property
    def empty(self) -> bool:
        return not (self.messages or self.found_rows or self.dead_letters
                    or self.in_flight_messages or self.in_flight_rows or self.discrepancies)

    def as_dict(self) -> dict[str, Any]:
        return {
            "topic": self.topic, "partition": self.partition, "table": self.table,
            "dead_letter_table": self.dead_letter_table,
            "from_offset": self.from_offset, "resume": self.resume, "upper": self.upper,
            "messages": self.messages, "expected_rows": self.expected_rows,
            "found_rows": self.found_rows, "dead_letters": self.dead_letters,
            "in_flight_messages": self.in_flight_messages,
            "in_flight_rows": self.in_flight_rows,
            "duplicated": {"count": self.duplicated.count, "offsets": self.duplicated.offsets},
            "missing": {"count": self.missing.count, "offsets": self.missing.offsets},
            "unexpected": {"count": self.unexpected.count, "rows": self.unexpected.rows,
                           "offsets": self.unexpected.offsets},
            "clean": not self.discrepancies,
        }


@dataclass
class PartitionAudit:
    """One topic-partition's audit: a streaming merge of messages and row counts."""

    topic: str
    partition: int
    from_offset: int
    resume: int
    upper: int
    audited: frozenset[str]
    dead_letter_table: str | None
    examples: int = DEFAULT_EXAMPLES
    tables: dict[str, TableAudit] = field(default_factory=dict)
    messages_read: int = 0
    unaudited_messages: int = 0
    count_rows_read: int = 0
    notes: list[str] = field(default_factory=list)

    def table(self, name: str) -> TableAudit:
        audit = self.tables.get(name)
        if audit is None:
            audit = self.tables[name] = TableAudit(
                self.topic, self.partition, name, self.from_offset, self.resume, self.upper,
                self.examples, dead_letter_table=name == self.dead_letter_table)
        return audit

    def run(self, messages: Iterable[Message], counts: Iterable[tuple[int, str, int]]) -> None:
        """Merge both streams (each in offset order) and account every offset."""
        groups = self._grouped(counts)
        group = next(groups, None)
        last = -1
        for message in messages:
            if message.offset <= last:
                raise AuditError(f"{self.topic}[{self.partition}]: Kafka returned offset "
                                 f"{message.offset} after {last}")
            last = message.offset
            self.messages_read += 1
            while group is not None and group[0] < message.offset:
                self._stray(*group)
                group = next(groups, None)
            found: dict[str, int] = {}
            if group is not None and group[0] == message.offset:
                found = group[1]
                group = next(groups, None)
            self._account(message, found)
        while group is not None:
            self._stray(*group)
            group = next(groups, None)

    def _grouped(self, counts: Iterable[tuple[int, str, int]]
                 ) -> Iterator[tuple[int, dict[str, int]]]:
        current = -1
        found: dict[str, int] = {}
        for offset, table, rows in counts:
            self.count_rows_read += 1
            if offset != current:
                if offset < current:
                    raise AuditError(f"{self.topic}[{self.partition}]: ClickHouse returned "
                                     f"offset {offset} after {current} (not in offset order)")
                if found:
                    yield current, found
                current, found = offset, {}
            found[table] = found.get(table, 0) + rows
        if found:
            yield current, found

    def _stray(self, offset: int, found: dict[str, int]) -> None:
        """Rows at an offset with no message: a hole, or beyond what was delivered."""
        for table, rows in found.items():
            self.table(table).unexpected.add(offset, rows)

    def _account(self, message: Message, found: dict[str, int]) -> None:
        offset, k = message.offset, message.rows
        delivered = offset < self.resume
        dlt = self.dead_letter_table
        dead = found.pop(dlt, 0) if dlt is not None else 0
        if message.table is not None and message.table in self.audited:
            audit = self.table(message.table)
            n = found.pop(message.table, 0)
            dead_lettered = n == 0 and dead > 0
            if delivered:
                audit.messages += 1
                audit.found_rows += n
                if dead_lettered:
                    audit.dead_letters += 1
                else:
                    audit.expected_rows += k
            else:
                audit.in_flight_messages += 1
                audit.in_flight_rows += n
            if n > k or dead > 1 or (n > 0 and dead > 0):
                audit.duplicated.add(offset)
            elif (delivered and n < k and not dead_lettered) or 0 < n < k:
                audit.missing.add(offset)
            if dead_lettered and dlt is not None:
                self._dead_letter(dlt, delivered, dead, counted=True)
        elif message.table is None and dlt is not None:
            dl = self._dead_letter(dlt, delivered, dead, counted=False)
            if delivered:
                dl.messages += 1
                dl.expected_rows += 1
            if dead > 1:
                dl.duplicated.add(offset)
            elif delivered and dead == 0:
                dl.missing.add(offset)
        else:
            self.unaudited_messages += 1
            if dlt is not None and dead:
                dl = self._dead_letter(dlt, delivered, dead, counted=True)
                if dead > 1:
                    dl.duplicated.add(offset)
        for table, rows in found.items():
            self.table(table).unexpected.add(offset, rows)

    def _dead_letter(self, dlt: str, delivered: bool, dead: int, counted: bool) -> TableAudit:
        dl = self.table(dlt)
        if delivered:
            dl.found_rows += dead
            if counted:
                dl.dead_letters += 1
                dl.expected_rows += 1
        else:
            dl.in_flight_rows += dead
        return dl


@dataclass
class AuditPlan:
    """What to audit, resolved from the options against both systems."""

    topics: list[str]
    tables: list[str]
    dead_letter_table: str | None
    from_offsets: dict[tuple[str | None, int], int]
    examples: int = DEFAULT_EXAMPLES


@dataclass
class AuditSummary:
    partitions: int = 0
    messages_read: int = 0
    count_rows_read: int = 0
    unaudited_messages: int = 0
    lines: int = 0
    discrepancies: int = 0


def make_plan(kafka: KafkaSide, clickhouse: ClickHouseSide, topics: list[str],
              tables: list[str], databases: list[str], dead_letter_table: str | None,
              from_offsets: dict[tuple[str | None, int], int], examples: int,
              warnings: list[str]) -> AuditPlan:
    """Resolve the options: the topics (default: those the group committed), the tables
    (default: every table with coordinate columns), the dead-letter table if it exists."""
    if not topics:
        topics = kafka.group_topics()
        if not topics:
            raise AuditError("the group has no committed offset for any topic: nothing was "
                             "delivered, or the group name is wrong; check --group or "
                             "name the topics with --topic")
    if tables:
        for table in tables:
            missing = clickhouse.missing_coordinates(table)
            if len(missing) == len(_COORDINATES) and not clickhouse.table_exists(table):
                raise AuditError(f"table {table} does not exist; check --table")
            if missing:
                raise AuditError(
                    f"table {table} has no {', '.join(missing)} column(s), so its rows can't "
                    "be matched with Kafka offsets; add _topic String, _partition UInt32, "
                    "_offset UInt64 (the writer fills them) or leave it out of --table")
    else:
        tables = [t for t in clickhouse.coordinate_tables(databases) if t != dead_letter_table]
        if not tables:
            where = f"databases {', '.join(databases)}" if databases else "any database"
            warnings.append(f"no table in {where} has the columns _topic, _partition, "
                            "_offset: only dead letters are audited")
    if dead_letter_table is not None and not clickhouse.table_exists(dead_letter_table):
        warnings.append(f"dead-letter table {dead_letter_table} does not exist: dead letters "
                        "are not audited (pass --dead-letter-table if it has another name)")
        dead_letter_table = None
    if not tables and dead_letter_table is None:
        raise AuditError("nothing to audit: no table with Kafka-coordinate columns and no "
                         "dead-letter table; check --database / --table")
    unknown = sorted({t for t, _ in from_offsets if t is not None} - set(topics))
    if unknown:
        raise AuditError(f"--from-offset names topics not audited: {', '.join(unknown)}")
    return AuditPlan(sorted(topics), sorted(tables), dead_letter_table, from_offsets,
                     examples)


def from_offset_of(plan: AuditPlan, topic: str, partition: int) -> int | None:
    value = plan.from_offsets.get((topic, partition))
    return plan.from_offsets.get((None, partition)) if value is None else value


def audit_partitions(kafka: KafkaSide, clickhouse: ClickHouseSide, plan: AuditPlan
                     ) -> Iterator[PartitionAudit]:
    """Audit every partition of the plan's topics, one at a time."""
    audited = frozenset(plan.tables)
    for topic in plan.topics:
        partitions = kafka.partitions(topic)
        incarnation = kafka.incarnation(topic)
        before = kafka.committed(topic, partitions)
        for partition in partitions:
            low, high = kafka.watermarks(topic, partition)
            lower = from_offset_of(plan, topic, partition)
            if lower is None:
                lower = low
            elif lower < low:
                raise AuditError(
                    f"{topic}[{partition}]: --from-offset {lower} is below the partition's "
                    f"first offset {low} (retention removed the messages in between); "
                    f"use --from-offset {topic}:{partition}={low} or higher")
            first = before.get(partition)
            resume = max(lower, first.offset) if first is not None else lower
            counts = iter(clickhouse.counts(plan.tables, plan.dead_letter_table, topic,
                                            partition, lower, incarnation))
            # The first block fixes ClickHouse's snapshot; a commit read after it accounts
            # for every block inserted before it (intent before flush).
            head = next(counts, None)
            after = kafka.committed(topic, [partition]).get(partition)
            upper = max([resume, *(c.accounts_up_to() for c in (first, after) if c)])
            audit = PartitionAudit(topic, partition, lower, resume, upper, audited,
                                   plan.dead_letter_table, plan.examples)
            if lower == low and low > 0 and from_offset_of(plan, topic, partition) is None:
                audit.notes.append(f"{topic}[{partition}]: offsets below {low} were removed "
                                   "by retention; rows with those offsets are not audited")
            if first is None:
                audit.notes.append(f"{topic}[{partition}]: the group has no committed offset: "
                                   "nothing counts as delivered")
            elif first.offset > high:
                audit.notes.append(
                    f"{topic}[{partition}]: the committed offset {first.offset} is past the "
                    f"partition's end {high}: offsets [{high}, {first.offset}) claimed "
                    "delivered do not exist (see arv verify's past_end)")
            stream = counts if head is None else _chain(head, counts)
            audit.run(kafka.messages(topic, partition, lower, min(upper, high)), stream)
            yield audit


def _chain(head: tuple[int, str, int], rest: Iterator[tuple[int, str, int]]
           ) -> Iterator[tuple[int, str, int]]:
    yield head
    yield from rest


class AuditReport:
    """Writes one line per topic/partition/table, as a table (default) or JSON lines."""

    COLUMNS: Final = ("PARTITION", "TABLE", "FROM", "RESUME", "MESSAGES", "EXPECTED ROWS",
                      "FOUND ROWS", "DEAD LETTERS", "IN FLIGHT", "DUPLICATED", "MISSING",
                      "UNEXPECTED")

    def __init__(self, out: TextIO, as_json: bool) -> None:
        self.out = out
        self.as_json = as_json
        self.summary = AuditSummary()
        self._header_written = False

    def add(self, audit: PartitionAudit) -> None:
        s = self.summary
        s.partitions += 1
        s.messages_read += audit.messages_read
        s.count_rows_read += audit.count_rows_read
        s.unaudited_messages += audit.unaudited_messages
        for name in sorted(audit.tables):
            line = audit.tables[name]
            if line.empty:
                continue
            s.lines += 1
            s.discrepancies += line.discrepancies
            self._write(line)
        self.out.flush()

    def _write(self, line: TableAudit) -> None:
        if self.as_json:
            self.out.write(json.dumps(line.as_dict(), sort_keys=True) + "\n")
            return
        if not self._header_written:
            self.out.write("\t".join(self.COLUMNS) + "\n")
            self._header_written = True
        row = (
            f"{line.topic}[{line.partition}]",
            line.table + (" (dead letters)" if line.dead_letter_table else ""),
            str(line.from_offset), str(line.resume), str(line.messages),
            str(line.expected_rows), str(line.found_rows), str(line.dead_letters),
            f"{line.in_flight_messages}/{line.in_flight_rows}",
            _examples(line.duplicated), _examples(line.missing), _examples(line.unexpected),
        )
        self.out.write("\t".join(row) + "\n")


def _examples(found: Examples) -> str:
    if not found.count:
        return "0"
    shown = ",".join(str(o) for o in found.offsets)
    more = ",..." if found.count > len(found.offsets) else ""
    return f"{found.count} ({shown}{more})"
