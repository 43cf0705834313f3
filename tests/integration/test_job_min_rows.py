"""``blocks.min_rows`` on the real stack (Kafka source, offset log, metadata store;
the deduplicating file sink of ``job_support``): a slow trickle into two tables over
two partitions forms blocks of a few rows with a 500 ms trigger; with ``min_rows`` the
driver calibrates on the first batches, restarts the query with Spark's
``minOffsetsPerTrigger``/``maxTriggerDelay``, and the same trickle forms several times
fewer, larger blocks, every message still once and within ``max_latency``."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from blockagg.proto.envelope import make_envelope
from tests.integration.job_support import stored

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
JOB_PY = REPO / "blockagg" / "spark" / "job.py"
TABLES = {"db.a": 1, "db.b": 2}
RATE = 20.0
"""Messages per second (one row each) over both partitions: four table-partitions."""
TRICKLE_S = 45.0
MIN_ROWS = 25
MAX_LATENCY_S = 8.0


class Trickle:
    """Produces ``RATE`` messages/s round-robin over partitions and tables, recording
    each message's Kafka timestamp by (partition, offset)."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        from confluent_kafka import Producer

        self.topic = topic
        self.producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
        self.sent: dict[tuple[int, int], float] = {}

    def run(self, seconds: float) -> None:
        def delivered(err: Any, msg: Any) -> None:
            assert err is None, err
            self.sent[(msg.partition(), msg.offset())] = msg.timestamp()[1] / 1000

        start = time.monotonic()
        i = 0
        while time.monotonic() - start < seconds:
            table = "db.a" if i % 4 < 2 else "db.b"
            self.producer.produce(self.topic, partition=i % 2, on_delivery=delivered,
                                  value=make_envelope(table, [f"r{i}".encode()]))
            self.producer.poll(0)
            i += 1
            time.sleep(max(0.0, start + i / RATE - time.monotonic()))
        assert self.producer.flush(30) == 0


def run_phase(tmp_path: Path, stack_env: dict[str, str], topic: str,
              *extra: str) -> tuple[list[dict[str, Any]], dict[tuple[int, int], float], str]:
    """One job over ``topic`` while the trickle runs; its blocks, what was sent, its log."""
    import json

    tag = uuid.uuid4().hex[:8]
    sink = tmp_path / f"sink-{tag}.jsonl"
    config = tmp_path / f"blockagg-{tag}.toml"
    config.write_text(f"""
[job]
name = "it-min-rows"
metadata_group_id = "it-min-rows-{tag}"
checkpoint_location = "{tmp_path / ('checkpoint-' + tag)}"
trigger_interval = "500ms"
lock_timeout = "20s"

[[topics]]
name = "{topic}"
replicas = ["127.0.0.1:19000"]

[blocks]
max_latency = "{MAX_LATENCY_S:g}s"

[kafka]
"bootstrap.servers" = "{stack_env['BLOCKAGG_BOOTSTRAP_SERVERS']}"

[metrics]
port = 0
""")
    env = {**os.environ,
           "BLOCKAGG_COMPONENTS": "tests.integration.job_support:from_env",
           "BLOCKAGG_TEST_SINK": str(sink),
           "BLOCKAGG_TEST_TABLES": ",".join(f"{k}={v}" for k, v in TABLES.items()),
           "PYTHONPATH": str(REPO), "BLOCKAGG_LOG_FORMAT": "text",
           "PYSPARK_SUBMIT_ARGS": f"--master local[2] --jars "
           f"{stack_env['BLOCKAGG_SPARK_JARS']} --conf spark.ui.enabled=false "
           "--conf spark.driver.host=127.0.0.1 pyspark-shell"}
    proc = subprocess.Popen([sys.executable, str(JOB_PY), "--config", str(config), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=REPO, start_new_session=True)
    lines: list[str] = []
    out = proc.stdout
    assert out is not None
    reader = threading.Thread(target=lambda: lines.extend(iter(out.readline, "")),
                              daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 180
        while not any("starting query" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-5000:]
            time.sleep(0.5)
        trickle = Trickle(stack_env["BLOCKAGG_BOOTSTRAP_SERVERS"], topic)
        trickle.run(TRICKLE_S)
        deadline = time.monotonic() + MAX_LATENCY_S + 60
        while True:
            blocks = [json.loads(line) for line in sink.read_text().splitlines()] \
                if sink.exists() else []
            seen = {(b["partition"], item[0]) for b in blocks for item in b["items"]}
            if seen >= set(trickle.sent) or time.monotonic() > deadline:
                break
            time.sleep(1)
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(10)
    got = stored(sink)  # every message once, retries identical
    assert sum(len(rows) for rows in got.rows.values()) == len(trickle.sent), \
        "".join(lines)[-5000:]
    return blocks, trickle.sent, "".join(lines)


def figures(blocks: list[dict[str, Any]], sent: dict[tuple[int, int], float]
            ) -> tuple[int, float, float]:
    """Blocks, median messages per block, worst latency (produce -> block written)."""
    first: dict[tuple[int, int], float] = {}
    for b in blocks:
        for offset, _ in b["items"]:
            first.setdefault((b["partition"], offset), b["at"])
    latency = [first[key] - at for key, at in sent.items()]
    return len(blocks), statistics.median(len(b["items"]) for b in blocks), max(latency)


def test_a_trickle_forms_fewer_larger_blocks_within_the_latency_bound(
        tmp_path: Path, stack_env: dict[str, str], new_topic: Callable[..., str]) -> None:
    """The job without and with ``min_rows`` run at the same time, each on its own topic
    and trickle, so that a loaded machine slows both alike: one after the other, an
    unsized run whose batches a busy machine slows forms larger blocks by itself (CI, two
    test workers: 40 blocks of a median 9 rows, against 64 for the sized run). Quiet,
    the sized run's median is 25 rows, with two busy cores beside it 20-21."""
    off_topic, on_topic = (new_topic(partitions=2, prefix="minrows") for _ in range(2))
    with ThreadPoolExecutor(2) as pool:
        off_run = pool.submit(run_phase, tmp_path, stack_env, off_topic)
        on_run = pool.submit(run_phase, tmp_path, stack_env, on_topic,
                             "--set", f"blocks.min_rows={MIN_ROWS}")
        off_blocks, off_sent, _ = off_run.result()
        on_blocks, on_sent, log = on_run.result()
    off = figures(off_blocks, off_sent)
    on = figures(on_blocks, on_sent)
    print(f"off: blocks={off[0]} median={off[1]} worst={off[2]:.1f}s; "
          f"on: blocks={on[0]} median={on[1]} worst={on[2]:.1f}s")
    assert "sizing: restarting the query" in log, log[-5000:]
    # blocks near min_rows, and larger than the unsized run's: on a loaded machine the
    # unsized run's slow batches form larger blocks by themselves (two test workers: a
    # median 9 and 13 rows, against 20 and 25 sized); a cold first batch counted in the
    # hold left a median 8
    assert on[1] >= MIN_ROWS / 2 and on[1] > off[1], (off, on)
    # the bound holds for the held batches; the calibration restart and a loaded
    # machine's slow batch add a few seconds at most, as much as the unsized run's
    assert on[2] <= max(MAX_LATENCY_S, off[2]) + 6, (off, on, log[-3000:])
