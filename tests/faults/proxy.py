"""A loopback TCP proxy whose behaviour is switched at run time, to put network faults
between the job and ClickHouse (or any other TCP service).

Modes (:class:`Mode`):

* ``FORWARD``: bytes flow both ways untouched.
* ``DROP_RESPONSE``: the request reaches the server and is executed, but its answer
  never reaches the client: once the client has sent at least ``min_request_bytes``
  since the server last answered (an ``INSERT`` carrying a data block, not a
  handshake or a ping), the next bytes the server sends are discarded and the client's
  connection is reset. For ClickHouse this is exactly "insert applied,
  acknowledgement lost": the server answers only after the block is written (and, with
  ``insert_quorum``, replicated), so the client must retry a block the server already
  has, and block deduplication has to drop the retry. ``drops`` bounds how many
  answers are dropped before the proxy falls back to ``FORWARD`` by itself.
* ``REFUSE``: new connections are accepted and reset at once; existing ones are reset.
* ``BLACKHOLE``: new connections are accepted and never answered; bytes on existing
  connections are swallowed in both directions (a partition: the peer sees a timeout,
  not an error).

The proxy listens on 127.0.0.1 only and forwards to a loopback target, so a test can
never send traffic off the machine. Every blocking call has a timeout and every thread
is a daemon that ends when the proxy is closed.
"""

from __future__ import annotations

import contextlib
import enum
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType

LOOPBACK = "127.0.0.1"
_POLL_S = 0.05
_CHUNK = 1 << 16


class Mode(enum.Enum):
    FORWARD = "forward"
    DROP_RESPONSE = "drop_response"
    REFUSE = "refuse"
    BLACKHOLE = "blackhole"


