"""A real Spark standalone cluster on loopback, from pyspark's own install.

:class:`StandaloneCluster` starts a master and ``workers`` workers with pyspark's
``bin/spark-class`` (``org.apache.spark.deploy.master.Master`` and ``...worker.Worker``),
each in its own session so that killing a job's driver never touches them, waits until
every worker is registered (the master's ``/json`` page) and stops them all at the end
(its executors and their Python workers included). Executors are separate JVMs under
the workers, so they can outlive the driver that asked for them: the phenomenon the
``executor_stall`` fault needs.

:func:`project_zips` builds what ``spark-submit --py-files`` ships: ``blockagg.zip`` (the
``blockagg/`` package) and ``faulthooks.zip`` (``tests/faults/hooks.py`` and its
packages, which the task hooks pickled into every task need). The workers run with no
``PYTHONPATH``, so an executor imports blockagg from the shipped zip, never from the
checkout: the hooks record ``blockagg.__file__`` and the test checks it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from tests.faults.stack import REPO_ROOT

MASTER_PORT = 7077
MASTER_UI_PORT = 8080


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def project_zips(folder: Path) -> list[Path]:
    """``blockagg.zip`` and ``faulthooks.zip`` in ``folder`` (rebuilt each time)."""
    folder.mkdir(parents=True, exist_ok=True)
    project = folder / "blockagg.zip"
    with zipfile.ZipFile(project, "w", zipfile.ZIP_DEFLATED) as out:
        for path in sorted((REPO_ROOT / "blockagg").rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                out.write(path, path.relative_to(REPO_ROOT))
    hooks = folder / "faulthooks.zip"
    with zipfile.ZipFile(hooks, "w", zipfile.ZIP_DEFLATED) as out:
        for name in ("tests/__init__.py", "tests/faults/__init__.py", "tests/faults/hooks.py"):
            out.write(REPO_ROOT / name, name)
    return [project, hooks]


@dataclass
class StandaloneCluster:
    """A master and its workers; ``shift`` moves the master's ports (7077, 8080)."""

    folder: Path
    shift: int = 0
    workers: int = 2
    cores: int = 1
    memory: str = "1g"
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"spark://127.0.0.1:{MASTER_PORT + self.shift}"

    @property
    def ui(self) -> str:
        return f"http://127.0.0.1:{MASTER_UI_PORT + self.shift}"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k != "PYTHONPATH" and not k.startswith("PYSPARK_")}
        env.update({
            "SPARK_HOME": str(spark_home()),
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_LOG_DIR": str(self.folder / "logs"),
            "SPARK_CONF_DIR": str(self.folder / "conf"),
            "PYSPARK_PYTHON": sys.executable,
        })
        return env

    def _spawn(self, name: str, *args: str) -> None:
        log = open(self.folder / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        self.procs.append(subprocess.Popen(
            [str(spark_home() / "bin" / "spark-class"), *args], stdout=log,
            stderr=subprocess.STDOUT, env=self.env(), cwd=self.folder,
            start_new_session=True))
        log.close()

    def start(self, timeout: float = 120) -> None:
        for sub in ("logs", "conf"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        self._spawn("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                    "--port", str(MASTER_PORT + self.shift),
                    "--webui-port", str(MASTER_UI_PORT + self.shift))
        for n in range(self.workers):
            work = self.folder / f"work-{n}"
            work.mkdir(exist_ok=True)
            self._spawn(f"worker-{n}", "org.apache.spark.deploy.worker.Worker",
                        "--host", "127.0.0.1", "--cores", str(self.cores),
                        "--memory", self.memory, "--webui-port", "0",
                        "--work-dir", str(work), self.url)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.alive_workers()) >= self.workers:
                return
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(1)
        self.stop()
        logs = "\n".join(p.read_text(errors="replace")[-2000:]
                         for p in sorted(self.folder.glob("*.log")))
        raise RuntimeError(f"the standalone cluster did not come up at {self.url}:\n{logs}")

    def alive_workers(self) -> list[dict[str, object]]:
        try:
            with urllib.request.urlopen(f"{self.ui}/json", timeout=5) as answer:
                state = json.load(answer)
        except OSError:
            return []
        return [w for w in state.get("workers", []) if w.get("state") == "ALIVE"]

    def stop(self) -> None:
        """SIGTERM every master/worker session (executors included), then SIGKILL."""
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        self.procs.clear()

