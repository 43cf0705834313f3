"""What waiting on an answer costs the waiting thread: ``python -m bench.bench_wake``.

An insert lane sends a packet and sleeps until the server answers, twice an insert
(the sample block, the end). This measures the waiting thread's own CPU (user and
kernel, ``time.thread_time``) for one exchange on loopback TCP (140 bytes out, one
byte back), against a peer process that answers after ``--delays`` seconds: how much
of an insert's per-block CPU is the wake-up itself, and why work done right after one
costs more than the same work done in a row (docs/BENCHMARKS.md, *Blocks built
ahead*). The delays run interleaved, ``--repeat`` rounds, and the medians are printed.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections.abc import Sequence

REQUEST = b"x" * 140
"""About an insert's query packet."""


def _answer(listener: socket.socket, delay_s: float, exchanges: int) -> None:
    """The peer: read each request whole, wait ``delay_s``, answer one byte; stop
    when the measuring side closes."""
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(exchanges):
        got = 0
        while got < len(REQUEST):
            chunk = conn.recv(len(REQUEST) - got)
            if not chunk:  # the measuring side gave up
                return
            got += len(chunk)
        if delay_s:
            time.sleep(delay_s)
        conn.sendall(b"\x05")
    conn.close()


def exchange_cpu_us(delay_s: float, exchanges: int) -> float:
    """The waiting thread's CPU per exchange, in µs, against a peer answering after
    ``delay_s`` (a forked process, as the servers are)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(60)  # the peer ends if the measuring side never connects
    pid = os.fork()
    if pid == 0:
        try:
            _answer(listener, delay_s, exchanges)
        finally:
            os._exit(0)
    address = listener.getsockname()
    listener.close()
    sock = socket.create_connection(address)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(60)  # as the driver's sockets: a poll before each call
    buffer = bytearray(1 << 20)
    began = time.thread_time()
    for _ in range(exchanges):
        sock.sendall(REQUEST)
        if sock.recv_into(buffer) != 1:
            raise RuntimeError("the peer closed the connection")
    spent = time.thread_time() - began
    sock.close()
    os.waitpid(pid, 0)
    return spent / exchanges * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delays", default="0,0.001,0.01",
                    help="the peer's answer delays, seconds, comma-separated")
    ap.add_argument("--seconds", type=float, default=3.0,
                    help="about how long each measurement runs")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    delays = [float(d) for d in args.delays.split(",")]
    results: dict[float, list[float]] = {d: [] for d in delays}
    for i in range(args.repeat):
        for delay in (delays if i % 2 == 0 else delays[::-1]):
            exchanges = max(20, min(5000, int(args.seconds / max(delay, 0.0005))))
            results[delay].append(exchange_cpu_us(delay, exchanges))
    load = os.getloadavg()
    print(f"# load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at end")
    for delay, values in results.items():
        shown = " ".join(f"{v:.1f}" for v in values)
        print(f"answer after {delay * 1e3:6.1f} ms: {statistics.median(values):6.1f} µs of the "
              f"waiting thread's CPU an exchange (runs: {shown})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