@dataclass
class ProxyStats:
    """What the proxy did; read it to check that a fault was really injected."""

    connections: int = 0
    refused: int = 0
    dropped_responses: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    dropped_bytes: int = 0
    events: list[tuple[float, str]] = field(default_factory=list)


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0): the peer sees ECONNRESET immediately."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class _Pipe:
    """One proxied connection: a client socket, a server socket, one pump thread."""

    def __init__(self, proxy: FaultProxy, client: socket.socket, server: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.server = server
        self.sent_since_answer = 0
        self.closed = False
        self.thread = threading.Thread(target=self._pump, daemon=True, name="fault-proxy-pipe")

    def close(self, reset_client: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        if reset_client:
            _reset(self.client)
        else:
            with contextlib.suppress(OSError):
                self.client.close()
        with contextlib.suppress(OSError):
            self.server.close()

    def _pump(self) -> None:
        try:
            while not self.closed and not self.proxy.closed:
                mode = self.proxy.mode
                if mode is Mode.REFUSE:
                    self.close(reset_client=True)
                    return
                try:
                    readable, _, _ = select.select([self.client, self.server], [], [], _POLL_S)
                except (OSError, ValueError):
                    break
                for sock in readable:
                    data = sock.recv(_CHUNK)
                    if not data:
                        self.close()
                        return
                    if mode is Mode.BLACKHOLE:
                        with self.proxy.lock:
                            self.proxy.stats.dropped_bytes += len(data)
                        continue
                    if sock is self.client:
                        self.server.sendall(data)
                        self.sent_since_answer += len(data)
                        with self.proxy.lock:
                            self.proxy.stats.bytes_up += len(data)
                        continue
                    if mode is Mode.DROP_RESPONSE and self.proxy._take_drop(
                            self.sent_since_answer):
                        # The server has executed the request and answered; the client
                        # never learns it. Keep the server side open a moment so the
                        # server finishes its answer without seeing a reset mid-insert.
                        with self.proxy.lock:
                            self.proxy.stats.dropped_bytes += len(data)
                        _reset(self.client)
                        self.closed = True
                        time.sleep(0.2)
                        with contextlib.suppress(OSError):
                            self.server.close()
                        return
                    self.sent_since_answer = 0
                    self.client.sendall(data)
                    with self.proxy.lock:
                        self.proxy.stats.bytes_down += len(data)
        except OSError:
            pass
        finally:
            self.close()
            self.proxy._forget(self)


class FaultProxy:
    """``FaultProxy(target_port)`` listens on an ephemeral (or given) loopback port and
    forwards to ``127.0.0.1:target_port``; switch with :meth:`set_mode` or
    :meth:`drop_responses`. Use as a context manager, or call :meth:`close`."""

    def __init__(self, target_port: int, listen_port: int = 0,
                 target_host: str = LOOPBACK, connect_timeout: float = 5.0) -> None:
        if not target_host.startswith("127."):
            raise ValueError(f"target {target_host} is not a loopback address")
        self.target = (target_host, target_port)
        self.connect_timeout = connect_timeout
        self.mode = Mode.FORWARD
        self.min_request_bytes = 1024
        self._drops_left = 0
        self.stats = ProxyStats()
        self.lock = threading.Lock()
        self.closed = False
        self._pipes: set[_Pipe] = set()
        self._held: list[socket.socket] = []
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((LOOPBACK, listen_port))
        self._listener.listen(128)
        self._listener.settimeout(_POLL_S)
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name="fault-proxy-accept")
        self._thread.start()

    # -- control -------------------------------------------------------------------

    def set_mode(self, mode: Mode) -> None:
        """Switch for every connection, existing and new. Leaving ``BLACKHOLE``
        resets the connections it held (their state is unknown to both ends)."""
        with self.lock:
            previous, self.mode = self.mode, mode
            self.stats.events.append((time.time(), mode.value))
            held, self._held = (self._held, []) if mode is not Mode.BLACKHOLE else ([], self._held)
            pipes = list(self._pipes) if previous is Mode.BLACKHOLE else []
        for sock in held:
            _reset(sock)
        for pipe in pipes:
            pipe.close(reset_client=True)

    def drop_responses(self, count: int = 1, min_request_bytes: int = 1024) -> None:
        """Drop the next ``count`` answers that follow a request of at least
        ``min_request_bytes`` bytes, then go back to ``FORWARD`` by itself."""
        with self.lock:
            self._drops_left = count
            self.min_request_bytes = min_request_bytes
        self.set_mode(Mode.DROP_RESPONSE)

    def wait_dropped(self, count: int, timeout: float) -> bool:
        """True once ``count`` answers were dropped in total (bounded wait)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.stats.dropped_responses >= count:
                return True
            time.sleep(_POLL_S)
        return self.stats.dropped_responses >= count

    def _take_drop(self, sent: int) -> bool:
        with self.lock:
            if self.mode is not Mode.DROP_RESPONSE or sent < self.min_request_bytes:
                return False
            if self._drops_left <= 0:
                return False
            self._drops_left -= 1
            self.stats.dropped_responses += 1
            self.stats.events.append((time.time(), "dropped_response"))
            if self._drops_left == 0:
                self.mode = Mode.FORWARD
                self.stats.events.append((time.time(), Mode.FORWARD.value))
            return True

    # -- plumbing ------------------------------------------------------------------

    def _forget(self, pipe: _Pipe) -> None:
        with self.lock:
            self._pipes.discard(pipe)

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            mode = self.mode
            with self.lock:
                self.stats.connections += 1
            if mode is Mode.REFUSE:
                with self.lock:
                    self.stats.refused += 1
                _reset(client)
                continue
            if mode is Mode.BLACKHOLE:
                with self.lock:
                    self._held.append(client)
                continue
            try:
                server = socket.create_connection(self.target, timeout=self.connect_timeout)
            except OSError:
                _reset(client)  # the target is down: the client sees a refusal, as it would
                continue
            server.settimeout(None)
            client.settimeout(None)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pipe = _Pipe(self, client, server)
            with self.lock:
                self._pipes.add(pipe)
            pipe.thread.start()

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        self._thread.join(timeout=2)
        with self.lock:
            pipes, self._pipes = list(self._pipes), set()
            held, self._held = self._held, []
        for pipe in pipes:
            pipe.close()
            pipe.thread.join(timeout=2)
        for sock in held:
            _reset(sock)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
