from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf.descriptor import Descriptor

from blockagg.proto.descriptors import compile_proto, load_descriptor

SAMPLE = Path(__file__).with_name("sample.proto")


@pytest.fixture(scope="session")
def sample_fds() -> bytes:
    return compile_proto(SAMPLE)


@pytest.fixture(scope="session")
def sample(sample_fds: bytes) -> Descriptor:
    return load_descriptor(sample_fds, "blockagg.test.Sample")


@pytest.fixture(params=["compiled", "numpy"])
def wire_scan(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test with the compiled wire scan (``proto/_wirescan.c``), then without it:
    the decoder must give the same answers either way (an executor may lack the build)."""
    from blockagg.proto import decode

    if request.param == "numpy":
        monkeypatch.setattr(decode, "_wirescan", None)
    elif decode._wirescan is None:
        pytest.fail("blockagg.proto._wirescan is not built: `pip install -e .` compiles it "
                    "(needs a C compiler and Python's headers)")
    return str(request.param)
