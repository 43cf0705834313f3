"""An insert's query packet as bytes kept per connection (docs/protocol.md, *The
insert's bytes*).

Every insert of a batch sends the same query packet but for its query id, its query
text and (on servers that take it) the client info's start time. clickhouse-driver
rebuilds it for each insert; :func:`insert_query_packet` captures the driver's own
bytes once per connection and cuts them around what changes, so the server receives
byte for byte what the driver would have sent (``tests/unit/clickhouse/test_native.py``
compares them for three protocol revisions). :func:`end_of_data_packet` is the
driver's empty Data block that ends an insert's data.
"""

from __future__ import annotations

from typing import Any, Final

QUERY_PACKET_TYPE: Final = b"\x01"
"""clickhouse-driver's ``ClientPacketTypes.QUERY`` as a varint."""

_SETTINGS_KEPT: Final = 256
"""Settings' bytes kept per connection (a per-block setting such as
``insert_deduplication_token`` makes each insert its own entry, written afresh)."""


class _Captured:
    """A stand-in for the driver's socket writer that keeps what is written."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.parts.append(bytes(data))

    def flush(self) -> None:
        pass

    def value(self) -> bytes:
        return b"".join(self.parts)


class QueryPacket:
    """An insert's query packet on one connection, in the pieces around what changes
    from insert to insert (docs/protocol.md, *The insert's bytes*): ``info``, the
    client info to write afresh (servers that take the query's start time), else
    ``None`` and ``client_info`` holds its bytes; then the settings' bytes (kept per
    settings, :meth:`before_query`), ``middle`` up to the query text, and
    ``after_query`` (the query's parameters and the empty external tables)."""

    __slots__ = ("after_query", "client_info", "flags", "info", "middle", "settings",
                 "settings_as_strings")

    def __init__(self, info: Any, client_info: bytes, settings_as_strings: bool,
                 flags: int, middle: bytes, after_query: bytes) -> None:
        self.info = info
        self.client_info = client_info
        self.settings_as_strings = settings_as_strings
        self.flags = flags
        self.middle = middle
        self.after_query = after_query
        self.settings: dict[tuple[tuple[str, Any], ...], bytes] = {}

    def settings_bytes(self, settings: dict[str, Any]) -> bytes:
        """The driver's ``write_settings`` of ``settings`` for this connection."""
        from clickhouse_driver.settings.writer import write_settings

        written = _Captured()
        write_settings(settings, written, self.settings_as_strings, self.flags)
        return written.value()

    def before_query(self, settings: dict[str, Any]) -> bytes:
        """The bytes between the query id (or the fresh client info) and the query
        text, for these settings."""
        try:
            key = tuple(settings.items())
            kept = self.settings.get(key)
        except TypeError:  # a setting's value that cannot be a key
            return self.client_info + self.settings_bytes(settings) + self.middle
        if kept is None:
            if len(self.settings) >= _SETTINGS_KEPT:
                self.settings.clear()
            kept = self.settings[key] = (self.client_info + self.settings_bytes(settings)
                                         + self.middle)
        return kept


def insert_query_packet(connection: Any) -> QueryPacket | None:
    """:class:`QueryPacket` for ``connection`` as it stands (server revision, client
    settings), cut from the bytes the driver's own ``send_query`` and
    ``send_external_tables(None)`` write (captured into a buffer), and kept on the
    connection until one of those changes. ``None`` when the captured bytes do not
    split as expected (then the insert takes the driver's methods).
    ``tests/unit/clickhouse/test_native.py`` checks that the pieces make the driver's
    packet byte for byte."""
    context = connection.context
    client = context.client_settings
    key = (connection.server_info.used_revision, connection.settings_is_important,
           connection.compression, connection.client_name, connection.client_revision,
           client.get("server_side_params"), client.get("quota_key"),
           client.get("opentelemetry_traceparent"), client.get("opentelemetry_tracestate"))
    kept: tuple[Any, QueryPacket | None] | None = getattr(
        connection, "_blockagg_query_packet", None)
    if kept is not None and kept[0] == key:
        return kept[1]
    packet = _query_packet(connection)
    connection._blockagg_query_packet = (key, packet)
    return packet


def _query_packet(connection: Any) -> QueryPacket | None:
    """:func:`insert_query_packet` on a new key: after the client info, the driver's
    packet for an empty query and for a one-character one differ exactly at the query
    text, which splits it; the settings are cut off the front of what precedes it."""
    from clickhouse_driver import defines
    from clickhouse_driver.clientinfo import ClientInfo
    from clickhouse_driver.settings.writer import SettingsFlags

    def driver(query: str) -> bytes:
        def write() -> None:
            connection.send_query(query, query_id="")
            connection.send_external_tables(None)
        return _capture(connection, write)

    revision = connection.server_info.used_revision
    head = QUERY_PACKET_TYPE + b"\x00"
    info: Any = None
    start = len(head)
    if revision >= defines.DBMS_MIN_REVISION_WITH_CLIENT_INFO:
        info = ClientInfo(connection.client_name, connection.context,
                          client_revision=connection.client_revision)
        info.query_kind = ClientInfo.QueryKind.INITIAL_QUERY
        written = _Captured()
        info.write(revision, written)
        start += len(written.value())
    timed = revision >= defines.DBMS_MIN_PROTOCOL_VERSION_WITH_INITIAL_QUERY_START_TIME
    empty, one = driver(""), driver("?")
    if not (empty.startswith(head) and one.startswith(head)
            and (timed or empty[:start] == one[:start])):
        return None
    tail_empty, tail_one = empty[start:], one[start:]
    at = _first_difference(tail_empty, tail_one)
    if (at < 0 or tail_empty[at] != 0
            or tail_one != tail_empty[:at] + b"\x01?" + tail_empty[at + 1:]):
        return None
    packet = QueryPacket(info if timed else None, b"" if timed else empty[len(head):start],
                         revision >= defines.DBMS_MIN_REVISION_WITH_SETTINGS_SERIALIZED_AS_STRINGS,
                         SettingsFlags.IMPORTANT if connection.settings_is_important else 0,
                         b"", tail_empty[at + 1:])
    settings = packet.settings_bytes(connection.context.settings)
    if not tail_empty[:at].startswith(settings):
        return None
    packet.middle = tail_empty[len(settings):at]
    return packet


def _first_difference(a: bytes, b: bytes) -> int:
    """The first index where ``a`` and ``b`` differ (-1 if one starts the other)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return -1


def end_of_data_packet(connection: Any) -> bytes:
    """The bytes of the driver's ``connection.send_data(ColumnOrientedBlock())`` (the
    empty block that ends an insert's data), captured once per server revision."""
    revision = connection.server_info.used_revision
    kept: tuple[int, bytes] | None = getattr(connection, "_blockagg_end_of_data", None)
    if kept is not None and kept[0] == revision:
        return kept[1]
    from clickhouse_driver.block import ColumnOrientedBlock

    captured = _capture(connection, lambda: connection.send_data(ColumnOrientedBlock()))
    connection._blockagg_end_of_data = (revision, captured)
    return captured


def _capture(connection: Any, write: Any) -> bytes:
    """What ``write()`` sends on ``connection`` (its writer and its block stream's
    swapped for a buffer meanwhile)."""
    captured = _Captured()
    fout, stream = connection.fout, connection.block_out
    stream_fout = stream.fout
    connection.fout = stream.fout = captured
    try:
        write()
    finally:
        connection.fout, stream.fout = fout, stream_fout
    return captured.value()
