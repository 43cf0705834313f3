"""Stop signals sent to the ``spark-submit`` JVM reach the Python driver.

Under ``spark-submit`` the JVM (``SparkSubmit`` running ``PythonRunner``) is the
parent of the Python driver. The JVM's own handlers of SIGTERM and SIGINT start its
shutdown hooks, which stop the SparkContext under the running batch: the process
dies with 143/130 and Java traces, the batch half done. So the driver replaces the
JVM's handlers (``sun.misc.Signal.handle``) with a py4j callback that only *asks*
the Python driver to stop; the driver finishes the running batch, stops the query,
exits 0, and ``spark-submit`` exits with it. Ctrl-C in a terminal signals the whole
foreground process group (JVM and Python alike): each process's handler asks once,
the request is idempotent. Spark's Python workers run in their own process group
(``pyspark.daemon``) and never see the Ctrl-C.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from blockagg import logs

log = logs.get("job")

SIGNALS = ("TERM", "INT")


class _JvmHandler:
    """A ``sun.misc.SignalHandler`` implemented in Python (py4j callback)."""

    def __init__(self, name: str, on_signal: Callable[[str], None]) -> None:
        self._name = name
        self._on_signal = on_signal

    def handle(self, _signal: Any) -> None:
        try:
            self._on_signal(f"SIG{self._name}")
        except Exception as exc:  # never let a callback fail the JVM thread
            log.warning("stop signal handler failed: %s", exc)

    class Java:
        implements: ClassVar = ["sun.misc.SignalHandler"]


class JvmSignals:
    """The JVM's SIGTERM/SIGINT handlers, replaced while the driver runs."""

    def __init__(self, spark: Any) -> None:
        self._spark = spark
        self._previous: dict[str, Any] = {}
        self._handlers: list[_JvmHandler] = []

    def install(self, on_signal: Callable[[str], None]) -> bool:
        """Route the JVM's stop signals to ``on_signal(name)``; False when the JVM
        does not allow it (then the JVM keeps its own handlers)."""
        from pyspark.java_gateway import ensure_callback_server_started

        context = self._spark.sparkContext
        gateway = context._gateway
        jvm = context._jvm
        try:
            ensure_callback_server_started(gateway)  # type: ignore[no-untyped-call]
            for name in SIGNALS:
                handler = _JvmHandler(name, on_signal)
                self._handlers.append(handler)
                self._previous[name] = jvm.sun.misc.Signal.handle(
                    jvm.sun.misc.Signal(name), handler)
        except Exception as exc:  # e.g. a JVM started with -Xrs
            logs.event(log, "JVM stop signals not routed to the driver", level=30,
                       error=" ".join(str(exc).split())[:300])
            return False
        return True

    def restore(self) -> None:
        """Give the JVM its own handlers back (a signal after the driver's exit then
        ends the JVM as usual)."""
        if not self._previous:
            return
        jvm = self._spark.sparkContext._jvm
        for name, previous in self._previous.items():
            try:
                jvm.sun.misc.Signal.handle(jvm.sun.misc.Signal(name), previous)
            except Exception as exc:  # the JVM may be going away
                log.debug("restoring the JVM's %s handler failed: %s", name, exc)
        self._previous.clear()
