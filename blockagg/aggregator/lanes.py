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
import select
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path

from blockagg.exceptions import ConfigError

PERMIT_POLL_S = 0.05
"""How long the waiting lane sleeps before it looks for a free permit again when no
release woke it: a permit freed by a killed process wakes nobody (its descriptors
close in the kernel), so this bounds how long such a permit stays idle."""


class SharedPermits:
    """At most ``count`` holders at once across every process and thread that opens
    the same ``directory``: one lock file a permit, taken with ``flock``. A process
    that dies releases its permits with its file descriptors, so a killed Python
    worker never leaves a permit taken. Each thread opens its own descriptors
    (``flock`` locks an open file description, so two threads of one process exclude
    each other too).

    Every lane asks through the ``queue`` file, so a lane that has just freed a
    permit queues behind the lanes already waiting instead of taking it back at once
    (when it could, the tasks that started first kept the permits and the last ran
    on alone). Only the queue's holder looks for a free permit; the others wait for
    the queue in the kernel, so a crowd of waiting lanes costs no CPU. A release
    writes a byte to the ``wake`` FIFO, which the waiting lane sleeps on, so a freed
    permit is taken at once; ``poll_s`` only bounds the sleep when no release wakes
    it."""

    def __init__(self, directory: Path, count: int, poll_s: float = PERMIT_POLL_S) -> None:
        if count < 1:
            raise ConfigError(f"executor insert concurrency must be >= 1, got {count}")
        self.directory = directory
        self.count = count
        self.poll_s = poll_s
        self._local = threading.local()
        self._starts = itertools.count(os.getpid())
        directory.mkdir(parents=True, exist_ok=True)
        try:
            os.mkfifo(directory / "wake", 0o600)
        except FileExistsError:
            pass
        except OSError as exc:
            raise ConfigError(
                f"executor insert permits need lock files and a FIFO in {directory}, "
                f"which refused the FIFO: {exc}; give the executors a local "
                "spark.local.dir or set clickhouse.executor_insert_concurrency = 0"
            ) from exc

    def _descriptors(self) -> list[int]:
        """This thread's descriptors: the ``count`` permits, the queue, then the wake
        FIFO's read and write ends (both non-blocking; holding a write end keeps the
        read end from reporting end-of-file when other writers close). They close
        when the thread ends."""
        held: _Descriptors | None = getattr(self._local, "held", None)
        if held is None:
            fds = [os.open(self.directory / name, os.O_RDWR | os.O_CREAT, 0o600)
                   for name in [*(f"{i}.lock" for i in range(self.count)), "queue"]]
            wake = self.directory / "wake"
            fds.append(os.open(wake, os.O_RDONLY | os.O_NONBLOCK))
            fds.append(os.open(wake, os.O_WRONLY | os.O_NONBLOCK))
            held = self._local.held = _Descriptors(fds)
        return held.fds

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

    def _sleep(self, wake: int) -> None:
        """Until a release writes to the wake FIFO, or ``poll_s``. The bytes are read
        after the wake-up and before the next look, so a release that comes between a
        failed look and this sleep is not missed: its byte is already waiting."""
        waiting = select.poll()
        waiting.register(wake, select.POLLIN)
        waiting.poll(self.poll_s * 1000)
        try:
            while os.read(wake, 4096):
                pass
        except BlockingIOError:
            pass

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Hold one permit for the block of the ``with``; waits its turn in the queue,
        then until one is free."""
        fds = self._descriptors()
        start = next(self._starts)
        queue, wake_read, wake_write = fds[self.count:]
        fcntl.flock(queue, fcntl.LOCK_EX)
        try:
            while (fd := self._take(fds, start)) is None:
                self._sleep(wake_read)
        finally:
            fcntl.flock(queue, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            with suppress(BlockingIOError):  # full of unread wake-ups: enough to wake on
                os.write(wake_write, b"\0")


class _Descriptors:
    """One thread's open permit files; closed once the thread's local data is gone."""

    def __init__(self, fds: list[int]) -> None:
        self.fds = fds
        weakref.finalize(self, _close_all, fds)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


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
