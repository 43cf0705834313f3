"""blockagg's own Native serialisation (aggregator.clickhouse.native) writes, for every
type it handles, the very bytes clickhouse-driver writes for the same values: 18.16
deduplicates a retried block by the hash of its data, so a block must serialise alike
whichever writer (or version of it) sends it. Seeded property tests against the
driver's own column writers, plus the block framing against its BlockOutputStream."""

from __future__ import annotations

import itertools
import socket
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockagg.aggregator.clickhouse import native
from blockagg.aggregator.clickhouse.exceptions import ClickHouseError
from blockagg.aggregator.clickhouse.native import NativeBlock, concat, encode_column, native_type_ok
from blockagg.rows.layout import EnumColumn, ListColumn, StringColumn
from blockagg.rows.types import INT_RANGES, NUMPY_DTYPES, parse_type


class ServerInfo:
    used_revision = 54467  # newer than every revision check the framing has

    def get_timezone(self) -> str:
        return "UTC"


def _context() -> Any:
    from clickhouse_driver.context import Context

    ctx = Context()
    ctx.client_settings = {"use_numpy": False, "strings_as_bytes": False,
                           "strings_encoding": "utf-8", "input_format_null_as_default": False}
    ctx.settings = {}
    ctx.server_info = ServerInfo()
    return ctx


