"""Why an insert failed, in one line: quorum and ALTER diagnosis of the server's
answers, and each replica's view of the table to name the one that does not catch up.

Split from :mod:`aggregator.clickhouse.writer` (issue 29): pure functions of the
server's code and message, and :func:`replica_states`, which reads the replicas through
the writer's connections.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeVar

QUORUM_CODES: Final = frozenset({
    285,  # TOO_FEW_LIVE_REPLICAS
    286,  # UNSATISFIED_QUORUM_FOR_PREVIOUS_WRITE
})
"""Codes that say ``insert_quorum`` can't be reached (and 159, TIMEOUT_EXCEEDED, or 319,
UNKNOWN_STATUS_OF_INSERT, when its message is about the quorum: 18.16 answers 319
"Timeout while waiting for quorum" when the part is stored but the quorum wait timed
out): retried, and once every attempt failed so, the error names the replica that does
not catch up (:func:`quorum_error`)."""


class Address(Protocol):
    """A replica as the diagnosis names it (the writer's ``Replica``)."""

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...


R = TypeVar("R", bound=Address)


def is_quorum_failure(code: int | None, message: str) -> bool:
    """Whether a refused insert says the quorum could not be reached."""
    return code in QUORUM_CODES or (code in (159, 319) and "quorum" in message.lower())


def is_quorum_pending(code: int | None, message: str) -> bool:
    """Whether a refused insert says another insert's quorum on the same table is still
    pending (18.16 takes one quorum insert per table at a time, checked in ZooKeeper
    before anything is written): nothing of this attempt was stored, and every replica
    would answer the same until that quorum is reached."""
    return code == 286 and "previous write" in message


def retry_level(attempt: int, attempts: int, code: int | None, message: str, *,
                waited: bool = False) -> int:
    """How loud a failed attempt that is retried is: INFO while it is what a healthy
    cluster does now and then (a first failure, or another insert's quorum still
    pending: 18.16 takes one quorum insert per table at a time, so partitions writing
    one table queue behind each other), WARNING once it persists and at the last
    attempt. ``waited``: the writer already waited the quorum queue's whole budget on
    this insert (``WriterConfig.quorum_pending_wait_s``), so a quorum still pending is a
    replica not catching up, not a queue: WARNING from then on. Pure."""
    pending = is_quorum_pending(code, message)
    if pending and waited:
        return logging.WARNING
    return logging.INFO if attempt == 1 or (pending and attempt < attempts) else logging.WARNING


def is_alter_pending(code: int | None, message: str) -> bool:
    """Whether a refused insert says the replica has not applied an ALTER of the table's
    columns yet (18.16: ``Bad version`` of ``.../columns`` while committing the part)."""
    return code == 244 and "Bad version" in message and "/columns" in message


def alter_error(table: str, code: int | None, message: str, attempts: int) -> str:
    """One line for a block refused on every attempt because an ALTER of ``table`` was
    not applied yet: what it means and what to do. Pure."""
    first = " ".join(message.split("Stack trace:")[0].split())[:300]
    return (f"insert into {table} failed after {attempts} attempt(s): the replicas have not "
            f"applied an ALTER of the table's columns yet (code {code}: {first}); the part "
            "was not committed. A replicated ALTER is normally applied within seconds: if "
            f"this persists, check SELECT * FROM system.replication_queue WHERE table = "
            f"'{table.split('.', 1)[-1]}' on each replica; on ClickHouse 18.16 a replica "
            f"whose ALTER stalled needs DETACH TABLE {table} then ATTACH TABLE {table} "
            "(docs/running.md, *When a replica does not catch up*). The batch is safe to "
            "run again: the retry sends the identical block")


def replicas_with_part(message: str) -> tuple[str, ...]:
    """The replicas a quorum status lists as having the previous part (18.16's code
    286 message ends ``replicas:`` then one name per line)."""
    m = re.search(r"\breplicas:\s*((?:[\w.-]+\s*)+?)(?:\.\s*Stack trace|$)", message)
    return tuple(m.group(1).split()) if m else ()


@dataclass(frozen=True)
class ReplicaState:
    """One replica's view of a table (``system.replicas``, ``system.replication_queue``),
    or why it gave none."""

    address: str
    name: str = ""
    readonly: bool = False
    session_expired: bool = False
    queue_size: int = 0
    delay_s: int = 0
    stuck: str = ""
    """The queue entry tried most often with an exception: type, tries, exception."""
    error: str = ""


STALLED_ALTER_CODE: Final = 341
"""18.16's "Alter is not finished because timeout when waiting for some replicas" /
"Metadata on replica is not up to date": a replica whose replication stopped after a
replicated ALTER (ClickHouse issue #3891); DETACH + ATTACH TABLE restarts it."""


def quorum_error(table: str, quorum: int, code: int | None, message: str, attempts: int,
                 states: Sequence[ReplicaState]) -> str:
    """One line for a block whose quorum was never reached: which replica lags and
    why, and what to do. Pure (the states are read by the writer)."""
    have = replicas_with_part(message)
    parts = []
    for st in states:
        if st.error:
            parts.append(f"replica at {st.address} did not answer ({st.error})")
            continue
        flags = [f for f, on in (("read-only", st.readonly),
                                 ("ZooKeeper session expired", st.session_expired)) if on]
        lag = "has the previous part" if st.name in have else "lags"
        parts.append(f"replica {st.name or '?'} at {st.address} {lag}: queue {st.queue_size}, "
                     f"delay {st.delay_s} s" + "".join(f", {f}" for f in flags)
                     + (f"; stuck on {st.stuck}" if st.stuck else ""))
    lagging = [st.name or st.address for st in states
               if st.error or (have and st.name not in have) or st.readonly
               or st.session_expired or st.stuck]
    alter = any(f"Code: {STALLED_ALTER_CODE}" in st.stuck or "ALTER" in st.stuck.upper()
                for st in states)
    first = " ".join(message.split("Stack trace:")[0].split())[:300]
    text = (f"insert into {table} failed after {attempts} attempt(s): insert_quorum = "
            f"{quorum} was not reached (code {code}: {first}); "
            + ("; ".join(parts) or "the replicas' state is unknown")
            + f". The replica that does not catch up: {', '.join(lagging) or 'unknown'}. "
            "Remedy: bring it back (up, reachable, ZooKeeper reachable); its "
            f"system.replication_queue for {table} says what it is stuck on")
    if alter:
        text += (f"; it is ClickHouse 18.16's stalled replicated ALTER (code "
                 f"{STALLED_ALTER_CODE}): run DETACH TABLE {table} then ATTACH TABLE "
                 f"{table} on that replica (docs/running.md, *When a replica does not catch "
                 "up*)")
    return (text + ". The batch is safe to run again once it has caught up; lowering "
            "insert_quorum instead would acknowledge blocks that the loss of one replica "
            "can take away")


def replica_states(table: str, replicas: Sequence[R], execute_on: Callable[[R, str, Any], Any],
               drop: Callable[[R], None]) -> list[ReplicaState]:
    """Every replica's view of ``table``, one query each (no retry: this explains a
    failure, it must not prolong it); ``execute_on`` runs a query on one replica,
    ``drop`` forgets its connection after a failure."""
    database, name = table.split(".", 1) if "." in table else ("default", table)
    params = {"db": database, "t": name}
    states = []
    for replica in replicas:
        address = f"{replica.host}:{replica.port}"
        try:
            rows = execute_on(
                replica,
                "SELECT replica_name, is_readonly, is_session_expired, queue_size, "
                "absolute_delay FROM system.replicas WHERE database = %(db)s AND "
                "table = %(t)s", params)
            stuck = execute_on(
                replica,
                "SELECT type, num_tries, last_exception FROM system.replication_queue "
                "WHERE database = %(db)s AND table = %(t)s AND last_exception != '' "
                "ORDER BY num_tries DESC LIMIT 1", params)
        except Exception as exc:
            drop(replica)
            states.append(ReplicaState(address, error=f"{type(exc).__name__}: "
                                                      f"{str(exc)[:200]}"))
            continue
        if not rows:
            states.append(ReplicaState(address, error="not a replicated table there"))
            continue
        rname, readonly, expired, queue, delay = rows[0]
        entry = ""
        if stuck:
            kind, tries, exc_text = stuck[0]
            entry = (f"{kind} tried {tries} times: "
                     + " ".join(str(exc_text).split("Stack trace:")[0].split())[:300])
        states.append(ReplicaState(address, str(rname), bool(readonly), bool(expired),
                                   int(queue), int(delay), entry))
    return states
