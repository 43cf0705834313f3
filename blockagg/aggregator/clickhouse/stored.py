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
is the one a second metadata group delivering the same topic raises; this module is
kept small so both checks can share it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from blockagg.aggregator.clickhouse.structure import (
    DEAD_LETTER_COORDINATES,
    TABLE_COORDINATES,
    Coordinates,
    Query,
)

ALLOW_SETTING: Final = "clickhouse.allow_stored_coordinates"
"""The explicit opt-out of the refusal (``aggregator.config.ClickHouseConfig``)."""


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
