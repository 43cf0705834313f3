"""The ClickHouse :class:`~aggregator.core.model.BlockSink`: one native-protocol,
columnar insert per block, retried identically until acknowledged.

Invariants:

* A block is inserted whole, with its rows in position order, in one ``INSERT``;
  a retry sends the very same rows (and the same ``insert_deduplication_token`` on
  servers that have it, 22.x+), on the same or another replica of the shard. So a
  block the server already has is dropped by block deduplication, and a block is
  never split or reordered.
* ``insert`` returns only once the server acknowledged the insert with the
  configured ``insert_quorum``. Connection errors and retriable server errors
  (:data:`RETRIABLE_CODES`) are retried with exponential backoff; any other error
  stops with the server's code and message (:class:`InsertFailed`).
* :meth:`ClickHouseBlockWriter.check_tables` refuses tables that would not drop a
  retried block, naming the table and the setting to change.

Columnar path: when every column of a block is columnar (see
:func:`blockagg.rows.types.convert_array`: numpy arrays, and String, Enum and
Array columns in Native layout) of a type in :data:`NUMPY_TYPES`, the block goes to
the default client (:class:`~aggregator.clickhouse.native.NativeClient`) as a
:class:`~aggregator.clickhouse.native.NativeBlock`, serialised from those buffers
without a Python object per value, and to another clickhouse-driver client through
its numpy mode; otherwise as Python lists, as before. All send the same bytes for the
same values (``tests/unit/clickhouse/test_native.py``, ``test_columnar.py``), so the
server hashes the block alike whichever path (or writer version) sent it; the choice
is a pure function of the block (its column types and size), the configuration and
the client, so a retry takes the same path with the same columns.

Layout (issue 29): this module is the insert with failover (clients per thread and
replica, ``_with_retries``, ``insert``, ``settings_for``) and the queries the writer's
checks make; the pure parts live beside it: the insert's columns in
:mod:`~aggregator.clickhouse.blockdata`, the re-send check in
:mod:`~aggregator.clickhouse.resend`, quorum and ALTER diagnosis in
:mod:`~aggregator.clickhouse.diagnosis`, table judgments in
:mod:`~aggregator.clickhouse.tables`. Above 500 lines because those queries share one
object's state (the connections, the replica in use, the server version, the windows
read) with the insert.
"""

from __future__ import annotations

import functools
import logging
import random
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from blockagg.aggregator.clickhouse.blockdata import (
    DEFAULT_INSERT_BLOCK_SIZE,
    BlockData,
    BlocksBuiltAhead,
    block_data,
    numpy_inserts_available,
)
from blockagg.aggregator.clickhouse.dedup_window import DedupNeed, DedupWindow, judge_window
from blockagg.aggregator.clickhouse.diagnosis import (
    alter_error,
    is_alter_pending,
    is_quorum_failure,
    is_quorum_pending,
    quorum_error,
    replica_states,
    retry_level,
)
from blockagg.aggregator.clickhouse.exceptions import (
    AlterNotApplied,
    ClickHouseError,
    DedupModeMismatch,
    DedupNotConfigured,
    InsertFailed,
    QuorumUnsatisfied,
)
from blockagg.aggregator.clickhouse.native import (
    native_client_class,
)
from blockagg.aggregator.clickhouse.resend import (
    ResendCheck,
    Unsettled,
    block_query_id,
    execute,
)
from blockagg.aggregator.clickhouse.stored import StoredRange, stored_ranges, unmarked_tables
from blockagg.aggregator.clickhouse.structure import (
    DEAD_LETTER_COORDINATES,
    TABLE_COORDINATES,
    StructureCache,
)
from blockagg.aggregator.clickhouse.tables import (
    TableInfo,
    dedup_setting,
    judge_coordinates,
    judge_shared,
    table_infos,
)
from blockagg.aggregator.core.metadata import DEAD_LETTER_TABLE_ID, DedupMode
from blockagg.aggregator.core.model import Batch, Block
from blockagg.rows.columns import (
    Column,
)

log = logging.getLogger(__name__)

