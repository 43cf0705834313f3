"""Each task's start in a Spark Python worker: ``python -m bench.bench_task_start
[--starts N] [--repeat R]``.

PySpark's worker calls ``importlib.invalidate_caches()`` before every task; on CPython
3.10/3.11 every zip importer on the worker's path then reads its archive's directory
again (``blockagg/spark/zip_imports.py``). This measures that call alone, with a real
worker's import state: one Spark task (``local[1]``, the job's task module imported as
a batch's task imports it) reports its worker's ``sys.path`` and every module it holds,
then fresh interpreters, alternating ``default`` and ``kept``
(:func:`~blockagg.spark.zip_imports.keep_zip_directories`) ABBA, set the same path,
import the same modules and time ``--starts`` calls. Reports the median ms a task start
of each and their ratio. No servers are needed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from typing import Any

from bench.workload import REPO_ROOT

STARTS = """
import importlib, json, sys, time, zipimport
state = json.loads(sys.stdin.read())
sys.path[:] = state["path"]
for name in state["modules"]:
    try:
        importlib.import_module(name)
    except Exception:
        pass
if state["mode"] == "kept":
    from blockagg.spark.zip_imports import keep_zip_directories
    assert keep_zip_directories()
    importlib.invalidate_caches()  # the first start after installing reads each once
seconds = []
for _ in range(state["starts"]):
    t = time.perf_counter()
    importlib.invalidate_caches()
    seconds.append(time.perf_counter() - t)
importers = sum(isinstance(f, zipimport.zipimporter) for f in sys.path_importer_cache.values())
print(json.dumps({"seconds": seconds, "importers": importers}))
"""


def worker_state() -> dict[str, Any]:
    """A real Spark Python worker's path and modules after a task that imported the
    job's task module."""
    from pyspark.sql import SparkSession

    def probe(rows: Any) -> Any:
        import sys as worker_sys

        import blockagg.spark.task  # noqa: F401  (what a batch's task imports)

        for _ in rows:
            pass
        yield (list(worker_sys.path), sorted(worker_sys.modules))

    spark = (SparkSession.builder.master("local[1]").appName("bench-task-start")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1").getOrCreate())
    try:
        path, modules = spark.sparkContext.parallelize([0], 1).mapPartitions(probe).collect()[0]
    finally:
        spark.stop()
    return {"path": path, "modules": [m for m in modules if not m.startswith("__")]}


def one_pass(state: dict[str, Any], mode: str, starts: int) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", STARTS], check=True, capture_output=True,
                         text=True, cwd=REPO_ROOT,
                         input=json.dumps(dict(state, mode=mode, starts=starts)))
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--starts", type=int, default=50, help="task starts timed a pass")
    ap.add_argument("--repeat", type=int, default=3, help="ABBA rounds")
    args = ap.parse_args(argv)
    state = worker_state()
    zips = [p for p in state["path"] if p.endswith((".zip", ".jar"))]
    print(f"# python {platform.python_version()}; worker path archives: {zips}; "
          f"{len(state['modules'])} modules")
    ms: dict[str, list[float]] = {"default": [], "kept": []}
    importers = 0
    for round_ in range(args.repeat):
        order = ("default", "kept") if round_ % 2 == 0 else ("kept", "default")
        for mode in order + order[::-1]:
            result = one_pass(state, mode, args.starts)
            importers = result["importers"]
            median = statistics.median(result["seconds"]) * 1000
            ms[mode].append(median)
            print(f"{mode:8} {median:8.3f} ms a task start")
    default, kept = statistics.median(ms["default"]), statistics.median(ms["kept"])
    print(f"zip importers: {importers}; median of {len(ms['default'])} passes: default "
          f"{default:.3f} ms, kept {kept:.3f} ms; kept/default {kept / default:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
