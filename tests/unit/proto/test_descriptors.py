"""``load_descriptor`` refuses row types whose nesting is unbounded, naming the loop."""

from __future__ import annotations

from pathlib import Path

import pytest

from blockagg.proto.descriptors import compile_proto, load_descriptor
from blockagg.proto.exceptions import SchemaError

RECURSIVE = """
syntax = "proto3";
package blockagg.test;
import "google/protobuf/struct.proto";
message Leaf { string name = 1; }
message Node { string name = 1; repeated Child kids = 2; Leaf leaf = 3; }
message Child { Node node = 1; }
message Tree { uint64 id = 1; Node root = 2; }
message Shared { Leaf a = 1; Leaf b = 2; repeated Leaf c = 3; }
message Loose { uint64 id = 1; google.protobuf.Struct attributes = 2; }
"""


@pytest.fixture(scope="module")
def fds(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path: Path = tmp_path_factory.mktemp("proto") / "recursive.proto"
    path.write_text(RECURSIVE)
    return compile_proto(path)


def test_a_loop_through_other_messages_is_named(fds: bytes) -> None:
    with pytest.raises(SchemaError) as info:
        load_descriptor(fds, "blockagg.test.Tree")
    message = str(info.value)
    assert "blockagg.test.Tree is recursive" in message
    assert "Tree.root -> Node.kids -> Child.node -> Node" in message
    assert "bounded nesting" in message


def test_a_well_known_recursive_type_is_refused(fds: bytes) -> None:
    with pytest.raises(SchemaError, match=r"Loose is recursive \(Loose.attributes -> "):
        load_descriptor(fds, "blockagg.test.Loose")


def test_a_type_used_twice_is_not_a_loop(fds: bytes) -> None:
    assert load_descriptor(fds, "blockagg.test.Shared").name == "Shared"
    assert load_descriptor(fds, "blockagg.test.Leaf").name == "Leaf"
