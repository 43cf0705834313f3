"""Regenerate the committed ``*_pb2.py``/``*_pb2.pyi`` modules from ``proto/blockagg/v1``.

Run it after editing a ``.proto`` file, **with protoc 26.x** (``grpcio-tools`` 1.63),
in a throwaway environment, because that grpcio-tools pins ``protobuf<6``::

    python -m venv /tmp/blockagg-gen
    /tmp/blockagg-gen/bin/pip install "grpcio-tools==1.63.0"
    /tmp/blockagg-gen/bin/python -m blockagg.proto.generate

Why the old compiler: gencode is forward compatible but not backward compatible.
protoc 27+ writes a ``ValidateProtobufRuntimeVersion`` call that refuses any runtime
older than the compiler (protoc 35 -> protobuf >= 7.35), while ``pyproject.toml``
allows ``protobuf>=5.26``. Gencode from protoc 26.1 ("Protobuf Python Version:
5.26.1") has no such check and is tested with protobuf 5.26 and 7.x, upb and pure
Python (``tests/unit/proto/test_gencode.py``). The script refuses to write modules
whose gencode version is newer than :data:`MAX_GENCODE` (``--allow-newer`` to
override, which then requires raising the protobuf floor in ``pyproject.toml``).

The ``.pyi`` stubs get a ``type-arg`` exemption because protoc's stubs use bare
``Mapping`` and the project runs mypy in strict mode.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Final

ROOT = Path(__file__).resolve().parent
_HEADER = '# mypy: disable-error-code="type-arg"\n'
MAX_GENCODE: Final = (5, 26)
"""Newest gencode (major, minor) the ``protobuf`` floor in pyproject.toml accepts."""

_VERSION_RE: Final = re.compile(r"^# Protobuf Python Version: (\d+)\.(\d+)", re.M)


def gencode_version(text: str) -> tuple[int, int] | None:
    """The ``Protobuf Python Version`` a ``_pb2.py`` module was generated for."""
    m = _VERSION_RE.search(text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def main(argv: list[str] | None = None) -> int:
    from grpc_tools import protoc

    args = sys.argv[1:] if argv is None else argv
    allow_newer = "--allow-newer" in args
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "blockagg" / "v1").glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        code = protoc.main(
            ["protoc", f"-I{ROOT}", f"--python_out={out}", f"--pyi_out={out}", *sources])
        if code != 0:
            return int(code)
        generated = sorted(out.glob("blockagg/v1/*_pb2.py*"))
        for module in generated:
            if module.suffix != ".py":
                continue
            version = gencode_version(module.read_text())
            if version is not None and version > MAX_GENCODE and not allow_newer:
                print(f"protoc writes gencode {version[0]}.{version[1]}, which needs protobuf "
                      f">= {version[0]}.{version[1]} at runtime; pyproject.toml allows "
                      f"{MAX_GENCODE[0]}.{MAX_GENCODE[1]}. Run with grpcio-tools==1.63.0 "
                      "(see this module's docstring) or pass --allow-newer and raise the "
                      "floor.", file=sys.stderr)
                return 1
        for module in generated:
            text = module.read_text()
            if module.suffix == ".pyi" and not text.startswith(_HEADER):
                text = _HEADER + text
            target = ROOT / module.relative_to(out)
            target.write_text(text)
    shutil.rmtree(ROOT / "blockagg" / "v1" / "__pycache__", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