RETRIABLE_CODES: Final = frozenset({
    3,    # UNEXPECTED_END_OF_FILE
    32,   # ATTEMPT_TO_READ_AFTER_EOF
    159,  # TIMEOUT_EXCEEDED
    164,  # READONLY (replica lost its ZooKeeper session)
    202,  # TOO_MANY_SIMULTANEOUS_QUERIES
    203,  # NO_FREE_CONNECTION
    209,  # SOCKET_TIMEOUT
    210,  # NETWORK_ERROR
    216,  # QUERY_WITH_SAME_ID_IS_ALREADY_RUNNING (an earlier attempt of the block, see
          # block_query_id)
    225,  # NO_ZOOKEEPER
    236,  # ABORTED
    241,  # MEMORY_LIMIT_EXCEEDED
    242,  # TABLE_IS_READ_ONLY
    244,  # UNEXPECTED_ZOOKEEPER_ERROR (18.16: "Bad version" of .../columns while an ALTER
          # is being applied: the part was not committed)
    252,  # TOO_MANY_PARTS
    279,  # ALL_CONNECTION_TRIES_FAILED
    285,  # TOO_FEW_LIVE_REPLICAS
    286,  # UNSATISFIED_QUORUM_FOR_PREVIOUS_WRITE
    319,  # UNKNOWN_STATUS_OF_INSERT
    373,  # SESSION_IS_LOCKED
    394,  # QUERY_WAS_CANCELLED
    425,  # SYSTEM_ERROR
    999,  # KEEPER_EXCEPTION
    1000,  # POCO_EXCEPTION
})
"""Server error codes after which the identical block is retried. Everything else
(syntax, unknown column, type mismatch, readonly user…) will fail again: stop."""

TOKEN_MIN_VERSION: Final = (22, 2)
"""First server version with ``insert_deduplication_token``."""

LATE_FIRST_SEND_S: Final = 5.0
"""A block's first attempt sent this long after the fence's confirm began its read (the
last moment the attempt was the partition's only writer) is checked like a re-send:
the attempt stalled in between (SIGSTOP, a GC pause), and a newer attempt may have
stored the block meanwhile under columns an ``ALTER`` has since changed
(docs/protocol.md, *The residual window*). A newer attempt needs a driver restart or
a lost executor, then its own commit, insert and the ALTER, far longer than this."""

QUORUM_PENDING_FIRST_PAUSE_S: Final = 0.01
"""The first pause before an insert refused for another insert's pending quorum is sent
again: the pause of the benchmark's same-blocks limit (``bench.bench_limits``), whose
queued inserts land that soon after their turn; a warm quorum insert of 12,500 rows
took 0.05-0.1 s there (docs/BENCHMARKS.md, session 22)."""

QUORUM_PENDING_MAX_PAUSE_S: Final = 0.1
"""The longest pause between two sends of a queued insert: it lands at most this long
after the quorum it waits behind is reached. Each send carries the whole block, so not
shorter."""


class QuorumQueue:
    """Pauses of one insert waiting behind other inserts' quorums on its table: from
    :data:`QUORUM_PENDING_FIRST_PAUSE_S`, doubling up to
    :data:`QUORUM_PENDING_MAX_PAUSE_S`, until ``budget_s`` is spent; ``None`` then,
    and the refusal counts as a failed attempt (a quorum pending that long is a replica
    not catching up, which the attempts diagnose). Counted in requested pauses, not the
    clock, so a writer with a test's sleep still ends."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.left = budget_s
        self.next = QUORUM_PENDING_FIRST_PAUSE_S

    @property
    def spent(self) -> bool:
        """Whether this insert already waited the whole budget (none when it is 0)."""
        return self.budget_s > 0 and self.left <= 0

    def pause(self, jitter: float = 1.0) -> float | None:
        if self.left <= 0:
            return None
        pause = min(self.next * jitter, self.left)
        self.left -= pause
        self.next = min(self.next * 2, QUORUM_PENDING_MAX_PAUSE_S)
        return pause


def _is_native_client(client: Any) -> bool:
    """Whether ``client`` sends :class:`~aggregator.clickhouse.native.NativeBlock`s."""
    return _is_driver_client(client) and isinstance(client, native_client_class())


def _is_driver_client(client: Any) -> bool:
    """Whether ``client`` is clickhouse-driver's (the only one with numpy mode)."""
    try:
        from clickhouse_driver import Client as DriverClient
    except ImportError:
        return False
    return isinstance(client, DriverClient)


class Client(Protocol):
    """The part of ``clickhouse_driver.Client`` the writer uses."""

    def execute(self, query: str, params: Any = None, *, columnar: bool = False,
                settings: dict[str, Any] | None = None, **kwargs: Any) -> Any: ...

    def disconnect(self) -> None: ...


@dataclass(frozen=True)
class Replica:
    host: str
    port: int = 9000


