"""Compatibility between versions of a table's message type, judged on the
descriptors *and* on how each field becomes a ClickHouse column.

Why it matters here: the version a message decodes with is the one its envelope
names, and ``schema_version = 0`` resolves to the latest version registered by the
message's timestamp. So once v2 is registered, bytes that producers still encode
with v1 are read with v2 (and, when producers switch before the registration,
v2 bytes are read with v1). If the two disagree on what a field number means, the
values land in the wrong column or change on the way, and nothing downstream can
tell: the rows are well-formed. The modes (:class:`proto.modes.Mode`, which the
registry's read side needs too), as Confluent Schema Registry names them:

* ``BACKWARD`` (default): the new version reads data written with the latest one;
* ``FORWARD``: the latest version reads data written with the new one;
* ``FULL``: both;
* ``*_TRANSITIVE``: the same against every registered version, not only the latest;
* ``NONE``: no check.

A check compares a *reader* and a *writer* descriptor field by field number and
reports a :class:`Difference` for each way the reader would put a different value
into a column than the writer meant (rule names follow Confluent's protobuf
checker where the notion is the same; ``FIELD_NUMBER_CHANGED``,
``FIELD_PRESENCE_CHANGED``, ``FIELD_POSITION_CHANGED``, ``COLUMN_UNFILLED`` and
``COLUMN_OVERFLOW`` are this project's, since they come from the column mapping:
columns are matched by field name, Tuple elements by position). Added and removed fields are
compatible (the reader skips or defaults them) unless a column or a oneof says
otherwise. Pure: descriptors and ``system.columns`` rows in, differences out.

Above 500 lines because the rules of every compatibility mode for every kind of field change
form one table, read together so no mode is changed alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Final

from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor

from blockagg.proto.descriptors import is_repeated
from blockagg.proto.modes import Direction, Mode
from blockagg.rows.columns import WRITER_COLUMNS, Column, match_columns
from blockagg.rows.exceptions import TypeParseError
from blockagg.rows.types import INT_RANGES, TIMESTAMP, CHType, parse_type

_T = FieldDescriptor


@dataclass(frozen=True)
class Difference:
    """One broken rule: ``rule`` (e.g. ``FIELD_SCALAR_KIND_CHANGED``), where
    (``path``: message and field names, with the field number), why, and in which
    ``direction`` against which previous ``version`` (None for the rules that hold
    whatever reads what, about the columns)."""

    rule: str
    path: str
    detail: str
    direction: Direction | None = None
    version: int = 0

    def __str__(self) -> str:
        where = f"version {self.version}" if self.version else "the previous version"
        if self.direction is Direction.BACKWARD:
            how = f"BACKWARD: the new version reading data of {where}"
        elif self.direction is Direction.FORWARD:
            how = f"FORWARD: {where} reading data of the new version"
        else:
            how = f"against {where}"
        return f"{self.rule} at {self.path}: {self.detail} ({how})"


def check(mode: Mode, new: Descriptor, previous: Sequence[tuple[int, Descriptor]],
          columns: Sequence[Column] | None = None) -> list[Difference]:
    """Every difference that makes ``new`` break ``mode`` against ``previous``
    (``(version, descriptor)``, oldest first; only the last one unless the mode is
    transitive). ``columns`` are the live table's (None: judge the descriptors alone,
    assuming the strictest column where a rule depends on it)."""
    if not mode.directions or not previous:
        return []
    targets = previous if mode.transitive else previous[-1:]
    out: list[Difference] = []
    for version, old in targets:
        for i, direction in enumerate(mode.directions):
            out.extend(differences(old, new, direction, columns, version,
                                   column_rules=i == 0))
    return _unique(out)


def differences(previous: Descriptor, new: Descriptor, direction: Direction,
                columns: Sequence[Column] | None = None, version: int = 0,
                column_rules: bool = True) -> list[Difference]:
    """The differences between ``previous`` and ``new`` in one ``direction``, plus
    (``column_rules``) the ones that hold in every direction: a column that only a
    removed field filled, an integer column the new type may overflow."""
    walk = _Walk(direction, version, column_rules)
    new_columns = _column_types(new, columns)
    old_columns = _column_types(previous, columns)

    def column_of(old_fd: FieldDescriptor, new_fd: FieldDescriptor) -> CHType | None:
        if columns is None:
            return None
        return new_columns.get(new_fd.name) or old_columns.get(old_fd.name)

    walk.message(previous, new, new.full_name, column_of, tuple_positions=False)
    if column_rules and columns is not None:
        walk.out.extend(_unfilled_columns(previous, new, columns, version))
    return walk.out


def _unique(items: list[Difference]) -> list[Difference]:
    seen: set[Difference] = set()
    out = []
    for d in items:
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out


def _column_types(descriptor: Descriptor, columns: Sequence[Column] | None
                  ) -> dict[str, CHType | None]:
    """Field name -> the type of the column it feeds (None: unparseable)."""
    if columns is None:
        return {}
    mapping, _ = match_columns(descriptor, columns)
    by_name = {c.name: c for c in columns}
    out: dict[str, CHType | None] = {}
    for name, fd in mapping.items():
        try:
            out[fd.name] = parse_type(by_name[name].type)
        except TypeParseError:
            out[fd.name] = None
    return out


def _unfilled_columns(previous: Descriptor, new: Descriptor, columns: Sequence[Column],
                      version: int) -> list[Difference]:
    """Columns without a DEFAULT that a field of ``previous`` filled and no field of
    ``new`` fills, where that field's number is gone from ``new``."""
    old_map, _ = match_columns(previous, columns)
    new_map, _ = match_columns(new, columns)
    numbers = {fd.number for fd in new.fields}
    out = []
    for col in columns:
        fd = old_map.get(col.name)
        if (fd is None or col.name in new_map or col.default_kind
                or col.name in WRITER_COLUMNS or fd.number in numbers):
            continue
        out.append(Difference(
            "COLUMN_UNFILLED", f"{new.full_name}.{fd.name} (number {fd.number})",
            f"the field is removed, and column {col.name} {col.type} has no DEFAULT and no "
            "other field to fill it; keep the field, or give the column a DEFAULT "
            f"(ALTER TABLE ... MODIFY COLUMN {col.name} DEFAULT ...) first",
            None, version))
    return out


