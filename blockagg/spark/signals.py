"""Stop signals sent to the ``spark-submit`` JVM reach the Python driver.

Under ``spark-submit`` the JVM (``SparkSubmit`` running ``PythonRunner``) is the
parent of the Python driver. The JVM's own handlers of SIGTERM and SIGINT start its
shutdown hooks, which stop the SparkContext under the running batch: the process
dies with 143/130 and Java traces, the batch half done. So while the driver runs:

- SIGTERM to the JVM goes to a py4j callback that only *asks* the Python driver to
  stop; the driver finishes the running batch, stops the query, exits 0, and
  ``spark-submit`` exits with it.
- SIGINT is *ignored* by the JVM. Ctrl-C in a terminal signals the whole foreground
  process group, so the Python driver receives it anyway and asks for the stop
  itself. A caught signal is reset to its default at ``exec``, an ignored one is
  inherited: with a handler in the JVM, every process the JVM spawns (Hadoop's
  ``chmod`` of each checkpoint file, ``jspawnhelper``) would die of the same Ctrl-C
  and fail the running batch (``Failed to exec spawn helper ... signal: 2``), so
  the stop would exit 1. Ignored, they run through it. SIGINT sent to the JVM alone
  does nothing; SIGTERM is the signal to send to a pid.

Spark's Python workers run in their own process group (``pyspark.daemon``) and never
see the Ctrl-C.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from blockagg import logs

log = logs.get("job")

ROUTED = ("TERM",)
IGNORED = ("INT",)


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
    """The JVM's stop signals while the driver runs: SIGTERM routed to the driver,
    SIGINT ignored (see the module's docstring for why)."""

    def __init__(self, spark: Any) -> None:
        self._spark = spark
        self._previous: dict[str, Any] = {}
        self._handlers: list[_JvmHandler] = []
        self.ignored: tuple[str, ...] = ()

    def install(self, on_signal: Callable[[str], None]) -> bool:
        """Route the JVM's SIGTERM to ``on_signal(name)`` and ignore its SIGINT; False
        when the JVM does not allow it (then the JVM keeps its own handlers)."""
        from pyspark.java_gateway import ensure_callback_server_started

        context = self._spark.sparkContext
        gateway = context._gateway
        jvm = context._jvm
        try:
            ensure_callback_server_started(gateway)  # type: ignore[no-untyped-call]
            for name in ROUTED:
                handler = _JvmHandler(name, on_signal)
                self._handlers.append(handler)
                self._previous[name] = jvm.sun.misc.Signal.handle(
                    jvm.sun.misc.Signal(name), handler)
        except Exception as exc:  # e.g. a JVM started with -Xrs
            logs.event(log, "JVM stop signals not routed to the driver", level=30,
                       error=" ".join(str(exc).split())[:300])
            return False
        for name in IGNORED:
            try:
                jvm.sun.misc.Signal.handle(jvm.sun.misc.Signal(name),
                                           jvm.sun.misc.SignalHandler.SIG_IGN)
            except Exception as exc:
                logs.event(log, "JVM's SIGINT not ignored: Ctrl-C may fail the running "
                           "batch", level=30, error=" ".join(str(exc).split())[:300])
            else:
                self.ignored += (name,)
        return True

    def restore(self) -> None:
        """Give the JVM its own SIGTERM handler back (a SIGTERM after the driver's exit
        then ends the JVM as usual). SIGINT stays ignored until the JVM exits: the JVM
        refuses a handler for a shutdown signal that is ignored (it returns without
        installing it), and the driver's exit ends the JVM anyway."""
        if not self._previous:
            return
        jvm = self._spark.sparkContext._jvm
        for name, previous in self._previous.items():
            try:
                jvm.sun.misc.Signal.handle(jvm.sun.misc.Signal(name), previous)
            except Exception as exc:  # the JVM may be going away
                log.debug("restoring the JVM's %s handler failed: %s", name, exc)
        self._previous.clear()
