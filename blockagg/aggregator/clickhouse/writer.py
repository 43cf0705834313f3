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

import numpy as np
import numpy.typing as npt

from blockagg.aggregator.clickhouse.dedup_window import DedupNeed, DedupWindow, judge_window
from blockagg.aggregator.clickhouse.exceptions import (
    AlterNotApplied,
    ClickHouseError,
    CoordinatesMissing,
    DedupModeMismatch,
    DedupNotConfigured,
    IncarnationMissing,
    InsertFailed,
    QuorumUnsatisfied,
    ReplayAcrossAlter,
    ReplayBeyondDedupAge,
    TableNotFound,
)
from blockagg.aggregator.clickhouse.native import (
    NativeBlock,
    concat,
    native_client_class,
    native_type_ok,
)
from blockagg.aggregator.clickhouse.stored import StoredRange, stored_ranges, unmarked_tables
from blockagg.aggregator.clickhouse.structure import (
    DEAD_LETTER_COORDINATES,
    TABLE_COORDINATES,
    Coordinates,
    StructureCache,
    landed_query,
    resend_risk,
)
from blockagg.aggregator.core.metadata import DEAD_LETTER_TABLE_ID, DedupMode
from blockagg.aggregator.core.model import Batch, Block
from blockagg.rows.columns import (
    COORDINATE_COLUMNS,
    INCARNATION_COLUMN,
    Column,
    ColumnSet,
    Payloads,
    Rows,
    TablePlan,
)
from blockagg.rows.deadletters import COLUMNS as DEAD_LETTER_COLUMNS
from blockagg.rows.deadletters import DeadLetter
from blockagg.rows.layout import NATIVE_COLUMNS, StringColumn
from blockagg.rows.types import INT_RANGES, CHType, default_value, parse_type

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

QUORUM_CODES: Final = frozenset({
    285,  # TOO_FEW_LIVE_REPLICAS
    286,  # UNSATISFIED_QUORUM_FOR_PREVIOUS_WRITE
})
"""Codes that say ``insert_quorum`` can't be reached (and 159, TIMEOUT_EXCEEDED, or 319,
UNKNOWN_STATUS_OF_INSERT, when its message is about the quorum: 18.16 answers 319
"Timeout while waiting for quorum" when the part is stored but the quorum wait timed
out): retried, and once every attempt failed so, the error names the replica that does
not catch up (:func:`quorum_error`)."""

TOKEN_MIN_VERSION: Final = (22, 2)
"""First server version with ``insert_deduplication_token``."""

NUMPY_TYPES: Final = frozenset({*INT_RANGES, "Float32", "Float64", "String", "DateTime",
                                "Enum8", "Enum16", "Array"})
"""Column types a block may have to go through clickhouse-driver's numpy mode:
written from arrays (integers, floats, String, DateTime without a time zone), or
by the driver's generic column from an ``object`` array (Enum8/16, Array(T))."""

LATE_FIRST_SEND_S: Final = 5.0
"""A block's first attempt sent this long after the fence's confirm began its read (the
last moment the attempt was the partition's only writer) is checked like a re-send:
the attempt stalled in between (SIGSTOP, a GC pause), and a newer attempt may have
stored the block meanwhile under columns an ``ALTER`` has since changed
(docs/protocol.md, *The residual window*). A newer attempt needs a driver restart or
a lost executor, then its own commit, insert and the ALTER, far longer than this."""

DEDUP_AGE_SETTING: Final = "replicated_deduplication_window_seconds"
DEFAULT_DEDUP_AGE_S: Final = 604_800
"""ClickHouse's default ``replicated_deduplication_window_seconds``: 7 days."""

DEFAULT_INSERT_BLOCK_SIZE: Final = 1_048_576
"""clickhouse-driver's ``insert_block_size``: larger blocks go as lists, which the
driver splits at exactly this many rows (its numpy mode splits differently)."""

_NUMPY_FALLBACK_WARNING: Final = "NumPy support is not implemented for"


class _QuietNumpyFallback(logging.Filter):
    """Drops clickhouse-driver's per-insert warning that an Enum/Array column takes
    the generic path in numpy mode: that is by design here (:data:`NUMPY_TYPES`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_NUMPY_FALLBACK_WARNING)


@functools.cache
def numpy_inserts_available() -> bool:
    """Whether clickhouse-driver's numpy mode can be used (it needs pandas)."""
    try:
        import clickhouse_driver.columns.numpy.service
        import clickhouse_driver.numpy.helpers  # noqa: F401
    except ImportError:
        return False
    logging.getLogger("clickhouse_driver.columns.service").addFilter(_QuietNumpyFallback())
    return True


