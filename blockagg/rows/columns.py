"""From encoded rows to insertable columns, and the message payloads of a Batch.

The task side decodes every message of a micro-batch partition *before* the core
routes it, so a message whose rows don't decode or convert is known to be a dead
letter when the core sees it (its table id is 0): routing stays a pure function of
the messages. Decoding is vectorised over all messages of one (table, version), and
in a batch over all tables of one shape (:func:`decide_envelopes_many`: one decode
and conversion per message type, not per table, the same columns):
:func:`decode_messages` returns one :class:`Rows` payload per good message (a slice
of a shared :class:`ColumnSet`) and a reason per bad one; :func:`decide_envelopes`
the same as :class:`Decisions`, which the task keeps as :class:`Payloads` (columns and
row ranges, no object per message). The writer concatenates the rows of a block's
positions, in order, into one insert.

Kafka coordinates: a table with columns ``_topic``, ``_partition`` and ``_offset``
gets them filled from the message each row came from, which makes every block's
content unique and so defeats 18.16's content-hash deduplication dropping a *new*
block that happens to equal a recent one. A table that also has ``_incarnation``
gets the batch's topic incarnation there (``Pins.incarnation``), so a recreated
topic's block at the same coordinates is another block too (the token carries the
incarnation on 22.2+; this column is its content-hash counterpart).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Final, overload

import numpy as np
import numpy.typing as npt
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from blockagg.proto.decode import PAD, Decoded, decode_in_place, decode_ranges, decode_rows
from blockagg.proto.envelope import Envelopes
from blockagg.rows.types import (
    CHType,
    convert_array,
    convert_column,
    field_mismatch,
    parse_type,
)

I64 = npt.NDArray[np.int64]

COORDINATE_COLUMNS: Final = ("_topic", "_partition", "_offset")
"""Optional columns the writer fills with the row's Kafka coordinates."""

INCARNATION_COLUMN: Final = "_incarnation"
"""Optional ``UInt64`` column the writer fills with the batch's topic incarnation
(``Pins.incarnation``): with it, two incarnations of a topic never give a block the
same content, and the re-send check counts only this incarnation's rows."""

WRITER_COLUMNS: Final = (*COORDINATE_COLUMNS, INCARNATION_COLUMN)
"""Every column blockagg fills itself; no message field may fill one."""


@dataclass(frozen=True)
class Column:
    """A live table column as ``system.columns`` reports it."""

    name: str
    type: str
    default_kind: str = ""
    default_expression: str = ""


@dataclass(frozen=True)
class TablePlan:
    """How rows of one registered version of a table become an insert.

    ``fields[i]`` feeds ``columns[i]``; coordinate columns have no field. Columns
    with a DEFAULT/MATERIALIZED/ALIAS expression and no field are left out of the
    insert so the server computes them.
    """

    table: str
    table_id: int
    version: int
    descriptor: Descriptor
    columns: tuple[str, ...]
    types: tuple[CHType, ...]
    fields: tuple[FieldDescriptor | None, ...]
    live: tuple[Column, ...] = ()
    """Every live column of the table (``system.columns`` order) the plan was made
    against; the writer uses it to line up blocks that mix schema versions."""

    @property
    def coordinates(self) -> bool:
        return all(c in self.columns for c in COORDINATE_COLUMNS)

    @cached_property
    def shape(self) -> tuple[Any, ...]:
        """What decides the plan's decoded and converted columns: its descriptor
        (one object per distinct schema), and each column's field and type. Plans of
        one shape are decoded together (:func:`decide_envelopes_many`)."""
        return (id(self.descriptor), repr(self.types),
                tuple(None if fd is None else id(fd) for fd in self.fields))

    @property
    def incarnation(self) -> bool:
        """Whether the plan fills :data:`INCARNATION_COLUMN`."""
        return INCARNATION_COLUMN in self.columns