@dataclass(frozen=True)
class WriterConfig:
    """Where and how to insert. ``replicas`` are the replicas of *one* shard (the
    shard this topic feeds); ``insert_quorum`` 0 means the server's default."""

    replicas: tuple[Replica, ...]
    user: str = "default"
    password: str = ""
    insert_quorum: int = 0
    insert_quorum_timeout_ms: int | None = None
    max_attempts: int = 12
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 15.0
    quorum_pending_wait_s: float = 10.0
    """How long, in all, an insert waits in short pauses, on the same replica, while the
    table's previous quorum insert is pending (code 286, :func:`~aggregator.clickhouse.
    diagnosis.is_quorum_pending`) before each further such refusal counts as a failed
    attempt (failover, backoff): partitions writing one table queue behind each other's
    quorums on 18.16, which takes a few tens of milliseconds an insert, not
    ``backoff_initial_s``."""
    connect_timeout_s: float = 10.0
    send_receive_timeout_s: float = 300.0
    dead_letter_table: str = "blockagg.dead_letters"
    extra_settings: Mapping[str, Any] = field(default_factory=dict)
    use_numpy: bool = True
    """Send blocks whose columns are numpy arrays through clickhouse-driver's numpy
    mode (when the driver's numpy extras, i.e. pandas, are installed)."""
    tls: Mapping[str, Any] = field(default_factory=dict)
    """clickhouse-driver's TLS arguments (``secure``, ``verify``, ``ca_certs``), from
    ``[clickhouse]`` (:func:`blockagg.tls.tls_arguments`)."""
    replay_across_alter: str = "refuse"
    """``clickhouse.replay_across_alter``: a re-send after an ALTER that the table's
    coordinates can't settle is refused, inserted or skipped."""
    expired_replay: str = "refuse"
    """``clickhouse.expired_replay``: a replay older than the table's deduplication age
    that the table's coordinates can't settle is refused, inserted or skipped."""
    allow_without_coordinates: frozenset[str] = frozenset()
    """``clickhouse.allow_tables_without_coordinates``: tables accepted without the
    coordinate columns on a content-hash server (:meth:`ClickHouseBlockWriter.check_tables`)."""
    allow_stored_coordinates: bool = False
    """``clickhouse.allow_stored_coordinates``: partitions were let start into tables
    holding rows at their coordinates (``aggregator.clickhouse.stored``), so in a
    table without ``_incarnation`` the re-send check can't take the rows it counts
    for this incarnation's, and settles nothing by them."""
    shared_with_other_kafka_clusters: bool = False
    """``clickhouse.shared_with_other_kafka_clusters``: other Kafka clusters feed the
    same tables, so on a content-hash server every table must carry the topic
    incarnation (:func:`~aggregator.clickhouse.tables.judge_shared`)."""
    dead_letter_columns_ttl_s: float = 60.0
    """How long the dead-letter table's columns are taken as known (whether it has the
    ``incarnation`` column) before they are read again."""
    earlier_attempt_wait_s: float = 360.0
    """How long the re-send check waits, in place, for an earlier attempt of the block
    still running on a replica before it gives up (:class:`Unsettled`, retried). Such
    a query ends at the latest when the server's ``receive_timeout`` (300 s by
    default) passes without data from a stalled client, or its quorum wait ends;
    failing the attempt sooner only makes Spark retry the task into the same wait."""
    ping_after_idle_s: float = 5.0
    """clickhouse-driver pings the server before every query; a connection that
    carried a query less than this many seconds ago skips the ping (0: always ping).
    A connection that died meanwhile fails the send, which is retried identically."""

    def __post_init__(self) -> None:
        if not self.replicas:
            from blockagg.exceptions import ConfigError

            raise ConfigError("need at least one ClickHouse replica (host:port) for the shard")


@functools.cache
def _recently_used_connection() -> type:
    """clickhouse-driver's ``Connection`` without the ping before a query on a
    connection that carried one within ``ping_after_idle_s``.

    The driver's ping (one round trip before every query) only notices a connection
    the server closed, to reconnect before sending. A connection in use seconds ago is
    open unless the server just went away; then the send fails with a network error
    and the writer retries the identical block (on this or another replica), as after
    any network error, so skipping the ping changes no outcome, only its cost."""
    from clickhouse_driver.connection import Connection

    class RecentlyUsedConnection(Connection):  # type: ignore[misc]
        ping_after_idle_s = 0.0
        used_at = float("-inf")

        def force_connect(self) -> None:
            """The driver's step before each query, pinging only an idle connection."""
            self.check_query_execution()
            self.ensure_connected()

        def ensure_connected(self) -> None:
            """Connect, or reconnect a connection idle for ``ping_after_idle_s`` or
            more that does not answer a ping."""
            now = time.monotonic()
            if not self.connected:
                self.connect()
            elif now - self.used_at >= self.ping_after_idle_s and not self.ping():
                log.info("connection to %s:%s was closed; reconnecting", *self.hosts[0])
                self.connect()
            self.used_at = now

    return RecentlyUsedConnection


def default_client_factory(config: WriterConfig) -> Callable[[Replica], Client]:
    """clickhouse-driver clients that send columnar blocks in Native layout as is
    (:class:`~aggregator.clickhouse.native.NativeClient`)."""
    DriverClient = native_client_class()

    def make(replica: Replica) -> Client:
        client: Any = DriverClient(
            replica.host, port=replica.port, user=config.user, password=config.password,
            connect_timeout=config.connect_timeout_s,
            send_receive_timeout=config.send_receive_timeout_s, **config.tls)
        client.connection.__class__ = _recently_used_connection()
        client.connection.ping_after_idle_s = config.ping_after_idle_s
        made: Client = client
        return made
    return make