def captured(write: Callable[[Any], None]) -> bytes:
    """What ``write(buffer)`` sends through clickhouse-driver's socket writer."""
    from clickhouse_driver.bufferedwriter import BufferedSocketWriter

    a, b = socket.socketpair()
    received: list[bytes] = []

    def drain() -> None:
        while chunk := b.recv(1 << 16):
            received.append(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        out = BufferedSocketWriter(a, 1 << 16)
        write(out)
        out.flush()
    finally:
        a.shutdown(socket.SHUT_WR)
        a.close()
        reader.join(10)
        b.close()
    return b"".join(received)


def driver_bytes(spec: str, items: list[Any]) -> bytes:
    from clickhouse_driver.columns.service import write_column

    ctx = _context()
    return captured(lambda out: write_column(ctx, "c", spec, list(items), out))


ENUM8 = "Enum8('a' = -128, 'b\\'q' = 0, 'é' = 5, 'z' = 127)"
ENUM16 = "Enum16('lo' = -32768, 'mid' = 300, 'hi' = 32767)"
SCALARS = [*INT_RANGES, "Float32", "Float64", "DateTime"]


def _numbers(name: str) -> st.SearchStrategy[Any]:
    if name in INT_RANGES:
        lo, hi = INT_RANGES[name]
        return st.integers(lo, hi)
    if name == "DateTime":
        return st.integers(0, 2**32 - 1)
    if name == "Float32":
        return st.floats(width=32, allow_nan=False)
    return st.floats(allow_nan=False)


def _strings() -> st.SearchStrategy[str]:
    # lengths across the varint widths (1, 2 and 3 bytes)
    return st.one_of(st.text(max_size=20), st.text(min_size=120, max_size=140),
                     st.builds(lambda k, c: c * k, st.integers(16_380, 16_390),
                               st.sampled_from(["x", "é"])))


def _column(spec: str, values: list[Any]) -> Any:
    """``values`` as convert_array would hold them for column ``spec``."""
    ch = parse_type(spec)
    if ch.name == "Array":
        inner = [v for row in values for v in row]
        offsets = np.cumsum([0, *map(len, values)]).astype(np.int64)
        return ListColumn(offsets, _column(str(ch.children[0]), inner))
    if ch.name == "String":
        binary = bool(values) and isinstance(values[0], bytes)
        return StringColumn.from_arrow(pa.array(values, type=pa.binary() if binary
                                                else pa.string()))
    if ch.name.startswith("Enum"):
        names = tuple(ch.enum)
        numbers = np.array([ch.enum[n] for n in names], dtype=np.int64)
        return EnumColumn(np.array([names.index(v) for v in values], dtype=np.intp), names,
                          numbers)
    return np.array(values, dtype=NUMPY_DTYPES[ch.name])


@st.composite
def columns(draw: st.DrawFn) -> tuple[str, list[Any]]:
    base = draw(st.sampled_from([*SCALARS, "String", "Bytes", ENUM8, ENUM16]))
    if base == "Bytes":
        element: st.SearchStrategy[Any] = st.binary(max_size=200)
        spec = "String"
    elif base == "String":
        element, spec = _strings(), "String"
    elif base.startswith("Enum"):
        element, spec = st.sampled_from(list(parse_type(base).enum)), base
    else:
        element, spec = _numbers(base), base
    if draw(st.booleans()):
        return f"Array({spec})", draw(st.lists(st.lists(element, max_size=6), max_size=30))
    return spec, draw(st.lists(element, max_size=40))


@settings(max_examples=400, derandomize=True, deadline=None)
@given(columns())
def test_native_bytes_are_the_drivers(case: tuple[str, list[Any]]) -> None:
    spec, values = case
    column = _column(spec, values)
    assert native_type_ok(parse_type(spec))
    assert column.tolist() == _column(spec, values).tolist()
    assert encode_column(parse_type(spec), column) == driver_bytes(spec, values)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(columns(), st.data())
def test_strings_encode_alike_compiled_and_with_numpy(case: tuple[str, list[Any]],
                                                     data: st.DataObject) -> None:
    """``_native.c`` and the numpy encoder write the same bytes, slices included (where a
    column's offsets do not start at 0)."""
    spec, values = case
    if spec not in ("String", "Array(String)"):
        return
    assert native._compiled is not None, "pip install -e . builds _native.c (a C compiler)"
    column = _column(spec, values)
    a = data.draw(st.integers(0, len(values)))
    part = column[a:]
    compiled = encode_column(parse_type(spec), part)
    kept = native._compiled
    try:
        native._compiled = None
        assert encode_column(parse_type(spec), part) == compiled
    finally:
        native._compiled = kept
    assert compiled == driver_bytes(spec, values[a:])


def test_compiled_strings_refuse_offsets_outside_the_data() -> None:
    compiled = native._compiled
    assert compiled is not None
    data = np.frombuffer(b"abc", dtype=np.uint8)
    assert compiled.strings(np.asarray([1, 3], dtype=np.int64), data) == b"\x02bc"
    for offsets, why in (([0, 4], "outside"), ([2, 1], "decrease"), ([], "at least one")):
        with pytest.raises(ValueError, match=why):
            compiled.strings(np.asarray(offsets, dtype=np.int64), data)


@settings(max_examples=200, derandomize=True, deadline=None)
@given(columns(), st.data())
def test_slices_and_concat_keep_the_rows(case: tuple[str, list[Any]], data: st.DataObject
                                         ) -> None:
    """A block's column is slices of decoded columns joined (the writer's runs): the
    same rows, the same bytes as the joined values written at once."""
    spec, values = case
    column = _column(spec, values)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(values)), max_size=4)))
    bounds = [0, *cuts, len(values)]
    parts = [column[a:b] for a, b in itertools.pairwise(bounds)]
    joined = concat(parts)
    assert joined.tolist() == list(values) == [v for p in parts for v in p.tolist()]
    assert encode_column(parse_type(spec), joined) == driver_bytes(spec, values)
    for part, (a, b) in zip(parts, itertools.pairwise(bounds), strict=True):
        assert encode_column(parse_type(spec), part) == driver_bytes(spec, values[a:b])


@settings(max_examples=100, derandomize=True, deadline=None)
@given(st.one_of(st.text(max_size=12), st.text(min_size=126, max_size=130)),
       st.integers(0, 40), st.data())
def test_a_repeated_value_encodes_as_the_driver_writes_it(value: str, n: int,
                                                          data: st.DataObject) -> None:
    """``StringColumn.repeat`` (the ``_topic`` column) encodes its one value n times
    without a pass over the rows; the bytes are the driver's, sliced too."""
    column = StringColumn.repeat(value, n)
    assert encode_column(parse_type("String"), column) == driver_bytes("String", [value] * n)
    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    assert (encode_column(parse_type("String"), column[a:b])
            == driver_bytes("String", [value] * (b - a)))


