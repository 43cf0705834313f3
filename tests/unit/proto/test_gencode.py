"""The committed ``_pb2`` modules must load on every protobuf the project allows
(``protobuf>=5.26``): gencode from protoc <= 26 and no runtime-version gate."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from blockagg.proto.generate import MAX_GENCODE, gencode_version

GENERATED = sorted((Path(__file__).resolve().parents[3] / "blockagg" / "proto" / "blockagg" / "v1")
                   .glob("*_pb2.py"))


@pytest.mark.parametrize("module", GENERATED, ids=lambda p: p.name)
def test_gencode_fits_the_protobuf_floor(module: Path) -> None:
    text = module.read_text()
    version = gencode_version(text)
    assert version is not None and version <= MAX_GENCODE, (
        f"{module.name} is gencode {version}; regenerate with grpcio-tools==1.63.0 "
        "(python -m blockagg.proto.generate) or raise the protobuf floor")
    assert "ValidateProtobufRuntimeVersion" not in text


def test_gencode_version_parsing() -> None:
    assert gencode_version("# Protobuf Python Version: 7.35.1\n") == (7, 35)
    assert gencode_version("nothing") is None


@pytest.mark.parametrize("impl", ["upb", "python"])
def test_round_trip_on_each_backend(impl: str) -> None:
    code = (
        "from blockagg.proto.blockagg.v1 import envelope_pb2, registry_pb2\n"
        "e = envelope_pb2.Envelope(table='a.b', schema_version=2, rows=[b'x'])\n"
        "assert envelope_pb2.Envelope.FromString(e.SerializeToString()) == e\n"
        "r = registry_pb2.Registration(table='a.b', table_id=1)\n"
        "r.versions.add(version=1, message_name='m', registered_at_ms=5)\n"
        "assert registry_pb2.Registration.FromString(r.SerializeToString()) == r\n"
        "from google.protobuf.internal import api_implementation\n"
        "print(api_implementation.Type())\n")
    root = Path(__file__).resolve().parents[3]
    env = {"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": impl, "PATH": "/usr/bin:/bin",
           "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-W", "error", "-c", code], cwd=root, env=env,
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == impl