def connected_version(client: Client) -> tuple[int, ...]:
    """The version of the server ``client`` is about to send to: for the writer's
    clickhouse-driver client, from the connection's handshake (connecting, or pinging
    an idle connection, first), without a query; else ``SELECT version()``."""
    connection = getattr(client, "connection", None)
    if hasattr(connection, "ensure_connected"):
        assert connection is not None
        connection.ensure_connected()
        info = connection.server_info
        return int(info.version_major), int(info.version_minor), int(info.version_patch)
    return parse_version(str(client.execute("SELECT version()")[0][0]))


def parse_version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


class ClickHouseBlockWriter:
    """Implements :class:`aggregator.core.model.BlockSink` for one shard.

    Safe for inserts from several threads at once (the insert lanes,
    ``aggregator.lanes``): each thread has its own connection to each replica."""

    def __init__(self, config: WriterConfig,
                 client_factory: Callable[[Replica], Client] | None = None,
                 sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self._clock = clock
        self._wall_clock = wall_clock
        self._factory = client_factory or default_client_factory(config)
        self._clients: dict[tuple[int, Replica], Client] = {}
        self._clients_lock = threading.Lock()
        self._sleep = sleep
        self._preferred = 0
        self._server_version: tuple[int, ...] | None = None
        self._structure = StructureCache()
        self.resend = ResendCheck(
            config, self._execute_on,
            self._drop, self.query, self._merge_tree_setting, lambda: self._clock(),
            lambda: self._wall_clock(), lambda s: self._sleep(s))
        """The re-send check (:mod:`aggregator.clickhouse.resend`), on this writer's
        connections."""
        self._windows: dict[str, tuple[float, DedupWindow]] = {}
        self._described: dict[str, TableInfo] = {}
        self._dead_letter_seen: tuple[float, bool] | None = None
        self._built_ahead = BlocksBuiltAhead()
        self.quorum_waits = 0
        """Inserts refused because the table's previous quorum was pending and sent again
        (:class:`QuorumQueue`), since the writer was made: what a batch's
        ``quorum_waits`` counts."""

    def _client(self, replica: Replica) -> Client:
        """This thread's client of ``replica``."""
        key = (threading.get_ident(), replica)
        client = self._clients.get(key)
        if client is None:
            client = self._factory(replica)
            with self._clients_lock:
                self._clients[key] = client
        return client

    def _execute_on(self, replica: Replica, sql: str, params: Any) -> Any:
        """``sql`` on ``replica`` through this thread's client, without retry."""
        return self._client(replica).execute(sql, params)

    def _drop(self, replica: Replica, thread: int | None = None) -> None:
        with self._clients_lock:
            client = self._clients.pop((thread or threading.get_ident(), replica), None)
        if client is not None:
            try:
                client.disconnect()
            except Exception:
                log.debug("disconnect from %s failed", replica, exc_info=True)

    def _current_replica(self) -> Replica:
        """The replica queries go to: ``_preferred`` counts every failover, so it
        wraps around the shard's replicas."""
        replicas = self.config.replicas
        return replicas[self._preferred % len(replicas)]

    def close(self) -> None:
        for thread, replica in list(self._clients):
            self._drop(replica, thread)

    def query(self, sql: str, params: Any = None) -> Any:
        """Run a read-only query on the first replica that answers."""
        return self._with_retries("(query)", lambda c: c.execute(sql, params))

    @property
    def server_version(self) -> tuple[int, ...]:
        if self._server_version is None:
            rows = self.query("SELECT version()")
            self._server_version = parse_version(str(rows[0][0]))
        return self._server_version

    @property
    def supports_token(self) -> bool:
        return self.server_version >= TOKEN_MIN_VERSION

    def dedup_mode(self) -> DedupMode:
        """How this shard's server recognises a retried block now: the mode a new
        batch is pinned to (``Pins.dedup``); a replay keeps its intent's. Asks the server
        again, so an upgrade reaches long-lived workers."""
        rows = self.query("SELECT version()")
        self._server_version = parse_version(str(rows[0][0]))
        return DedupMode.TOKEN if self.supports_token else DedupMode.BLOCK_HASH

    def describe(self, table: str) -> TableInfo:
        return self.describe_many([table])[table][0]

    def describe_many(self, tables: Sequence[str]) -> dict[str, tuple[TableInfo, str]]:
        """Each table's :class:`TableInfo` and ``CREATE`` statement, read with two
        queries per database (``system.columns``, ``system.tables``) however many
        tables: the per-table refresh of live columns was seven queries a table (a
        millisecond of the job's CPU each, paid per block at small blocks). Raises
        :class:`TableNotFound` naming the first table the server does not have."""
        by_database: dict[str, list[str]] = {}
        for table in dict.fromkeys(tables):
            database, name = table.split(".", 1)
            by_database.setdefault(database, []).append(name)
        columns: dict[str, list[Column]] = {}
        engines: dict[str, tuple[str, str]] = {}
        for database, names in by_database.items():
            params = {"db": database, "t": tuple(names)}
            for t, n, ty, k, e in self.query(
                    "SELECT table, name, type, default_kind, default_expression "
                    "FROM system.columns WHERE database = %(db)s AND table IN %(t)s", params):
                columns.setdefault(f"{database}.{t}", []).append(
                    Column(str(n), str(ty), str(k), str(e)))
            for t, engine, create in self.query(
                    "SELECT name, engine, create_table_query FROM system.tables "
                    "WHERE database = %(db)s AND name IN %(t)s", params):
                engines[f"{database}.{t}"] = (str(engine), str(create))
        return table_infos(tables, columns, engines, self._current_replica().host)

    def check_tables(self, tables: Sequence[str], need: DedupNeed | None = None,
                     allow_small_window: bool = False) -> list[str]:
        """Refuse tables that won't deduplicate; return warnings. Every window read is
        kept (:meth:`dedup_window`) for the task's guard.

        Raises :class:`DedupNotConfigured` when a table is not ``Replicated*`` and
        has no ``non_replicated_deduplication_window`` > 0, or when the user's
        profile sets ``insert_deduplicate = 0``; :class:`DedupWindowTooSmall` when
        the window gives ``need``'s partitions no block each per batch (below ``2 x
        P``, ``aggregator.clickhouse.dedup_window``; a warning with
        ``allow_small_window``, as is a share below ``need.expected_blocks``);
        :class:`CoordinatesMissing` when a table lacks the Kafka-coordinate columns on
        a content-hash server
        (:func:`~aggregator.clickhouse.tables.judge_coordinates`; a warning for the tables
        ``allow_without_coordinates`` lists, and on token servers).
        """
        warnings: list[str] = []
        profile = self.query("SELECT value FROM system.settings "
                             "WHERE name = 'insert_deduplicate'")
        if profile and str(profile[0][0]) == "0":
            raise DedupNotConfigured(
                f"user {self.config.user!r} has insert_deduplicate = 0 in its profile; set "
                "insert_deduplicate = 1 in the user's profile (users.xml) so a retried "
                "block is dropped")
        described = self.describe_many(tables)
        defaults: dict[str, int | None] = {}

        def server_default(name: str, default: int) -> int | None:
            if name not in defaults:  # one read per call, not per table
                defaults[name] = self._merge_tree_setting(name, default)
            return defaults[name]

        for table in dict.fromkeys(tables):
            info, create = described[table]
            self._described[table] = info
            setting, window = dedup_setting(table, info.engine, create, server_default)
            if window is not None:
                self._windows[table] = (self._clock(), DedupWindow(setting, window))
            if window is not None and need is not None:
                warning = judge_window(table, setting, window, need, allow_small_window)
                if warning is not None:
                    warnings.append(warning)
            if self.config.shared_with_other_kafka_clusters:
                judge_shared(info, self.supports_token, self.server_version,
                             self.config.dead_letter_table)
            if not info.coordinates and table != self.config.dead_letter_table:
                warning = judge_coordinates(info, self.supports_token, self.server_version,
                                            self.config.allow_without_coordinates)
                if warning is not None:
                    warnings.append(warning)
        for w in warnings:
            log.warning("%s", w)
        return warnings

    def checked(self, table: str) -> TableInfo | None:
        """What the last :meth:`check_tables` of ``table`` read of it (``None`` before
        one): its live columns as checked, without reading them again."""
        return self._described.get(table)

    def dedup_window(self, table: str, max_age_s: float = float("inf")) -> DedupWindow | None:
        """The window :meth:`check_tables` last read for ``table``, if within
        ``max_age_s`` seconds; ``None`` otherwise (check the table to read it)."""
        entry = self._windows.get(table)
        if entry is None or self._clock() - entry[0] >= max_age_s:
            return None
        return entry[1]

    def shard_identity(self, table: str) -> str | None:
        """What the servers say identifies this shard, whatever the replicas are called
        in the configuration: the ZooKeeper path of ``table`` (the dead-letter table,
        on every shard) when it is replicated (replicas of one table share it, and it
        names the table's shard), else the ``cluster``/``shard`` macros (a shard macro
        without the cluster's may merge two clusters' shards: fewer blocks each, safe);
        ``None`` when neither is known (``dedup_window.shard_partitions`` then groups by
        replica addresses alone)."""
        database, name = table.split(".", 1)
        rows = self.query("SELECT zookeeper_path FROM system.replicas "
                          "WHERE database = %(db)s AND table = %(t)s",
                          {"db": database, "t": name})
        if rows and rows[0][0]:
            return f"zookeeper:{rows[0][0]}"
        try:
            macros = dict(self.query("SELECT macro, substitution FROM system.macros"))
        except ClickHouseError:  # no system.macros: the replica addresses decide
            log.debug("shard identity unknown for %s", table, exc_info=True)
            return None
        if "shard" in macros:
            return f"macro:{macros.get('cluster', '')}/{macros['shard']}"
        return None

    def _merge_tree_setting(self, name: str, default: int) -> int | None:
        try:
            rows = self.query("SELECT value FROM system.merge_tree_settings "
                              "WHERE name = %(n)s", {"n": name})
        except InsertFailed:
            return default
        return int(rows[0][0]) if rows else None

    def settings_for(self, block: Block, dedup: int = DedupMode.UNPINNED) -> dict[str, Any]:
        """The insert's settings. ``dedup`` is the batch's pinned mode
        (``Pins.dedup``): the token is sent exactly when the block's first attempt sent
        it, whatever the server answering now supports, so an upgrade (or a failover
        to a replica of another version) never gives a replay another identity; a
        replay pinned to ``BLOCK_HASH`` on a server with tokens refuses, since the
        content hash itself changed across versions.
        ``UNPINNED`` (an intent written before pins existed) takes the server's mode,
        as before."""
        settings: dict[str, Any] = {"insert_deduplicate": 1, **self.config.extra_settings}
        if self.config.insert_quorum:
            settings["insert_quorum"] = self.config.insert_quorum
            if self.config.insert_quorum_timeout_ms is not None:
                settings["insert_quorum_timeout"] = self.config.insert_quorum_timeout_ms
        mode = DedupMode(dedup) if dedup else self.dedup_mode()
        if mode == DedupMode.TOKEN:
            if not self.supports_token:
                raise DedupModeMismatch(
                    f"block {block.token} was first inserted with insert_deduplication_token "
                    "(pinned in its intent), but the server now answering is version "
                    f"{'.'.join(map(str, self.server_version))}, which has no such setting: "
                    "without the token a replay would not be recognised. Insert through "
                    f"replicas of ClickHouse {TOKEN_MIN_VERSION[0]}.{TOKEN_MIN_VERSION[1]}+ "
                    "(this block was not sent)")
            settings["insert_deduplication_token"] = block.token
        elif mode == DedupMode.BLOCK_HASH and self.supports_token:
            raise DedupModeMismatch(
                f"block {block.token} was first inserted under content-hash deduplication, by "
                "a server without insert_deduplication_token (pinned in its intent), but the "
                f"server now answering is version {'.'.join(map(str, self.server_version))}: "
                "servers compute a block's hash differently across versions (18.16 and 26 "
                "give the same block different ids), so this replay might not be recognised "
                "and could land twice. Let the replay run through a replica of the version "
                "that first inserted it (finish the rolling upgrade after it), and before an "
                "upgrade stop the job with SIGTERM, whose last commits are final (this block "
                "was not sent)")
        return settings

    def block_columns(self, block: Block, batch: Batch) -> tuple[tuple[str, ...], list[list[Any]]]:
        """The block's column names and columnar values (Python lists), rows in
        position order.

        Pure: the same block over the same batch always gives the same values."""
        data = self.block_data(block, batch, numpy=False)
        return data.names, data.columns

    def block_data(self, block: Block, batch: Batch, numpy: bool | None = None,
                   dead_letter_incarnation: bool = False) -> BlockData:
        """The block's insert (:func:`~aggregator.clickhouse.blockdata.block_data`), in
        numpy mode by default when the configuration and the driver allow it.

        Pure: the same block over the same batch always gives the same data."""
        if numpy is None:
            numpy = self.config.use_numpy and numpy_inserts_available()
        limit = int(self.config.extra_settings.get("insert_block_size",
                                                   DEFAULT_INSERT_BLOCK_SIZE))
        return block_data(block, batch, numpy, dead_letter_incarnation, limit)

    def build_ahead(self, blocks: Sequence[Block], batch: Batch) -> None:
        """Build a seal event's inserts ahead (:class:`~aggregator.core.model.BuildAheadSink`,
        :class:`~aggregator.clickhouse.blockdata.BlocksBuiltAhead`); dead-letter blocks,
        whose columns depend on a server read, are built by their inserts."""
        self._built_ahead.fill([b for b in blocks if b.table_id != DEAD_LETTER_TABLE_ID],
                               batch, lambda block: self.block_data(block, batch))

    def _dead_letter_incarnation(self) -> bool:
        """Whether the dead-letter table has the ``incarnation`` column (re-read every
        ``dead_letter_columns_ttl_s``): dead-letter blocks then carry the batch's topic
        incarnation there, as table blocks carry ``_incarnation``. Not pinned: a
        replay across the ``ALTER`` that adds it sends a block its first attempt did
        not, which the re-send check sees (the ALTER moved the structure mark) and
        settles by the rows' coordinates before sending."""
        now = self._clock()
        seen = self._dead_letter_seen
        if seen is None or now - seen[0] >= self.config.dead_letter_columns_ttl_s:
            database, name = self.config.dead_letter_table.split(".", 1)
            rows = self.query("SELECT count() FROM system.columns WHERE database = %(db)s "
                              "AND table = %(t)s AND name = %(c)s AND type = 'UInt64'",
                              {"db": database, "t": name,
                               "c": DEAD_LETTER_COORDINATES.incarnation})
            seen = self._dead_letter_seen = (now, bool(rows and int(rows[0][0])))
        return seen[1]

    def stored_coordinates(self, tables: Sequence[str], topic: str, partition: int,
                           start: int) -> list[StoredRange]:
        """The rows of ``topic[partition]`` at offsets ``start`` and above in those of
        ``tables`` that can't tell topic incarnations apart (coordinate columns, no
        incarnation column: :func:`~aggregator.clickhouse.stored.unmarked_tables`).
        One ``system.columns`` query, then one count per such table; the task asks only
        when a partition starts without a blockagg commit (docs/protocol.md)."""
        wanted = set(tables)
        columns: dict[str, set[str]] = {t: set() for t in wanted}
        looked_for = sorted({getattr(c, f) for c in (TABLE_COORDINATES, DEAD_LETTER_COORDINATES)
                             for f in ("topic", "partition", "offset", "incarnation")})
        rows = self.query("SELECT database, table, name FROM system.columns WHERE name IN "
                          "%(names)s", {"names": tuple(looked_for)})
        for database, table, name in rows:
            key = f"{database}.{table}"
            if key in wanted:
                columns[key].add(str(name))
        targets = unmarked_tables(columns, self.config.dead_letter_table)
        return stored_ranges(self.query, targets, topic, partition, start)

    def insert(self, block: Block, batch: Batch, confirmed_at: float | None = None) -> None:
        """Insert ``block`` (all its rows, in one insert); return once acknowledged.

        ``confirmed_at`` (the fence's confirm, on this writer's clock) is when the
        attempt was last known to be the partition's only writer: a first send later
        than :data:`LATE_FIRST_SEND_S` after it is checked like a re-send. A replay
        whose first attempt may be older than the table's deduplication age
        (:meth:`_expired`) is checked by its rows too, whatever the server's mode."""
        began = self._clock() if confirmed_at is None else min(confirmed_at, self._clock())
        table = (self.config.dead_letter_table if block.table_id == DEAD_LETTER_TABLE_ID
                 else block.table)
        data = self._built_ahead.take(block, batch) or self.block_data(
            block, batch, dead_letter_incarnation=(
                block.table_id == DEAD_LETTER_TABLE_ID and self._dead_letter_incarnation()))
        if not data.rows:
            return
        quoted = ", ".join(f"`{n}`" for n in data.names)
        sql = f"INSERT INTO {table} ({quoted}) VALUES"
        dedup = batch.pins.dedup
        settings = self._settings_on_a_fitting_replica(block, dedup)
        by_hash = dedup == DedupMode.BLOCK_HASH or (
            dedup == DedupMode.UNPINNED and not self.supports_token)
        attempts = 0
        query_id = block_query_id(block)

        def send(client: Client) -> Any:
            nonlocal attempts
            attempts += 1
            if dedup:
                self._check_dedup_mode(client, block, dedup)
            late = self._clock() - began if attempts == 1 else 0.0
            expired = self.resend.expired(table, block) if block.replay else None
            if (expired or (by_hash and (block.replay or attempts > 1
                                         or late > LATE_FIRST_SEND_S))) \
                    and self.resend.already_stored(client, block, table, data,
                                             batch.pins.structure, attempts, late, expired,
                                             batch.pins.incarnation):
                return None
            if data.numpy and _is_driver_client(client):
                return client.execute(sql, data.fresh(native=_is_native_client(client)),
                                      columnar=True, query_id=query_id,
                                      settings={**settings, "use_numpy": True})
            return client.execute(sql, data.fresh(lists=True), columnar=True,
                                  query_id=query_id, settings=settings)
        self._with_retries(table, send)

    def _settings_on_a_fitting_replica(self, block: Block, dedup: int) -> dict[str, Any]:
        """The insert's settings on a replica whose version keeps the pinned mode
        (during a rolling upgrade across the token boundary a replay moves to a
        replica of its first attempt's side); raises :class:`DedupModeMismatch` when
        none answering does."""
        for _ in range(len(self.config.replicas) - 1):
            try:
                return self.settings_for(block, dedup)
            except DedupModeMismatch:
                self._preferred += 1
                self._server_version = None
        return self.settings_for(block, dedup)

    def structure_mark(self, tables: Sequence[str]) -> int:
        """``Pins.structure`` for a batch that may write ``tables``: the highest zxid
        of their ``columns`` nodes (:mod:`aggregator.clickhouse.structure`). Read
        afresh only for tables whose ``columns_version`` moved on some replica, so a
        batch costs one ``system.replicas`` query per replica. When no replica answers,
        the query is retried like any other and fails the batch in the end: a mark of 0
        would read as "no mark" and leave every re-send of the batch unchecked."""
        sql = "SELECT database, table, columns_version FROM system.replicas"
        answers: list[Any] = []
        for replica in self.config.replicas:
            try:
                answers.append(self._client(replica).execute(sql))
            except Exception:  # a replica down: its changes show in the re-send check
                log.debug("system.replicas of %s unreadable", replica, exc_info=True)
                self._drop(replica)
        if not answers:
            # A mark of 0 would mean "no mark": every re-send of the batch unchecked.
            answers.append(self._with_retries("(query)", lambda c: execute(c, sql, None)))
        versions: dict[str, list[int]] = {}
        for rows in answers:
            for database, name, version in rows:
                versions.setdefault(f"{database}.{name}", []).append(int(version))
        return int(self._with_retries("(query)", lambda c: self._structure.mark(
            functools.partial(execute, c), tables, versions)))

    @staticmethod
    def _check_dedup_mode(client: Client, block: Block, dedup: int) -> None:
        """Right before each attempt: the replica about to receive a pinned block is
        on the pinned side of the token boundary (a failover may have moved it)."""
        version = connected_version(client)
        if (version >= TOKEN_MIN_VERSION) != (dedup == DedupMode.TOKEN):
            raise DedupModeMismatch(
                f"block {block.token} is pinned to {DedupMode(dedup).name} deduplication, "
                f"but the replica it failed over to is version "
                f"{'.'.join(map(str, version))}, on the other side of the "
                "insert_deduplication_token boundary; retry when a replica of the pinned "
                "side answers (this attempt was not sent)")

    def _with_retries(self, what: str, action: Callable[[Client], Any]) -> Any:
        from clickhouse_driver import errors as ch_errors

        delay = self.config.backoff_initial_s
        last_code: int | None = None
        last_message = ""
        quorum: tuple[int | None, str] | None = None  # the last quorum refusal
        queued = QuorumQueue(self.config.quorum_pending_wait_s)
        attempt = 0
        while attempt < self.config.max_attempts:
            attempt += 1
            replica = self._current_replica()
            try:
                return action(self._client(replica))
            except ch_errors.ServerException as exc:
                last_code, last_message = int(exc.code), str(exc.message)
                if last_code not in RETRIABLE_CODES:
                    raise InsertFailed(what, last_code, last_message, attempt) from exc
            except (ch_errors.NetworkError, ch_errors.SocketTimeoutError, EOFError,
                    OSError, ch_errors.UnexpectedPacketFromServerError, Unsettled) as exc:
                last_code, last_message = None, f"{type(exc).__name__}: {exc}"
            except ch_errors.Error as exc:
                code = getattr(exc, "code", None)
                last_code, last_message = code, str(exc)
                if code not in RETRIABLE_CODES:
                    raise InsertFailed(what, code, last_message, attempt) from exc
            if is_quorum_failure(last_code, last_message):
                quorum = (last_code, last_message)
            pause = (queued.pause(random.uniform(0.8, 1.2))
                     if is_quorum_pending(last_code, last_message) else None)
            if pause is not None:
                with self._clients_lock:
                    self.quorum_waits += 1
                log.debug("%s on %s:%d: the table's previous quorum insert is pending; "
                          "sent again in %.3f s to the same replica", what,
                          replica.host, replica.port, pause)
                self._sleep(pause)
                attempt -= 1
                continue
            log.log(retry_level(attempt, self.config.max_attempts, last_code, last_message,
                                waited=queued.spent),
                    "%s on %s:%d failed (attempt %d/%d): %s; retrying %s", what,
                    replica.host, replica.port, attempt, self.config.max_attempts,
                    last_message.split("Stack trace:")[0].strip(),
                    "the query" if what == "(query)" else "the identical block")
            self._drop(replica)
            self._preferred += 1
            if attempt < self.config.max_attempts:
                self._sleep(min(delay, self.config.backoff_max_s) * random.uniform(0.8, 1.2))
                delay *= 2
        attempts = self.config.max_attempts
        if what != "(query)" and is_alter_pending(last_code, last_message):
            raise AlterNotApplied(what, last_code, last_message, attempts,
                                  alter_error(what, last_code, last_message, attempts))
        if what != "(query)" and self.config.insert_quorum and quorum is not None:
            code, message = quorum
            raise QuorumUnsatisfied(what, code, message, attempts, quorum_error(
                what, self.config.insert_quorum, code, message, attempts,
                replica_states(what, self.config.replicas, self._execute_on, self._drop)))
        raise InsertFailed(what, last_code, last_message, attempts)