_WRAPPERS: Final = frozenset(
    f"google.protobuf.{n}" for n in ("DoubleValue", "FloatValue", "Int64Value", "UInt64Value",
                                     "Int32Value", "UInt32Value", "BoolValue", "StringValue",
                                     "BytesValue"))
_MESSAGE_TYPES: Final = (_T.TYPE_MESSAGE, _T.TYPE_GROUP)
_NUMERIC_NAMES: Final = {v: k[5:].lower() for k, v in vars(_T).items()
                         if k.startswith("TYPE_") and isinstance(v, int)}

_WIRE: Final = {
    **dict.fromkeys((_T.TYPE_INT32, _T.TYPE_INT64, _T.TYPE_UINT32, _T.TYPE_UINT64,
                     _T.TYPE_BOOL, _T.TYPE_ENUM), "varint"),
    **dict.fromkeys((_T.TYPE_SINT32, _T.TYPE_SINT64), "zigzag varint"),
    **dict.fromkeys((_T.TYPE_FIXED32, _T.TYPE_SFIXED32, _T.TYPE_FLOAT), "32-bit"),
    **dict.fromkeys((_T.TYPE_FIXED64, _T.TYPE_SFIXED64, _T.TYPE_DOUBLE), "64-bit"),
    **dict.fromkeys((_T.TYPE_STRING, _T.TYPE_BYTES), "length-delimited"),
}