def numpy_type_ok(ch: CHType) -> bool:
    """Whether a column of type ``ch`` may go through the numpy mode."""
    if ch.name == "DateTime":
        return not ch.args
    return ch.name in NUMPY_TYPES


@dataclass(frozen=True, eq=False)
class BlockData:
    """A block's insert: column names, columns, and whether they are columnar
    (numpy arrays and :mod:`~aggregator.clickhouse.native` columns, with their
    ``types``) or Python lists."""

    names: tuple[str, ...]
    columns: list[Any]
    numpy: bool
    types: tuple[CHType, ...] = ()

    @property
    def rows(self) -> int:
        return len(self.columns[0]) if self.columns else 0

    def fresh(self, lists: bool = False, native: bool = False) -> Any:
        """The columns for one attempt: ``native``, the block in Native layout for
        :class:`~aggregator.clickhouse.native.NativeClient` (immutable, encoded once);
        ``lists``, Python lists (the same values) for a client without numpy mode;
        otherwise a copy for clickhouse-driver's numpy mode (which rewrites some in
        place)."""
        if native and self.numpy and all(native_type_ok(t) for t in self.types):
            if self._native is None:
                object.__setattr__(self, "_native",
                                   NativeBlock(self.names, self.types, self.columns))
            return self._native
        if lists:
            return [c.tolist() if hasattr(c, "tolist") else list(c) for c in self.columns]
        return [c.copy() if isinstance(c, np.ndarray) else c.driver_items()
                if isinstance(c, NATIVE_COLUMNS) else list(c) for c in self.columns]

    _native: NativeBlock | None = field(default=None, init=False, repr=False)


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
    incarnation (:meth:`ClickHouseBlockWriter._judge_shared`)."""
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


@dataclass
class TableInfo:
    """What the writer learned about a table at startup."""

    table: str
    columns: tuple[Column, ...]
    engine: str
    coordinates: bool
    incarnation: bool = False


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
        self._dedup_ages: dict[str, int | None] = {}
        self._windows: dict[str, tuple[float, DedupWindow]] = {}
        self._described: dict[str, TableInfo] = {}
        self._dead_letter_seen: tuple[float, bool] | None = None

    def _client(self, replica: Replica) -> Client:
        """This thread's client of ``replica``."""
        key = (threading.get_ident(), replica)
        client = self._clients.get(key)
        if client is None:
            client = self._factory(replica)
            with self._clients_lock:
                self._clients[key] = client
        return client

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
        found: dict[str, tuple[TableInfo, str]] = {}
        for table in dict.fromkeys(tables):
            if table not in columns:
                raise TableNotFound(f"table {table} does not exist (or has no columns) on "
                                    f"{self._current_replica().host}")
            cols = tuple(columns[table])
            engine, create = engines.get(table, ("", ""))
            present = {c.name for c in cols}
            found[table] = (TableInfo(table, cols, engine,
                                      all(c in present for c in COORDINATE_COLUMNS),
                                      INCARNATION_COLUMN in present), create)
        return found

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
        (:meth:`_judge_coordinates`; a warning for the tables
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
            window = _setting_in_create(create, "replicated_deduplication_window")
            setting = "replicated_deduplication_window"
            if info.engine.startswith("Replicated"):
                if window is None:
                    window = server_default("replicated_deduplication_window", 100)
                if window == 0:
                    raise DedupNotConfigured(
                        f"table {table} has replicated_deduplication_window = 0; set it to "
                        "at least 100 (ALTER TABLE ... MODIFY SETTING or the table's "
                        "SETTINGS) so retried blocks are deduplicated")
            elif info.engine.endswith("MergeTree"):
                setting = "non_replicated_deduplication_window"
                window = _setting_in_create(create, setting)
                if window is None:
                    window = server_default("non_replicated_deduplication_window", 0)
                if not window:
                    raise DedupNotConfigured(
                        f"table {table} uses {info.engine}, which does not deduplicate "
                        f"inserts; use Replicated{info.engine} or set "
                        "non_replicated_deduplication_window = 1000 in its SETTINGS "
                        "(ClickHouse 21.2+)")
            else:
                raise DedupNotConfigured(
                    f"table {table} uses engine {info.engine or '(none)'}, which does not "
                    "deduplicate inserts; insert into the shard's ReplicatedMergeTree table "
                    "(not a Distributed, Buffer or view)")
            if window is not None:
                self._windows[table] = (self._clock(), DedupWindow(setting, window))
            if window is not None and need is not None:
                warning = judge_window(table, setting, window, need, allow_small_window)
                if warning is not None:
                    warnings.append(warning)
            if self.config.shared_with_other_kafka_clusters:
                self._judge_shared(info)
            if not info.coordinates and table != self.config.dead_letter_table:
                warning = self._judge_coordinates(info)
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

    def _judge_shared(self, info: TableInfo) -> None:
        """A table that other Kafka clusters feed too (``shared_with_other_kafka_clusters``):
        on a server that deduplicates by content hash, refused without the topic
        incarnation column (``UInt64``, filled by the writer), the only part of the
        block that names the cluster (invariant 1: another data centre's block with the
        same rows at the same topic name, partition and offsets hashes alike, and the
        second is dropped as a retry). With ``insert_deduplication_token`` the token
        carries the incarnation (``core.model.block_token``): nothing to check."""
        if self.supports_token:
            return
        table = info.table
        dead = table == self.config.dead_letter_table
        name = DEAD_LETTER_COORDINATES.incarnation if dead else INCARNATION_COLUMN
        column = next((c for c in info.columns if c.name == name), None)
        if (column is not None and column.type == "UInt64"
                and column.default_kind not in ("MATERIALIZED", "ALIAS")):
            return
        what = (f"has no {name} column" if column is None else
                f"has {name} {column.type} {column.default_kind}".rstrip())
        version = ".".join(map(str, self.server_version))
        raise IncarnationMissing(
            f"table {table} {what}, but clickhouse.shared_with_other_kafka_clusters = true "
            f"and ClickHouse {version} deduplicates by content hash: another cluster's "
            "block with the same rows at the same coordinates would be dropped as a retry "
            f"and lost. Fix: ALTER TABLE {table} ADD COLUMN {name} UInt64 DEFAULT 0")

    def _judge_coordinates(self, info: TableInfo) -> str | None:
        """A table without ``_topic``, ``_partition``, ``_offset``: refused on a server
        that deduplicates by content hash (invariant 1: two different blocks with equal
        rows, e.g. the same event sent twice at different offsets, or a recreated topic
        repeating old payloads, hash alike, and the server drops the second as a retry:
        lost), unless ``allow_without_coordinates`` lists it (then a warning). With
        ``insert_deduplication_token`` the token names topic, partition and offsets, so
        equal rows never merge; only ``arv audit`` and the re-send check after an ALTER
        miss the columns there (a warning)."""
        table = info.table
        missing = ", ".join(c for c in COORDINATE_COLUMNS
                            if c not in {col.name for col in info.columns})
        add = "add _topic String, _partition UInt32, _offset UInt64"
        if self.supports_token:
            return (f"table {table} has no {missing} column(s): arv audit cannot check it "
                    "(deduplication is safe here: the server takes "
                    f"insert_deduplication_token); {add}")
        version = ".".join(map(str, self.server_version))
        if table in self.config.allow_without_coordinates:
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
        """The block's insert, rows in position order: numpy arrays when ``numpy``
        (default: the configuration and the driver allow it) and every column
        converted to an array of a :data:`NUMPY_TYPES` type, else Python lists.
        ``dead_letter_incarnation``: the dead-letter table has the ``incarnation``
        column (:meth:`_dead_letter_incarnation`), which a dead-letter block then fills.

        Pure: the same block over the same batch always gives the same data."""
        bulk = (batch.payloads.runs(block.positions)
                if isinstance(batch.payloads, Payloads)
                and block.table_id != DEAD_LETTER_TABLE_ID else None)
        if numpy is None:
            numpy = self.config.use_numpy and numpy_inserts_available()
        if bulk is not None:
            # The block's rows as slices of the batch's columns: no object per message.
            runs, counts = bulk
            names, fills = self._union_columns(block, [cs.plan for cs, _, _ in runs])
            if (numpy and not fills
                    and self._numpy_eligible(block, int(counts.sum()), [cs for cs, _, _ in runs])):
                return BlockData(names, self._array_columns(block, batch, runs, counts), True,
                                 runs[0][0].plan.types)
        payloads = [batch.payloads[int(p)] for p in block.positions]
        if block.table_id == DEAD_LETTER_TABLE_ID:
            rows = []
            for payload in payloads:
                if not isinstance(payload, DeadLetter):
                    raise ClickHouseError(
                        f"block of the dead-letter table holds a {type(payload).__name__} "
                        "payload; the task must pass a DeadLetter (make_dead_letter)")
                rows.append(payload.row())
            columns = [list(col) for col in zip(*rows, strict=True)]
            if dead_letter_incarnation:
                return BlockData((*DEAD_LETTER_COLUMNS, DEAD_LETTER_COORDINATES.incarnation),
                                 [*columns, [batch.pins.incarnation] * len(rows)], False)
            return BlockData(DEAD_LETTER_COLUMNS, columns, False)
        rows_payloads: list[Rows] = []
        for payload in payloads:
            if not isinstance(payload, Rows):
                raise ClickHouseError(
                    f"block of {block.table} holds a {type(payload).__name__} payload; "
                    "expected blockagg.rows.columns.Rows")
            rows_payloads.append(payload)
        names, fills = self._union_columns(block, [p.columns.plan for p in rows_payloads])
        if numpy and not fills and self._numpy_eligible(
                block, sum(p.count for p in rows_payloads), [p.columns for p in rows_payloads]):
            counts = np.fromiter((p.count for p in rows_payloads), dtype=np.int64,
                                 count=len(rows_payloads))
            return BlockData(names, self._array_columns(block, batch, _runs(rows_payloads),
                                                        counts), True,
                             rows_payloads[0].columns.plan.types)
        values: list[list[Any]] = []
        positions = block.positions.tolist()
        for name in names:
            col: list[Any] = []
            for payload, pos in zip(rows_payloads, positions, strict=True):
                plan = payload.columns.plan
                j = plan.columns.index(name) if name in plan.columns else -1
                if j < 0:
                    col.extend([fills[name]] * payload.count)
                elif plan.fields[j] is None and name == INCARNATION_COLUMN:
                    col.extend([batch.pins.incarnation] * payload.count)
                elif plan.fields[j] is None and name in COORDINATE_COLUMNS:
                    value = (block.topic if name == "_topic" else block.partition
                             if name == "_partition" else int(batch.offsets[pos]))
                    col.extend([value] * payload.count)
                else:
                    part = payload.columns.values[j][payload.start:payload.stop]
                    col.extend(part.tolist() if hasattr(part, "tolist") else part)
            values.append(col)
        return BlockData(names, values, False)

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

    def _numpy_eligible(self, block: Block, rows: int, sets: Sequence[ColumnSet]) -> bool:
        """Every column (of the block's column ``sets``, ``rows`` rows in all) an array
        of a numpy-mode type, and the block within one driver insert block (a
        function of the block only: a retry agrees)."""
        limit = int(self.config.extra_settings.get("insert_block_size",
                                                   DEFAULT_INSERT_BLOCK_SIZE))
        if block.rows > limit or rows > limit:
            return False
        seen: set[int] = set()
        for cs in sets:
            if id(cs) in seen:
                continue
            seen.add(id(cs))
            for ch, fd, values in zip(cs.plan.types, cs.plan.fields, cs.values, strict=True):
                if not numpy_type_ok(ch):
                    return False
                if fd is not None and not isinstance(values, (np.ndarray, *NATIVE_COLUMNS)):
                    return False
        return True

    @staticmethod
    def _array_columns(block: Block, batch: Batch, runs: Sequence[tuple[ColumnSet, int, int]],
                       counts: npt.NDArray[np.int64]) -> list[Any]:
        """The block's columns from its ``runs`` of rows (:func:`_runs`) and each
        message's row count (``counts``, for the ``_offset`` column)."""
        plan = runs[0][0].plan
        n = int(counts.sum())
        out: list[Any] = []
        for j, name in enumerate(plan.columns):
            col: Any
            if plan.fields[j] is None and name == INCARNATION_COLUMN:
                col = np.full(n, batch.pins.incarnation, dtype=np.uint64)
            elif plan.fields[j] is None and name in COORDINATE_COLUMNS:
                if name == "_topic":
                    col = StringColumn.repeat(block.topic, n)
                elif name == "_partition":
                    col = np.full(n, block.partition, dtype=np.int64)
                else:
                    col = np.repeat(batch.offsets[block.positions].astype(np.int64), counts)
            else:
                parts = []
                for cs, start, stop in runs:
                    values = cs.values[j]
                    assert isinstance(values, (np.ndarray, *NATIVE_COLUMNS))
                    parts.append(values[start:stop])
                col = concat(parts)
            out.append(col)
        return out

    def _union_columns(self, block: Block, plans: Sequence[TablePlan]
                       ) -> tuple[tuple[str, ...], dict[str, Any]]:
        """The insert's columns for a block whose messages were decoded with
        ``plans``: the union of the plans' columns in the table's column order, and
        the value each column takes in rows of a version that lacks it (its
        constant DEFAULT, NULL, or the type's zero value). A column no version of
        the block carries is left out, so the server computes its DEFAULT."""
        distinct: list[TablePlan] = []
        for plan in plans:
            if all(plan is not d and plan.columns != d.columns for d in distinct):
                distinct.append(plan)
        first = distinct[0]
        if len(distinct) == 1:
            return first.columns, {}
        # The newest version's recorded columns line the others up: they hold every
        # column an older version feeds (a pure function of the registry history).
        live = max((p for p in distinct if p.live), key=lambda p: p.version,
                   default=first).live
        if not live:
            raise ClickHouseError(
                f"block of {block.table} mixes schema versions with different columns and "
                "its plans carry no live columns; build plans with "
                "blockagg.rows.columns.make_plan")
        present = {name for p in distinct for name in p.columns}
        names = tuple(c.name for c in live if c.name in present)
        fills: dict[str, Any] = {}
        for c in live:
            if c.name not in present or all(c.name in p.columns for p in distinct):
                continue
            value, exact = default_value(parse_type(c.type), c.default_kind,
                                         c.default_expression)
            if not exact:
                log.warning("%s: rows of schema versions without column %s get %r, not its "
                            "DEFAULT %s (not a constant); pin one version per block or make "
                            "the default a literal", block.table, c.name, value,
                            c.default_expression)
            fills[c.name] = value
        return names, fills

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
        data = self.block_data(block, batch, dead_letter_incarnation=(
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
            expired = self._expired(table, block) if block.replay else None
            if (expired or (by_hash and (block.replay or attempts > 1
                                         or late > LATE_FIRST_SEND_S))) \
                    and self._already_stored(client, block, table, data,
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
            answers.append(self._with_retries("(query)", lambda c: _execute(c, sql, None)))
        versions: dict[str, list[int]] = {}
        for rows in answers:
            for database, name, version in rows:
                versions.setdefault(f"{database}.{name}", []).append(int(version))
        return int(self._with_retries("(query)", lambda c: self._structure.mark(
            functools.partial(_execute, c), tables, versions)))

    def _expired(self, table: str, block: Block) -> str | None:
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
            create = str(self.query(f"SHOW CREATE TABLE {table}")[0][0])
            window: int | None = None
            if re.search(r"ENGINE\s*=\s*Replicated", create):
                window = _setting_in_create(create, DEDUP_AGE_SETTING)
                if window is None:
                    window = self._merge_tree_setting(DEDUP_AGE_SETTING, DEFAULT_DEDUP_AGE_S)
            self._dedup_ages[table] = window
        return self._dedup_ages[table]

    def _already_stored(self, client: Client, block: Block, table: str, data: BlockData,
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
        risk = expired or resend_risk(functools.partial(_execute, client), table, mark)
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
        for replica in self.config.replicas:
            try:
                row = self._client(replica).execute(sql, params)[0]
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
        if (not marked and self.config.allow_stored_coordinates
                and any(c for c in counts)):
            return self._unsettled_resend(where, kind, risk, unattributable_error(
                where, kind, risk, table, coordinates, counts, "has no "
                f"{coordinates.incarnation} column and clickhouse.allow_stored_coordinates "
                "let the partition start without checking that no other incarnation's "
                "rows are there"), bool(expired))
        if full >= max(1, self.config.insert_quorum):
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
            choice, setting = self.config.expired_replay, "expired_replay"
        else:
            choice, setting = self.config.replay_across_alter, "replay_across_alter"
        if choice == "refuse":
            raise (ReplayBeyondDedupAge if expired else ReplayAcrossAlter)(refusal)
        log.warning("block %s (%s) %s although %s: %s = %r", where, kind,
                    "not sent" if choice == "skip" else "sent again", risk, setting, choice)
        return choice == "skip"

    def _wait_for_earlier_attempt(self, query_id: str, where: str) -> list[str]:
        """:meth:`_still_running`, polled every second until no replica runs the
        query or ``earlier_attempt_wait_s`` passed; the replicas still running it."""
        began = self._clock()
        next_warning = 0.0
        while True:
            running = self._still_running(query_id)
            waited = self._clock() - began
            if not running or waited >= self.config.earlier_attempt_wait_s:
                return running
            if waited >= next_warning:
                log.warning("block %s: an earlier attempt of it is still running on %s "
                            "(%.0f s); its rows are counted once it ends", where,
                            ", ".join(running), waited)
                next_warning += 30.0
            self._sleep(1.0)

    def _still_running(self, query_id: str) -> list[str]:
        """The replicas where an attempt of the block with ``query_id`` is still
        running. Counted before then, its rows would read 0 and the block would be
        sent again; if the earlier attempt then commits (18.16 applies an ``ALTER``
        behind a running insert) both copies would be kept. A replica that does not
        answer is left to the row count, which then reads as unsettled."""
        sql = "SELECT count() FROM system.processes WHERE query_id = %(id)s"
        running = []
        for replica in self.config.replicas:
            try:
                if int(self._client(replica).execute(sql, {"id": query_id})[0][0]):
                    running.append(f"{replica.host}:{replica.port}")
            except Exception:
                self._drop(replica)
        return running

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
        for attempt in range(1, self.config.max_attempts + 1):
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
            log.log(retry_level(attempt, self.config.max_attempts, last_code, last_message),
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
                self.replica_states(what)))
        raise InsertFailed(what, last_code, last_message, attempts)

    def replica_states(self, table: str) -> list[ReplicaState]:
        """Every replica's view of ``table``, one query each (no retry: this explains a
        failure, it must not prolong it)."""
        database, name = table.split(".", 1) if "." in table else ("default", table)
        params = {"db": database, "t": name}
        states = []
        for replica in self.config.replicas:
            address = f"{replica.host}:{replica.port}"
            try:
                client = self._client(replica)
                rows = client.execute(
                    "SELECT replica_name, is_readonly, is_session_expired, queue_size, "
                    "absolute_delay FROM system.replicas WHERE database = %(db)s AND "
                    "table = %(t)s", params)
                stuck = client.execute(
                    "SELECT type, num_tries, last_exception FROM system.replication_queue "
                    "WHERE database = %(db)s AND table = %(t)s AND last_exception != '' "
                    "ORDER BY num_tries DESC LIMIT 1", params)
            except Exception as exc:
                self._drop(replica)
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


def _execute(client: Client, sql: str, params: Any) -> Any:
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


def _runs(payloads: Sequence[Rows]) -> list[tuple[ColumnSet, int, int]]:
    """The payloads' rows as runs ``(columns, start, stop)``: consecutive payloads that
    are adjacent slices of one ColumnSet (the usual case: one decode per table and
    partition) are taken as one slice (as :meth:`rows.Payloads.runs` does)."""
    runs: list[tuple[ColumnSet, int, int]] = []
    for p in payloads:
        if runs and runs[-1][0] is p.columns and runs[-1][2] == p.start:
            runs[-1] = (p.columns, runs[-1][1], p.stop)
        else:
            runs.append((p.columns, p.start, p.stop))
    return runs


def is_quorum_failure(code: int | None, message: str) -> bool:
    """Whether a refused insert says the quorum could not be reached."""
    return code in QUORUM_CODES or (code in (159, 319) and "quorum" in message.lower())


def retry_level(attempt: int, attempts: int, code: int | None, message: str) -> int:
    """How loud a failed attempt that is retried is: INFO while it is what a healthy
    cluster does now and then (a first failure, or another insert's quorum still
    pending: 18.16 takes one quorum insert per table at a time, so partitions writing
    one table queue behind each other), WARNING once it persists and at the last
    attempt. Pure."""
    pending = code == 286 and "previous write" in message
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


def _setting_in_create(create: str, name: str) -> int | None:
    m = re.search(rf"\b{name}\s*=\s*(\d+)", create)
    return int(m.group(1)) if m else None
