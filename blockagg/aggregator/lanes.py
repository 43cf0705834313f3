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
        # ``width`` lanes each take the next insert in order until none is left or
        # one failed: one task per lane, not per insert (a future, a queue hand-over
        # and a thread wake-up per block were a measurable part of a small block's
        # CPU, docs/BENCHMARKS.md).
        failed = threading.Event()
        errors: list[BaseException | None] = [None] * len(inserts)
        pending = iter(range(len(inserts)))
        taking = threading.Lock()

        def lane() -> None:
            while not failed.is_set():
                with taking:
                    i = next(pending, None)
                if i is None:
                    return
                try:
                    inserts[i]()
                except BaseException as exc:  # raised below, in the given order
                    errors[i] = exc
                    failed.set()

        futures: list[Future[None]] = [self._pool.submit(lane)
                                       for _ in range(min(self.width, len(inserts)))]
        for future in futures:
            future.result()
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def close(self) -> None:
        self._pool.shutdown(wait=True)