_RANGES: Final = {
    _T.TYPE_INT32: (-(2**31), 2**31 - 1), _T.TYPE_SINT32: (-(2**31), 2**31 - 1),
    _T.TYPE_SFIXED32: (-(2**31), 2**31 - 1), _T.TYPE_ENUM: (-(2**31), 2**31 - 1),
    _T.TYPE_INT64: (-(2**63), 2**63 - 1), _T.TYPE_SINT64: (-(2**63), 2**63 - 1),
    _T.TYPE_SFIXED64: (-(2**63), 2**63 - 1), _T.TYPE_UINT32: (0, 2**32 - 1),
    _T.TYPE_FIXED32: (0, 2**32 - 1), _T.TYPE_UINT64: (0, 2**64 - 1),
    _T.TYPE_FIXED64: (0, 2**64 - 1), _T.TYPE_BOOL: (0, 1),
}

_READS_SAME: Final = frozenset({
    # (written as, read as): every value written decodes to the same number.
    (_T.TYPE_INT32, _T.TYPE_INT64), (_T.TYPE_UINT32, _T.TYPE_INT64),
    (_T.TYPE_UINT32, _T.TYPE_UINT64), (_T.TYPE_SINT32, _T.TYPE_SINT64),
    (_T.TYPE_BOOL, _T.TYPE_INT32), (_T.TYPE_BOOL, _T.TYPE_INT64),
    (_T.TYPE_BOOL, _T.TYPE_UINT32), (_T.TYPE_BOOL, _T.TYPE_UINT64),
    (_T.TYPE_ENUM, _T.TYPE_INT32), (_T.TYPE_ENUM, _T.TYPE_INT64),
    (_T.TYPE_INT32, _T.TYPE_ENUM),
})


def _type_name(fd: FieldDescriptor) -> str:
    if fd.type in _MESSAGE_TYPES and fd.message_type is not None:
        return fd.message_type.full_name
    if fd.type == _T.TYPE_ENUM and fd.enum_type is not None:
        return f"enum {fd.enum_type.full_name}"
    return _NUMERIC_NAMES.get(fd.type, str(fd.type))


def _is_map(fd: FieldDescriptor) -> bool:
    mt = fd.message_type
    return is_repeated(fd) and mt is not None and bool(mt.GetOptions().map_entry)


def _kind(fd: FieldDescriptor) -> str:
    if _is_map(fd):
        return "map"
    if fd.type in _MESSAGE_TYPES:
        return "message"
    return "scalar"


def _local_name(message: Descriptor) -> str:
    """A message's name within its package (Confluent compares these, so moving a
    schema to a new package is not a type change); well-known types keep theirs."""
    package = message.file.package
    if package == "google.protobuf" or not package:
        return message.full_name
    return message.full_name.removeprefix(package + ".")


def _real_oneof(fd: FieldDescriptor) -> str | None:
    """The oneof ``fd`` belongs to, None for none or the synthetic oneof of a proto3
    ``optional`` field (the Python API doesn't tell them apart; the descriptor
    proto's ``proto3_optional`` does)."""
    oneof = fd.containing_oneof
    if oneof is None:
        return None
    parent = fd.containing_type
    assert parent is not None
    if fd.number in _proto3_optionals(parent):
        return None
    return str(oneof.name)


@lru_cache(maxsize=1024)
def _proto3_optionals(message: Descriptor) -> frozenset[int]:
    proto = descriptor_pb2.DescriptorProto()
    message.CopyToProto(proto)
    return frozenset(f.number for f in proto.field if f.proto3_optional)


def _is_required(fd: FieldDescriptor) -> bool:
    label = getattr(fd, "label", None)
    if label is not None:
        return bool(label == _T.LABEL_REQUIRED)
    return bool(getattr(fd, "is_required", False))


def _base(ch: CHType | None) -> CHType | None:
    return None if ch is None else ch.unwrap()


def _element(ch: CHType | None) -> CHType | None:
    """The element column type of an ``Array`` column (None when not an Array)."""
    base = _base(ch)
    if base is None or base.name != "Array" or not base.children:
        return None
    return base.children[0].unwrap()


def _int_column(ch: CHType | None) -> bool:
    return ch is not None and ch.name in INT_RANGES


