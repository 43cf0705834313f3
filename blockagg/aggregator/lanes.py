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

:class:`SharedPermits` bounds the inserts in flight across every task of one executor
(``clickhouse.executor_insert_concurrency``): each task's lanes may then run up to
``insert_concurrency`` inserts, and while another task reads or decodes, or has
finished, the ones still inserting use the permits it leaves free. The permits only
delay when an insert starts, never which blocks or in what order a lane takes them.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from blockagg.exceptions import ConfigError

PERMIT_POLL_S = 0.002
"""How long a lane waits before it looks for a free permit again (an insert takes
tens of milliseconds)."""


class SharedPermits:
    """At most ``count`` holders at once across every process and thread that opens
    the same ``directory``: one lock file a permit, taken with ``flock``. A process
    that dies releases its permits with its file descriptors, so a killed Python
    worker never leaves a permit taken. Each thread opens its own descriptors
    (``flock`` locks an open file description, so two threads of one process exclude
    each other too). Of the lanes waiting for a permit, only the one holding the
    ``queue`` file looks for a free one, every ``poll_s``; the others wait for the
    queue in the kernel, so a crowd of waiting lanes costs no CPU."""

    def __init__(self, directory: Path, count: int, poll_s: float = PERMIT_POLL_S) -> None:
        if count < 1:
            raise ConfigError(f"executor insert concurrency must be >= 1, got {count}")
        self.directory = directory
        self.count = count
        self.poll_s = poll_s
        self._local = threading.local()
        self._starts = itertools.count(os.getpid())
        directory.mkdir(parents=True, exist_ok=True)

    def _descriptors(self) -> list[int]:
        """This thread's descriptors: the ``count`` permits, then the queue."""
        fds: list[int] | None = getattr(self._local, "fds", None)
        if fds is None:
            fds = [os.open(self.directory / name, os.O_RDWR | os.O_CREAT, 0o600)
                   for name in [*(f"{i}.lock" for i in range(self.count)), "queue"]]
            self._local.fds = fds
        return fds

    def _take(self, fds: list[int], start: int) -> int | None:
        """A permit's descriptor, locked, if one is free now."""
        for k in range(self.count):
            fd = fds[(start + k) % self.count]
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            return fd
        return None

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Hold one permit for the block of the ``with``; waits until one is free."""
        fds = self._descriptors()
        start = next(self._starts)
        fd = self._take(fds, start)
        if fd is None:
            queue = fds[self.count]
            fcntl.flock(queue, fcntl.LOCK_EX)
            try:
                while (fd := self._take(fds, start)) is None:
                    time.sleep(self.poll_s)
            finally:
                fcntl.flock(queue, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)


class ThreadLanes:
    """Runs an event's inserts on up to ``width`` threads (``width`` 1: in order, on
    one thread, as the serial executor does); with ``permits``, each insert also holds
    one of them while it runs."""

    def __init__(self, width: int, permits: SharedPermits | None = None) -> None:
        if width < 1:
            raise ConfigError(f"insert concurrency must be >= 1, got {width}")
        self.width = width
        self.permits = permits
        self._pool = ThreadPoolExecutor(max_workers=width, thread_name_prefix="insert-lane")

    def _start(self, insert: Callable[[], None], failed: threading.Event | None = None) -> None:
        """Run ``insert``, holding a permit if there are any; not once ``failed`` is set
        while it waited for one. A failure sets ``failed`` before its permit is
        released, so the lane that takes the permit next sees it."""
        if self.permits is None:
            insert()
            return
        with self.permits.hold():
            if failed is not None and failed.is_set():
                return
            try:
                insert()
            except BaseException:
                if failed is not None:
                    failed.set()
                raise

    def run(self, inserts: Sequence[Callable[[], None]]) -> None:
        """Run every insert; raise the first failure (in the given order) once every
        insert that started has ended, having started none after the failure."""
        if len(inserts) <= 1 or self.width == 1:
            for insert in inserts:
                self._start(insert)
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
                    self._start(inserts[i], failed)
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
