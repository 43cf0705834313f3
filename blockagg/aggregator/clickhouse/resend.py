"""The re-send check: before a block goes out again where the server alone might not
recognise it (content-hash deduplication after an ``ALTER``, a late first send, a replay
older than the table's deduplication age), count its rows in every replica and send it
only when none is stored (invariant 1), refusing in one line when the rows can't tell.

Split from :mod:`aggregator.clickhouse.writer` (issue 29): the writer owns the
connections and the retries and hands the check a :class:`ResendCheck` built on them;
the refusal texts are pure functions here.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol

from blockagg.aggregator.clickhouse.exceptions import ReplayAcrossAlter, ReplayBeyondDedupAge
from blockagg.aggregator.clickhouse.structure import (
    DEAD_LETTER_COORDINATES,
    TABLE_COORDINATES,
    Coordinates,
    landed_query,
    resend_risk,
)
from blockagg.aggregator.clickhouse.tables import setting_in_create
from blockagg.aggregator.core.metadata import DEAD_LETTER_TABLE_ID
from blockagg.aggregator.core.model import Block
from blockagg.rows.columns import COORDINATE_COLUMNS

log = logging.getLogger(__name__)

DEDUP_AGE_SETTING: Final = "replicated_deduplication_window_seconds"
DEFAULT_DEDUP_AGE_S: Final = 604_800
"""ClickHouse's default ``replicated_deduplication_window_seconds``: 7 days."""


class Executes(Protocol):
    """What the check asks of a connection (the writer's ``Client`` is one)."""

    def execute(self, query: str, params: Any = None) -> Any: ...


class Sent(Protocol):
    """What the check needs of the block's insert (the writer's ``BlockData``)."""

    @property
    def names(self) -> tuple[str, ...]: ...

    @property
    def rows(self) -> int: ...


class Address(Protocol):
    """A replica as the check names it (the writer's ``Replica``)."""

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...


class ResendPolicy(Protocol):
    """The settings the check follows (the writer's ``WriterConfig`` has them)."""

    @property
    def replicas(self) -> Sequence[Address]: ...

    @property
    def insert_quorum(self) -> int: ...

    @property
    def allow_stored_coordinates(self) -> bool: ...

    @property
    def replay_across_alter(self) -> str: ...

    @property
    def expired_replay(self) -> str: ...

    @property
    def earlier_attempt_wait_s(self) -> float: ...