def match_columns(descriptor: Descriptor, columns: Sequence[Column]) -> tuple[
        dict[str, FieldDescriptor], list[str]]:
    """Map column names to fields and list every mismatch.

    Rules: a column matches the field with the same name; failing that, the one
    whose name is equal ignoring case (if exactly one). Nested messages map to a
    ``Tuple`` column of the field's name (no flattening). Every field needs a
    column; every column without a default needs a field, except the coordinate
    columns and ``_incarnation``, which no field may fill (blockagg writes the Kafka
    topic, partition, offset and topic incarnation there: a producer's value could
    make two different blocks hash alike, and the re-send check would count rows that
    are not the block's); types must convert
    (:func:`blockagg.rows.types.field_mismatch`).
    """
    fields = {fd.name: fd for fd in descriptor.fields}
    lower: dict[str, list[FieldDescriptor]] = {}
    for each in descriptor.fields:
        lower.setdefault(each.name.lower(), []).append(each)
    mapping: dict[str, FieldDescriptor] = {}
    problems: list[str] = []
    used: set[str] = set()
    for col in columns:
        if col.default_kind in ("MATERIALIZED", "ALIAS"):
            continue
        fd: FieldDescriptor | None = fields.get(col.name)
        if fd is None and len(lower.get(col.name.lower(), [])) == 1:
            fd = lower[col.name.lower()][0]
        if fd is not None and col.name in WRITER_COLUMNS:
            problems.append(
                f"field {fd.name} (number {fd.number}) of {descriptor.full_name} would fill "
                f"column {col.name}, which blockagg fills with the message's Kafka "
                "coordinates and topic incarnation (they keep two equal blocks apart and "
                "let a re-send find its rows); rename the field (its number stays, so the "
                "wire format does not change) and its column")
            used.add(fd.name)
            continue
        if col.name == INCARNATION_COLUMN and col.type != "UInt64":
            problems.append(f"column {col.name} is {col.type}; blockagg fills it with the "
                            "topic incarnation, a 64-bit unsigned fingerprint: make it "
                            f"UInt64 (ALTER TABLE ... MODIFY COLUMN {col.name} UInt64)")
            continue
        if fd is None:
            if col.name not in WRITER_COLUMNS and not col.default_kind:
                problems.append(f"column {col.name} {col.type} has no field in "
                                f"{descriptor.full_name} and no DEFAULT")
            continue
        try:
            reason = field_mismatch(parse_type(col.type), fd)
        except Exception as exc:
            reason = str(exc)
        if reason:
            problems.append(f"column {col.name} {col.type} <- field {fd.name}: {reason}")
        mapping[col.name] = fd
        used.add(fd.name)
    for each in descriptor.fields:
        if each.name not in used:
            problems.append(f"field {each.name} (number {each.number}) of {descriptor.full_name} "
                            "has no column")
    return mapping, problems


def make_plan(table: str, table_id: int, version: int, descriptor: Descriptor,
              columns: Sequence[Column]) -> tuple[TablePlan, list[str]]:
    """The insert plan for one registered version against the live columns, and
    the mismatches (an empty list means the plan is safe to use)."""
    mapping, problems = match_columns(descriptor, columns)
    names: list[str] = []
    types: list[CHType] = []
    feeds: list[FieldDescriptor | None] = []
    for col in columns:
        if col.name in mapping or col.name in WRITER_COLUMNS:
            if col.default_kind in ("MATERIALIZED", "ALIAS"):
                continue
            names.append(col.name)
            types.append(parse_type(col.type))
            feeds.append(mapping.get(col.name))
    plan = TablePlan(table, table_id, version, descriptor, tuple(names), tuple(types),
                     tuple(feeds), tuple(columns))
    return plan, problems


def with_incarnation(plan: TablePlan, live: Sequence[Column]) -> TablePlan:
    """``plan`` filling :data:`INCARNATION_COLUMN` too when the live table has it and
    the plan does not (a version registered before the column was added): the
    column is blockagg's, not the producer's, so adding it needs no new version. A
    replay across that ``ALTER`` sends a block its first attempt did not; the
    re-send check (``structure.resend_risk``) sees the ALTER and counts the rows
    first, and refuses when rows of unknown incarnation are at the block's
    coordinates (``resend.ResendCheck.already_stored``). Pure."""
    column = next((c for c in live if c.name == INCARNATION_COLUMN), None)
    if (column is None or plan.incarnation or column.type != "UInt64"
            or column.default_kind in ("MATERIALIZED", "ALIAS")):
        return plan
    live_columns = plan.live if any(c.name == INCARNATION_COLUMN for c in plan.live) else (
        *plan.live, column)
    return replace(plan, columns=(*plan.columns, INCARNATION_COLUMN),
                   types=(*plan.types, parse_type(column.type)), fields=(*plan.fields, None),
                   live=live_columns)


