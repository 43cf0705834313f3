"""Which offsets of a topic a shard already stores: the highest ``_offset`` per
partition over the tables with Kafka-coordinate columns, and the dead-letter table's
``offset``. The start-up ownership check (``spark.ownership``) refuses a start that
would deliver offsets at or below these again.

Cost: two requests per topic and shard, whatever the number of tables: one
``system.columns`` query finds which of the registered tables have coordinate
columns, one ``UNION ALL`` of ``max(_offset) ... WHERE
_topic = t GROUP BY _partition`` per table answers. Each subquery reads the three
coordinate columns of its table (a column scan; the ``_topic`` filter uses the primary
key when the table is ordered by the coordinates).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from blockagg.proto.envelope import is_table_name

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


def stored_top_query(tables: Sequence[str], dead_letter_table: str | None) -> str:
    parts = [f"SELECT toUInt32(_partition) AS p, max(toUInt64(_offset)) AS o, '{t}' AS t "
             f"FROM {_quote(t)} WHERE _topic = %(topic)s GROUP BY p" for t in tables]
    if dead_letter_table is not None:
        parts.append(f"SELECT toUInt32(`partition`) AS p, max(toUInt64(`offset`)) AS o, "
                     f"'{dead_letter_table}' AS t FROM {_quote(dead_letter_table)} "
                     "WHERE topic = %(topic)s GROUP BY p")
    return " UNION ALL ".join(parts)


def stored_top(client: Any, topic: str, tables: Sequence[str],
               dead_letter_table: str | None) -> dict[int, tuple[int, str]]:
    """The highest stored offset of each partition of ``topic`` over ``tables`` and the
    dead-letter table, with the table that holds it (one request)."""
    if not tables and dead_letter_table is None:
        return {}
    out: dict[int, tuple[int, str]] = {}
    for p, o, t in client.execute(stored_top_query(tables, dead_letter_table),
                                  {"topic": topic}):
        if int(p) not in out or int(o) > out[int(p)][0]:
            out[int(p)] = (int(o), str(t))
    return out


def overlaps(delivers_from: Mapping[int, int], stored: StoredTop) -> dict[int, tuple[int, str]]:
    """The partitions whose stored rows reach ``delivers_from`` (the first offset a
    start would deliver anew): partition -> (highest stored offset, table)."""
    return {p: top for p, top in sorted(stored.items())
            if p in delivers_from and top[0] >= delivers_from[p]}
