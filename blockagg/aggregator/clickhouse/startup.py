"""Start-up checks of ClickHouse: each replica answers, accepts the user, and holds the
dead-letter table with the expected columns.

Each check is one query, not retried: a check that fails tells the operator what to
change (host:port, the user, the table) in one line, with the server's message but
never its C++ stack trace, and the job refuses to start before anything is written.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from blockagg.aggregator.clickhouse.exceptions import (
    ClickHouseAuthFailed,
    ClickHouseError,
    ClickHouseTlsFailed,
    ClickHouseUnreachable,
    DeadLetterTableInvalid,
)

AUTH_CODES: Final = frozenset({192, 193, 194, 516})  # UNKNOWN_USER, WRONG_PASSWORD,
# REQUIRED_PASSWORD, AUTHENTICATION_FAILED (20.x+)
DEAD_LETTER_TYPES: Final = {
    "table": "String", "topic": "String", "partition": "UInt32", "offset": "UInt64",
    "error": "String", "raw": "String", "time": "DateTime",
}


def server_message(exc: BaseException) -> str:
    """The server's message without ``Stack trace:`` and what follows, on one line."""
    text = str(getattr(exc, "message", None) or exc)
    text = re.split(r"\.?\s*Stack trace", text, maxsplit=1)[0]
    return " ".join(text.split())


def _plain_type(type_name: str) -> str:
    match = re.fullmatch(r"LowCardinality\((.*)\)", type_name)
    return match.group(1) if match else type_name


def dead_letter_problems(columns: Mapping[str, str]) -> list[str]:
    """What is wrong with a dead-letter table of these columns (name -> type)."""
    problems: list[str] = []
    for name, expected in DEAD_LETTER_TYPES.items():
        found = columns.get(name)
        if found is None:
            problems.append(f"no column {name} {expected}")
        elif _plain_type(found) != expected:
            problems.append(f"column {name} is {found}, expected {expected}")
    return problems


@dataclass(frozen=True)
class Fixes:
    """Where the user changes the address and the credentials (the job's TOML, or a
    command's flags)."""

    address: str = "the replica's host:port in [[topics]] replicas"
    auth: str = "[clickhouse] user / password (or password_env)"
    tls: str = ("[clickhouse] ca_certs (the CA that signed the server's certificate), "
                "verify, or secure (TLS on the secure port, 9440 by default; plain on 9000)")


_TLS_FAILURE = re.compile(r"\bSSL\b|CERTIFICATE|certificate verify", re.IGNORECASE)


class ReplicaCheck:
    """The checks of one replica through a ``clickhouse_driver.Client``-like object
    made by ``connect()`` (real client in production)."""

    def __init__(self, host: str, port: int, user: str, connect: Callable[[], Any],
                 fixes: Fixes | None = None) -> None:
        self.where = f"{host}:{port}"
        self.user = user
        self.fixes = fixes or Fixes()
        self._connect = connect
        self._client: Any = None

    def query(self, sql: str, params: Any = None) -> Any:
        from clickhouse_driver.errors import Error as DriverError
        from clickhouse_driver.errors import NetworkError, ServerException, SocketTimeoutError

        try:
            if self._client is None:
                self._client = self._connect()
            return self._client.execute(sql, params)
        except ServerException as exc:
            if exc.code in AUTH_CODES:
                raise ClickHouseAuthFailed(
                    f"ClickHouse at {self.where} refused user {self.user!r} (code {exc.code}: "
                    f"{server_message(exc)}). Fix {self.fixes.auth}") from None
            raise ClickHouseError(
                f"ClickHouse at {self.where}: {sql.split()[0]} failed (code {exc.code}: "
                f"{server_message(exc)})") from None
        except (NetworkError, SocketTimeoutError, OSError, EOFError) as exc:
            if _TLS_FAILURE.search(server_message(exc)):
                raise ClickHouseTlsFailed(
                    f"TLS with ClickHouse at {self.where} failed ({server_message(exc)}): "
                    f"fix {self.fixes.tls}") from None
            raise ClickHouseUnreachable(
                f"ClickHouse unreachable at {self.where} ({server_message(exc)}): start "
                f"the server or fix {self.fixes.address}") from None
        except DriverError as exc:
            raise ClickHouseError(f"ClickHouse at {self.where}: {server_message(exc)}") from None

    def version(self) -> str:
        return str(self.query("SELECT version()")[0][0])

    def check_dead_letter_table(self, table: str) -> None:
        database, _, name = table.partition(".")
        rows = self.query(
            "SELECT name, type FROM system.columns WHERE database = %(db)s AND table = %(t)s",
            {"db": database, "t": name})
        if not rows:
            raise DeadLetterTableInvalid(
                f"dead-letter table {table} does not exist on {self.where}: create it on "
                "every replica with the CREATE TABLE of docs/schemas.md (or set "
                "[dead_letters] table)")
        problems = dead_letter_problems({str(n): str(t) for n, t in rows})
        if problems:
            raise DeadLetterTableInvalid(
                f"dead-letter table {table} on {self.where} does not have the expected "
                f"columns: {'; '.join(problems)}. Recreate it from the CREATE TABLE in "
                "docs/schemas.md")

    def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):  # closing a failed connection
                self._client.disconnect()
            self._client = None


def driver_check(host: str, port: int, user: str, password: str,
                 timeout: float, fixes: Fixes | None = None,
                 tls: Mapping[str, Any] | None = None) -> ReplicaCheck:
    """A :class:`ReplicaCheck` over a real clickhouse-driver connection (with the
    job's TLS arguments, so the check connects as the job will)."""
    from clickhouse_driver import Client

    def connect() -> Any:
        return Client(host, port=port, user=user, password=password,
                      connect_timeout=timeout, send_receive_timeout=timeout,
                      sync_request_timeout=timeout, **(tls or {}))

    return ReplicaCheck(host, port, user, connect, fixes)


def check_replicas(replicas: Iterable[ReplicaCheck], dead_letter_table: str | None) -> None:
    """Each replica answers and accepts the user; the dead-letter table is right on
    each (every replica inserts: the one in use may change at any retry)."""
    for replica in replicas:
        try:
            replica.version()
            if dead_letter_table is not None:
                replica.check_dead_letter_table(dead_letter_table)
        finally:
            replica.close()