def test_repeat_and_driver_items() -> None:
    topic = StringColumn.repeat("tøpic", 3)
    assert topic.tolist() == ["tøpic"] * 3
    assert encode_column(parse_type("String"), topic) == driver_bytes("String", ["tøpic"] * 3)
    assert StringColumn.repeat("x", 0).tolist() == []
    enum = _column(ENUM8, ["z", "a"])
    assert enum.driver_items().tolist() == ["z", "a"]
    lists = _column("Array(String)", [["a"], [], ["b", "c"]])
    assert lists.driver_items().tolist() == [["a"], [], ["b", "c"]]


def test_refuses_what_it_does_not_encode() -> None:
    assert not native_type_ok(parse_type("Nullable(Int64)"))
    assert not native_type_ok(parse_type("DateTime('UTC')"))
    assert not native_type_ok(parse_type("Array(Nullable(Int8))"))
    with pytest.raises(ClickHouseError):
        encode_column(parse_type("String"), np.array(["a"], dtype=object))
    with pytest.raises(ClickHouseError):
        concat([_column(ENUM8, ["a"]), _column(ENUM16, ["lo"])])


def test_block_framing_is_the_drivers() -> None:
    """The Data packet body NativeClient sends is BlockOutputStream's for the same
    block (block info, sizes, names, types, the custom-serialisation byte)."""
    from clickhouse_driver.block import ColumnOrientedBlock
    from clickhouse_driver.streams.native import BlockOutputStream

    specs = [("id", "UInt64"), ("name", "String"), ("kind", ENUM8),
             ("tags", "Array(Int64)")]
    values: list[list[Any]] = [[1, 2, 3], ["x", "", "yé"], ["a", "z", "a"],
                               [[1, -2], [], [3]]]
    block = NativeBlock([n for n, _ in specs], [parse_type(t) for _, t in specs],
                        [_column(t, v) for (_, t), v in zip(specs, values, strict=True)])
    ctx = _context()
    for revision in (54406, 54467):
        ctx.server_info.used_revision = revision
        want = captured(lambda out: BlockOutputStream(out, ctx).write(
            ColumnOrientedBlock(specs, [list(v) for v in values])))
        assert block.packet_body(specs, revision) == want
    assert block.matches(specs)
    assert not block.matches([*specs[:3], ("tags", "Array(Int32)")])
    assert not block.matches([("other", "UInt64"), *specs[1:]])


class _Sink:
    """The driver's socket writer, as a buffer."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.flushes = 0

    def write(self, data: bytes) -> None:
        self.data += data

    def flush(self) -> None:
        self.flushes += 1

    def take(self) -> bytes:
        out, self.data = bytes(self.data), bytearray()
        return out


class _Revision:
    def __init__(self, revision: int) -> None:
        self.used_revision = revision


def _insert_client(revision: int, settings: dict[str, Any]) -> tuple[Any, _Sink]:
    """A NativeClient whose connection is "connected" to a buffer, with the query
    settings an ``execute(..., settings=settings)`` gives it."""
    from clickhouse_driver.streams.native import BlockOutputStream

    from blockagg.aggregator.clickhouse.native import native_client_class

    client = native_client_class()("localhost", settings={"insert_deduplicate": 1})
    client.make_query_settings(settings)
    connection = client.connection
    sink = _Sink()
    connection.connected = True
    connection.server_info = connection.context.server_info = _Revision(revision)
    connection.fout = sink
    connection.block_out = BlockOutputStream(sink, connection.context)
    return client, sink


def _driver_query(client: Any, sink: _Sink, query: str, query_id: str) -> bytes:
    client.connection.send_query(query, query_id=query_id)
    client.connection.send_external_tables(None)
    return sink.take()


# 54406: ClickHouse 18.16's; 54449: the first with the query's start time; then the
# driver's own.
REVISIONS = (54406, 54449, 54467)


@pytest.fixture
def fixed_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """One start time for the driver's client info and NativeClient's (servers of
    revision 54449 and later get the query's start time in the packet)."""
    import time

    import clickhouse_driver.clientinfo

    monkeypatch.setattr(clickhouse_driver.clientinfo, "time", lambda: 1_700_000_000.25)
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.25)