class ResendCheck:
    """The writer's re-send check, on the writer's connections: ``execute_on`` runs a
    query on one replica (no retry: a replica that does not answer is counted as
    unknown), ``drop`` forgets a failed connection, ``query`` runs a read on the first
    replica that answers (with the writer's retries). The clocks and ``sleep`` are
    called through, so a test may replace the writer's."""

    def __init__(self, config: ResendPolicy,
                 execute_on: Callable[[Any, str, Any], Any],
                 drop: Callable[[Any], None],
                 query: Callable[[str], Any],
                 merge_tree_setting: Callable[[str, int], int | None],
                 clock: Callable[[], float], wall_clock: Callable[[], float],
                 sleep: Callable[[float], None]) -> None:
        self._config = config
        self._execute_on = execute_on
        self._drop = drop
        self._query = query
        self._merge_tree_setting = merge_tree_setting
        self._clock = clock
        self._wall_clock = wall_clock
        self._sleep = sleep
        self._dedup_ages: dict[str, int | None] = {}

    def expired(self, table: str, block: Block) -> str | None:
        """Why the server may have forgotten a replay block's first attempt, or
        ``None``: its intent recorded when the block was first sent (``since_s``, at or
        before the real send) and the age passed the table's
        ``replicated_deduplication_window_seconds`` less a margin for clocks
        (:func:`dedup_age_limit`). ClickHouse forgets a block once a block newer by that
        much is stored, so the age measured from now is never short of it."""
        if not block.since_s:
            return None
        window = self._dedup_age(table)
        age = int(self._wall_clock()) - block.since_s
        if window is None or age < dedup_age_limit(window):
            return None
        return (f"its first attempt may be {age} s old, and {table} forgets a stored block "
                f"after replicated_deduplication_window_seconds = {window}")

    def _dedup_age(self, table: str) -> int | None:
        """The table's ``replicated_deduplication_window_seconds`` (``None``: a table
        that does not forget by age), read once per writer."""
        if table not in self._dedup_ages:
            create = str(self._query(f"SHOW CREATE TABLE {table}")[0][0])
            window: int | None = None
            if re.search(r"ENGINE\s*=\s*Replicated", create):
                window = setting_in_create(create, DEDUP_AGE_SETTING)
                if window is None:
                    window = self._merge_tree_setting(DEDUP_AGE_SETTING, DEFAULT_DEDUP_AGE_S)
            self._dedup_ages[table] = window
        return self._dedup_ages[table]

    def already_stored(self, client: Executes, block: Block, table: str, data: Sent,
                        mark: int, attempt: int, late: float = 0.0,
                        expired: str | None = None, incarnation: int = 0) -> bool:
        """Before a block is sent again under content-hash deduplication (or its first
        attempt goes out ``late`` seconds after its confirm), or a replay the server may
        have forgotten (``expired``: why): ``True`` when it is stored already and must
        not be sent; ``False`` when sending it is safe (the table's columns are as they
        were at the intent's ``mark`` and the server still knows the block, or the block
        is in none of the replicas). Raises :class:`ReplayAcrossAlter` (or
        :class:`ReplayBeyondDedupAge`) when only the table's rows could tell and it has
        no coordinate columns, or when the rows at the block's coordinates can't be told
        to be of its topic ``incarnation``.

        Which rows count as the block's: with the incarnation column in the block,
        those of its ``incarnation`` (another incarnation's rows at the same
        coordinates are another topic's); rows of unknown incarnation there (written
        before the table had the column) with none of its own refuse, since the first
        attempt may predate the column. Without it, every row at the coordinates,
        which the partition's start check (``aggregator.clickhouse.stored``) proves
        this incarnation's, unless ``allow_stored_coordinates`` waived that check:
        then any row there refuses."""
        risk = expired or resend_risk(functools.partial(execute, client), table, mark)
        if risk is None:
            return False
        kind = ("replay" if block.replay and attempt == 1 else f"retry, attempt {attempt}"
                if attempt > 1 or block.replay else f"first attempt, {late:.0f} s late")
        where = f"{table} {block.topic}[{block.partition}] [{block.first}, {block.last}]"
        if block.table_id == DEAD_LETTER_TABLE_ID:
            coordinates: Coordinates | None = DEAD_LETTER_COORDINATES
        elif all(c in data.names for c in COORDINATE_COLUMNS):
            coordinates = TABLE_COORDINATES
        else:
            coordinates = None
        if coordinates is None:
            refusal = (expired_replay_error(where, risk, data.rows) if expired
                       else replay_across_alter_error(where, kind, risk, data.rows))
            return self._unsettled_resend(where, kind, risk, refusal, bool(expired))
        running = self._wait_for_earlier_attempt(block_query_id(block), where)
        if running:
            raise Unsettled(f"block {where}: {risk}; an earlier attempt of it is still "
                            f"running on {', '.join(running)}, so its rows can't be "
                            "counted yet")
        marked = coordinates.incarnation in data.names
        params = {"topic": block.topic, "partition": block.partition,
                  "first": block.first, "last": block.last,
                  **({"incarnation": incarnation} if marked else {})}
        sql = landed_query(table, coordinates, marked)
        counts: list[int | None] = []
        unknown: list[int | None] = []
        for replica in self._config.replicas:
            try:
                row = self._execute_on(replica, sql, params)[0]
                counts.append(int(row[0]))
                unknown.append(int(row[-1]))
            except Exception:
                self._drop(replica)
                counts.append(None)
                unknown.append(None)
        full = sum(c is not None and c >= data.rows for c in counts)
        if any(c is not None and c > data.rows for c in counts):
            log.error("block %s (%s): %s, and some replica holds more than its %d rows "
                      "(rows in its range per replica: %s): stored more than once already; "
                      "not sent again. Check with arv audit", where, kind, risk, data.rows,
                      counts)
        if (not marked and self._config.allow_stored_coordinates
                and any(c for c in counts)):
            return self._unsettled_resend(where, kind, risk, unattributable_error(
                where, kind, risk, table, coordinates, counts, "has no "
                f"{coordinates.incarnation} column and clickhouse.allow_stored_coordinates "
                "let the partition start without checking that no other incarnation's "
                "rows are there"), bool(expired))
        if full >= max(1, self._config.insert_quorum):
            log.info("block %s (%s) not sent again: %s, and its %d rows are stored "
                     "(rows in its range per replica: %s)", where, kind, risk, data.rows, counts)
            return True
        if all(c == 0 for c in counts) and marked and any(u for u in unknown):
            return self._unsettled_resend(where, kind, risk, unattributable_error(
                where, kind, risk, table, coordinates, unknown, "holds rows there written "
                f"before it had the {coordinates.incarnation} column (0), which may be this "
                "block's first attempt or an earlier topic incarnation's"))
        if all(c == 0 for c in counts):
            log.info("block %s (%s) sent again: %s, and none of its rows is stored",
                     where, kind, risk)
            return False
        if len(set(counts)) == 1 and None not in counts:
            raise ReplayAcrossAlter(partly_stored_error(where, kind, risk, counts[0] or 0,
                                                        data.rows, coordinates,
                                                        incarnation if marked else None))
        raise Unsettled(f"block {where}: {risk}; its rows in each replica: {counts} of "
                        f"{data.rows} (a replica down or a copy still replicating)")

    def _unsettled_resend(self, where: str, kind: str, risk: str, refusal: str,
                          expired: bool = False) -> bool:
        """A re-send the table's rows can't settle: refused (``ReplayAcrossAlter``, or
        ``ReplayBeyondDedupAge`` for a replay the server may have forgotten; nothing
        sent), or the operator's one-restart choice of ``clickhouse.replay_across_alter``
        (``clickhouse.expired_replay``) (``True``: skip it)."""
        if expired:
            choice, setting = self._config.expired_replay, "expired_replay"
        else:
            choice, setting = self._config.replay_across_alter, "replay_across_alter"
        if choice == "refuse":
            raise (ReplayBeyondDedupAge if expired else ReplayAcrossAlter)(refusal)
        log.warning("block %s (%s) %s although %s: %s = %r", where, kind,
                    "not sent" if choice == "skip" else "sent again", risk, setting, choice)
        return choice == "skip"

    def _wait_for_earlier_attempt(self, query_id: str, where: str) -> list[str]:
        """:meth:`still_running`, polled every second until no replica runs the
        query or ``earlier_attempt_wait_s`` passed; the replicas still running it."""
        began = self._clock()
        next_warning = 0.0
        while True:
            running = self.still_running(query_id)
            waited = self._clock() - began
            if not running or waited >= self._config.earlier_attempt_wait_s:
                return running
            if waited >= next_warning:
                log.warning("block %s: an earlier attempt of it is still running on %s "
                            "(%.0f s); its rows are counted once it ends", where,
                            ", ".join(running), waited)
                next_warning += 30.0
            self._sleep(1.0)

    def still_running(self, query_id: str) -> list[str]:
        """The replicas where an attempt of the block with ``query_id`` is still
        running. Counted before then, its rows would read 0 and the block would be
        sent again; if the earlier attempt then commits (18.16 applies an ``ALTER``
        behind a running insert) both copies would be kept. A replica that does not
        answer is left to the row count, which then reads as unsettled."""
        sql = "SELECT count() FROM system.processes WHERE query_id = %(id)s"
        running = []
        for replica in self._config.replicas:
            try:
                if int(self._execute_on(replica, sql, {"id": query_id})[0][0]):
                    running.append(f"{replica.host}:{replica.port}")
            except Exception:
                self._drop(replica)
        return running


