"""Rows a table already holds at the Kafka coordinates a partition is about to deliver.

Under content-hash deduplication (servers before 22.2) a block is recognised by its
content, and the re-send check after an ``ALTER`` counts a block's rows by their
coordinates. Both assume that nothing but this job's own blocks of *this* topic
incarnation sits at the coordinates ``(topic, partition, offset >= start)`` it
delivers. A table with an ``_incarnation`` column (``incarnation`` in the dead-letter
table) keeps incarnations apart by itself: the writer fills it, so the content and
the count differ. A table without one can't, and holds another incarnation's rows
there when a topic was deleted and recreated and the job restarted from its earliest
offset (the ``TopicIncarnationChanged`` recovery): a new block equal to an old one
would be dropped by the server, and a re-send after an ALTER would count the old
rows as its own. So a partition that starts without a blockagg commit (none, or one
written by a tool) first asks those tables (:func:`stored_ranges`), and the task
refuses to deliver into one that already holds rows there
(:func:`coordinates_in_use_error`).

Once a partition's first commit of its incarnation is written, every row at its
coordinates from ``start`` on is this job's, of this incarnation: that is what lets
the re-send check count rows in a table without ``_incarnation``.

The same question (does a table hold rows at the coordinates about to be delivered?)
is the one a second metadata group delivering the same topic raises: the start-up
ownership check (``spark.ownership``) asks the highest stored offset per partition
over every coordinate table at once (:func:`stored_top`): two requests per topic and
shard, whatever the number of tables (one ``system.columns`` query, one ``UNION ALL``
of ``max(_offset) ... GROUP BY _partition``; the ``_topic`` filter uses the primary key
when the table is ordered by the coordinates).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from blockagg.aggregator.clickhouse.structure import (
    DEAD_LETTER_COORDINATES,
    TABLE_COORDINATES,
    Coordinates,
    Query,
)
from blockagg.proto.envelope import is_table_name

ALLOW_SETTING: Final = "clickhouse.allow_stored_coordinates"
"""The explicit opt-out of the refusal (``blockagg.config.ClickHouseConfig``)."""


@dataclass(frozen=True, slots=True)
class StoredRange:
    """Rows of one topic-partition a table holds from the start offset on."""

    table: str
    rows: int
    first: int
    last: int


def unmarked_tables(columns: Mapping[str, Collection[str]], dead_letter_table: str
                    ) -> dict[str, Coordinates]:
    """The tables (of ``columns``: table -> its column names) whose rows at a
    topic-partition's coordinates can't be told apart by topic incarnation: those
    with the coordinate columns and without the incarnation column, each with its
    :class:`Coordinates`. A table without coordinate columns is not here: no
    coordinates to ask (``writer.check_tables`` warns about it). Pure."""
    out: dict[str, Coordinates] = {}
    for table, names in columns.items():
        where = DEAD_LETTER_COORDINATES if table == dead_letter_table else TABLE_COORDINATES
        if (all(c in names for c in (where.topic, where.partition, where.offset))
                and where.incarnation not in names):
            out[table] = where
    return out


def stored_query(table: str, where: Coordinates, incarnation: bool = False) -> str:
    """How many rows of a topic-partition ``table`` holds at offsets from
    ``%(start)s`` on, and their lowest and highest offset; ``incarnation`` counts only
    rows of the incarnation ``%(incarnation)s``."""
    return (f"SELECT count(), min(`{where.offset}`), max(`{where.offset}`) FROM {table} "
            f"WHERE `{where.topic}` = %(topic)s AND `{where.partition}` = %(partition)s "
            f"AND `{where.offset}` >= %(start)s"
            + (f" AND `{where.incarnation}` = %(incarnation)s" if incarnation else ""))


def stored_ranges(query: Query, tables: Mapping[str, Coordinates], topic: str,
                  partition: int, start: int, incarnation: int | None = None
                  ) -> list[StoredRange]:
    """The rows each of ``tables`` holds of ``topic[partition]`` at offsets ``start``
    and above (of incarnation ``incarnation`` only, when given); tables holding none
    are left out. One query per table, on one replica (``query``): a replica that
    lags can only miss rows the others have, and the refusal is about any."""
    params: dict[str, object] = {"topic": topic, "partition": partition, "start": start}
    if incarnation is not None:
        params["incarnation"] = incarnation
    found = []
    for table in sorted(tables):
        rows, first, last = query(stored_query(table, tables[table], incarnation is not None),
                                  params)[0]
        if int(rows):
            found.append(StoredRange(table, int(rows), int(first), int(last)))
    return found


def coordinates_in_use_error(topic: str, partition: int, start: int,
                             found: Sequence[StoredRange]) -> str:
    """The refusal of a partition whose delivery would meet rows at its coordinates
    that the job can't tell from its own: one line, naming each table, the stored
    offset range and the ways on. Pure."""
    tables = "; ".join(f"{s.table} holds {s.rows} rows of {topic}[{partition}] at offsets "
                       f"{s.first}-{s.last}" for s in found)
    names = ", ".join(s.table for s in found)
    return (f"{topic}[{partition}]: the partition starts at offset {start} without a "
            f"blockagg commit of this topic incarnation, but {tables}. They are an earlier "
            "incarnation's (the topic was deleted and recreated) or another job's, and "
            "this server deduplicates by content, without insert_deduplication_token: a "
            "new block equal to a stored one would be dropped, and a re-send after an "
            "ALTER would count those rows as its own. Nothing was committed or inserted. "
            f"Add the incarnation column to {names} (ALTER TABLE ... ADD COLUMN "
            "_incarnation UInt64 DEFAULT 0, or incarnation UInt64 DEFAULT 0 in the "
            "dead-letter table), or delete those rows, or insert through ClickHouse "
            f"22.2+ (tokens carry the incarnation); or set {ALLOW_SETTING} = true to "
            "deliver anyway, accepting that such blocks may be lost")


StoredTop = Mapping[int, tuple[int, str]]
"""partition -> (highest stored offset, the table holding it)."""


def _quote(table: str) -> str:
    database, name = table.split(".", 1)
    return f"`{database}`.`{name}`"


def coordinate_tables(client: Any, among: Sequence[str]) -> list[str]:
    """The tables of ``among`` (``db.table``) that have ``_topic``, ``_partition`` and
    ``_offset`` on the server (one request)."""
    wanted = {t for t in among if is_table_name(t)}
    if not wanted:
        return []
    rows = client.execute(
        "SELECT database, table FROM system.columns WHERE database IN %(dbs)s AND name "
        "IN ('_topic', '_partition', '_offset') GROUP BY database, table "
        "HAVING count() = 3 ORDER BY database, table",
        {"dbs": tuple(sorted({t.split(".", 1)[0] for t in wanted}))})
    return [f"{d}.{t}" for d, t in rows if f"{d}.{t}" in wanted]


def incarnation_tables(client: Any, among: Sequence[str], dead_letter_table: str | None
                       ) -> frozenset[str]:
    """The tables of ``among`` (and the dead-letter table) that carry the topic
    incarnation (``_incarnation``; ``incarnation`` in the dead-letter table), one
    request."""
    wanted = {t for t in (*among, *([dead_letter_table] if dead_letter_table else []))
              if is_table_name(t)}
    if not wanted:
        return frozenset()
    rows = client.execute(
        "SELECT database, table, name FROM system.columns WHERE database IN %(dbs)s AND "
        "name IN ('_incarnation', 'incarnation')",
        {"dbs": tuple(sorted({t.split(".", 1)[0] for t in wanted}))})
    return frozenset(
        f"{d}.{t}" for d, t, n in rows if f"{d}.{t}" in wanted
        and n == (DEAD_LETTER_COORDINATES.incarnation if f"{d}.{t}" == dead_letter_table
                  else TABLE_COORDINATES.incarnation))


def stored_top_query(tables: Sequence[str], dead_letter_table: str | None,
                     marked: Collection[str] = ()) -> str:
    """The union of :func:`stored_top`; a table of ``marked`` counts only the rows of
    incarnation ``%(incarnation)s`` and of unknown incarnation (``0``, written before
    the column existed: they may be this cluster's)."""
    def mine(table: str, column: str) -> str:
        return (f" AND `{column}` IN (%(incarnation)s, 0)" if table in marked else "")

    parts = [f"SELECT toUInt32(_partition) AS p, max(toUInt64(_offset)) AS o, '{t}' AS t "
             f"FROM {_quote(t)} WHERE _topic = %(topic)s"
             f"{mine(t, TABLE_COORDINATES.incarnation)} GROUP BY p" for t in tables]
    if dead_letter_table is not None:
        parts.append(f"SELECT toUInt32(`partition`) AS p, max(toUInt64(`offset`)) AS o, "
                     f"'{dead_letter_table}' AS t FROM {_quote(dead_letter_table)} "
                     f"WHERE topic = %(topic)s"
                     f"{mine(dead_letter_table, DEAD_LETTER_COORDINATES.incarnation)} "
                     "GROUP BY p")
    return " UNION ALL ".join(parts)


def stored_top(client: Any, topic: str, tables: Sequence[str],
               dead_letter_table: str | None, incarnation: int | None = None
               ) -> dict[int, tuple[int, str]]:
    """The highest stored offset of each partition of ``topic`` over ``tables`` and the
    dead-letter table, with the table that holds it (one request; two with
    ``incarnation``). With ``incarnation`` (``clickhouse.shared_with_other_kafka_
    clusters``: another Kafka cluster feeds the same tables under the same topic
    name), a table carrying the incarnation counts only rows of this one or of
    unknown incarnation: another cluster's rows are not this topic's."""
    if not tables and dead_letter_table is None:
        return {}
    marked: frozenset[str] = frozenset()
    params: dict[str, Any] = {"topic": topic}
    if incarnation is not None:
        marked = incarnation_tables(client, tables, dead_letter_table)
        params["incarnation"] = incarnation
    out: dict[int, tuple[int, str]] = {}
    for p, o, t in client.execute(stored_top_query(tables, dead_letter_table, marked),
                                  params):
        if int(p) not in out or int(o) > out[int(p)][0]:
            out[int(p)] = (int(o), str(t))
    return out


def overlaps(delivers_from: Mapping[int, int], stored: StoredTop) -> dict[int, tuple[int, str]]:
    """The partitions whose stored rows reach ``delivers_from`` (the first offset a
    start would deliver anew): partition -> (highest stored offset, table)."""
    return {p: top for p, top in sorted(stored.items())
            if p in delivers_from and top[0] >= delivers_from[p]}
