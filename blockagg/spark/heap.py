"""The Python worker's heap, kept from one batch to the next.

A Spark Python worker serves batch after batch (``spark.python.worker.reuse``), each of
about the same size. glibc's malloc, left to itself, hands a batch's freed memory back
to the kernel (it trims the heap's top, unmaps large chunks, and raises its thresholds
only as it goes), so the next batch faults every page in again: at 400 blocks of 1,250
rows, 5,000–26,000 minor page faults a batch in a worker that has already served one,
a few µs each on a VM (docs/BENCHMARKS.md, *The worker's heap kept*). With the
thresholds below a batch reuses the memory the last one freed.

The cost: a worker keeps up to :data:`TRIM_THRESHOLD` of freed heap between batches
instead of returning it (its peak, which the batch needed anyway, is unchanged).
Nothing here changes what is computed; only where memory comes from.
"""

from __future__ import annotations

import ctypes
import functools
import platform
from typing import Final

from blockagg import logs

log = logs.get("task")

M_TRIM_THRESHOLD: Final = -1
M_TOP_PAD: Final = -2
M_MMAP_THRESHOLD: Final = -3
"""glibc's ``mallopt`` parameters (``malloc.h``)."""

TRIM_THRESHOLD: Final = 256 << 20
"""Freed memory at the heap's top kept rather than returned to the kernel."""

TOP_PAD: Final = 16 << 20
"""Extra the heap grows by at once, so a growing batch asks the kernel less often."""

MMAP_THRESHOLD: Final = 32 << 20
"""Allocations from this size up are mapped on their own (and returned when freed),
as glibc's dynamic threshold allows at most; below it they come from the heap. Fixing
it stops glibc from adjusting it, so the first batch already reuses its memory."""


@functools.cache
def keep_heap() -> bool:
    """Set the thresholds once per process; False where malloc is not glibc's (then
    nothing is changed)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (M_TOP_PAD, TOP_PAD)))
    if not ok:
        log.debug("mallopt refused a threshold; the worker's heap is glibc's default")
    return ok
