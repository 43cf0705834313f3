"""The tree stays ruff- and mypy-clean (``pyproject.toml`` holds both configurations):
run here so that CI, which runs the README's test command, enforces it. Both tools come
with pytest in the ``dev`` extra, so a missing one is a failure, not a skip."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("tool", [["ruff", "check", "."], ["mypy", "."]], ids=["ruff", "mypy"])
def test_clean(tool: list[str]) -> None:
    res = subprocess.run([sys.executable, "-m", *tool], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, check=False)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
