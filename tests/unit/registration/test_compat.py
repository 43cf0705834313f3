"""Compatibility rules (``registration.compat``) on descriptors compiled from small .proto
sources, with and without the live table's columns, and hypothesis properties on
generated descriptors."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any

import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from blockagg.exceptions import BlockaggError
from blockagg.proto.decode import decode_rows
from blockagg.proto.descriptors import compile_proto, load_descriptor, message_class
from blockagg.proto.exceptions import UnknownMode
from blockagg.proto.modes import DEFAULT_MODE, Direction, Mode, parse_mode
from blockagg.registration.compat import check, differences
from blockagg.rows.columns import Column
from blockagg.rows.types import convert_column, field_mismatch, parse_type

Compile = Callable[..., dict[str, Descriptor]]
_counter = itertools.count()


@pytest.fixture(scope="module")
def compile_(tmp_path_factory: pytest.TempPathFactory) -> Compile:
    """Compile a .proto body (``syntax``/``package`` added) and return its messages."""
    root = tmp_path_factory.mktemp("compat")

    def build(body: str, syntax: str = "proto3", package: str = "t") -> dict[str, Descriptor]:
        path = root / f"f{next(_counter)}.proto"
        imports = ('import "google/protobuf/wrappers.proto";\n'
                   if "google.protobuf" in body else "")
        path.write_text(f'syntax = "{syntax}";\npackage {package};\n{imports}{body}')
        fds = compile_proto(path)
        names = [line.split()[1] for line in body.splitlines()
                 if line.startswith("message ")]
        return {n: load_descriptor(fds, f"{package}.{n}") for n in names}
    return build


def rules(mode: Mode, old: Descriptor, new: Descriptor,
          columns: list[Column] | None = None) -> set[str]:
    return {d.rule for d in check(mode, new, [(1, old)], columns)}


def pair(compile_: Compile, old: str, new: str, extra: str = "",
         syntax: str = "proto3") -> tuple[Descriptor, Descriptor]:
    found = compile_(f"message Old {{ {old} }}\nmessage New {{ {new} }}\n{extra}", syntax)
    return found["Old"], found["New"]


def test_modes() -> None:
    assert parse_mode("") is DEFAULT_MODE is Mode.BACKWARD
    assert parse_mode("full_transitive") is Mode.FULL_TRANSITIVE
    assert Mode.FULL.directions == (Direction.BACKWARD, Direction.FORWARD)
    assert Mode.FORWARD_TRANSITIVE.directions == (Direction.FORWARD,)
    assert Mode.FORWARD_TRANSITIVE.transitive and not Mode.FULL.transitive
    assert Mode.NONE.directions == ()
    with pytest.raises(UnknownMode, match=r"'SIDEWAYS'.*BACKWARD") as info:
        parse_mode("SIDEWAYS")
    assert isinstance(info.value, BlockaggError)


def test_swapped_field_numbers_are_refused_in_every_mode_but_none(compile_: Compile) -> None:
    old, new = pair(compile_, "int32 a = 1; int32 b = 2;", "int32 b = 1; int32 a = 2;")
    cols = [Column("a", "Int32"), Column("b", "Int32")]
    for mode in Mode:
        found = check(mode, new, [(1, old)], cols)
        if mode is Mode.NONE:
            assert found == []
            continue
        assert {d.rule for d in found} == {"FIELD_NAME_CHANGED"}, mode
        text = "\n".join(map(str, found))
        assert "t.New.b (number 1)" in text and "t.New.a (number 2)" in text
        assert "number 1 is a in version 1 and b in the new version" in text


def test_a_field_keeping_its_name_under_a_new_number_is_refused(compile_: Compile) -> None:
    old, new = pair(compile_, "int32 a = 1;", "int32 a = 5;")
    found = check(Mode.BACKWARD, new, [(1, old)], [Column("a", "Int32")])
    assert [d.rule for d in found] == ["FIELD_NUMBER_CHANGED"]
    assert "number 1 in version 1 and 5 in the new version" in str(found[0])
    assert rules(Mode.FORWARD, old, new) == {"FIELD_NUMBER_CHANGED"}


def test_added_field_is_compatible_both_ways(compile_: Compile) -> None:
    old, new = pair(compile_, "int32 a = 1;", "int32 a = 1; string c = 3;")
    cols = [Column("a", "Int32"), Column("c", "String", "DEFAULT", "'x'")]
    for mode in Mode:
        assert rules(mode, old, new, cols) == set()


def test_removed_field_needs_its_column_to_have_a_default(compile_: Compile) -> None:
    old, new = pair(compile_, "int32 a = 1; string b = 2;", "int32 a = 1;")
    assert rules(Mode.FULL, old, new) == set()
    without = [Column("a", "Int32"), Column("b", "String")]
    found = check(Mode.BACKWARD, new, [(3, old)], without)
    assert [d.rule for d in found] == ["COLUMN_UNFILLED"]
    assert "column b String has no DEFAULT" in str(found[0]) and "version 3" in str(found[0])
    assert rules(Mode.FORWARD, old, new, without) == {"COLUMN_UNFILLED"}
    with_default = [Column("a", "Int32"), Column("b", "String", "DEFAULT", "''")]
    assert rules(Mode.FULL, old, new, with_default) == set()


@pytest.mark.parametrize(("old_type", "new_type", "column", "backward", "forward"), [
    ("int32", "sint32", "Int64", {"FIELD_SCALAR_KIND_CHANGED"}, {"FIELD_SCALAR_KIND_CHANGED"}),
    ("int32", "int64", "Int64", set(), {"FIELD_SCALAR_KIND_CHANGED"}),
    ("int32", "int64", "Int32", {"COLUMN_OVERFLOW"},
     {"COLUMN_OVERFLOW", "FIELD_SCALAR_KIND_CHANGED"}),
    ("int64", "int32", "Int64", {"FIELD_SCALAR_KIND_CHANGED"}, set()),
    ("uint32", "int32", "Int64", {"FIELD_SCALAR_KIND_CHANGED"}, {"FIELD_SCALAR_KIND_CHANGED"}),
    ("uint32", "uint64", "UInt64", set(), {"FIELD_SCALAR_KIND_CHANGED"}),
    ("sint32", "sint64", "Int64", set(), {"FIELD_SCALAR_KIND_CHANGED"}),
    ("fixed32", "sfixed32", "Int64", {"FIELD_SCALAR_KIND_CHANGED"},
     {"FIELD_SCALAR_KIND_CHANGED"}),
    ("float", "double", "Float64", {"FIELD_SCALAR_KIND_CHANGED"},
     {"FIELD_SCALAR_KIND_CHANGED"}),
    ("bool", "int32", "Int32", set(), {"FIELD_SCALAR_KIND_CHANGED"}),
    ("string", "bytes", "String", set(), {"FIELD_SCALAR_KIND_CHANGED"}),
    ("string", "bytes", "UUID", {"FIELD_SCALAR_KIND_CHANGED"}, {"FIELD_SCALAR_KIND_CHANGED"}),
    ("bytes", "string", "String", {"FIELD_SCALAR_KIND_CHANGED"}, set()),
    ("int32", "E", "Enum8('Z' = 0, 'A' = 1)", {"FIELD_SCALAR_KIND_CHANGED"},
     {"FIELD_SCALAR_KIND_CHANGED"}),
])
def test_scalar_type_changes(compile_: Compile, old_type: str, new_type: str, column: str,
                             backward: set[str], forward: set[str]) -> None:
    old, new = pair(compile_, f"{old_type} v = 1;", f"{new_type} v = 1;",
                    "enum E { Z = 0; A = 1; }")
    cols = [Column("v", column)]
    assert rules(Mode.BACKWARD, old, new, cols) == backward
    assert rules(Mode.FORWARD, old, new, cols) == forward
    assert rules(Mode.FULL, old, new, cols) == backward | forward


def test_string_bytes_without_columns_is_refused(compile_: Compile) -> None:
    old, new = pair(compile_, "string v = 1;", "bytes v = 1;")
    assert rules(Mode.BACKWARD, old, new) == {"FIELD_SCALAR_KIND_CHANGED"}


def test_enum_values(compile_: Compile) -> None:
    found = compile_("message M1 { enum E { Z = 0; A = 1; B = 2; } E v = 1; }\n"
                     "message M2 { enum E { Z = 0; A2 = 1; B = 2; } E v = 1; }\n"
                     "message M3 { enum E { Z = 0; A = 1; } E v = 1; }\n"
                     "message M4 { enum E { Z = 0; A = 1; B = 2; C = 3; } E v = 1; }\n")
    cols = [Column("v", "Enum8('Z' = 0, 'A' = 1, 'B' = 2, 'C' = 3)")]
    renamed = check(Mode.BACKWARD, found["M2"], [(1, found["M1"])], cols)
    assert {d.rule for d in renamed} == {"ENUM_CONST_CHANGED"}
    assert "named A by version 1 and A2 by the new version" in "\n".join(map(str, renamed))
    assert rules(Mode.BACKWARD, found["M4"], found["M3"], cols) == {"ENUM_CONST_REMOVED"}
    assert rules(Mode.FORWARD, found["M4"], found["M3"], cols) == set()
    assert rules(Mode.BACKWARD, found["M3"], found["M4"], cols) == set()
    assert rules(Mode.FORWARD, found["M3"], found["M4"], cols) == {"ENUM_CONST_ADDED"}


@pytest.mark.parametrize(("old", "new", "rule"), [
    ("int32 v = 1;", "repeated int32 v = 1;", "FIELD_NUMERIC_LABEL_CHANGED"),
    ("repeated string v = 1;", "string v = 1;", "FIELD_STRING_OR_BYTES_LABEL_CHANGED"),
    ("Inner v = 1;", "repeated Inner v = 1;", "FIELD_LABEL_CHANGED"),
    ("int32 v = 1;", "Inner v = 1;", "FIELD_KIND_CHANGED"),
    ("map<string, int32> v = 1;", "repeated Inner v = 1;", "FIELD_KIND_CHANGED"),
    ("Inner v = 1;", "Other v = 1;", "FIELD_NAMED_TYPE_CHANGED"),
    ("google.protobuf.Int32Value v = 1;", "google.protobuf.Int64Value v = 1;",
     "FIELD_NAMED_TYPE_CHANGED"),
    ("int32 v = 1;", "optional int32 v = 1;", "FIELD_PRESENCE_CHANGED"),
    ("map<string, int32> v = 1;", "map<string, sint32> v = 1;", "FIELD_SCALAR_KIND_CHANGED"),
    ("map<string, int32> v = 1;", "map<int32, int32> v = 1;", "FIELD_SCALAR_KIND_CHANGED"),
])
def test_shape_changes_are_refused_both_ways(compile_: Compile, old: str, new: str,
                                             rule: str) -> None:
    extra = "message Inner { int32 a = 1; }\nmessage Other { int32 a = 1; }"
    o, n = pair(compile_, old, new, extra)
    assert rules(Mode.BACKWARD, o, n) == {rule}
    assert rules(Mode.FORWARD, o, n) == {rule}


def test_nested_messages_are_compared_recursively_and_by_position(compile_: Compile) -> None:
    def row(inner: str) -> Descriptor:
        return compile_(f"message A {{ {inner} }}\nmessage Row {{ A inner = 1; }}\n")["Row"]

    v1 = row("int32 x = 1; string y = 2;")
    cols = [Column("inner", "Tuple(Int32, String)")]
    changed = check(Mode.BACKWARD, row("sint32 x = 1; string y = 2;"), [(1, v1)], cols)
    assert [d.rule for d in changed] == ["FIELD_SCALAR_KIND_CHANGED"]
    assert "t.Row.inner (number 1).x (number 1)" in str(changed[0])
    assert rules(Mode.BACKWARD, v1, row("string y = 2; int32 x = 1;"), cols) == {
        "FIELD_POSITION_CHANGED"}
    assert rules(Mode.FULL, v1, row("int32 x = 1; string y = 2; int64 z = 3;"), cols) == set()
    assert rules(Mode.BACKWARD, v1, row("int32 x = 1; string z = 2;"), cols) == {
        "FIELD_NAME_CHANGED"}


def test_repeated_nested_messages_use_the_array_element(compile_: Compile) -> None:
    row = compile_("message A { int32 x = 1; }\nmessage Row { repeated A items = 1; }\n")["Row"]
    wider = compile_("message A { int64 x = 1; }\nmessage Row { repeated A items = 1; }\n")["Row"]
    assert rules(Mode.BACKWARD, row, wider, [Column("items", "Array(Tuple(Int64))")]) == set()
    assert rules(Mode.BACKWARD, row, wider,
                 [Column("items", "Array(Tuple(Int32))")]) == {"COLUMN_OVERFLOW"}


def test_moving_to_another_package_is_not_a_type_change(compile_: Compile) -> None:
    body = "message A { int32 x = 1; }\nmessage Row { A inner = 1; }\n"
    v1 = compile_(body, package="shop.v1")["Row"]
    v2 = compile_(body, package="shop.v2")["Row"]
    assert rules(Mode.FULL_TRANSITIVE, v1, v2) == set()


def test_oneofs(compile_: Compile) -> None:
    old, grown = pair(compile_, "oneof k { int32 a = 1; string b = 2; }",
                      "oneof k { int32 a = 1; string b = 2; bool c = 3; }")
    assert rules(Mode.BACKWARD, old, grown) == set()
    assert rules(Mode.FORWARD, old, grown) == {"ONEOF_FIELD_ADDED"}
    assert rules(Mode.BACKWARD, grown, old) == {"ONEOF_FIELD_REMOVED"}
    loose, joined = pair(compile_, "optional int32 a = 1; optional string b = 2;",
                         "oneof k { int32 a = 1; string b = 2; }")
    assert rules(Mode.BACKWARD, loose, joined) == {"MULTIPLE_FIELDS_MOVED_TO_ONEOF"}
    assert rules(Mode.FORWARD, loose, joined) == set()
    one, into = pair(compile_, "optional int32 a = 1; oneof k { string b = 2; }",
                     "oneof k { int32 a = 1; string b = 2; }")
    assert rules(Mode.BACKWARD, one, into) == {"FIELD_MOVED_TO_EXISTING_ONEOF"}


def test_required_fields(compile_: Compile) -> None:
    old, new = pair(compile_, "optional int32 a = 1;",
                    "optional int32 a = 1; required int32 r = 2;", syntax="proto2")
    assert rules(Mode.BACKWARD, old, new) == {"REQUIRED_FIELD_ADDED"}
    assert rules(Mode.FORWARD, old, new) == set()
    assert rules(Mode.FORWARD, new, old) == {"REQUIRED_FIELD_REMOVED"}


def test_transitive_modes_compare_every_version(compile_: Compile) -> None:
    found = compile_("message V1 { int32 a = 1; int64 c = 3; }\n"
                     "message V2 { int32 a = 1; }\n"
                     "message V3 { int32 a = 1; string d = 3; }\n")
    history = [(1, found["V1"]), (2, found["V2"])]
    assert check(Mode.BACKWARD, found["V3"], history) == []
    assert check(Mode.FULL, found["V3"], history) == []
    found_t = check(Mode.BACKWARD_TRANSITIVE, found["V3"], history)
    assert [(d.rule, d.version) for d in found_t] == [("FIELD_NAME_CHANGED", 1)]
    assert {d.direction for d in check(Mode.FULL_TRANSITIVE, found["V3"], history)} == {
        Direction.BACKWARD, Direction.FORWARD}
    assert check(Mode.NONE, found["V3"], history) == []
    assert check(Mode.BACKWARD, found["V1"], []) == []


# Hypothesis: generated descriptors, built as FileDescriptorProtos (no protoc per example).
# Deterministic (the same examples on every run); raise with COMPAT_EXAMPLES=2000.
SETTINGS = settings(max_examples=int(os.environ.get("COMPAT_EXAMPLES", "100")), deadline=None,
                    derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS: list[int] = [_F.TYPE_INT32, _F.TYPE_INT64, _F.TYPE_UINT32, _F.TYPE_UINT64, _F.TYPE_SINT32,
            _F.TYPE_SINT64, _F.TYPE_FIXED32, _F.TYPE_FIXED64, _F.TYPE_SFIXED32,
            _F.TYPE_SFIXED64, _F.TYPE_BOOL, _F.TYPE_FLOAT, _F.TYPE_DOUBLE, _F.TYPE_STRING,
            _F.TYPE_BYTES]
_COLUMN: dict[int, str] = {_F.TYPE_INT32: "Int32", _F.TYPE_INT64: "Int64", _F.TYPE_UINT32: "UInt32",
           _F.TYPE_UINT64: "UInt64", _F.TYPE_SINT32: "Int32", _F.TYPE_SINT64: "Int64",
           _F.TYPE_FIXED32: "UInt32", _F.TYPE_FIXED64: "UInt64", _F.TYPE_SFIXED32: "Int32",
           _F.TYPE_SFIXED64: "Int64", _F.TYPE_BOOL: "UInt8", _F.TYPE_FLOAT: "Float32",
           _F.TYPE_DOUBLE: "Float64", _F.TYPE_STRING: "String", _F.TYPE_BYTES: "String"}

FieldSpec = tuple[str, int, int, bool]   # name, number, type, repeated


@st.composite
def field_specs(draw: st.DrawFn) -> list[FieldSpec]:
    count = draw(st.integers(1, 8))
    names = draw(st.lists(st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True),
                          min_size=count, max_size=count, unique=True))
    numbers = draw(st.lists(st.integers(1, 200), min_size=count, max_size=count, unique=True))
    return [(name, number, draw(st.sampled_from(_SCALARS)), draw(st.booleans()))
            for name, number in zip(names, numbers, strict=True)]


def build(specs: list[FieldSpec], nested: bool = False) -> Descriptor:
    """A proto3 message ``gen.M`` with these fields (and a nested message field
    ``sub`` of type ``gen.S`` with the same fields, numbered past them)."""
    file = descriptor_pb2.FileDescriptorProto(name="gen.proto", package="gen",
                                              syntax="proto3")
    for message_name in ("S", "M"):
        message = file.message_type.add(name=message_name)
        for name, number, kind, repeated in specs:
            message.field.add(name=name, number=number, type=kind,
                              label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL)
        if message_name == "M" and nested:
            message.field.add(name="sub_message", number=500, type=_F.TYPE_MESSAGE,
                              type_name=".gen.S", label=_F.LABEL_OPTIONAL)
    fds = descriptor_pb2.FileDescriptorSet(file=[file])
    return load_descriptor(fds.SerializeToString(), "gen.M")


def columns_for(specs: list[FieldSpec], nested: bool) -> list[Column]:
    cols = [Column(name, f"Array({_COLUMN[kind]})" if repeated else _COLUMN[kind])
            for name, _, kind, repeated in specs]
    if nested:
        inner = ", ".join(f"Array({_COLUMN[k]})" if r else _COLUMN[k] for _, _, k, r in specs)
        cols.append(Column("sub_message", f"Tuple({inner})"))
    return cols


@SETTINGS
@given(specs=field_specs(), nested=st.booleans(), with_columns=st.booleans())
def test_a_schema_is_compatible_with_itself_in_every_mode(
        specs: list[FieldSpec], nested: bool, with_columns: bool) -> None:
    descriptor = build(specs, nested)
    again = build(specs, nested)
    columns = columns_for(specs, nested) if with_columns else None
    for mode in Mode:
        assert check(mode, again, [(1, descriptor), (2, descriptor)], columns) == []


@SETTINGS
@given(specs=field_specs().filter(lambda s: len(s) >= 2), data=st.data())
def test_a_field_number_swap_is_refused(specs: list[FieldSpec], data: st.DataObject) -> None:
    i, j = data.draw(st.lists(st.integers(0, len(specs) - 1), min_size=2, max_size=2,
                              unique=True))
    swapped = list(specs)
    (ni, nu_i, ki, ri), (nj, nu_j, kj, rj) = specs[i], specs[j]
    swapped[i], swapped[j] = (ni, nu_j, ki, ri), (nj, nu_i, kj, rj)
    old, new = build(specs), build(swapped)
    for mode in Mode:
        found = {d.rule for d in check(mode, new, [(1, old)], columns_for(specs, False))}
        if mode is Mode.NONE:
            assert found == set()
        else:
            assert "FIELD_NAME_CHANGED" in found, mode


@SETTINGS
@given(specs=field_specs(), kind=st.sampled_from(_SCALARS), repeated=st.booleans())
def test_adding_a_field_with_a_fresh_number_is_fully_compatible(
        specs: list[FieldSpec], kind: int, repeated: bool) -> None:
    grown = [*specs, ("added_field", 300, kind, repeated)]
    assert check(Mode.FULL_TRANSITIVE, build(grown), [(1, build(specs))]) == []


@SETTINGS
@given(specs=field_specs(), data=st.data())
def test_directions_mirror_each_other(specs: list[FieldSpec], data: st.DataObject) -> None:
    """Reading B's data with A is the same question whichever of them is "new"."""
    other = [(n, num, data.draw(st.sampled_from(_SCALARS)), r) for n, num, _, r in specs]
    a, b = build(specs), build(other)

    def shape(items: list[str]) -> list[str]:
        return sorted(r.replace("_ADDED", "_CHANGED").replace("_REMOVED", "_CHANGED")
                      for r in items)
    forward = [d.rule for d in differences(a, b, Direction.FORWARD, column_rules=False)]
    backward = [d.rule for d in differences(b, a, Direction.BACKWARD, column_rules=False)]
    assert shape(forward) == shape(backward)


