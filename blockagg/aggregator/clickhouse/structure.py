"""Whether a block can be sent again under content-hash deduplication.

A server without ``insert_deduplication_token`` (before 22.2) recognises a block it
already stored by a hash of the *part* it writes, and that part holds every column
the table has on the receiving replica at that moment, defaults included. An
``ALTER`` that adds, drops or modifies a column between a block's first attempt and
a re-send (a retry, or a replay after a crash) gives the identical rows another
hash, and the server stores them a second time
(``tests/integration/test_replay_across_alter.py``; found by the long fault run,
``docs/RELIABILITY.md``).

The guard has two halves:

* **The mark** (``Pins.structure``), read before any first attempt of a batch: the
  highest ZooKeeper transaction id (zxid) among the ``columns`` nodes of the tables
  the batch may write (the table's shared node and each replica's). zxids only grow,
  so it is at or above each such table's last change then, and below any change
  after it.
* **The re-send check** (:func:`resend_risk`): before a block is sent again, its
  table's ``columns`` nodes are read afresh. All at or below the mark, with every
  replica on the shared columns: nothing changed since the first attempt, so the
  part hashes alike and the server drops the copy. Otherwise the writer asks the
  table whether the block landed, by its Kafka coordinate columns
  (:func:`landed_query`), and refuses when the table has none.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Query = Callable[[str, dict[str, Any]], Any]
"""Runs one read-only query on one replica (no failover: ZooKeeper's view is shared)."""


@dataclass(frozen=True, slots=True)
class ColumnsState:
    """A replicated table's ``columns`` nodes in ZooKeeper, as one replica reads them."""

    zxid: int
    """The highest ``mzxid`` of the shared node and every replica's node."""
    agreed: bool
    """Every replica's columns equal the shared ones (no ``ALTER`` still applying)."""


def zookeeper_paths(query: Query, tables: Sequence[str]) -> dict[str, str]:
    """``table -> zookeeper_path`` for those of ``tables`` that are replicated here."""
    wanted = set(tables)
    rows = query("SELECT database, table, zookeeper_path FROM system.replicas", {})
    return {f"{d}.{t}": str(p) for d, t, p in rows if f"{d}.{t}" in wanted}


def columns_state(query: Query, zookeeper_path: str) -> ColumnsState:
    """Read the table's shared ``columns`` node and each replica's (``2 +
    replicas`` queries of ``system.zookeeper``, which takes one path at a time)."""
    def columns_node(path: str) -> tuple[int, str]:
        rows = query("SELECT mzxid, value FROM system.zookeeper "
                     "WHERE path = %(p)s AND name = 'columns'", {"p": path})
        return (int(rows[0][0]), str(rows[0][1])) if rows else (0, "")

    shared_zxid, shared = columns_node(zookeeper_path)
    names = query("SELECT name FROM system.zookeeper WHERE path = %(p)s",
                  {"p": f"{zookeeper_path}/replicas"})
    zxid, agreed = shared_zxid, True
    for (name,) in names:
        replica_zxid, value = columns_node(f"{zookeeper_path}/replicas/{name}")
        zxid = max(zxid, replica_zxid)
        agreed = agreed and value == shared
    return ColumnsState(zxid, agreed)


def structure_mark(query: Query, tables: Sequence[str]) -> int:
    """The mark a batch pins (``Pins.structure``): the highest zxid among the
    ``columns`` nodes of ``tables`` (those replicated on this shard); 0 when none is."""
    paths = zookeeper_paths(query, tables)
    return max((columns_state(query, p).zxid for p in paths.values()), default=0)


class StructureCache:
    """:func:`structure_mark` for a writer that marks every batch: a table's
    ``columns`` nodes are read again only when its ``columns_version`` moved on some
    replica. A stale entry can only make the mark lower, which makes the re-send
    check look at the table's rows more often, never less."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[tuple[int, ...], int]] = {}

    def mark(self, query: Query, tables: Sequence[str],
             versions: Mapping[str, Sequence[int]]) -> int:
        """The mark over ``tables``, given each table's ``columns_version`` on every
        replica that answered (``system.replicas``)."""
        with self._lock:
            stale = [t for t in tables if t in versions
                     and self._seen.get(t, ((), 0))[0] != tuple(versions[t])]
            if stale:
                paths = zookeeper_paths(query, stale)
                for table, path in paths.items():
                    self._seen[table] = (tuple(versions[table]),
                                         columns_state(query, path).zxid)
            return max((self._seen[t][1] for t in tables if t in self._seen), default=0)


def resend_risk(query: Query, table: str, mark: int) -> str | None:
    """Why sending a block of ``table`` again might store it twice, or ``None`` when
    its columns are as they were at ``mark`` on every replica.

    Not checked (``None``, sent again as before): an intent without a mark (written
    by an older blockagg, or under token deduplication) and a table that is not
    replicated (``non_replicated_deduplication_window``, 21.2 to 22.1: no ZooKeeper
    record of its columns)."""
    if not mark:
        return None
    paths = zookeeper_paths(query, [table])
    if table not in paths:
        return None
    state = columns_state(query, paths[table])
    if not state.agreed:
        return "its replicas do not all have the same columns yet (an ALTER is applying)"
    if state.zxid > mark:
        return (f"its columns changed (ZooKeeper zxid {state.zxid}) after the block's "
                f"intent was written (mark {mark}): an ALTER in between")
    return None


@dataclass(frozen=True, slots=True)
class Coordinates:
    """The column names that hold each row's Kafka topic, partition and offset, and
    the optional one that holds the topic incarnation."""

    topic: str
    partition: str
    offset: str
    incarnation: str


TABLE_COORDINATES = Coordinates("_topic", "_partition", "_offset", "_incarnation")
DEAD_LETTER_COORDINATES = Coordinates("topic", "partition", "offset", "incarnation")


def landed_query(table: str, where: Coordinates, incarnation: bool = False) -> str:
    """How many rows of a block's offset range ``[first, last]`` of one topic-partition
    a replica holds, as two counts: the rows of the block's incarnation
    (``%(incarnation)s``) and the rows of unknown incarnation (``0``: written before
    the table had the column). A block holds every row of its table in that range
    (blocks of one table never overlap), so the first is 0 or the block's row count
    unless a copy is half-replicated.

    Without ``incarnation`` (the block carries no incarnation column) one count, of
    every row in the range: the rows can't be told apart by incarnation, and only the
    partition's start check (``aggregator.clickhouse.stored``) makes them this
    incarnation's."""
    where_sql = (f" FROM {table} WHERE `{where.topic}` = %(topic)s AND "
                 f"`{where.partition}` = %(partition)s AND "
                 f"`{where.offset}` BETWEEN %(first)s AND %(last)s")
    if not incarnation:
        return "SELECT count()" + where_sql
    return (f"SELECT countIf(`{where.incarnation}` = %(incarnation)s), "
            f"countIf(`{where.incarnation}` = 0)" + where_sql)
