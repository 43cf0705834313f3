"""The worker's heap kept between batches: a batch's freed memory is reused by the
next instead of being returned to the kernel and faulted in again. Each case runs in
a fresh interpreter, since glibc's thresholds are process-wide and move with what the
process has freed before."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

BATCHES = """
import resource, sys
from blockagg.spark.heap import keep_heap
if sys.argv[1] == "kept":
    assert keep_heap()
def batch():  # 800 blocks' worth of ~100 KB buffers, all freed at the end
    return [bytearray(100_000) for _ in range(800)]
batch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    batch()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults_over_five_batches(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", BATCHES, mode], capture_output=True,
                         text=True, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_a_batchs_freed_memory_is_reused_by_the_next_not_faulted_in_again() -> None:
    default = faults_over_five_batches("default")
    kept = faults_over_five_batches("kept")
    assert default > 5 * 15_000, f"glibc's default trimmed less than expected: {default}"
    assert kept < default // 20, (kept, default)
