"""``bench.bench_wake`` runs its exchanges to the end and reports a cost for each."""

from __future__ import annotations

import pytest

from bench.bench_wake import exchange_cpu_us, main


def test_an_exchange_costs_the_waiting_thread_some_cpu() -> None:
    assert exchange_cpu_us(0.0, 50) > 0


def test_main_prints_one_median_a_delay(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--delays", "0,0.001", "--seconds", "0.02", "--repeat", "2"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("answer")]
    assert [line.split(":")[0] for line in lines] == ["answer after    0.0 ms",
                                                     "answer after    1.0 ms"]