def test_generated_builder_sanity() -> None:
    d = build([("a", 1, _F.TYPE_INT32, False)], nested=True)
    assert [f.name for f in d.fields] == ["a", "sub_message"]
    assert d.fields_by_name["sub_message"].type == FieldDescriptor.TYPE_MESSAGE


_NAMES = {v: k[5:].lower() for k, v in vars(_F).items() if k.startswith("TYPE_")}
_VALUES: dict[int, st.SearchStrategy[Any]] = {
    _F.TYPE_INT32: st.integers(-(2**31), 2**31 - 1),
    _F.TYPE_SINT32: st.integers(-(2**31), 2**31 - 1),
    _F.TYPE_SFIXED32: st.integers(-(2**31), 2**31 - 1),
    _F.TYPE_INT64: st.integers(-(2**63), 2**63 - 1),
    _F.TYPE_SINT64: st.integers(-(2**63), 2**63 - 1),
    _F.TYPE_SFIXED64: st.integers(-(2**63), 2**63 - 1),
    _F.TYPE_UINT32: st.integers(0, 2**32 - 1), _F.TYPE_FIXED32: st.integers(0, 2**32 - 1),
    _F.TYPE_UINT64: st.integers(0, 2**64 - 1), _F.TYPE_FIXED64: st.integers(0, 2**64 - 1),
    _F.TYPE_BOOL: st.booleans(),
    _F.TYPE_FLOAT: st.floats(width=32, allow_nan=False),
    _F.TYPE_DOUBLE: st.floats(allow_nan=False),
    _F.TYPE_STRING: st.text(max_size=6), _F.TYPE_BYTES: st.binary(max_size=6),
}


