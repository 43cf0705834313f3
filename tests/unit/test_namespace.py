"""One namespace: every import name blockagg installs is under ``blockagg.``.

proto-plus (a dependency of every google-cloud Python client) owns the top-level
import name ``proto``; ``spark``, ``aggregator`` and ``verifier`` are just as generic.
Installed beside such packages, blockagg must neither shadow them nor be shadowed.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_packaging_installs_only_blockagg() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["tool"]["setuptools"]["packages"]["find"]["include"] == ["blockagg*"]
    for target in project["project"]["scripts"].values():
        assert target.startswith("blockagg."), target
    tops = {p.name for p in REPO.iterdir() if (p / "__init__.py").exists()}
    assert tops <= {"blockagg", "tests", "bench", "scripts"}, tops


def test_proto_plus_and_blockagg_import_side_by_side() -> None:
    """In a fresh interpreter started outside the repository (so only installed
    packages are importable): ``proto`` is proto-plus, and blockagg's registry, CLI
    and job modules import beside it."""
    code = (
        "import proto, blockagg.proto.registry, blockagg.registration.cli, blockagg.spark.task\n"
        "import blockagg.verifier.cli, blockagg.aggregator.core.protocol\n"
        "assert hasattr(proto, 'Message') and hasattr(proto, 'Field'), proto.__file__\n"
        "assert 'blockagg' not in proto.__file__, proto.__file__\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True,
                         cwd="/", check=False)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]