@dataclass(frozen=True, eq=False)
class ColumnSet:
    """Converted columns of many messages' rows: ``values[j][r]`` is column ``j``
    of row ``r`` (coordinate columns are empty; the writer fills them). A column is
    a list, or a numpy array (:func:`blockagg.rows.types.convert_array`)
    whose ``tolist()`` is that list."""

    plan: TablePlan
    values: tuple[list[Any] | npt.NDArray[Any], ...]


@dataclass(frozen=True, eq=False)
class Rows:
    """A message's payload: its rows ``[start, stop)`` of ``columns``."""

    columns: ColumnSet
    start: int
    stop: int

    @property
    def count(self) -> int:
        return self.stop - self.start


def decode_messages(plan: TablePlan, messages: Sequence[Sequence[bytes]],
                    columnar: bool = True) -> list[Rows | str]:
    """Decode and convert the rows of ``messages`` (each a message's encoded rows)
    for ``plan``. Returns, per message, its :class:`Rows` or the reason it is a dead
    letter (the first failing row's). Pure and deterministic.

    ``columnar`` converts with :func:`~blockagg.rows.types.convert_array`
    (numpy columns where a vectorised rule exists); False keeps the per-value
    :func:`~blockagg.rows.types.convert_column` lists (the previous path,
    kept as the benchmark's baseline). Both give the same values and reasons."""
    counts = np.fromiter(map(len, messages), dtype=np.int64, count=len(messages))
    flat: list[bytes] = [row for rows in messages for row in rows]
    return _messages(plan, decode_rows(plan.descriptor, flat), counts, columnar)


@dataclass(frozen=True, eq=False)
class Decisions:
    """Many messages' rows decoded at once (one :class:`ColumnSet`): message ``i``'s
    rows are ``bounds[i]:bounds[i + 1]`` of ``columns``, unless ``reasons[i]`` says
    why it is a dead letter. What :func:`decode_messages` gives, without a
    :class:`Rows` per message."""

    columns: ColumnSet
    bounds: I64
    reasons: dict[int, str]


def decide_envelopes(plan: TablePlan, envelopes: Envelopes, messages: I64,
                     columnar: bool = True) -> Decisions:
    """:func:`decode_messages` of accepted ``messages`` of ``envelopes`` as
    :class:`Decisions`: the same columns, rows and reasons. The rows are decoded in
    their messages' spans (:func:`proto.decode.decode_in_place`, one copy per
    message), and laid out as ``decode_messages`` lays them out
    (:meth:`~proto.envelope.Envelopes.rows_of`) and decoded again only when one of
    them does not decode, so that its reason is that layout's."""
    buf, starts, ends, counts = envelopes.rows_in_spans(messages)
    decoded = decode_in_place(plan.descriptor, buf, starts, ends)
    if decoded is None:
        buf, starts, ends, counts = envelopes.rows_of(messages)
        decoded = decode_ranges(plan.descriptor, buf, starts, ends)
    return _decide(plan, decoded, counts, columnar)


