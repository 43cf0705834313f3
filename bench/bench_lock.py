"""Lock hand-over after a kill -9: ``python -m bench.bench_lock [--repeat R]``.

A job killed with ``kill -9`` leaves its membership of the lock group
(``<metadata_group_id>.lock``, :class:`spark.lock.GroupLock`) behind; the next run
cannot hold the lock until the broker expires it, ``job.lock_session_timeout`` later.
This measures that wait alone, against the broker of ``scripts/stack`` (its address
from ``BLOCKAGG_BOOTSTRAP_SERVERS`` or ``bench.workload.stack_env``): a child process
acquires the lock and is killed with SIGKILL, then this process times
:meth:`GroupLock.acquire`. The baseline is the default session timeout (10 s); the
candidates run interleaved with it (ABBA), each on a fresh group and topic.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid

from bench.workload import REPO_ROOT, create_topic, stack_env

_HOLDER = """
import sys, time
from blockagg.spark.lock import GroupLock
lock = GroupLock({"bootstrap.servers": sys.argv[1]}, sys.argv[2], [sys.argv[3]],
                 lambda t: t == sys.argv[3], client_id="holder",
                 session_timeout_ms=int(sys.argv[4]))
lock.acquire(60)
print("held", flush=True)
time.sleep(3600)
"""


def handover_seconds(bootstrap: str, session_ms: int) -> float:
    """Seconds from a holder's SIGKILL until a new member holds the lock."""
    from blockagg.spark.lock import GroupLock

    name = f"lockbench-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, name, 4)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, bootstrap, name, name, str(session_ms)],
        stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        assert holder.stdout is not None
        if holder.stdout.readline().strip() != "held":
            raise RuntimeError("the holder did not acquire the lock")
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        started = time.monotonic()
        lock = GroupLock({"bootstrap.servers": bootstrap}, name, [name],
                         lambda t: t == name, client_id="next", session_timeout_ms=session_ms)
        lock.acquire(120)
        took = time.monotonic() - started
        lock.release()
        return took
    finally:
        if holder.poll() is None:
            holder.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--session-ms", type=int, nargs="+", default=[6000],
                    help="candidate lock session timeouts (ms), against the 10000 baseline")
    args = ap.parse_args(argv)
    bootstrap = os.environ.get("BLOCKAGG_BOOTSTRAP_SERVERS") or stack_env()[
        "BLOCKAGG_BOOTSTRAP_SERVERS"]
    baseline = 10_000
    times: dict[int, list[float]] = {ms: [] for ms in [baseline, *args.session_ms]}
    for r in range(args.repeat):
        order = list(times) if r % 2 == 0 else list(reversed(times))
        for ms in order:
            times[ms].append(handover_seconds(bootstrap, ms))
            print(f"session {ms} ms: {times[ms][-1]:.2f} s", file=sys.stderr, flush=True)
    base = statistics.median(times[baseline])
    print("| lock session timeout | kill -9 to lock held, median (s) | each (s) | vs 10 s |")
    print("| --- | --- | --- | --- |")
    for ms, xs in times.items():
        med = statistics.median(xs)
        ratio = "baseline" if ms == baseline else f"{base / med:.2f}x faster"
        print(f"| {ms / 1000:g} s | {med:.2f} | {', '.join(f'{x:.2f}' for x in xs)} | {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
