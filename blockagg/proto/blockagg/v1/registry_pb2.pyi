# mypy: disable-error-code="type-arg"
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SchemaVersion(_message.Message):
    __slots__ = ("version", "message_name", "file_descriptor_set", "registered_at_ms", "forced_incompatibilities", "position", "columns")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_NAME_FIELD_NUMBER: _ClassVar[int]
    FILE_DESCRIPTOR_SET_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    FORCED_INCOMPATIBILITIES_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    version: int
    message_name: str
    file_descriptor_set: bytes
    registered_at_ms: int
    forced_incompatibilities: _containers.RepeatedScalarFieldContainer[str]
    position: int
    columns: _containers.RepeatedCompositeFieldContainer[Column]
    def __init__(self, version: _Optional[int] = ..., message_name: _Optional[str] = ..., file_descriptor_set: _Optional[bytes] = ..., registered_at_ms: _Optional[int] = ..., forced_incompatibilities: _Optional[_Iterable[str]] = ..., position: _Optional[int] = ..., columns: _Optional[_Iterable[_Union[Column, _Mapping]]] = ...) -> None: ...

class Column(_message.Message):
    __slots__ = ("name", "type", "default_kind", "default_expression")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_KIND_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_EXPRESSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    type: str
    default_kind: str
    default_expression: str
    def __init__(self, name: _Optional[str] = ..., type: _Optional[str] = ..., default_kind: _Optional[str] = ..., default_expression: _Optional[str] = ...) -> None: ...

class Registration(_message.Message):
    __slots__ = ("table", "table_id", "versions", "compatibility")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    TABLE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    COMPATIBILITY_FIELD_NUMBER: _ClassVar[int]
    table: str
    table_id: int
    versions: _containers.RepeatedCompositeFieldContainer[SchemaVersion]
    compatibility: str
    def __init__(self, table: _Optional[str] = ..., table_id: _Optional[int] = ..., versions: _Optional[_Iterable[_Union[SchemaVersion, _Mapping]]] = ..., compatibility: _Optional[str] = ...) -> None: ...
