"""Insert lanes: the inserts of one seal event, several at once.

The core's executor (:func:`aggregator.core.protocol.run_batch`) hands each seal
event's inserts to a :class:`~aggregator.core.model.Lanes`. :class:`ThreadLanes` runs
up to ``width`` of them at a time on threads kept for the life of the Python worker
(so each lane keeps its ClickHouse connection warm across batches; the writer gives
every thread its own). The rules it keeps (``docs/protocol.md``, *Concurrent
inserts*): it is only ever given blocks whose intent is committed; it returns only
once every insert it started has ended, so the next commit waits for all of them; a
failure starts no further insert of the event and is raised, so the batch fails and
its retry replays the event identically.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from blockagg.exceptions import ConfigError


class ThreadLanes:
    """Runs an event's inserts on up to ``width`` threads (``width`` 1: in order, on
    one thread, as the serial executor does)."""

    def __init__(self, width: int) -> None:
        if width < 1:
            raise ConfigError(f"insert concurrency must be >= 1, got {width}")
        self.width = width
        self._pool = ThreadPoolExecutor(max_workers=width, thread_name_prefix="insert-lane")

    def run(self, inserts: Sequence[Callable[[], None]]) -> None:
        """Run every insert; raise the first failure (in the given order) once every
        insert that started has ended, having started none after the failure."""
        if len(inserts) <= 1 or self.width == 1:
            for insert in inserts:
                insert()
            return
        failed = threading.Event()

        def guarded(insert: Callable[[], None]) -> bool:
            if failed.is_set():
                return False
            try:
                insert()
            except BaseException:
                failed.set()
                raise
            return True

        futures: list[Future[bool]] = [self._pool.submit(guarded, insert)
                                       for insert in inserts]
        first: BaseException | None = None
        for future in futures:
            error = future.exception()
            if error is not None and first is None:
                first = error
        if first is not None:
            raise first

    def close(self) -> None:
        self._pool.shutdown(wait=True)
