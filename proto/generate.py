"""Regenerate the committed ``*_pb2.py``/``*_pb2.pyi`` modules from ``proto/blockagg/v1``.

Run ``python -m proto.generate`` after editing a ``.proto`` file. The ``.pyi`` stubs
get a ``type-arg`` exemption because protoc's stubs use bare ``Mapping`` and the
project runs mypy in strict mode.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent
_HEADER = '# mypy: disable-error-code="type-arg"\n'


def main() -> int:
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "blockagg" / "v1").glob("*.proto"))
    code = protoc.main(
        ["protoc", f"-I{ROOT}", f"--python_out={ROOT}", f"--pyi_out={ROOT}", *sources]
    )
    if code != 0:
        return int(code)
    for stub in (ROOT / "blockagg" / "v1").glob("*_pb2.pyi"):
        text = stub.read_text()
        if not text.startswith(_HEADER):
            stub.write_text(_HEADER + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
