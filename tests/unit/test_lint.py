"""The tree stays ruff- and mypy-clean (``pyproject.toml`` holds both configurations):
run here so that CI, which runs the README's test command, enforces it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("tool", [["ruff", "check", "."], ["mypy", "."]], ids=["ruff", "mypy"])
def test_clean(tool: list[str]) -> None:
    if shutil.which(tool[0]) is None:
        pytest.skip(f"{tool[0]} is not installed (pip install -e '.[dev]')")
    res = subprocess.run([sys.executable, "-m", *tool], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, check=False)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
