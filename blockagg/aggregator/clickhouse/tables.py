"""What the writer reads of a table's definition and how it judges it: pure functions
of the ``CREATE`` statement and the live columns (split from
:mod:`aggregator.clickhouse.writer`, issue 29)."""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from blockagg.aggregator.clickhouse.exceptions import (
    CoordinatesMissing,
    DedupNotConfigured,
    IncarnationMissing,
    TableNotFound,
)
from blockagg.aggregator.clickhouse.structure import DEAD_LETTER_COORDINATES
from blockagg.rows.columns import COORDINATE_COLUMNS, INCARNATION_COLUMN, Column


@dataclass
class TableInfo:
    """What the writer learned about a table at startup."""

    table: str
    columns: tuple[Column, ...]
    engine: str
    coordinates: bool
    incarnation: bool = False



def setting_in_create(create: str, name: str) -> int | None:
    """The integer ``name = N`` in a ``CREATE TABLE`` statement's SETTINGS, or ``None``
    when the table leaves it at the server's default. Pure."""
    m = re.search(rf"\b{name}\s*=\s*(\d+)", create)
    return int(m.group(1)) if m else None


def table_infos(tables: Sequence[str], columns: Mapping[str, Sequence[Column]],
                engines: Mapping[str, tuple[str, str]], host: str
                ) -> dict[str, tuple[TableInfo, str]]:
    """Each table's :class:`TableInfo` and ``CREATE`` statement from what
    ``system.columns`` (``columns``) and ``system.tables`` (``engines``: engine and
    statement) say of it on ``host``. Raises :class:`TableNotFound` naming the first
    table the server does not have. Pure."""
    found: dict[str, tuple[TableInfo, str]] = {}
    for table in dict.fromkeys(tables):
        if table not in columns:
            raise TableNotFound(f"table {table} does not exist (or has no columns) on "
                                f"{host}")
        cols = tuple(columns[table])
        engine, create = engines.get(table, ("", ""))
        present = {c.name for c in cols}
        found[table] = (TableInfo(table, cols, engine,
                                  all(c in present for c in COORDINATE_COLUMNS),
                                  INCARNATION_COLUMN in present), create)
    return found


def dedup_setting(table: str, engine: str, create: str,
                  server_default: Callable[[str, int], int | None]) -> tuple[str, int | None]:
    """The setting that bounds how many recent blocks ``table`` recognises as retries,
    and its value (from the ``CREATE`` statement, else ``server_default``). Raises
    :class:`DedupNotConfigured` for a table that would not drop a retried block
    (invariant 1): a window of 0, a non-replicated MergeTree without
    ``non_replicated_deduplication_window``, or an engine that does not deduplicate."""
    window = setting_in_create(create, "replicated_deduplication_window")
    setting = "replicated_deduplication_window"
    if engine.startswith("Replicated"):
        if window is None:
            window = server_default("replicated_deduplication_window", 100)
        if window == 0:
            raise DedupNotConfigured(
                f"table {table} has replicated_deduplication_window = 0; set it to "
                "at least 100 (ALTER TABLE ... MODIFY SETTING or the table's "
                "SETTINGS) so retried blocks are deduplicated")
    elif engine.endswith("MergeTree"):
        setting = "non_replicated_deduplication_window"
        window = setting_in_create(create, setting)
        if window is None:
            window = server_default("non_replicated_deduplication_window", 0)
        if not window:
            raise DedupNotConfigured(
                f"table {table} uses {engine}, which does not deduplicate "
                f"inserts; use Replicated{engine} or set "
                "non_replicated_deduplication_window = 1000 in its SETTINGS "
                "(ClickHouse 21.2+)")
    else:
        raise DedupNotConfigured(
            f"table {table} uses engine {engine or '(none)'}, which does not "
            "deduplicate inserts; insert into the shard's ReplicatedMergeTree table "
            "(not a Distributed, Buffer or view)")
    return setting, window


def judge_shared(info: TableInfo, supports_token: bool, server_version: tuple[int, ...],
                 dead_letter_table: str) -> None:
    """A table that other Kafka clusters feed too (``shared_with_other_kafka_clusters``):
    on a server that deduplicates by content hash, refused without the topic
    incarnation column (``UInt64``, filled by the writer), the only part of the
    block that names the cluster (invariant 1: another data centre's block with the
    same rows at the same topic name, partition and offsets hashes alike, and the
    second is dropped as a retry). With ``insert_deduplication_token`` the token
    carries the incarnation (``core.model.block_token``): nothing to check. Pure."""
    if supports_token:
        return
    table = info.table
    dead = table == dead_letter_table
    name = DEAD_LETTER_COORDINATES.incarnation if dead else INCARNATION_COLUMN
    column = next((c for c in info.columns if c.name == name), None)
    if (column is not None and column.type == "UInt64"
            and column.default_kind not in ("MATERIALIZED", "ALIAS")):
        return
    what = (f"has no {name} column" if column is None else
            f"has {name} {column.type} {column.default_kind}".rstrip())
    version = ".".join(map(str, server_version))
    raise IncarnationMissing(
        f"table {table} {what}, but clickhouse.shared_with_other_kafka_clusters = true "
        f"and ClickHouse {version} deduplicates by content hash: another cluster's "
        "block with the same rows at the same coordinates would be dropped as a retry "
        f"and lost. Fix: ALTER TABLE {table} ADD COLUMN {name} UInt64 DEFAULT 0")


def judge_coordinates(info: TableInfo, supports_token: bool, server_version: tuple[int, ...],
                      allow_without_coordinates: Collection[str]) -> str | None:
    """A table without ``_topic``, ``_partition``, ``_offset``: refused on a server
    that deduplicates by content hash (invariant 1: two different blocks with equal
    rows, e.g. the same event sent twice at different offsets, or a recreated topic
    repeating old payloads, hash alike, and the server drops the second as a retry:
    lost), unless ``allow_without_coordinates`` lists it (then a warning). With
    ``insert_deduplication_token`` the token names topic, partition and offsets, so
    equal rows never merge; only ``arv audit`` and the re-send check after an ALTER
    miss the columns there (a warning). Pure."""
    table = info.table
    missing = ", ".join(c for c in COORDINATE_COLUMNS
                        if c not in {col.name for col in info.columns})
    add = "add _topic String, _partition UInt32, _offset UInt64"
    if supports_token:
        return (f"table {table} has no {missing} column(s): arv audit cannot check it "
                "(deduplication is safe here: the server takes "
                f"insert_deduplication_token); {add}")
    version = ".".join(map(str, server_version))
    if table in allow_without_coordinates:
        return (f"table {table} has no {missing} column(s) on ClickHouse {version} "
                "(content-hash deduplication): a new block whose rows equal a recent "
                "block's is dropped as a retry and lost; accepted by "
                f"clickhouse.allow_tables_without_coordinates; {add}")
    raise CoordinatesMissing(
        f"table {table} has no {missing} column(s): ClickHouse {version} deduplicates "
        "by content hash (no insert_deduplication_token), so a new block whose rows "
        "equal a recent block's would be dropped as a retry and its messages lost. "
        f"Fix: ALTER TABLE {table} ADD COLUMN _topic String, ADD COLUMN _partition "
        "UInt32, ADD COLUMN _offset UInt64, or accept the loss "
        f"with clickhouse.allow_tables_without_coordinates = [\"{table}\"]")