def decide_envelopes_many(items: Sequence[tuple[TablePlan, I64]], envelopes: Envelopes,
                          columnar: bool = True) -> list[Decisions]:
    """:func:`decide_envelopes` of each ``(plan, messages)`` of ``items``, the same
    :class:`Decisions` row for row, with the per-call cost paid once per *shape*
    rather than once per table: the items whose plans share the message descriptor
    (:attr:`proto.registry.SchemaVersion.descriptor` is one object per distinct
    schema) and convert the same fields to the same types are decoded in one
    :func:`~proto.decode.decode_in_place` and converted in one
    :func:`~blockagg.rows.types.convert_array` per column; each item gets a
    :class:`ColumnSet` of its own plan over those shared columns, its rows a range of
    them.

    Why the columns are the same as one call per item gives: a row that decodes is
    read within its own bytes (:func:`~proto.decode.decode_in_place`) and the
    vectorised conversions are elementwise, so each item's rows get the same values
    and, as the shared path is taken only when every column converts to an array or
    a Native column (no list), the same representation, hence the same insert bytes
    (the block's deduplication hash). When a row of the shape does not decode or
    convert, or a column falls back to lists, each item of that shape goes through
    :func:`decide_envelopes` alone, whose reasons are the per-message path's."""
    out: list[Decisions | None] = [None] * len(items)
    shapes: dict[tuple[Any, ...], list[int]] = {}
    for k, (plan, _) in enumerate(items):
        if not columnar:
            out[k] = decide_envelopes(plan, envelopes, items[k][1], columnar)
            continue
        shapes.setdefault(plan.shape, []).append(k)
    for members in shapes.values():
        for chunk in _chunks(members, items, envelopes):
            shared = (_decide_shared([items[k] for k in chunk], envelopes)
                      if len(chunk) > 1 else None)
            for j, k in enumerate(chunk):
                out[k] = shared[j] if shared is not None else decide_envelopes(
                    items[k][0], envelopes, items[k][1], columnar)
    return [d for d in out if d is not None]


SHARED_DECODE_ROWS = 1 << 15
"""Rows decoded together at most (:func:`decide_envelopes_many`): enough to pay the
per-call cost once for many small tables, small enough that the decoder's temporary
arrays stay in cache and are reused rather than freshly mapped (a single pass over a
batch's 500k rows cost more CPU than the per-table calls it saved)."""


def _chunks(members: list[int], items: Sequence[tuple[TablePlan, I64]],
            envelopes: Envelopes) -> Iterator[list[int]]:
    """``members`` (item indexes) in order, cut into runs of at most
    :data:`SHARED_DECODE_ROWS` rows (an item bigger than that alone)."""
    chunk: list[int] = []
    rows = 0
    for k in members:
        messages = items[k][1]
        n = int((envelopes.row_hi[messages] - envelopes.row_lo[messages]).sum())
        if chunk and rows + n > SHARED_DECODE_ROWS:
            yield chunk
            chunk, rows = [], 0
        chunk.append(k)
        rows += n
    if chunk:
        yield chunk


def _decide_shared(items: Sequence[tuple[TablePlan, I64]], envelopes: Envelopes
                   ) -> list[Decisions] | None:
    """The :class:`Decisions` of items of one shape (:func:`decide_envelopes_many`)
    from one decode and conversion, or ``None`` when a row does not decode or
    convert, or a column converts to a list."""
    sizes = [m.size for _, m in items]
    messages = np.concatenate([m for _, m in items])
    buf, starts, ends, counts = _rows_where_they_lie(envelopes, messages)
    plan = items[0][0]
    decoded = decode_in_place(plan.descriptor, buf, starts, ends)
    if decoded is None:
        return None
    values: list[Any] = []
    for ch, fd in zip(plan.types, plan.fields, strict=True):
        if fd is None:
            values.append([])
            continue
        converted = convert_array(ch, fd, decoded.columns[fd.name])
        if converted.errors or isinstance(converted.values, list):
            return None
        values.append(converted.values)
    shared = tuple(values)
    edges = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    out: list[Decisions] = []
    first = 0
    for (item_plan, _), size in zip(items, sizes, strict=True):
        part = counts[first:first + size]
        reasons = {int(i): "envelope carries no rows" for i in np.flatnonzero(part == 0)}
        out.append(Decisions(ColumnSet(item_plan, shared), edges[first:first + size + 1],
                             reasons))
        first += size
    return out


