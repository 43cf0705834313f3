# mypy: disable-error-code="type-arg"
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Envelope(_message.Message):
    __slots__ = ("table", "schema_version", "rows")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    table: str
    schema_version: int
    rows: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, table: _Optional[str] = ..., schema_version: _Optional[int] = ..., rows: _Optional[_Iterable[bytes]] = ...) -> None: ...