@pytest.mark.parametrize("revision", REVISIONS)
@pytest.mark.usefixtures("fixed_clock")
def test_cached_query_packet_is_the_drivers(revision: int) -> None:
    """NativeClient's insert query packet (cached per connection) is byte for byte
    what the driver's send_query and send_external_tables write for the same insert,
    query id and settings (quorum included), on every call."""
    settings = {"insert_quorum": 2, "insert_quorum_timeout": 60_000, "use_numpy": True}
    client, sink = _insert_client(revision, settings)
    for query, query_id in itertools.product(
            ("INSERT INTO db.t (`id`, `name`) VALUES", "INSERT INTO db.u (`é`) VALUES",
             "INSERT INTO db.v (" + ", ".join(f"`c{i}`" for i in range(60)) + ") VALUES"),
            ("", "blockagg-t-0-12-34", "blockagg-t-0-35-99")):
        want = _driver_query(client, sink, query, query_id)
        client.send_insert_query(query, query_id)
        assert sink.take() == want
    assert b"insert_quorum" in want
    packet = client.connection._blockagg_query_packet[1]
    assert packet is not None
    assert len(packet.settings) == 1


@pytest.mark.usefixtures("fixed_clock")
def test_query_packet_cache_misses_on_a_changed_setting_table_or_revision() -> None:
    """Another setting value (a per-block token too), another table or another server
    revision gives the driver's bytes for it, never the cached ones; the connection's
    pieces are rebuilt for another revision only."""
    client, sink = _insert_client(54406, {"insert_quorum": 2})
    query = "INSERT INTO db.t (`id`) VALUES"
    client.send_insert_query(query, "q")
    first = sink.take()
    built = client.connection._blockagg_query_packet[1]

    def other_setting() -> str:
        client.make_query_settings({"insert_quorum": 1})
        return query

    def a_token() -> str:
        client.make_query_settings({"insert_quorum": 1, "insert_deduplication_token": "b-1"})
        return query

    def other_revision() -> str:
        client.connection.server_info.used_revision = 54467
        return query

    seen = {first}
    for change, rebuilt in ((other_setting, False),
                            (lambda: "INSERT INTO db.u (`id`) VALUES", False),
                            (other_revision, True), (a_token, False)):
        sql = change()
        want = _driver_query(client, sink, sql, "q")
        client.send_insert_query(sql, "q")
        got = sink.take()
        assert got == want
        assert got not in seen
        seen.add(got)
        now = client.connection._blockagg_query_packet[1]
        assert (now is not built) == rebuilt
        built = now
    assert b"insert_deduplication_token" in got


def test_end_of_data_is_the_drivers() -> None:
    """The empty block that ends an insert's data, sent with the block in one write
    on servers that answer nothing between them, is the driver's bytes for it."""
    from clickhouse_driver.block import ColumnOrientedBlock

    from blockagg.aggregator.clickhouse.query_packet import end_of_data_packet

    for revision in REVISIONS:
        client, sink = _insert_client(revision, {})
        client.connection.send_data(ColumnOrientedBlock())
        want = sink.take()
        assert end_of_data_packet(client.connection) == want
        assert sink.take() == b""


def test_a_kept_match_is_only_for_the_same_columns() -> None:
    """A sample block that matched one block's types does not match another block's
    of other types on the same names (the kept match is per names and types)."""
    specs = [("id", "UInt64"), ("name", "String")]
    good = NativeBlock(["id", "name"], [parse_type("UInt64"), parse_type("String")],
                       [np.array([1], dtype=np.uint64), _column("String", ["x"])])
    other = NativeBlock(["id", "name"], [parse_type("Int64"), parse_type("String")],
                        [np.array([1], dtype=np.int64), _column("String", ["x"])])
    for _ in range(2):
        assert good.matches(specs)
        assert not other.matches(specs)
    assert NativeBlock(good.names, good.types, list(good)).matches(specs)
