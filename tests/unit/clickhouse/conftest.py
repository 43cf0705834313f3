from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf.descriptor import Descriptor

from blockagg.proto.descriptors import compile_proto, load_descriptor

SAMPLE = Path(__file__).parent.parent / "proto" / "sample.proto"


@pytest.fixture(scope="session")
def sample_fds() -> bytes:
    return compile_proto(SAMPLE)


@pytest.fixture(scope="session")
def sample(sample_fds: bytes) -> Descriptor:
    return load_descriptor(sample_fds, "blockagg.test.Sample")
