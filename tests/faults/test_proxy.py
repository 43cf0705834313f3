"""The fault proxy itself, against a loopback echo-with-side-effect server (no stack):
forwarding is transparent, a dropped answer still reaches the server (the side effect
happens exactly once) while the client sees a reset, refusal and blackhole behave as a
client would see them from a real outage, and the proxy goes back to forwarding."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from tests.faults.proxy import FaultProxy, Mode


class Server:
    """Reads one line per request, records it, answers ``ok:<line>``."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.received: list[bytes] = []
        self.stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        buf = b""
        conn.settimeout(5)
        try:
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    self.received.append(line)
                    conn.sendall(b"ok:" + line[:20] + b"\n")
        except OSError:
            return
        finally:
            conn.close()


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.stop = True
    s.sock.close()


def request(port: int, payload: bytes, timeout: float = 2.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as c:
        c.sendall(payload + b"\n")
        out = b""
        while not out.endswith(b"\n"):
            data = c.recv(65536)
            if not data:
                raise ConnectionResetError("closed without an answer")
            out += data
        return out


def test_forward_is_transparent(server: Server) -> None:
    with FaultProxy(server.port) as proxy:
        assert request(proxy.port, b"hello") == b"ok:hello\n"
        big = b"x" * 200_000
        assert request(proxy.port, big) == b"ok:" + b"x" * 20 + b"\n"
        assert server.received == [b"hello", big]
        assert proxy.stats.bytes_up == 6 + 200_001


def test_dropped_answer_is_applied_once_and_then_forwarding_resumes(server: Server) -> None:
    with FaultProxy(server.port) as proxy:
        proxy.drop_responses(count=1, min_request_bytes=1000)
        # a small request (a handshake) is not the one whose answer is dropped
        assert request(proxy.port, b"small") == b"ok:small\n"
        with pytest.raises(OSError):
            request(proxy.port, b"i" * 5000)
        assert proxy.wait_dropped(1, timeout=2)
        assert server.received[-1] == b"i" * 5000  # the server did apply it
        assert proxy.mode is Mode.FORWARD
        assert request(proxy.port, b"r" * 5000).startswith(b"ok:r")  # the retry goes through
        assert server.received.count(b"i" * 5000) == 1


def test_refuse_resets_new_and_existing_connections(server: Server) -> None:
    with FaultProxy(server.port) as proxy:
        held = socket.create_connection(("127.0.0.1", proxy.port), timeout=2)
        held.sendall(b"before\n")
        assert held.recv(100) == b"ok:before\n"
        proxy.set_mode(Mode.REFUSE)
        with pytest.raises(OSError):
            request(proxy.port, b"refused")
        with pytest.raises(OSError):
            held.sendall(b"after\n")
            if not held.recv(100):
                raise ConnectionResetError
        held.close()
        assert proxy.stats.refused >= 1
        proxy.set_mode(Mode.FORWARD)
        assert request(proxy.port, b"back") == b"ok:back\n"
        assert b"refused" not in server.received


def test_blackhole_times_out_and_swallows(server: Server) -> None:
    with FaultProxy(server.port) as proxy:
        proxy.set_mode(Mode.BLACKHOLE)
        with pytest.raises(TimeoutError):
            request(proxy.port, b"lost", timeout=0.5)
        assert b"lost" not in server.received
        proxy.set_mode(Mode.FORWARD)
        assert request(proxy.port, b"back") == b"ok:back\n"


def test_target_down_looks_like_a_refusal() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    with FaultProxy(port) as proxy, pytest.raises(OSError):
        request(proxy.port, b"nobody")


def test_only_loopback_targets() -> None:
    with pytest.raises(ValueError):
        FaultProxy(9000, target_host="10.0.0.1")
