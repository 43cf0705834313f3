"""The README's main command on the real stack: ``scripts/demo`` with real ClickHouse
replicas (insert_quorum = 2), the schema registry, dead letters and ``arv verify``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_demo_ends_in_success(stack_env: dict[str, str]) -> None:
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "demo"), "--messages", "3000",
                          "--partitions", "3", "--bad", "0.01"],
                         capture_output=True, text=True, timeout=900, cwd=REPO, check=False)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    assert "SUCCESS: every produced row is in ClickHouse exactly once" in out
    assert "MISMATCH" not in out
    assert "duplicated ids: 0" in out