@dataclass
class _Walk:
    """One comparison in one direction; ``old``/``new`` arguments are the previous
    and the new version's side, whichever reads."""

    direction: Direction
    version: int
    column_rules: bool
    out: list[Difference] = field(default_factory=list)

    @property
    def new_reads(self) -> bool:
        return self.direction is Direction.BACKWARD

    def add(self, rule: str, path: str, detail: str) -> None:
        self.out.append(Difference(rule, path, detail, self.direction, self.version))

    def label(self, new: bool) -> str:
        if new:
            return "the new version"
        return f"version {self.version}" if self.version else "the previous version"

    @property
    def reader(self) -> str:
        return self.label(self.new_reads)

    @property
    def writer(self) -> str:
        return self.label(not self.new_reads)

    def message(self, old: Descriptor, new: Descriptor, prefix: str,
                column_of: Callable[[FieldDescriptor, FieldDescriptor], CHType | None],
                tuple_positions: bool) -> None:
        olds = {fd.number: fd for fd in old.fields}
        news = {fd.number: fd for fd in new.fields}
        for number in sorted(olds.keys() | news.keys()):
            o, n = olds.get(number), news.get(number)
            if o is not None and n is not None:
                self.field(o, n, f"{prefix}.{n.name} (number {number})", column_of(o, n))
                continue
            present = o if o is not None else n
            assert present is not None
            path = f"{prefix}.{present.name} (number {number})"
            written = present if (o is not None) == self.new_reads else None
            if written is not None and _real_oneof(written) is not None:
                rule = "ONEOF_FIELD_REMOVED" if o is not None else "ONEOF_FIELD_ADDED"
                self.add(rule, path,
                         f"data of {self.writer} may set oneof {_real_oneof(written)} to "
                         f"{written.name}, which {self.reader} does not know: it reads the "
                         "oneof as unset")
            elif written is None and _is_required(present):
                rule = "REQUIRED_FIELD_ADDED" if o is None else "REQUIRED_FIELD_REMOVED"
                self.add(rule, path,
                         f"{self.reader} requires it and data of {self.writer} never has it: "
                         "such rows do not decode")
        old_names = {fd.name: fd for fd in old.fields}
        for fd in new.fields:
            was = old_names.get(fd.name)
            if was is None or was.number == fd.number:
                continue
            reused = news.get(was.number)
            if reused is not None and reused.name != fd.name:
                continue
            self.add("FIELD_NUMBER_CHANGED", f"{prefix}.{fd.name} (number {fd.number})",
                     f"number {was.number} in {self.label(False)} and {fd.number} in the new "
                     f"version: {self.reader} skips the number that data of {self.writer} "
                     f"carries, so {fd.name} reads as unset")
        if tuple_positions:
            old_pos = {fd.number: i for i, fd in enumerate(old.fields)}
            for i, fd in enumerate(new.fields):
                j = old_pos.get(fd.number)
                if j is not None and j != i:
                    self.add("FIELD_POSITION_CHANGED", f"{prefix}.{fd.name} (number {fd.number})",
                             f"declared at position {j + 1} in {self.label(False)} and "
                             f"{i + 1} in the new version; a Tuple column takes a nested "
                             "message's fields by position, so the values move to another "
                             "element")
        self.oneofs(old, new, prefix)

    def oneofs(self, old: Descriptor, new: Descriptor, prefix: str) -> None:
        """A reader's oneof must not join fields that the writer can set together:
        the reader keeps only the last of them."""
        reader, writer = (new, old) if self.new_reads else (old, new)
        written = {fd.number: fd for fd in writer.fields}
        groups: dict[str, list[FieldDescriptor]] = {}
        for fd in reader.fields:
            name = _real_oneof(fd)
            if name is not None and fd.number in written:
                groups.setdefault(name, []).append(written[fd.number])
        for name, members in sorted(groups.items()):
            homes = [_real_oneof(m) for m in members]
            if len(members) < 2 or (homes[0] is not None and len(set(homes)) == 1):
                continue
            loose = [m.name for m, h in zip(members, homes, strict=True) if h is None]
            rule = ("MULTIPLE_FIELDS_MOVED_TO_ONEOF" if len(loose) > 1
                    else "FIELD_MOVED_TO_EXISTING_ONEOF")
            self.add(rule, f"{prefix}.{name}",
                     f"{self.reader} has oneof {name} over fields "
                     f"{', '.join(m.name for m in members)} that data of {self.writer} can "
                     "set together: all but the last would be lost")

    def field(self, o: FieldDescriptor, n: FieldDescriptor, path: str,
              ch: CHType | None) -> None:
        r, w = (n, o) if self.new_reads else (o, n)
        if o.name != n.name:
            self.add("FIELD_NAME_CHANGED", path,
                     f"number {o.number} is {o.name} in {self.label(False)} and {n.name} in "
                     "the new version; columns are matched by field name, so its values "
                     f"would go to column {r.name} instead of {w.name}")
            return
        if _kind(o) != _kind(n):
            self.add("FIELD_KIND_CHANGED", path,
                     f"{_kind(w)} {_type_name(w)} written, read as {_kind(r)} {_type_name(r)}")
            return
        if _kind(o) == "map":
            self.map(o, n, path, ch)
            return
        if is_repeated(o) != is_repeated(n):
            if _kind(o) == "message":
                rule = "FIELD_LABEL_CHANGED"
            elif o.type in (_T.TYPE_STRING, _T.TYPE_BYTES):
                rule = "FIELD_STRING_OR_BYTES_LABEL_CHANGED"
            else:
                rule = "FIELD_NUMERIC_LABEL_CHANGED"
            shape = {True: "repeated (an Array column)", False: "singular"}
            self.add(rule, path, f"{shape[is_repeated(w)]} written, read as "
                                 f"{shape[is_repeated(r)]}")
            return
        element = _element(ch) if is_repeated(o) else _base(ch)
        if _kind(o) == "message":
            self.nested(o, n, path, element)
            return
        if not is_repeated(o) and o.has_presence != n.has_presence:
            have = {True: "with presence (NULL when absent)",
                    False: "without presence (0/empty when absent)"}
            self.add("FIELD_PRESENCE_CHANGED", path,
                     f"{have[w.has_presence]} written, read {have[r.has_presence]}: an unset "
                     "value changes between NULL and the zero value in the column")
        self.scalar(o, n, path, element)

    def map(self, o: FieldDescriptor, n: FieldDescriptor, path: str, ch: CHType | None) -> None:
        base = _base(ch)
        kids = base.children if base is not None and base.name == "Map" else ()
        for i, part in enumerate(("key", "value")):
            om, nm = o.message_type, n.message_type
            assert om is not None and nm is not None
            sub_ch = kids[i] if len(kids) == 2 else None
            self.field(om.fields_by_name[part], nm.fields_by_name[part], f"{path}.{part}",
                       sub_ch)

    def nested(self, o: FieldDescriptor, n: FieldDescriptor, path: str,
               ch: CHType | None) -> None:
        om, nm = o.message_type, n.message_type
        assert om is not None and nm is not None
        if _local_name(om) != _local_name(nm):
            self.add("FIELD_NAMED_TYPE_CHANGED", path,
                     f"message {_type_name(o)} in {self.label(False)}, {_type_name(n)} in "
                     "the new version")
            return
        if om.full_name in _WRAPPERS:
            self.field(om.fields_by_name["value"], nm.fields_by_name["value"],
                       f"{path}.value", ch)
            return
        if om.full_name == TIMESTAMP:
            return
        kids = ch.children if ch is not None and ch.name == "Tuple" else None
        reader = nm if self.new_reads else om

        def column_of(old_fd: FieldDescriptor, new_fd: FieldDescriptor) -> CHType | None:
            if kids is None:
                return None
            fd = new_fd if self.new_reads else old_fd
            index = [f.number for f in reader.fields].index(fd.number)
            return kids[index] if index < len(kids) else None

        self.message(om, nm, path, column_of, tuple_positions=True)

    def scalar(self, o: FieldDescriptor, n: FieldDescriptor, path: str,
               ch: CHType | None) -> None:
        r, w = (n, o) if self.new_reads else (o, n)
        if o.type == n.type == _T.TYPE_ENUM:
            self.enum(o, n, path, ch)
            return
        if o.type != n.type:
            self.changed_type(r, w, path, ch)
            if self.column_rules:
                self.overflow(o, n, path, ch)

    def changed_type(self, r: FieldDescriptor, w: FieldDescriptor, path: str,
                     ch: CHType | None) -> None:
        rt, wt = r.type, w.type
        what = f"{_type_name(w)} written, read as {_type_name(r)}"
        if _T.TYPE_ENUM in (rt, wt):
            closed = rt == _T.TYPE_ENUM and _closed(r.enum_type)
            if (wt, rt) in _READS_SAME and _int_column(ch) and not closed:
                return
            self.add("FIELD_SCALAR_KIND_CHANGED", path,
                     f"{what}: an enum converts into {ch or 'an Enum column'} by "
                     "name and an integer by value"
                     + ("; a closed enum drops unknown numbers" if closed else ""))
            return
        if (wt, rt) in _READS_SAME:
            return
        if (wt, rt) == (_T.TYPE_STRING, _T.TYPE_BYTES):
            if ch is not None and ch.name in ("String", "FixedString"):
                return
            self.add("FIELD_SCALAR_KIND_CHANGED", path,
                     f"{what}: text and bytes convert differently into "
                     f"{ch or 'UUID, IPv6, Decimal or Date columns'}")
            return
        if _WIRE[wt] != _WIRE[rt]:
            why = (f"the value is written as {_WIRE[wt]} and read as {_WIRE[rt]}: the reader "
                   "skips it or decodes other numbers")
        elif (wt, rt) == (_T.TYPE_BYTES, _T.TYPE_STRING):
            why = "bytes that are not UTF-8 do not decode as a string"
        else:
            why = ("values outside the reader's range change (truncated to the low bits or "
                   "read with another sign)")
        self.add("FIELD_SCALAR_KIND_CHANGED", path, f"{what}: {why}")

    def overflow(self, o: FieldDescriptor, n: FieldDescriptor, path: str,
                 ch: CHType | None) -> None:
        """An integer column that held every value of the old type but not of the new
        one: rows would start becoming dead letters."""
        if not _int_column(ch) or o.type not in _RANGES or n.type not in _RANGES:
            return
        assert ch is not None
        lo, hi = INT_RANGES[ch.name]
        fits_old = lo <= _RANGES[o.type][0] and _RANGES[o.type][1] <= hi
        fits_new = lo <= _RANGES[n.type][0] and _RANGES[n.type][1] <= hi
        if fits_old and not fits_new:
            self.out.append(Difference(
                "COLUMN_OVERFLOW", path,
                f"column type {ch} holds every {_type_name(o)} but not every "
                f"{_type_name(n)}: larger values would make their messages dead letters; "
                "widen the column first", None, self.version))

    def enum(self, o: FieldDescriptor, n: FieldDescriptor, path: str,
             ch: CHType | None) -> None:
        r, w = (n, o) if self.new_reads else (o, n)
        re_, we = r.enum_type, w.enum_type
        assert re_ is not None and we is not None
        by_number = _int_column(ch)
        for value in we.values:
            known = re_.values_by_number.get(value.number)
            if known is None:
                if by_number and not _closed(re_):
                    continue
                rule = "ENUM_CONST_REMOVED" if self.new_reads else "ENUM_CONST_ADDED"
                self.add(rule, f"{path} value {value.name} = {value.number}",
                         f"{self.reader} does not know the number: "
                         + ("its closed enum drops it" if _closed(re_) else
                            f"it does not convert into {ch or 'an Enum column'}"))
            elif known.name != value.name and not by_number:
                self.add("ENUM_CONST_CHANGED", f"{path} value {value.number}",
                         f"named {value.name} by {self.writer} and {known.name} by "
                         f"{self.reader}; {ch or 'an Enum column'} takes the name")


def _closed(enum: EnumDescriptor | None) -> bool:
    return enum is not None and bool(getattr(enum, "is_closed", False))
