"""The sample message types of ``tests/unit/proto`` (registration registers them)."""

from __future__ import annotations

from tests.unit.proto.conftest import sample, sample_fds

__all__ = ["sample", "sample_fds"]
