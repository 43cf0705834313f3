"""The JVM's stop signals while the driver runs, against a scripted JVM: SIGTERM is
routed to the driver and given back afterwards; SIGINT is ignored, so that what the
JVM spawns inherits the ignored Ctrl-C instead of dying of it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from blockagg.spark.signals import JvmSignals

SIG_IGN = "SIG_IGN"


class FakeSignalTable:
    """``sun.misc.Signal`` as HotSpot behaves: ``handle`` returns the previous handler,
    and refuses a handler for a shutdown signal that is ignored (returns SIG_IGN
    without installing it)."""

    def __init__(self, refuse: frozenset[str] = frozenset()) -> None:
        self.handlers: dict[str, Any] = {"TERM": "Terminator", "INT": "Terminator"}
        self.refuse = refuse

    def handle(self, name: str, handler: Any) -> Any:
        if name in self.refuse:
            raise RuntimeError(f"Signal already used by VM or OS: SIG{name}")
        previous = self.handlers[name]
        if previous == SIG_IGN and handler != SIG_IGN:
            return SIG_IGN
        self.handlers[name] = handler
        return previous


class Signal:
    """``jvm.sun.misc.Signal``: callable as the constructor, with a static ``handle``."""

    def __init__(self, table: FakeSignalTable) -> None:
        self._table = table

    def __call__(self, name: str) -> str:
        return name

    def handle(self, name: str, handler: Any) -> Any:
        return self._table.handle(name, handler)


def spark_of(table: FakeSignalTable) -> Any:
    misc = SimpleNamespace(Signal=Signal(table), SignalHandler=SimpleNamespace(SIG_IGN=SIG_IGN))
    jvm = SimpleNamespace(sun=SimpleNamespace(misc=misc))
    return SimpleNamespace(sparkContext=SimpleNamespace(_gateway=object(), _jvm=jvm))


@pytest.fixture(autouse=True)
def no_callback_server(monkeypatch: pytest.MonkeyPatch) -> None:
    import pyspark.java_gateway

    monkeypatch.setattr(pyspark.java_gateway, "ensure_callback_server_started",
                        lambda gateway: None)


def test_sigterm_asks_the_driver_and_sigint_is_ignored_by_the_jvm() -> None:
    table = FakeSignalTable()
    asked: list[str] = []
    signals = JvmSignals(spark_of(table))
    assert signals.install(asked.append)
    assert table.handlers["INT"] == SIG_IGN
    assert signals.ignored == ("INT",)
    table.handlers["TERM"].handle(None)
    assert asked == ["SIGTERM"]


def test_restore_gives_sigterm_back_and_sigint_stays_ignored() -> None:
    table = FakeSignalTable()
    signals = JvmSignals(spark_of(table))
    signals.install(lambda name: None)
    signals.restore()
    assert table.handlers == {"TERM": "Terminator", "INT": SIG_IGN}


def test_a_jvm_refusing_to_ignore_sigint_still_routes_sigterm() -> None:
    table = FakeSignalTable(refuse=frozenset({"INT"}))
    asked: list[str] = []
    signals = JvmSignals(spark_of(table))
    assert signals.install(asked.append)
    assert signals.ignored == ()
    table.handlers["TERM"].handle(None)
    assert asked == ["SIGTERM"]


def test_a_jvm_refusing_sigterm_keeps_its_own_handlers() -> None:
    table = FakeSignalTable(refuse=frozenset({"TERM"}))
    signals = JvmSignals(spark_of(table))
    assert not signals.install(lambda name: None)
    assert table.handlers == {"TERM": "Terminator", "INT": "Terminator"}
