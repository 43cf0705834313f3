"""How long a test's Spark driver takes to start and run one small query, with the
JVM's default JIT against the tests' options (``tests/conftest.py``:
``SPARK_SUBMIT_OPTS``), ABBA-ordered, reported as the ratio of medians.

    python -m bench.bench_test_jvm --rounds 3

Each run is ``spark-submit --master local[2]`` of a script that builds a session and
counts 100k rows by key: what a test job's first batch costs the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.conftest import TEST_JVM_OPTIONS

QUERY = """
from pyspark.sql import SparkSession
spark = SparkSession.builder.config("spark.ui.enabled", "false").getOrCreate()
rows = spark.range(0, 100000).selectExpr("id % 7 AS k").groupBy("k").count().collect()
assert len(rows) == 7
spark.stop()
"""


def run_once(script: Path, options: str) -> float:
    env = {k: v for k, v in os.environ.items() if k != "SPARK_SUBMIT_OPTS"}
    if options:
        env["SPARK_SUBMIT_OPTS"] = options
    started = time.monotonic()
    subprocess.run(["spark-submit", "--master", "local[2]", str(script)], env=env,
                   check=True, capture_output=True)
    return time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="ABBA rounds (4 runs each)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "query.py"
        script.write_text(QUERY)
        times: dict[str, list[float]] = {"default": [], "tests": []}
        for _ in range(args.rounds):
            for name in ("default", "tests", "tests", "default"):
                times[name].append(run_once(script, TEST_JVM_OPTIONS if name == "tests" else ""))
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, values in times.items():
        print(f"{name:8} median {medians[name]:.2f} s  runs {[round(v, 2) for v in values]}")
    print(f"ratio tests/default {medians['tests'] / medians['default']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
