"""The zip archives on a Spark Python worker's import path, read once rather than once
a task.

PySpark's worker calls ``importlib.invalidate_caches()`` before each task's own code
(``pyspark.worker_util.setup_spark_files``). On CPython 3.10 and 3.11 that makes every
``zipimport.zipimporter`` read its archive's whole central directory again, there and
then, in Python (CPython gh-103200; 3.12 made it lazy). A worker holds one importer per
package path it has imported from an archive: ``pyspark.zip`` (1,220 entries) and each
of its subpackages, py4j's zip, and the ``spark-core`` jar (5,261 entries), which Spark
puts on every worker's ``PYTHONPATH``. Together that is 0.1 s of a core at the start of
every task on an idle machine, and 0.18–0.55 s of wall inside a batch whose other slot
and servers share the cores, before the task has read a record (docs/BENCHMARKS.md,
*Each task's start*).

:func:`keep_zip_directories` makes the re-read conditional: an importer reads its
archive again when the file has changed since it last read it (its size, modification
time in ns or inode differ), as the import system's own ``FileFinder`` trusts a
directory's modification time. An archive rewritten in place is still seen; an unchanged
one costs a ``stat``. What is imported, and from where, does not change.
"""

from __future__ import annotations

import functools
import os
import sys
import zipimport
from typing import Any, Final

from blockagg import logs

log = logs.get("task")

_READ_AT: Final = "_blockagg_archive_stat"
"""The importer attribute holding its archive's :func:`archive_stat` when it last read
the archive's directory."""


def archive_stat(path: str) -> tuple[int, int, int] | None:
    """What tells a rewritten archive from the one read: (size, mtime in ns, inode);
    None when the file cannot be read (then the importer is left to its own handling)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns, st.st_ino)


def eagerly_reread() -> bool:
    """True on the CPython versions whose ``zipimporter.invalidate_caches`` reads the
    archive's directory on every call (3.10 and 3.11)."""
    return sys.implementation.name == "cpython" and (3, 10) <= sys.version_info[:2] < (3, 12)


@functools.cache
def keep_zip_directories() -> bool:
    """Install the conditional re-read once per process; False where the interpreter
    already reads lazily (nothing is changed then)."""
    if not eagerly_reread():
        return False
    eager = zipimport.zipimporter.invalidate_caches

    def invalidate_caches(self: Any) -> None:
        archive = getattr(self, "archive", None)
        if not isinstance(archive, str):
            eager(self)
            return
        now = archive_stat(archive)
        if now is not None and getattr(self, _READ_AT, None) == now:
            return
        eager(self)
        if now is not None:
            setattr(self, _READ_AT, now)

    invalidate_caches.__doc__ = eager.__doc__
    zipimport.zipimporter.invalidate_caches = invalidate_caches  # type: ignore[method-assign]
    log.debug("zip archives on the import path are read again only when they change")
    return True