_WIDER: list[int] = [_F.TYPE_INT64, _F.TYPE_UINT64, _F.TYPE_SINT64, _F.TYPE_INT32,
                     _F.TYPE_UINT32, _F.TYPE_BYTES]


def _same_bytes(value: Any) -> Any:
    """A String column stores ``str`` and ``bytes`` alike (as bytes)."""
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, list):
        return [_same_bytes(v) for v in value]
    return value


@pytest.mark.parametrize("mode", [Mode.BACKWARD, Mode.FORWARD])
@SETTINGS
@given(specs=field_specs(), data=st.data())
def test_a_compatible_change_converts_rows_alike(
        mode: Mode, specs: list[FieldSpec], data: st.DataObject) -> None:
    """The rules against the real pipeline: when a changed field type passes the mode
    against the columns, rows encoded with the writing version (the old one for
    BACKWARD, the new one for FORWARD), decoded with the reading one and converted
    into the columns give the values (and the dead letters) the writer's own version
    gives."""
    i = data.draw(st.integers(0, len(specs) - 1))
    name, number, _, repeated = specs[i]
    changed = list(specs)
    kind = data.draw(st.sampled_from(_SCALARS) | st.sampled_from(_WIDER))
    changed[i] = (name, number, kind, repeated)
    old, new = build(specs), build(changed)
    columns = columns_for(changed, False)
    if check(mode, new, [(1, old)], columns):
        event("refused")
        return
    event("same type" if changed[i][2] == specs[i][2] else
          f"{_NAMES[specs[i][2]]} -> {_NAMES[changed[i][2]]}")
    (writer, writer_specs), reader = (((old, specs), new) if mode is Mode.BACKWARD
                                      else ((new, changed), old))
    rows = []
    for _ in range(data.draw(st.integers(1, 4))):
        values: dict[str, Any] = {}
        for n, _, k, rep in writer_specs:
            draw = _VALUES[k]
            values[n] = data.draw(st.lists(draw, max_size=3) if rep else draw)
        rows.append(message_class(writer)(**values).SerializeToString())
    written, read = decode_rows(writer, rows), decode_rows(reader, rows)
    assert read.errors == written.errors
    for column in columns:
        ch = parse_type(column.type)
        w_fd, r_fd = writer.fields_by_name[column.name], reader.fields_by_name[column.name]
        if field_mismatch(ch, w_fd) is not None or field_mismatch(ch, r_fd) is not None:
            continue
        want = convert_column(ch, w_fd, written.columns[column.name])
        got = convert_column(ch, r_fd, read.columns[column.name])
        assert _same_bytes(list(got.values)) == _same_bytes(list(want.values)), column
        assert got.errors.keys() == want.errors.keys(), column