def _rows_where_they_lie(envelopes: Envelopes, messages: I64) -> tuple[
        npt.NDArray[np.uint8], I64, I64, I64]:
    """The rows of ``messages`` as :meth:`~proto.envelope.Envelopes.rows_in_spans`
    gives them, but left in the envelopes' buffer (which ends with the decoder's zero
    padding) instead of copied message by message: a row that decodes does so
    wherever it lies (:func:`~proto.decode.decode_in_place`)."""
    buf = envelopes.buf
    if buf.size < PAD or buf[buf.size - PAD:].any():
        return envelopes.rows_in_spans(messages)
    lo, hi = envelopes.row_lo[messages], envelopes.row_hi[messages]
    counts = hi - lo
    rows = (np.repeat(lo - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
            + np.arange(int(counts.sum()), dtype=np.int64))
    return buf, envelopes.row_starts[rows], envelopes.row_ends[rows], counts


def _messages(plan: TablePlan, decoded: Decoded, counts: I64, columnar: bool
              ) -> list[Rows | str]:
    decided = _decide(plan, decoded, counts, columnar)
    edges = decided.bounds.tolist()
    return [decided.reasons[i] if i in decided.reasons
            else Rows(decided.columns, edges[i], edges[i + 1]) for i in range(len(counts))]


def _decide(plan: TablePlan, decoded: Decoded, counts: I64, columnar: bool) -> Decisions:
    bounds = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    errors = dict(decoded.errors)
    values: list[Any] = []
    convert = convert_array if columnar else convert_column
    for name, ch, fd in zip(plan.columns, plan.types, plan.fields, strict=True):
        if fd is None:
            values.append([])
            continue
        converted = convert(ch, fd, decoded.columns[fd.name])
        for row, reason in converted.errors.items():
            errors.setdefault(row, f"column {name}: {reason}")
        values.append(converted.values)
    shared = ColumnSet(plan, tuple(values))
    bad_rows = np.array(sorted(errors), dtype=np.int64)
    owner = np.searchsorted(bounds, bad_rows, side="right") - 1
    first_error: dict[int, str] = {}
    for row, message in zip(bad_rows.tolist(), owner.tolist(), strict=True):
        if message not in first_error:
            first_error[message] = f"row {row - int(bounds[message])}: {errors[row]}"
    for i in np.flatnonzero(counts == 0).tolist():
        first_error.setdefault(i, "envelope carries no rows")
    return Decisions(shared, bounds, first_error)


@dataclass(frozen=True, eq=False)
class Payloads(Sequence[object]):
    """A batch's payloads (:attr:`aggregator.core.model.Batch.payloads`) without an
    object per message: message ``i`` is ``dead[i]`` (its dead letter) when
    ``sets[i]`` is -1, else rows ``starts[i]:stops[i]`` of ``columns[sets[i]]``.
    Indexing gives what the per-message list holds (a :class:`Rows`, made on
    demand); :meth:`runs` gives a block's rows as slices, as the writer takes them."""

    columns: tuple[ColumnSet, ...]
    sets: I64
    starts: I64
    stops: I64
    dead: dict[int, object]

    def __len__(self) -> int:
        return int(self.sets.size)

    @overload
    def __getitem__(self, i: int) -> object: ...

    @overload
    def __getitem__(self, i: slice) -> list[object]: ...

    def __getitem__(self, i: int | slice) -> object:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        k = int(self.sets[i])
        if k < 0:
            return self.dead.get(int(i) % len(self))
        return Rows(self.columns[k], int(self.starts[i]), int(self.stops[i]))

    def __iter__(self) -> Iterator[object]:
        return (self[i] for i in range(len(self)))

    def runs(self, positions: I64) -> tuple[list[tuple[ColumnSet, int, int]], I64] | None:
        """The rows of messages ``positions`` (in this order) as runs ``(columns, start,
        stop)``, adjacent slices of one :class:`ColumnSet` joined, and each message's
        row count; ``None`` if one of them is not rows (a dead letter)."""
        k = self.sets[positions]
        if k.size == 0 or bool((k < 0).any()):
            return None
        a, b = self.starts[positions], self.stops[positions]
        first = np.ones(k.size, dtype=np.bool_)
        first[1:] = (k[1:] != k[:-1]) | (a[1:] != b[:-1])
        heads = np.flatnonzero(first)
        tails = np.append(heads[1:], k.size) - 1
        runs = [(self.columns[int(k[h])], int(a[h]), int(b[t]))
                for h, t in zip(heads.tolist(), tails.tolist(), strict=True)]
        return runs, b - a
