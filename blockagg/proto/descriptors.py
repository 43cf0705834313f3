"""Turning ``.proto`` files and ``FileDescriptorSet`` bytes into message descriptors.

Every registration carries a self-contained ``FileDescriptorSet`` (the message's file
and all its imports), so a descriptor is rebuilt from the registration alone, in a
private :class:`DescriptorPool` per set: two tables may register different files
with the same name or package without clashing.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from blockagg.proto.exceptions import SchemaError


def compile_proto(path: str | Path, include: list[str | Path] | None = None) -> bytes:
    """Compile ``path`` with the bundled protoc (grpc_tools) into a serialized
    ``FileDescriptorSet`` with all imports (``--include_imports``).

    ``include`` are extra ``-I`` directories; the file's own directory and the
    well-known types are always on the path.
    """
    import grpc_tools
    from grpc_tools import protoc

    source = Path(path).resolve()
    if not source.is_file():
        raise SchemaError(f"no such .proto file: {source}")
    wkt = Path(grpc_tools.__file__).parent / "_proto"
    dirs = [str(Path(d).resolve()) for d in (include or [])] or [str(source.parent)]
    relative = None
    for d in dirs:
        try:
            relative = str(source.relative_to(d))
            break
        except ValueError:
            continue
    if relative is None:
        raise SchemaError(f"{source} is not under any include directory {dirs}; pass -I")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        args = ["protoc", *(f"-I{d}" for d in dirs), f"-I{wkt}", "--include_imports",
                f"--descriptor_set_out={out}", relative]
        code = protoc.main(args)
        if code != 0 or not out.exists():
            raise SchemaError(
                f"protoc failed on {source} (exit {code}); run the same command by hand to "
                f"see the error: python -m grpc_tools.protoc {' '.join(args[1:])}")
        return out.read_bytes()


def load_descriptor(file_descriptor_set: bytes, message_name: str) -> Descriptor:
    """The descriptor of ``message_name`` in a serialized ``FileDescriptorSet``."""
    fds = descriptor_pb2.FileDescriptorSet()
    try:
        fds.ParseFromString(file_descriptor_set)
    except DecodeError as exc:
        raise SchemaError(f"not a serialized FileDescriptorSet: {exc}") from exc
    pool = descriptor_pool.DescriptorPool()
    pending = {f.name: f for f in fds.file}
    added: set[str] = set()

    def add(name: str) -> None:
        if name in added:
            return
        proto = pending.get(name)
        if proto is None:
            raise SchemaError(
                f"the FileDescriptorSet lacks {name!r}, imported by another file; make it "
                "with protoc --include_imports")
        added.add(name)
        for dep in proto.dependency:
            add(dep)
        try:
            pool.Add(proto)
        except (TypeError, ValueError) as exc:
            raise SchemaError(f"file {name!r} is inconsistent: {exc}") from exc

    for name in pending:
        add(name)
    try:
        descriptor = pool.FindMessageTypeByName(message_name)
    except KeyError:
        names = sorted(_message_names(fds))
        raise SchemaError(
            f"message {message_name!r} is not in the FileDescriptorSet; it has: "
            f"{', '.join(names[:20]) or '(none)'}") from None
    check_bounded(descriptor)
    return descriptor


def check_bounded(descriptor: Descriptor) -> None:
    """Refuse a row type that contains itself (``message Node { repeated Node kids = 1; }``,
    ``google.protobuf.Struct``): a ClickHouse column has one fixed type, so a row's
    nesting must be bounded, and the decoder lays out every nested field ahead of time."""
    path: list[FieldDescriptor] = []
    open_types: set[str] = set()
    done: set[str] = set()

    def walk(message: Descriptor) -> None:
        open_types.add(message.full_name)
        for fd in message.fields:
            nested = fd.message_type
            if nested is None or nested.full_name in done:
                continue
            path.append(fd)
            if nested.full_name in open_types:
                loop = " -> ".join(f"{f.full_name.split('.')[-2]}.{f.name}" for f in path)
                raise SchemaError(
                    f"message {descriptor.full_name} is recursive ({loop} -> "
                    f"{nested.name}): a row type must have bounded nesting, since each "
                    "field maps to one ClickHouse column type; flatten the recursive part "
                    "or carry it as bytes")
            walk(nested)
            path.pop()
        open_types.discard(message.full_name)
        done.add(message.full_name)

    walk(descriptor)


def message_class(descriptor: Descriptor) -> type[Message]:
    """A Python class for ``descriptor`` (for producers, tests and the naive decoder)."""
    return message_factory.GetMessageClass(descriptor)


def _message_names(fds: descriptor_pb2.FileDescriptorSet) -> list[str]:
    names: list[str] = []
    for f in fds.file:
        prefix = f"{f.package}." if f.package else ""
        names.extend(prefix + m.name for m in f.message_type)
    return names


def is_repeated(fd: FieldDescriptor) -> bool:
    """Whether ``fd`` is a repeated (or map) field, on every supported protobuf:
    ``FieldDescriptor.is_repeated`` exists from protobuf 6.31 on and ``label`` is gone
    in 7.x, so neither alone covers ``protobuf>=5.26``."""
    flag = getattr(fd, "is_repeated", None)
    if flag is not None:
        return bool(flag)
    return bool(fd.label == FieldDescriptor.LABEL_REPEATED)  # type: ignore[attr-defined,unused-ignore]
