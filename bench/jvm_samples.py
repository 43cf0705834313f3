"""Where the job's JVM spent a window of time, from a Java Flight Recorder file.

``python -m bench.jvm_samples FILE.jfr [--since EPOCH] [--until EPOCH]`` reads the
recording's ``jdk.ExecutionSample`` events (``jfr print --json``: a Java thread's
stack, sampled while it runs Java code, every 10 ms with ``settings=profile``) and
prints, for the samples inside the window, the share of each part of the job's
read path (:data:`PARTS`, matched on the stack from its top frame down) and the
hottest top frames. Samples are of Java threads running Java code: the JIT
compilers' threads and the JVM's own C++ work (garbage collection among it) are not
in them; the process's CPU is (``bench_e2e``'s ``job_cpu_s``).

Written by ``bench_e2e --jfr`` (``-XX:StartFlightRecording`` in the driver's JVM,
which in local mode is also the executor's), one file per job run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Final

PARTS: Final[tuple[tuple[str, tuple[str, ...]], ...]] = (
    ("lz4 decompression", ("net.jpountz.", "KafkaLZ4BlockInputStream")),
    ("zstd/snappy/gzip decompression", ("com.github.luben.", "org.xerial.snappy.",
                                       "java.util.zip.Inflater")),
    ("record CRC", ("java.util.zip.CRC32C", "DefaultRecordBatch.isValid",
                    "DefaultRecordBatch.ensureValid")),
    ("Kafka record parsing", ("org.apache.kafka.common.record.",)),
    ("Kafka fetch and network", ("org.apache.kafka.clients.", "org.apache.kafka.common.network",
                                 "sun.nio.")),
    ("Spark's Kafka source", ("org.apache.spark.sql.kafka010.",)),
    ("rows to Arrow", ("org.apache.spark.sql.execution.arrow.", "org.apache.arrow.")),
    ("Python hand-over", ("org.apache.spark.api.python.",
                          "org.apache.spark.sql.execution.python.")),
    ("Spark codegen rows", ("GeneratedClass", "org.apache.spark.sql.catalyst.expressions.")),
    ("Spark scheduling and RPC", ("org.apache.spark.scheduler.", "org.apache.spark.rpc.",
                                  "io.netty.")),
    ("Py4J (driver calls)", ("py4j.",)),
)
"""(part, frame prefixes): a sample belongs to the first part one of whose prefixes
starts a frame's ``class.method``, looking from the top of the stack down (so a CRC
computed inside the record parser counts as CRC)."""


@dataclass(frozen=True)
class Sample:
    at: float
    thread: str
    frames: tuple[str, ...]
    """``class.method``, top of the stack first."""


def _epoch(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def read_samples(jfr: Path) -> list[Sample]:
    """Every ``jdk.ExecutionSample`` of ``jfr`` (``jfr print --json``)."""
    out = subprocess.run(["jfr", "print", "--json", "--stack-depth", "64", "--events",
                          "jdk.ExecutionSample", str(jfr)],
                         check=True, capture_output=True, text=True)
    events = json.loads(out.stdout)["recording"]["events"]
    samples = []
    for event in events:
        values: dict[str, Any] = event["values"]
        stack = values.get("stackTrace") or {}
        frames = tuple(  # JFR names classes with "/": the prefixes use "."
            f"{f['method']['type']['name'].replace('/', '.')}.{f['method']['name']}"
            for f in stack.get("frames", []))
        thread = (values.get("sampledThread") or {}).get("javaName") or ""
        samples.append(Sample(_epoch(values["startTime"]), thread, frames))
    return samples


def part_of(frames: Sequence[str]) -> str:
    for frame in frames:
        for part, prefixes in PARTS:
            if any(frame.startswith(p) or p in frame for p in prefixes):
                return part
    return "other"


def summarize(samples: Iterable[Sample], since: float = 0.0, until: float = float("inf"),
              top: int = 15) -> dict[str, Any]:
    """Samples in [since, until): their count, and counts by part, by thread kind and
    by top frame (the ``top`` hottest)."""
    inside = [s for s in samples if since <= s.at < until]
    parts = Counter(part_of(s.frames) for s in inside)
    threads = Counter(_thread_kind(s.thread) for s in inside)
    frames = Counter(s.frames[0] if s.frames else "?" for s in inside)
    return {"samples": len(inside), "parts": dict(parts.most_common()),
            "threads": dict(threads.most_common()),
            "top_frames": dict(frames.most_common(top))}


def _thread_kind(name: str) -> str:
    if name.startswith("Executor task launch worker"):
        return "task"
    for kind in ("stdout writer", "Thread-", "dispatcher-", "py4j", "stream execution",
                 "kafka-", "shuffle", "netty", "rpc"):
        if kind.lower() in name.lower():
            return kind.rstrip("-")
    return name.split(" ")[0] if name else "?"


def lines(summary: dict[str, Any]) -> list[str]:
    total = summary["samples"] or 1
    out = [f"{summary['samples']} samples"]
    out += [f"  {100 * n / total:5.1f}%  {part}" for part, n in summary["parts"].items()]
    out.append("threads:")
    out += [f"  {100 * n / total:5.1f}%  {kind}" for kind, n in summary["threads"].items()]
    out.append("top frames:")
    out += [f"  {100 * n / total:5.1f}%  {frame}" for frame, n in summary["top_frames"].items()]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jfr", type=Path)
    ap.add_argument("--since", type=float, default=0.0, help="epoch seconds")
    ap.add_argument("--until", type=float, default=float("inf"), help="epoch seconds")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args(argv)
    print("\n".join(lines(summarize(read_samples(args.jfr), args.since, args.until,
                                    args.top))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