class Unsettled(Exception):
    """A re-sent block's rows are in some replicas but not enough to call it stored,
    or an earlier attempt of it is still running: retried like a connection error,
    until the copies settle or attempts run out."""


def block_query_id(block: Block) -> str:
    """The query id of every attempt of ``block`` (its token: a pure function of the
    block). A replica refuses a second query with the id of one still running (code
    216, retried), so two attempts of one block never run at once on one replica, and
    the re-send check can see an earlier attempt still running on any of them."""
    return block.token


def execute(client: Executes, sql: str, params: Any) -> Any:
    """``sql`` on ``client``, no parameters as ``None`` (what the driver wants)."""
    return client.execute(sql, params or None)


def dedup_age_limit(window_s: int) -> int:
    """The age at which a replay is treated as forgotten by a server that keeps blocks
    ``window_s`` seconds: a tenth earlier, and at least a minute, for clocks that
    disagree between executors and servers."""
    return window_s - max(60, window_s // 10)


def expired_replay_error(where: str, risk: str, rows: int) -> str:
    """The refusal of a replay older than the table's deduplication age, which only the
    table's rows could settle."""
    table = where.split(" ", 1)[0]
    return (f"block {where} ({rows} rows) must be replayed, but {risk}: if its first "
            "attempt landed, the server no longer recognises it and would store it twice, "
            f"and blockagg can't tell whether it did because {table} has no "
            "_topic/_partition/_offset columns. Nothing was sent. Check the block's rows "
            f"(arv audit, or count them in {table}); then restart once with "
            "clickhouse.expired_replay = \"skip\" if they are there or \"insert\" if they "
            "are not, and set it back (docs/running.md, *A replay older than the "
            "deduplication age*).")


def replay_across_alter_error(where: str, kind: str, risk: str, rows: int) -> str:
    """The refusal of a re-send that only the table's rows could settle."""
    table = where.split(" ", 1)[0]
    return (f"block {where} ({rows} rows) must be sent again ({kind}), but {risk}. This "
            "server deduplicates by a hash of the part it writes, which covers every "
            "column the table has now: if the first attempt landed, the block would be "
            f"stored twice, and blockagg can't tell whether it did because {table} has no "
            "_topic/_partition/_offset columns. Nothing was sent. Look for the block's rows "
            f"in {table}; then restart once with clickhouse.replay_across_alter = \"skip\" "
            "if they are there or \"insert\" if they are not, and set it back. Adding the "
            f"coordinate columns (ALTER TABLE {table} ADD COLUMN _topic String, ADD COLUMN "
            "_partition UInt32, ADD COLUMN _offset UInt64) lets blockagg check by itself "
            "from the next block on; on 22.2+ servers the block's token makes this moot.")


def unattributable_error(where: str, kind: str, risk: str, table: str,
                         coordinates: Coordinates, counts: Sequence[int | None],
                         why: str) -> str:
    """The refusal of a re-send whose table holds rows at the block's coordinates that
    may be another topic incarnation's. Pure."""
    return (f"block {where} must be sent again ({kind}), but {risk}, and {table} "
            f"{why}: rows in the block's range per replica {list(counts)}. Counting them as "
            "the block's could lose it, sending it could store it twice. Nothing was sent. "
            f"Look for the block's rows in {table}; then restart once with "
            "clickhouse.replay_across_alter = \"skip\" if they are there or \"insert\" if "
            f"they are not, and set it back; adding {coordinates.incarnation} UInt64 to "
            f"{table} lets blockagg tell incarnations apart from the next batch on.")


def partly_stored_error(where: str, kind: str, risk: str, stored: int, rows: int,
                        coordinates: Coordinates, incarnation: int | None = None) -> str:
    """The refusal of a re-send whose block is in every replica, but only in part: its
    rows span several partitions of the table (one part each) and an earlier attempt
    failed between them."""
    table, topic_partition, span = where.split(" ", 2)
    topic, partition = topic_partition[:-1].split("[")
    first, last = span.strip("[]").split(", ")
    return (f"block {where} must be sent again ({kind}), but {risk}, and every replica "
            f"holds {stored} of its {rows} rows: an earlier attempt stored some of its "
            "partitions' parts and failed before the others. Sending it whole would store "
            f"those {stored} rows twice, sending nothing would lose the rest. Nothing was "
            f"sent. Delete the stored part (ALTER TABLE {table} DELETE WHERE "
            f"{coordinates.topic} = '{topic}' AND {coordinates.partition} = {partition} AND "
            f"{coordinates.offset} BETWEEN {first} AND {last}"
            + ("" if incarnation is None else f" AND {coordinates.incarnation} = {incarnation}")
            + ") and wait for the mutation on "
            "every replica; then restart the job: with none of its rows stored, the block "
            "is sent whole.")
